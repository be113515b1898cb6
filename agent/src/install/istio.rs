//! Taking a node's CNI configuration over from istio-cni without a window, and telling when its
//! agent fights back.
//!
//! istio-cni's agent (istio/istio 86c9f01, `cni/pkg/install/install.go`) chains its entry
//! (type `istio-cni`) into the first valid file of the conf dir and, while it runs, re-checks
//! that file on any change of the directory (`sleepWatchInstall`, `checkValidCNIConfig`): an
//! entry missing from *its* file is put back. Another file sorting before its file is only
//! warned about ("preempted"): once it has chosen its file (`cfg.CNIConfName` is set at its
//! first install) it never writes into another one. When it leaves for good
//! (`cni/pkg/nodeagent/server.go`, `ShouldStopCleanup` false: its DaemonSet deleted, or its
//! node affinity no longer matching the node) `Installer.Cleanup` removes its entry from that
//! same file, or the file itself with `istioOwnedCNIConfig`.
//!
//! So meshcap never edits the file istio-cni's entry is in while that entry is there. Its entry
//! goes into meshcap's own file ([`super::owned`], Istio's `02-istio-cni.conflist` by default)
//! holding the primary's plugins without istio-cni's entry and with meshcap's: one rename, and
//! the runtime, which uses the first valid file, goes from the primary's plugins with
//! istio-cni's to the same with meshcap's. A pod created meanwhile has run through one of the
//! two, never both and never neither. istio-cni's running agent sees its own file unchanged and
//! does not write. When its clean-up takes its entry out, the primary's file is ordinary again:
//! meshcap chains itself into it, then removes its own file (the runtime uses its own file
//! until then, [`super::ensure_conf`]). An agent that leaves without the clean-up (an upgrade
//! or a reboot, as Istio tells) leaves its entry, and meshcap's own file stays in front of it.
//!
//! An istio-cni agent that starts on the node after the takeover chooses the first valid file,
//! meshcap's, and inserts its entry there: that, or its entry back in any file meshcap's entry
//! is in, is [`contest`]: the agent is not ready (the watcher says why) while it goes on.
use std::{fs, path::Path};

use serde_json::Value;

use super::conflist;
pub use super::conflist::{ISTIO_PLUGIN_TYPE as PLUGIN_TYPE, is_istio_entry as is_entry};

/// Whether a configuration (a list, or istio-cni's standalone single plugin) holds istio-cni's
/// entry.
#[must_use]
pub fn holds_entry(conf: &Value) -> bool {
    match conf.get("plugins").and_then(Value::as_array) {
        Some(plugins) => plugins.iter().any(is_entry),
        None => is_entry(conf),
    }
}

/// The first file of the CNI configuration directory `dir` holding istio-cni's entry: its agent
/// runs on the node, or did and left its entry for its next start.
///
/// # Errors
/// When the directory cannot be read.
pub fn entry_file(dir: &Path) -> Result<Option<String>, super::InstallError> {
    Ok(conflist::read_dir(dir)?
        .into_iter()
        .find(|(_, bytes)| {
            serde_json::from_slice::<Value>(bytes).is_ok_and(|conf| holds_entry(&conf))
        })
        .map(|(name, _)| name))
}

fn holds_meshcap(conf: &Value) -> bool {
    conf.get("plugins")
        .and_then(Value::as_array)
        .is_some_and(|plugins| plugins.iter().any(conflist::is_meshcap_entry))
}

/// Evidence that istio-cni's agent runs on this node and writes against meshcap, in words:
/// a file of `files` holding both entries (meshcap never writes that), or `last`, the file
/// meshcap's entry was put in last, holding istio-cni's entry instead. `None` otherwise.
#[must_use]
pub fn contest(files: &[(String, Vec<u8>)], last: Option<&Path>) -> Option<String> {
    let parsed = |bytes: &[u8]| serde_json::from_slice::<Value>(bytes).ok();
    if let Some((name, _)) = files.iter().find(|(_, bytes)| {
        parsed(bytes).is_some_and(|conf| holds_entry(&conf) && holds_meshcap(&conf))
    }) {
        return Some(format!("istio-cni's entry is beside meshcap's in {name}"));
    }
    let last = last?;
    let conf = fs::read(last).ok().and_then(|bytes| parsed(&bytes))?;
    (holds_entry(&conf) && !holds_meshcap(&conf)).then(|| {
        format!(
            "istio-cni's agent replaced meshcap's entry with its own in {}",
            last.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn file(name: &str, value: &Value) -> (String, Vec<u8>) {
        (name.to_owned(), value.to_string().into_bytes())
    }

    #[test]
    fn both_entries_in_one_file_or_ours_replaced_is_a_contest() {
        let ours = json!({"name":"k","plugins":[{"type":"calico"},{"type":"meshcap-cni"}]});
        let theirs = json!({"name":"k","plugins":[{"type":"calico"},{"type":"istio-cni"}]});
        let both = json!({"name":"k","plugins":[{"type":"calico"},{"type":"meshcap-cni"},{"type":"istio-cni"}]});
        assert_eq!(
            contest(
                &[
                    file("02-istio-cni.conflist", &ours),
                    file("10-calico.conflist", &theirs)
                ],
                None
            ),
            None,
            "istio-cni's entry left in the primary's file behind meshcap's is no contest"
        );
        assert!(
            contest(&[file("02-istio-cni.conflist", &both)], None)
                .is_some_and(|why| why.contains("02-istio-cni.conflist"))
        );
        let dir = std::env::temp_dir().join(format!("meshcap-contest-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let last = dir.join("02-istio-cni.conflist");
        fs::write(&last, theirs.to_string()).expect("write");
        let replaced = contest(&[], Some(&last));
        fs::write(&last, ours.to_string()).expect("write");
        let kept = contest(&[], Some(&last));
        fs::remove_dir_all(&dir).expect("clean up");
        assert!(replaced.is_some_and(|why| why.contains("replaced")));
        assert_eq!(kept, None);
    }

    #[test]
    fn a_standalone_istio_cni_file_holds_its_entry() {
        assert!(holds_entry(
            &json!({"cniVersion":"0.3.1","name":"istio-cni","type":"istio-cni"})
        ));
        assert!(!holds_entry(
            &json!({"name":"k","plugins":[{"type":"calico"}]})
        ));
    }
}
