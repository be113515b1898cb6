//! `istioOwnedCNIConfig` (Istio 1.27, `cni/pkg/install/cniconfig.go` and `install.go` at
//! istio/istio 86c9f01): chained, meshcap writes a file of its own
//! ([`super::InstallConfig::owned_file_name`], Istio's `02-istio-cni.conflist` by default) that
//! holds the primary CNI's configuration with meshcap's entry last, and leaves the primary's
//! file alone. The runtime uses the first valid file by name, so the owned file must sort before
//! the primary's; a primary that rewrites its own file (at a node's reboot, before the agent is
//! back) then cannot drop meshcap: pods keep going through meshcap's plugin, which fails closed
//! while the agent is away instead of letting them start uncaptured.
//!
//! As Istio: the primary is `cniConfFileName`, else the first valid file other than the owned
//! one; the owned file is rewritten whenever it is not that file's configuration plus the entry
//! (Istio compares only the plugins' types, so a primary's changed settings were not followed;
//! meshcap follows every change); while no primary configuration exists the owned file stays as
//! it is; an uninstall removes it whole. Unlike Istio, a valid file sorting before the owned one
//! (which the runtime uses instead) leaves the agent not ready, naming it: Istio only warns.
//! Unlike Istio too, it applies in sidecar mode as well as ambient mode (docs/install.md says
//! why); with `chained: false` it has no effect (the standalone file is meshcap's own already).
use super::{ConfState, InstallConfig, InstallError, conflist, no_primary};

/// Puts meshcap's own file in place (see the module documentation).
///
/// # Errors
/// When a file cannot be read or written, or `cniConfFileName` names the owned file itself.
pub(super) fn ensure(config: &InstallConfig) -> Result<ConfState, InstallError> {
    let dir = &config.cni_conf_dir;
    let name = file_name(config);
    let path = dir.join(&name);
    let configured = config.cni_conf_file_name.as_deref();
    if configured.is_some_and(|c| conflist::list_name(c) == name) {
        return Err(InstallError::InvalidConfigured {
            path,
            reason: "it is istioOwnedCNIConfigFileName too: meshcap's own file cannot be the \
                     primary CNI's"
                .to_owned(),
        });
    }
    let mut files = conflist::read_dir(dir)?;
    files.retain(|(file, _)| *file != name);
    let Some(primary) = conflist::primary(&files, configured) else {
        // The owned file stays as it is: pods keep waiting for meshcap meanwhile.
        return no_primary(dir, &files, configured);
    };
    let wanted = conflist::with_entry(&primary, &config.plugin.entry());
    let written = super::write_own(&path, &wanted.value, config.conf_mode)?;
    if written {
        tracing::info!(
            file = %path.display(),
            primary = %primary.name,
            "wrote meshcap's own CNI configuration: the primary's with {}", super::PLUGIN_TYPE
        );
    }
    if let Some(first) = preempting(&files, &name) {
        return Ok(ConfState::Preempted { path, first });
    }
    Ok(ConfState::Installed { path, written })
}

/// The owned file's name: a `.conflist` (a name ending otherwise gets its stem with that
/// extension, as Istio renames a `.conf` it wrote).
fn file_name(config: &InstallConfig) -> String {
    conflist::list_name(&config.owned_file_name)
}

/// The owned file among `files`, when it holds meshcap's entry (meshcap wrote it): what an
/// uninstall removes whole, and what is removed once `istioOwnedCNIConfig` is off and the
/// primary's file holds the entry. A file of that name without meshcap's entry (istio-cni's)
/// is not meshcap's to remove.
#[must_use]
pub fn own_file(config: &InstallConfig, files: &[(String, Vec<u8>)]) -> Option<String> {
    let name = file_name(config);
    let (_, bytes) = files.iter().find(|(file, _)| *file == name)?;
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let plugins = value.get("plugins")?.as_array()?;
    plugins
        .iter()
        .any(conflist::is_meshcap_entry)
        .then_some(name)
}

/// The first valid file of `others` (sorted, as the runtime sorts them) that sorts before
/// `ours`: the runtime would use it instead.
fn preempting(others: &[(String, Vec<u8>)], ours: &str) -> Option<String> {
    others
        .iter()
        .take_while(|(name, _)| name.as_str() < ours)
        .find(|(name, bytes)| conflist::invalid_reason(name, bytes).is_none())
        .map(|(name, _)| name.clone())
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::PermissionsExt as _};

    use serde_json::{Value, json};

    use super::*;
    use crate::install::{self, CONF_MODE_GROUP_READ, PluginSettings};

    fn config(dir: &std::path::Path) -> InstallConfig {
        InstallConfig {
            cni_conf_dir: dir.to_owned(),
            cni_bin_dir: dir.join("bin"),
            owned: true,
            ..InstallConfig::new("/nonexistent/meshcap-cni".into())
        }
    }

    fn write(dir: &std::path::Path, name: &str, value: &Value) {
        fs::write(dir.join(name), value.to_string()).expect("write");
    }

    fn read(path: &std::path::Path) -> Value {
        serde_json::from_slice(&fs::read(path).expect("read")).expect("JSON")
    }

    fn mode(path: &std::path::Path) -> u32 {
        fs::metadata(path).expect("stat").permissions().mode() & 0o7777
    }

    #[test]
    fn the_owned_file_merges_the_primarys_and_follows_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let primary = json!({"cniVersion": "1.0.0", "name": "k8s-pod-network",
                             "plugins": [{"type": "calico"}, {"type": "portmap"}]});
        write(dir.path(), "10-calico.conflist", &primary);
        fs::set_permissions(
            dir.path().join("10-calico.conflist"),
            fs::Permissions::from_mode(0o644),
        )
        .expect("chmod");
        let config = config(dir.path());
        let state = install::ensure_conf(&config).expect("installed");
        let owned = dir.path().join(install::OWNED_FILE_NAME);
        assert_eq!(
            state,
            ConfState::Installed {
                path: owned.clone(),
                written: true
            }
        );
        let merged = read(&owned);
        assert_eq!(merged["name"], "k8s-pod-network");
        assert_eq!(merged["cniVersion"], "1.0.0");
        assert_eq!(
            merged["plugins"],
            json!([{"type": "calico"}, {"type": "portmap"}, PluginSettings::default().entry()])
        );
        assert_eq!(mode(&owned), 0o600);
        assert_eq!(
            read(&dir.path().join("10-calico.conflist")),
            primary,
            "the primary's file is left alone"
        );
        assert_eq!(mode(&dir.path().join("10-calico.conflist")), 0o644);
        assert_eq!(
            install::ensure_conf(&config).expect("again"),
            ConfState::Installed {
                path: owned.clone(),
                written: false
            }
        );
        // The primary changes a setting: followed (Istio compares only the plugins' types).
        let changed = json!({"cniVersion": "1.0.0", "name": "k8s-pod-network",
                             "plugins": [{"type": "calico", "mtu": 1400}, {"type": "portmap"}]});
        write(dir.path(), "10-calico.conflist", &changed);
        assert!(matches!(
            install::ensure_conf(&config).expect("followed"),
            ConfState::Installed { written: true, .. }
        ));
        assert_eq!(read(&owned)["plugins"][0]["mtu"], 1400);
        // The primary's file gone: the owned file stays, pods keep going through meshcap.
        fs::remove_file(dir.path().join("10-calico.conflist")).expect("rm");
        assert_eq!(
            install::ensure_conf(&config).expect("waits"),
            ConfState::NoPrimaryConfig
        );
        assert!(owned.exists());
    }

    #[test]
    fn a_file_sorting_before_the_owned_one_leaves_it_preempted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let list = json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "x"}]});
        write(dir.path(), "01-first.conflist", &list);
        write(dir.path(), "00-broken.conflist", &json!({"name": "b"}));
        let config = config(dir.path());
        let state = install::ensure_conf(&config).expect("state");
        assert_eq!(
            state,
            ConfState::Preempted {
                path: dir.path().join(install::OWNED_FILE_NAME),
                first: "01-first.conflist".to_owned()
            }
        );
        assert!(!state.to_string().is_empty());
        // Named to sort first: in place. An invalid file before it does not count.
        let config = InstallConfig {
            owned_file_name: "000-meshcap.conf".to_owned(),
            ..config
        };
        assert_eq!(
            install::ensure_conf(&config).expect("state"),
            ConfState::Installed {
                path: dir.path().join("000-meshcap.conflist"),
                written: true
            }
        );
        let refused = InstallConfig {
            cni_conf_file_name: Some("000-meshcap.conflist".to_owned()),
            ..config
        };
        assert!(matches!(
            install::ensure_conf(&refused),
            Err(InstallError::InvalidConfigured { .. })
        ));
    }

    #[test]
    fn switched_off_the_primarys_file_gets_the_entry_then_the_owned_file_goes() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "10-bridge.conf",
            &json!({"cniVersion": "0.4.0", "name": "b", "type": "bridge"}),
        );
        let on = InstallConfig {
            conf_mode: CONF_MODE_GROUP_READ,
            ..config(dir.path())
        };
        install::ensure_conf(&on).expect("on");
        let owned = dir.path().join(install::OWNED_FILE_NAME);
        assert_eq!(mode(&owned), 0o640, "CNI_CONF_GROUP_READ");
        assert!(
            dir.path().join("10-bridge.conf").exists(),
            "a lone .conf stays as it is"
        );
        let off = InstallConfig { owned: false, ..on };
        let state = install::ensure_conf(&off).expect("off");
        let chained = dir.path().join("10-bridge.conflist");
        assert_eq!(
            state,
            ConfState::Installed {
                path: chained.clone(),
                written: true
            }
        );
        assert!(!owned.exists(), "meshcap's own file removed");
        assert_eq!(read(&chained)["plugins"][1]["type"], "meshcap-cni");
        // istio-cni's file of the same name is not meshcap's to remove.
        let istio = json!({"cniVersion": "0.3.1", "name": "k8s-pod-network",
                           "plugins": [{"type": "bridge"}, {"type": "istio-cni"}]});
        write(dir.path(), install::OWNED_FILE_NAME, &istio);
        let files = conflist::read_dir(dir.path()).expect("read");
        assert_eq!(own_file(&off, &files), None);
    }

    #[test]
    fn an_uninstall_removes_the_owned_file_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let primary = json!({"cniVersion": "1.0.0", "name": "k", "plugins": [{"type": "x"}]});
        write(dir.path(), "10-x.conflist", &primary);
        let config = config(dir.path());
        install::ensure_conf(&config).expect("installed");
        install::uninstall(&config).expect("uninstalled");
        assert!(!dir.path().join(install::OWNED_FILE_NAME).exists());
        assert_eq!(read(&dir.path().join("10-x.conflist")), primary);
    }
}
