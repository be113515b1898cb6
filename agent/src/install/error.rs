//! What goes wrong installing meshcap: the error of each file operation, and the step of the
//! installation it stopped.
use std::{
    io,
    path::{Path, PathBuf},
};

/// Errors of the install module; each names the file and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done (`writing`, `reading`, ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The configured file exists but the runtime would not accept it.
    #[error("cniConfFileName {}: {reason}", path.display())]
    InvalidConfigured {
        /// The file.
        path: PathBuf,
        /// Why libcni would refuse it.
        reason: String,
    },
    /// The agent's kubeconfig, from which the plugin's is made, does not parse.
    #[error("the kubeconfig {}: {reason}", path.display())]
    InvalidKubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Watching the directories failed.
    #[error("watching {}: {source}", path.display())]
    Watch {
        /// The directory.
        path: PathBuf,
        /// The watcher's error.
        #[source]
        source: notify::Error,
    },
}

impl InstallError {
    pub(super) fn io(action: &'static str, path: &Path, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// The steps of an installation, in the order [`super::install`] takes them: Istio's installer counts
/// a failure by the step that failed (`cni/pkg/install/install.go`, `installAll`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Copying the plugin's (and the decider's) binary into the CNI bin dir.
    Binaries,
    /// Writing the plugin's kubeconfig.
    Kubeconfig,
    /// Putting meshcap's entry into the CNI configuration.
    Conf,
}

impl Step {
    /// `istio_cni_installs_total`'s `result` for a failure of this step
    /// (`cni/pkg/install/monitoring.go`).
    #[must_use]
    pub const fn istio_result(self) -> &'static str {
        match self {
            Self::Binaries => "COPY_BINARIES_FAILURE",
            Self::Kubeconfig => "CREATE_KUBECONFIG_FAILURE",
            Self::Conf => "CREATE_CNI_CONFIG_FAILURE",
        }
    }
}

/// An installation that failed, and at which step.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct InstallFailure {
    /// The step that failed.
    pub step: Step,
    /// Why.
    #[source]
    pub source: InstallError,
}
