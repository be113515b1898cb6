//! Installing meshcap into the node's CNI set-up, as Istio's install-cni does: the plugin binary
//! into the CNI bin dir, and meshcap's entry chained last into the runtime's network
//! configuration (or a standalone file when `chained` is false, or, with `istioOwnedCNIConfig`,
//! a file of meshcap's own that merges the primary's: [`owned`]), kept there by [`watch`] while
//! other components rewrite the files. istio-cni's entry, where it is found, is replaced in one
//! rename, never run beside meshcap's ([`istio`]).
//!
//! The files meshcap owns in the conf dir (the standalone file, the owned file, the plugin's
//! kubeconfig) are written 0600 (0640 for the first two with Istio's `CNI_CONF_GROUP_READ`), as
//! Istio's since 1.30; a primary's file meshcap chains into keeps the mode it has.
//!
//! Unlike Istio in sidecar mode, nothing is removed when the agent stops: across restarts and
//! upgrades the entry stays, so a pod created while no agent runs waits (the plugin fails closed
//! and the runtime retries) instead of starting uncaptured. Only [`uninstall`], called for a
//! real uninstall, removes it.
use std::{
    fmt, fs, io,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use serde_json::Value;

pub use self::error::{InstallError, InstallFailure, Step};
use crate::paths;

pub mod binary;
pub mod conflist;
mod error;
pub mod istio;
pub mod kubeconfig;
pub mod owned;
pub mod watch;

pub use meshcap_cni::cni::PluginSettings;

/// The plugin's CNI `type`.
pub const PLUGIN_TYPE: &str = meshcap_cni::cni::PLUGIN_TYPE;

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

/// The file `istioOwnedCNIConfig` writes when `istioOwnedCNIConfigFileName` is empty: Istio's
/// name (`cni/pkg/constants`), so that meshcap takes over a file istio-cni left rather than
/// sorting behind it.
pub const OWNED_FILE_NAME: &str = "02-istio-cni.conflist";

/// The mode of the CNI configuration files meshcap owns: Istio's since 1.30 (CIS Kubernetes
/// benchmark; the runtime reads them as root).
pub const CONF_MODE: u32 = 0o600;

/// The same with Istio's `CNI_CONF_GROUP_READ`.
pub const CONF_MODE_GROUP_READ: u32 = 0o640;

/// The namespace of meshcap's own pods (`deploy/`): the plugin's default too.
pub const AGENT_POD_NAMESPACE: &str = meshcap_cni::cni::DEFAULT_AGENT_POD_NAMESPACE;

/// The name prefix of meshcap's own pods: the DaemonSet's name and a dash (`deploy/`), the
/// plugin's default too.
pub const AGENT_POD_PREFIX: &str = meshcap_cni::cni::DEFAULT_AGENT_POD_PREFIX;

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
    /// `istioOwnedCNIConfig`: chained, write [`Self::owned_file_name`] merging the primary's
    /// configuration with meshcap's entry instead of editing the primary's file.
    pub owned: bool,
    /// `istioOwnedCNIConfigFileName` ([`OWNED_FILE_NAME`] when unset), known even while
    /// `owned` is off, so that the file left from when it was on is found and removed.
    pub owned_file_name: String,
    /// The mode of the standalone and owned files ([`CONF_MODE`] or [`CONF_MODE_GROUP_READ`]).
    pub conf_mode: u32,
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
            owned: false,
            owned_file_name: OWNED_FILE_NAME.to_owned(),
            conf_mode: CONF_MODE,
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
    /// meshcap's own file ([`InstallConfig::owned`]) is written, but a valid file sorts before
    /// it: the runtime uses that one, without meshcap.
    Preempted {
        /// meshcap's file.
        path: PathBuf,
        /// The file the runtime uses instead.
        first: String,
    },
}

impl fmt::Display for ConfState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Installed { path, .. } => write!(f, "installed in {}", path.display()),
            Self::NoPrimaryConfig => f.write_str("waiting for the primary CNI's configuration"),
            Self::Preempted { path, first } => write!(
                f,
                "{} is written, but the runtime uses {first}, which sorts before it: name \
                 istioOwnedCNIConfigFileName to sort first",
                path.display()
            ),
        }
    }
}

/// Installs the binary and the configuration (idempotent; writes nothing that is in place).
///
/// # Errors
/// When a file cannot be read or written: the step that failed, and why.
pub fn install(config: &InstallConfig) -> Result<ConfState, InstallFailure> {
    let at = |step| move |source| InstallFailure { step, source };
    let binaries = std::iter::once((&config.plugin_source, PLUGIN_BINARY))
        .chain(config.decider_source.iter().map(|s| (s, DECIDER_BINARY)));
    for (source, name) in binaries {
        if binary::install(source, &config.cni_bin_dir, name).map_err(at(Step::Binaries))?
            == binary::Copied::Written
        {
            tracing::info!(dir = %config.cni_bin_dir.display(), "installed the {name} binary");
        }
    }
    if let (Some(source), Some(path)) = (&config.kubeconfig_source, &config.plugin.kubeconfig)
        && kubeconfig::ensure(source, path).map_err(at(Step::Kubeconfig))?
    {
        tracing::info!(file = %path.display(), "wrote the plugin's kubeconfig");
    }
    ensure_conf(config).map_err(at(Step::Conf))
}

/// Puts meshcap's configuration in place, if it is not already.
///
/// # Errors
/// When a file cannot be read or written.
pub fn ensure_conf(config: &InstallConfig) -> Result<ConfState, InstallError> {
    match (config.chained, config.owned) {
        (false, _) => ensure_standalone(config),
        (true, true) => owned::ensure(config),
        (true, false) => ensure_chained(config),
    }
}

fn ensure_chained(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let dir = &config.cni_conf_dir;
    let mut files = conflist::read_dir(dir)?;
    // meshcap's own file from when istioOwnedCNIConfig was on: not the primary's, and removed
    // once the primary's holds the entry (until then it keeps pods waiting for meshcap).
    let leftover = owned::own_file(config, &files);
    files.retain(|(name, _)| Some(name) != leftover.as_ref());
    let configured = config.cni_conf_file_name.as_deref();
    let Some(current) = conflist::primary(&files, configured) else {
        return no_primary(dir, &files, configured);
    };
    if istio::holds_entry(&current.value) {
        // Not this file while istio-cni's entry is in it: meshcap's own file, in front of it,
        // replaces that entry in one rename (`istio`).
        return owned::ensure(config);
    }
    let wanted = conflist::with_entry(&current, &config.plugin.entry());
    let path = dir.join(&wanted.name);
    let written = wanted != current;
    if written {
        let old_path = dir.join(&current.name);
        let mode = file_mode(&old_path)?;
        conflist::write_atomic(&path, &conflist::render(&wanted.value), mode)?;
        if wanted.name != current.name {
            // A lone .conf became a .conflist: the .conf would otherwise sort first and win.
            remove_file(&old_path)?;
        }
        tracing::info!(file = %path.display(), "chained {PLUGIN_TYPE} into the CNI configuration");
    }
    if let Some(name) = leftover {
        remove_file(&dir.join(&name))?;
        tracing::info!(
            file = %dir.join(&name).display(),
            "istioOwnedCNIConfig is off: removed meshcap's own file, the primary's holds the entry"
        );
    }
    Ok(ConfState::Installed { path, written })
}

/// No usable primary configuration among `files`: an error when the configured one is there
/// but invalid, else a wait for the primary CNI.
fn no_primary(
    dir: &Path,
    files: &[(String, Vec<u8>)],
    configured: Option<&str>,
) -> Result<ConfState, InstallError> {
    if let Some((name, bytes)) =
        configured.and_then(|wanted| files.iter().find(|(name, _)| name == wanted))
        && let Some(reason) = conflist::invalid_reason(name, bytes)
    {
        return Err(InstallError::InvalidConfigured {
            path: dir.join(name),
            reason,
        });
    }
    Ok(ConfState::NoPrimaryConfig)
}

fn ensure_standalone(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let path = config.cni_conf_dir.join(standalone_name(config));
    let wanted = conflist::standalone(&config.plugin.entry(), STANDALONE_CNI_VERSION);
    fs::create_dir_all(&config.cni_conf_dir)
        .map_err(|e| InstallError::io("creating", &config.cni_conf_dir, e))?;
    let written = write_own(&path, &wanted, config.conf_mode)?;
    if written {
        tracing::info!(file = %path.display(), "wrote the standalone {PLUGIN_TYPE} configuration");
    }
    Ok(ConfState::Installed { path, written })
}

/// Puts a file meshcap owns in place with `wanted` as its content and `mode` as its mode:
/// rewritten (atomically) when its content differs, only given `mode` when that alone differs
/// (a file an earlier meshcap wrote 0644). Whether it was rewritten.
fn write_own(path: &Path, wanted: &Value, mode: u32) -> Result<bool, InstallError> {
    let current: Option<Value> = fs::read(path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    if current.as_ref() != Some(wanted) {
        conflist::write_atomic(path, &conflist::render(wanted), mode)?;
        return Ok(true);
    }
    if file_mode(path)? != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(|e| InstallError::io("setting the mode of", path, e))?;
        tracing::info!(file = %path.display(), mode = format!("{mode:o}"), "mode set");
    }
    Ok(false)
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
        let files = conflist::read_dir(dir)?;
        // meshcap's own file goes whole (without the entry it would be a stale copy of the
        // primary's configuration that the runtime keeps using), and last: until then it stays
        // in front of a file whose entry is being taken out, so that the runtime goes from
        // meshcap's chain to what is behind it (istio-cni's, say) in one step.
        let own = owned::own_file(config, &files);
        for (name, bytes) in files {
            if Some(&name) == own.as_ref() {
                continue;
            }
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
        if let Some(name) = own {
            remove_file(&dir.join(&name))?;
            tracing::info!(file = %dir.join(&name).display(), "removed meshcap's own CNI configuration");
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
