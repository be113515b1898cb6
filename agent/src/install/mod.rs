//! Installing meshcap into the node's CNI set-up, as Istio's install-cni does: the plugin binary
//! into the CNI bin dir, and meshcap's entry chained last into the runtime's network
//! configuration (or a standalone file when `chained` is false), kept there by [`watch`] while
//! other components rewrite the file.
//!
//! Unlike Istio in sidecar mode, nothing is removed when the agent stops: across restarts and
//! upgrades the entry stays, so a pod created while no agent runs waits (the plugin fails closed
//! and the runtime retries) instead of starting uncaptured. Only [`uninstall`], called for a
//! real uninstall, removes it.
use std::{
    fmt, fs, io,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Value, json};

use crate::paths;

pub mod binary;
pub mod conflist;
pub mod kubeconfig;
pub mod watch;

/// The plugin's CNI `type`.
pub const PLUGIN_TYPE: &str = "meshcap-cni";

/// The plugin binary's file name in the CNI bin dir.
pub const PLUGIN_BINARY: &str = "meshcap-cni";

/// The agent binary's file name in the CNI bin dir: the plugin runs `meshcap-agent decide`
/// beside itself to decide a pod when the agent is down (docs/install.md, "Agent outage").
pub const DECIDER_BINARY: &str = "meshcap-agent";

/// The kubeconfig `meshcap-agent decide` uses, in the CNI conf dir (Istio's is
/// `ZZZ-istio-cni-kubeconfig`); not a `.conf`/`.conflist`/`.json` file, so no runtime reads it
/// as a network configuration.
pub const KUBECONFIG_FILE_NAME: &str = "meshcap-cni.kubeconfig";

/// Marks meshcap's temporary files (`.<name>.meshcap-tmp.<pid>`), so stale ones can be found.
pub const TMP_MARKER: &str = ".meshcap-tmp.";

/// The file written when `chained` is false, named like Istio's `YYY-istio-cni.conf` so that it
/// sorts after the primary CNI's file and the runtime never takes it as the pod network.
pub const STANDALONE_FILE_NAME: &str = "YYY-meshcap-cni.conf";

/// The network name in the standalone file: Istio's (`cni/pkg/install/cniconfig.go` names its
/// own `istio-cni`). Multus resolves a NetworkAttachmentDefinition without `spec.config` to the
/// file in its conf dir whose `name` is the definition's, and Istio's injector, with
/// `pilot.cni.provider=multus`, attaches pods to `default/istio-cni`: under that name meshcap's
/// file is the one found (the chart's `provider: multus` creates that definition).
pub const STANDALONE_NETWORK_NAME: &str = "istio-cni";

/// The CNI version of the standalone file (Istio's).
pub const STANDALONE_CNI_VERSION: &str = "0.3.1";

/// The Istio CNI plugin's type, whose entry must not run beside meshcap's.
const ISTIO_PLUGIN_TYPE: &str = "istio-cni";

/// The namespace of meshcap's own pods (`deploy/`): the plugin's default too.
pub const AGENT_POD_NAMESPACE: &str = meshcap_cni::cni::DEFAULT_AGENT_POD_NAMESPACE;

/// The name prefix of meshcap's own pods: the DaemonSet's name and a dash (`deploy/`), the
/// plugin's default too.
pub const AGENT_POD_PREFIX: &str = meshcap_cni::cni::DEFAULT_AGENT_POD_PREFIX;

/// What the plugin is told in its entry: the keys of `meshcap_cni::cni::PluginConfig`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginSettings {
    /// The agent's socket (`agent_socket`).
    pub agent_socket: PathBuf,
    /// Namespaces the plugin passes through without asking the agent (`exclude_namespaces`).
    pub exclude_namespaces: Vec<String>,
    /// Namespace of the agent's own pods, never sent to the agent (`agent_pod_namespace`).
    pub agent_pod_namespace: String,
    /// Name prefix of the agent's own pods (`agent_pod_prefix`).
    pub agent_pod_prefix: String,
    /// The plugin's log level: error, warn, info or debug (`log_level`).
    pub log_level: String,
    /// How long the plugin waits for the agent, whole seconds (`timeout_seconds`).
    pub timeout: Duration,
    /// With the agent unreachable, the plugin decides from the API server with this
    /// kubeconfig (`kubeconfig`)...
    pub kubeconfig: Option<PathBuf>,
    /// ...or from this manifest directory (`pod_dir`, standalone mode).
    pub pod_dir: Option<PathBuf>,
    /// The node runs ambient mode with these enablement selectors (`ambient_enabled`,
    /// `enablement_selectors`), so that the plugin decides as the agent does without it.
    pub ambient_selectors: Option<Value>,
}

impl Default for PluginSettings {
    fn default() -> Self {
        Self {
            agent_socket: PathBuf::from(paths::AGENT_SOCKET),
            exclude_namespaces: vec!["kube-system".to_owned()],
            agent_pod_namespace: AGENT_POD_NAMESPACE.to_owned(),
            agent_pod_prefix: AGENT_POD_PREFIX.to_owned(),
            log_level: "info".to_owned(),
            timeout: Duration::from_secs(meshcap_cni::cni::DEFAULT_TIMEOUT_SECONDS),
            kubeconfig: None,
            pod_dir: None,
            ambient_selectors: None,
        }
    }
}

impl PluginSettings {
    /// meshcap's plugin entry, as chained into the conflist.
    #[must_use]
    pub fn entry(&self) -> Value {
        let mut entry = json!({
            "type": PLUGIN_TYPE,
            "agent_socket": self.agent_socket,
            "exclude_namespaces": self.exclude_namespaces,
            "agent_pod_namespace": self.agent_pod_namespace,
            "agent_pod_prefix": self.agent_pod_prefix,
            "log_level": self.log_level,
            "timeout_seconds": self.timeout.as_secs().max(1),
        });
        if let Some(path) = &self.kubeconfig {
            entry["kubeconfig"] = json!(path);
        }
        if let Some(dir) = &self.pod_dir {
            entry["pod_dir"] = json!(dir);
        }
        if let Some(selectors) = &self.ambient_selectors {
            entry["ambient_enabled"] = json!(true);
            entry["enablement_selectors"] = selectors.clone();
        }
        entry
    }
}

/// Where and how to install. Field names follow Istio's settings of the same meaning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstallConfig {
    /// `cniBinDir`: where the plugin binary goes.
    pub cni_bin_dir: PathBuf,
    /// `cniConfDir`: the runtime's network configurations.
    pub cni_conf_dir: PathBuf,
    /// `cniConfFileName`: the file to chain into (or the standalone file's name); `None` picks
    /// the runtime's own choice (or [`STANDALONE_FILE_NAME`]).
    pub cni_conf_file_name: Option<String>,
    /// `chained`: insert into the primary CNI's list (true) or write a standalone file.
    pub chained: bool,
    /// The `meshcap-cni` binary to copy (shipped beside the agent).
    pub plugin_source: PathBuf,
    /// The agent binary to copy beside the plugin, for its decisions while the agent is down
    /// ([`DECIDER_BINARY`]); none: the plugin fails closed for every pod it cannot exclude.
    pub decider_source: Option<PathBuf>,
    /// What the plugin's kubeconfig ([`PluginSettings::kubeconfig`]) is made from.
    pub kubeconfig_source: Option<kubeconfig::Source>,
    /// The plugin's own settings.
    pub plugin: PluginSettings,
}

impl InstallConfig {
    /// The defaults (Istio's), with the plugin binary taken from `plugin_source`.
    #[must_use]
    pub fn new(plugin_source: PathBuf) -> Self {
        Self {
            cni_bin_dir: PathBuf::from(paths::CNI_BIN_DIR),
            cni_conf_dir: PathBuf::from(paths::CNI_CONF_DIR),
            cni_conf_file_name: None,
            chained: true,
            plugin_source,
            decider_source: None,
            kubeconfig_source: None,
            plugin: PluginSettings::default(),
        }
    }
}

/// Where meshcap's configuration stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfState {
    /// meshcap's entry is in place in this file (written now or already there).
    Installed {
        /// The file holding the entry.
        path: PathBuf,
        /// Whether this call wrote it.
        written: bool,
    },
    /// Chained, but the primary CNI has written no valid configuration yet: wait for it (the
    /// runtime creates no pods on this node until it has one either).
    NoPrimaryConfig,
}

impl fmt::Display for ConfState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Installed { path, .. } => write!(f, "installed in {}", path.display()),
            Self::NoPrimaryConfig => f.write_str("waiting for the primary CNI's configuration"),
        }
    }
}

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
    fn io(action: &'static str, path: &Path, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// Installs the binary and the configuration (idempotent; writes nothing that is in place).
///
/// # Errors
/// When a file cannot be read or written.
pub fn install(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let binaries = std::iter::once((&config.plugin_source, PLUGIN_BINARY))
        .chain(config.decider_source.iter().map(|s| (s, DECIDER_BINARY)));
    for (source, name) in binaries {
        if binary::install(source, &config.cni_bin_dir, name)? == binary::Copied::Written {
            tracing::info!(dir = %config.cni_bin_dir.display(), "installed the {name} binary");
        }
    }
    if let (Some(source), Some(path)) = (&config.kubeconfig_source, &config.plugin.kubeconfig)
        && kubeconfig::ensure(source, path)?
    {
        tracing::info!(file = %path.display(), "wrote the plugin's kubeconfig");
    }
    ensure_conf(config)
}

/// Puts meshcap's configuration in place, if it is not already.
///
/// # Errors
/// When a file cannot be read or written.
pub fn ensure_conf(config: &InstallConfig) -> Result<ConfState, InstallError> {
    if config.chained {
        ensure_chained(config)
    } else {
        ensure_standalone(config)
    }
}

fn ensure_chained(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let dir = &config.cni_conf_dir;
    let files = conflist::read_dir(dir)?;
    let configured = config.cni_conf_file_name.as_deref();
    let Some(current) = conflist::primary(&files, configured) else {
        if let Some((name, bytes)) =
            configured.and_then(|wanted| files.iter().find(|(name, _)| name == wanted))
            && let Some(reason) = conflist::invalid_reason(name, bytes)
        {
            return Err(InstallError::InvalidConfigured {
                path: dir.join(name),
                reason,
            });
        }
        return Ok(ConfState::NoPrimaryConfig);
    };
    let plugins = current.value.get("plugins").and_then(Value::as_array);
    if plugins.is_some_and(|p| {
        p.iter()
            .any(|p| p.get("type").and_then(Value::as_str) == Some(ISTIO_PLUGIN_TYPE))
    }) {
        tracing::warn!(
            file = %dir.join(&current.name).display(),
            "the istio-cni plugin is chained too: uninstall istio-cni (docs/install.md), or both \
             will program each pod"
        );
    }
    let wanted = conflist::with_entry(&current, &config.plugin.entry());
    let path = dir.join(&wanted.name);
    if wanted == current {
        return Ok(ConfState::Installed {
            path,
            written: false,
        });
    }
    let old_path = dir.join(&current.name);
    let mode = file_mode(&old_path)?;
    conflist::write_atomic(&path, &conflist::render(&wanted.value), mode)?;
    if wanted.name != current.name {
        // A lone .conf became a .conflist: the .conf would otherwise sort first and win.
        remove_file(&old_path)?;
    }
    tracing::info!(file = %path.display(), "chained {PLUGIN_TYPE} into the CNI configuration");
    Ok(ConfState::Installed {
        path,
        written: true,
    })
}

fn ensure_standalone(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let path = config.cni_conf_dir.join(standalone_name(config));
    let wanted = conflist::standalone(&config.plugin.entry(), STANDALONE_CNI_VERSION);
    let current: Option<Value> = fs::read(&path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    if current.as_ref() == Some(&wanted) {
        return Ok(ConfState::Installed {
            path,
            written: false,
        });
    }
    fs::create_dir_all(&config.cni_conf_dir)
        .map_err(|e| InstallError::io("creating", &config.cni_conf_dir, e))?;
    conflist::write_atomic(&path, &conflist::render(&wanted), 0o644)?;
    tracing::info!(file = %path.display(), "wrote the standalone {PLUGIN_TYPE} configuration");
    Ok(ConfState::Installed {
        path,
        written: true,
    })
}

fn standalone_name(config: &InstallConfig) -> &str {
    config
        .cni_conf_file_name
        .as_deref()
        .unwrap_or(STANDALONE_FILE_NAME)
}

/// A real uninstall: removes meshcap's entry from every configuration in the conf dir (or its
/// standalone file) and the plugin binary. Never call this on a restart or an upgrade: pods
/// created before the next agent runs would start uncaptured.
///
/// # Errors
/// When a file cannot be read, written or removed.
pub fn uninstall(config: &InstallConfig) -> Result<(), InstallError> {
    let dir = &config.cni_conf_dir;
    if config.chained {
        for (name, bytes) in conflist::read_dir(dir)? {
            let Ok(value) = serde_json::from_slice(&bytes) else {
                continue;
            };
            let conf = conflist::ConfFile { name, value };
            if let Some(cleaned) = conflist::without_entry(&conf) {
                let path = dir.join(&cleaned.name);
                conflist::write_atomic(
                    &path,
                    &conflist::render(&cleaned.value),
                    file_mode(&path)?,
                )?;
                tracing::info!(file = %path.display(), "removed {PLUGIN_TYPE} from the CNI configuration");
            }
        }
    } else {
        remove_file(&dir.join(standalone_name(config)))?;
    }
    remove_file(&config.cni_conf_dir.join(KUBECONFIG_FILE_NAME))?;
    binary::remove(&config.cni_bin_dir, DECIDER_BINARY)?;
    binary::remove(&config.cni_bin_dir, PLUGIN_BINARY)
}

fn file_mode(path: &Path) -> Result<u32, InstallError> {
    fs::metadata(path)
        .map(|m| m.permissions().mode() & 0o7777)
        .map_err(|e| InstallError::io("reading the mode of", path, e))
}

fn remove_file(path: &Path) -> Result<(), InstallError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(InstallError::io("removing", path, e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_reads_the_entry_as_written() {
        let settings = PluginSettings {
            exclude_namespaces: vec!["kube-system".to_owned(), "istio-system".to_owned()],
            log_level: "debug".to_owned(),
            timeout: Duration::from_secs(7),
            ..PluginSettings::default()
        };
        // The runtime hands each plugin of a list its entry plus the list's name and version.
        let mut conf = settings.entry();
        conf["cniVersion"] = "1.0.0".into();
        conf["name"] = "k8s-pod-network".into();
        let bytes = serde_json::to_vec(&conf).expect("JSON");
        let parsed = meshcap_cni::cni::NetConf::parse(&bytes).expect("the plugin accepts it");
        let plugin = parsed.meshcap;
        assert_eq!(plugin.agent_socket, settings.agent_socket);
        assert_eq!(plugin.exclude_namespaces, settings.exclude_namespaces);
        assert_eq!(plugin.agent_pod_namespace, AGENT_POD_NAMESPACE);
        assert_eq!(plugin.agent_pod_prefix, AGENT_POD_PREFIX);
        assert_eq!(plugin.timeout(), Duration::from_secs(7));
        assert_eq!(
            paths::AGENT_SOCKET,
            meshcap_cni::cni::DEFAULT_AGENT_SOCKET,
            "the plugin's default socket is the agent's"
        );
    }
}
