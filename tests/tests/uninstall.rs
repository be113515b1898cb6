//! The real uninstall (restarts and upgrades never run it): the plugin leaves the CNI set-up at
//! once, but the eBPF programs stay attached for as long as a pod they captured is alive, so
//! that no pod's traffic bypasses its sidecar; once those pods are gone a second run detaches
//! and unpins everything. By hand (`meshcap-agent uninstall`), or by the agent itself when it
//! is stopped because its DaemonSet is being deleted.
use std::{fs, path::Path, process::Command};

use meshcap_agent::backend::ebpf;
use meshcap_tests::{
    agent::{Agent, Backend, binaries},
    apiserver::ApiServer,
    fixtures::{ManifestDir, eventually, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root, unique_name,
    wired::Wired,
};
use serde_json::{Value, json};

fn uninstall(conf_dir: &Path, bin_dir: &Path, bpffs_dir: &Path) -> (bool, String) {
    let out = Command::new(binaries().join("meshcap-agent"))
        .arg("uninstall")
        .arg("--bpffs-dir")
        .arg(bpffs_dir)
        .env("MESHCAP_CNI_CONF_DIR", conf_dir)
        .env("MESHCAP_CNI_BIN_DIR", bin_dir)
        .output()
        .expect("running meshcap-agent uninstall");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn meshcap_entries(conflist: &Path) -> usize {
    let conf: Value =
        serde_json::from_slice(&fs::read(conflist).expect("conflist")).expect("JSON conflist");
    conf["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter(|p| p["type"] == "meshcap-cni")
        .count()
}

#[test]
fn uninstall_keeps_the_programs_while_a_captured_pod_lives_then_removes_everything() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let pods = ManifestDir::new();
    let cni_root = ManifestDir(std::env::temp_dir().join(unique_name("meshcap-uninstall")));
    let (conf_dir, bin_dir) = (cni_root.0.join("net.d"), cni_root.0.join("bin"));
    for dir in [&conf_dir, &bin_dir] {
        fs::create_dir_all(dir).expect("CNI dirs");
    }
    let primary = conf_dir.join("10-flannel.conflist");
    fs::write(
        &primary,
        json!({"cniVersion": "1.0.0", "name": "cbr0", "plugins": [{"type": "flannel"}]})
            .to_string(),
    )
    .expect("primary conflist");
    let mut agent = Agent::start(
        Backend::Ebpf,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            pods.0.to_str().expect("utf-8"),
        ],
        &[
            ("MESHCAP_INSTALL_CNI", "true"),
            ("MESHCAP_CNI_CONF_DIR", conf_dir.to_str().expect("utf-8")),
            ("MESHCAP_CNI_BIN_DIR", bin_dir.to_str().expect("utf-8")),
        ],
    )
    .expect("agent");
    eventually("the plugin chained into the primary conflist", || {
        meshcap_entries(&primary) == 1
    })
    .expect("installed");
    let ebpf_config = agent.ebpf_config().expect("eBPF agent");

    let wired = Wired::new(&agent);
    let servers = wired.servers();
    let name = unique_name("web");
    write_manifest(&pods.0, &sidecar_pod("shop", &name, &[]));
    let sandbox = Sandbox::new("shop", &name, &wired.pod);
    let add = cni("ADD", &sandbox, &config("1.0.0", &agent.socket, "10.0.0.2")).expect("ADD");
    assert!(add.success, "ADD failed: {add:?}");
    assert_eq!(wired.app_dial().0, "envoy", "captured");
    // The DaemonSet is gone (the agent with it); the pod lives on.
    agent.kill().expect("kill the agent");

    let (ok, out) = uninstall(&conf_dir, &bin_dir, &ebpf_config.bpffs_dir);
    assert!(!ok, "a live captured pod keeps the programs: {out}");
    assert!(
        out.contains(&format!("shop/{name}")),
        "names the pod: {out}"
    );
    assert_eq!(meshcap_entries(&primary), 0, "the plugin entry is gone");
    assert!(
        !bin_dir.join("meshcap-cni").exists(),
        "the plugin binary is gone"
    );
    assert!(ebpf_config.bpffs_dir.exists(), "the pins stay");
    assert_eq!(
        wired.app_dial().0,
        "envoy",
        "the live pod is still captured"
    );

    // The pod is restarted elsewhere: its netns goes.
    drop(servers);
    drop(wired);
    let (ok, out) = uninstall(&conf_dir, &bin_dir, &ebpf_config.bpffs_dir);
    assert!(ok, "nothing captured is left: {out}");
    assert!(!ebpf_config.bpffs_dir.exists(), "every pin removed: {out}");
    let attached: Vec<_> = ebpf::cgroup_attachments(&ebpf_config.cgroup_root)
        .expect("query the cgroup")
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(attached, Vec::new(), "every program detached");
}

/// The agent stopped (SIGTERM) while its DaemonSet is there — a rolling update, a restart, a
/// drain — keeps everything; stopped because the DaemonSet is being deleted (`kubectl delete
/// -f deploy/`), it removes meshcap from the node: new pods no longer wait for an agent that
/// will not come back.
#[test]
fn deleting_the_daemon_set_uninstalls_and_a_rolling_update_does_not() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let api = ApiServer::start();
    let daemon_set = |uid: &str, deleting: bool| {
        let mut ds = json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "meshcap-agent", "namespace": "meshcap-system", "uid": uid},
            "spec": {"selector": {"matchLabels": {"app": "meshcap-agent"}},
                     "template": {"metadata": {"labels": {"app": "meshcap-agent"}},
                                  "spec": {"containers": [{"name": "agent", "image": "meshcap"}]}}},
        });
        if deleting {
            ds["metadata"]["deletionTimestamp"] = json!("2026-11-24T00:00:00Z");
            ds["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
        }
        ds
    };
    api.pods.lock().expect("pods").push(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "meshcap-agent-x7k2p", "namespace": "meshcap-system", "uid": "pod-1",
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                          "name": "meshcap-agent", "uid": "ds-1", "controller": true}]},
        "spec": {"nodeName": "node-1", "containers": [{"name": "agent", "image": "meshcap"}]},
    }));
    api.daemon_sets
        .lock()
        .expect("daemon sets")
        .push(daemon_set("ds-1", false));
    let root = ManifestDir::new();
    let (conf_dir, bin_dir) = (root.0.join("net.d"), root.0.join("bin"));
    fs::create_dir_all(&conf_dir).expect("conf dir");
    let conflist = conf_dir.join("10-bridge.conflist");
    fs::write(
        &conflist,
        json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge"}]}).to_string(),
    )
    .expect("primary conflist");
    let kubeconfig = api.kubeconfig(&root.0);
    let plugin = binaries().join("meshcap-cni");
    let env = [
        ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ("MESHCAP_INSTALL_CNI", "true"),
        ("MESHCAP_CNI_CONF_DIR", conf_dir.to_str().expect("utf-8")),
        ("MESHCAP_CNI_BIN_DIR", bin_dir.to_str().expect("utf-8")),
        ("MESHCAP_PLUGIN_BINARY", plugin.to_str().expect("utf-8")),
        ("MESHCAP_STARTUP_TAINT", ""),
        ("MESHCAP_POD_NAMESPACE", "meshcap-system"),
        ("MESHCAP_POD_NAME", "meshcap-agent-x7k2p"),
    ];
    let mut agent = Agent::start(
        Backend::Ebpf,
        &["--pods", "kube", "--node-name", "node-1"],
        &env,
    )
    .expect("agent");
    let installed = || {
        meshcap_entries(&conflist) == 1
            && bin_dir.join("meshcap-cni").exists()
            && bin_dir.join("meshcap-agent").exists()
            && conf_dir.join("meshcap-cni.kubeconfig").exists()
    };
    eventually("meshcap installed", installed).expect("installed");
    let pins = agent.ebpf_config().expect("eBPF").bpffs_dir;

    // A rolling update (the DaemonSet is there), then one after the DaemonSet was replaced
    // (another uid: its new pods come): nothing is removed.
    for (uid, when) in [
        ("ds-1", "a rolling update"),
        ("ds-2", "a replaced DaemonSet"),
    ] {
        *api.daemon_sets.lock().expect("daemon sets") = vec![daemon_set(uid, false)];
        let status = agent.terminate().expect("SIGTERM");
        assert!(
            status.success(),
            "{when}: an orderly stop: {status}\n{}",
            agent.log()
        );
        assert!(
            installed(),
            "{when}: meshcap stays installed\n{}",
            agent.log()
        );
        assert!(pins.exists(), "{when}: the programs stay");
        agent.restart().expect("restart");
    }

    // kubectl delete (foreground): the DaemonSet is being deleted when its pods are stopped.
    *api.daemon_sets.lock().expect("daemon sets") = vec![daemon_set("ds-1", true)];
    // Right after the restart, while the agent may still be starting: a SIGTERM then gets
    // the same orderly stop (the CI once saw the default action kill it here).
    let status = agent.terminate().expect("SIGTERM");
    assert!(
        status.success(),
        "an orderly stop: {status}\n{}",
        agent.log()
    );
    assert_eq!(
        meshcap_entries(&conflist),
        0,
        "the entry is gone: new pods start without meshcap\n{}",
        agent.log()
    );
    for gone in [
        bin_dir.join("meshcap-cni"),
        bin_dir.join("meshcap-agent"),
        conf_dir.join("meshcap-cni.kubeconfig"),
        pins,
    ] {
        assert!(
            !gone.exists(),
            "{} is left\n{}",
            gone.display(),
            agent.log()
        );
    }
}
