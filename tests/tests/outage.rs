//! Agent outage: with `meshcap-agent` down (crash loop, image pull failure, eviction) a pod
//! the mesh concerns still fails closed, and every other pod starts. The agent installs a copy
//! of itself beside the plugin with the plugin's own credentials (a token of its own, bound to
//! no pod: the agent's pod object may be gone too) or, standalone, the manifest directory it
//! uses; the plugin runs `meshcap-agent decide` from there. Everything through the real
//! binaries: the agent installs into throwaway CNI directories, is killed, and the plugin it
//! installed is run with the entry it chained.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use meshcap_tests::{
    Netns,
    agent::binaries,
    apiserver::{AGENT_POD, ApiServer, SYSTEM_NAMESPACE},
    fixtures::{plain_pod, sidecar_pod, write_manifest},
    kubelet::{CniOutput, installed_add},
    require_root, unique_name,
};
use serde_json::{Value, json};

/// A throwaway directory tree, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The node's CNI directories with a primary conflist, and the agent's own dirs.
struct Node {
    root: Scratch,
    conf_dir: PathBuf,
    bin_dir: PathBuf,
}

impl Node {
    fn new() -> Self {
        let root = Scratch(std::env::temp_dir().join(unique_name("meshcap-outage")));
        let (conf_dir, bin_dir) = (root.0.join("net.d"), root.0.join("bin"));
        for dir in [&conf_dir, &bin_dir] {
            fs::create_dir_all(dir).expect("scratch dirs");
        }
        fs::write(
            conf_dir.join("10-bridge.conflist"),
            json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [{"type": "bridge"}]})
                .to_string(),
        )
        .expect("primary conflist");
        Self {
            root,
            conf_dir,
            bin_dir,
        }
    }

    /// Runs `meshcap-agent run --install-cni` with `source` and `env` until meshcap is chained,
    /// then SIGKILLs it (by its pid) and returns the entry it chained.
    fn install_then_kill(&self, source: &[&str], env: &[(&str, &Path)]) -> Value {
        let mut agent: Child = Command::new(binaries().join("meshcap-agent"))
            .args([
                "run",
                "--backend",
                "iptables",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(source)
            .arg("--socket")
            .arg(self.root.0.join("agent.sock"))
            .arg("--state-dir")
            .arg(self.root.0.join("state"))
            .env("MESHCAP_INSTALL_CNI", "true")
            .env("MESHCAP_CNI_CONF_DIR", &self.conf_dir)
            .env("MESHCAP_CNI_BIN_DIR", &self.bin_dir)
            .env("MESHCAP_PLUGIN_BINARY", binaries().join("meshcap-cni"))
            .env("MESHCAP_STARTUP_TAINT", "")
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("starting meshcap-agent");
        let conflist = self.conf_dir.join("10-bridge.conflist");
        let entry = (0..400).find_map(|_| {
            thread::sleep(Duration::from_millis(50));
            let conf: Value = serde_json::from_slice(&fs::read(&conflist).ok()?).ok()?;
            let last = conf["plugins"].as_array()?.last()?.clone();
            (last["type"] == "meshcap-cni" && self.bin_dir.join("meshcap-agent").exists())
                .then_some(last)
        });
        let _ = agent.kill();
        let _ = agent.wait();
        let mut entry = entry.expect("the agent chained meshcap-cni and installed its decider");
        entry["cniVersion"] = json!("1.0.0");
        entry["name"] = json!("k8s-pod-network");
        entry["prevResult"] = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24"}]});
        entry
    }

    /// The installed plugin's ADD of `namespace/name`, and how long it took.
    fn add(&self, conf: &Value, namespace: &str, name: &str) -> (CniOutput, Duration) {
        installed_add(&self.bin_dir, conf, namespace, name)
    }
}

/// The same three decisions from either source: a pod outside the mesh starts, a mesh pod
/// fails closed, an excluded namespace starts without asking anything.
fn decides_as_the_agent_would(node: &Node, conf: &Value) {
    let (plain, took) = node.add(conf, "shop", "plain");
    assert!(plain.success, "a pod outside the mesh starts: {plain:?}");
    assert_eq!(
        plain.stdout["ips"][0]["address"], "10.0.0.2/24",
        "prevResult passes"
    );
    assert!(
        plain.stderr.contains("not captured without the agent"),
        "{}",
        plain.stderr
    );
    eprintln!("ADD of a pod outside the mesh with the agent down: {took:?}");
    let (mesh, _) = node.add(conf, "shop", "web");
    assert!(!mesh.success, "a mesh pod must fail closed: {mesh:?}");
    assert_eq!(mesh.stdout["code"], 11);
    assert!(mesh.msg().contains("must be captured"), "{}", mesh.msg());
    let (excluded, _) = node.add(conf, "kube-system", "coredns");
    assert!(excluded.success, "{excluded:?}");
}

#[test]
fn with_the_agent_down_only_mesh_pods_wait_api_source() {
    require_root();
    let node = Node::new();
    let api = ApiServer::start();
    {
        let mut pods = api.pods.lock().expect("pods");
        pods.push(plain_pod("shop", "plain"));
        pods.push(sidecar_pod("shop", "web", &[]));
    }
    let kubeconfig = api.kubeconfig(&node.root.0);
    let token_dir = api.cni_token_dir(&node.root.0);
    let conf = node.install_then_kill(
        &["--pods", "kube", "--node-name", "node-1"],
        &[
            ("KUBECONFIG", &kubeconfig),
            ("MESHCAP_CNI_TOKEN_DIR", &token_dir),
        ],
    );
    // The agent's pod object goes too (an eviction, an upgrade to an image that cannot be
    // pulled): its token is revoked, and the plugin decides with its own.
    api.delete("Pod", SYSTEM_NAMESPACE, AGENT_POD);
    let written = conf["kubeconfig"]
        .as_str()
        .expect("the entry names the plugin's kubeconfig");
    assert_eq!(
        Path::new(written),
        node.conf_dir.join("meshcap-cni.kubeconfig")
    );
    decides_as_the_agent_would(&node, &conf);
    // A pod the API server does not know: nothing says it is outside the mesh.
    let (unknown, _) = node.add(&conf, "shop", "ghost");
    assert!(!unknown.success, "{unknown:?}");
    assert!(
        unknown.msg().contains("cannot be decided"),
        "{}",
        unknown.msg()
    );
    // Both the agent and the API server down: fail closed for every pod not excluded here.
    drop(api);
    let (plain, took) = node.add(&conf, "shop", "plain");
    assert!(!plain.success, "no source, no decision: {plain:?}");
    assert_eq!(plain.stdout["code"], 11);
    eprintln!("ADD with the agent and the API server down: {took:?}");
    let (excluded, _) = node.add(&conf, "kube-system", "coredns");
    assert!(excluded.success, "{excluded:?}");
}

#[test]
fn with_the_agent_down_only_mesh_pods_wait_manifest_source() {
    require_root();
    let node = Node::new();
    let pods = node.root.0.join("pods");
    fs::create_dir_all(&pods).expect("pod dir");
    write_manifest(&pods, &plain_pod("shop", "plain"));
    write_manifest(&pods, &sidecar_pod("shop", "web", &[]));
    let conf = node.install_then_kill(
        &["--pods", "dir", "--pod-dir", pods.to_str().expect("utf-8")],
        &[],
    );
    assert_eq!(conf["pod_dir"], json!(pods));
    decides_as_the_agent_would(&node, &conf);
}

/// On a node that runs ambient mode, a pod ambient mode enrolls (its label, or its
/// namespace's) is the mesh's too: it waits for the agent rather than start uncaptured.
#[test]
fn with_the_agent_down_ambient_pods_wait_too() {
    require_root();
    let node = Node::new();
    let pods = node.root.0.join("pods");
    fs::create_dir_all(&pods).expect("pod dir");
    let label = |mut pod: Value, value: &str| {
        pod["metadata"]["labels"] = json!({"istio.io/dataplane-mode": value});
        pod
    };
    write_manifest(&pods, &plain_pod("shop", "plain"));
    write_manifest(&pods, &label(plain_pod("shop", "mesh"), "ambient"));
    write_manifest(&pods, &plain_pod("enrolled", "by-namespace"));
    write_manifest(&pods, &label(plain_pod("enrolled", "opted-out"), "none"));
    fs::write(
        pods.join("namespace.yaml"),
        "kind: Namespace\nmetadata: {name: enrolled, labels: {istio.io/dataplane-mode: ambient}}\n",
    )
    .expect("namespace manifest");
    let socket = node.root.0.join("ztunnel.sock");
    // Ambient mode writes its probe rule and sets in the node's netns: a throwaway one.
    let node_netns = Netns::new("mc-node").expect("node netns");
    let conf = node.install_then_kill(
        &["--pods", "dir", "--pod-dir", pods.to_str().expect("utf-8")],
        &[
            ("MESHCAP_AMBIENT_ENABLED", Path::new("true")),
            ("MESHCAP_ZTUNNEL_SOCKET", &socket),
            ("MESHCAP_NODE_NETNS", &node_netns.path()),
        ],
    );
    assert_eq!(conf["ambient_enabled"], json!(true), "{conf}");
    assert!(conf["enablement_selectors"].is_array(), "{conf}");
    for (namespace, name, waits) in [
        ("shop", "plain", false),
        ("shop", "mesh", true),
        ("enrolled", "by-namespace", true),
        ("enrolled", "opted-out", false),
    ] {
        let (out, _) = node.add(&conf, namespace, name);
        assert_eq!(!out.success, waits, "{namespace}/{name}: {out:?}");
        if waits {
            assert_eq!(out.stdout["code"], 11);
            assert!(
                out.msg().contains("ambient mode enrolls it"),
                "{}",
                out.msg()
            );
        }
    }
}
