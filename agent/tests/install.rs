//! The install module against real files: golden conf dirs (`testdata/install/<case>/pre` →
//! `expected`) shaped like what Calico, Cilium, flannel and kind write, idempotence, uninstall,
//! and the watcher re-inserting meshcap while the "primary CNI" rewrites its file.
//!
//! `MESHCAP_BLESS=1 cargo test -p meshcap-agent --test install` rewrites the expected files;
//! review the diff before committing it.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use meshcap_agent::install::{
    self, ConfState, InstallConfig, PLUGIN_BINARY, Step,
    watch::{self, InstallStatus, Pass},
};
use serde_json::Value;
use tempfile::TempDir;

const PLUGIN_BYTES: &[u8] = b"#!/bin/sh\n# stand-in for the meshcap-cni binary\n";

/// A node's CNI directories in a tempdir, with a plugin binary to install.
struct Node {
    _root: TempDir,
    config: InstallConfig,
}

impl Node {
    fn new(pre: Option<&Path>) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let source = root.path().join("meshcap-cni.src");
        fs::write(&source, PLUGIN_BYTES).expect("plugin source");
        let mut config = InstallConfig::new(source);
        config.cni_bin_dir = root.path().join("opt/cni/bin");
        config.cni_conf_dir = root.path().join("etc/cni/net.d");
        fs::create_dir_all(&config.cni_conf_dir).expect("conf dir");
        if let Some(pre) = pre {
            for entry in fs::read_dir(pre).expect("pre dir") {
                let entry = entry.expect("pre entry");
                fs::copy(entry.path(), config.cni_conf_dir.join(entry.file_name()))
                    .expect("copying a pre file");
            }
        }
        Self {
            _root: root,
            config,
        }
    }

    fn conf_dir(&self) -> &Path {
        &self.config.cni_conf_dir
    }

    fn files(&self) -> Vec<(String, Vec<u8>)> {
        dir_files(self.conf_dir())
    }

    fn plugin_types(&self, name: &str) -> Vec<String> {
        let value: Value =
            serde_json::from_slice(&fs::read(self.conf_dir().join(name)).expect("conf file"))
                .expect("JSON");
        value["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .map(|p| p["type"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

fn dir_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| {
                    let e = e.expect("entry");
                    let name = e.file_name().into_string().expect("UTF-8 name");
                    (name, fs::read(e.path()).expect("reading"))
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

fn case_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/testdata/install")
        .join(name)
}

/// Installs into a copy of `<case>/pre` (after `tweak`), compares with `<case>/expected`, then
/// checks that a second install writes nothing and that uninstalling removes every trace.
fn golden(case: &str, tweak: impl FnOnce(&mut InstallConfig)) -> Node {
    let mut node = Node::new(Some(&case_dir(case).join("pre")));
    tweak(&mut node.config);
    let first = install::install(&node.config).expect("install");
    assert!(
        matches!(first, ConfState::Installed { written: true, .. }),
        "{case}: {first:?}"
    );
    let expected_dir = case_dir(case).join("expected");
    if std::env::var_os("MESHCAP_BLESS").is_some() {
        let _ = fs::remove_dir_all(&expected_dir);
        fs::create_dir_all(&expected_dir).expect("expected dir");
        for (name, bytes) in node.files() {
            fs::write(expected_dir.join(name), bytes).expect("blessing");
        }
    }
    let expected = dir_files(&expected_dir);
    assert!(!expected.is_empty(), "{case}: no expected files");
    let got = node.files();
    for ((got_name, got_bytes), (want_name, want_bytes)) in got.iter().zip(&expected) {
        assert_eq!(got_name, want_name, "{case}: file names differ");
        assert_eq!(
            String::from_utf8_lossy(got_bytes),
            String::from_utf8_lossy(want_bytes),
            "{case}: {got_name} differs from the golden file"
        );
    }
    assert_eq!(got.len(), expected.len(), "{case}: {got:?}");
    assert_eq!(
        fs::read(node.config.cni_bin_dir.join(PLUGIN_BINARY)).expect("installed binary"),
        PLUGIN_BYTES
    );

    let again = install::install(&node.config).expect("second install");
    assert!(
        matches!(again, ConfState::Installed { written: false, .. }),
        "{case}: a second install must write nothing: {again:?}"
    );
    assert_eq!(
        node.files(),
        got,
        "{case}: the second install changed files"
    );
    node
}

fn assert_uninstalls(node: &Node) {
    install::uninstall(&node.config).expect("uninstall");
    for (name, bytes) in node.files() {
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("meshcap-cni"),
            "{name} still mentions meshcap: {text}"
        );
    }
    assert!(!node.config.cni_bin_dir.join(PLUGIN_BINARY).exists());
}

#[test]
fn calico() {
    let node = golden("calico", |_| {});
    assert_eq!(
        node.plugin_types("10-calico.conflist"),
        ["calico", "portmap", "bandwidth", "meshcap-cni"]
    );
    assert_uninstalls(&node);
}

#[test]
fn cilium() {
    let node = golden("cilium", |_| {});
    assert_eq!(
        node.plugin_types("05-cilium.conflist"),
        ["cilium-cni", "meshcap-cni"]
    );
    assert_uninstalls(&node);
}

#[test]
fn flannel() {
    let node = golden("flannel", |_| {});
    assert_eq!(
        node.plugin_types("10-flannel.conflist"),
        ["flannel", "portmap", "meshcap-cni"]
    );
    assert_uninstalls(&node);
}

#[test]
fn a_lone_conf_becomes_a_conflist_with_its_mode() {
    let pre = case_dir("flannel-conf").join("pre");
    let node = golden("flannel-conf", |config| {
        let conf = config.cni_conf_dir.join("10-flannel.conf");
        fs::set_permissions(&conf, fs::Permissions::from_mode(0o600)).expect("chmod");
    });
    assert!(pre.join("10-flannel.conf").exists());
    assert!(!node.conf_dir().join("10-flannel.conf").exists());
    let mode = fs::metadata(node.conf_dir().join("10-flannel.conflist"))
        .expect("conflist")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the original file's mode is kept");
    assert_uninstalls(&node);
}

#[test]
fn an_upgrade_replaces_the_old_entry() {
    let node = golden("upgrade", |_| {});
    assert_eq!(
        node.plugin_types("10-calico.conflist"),
        ["calico", "portmap", "meshcap-cni"]
    );
}

/// istio-cni's entry in the primary's file (`install::istio`): meshcap's own file, sorting
/// first, holds the primary's plugins with meshcap's entry in istio-cni's place, written in one
/// rename, and istio-cni's file is left to its agent; an uninstall then hands the node back as
/// istio-cni left it.
#[test]
fn istio_cnis_entry_is_replaced_in_front_of_its_file() {
    let node = golden("istio-cni", |_| {});
    assert_eq!(
        node.plugin_types("02-istio-cni.conflist"),
        ["calico", "portmap", "bandwidth", "meshcap-cni"]
    );
    let theirs = fs::read(case_dir("istio-cni").join("pre/10-calico.conflist")).expect("pre");
    assert_eq!(
        fs::read(node.conf_dir().join("10-calico.conflist")).expect("primary"),
        theirs,
        "istio-cni's file is its agent's"
    );
    assert_uninstalls(&node);
    assert_eq!(
        fs::read(node.conf_dir().join("10-calico.conflist")).expect("primary"),
        theirs,
        "handed back as istio-cni left it"
    );
    assert!(!node.conf_dir().join("02-istio-cni.conflist").exists());
}

/// istio-cni's clean-up takes its entry out of its file: meshcap chains into that file, then
/// removes its own (the runtime used its own until then).
#[test]
fn istio_cnis_clean_up_hands_its_file_over() {
    let node = golden("istio-cni", |_| {});
    let primary = node.conf_dir().join("10-calico.conflist");
    let mut value: Value =
        serde_json::from_slice(&fs::read(&primary).expect("primary")).expect("JSON");
    value["plugins"]
        .as_array_mut()
        .expect("plugins")
        .retain(|p| p["type"] != "istio-cni");
    fs::write(&primary, value.to_string()).expect("istio-cni's clean-up");
    let state = install::install(&node.config).expect("install");
    assert!(
        matches!(&state, ConfState::Installed { path, written: true } if *path == primary),
        "{state:?}"
    );
    assert_eq!(
        node.plugin_types("10-calico.conflist"),
        ["calico", "portmap", "bandwidth", "meshcap-cni"]
    );
    assert!(!node.conf_dir().join("02-istio-cni.conflist").exists());
}

#[test]
fn invalid_files_are_skipped_as_libcni_skips_them() {
    let node = golden("invalid-first", |_| {});
    assert_eq!(
        node.plugin_types("10-kindnet.conflist"),
        ["ptp", "portmap", "meshcap-cni"]
    );
}

#[test]
fn a_configured_file_name_wins_over_sort_order() {
    let node = golden("configured", |config| {
        // Istio accepts the .conf name when the runtime's file is its .conflist twin.
        config.cni_conf_file_name = Some("10-flannel.conf".to_owned());
    });
    assert_eq!(node.plugin_types("05-cilium.conflist"), ["cilium-cni"]);
}

#[test]
fn unchained_writes_a_standalone_file() {
    let node = golden("standalone", |config| config.chained = false);
    assert!(
        node.conf_dir().join(install::STANDALONE_FILE_NAME).exists(),
        "{:?}",
        node.files()
    );
    assert_uninstalls(&node);
    assert!(node.conf_dir().join("10-calico.conflist").exists());
}

#[test]
fn no_primary_config_means_waiting_not_writing() {
    let node = Node::new(None);
    assert_eq!(
        install::install(&node.config).expect("install"),
        ConfState::NoPrimaryConfig
    );
    assert!(node.files().is_empty());
}

#[test]
fn stale_temporary_copies_are_removed() {
    let node = Node::new(None);
    let bin = &node.config.cni_bin_dir;
    fs::create_dir_all(bin).expect("bin dir");
    let stale = bin.join(format!(".{PLUGIN_BINARY}{}4242", install::TMP_MARKER));
    fs::write(&stale, b"half a binary").expect("stale file");
    let other = bin.join("calico");
    fs::write(&other, b"someone else's").expect("other plugin");
    install::install(&node.config).expect("install");
    assert!(!stale.exists());
    assert!(other.exists());
    let mode = fs::metadata(bin.join(PLUGIN_BINARY))
        .expect("binary")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
}

/// Waits (bounded, generously: this is a liveness check, not a timing assertion) until the
/// watcher publishes a status for which `done` holds.
fn wait_for(
    rx: &mut tokio::sync::watch::Receiver<InstallStatus>,
    done: impl Fn(&InstallStatus) -> bool,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|s| done(s)))
            .await
            .expect("the watcher never reached the expected state")
            .expect("the watcher stopped");
    });
}

/// Waits until `check` holds on the files, re-checking on every status change and briefly
/// polling (the watcher publishes nothing when a rewrite leaves its status unchanged).
fn wait_until(node: &Node, what: &str, check: impl Fn(&Node) -> bool) {
    for _ in 0..600 {
        if check(node) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{what}: not reached within a minute; files: {:?}",
        node.files()
    );
}

#[test]
fn the_watcher_reinserts_when_the_primary_cni_rewrites_its_file() {
    let node = Node::new(Some(&case_dir("calico").join("pre")));
    let original = fs::read(case_dir("calico").join("pre/10-calico.conflist")).expect("pre");
    let (tx, mut rx) = tokio::sync::watch::channel(InstallStatus::Starting);
    let writes = Arc::new(AtomicUsize::new(0));
    let repairs = Arc::new(AtomicUsize::new(0));
    let (count, repaired) = (writes.clone(), repairs.clone());
    let watcher = watch::spawn(node.config.clone(), tx, move |pass| {
        if let Pass::Installed {
            written: true,
            repaired: repair,
            ..
        } = *pass
        {
            count.fetch_add(1, Ordering::Relaxed);
            if repair {
                repaired.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
    .expect("watcher");
    wait_for(&mut rx, InstallStatus::is_installed);
    assert_eq!(writes.load(Ordering::Relaxed), 1);
    assert_eq!(
        repairs.load(Ordering::Relaxed),
        0,
        "the first write installs: it repairs nothing"
    );
    let has_meshcap = |name: &'static str| {
        move |node: &Node| {
            node.conf_dir().join(name).exists()
                && node.plugin_types(name).last().map(String::as_str) == Some("meshcap-cni")
        }
    };
    assert!(has_meshcap("10-calico.conflist")(&node));

    // Calico's install container rewrites its file in place, without meshcap.
    fs::write(node.conf_dir().join("10-calico.conflist"), &original).expect("rewrite");
    wait_until(
        &node,
        "re-inserted after an in-place rewrite",
        has_meshcap("10-calico.conflist"),
    );

    // Cilium (cni.exclusive=false) writes its own file, which sorts first and becomes the
    // runtime's choice: meshcap must follow it there.
    let cilium = fs::read(case_dir("cilium").join("pre/05-cilium.conflist")).expect("cilium");
    let tmp = node.conf_dir().join(".05-cilium.conflist.tmp");
    fs::write(&tmp, cilium).expect("cilium tmp");
    fs::rename(&tmp, node.conf_dir().join("05-cilium.conflist")).expect("cilium rename");
    wait_until(
        &node,
        "inserted into the new first file",
        has_meshcap("05-cilium.conflist"),
    );

    // A node cleanup removes the plugin binary.
    let binary = node.config.cni_bin_dir.join(PLUGIN_BINARY);
    fs::remove_file(&binary).expect("removing the binary");
    wait_until(&node, "binary restored", |_| binary.exists());

    // Stopping the agent (restart, upgrade) leaves everything in place: pods created before
    // the next agent runs wait for it instead of starting uncaptured.
    drop(watcher);
    assert!(binary.exists());
    assert!(has_meshcap("05-cilium.conflist")(&node));
    let before = node.files();
    let (tx, mut rx) = tokio::sync::watch::channel(InstallStatus::Starting);
    let passes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = passes.clone();
    let restarted = watch::spawn(node.config.clone(), tx, move |pass| {
        seen.lock().expect("passes").push(format!("{pass:?}"));
    })
    .expect("restarted watcher");
    wait_for(&mut rx, |s| {
        matches!(
            s,
            InstallStatus::Conf(ConfState::Installed { written: false, .. })
        )
    });
    drop(restarted);
    assert_eq!(node.files(), before, "a restart rewrites nothing");
    // One installation found in place, as Istio's installer counts one at each start; no write.
    let cilium_file = node.conf_dir().join("05-cilium.conflist");
    assert_eq!(
        *passes.lock().expect("passes"),
        [format!(
            "{:?}",
            Pass::Installed {
                path: &cilium_file,
                written: false,
                repaired: false
            }
        )]
    );
    // Each re-insertion above was one write, and a repair (the counter of drift put back).
    assert!(writes.load(Ordering::Relaxed) >= 3, "{writes:?}");
    assert!(repairs.load(Ordering::Relaxed) >= 2, "{repairs:?}");
}

/// A failed installation is reported with the step that failed, as Istio's installer counts
/// it (`istio_cni_installs_total{result="COPY_BINARIES_FAILURE"}`, ...), at each attempt; once
/// the cause is gone, the next attempt installs.
#[test]
fn the_watcher_reports_the_step_that_failed() {
    let node = Node::new(Some(&case_dir("calico").join("pre")));
    let source = node.config.plugin_source.clone();
    fs::remove_file(&source).expect("the plugin binary goes");
    let (tx, mut rx) = tokio::sync::watch::channel(InstallStatus::Starting);
    let passes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = passes.clone();
    let _watcher = watch::spawn(node.config.clone(), tx, move |pass| {
        let step = match *pass {
            Pass::Failed(step) => Some(step),
            Pass::Installed { .. } => None,
        };
        seen.lock().expect("passes").push(step);
    })
    .expect("watcher");
    wait_for(&mut rx, |s| matches!(s, InstallStatus::Failed(_)));
    assert_eq!(passes.lock().expect("passes")[0], Some(Step::Binaries));
    assert_eq!(Step::Binaries.istio_result(), "COPY_BINARIES_FAILURE");
    fs::write(&source, PLUGIN_BYTES).expect("the plugin binary is back");
    // A change in the bin dir makes the watcher try again.
    fs::write(node.config.cni_bin_dir.join("poke"), b"").expect("a change");
    wait_for(&mut rx, InstallStatus::is_installed);
    assert_eq!(passes.lock().expect("passes").last(), Some(&None));
}

#[test]
fn the_watcher_waits_for_the_primary_cni() {
    let node = Node::new(None);
    let (tx, mut rx) = tokio::sync::watch::channel(InstallStatus::Starting);
    let _watcher = watch::spawn(node.config.clone(), tx, |_| {}).expect("watcher");
    wait_for(&mut rx, |s| {
        *s == InstallStatus::Conf(ConfState::NoPrimaryConfig)
    });
    fs::copy(
        case_dir("flannel-conf").join("pre/10-flannel.conf"),
        node.conf_dir().join("10-flannel.conf"),
    )
    .expect("the primary CNI's file");
    wait_for(&mut rx, InstallStatus::is_installed);
    assert_eq!(
        node.plugin_types("10-flannel.conflist"),
        ["flannel", "meshcap-cni"]
    );
}
