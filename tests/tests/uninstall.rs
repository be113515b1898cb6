//! The real uninstall (restarts and upgrades never run it): the plugin leaves the CNI set-up at
//! once; the eBPF programs stay attached for as long as a pod they capture is alive, so that no
//! pod's traffic bypasses its sidecar, until that pod is handed back to Istio's own rules or is
//! gone. By hand (`meshcap-agent uninstall`: a second run once the pods are gone detaches and
//! unpins everything), or by the agent itself when it is stopped because meshcap is being
//! deleted (when it concludes so: `tests/tests/leaving.rs`), which hands the pods back first.

use std::{fs, path::Path, process::Command};

use meshcap_tests::{
    Placement,
    agent::{Agent, Backend, binaries},
    apiserver::{ApiServer, DAEMON_SET, SYSTEM_NAMESPACE},
    cluster::ClusterNode,
    dial,
    fixtures::{
        ManifestDir, attached_programs, eventually, leftovers, sidecar_pod, write_manifest,
    },
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

/// Marks meshcap's DaemonSet as being deleted and stops `agent` as kubelet then does; the agent
/// must exit cleanly, leaving the node's CNI set-up without meshcap.
fn delete_daemon_set(api: &ApiServer, node: &ClusterNode, agent: &mut Agent) {
    api.mark_deleting("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
    let status = agent.terminate().expect("SIGTERM");
    assert!(status.success(), "{status}\n{}", agent.log());
    assert!(node.clean(), "{}", agent.log());
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
    assert_eq!(
        attached_programs(&ebpf_config.cgroup_root),
        Vec::new(),
        "every program detached"
    );
}

/// Deleting the DaemonSet with a pod captured in the kernel: the stopping agent removes the CNI
/// set-up, hands the pod back to Istio's own rules (written by the iptables backend, held to
/// Istio's goldens), and then detaches and unpins every program: nothing of meshcap's kernel
/// objects outlives the agent, and the pod's connections still reach its proxy, both ways, with
/// their original destination.
#[test]
fn deleting_the_daemon_set_hands_captured_pods_back_and_removes_every_program() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let api = ApiServer::start();
    let node = ClusterNode::new(&api);
    let mut agent = node.start_agent(Backend::Ebpf, &[]);
    let ebpf_config = agent.ebpf_config().expect("eBPF");
    let wired = Wired::new(&agent);
    let _servers = wired.servers();
    let name = unique_name("web");
    api.apply_pod(sidecar_pod("shop", &name, &[]));
    let sandbox = Sandbox::new("shop", &name, &wired.pod);
    let add = cni("ADD", &sandbox, &config("1.0.0", &agent.socket, "10.0.0.2")).expect("ADD");
    assert!(add.success, "ADD failed: {add:?}\n{}", agent.log());
    let captured = || {
        let inbound = dial(
            Placement {
                netns: &wired.upstream,
                cgroup: None,
                uid: 0,
                gid: 0,
            },
            "tcp:10.0.0.2:8080",
            None,
        )
        .expect("dial")
        .map(|r| (r.server, r.listener, r.original_dst.map(|a| a.to_string())));
        (wired.app_dial(), inbound)
    };
    let expected = (
        ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
        Some(("envoy".to_owned(), 15006, Some("10.0.0.2:8080".to_owned()))),
    );
    assert_eq!(captured(), expected, "captured in the kernel");
    let before = leftovers(&wired.pod).expect("rules");
    assert!(
        before.iter().all(|l| !l.contains("ISTIO")),
        "no rules of Istio's before: {before:#?}"
    );

    delete_daemon_set(&api, &node, &mut agent);
    assert!(
        agent.log().contains("handed back: Istio's rules in place"),
        "{}",
        agent.log()
    );
    assert!(
        !ebpf_config.bpffs_dir.exists(),
        "the pins are left\n{}",
        agent.log()
    );
    assert_eq!(
        attached_programs(&ebpf_config.cgroup_root),
        Vec::new(),
        "every program detached"
    );
    let rules = leftovers(&wired.pod).expect("rules");
    for rule in [
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
    ] {
        assert!(rules.iter().any(|l| l.contains(rule)), "{rule}: {rules:#?}");
    }
    assert_eq!(captured(), expected, "captured by Istio's rules");
}

/// With the eBPF backend the uninstall also detaches the programs and removes the pins when
/// no captured pod lives.
#[test]
fn deleting_the_daemon_set_removes_the_programs_too() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let api = ApiServer::start();
    let node = ClusterNode::new(&api);
    let mut agent = node.start_agent(Backend::Ebpf, &[]);
    let pins = agent.ebpf_config().expect("eBPF").bpffs_dir;
    assert!(pins.exists());
    delete_daemon_set(&api, &node, &mut agent);
    assert!(!pins.exists(), "the pins are left\n{}", agent.log());
}
