//! Whether the agent may be sent pods: `/readyz`, the plugin's PING and the status report ask.
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use tokio::sync::watch;

use crate::{install::watch::InstallStatus, pods::PodSource};

/// The agent's readiness: the backend is open (it is, once this exists), the plugin socket
/// serves, the pod source has synced, and the plugin is chained into the CNI configuration
/// (when this agent installs it).
pub struct Readiness {
    /// Whether the plugin socket serves: the request path refuses requests while it does not.
    pub(super) serving: AtomicBool,
    source: Arc<PodSource>,
    /// Where the plugin's installation stands, when this agent installs it.
    install: Option<watch::Receiver<InstallStatus>>,
}

impl Readiness {
    /// Not serving yet; ready once serving, `source` synced and, with `install`, the plugin's
    /// entry in place.
    #[must_use]
    pub fn new(source: Arc<PodSource>, install: Option<watch::Receiver<InstallStatus>>) -> Self {
        Self {
            serving: AtomicBool::new(false),
            source,
            install,
        }
    }

    /// Marks the agent as serving (or not: shutting down).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    /// Why the agent is not ready, or `None` when it is.
    #[must_use]
    pub fn not_ready_reason(&self) -> Option<String> {
        if !self.serving.load(Ordering::Acquire) {
            return Some("the plugin socket is not serving".into());
        }
        if !self.source.is_ready() {
            return Some(format!("{} has not synced yet", self.source.describe()));
        }
        if let Some(install) = &self.install {
            let status = install.borrow();
            if !status.is_installed() {
                return Some(format!("meshcap-cni is not in place: {}", *status));
            }
        }
        None
    }
}
