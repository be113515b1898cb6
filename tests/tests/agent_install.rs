//! `meshcap-agent run --install-cni`, as the DaemonSet runs it: the plugin binary is copied
//! into the CNI bin dir and chained last into the runtime's conflist, the settings come from
//! the DaemonSet's environment variables, and the entry stays when the agent exits (pods
//! created meanwhile wait for it instead of starting uncaptured).
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use meshcap_tests::{agent::binaries, require_root, unique_name};
use serde_json::{Value, json};

/// A throwaway directory tree, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The agent process, killed by its pid on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).expect("conflist")).expect("JSON conflist")
}

fn meshcap_entries(conflist: &Value) -> Vec<Value> {
    conflist["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter(|p| p["type"] == "meshcap-cni")
        .cloned()
        .collect()
}

#[test]
fn run_installs_the_plugin_and_leaves_it_in_place_when_it_exits() {
    require_root();
    let root = Scratch(std::env::temp_dir().join(unique_name("meshcap-install")));
    let (conf_dir, bin_dir, pods) = (
        root.0.join("net.d"),
        root.0.join("bin"),
        root.0.join("pods"),
    );
    for dir in [&conf_dir, &bin_dir, &pods] {
        fs::create_dir_all(dir).expect("scratch dirs");
    }
    let primary = conf_dir.join("10-calico.conflist");
    fs::write(
        &primary,
        json!({"cniVersion": "1.0.0", "name": "k8s-pod-network",
               "plugins": [{"type": "calico"}, {"type": "portmap"}]})
        .to_string(),
    )
    .expect("primary conflist");
    let socket = root.0.join("agent.sock");

    let mut agent = Running(
        Command::new(binaries().join("meshcap-agent"))
            .args(["run", "--pods", "dir", "--backend", "iptables"])
            .args(["--http-listen", "127.0.0.1:0"])
            .arg("--pod-dir")
            .arg(&pods)
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(root.0.join("state"))
            .env("MESHCAP_INSTALL_CNI", "true")
            .env("MESHCAP_CNI_CONF_DIR", &conf_dir)
            .env("MESHCAP_CNI_BIN_DIR", &bin_dir)
            .env("MESHCAP_EXCLUDE_NAMESPACES", "kube-system,istio-system")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("starting meshcap-agent"),
    );

    let installed = (0..200).find_map(|_| {
        thread::sleep(Duration::from_millis(50));
        let conf = read_json(&primary);
        (bin_dir.join("meshcap-cni").exists() && !meshcap_entries(&conf).is_empty()).then_some(conf)
    });
    let conf = installed.expect("the agent chained meshcap-cni into 10-calico.conflist");
    let plugins = conf["plugins"].as_array().expect("plugins");
    assert_eq!(plugins.len(), 3, "{conf}");
    assert_eq!(plugins[2]["type"], "meshcap-cni", "chained last: {conf}");
    assert_eq!(plugins[2]["agent_socket"], json!(socket), "{conf}");
    assert_eq!(
        plugins[2]["exclude_namespaces"],
        json!(["kube-system", "istio-system"]),
        "the DaemonSet's excludeNamespaces reach the plugin: {conf}"
    );
    assert_eq!(
        fs::read(bin_dir.join("meshcap-cni")).expect("installed plugin"),
        fs::read(binaries().join("meshcap-cni")).expect("built plugin"),
    );

    // The primary CNI rewrites its file (as Calico and Cilium do): the entry comes back.
    fs::write(
        &primary,
        json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [{"type": "calico"}]})
            .to_string(),
    )
    .expect("rewrite");
    let restored = (0..200).any(|_| {
        thread::sleep(Duration::from_millis(50));
        meshcap_entries(&read_json(&primary)).len() == 1
    });
    assert!(
        restored,
        "the watcher re-inserts the entry: {}",
        read_json(&primary)
    );

    // SIGKILL: nothing removed, so pods created while the agent is away fail closed.
    agent.0.kill().expect("kill the agent");
    agent.0.wait().expect("reap the agent");
    assert_eq!(meshcap_entries(&read_json(&primary)).len(), 1);
    assert!(bin_dir.join("meshcap-cni").exists());
}
