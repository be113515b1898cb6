//! Switching a node from istio-cni to meshcap with both agents on it (docs/install.md,
//! "Switching from istio-cni"): the real agent binary installing into a temp conf dir, beside a
//! stand-in istio-cni agent that does with the files what Istio's does
//! (`cni/pkg/install/install.go` at istio/istio 86c9f01): it chains its entry into the first
//! valid file, puts it back whenever that file lacks it (`sleepWatchInstall`,
//! `checkValidCNIConfig`; another file sorting first is only warned about), and at its exit
//! takes it out of that file (`Installer.Cleanup`). A reader polls the conf dir as the runtime
//! reads it (libcni: the first valid file by name) and records every chain that holds both
//! plugins or neither: a pod created then would run through both, or start uncaptured.
use std::{
    fs,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use meshcap_agent::{
    ambient::{HostProbes, ProbeWay, remove_from_node},
    backend::iptables::FlavourChoice,
    ipset::IpSets,
    uninstall,
};
use meshcap_policy::{ambient::HostProbeSnat, hostprobe::PROBE_SET_V4};
use meshcap_tests::{
    APP_UID, Proc,
    agent::{Agent, Backend},
    apiserver::ApiServer,
    bin,
    cluster::ClusterNode,
    dial,
    fixtures::{ManifestDir, ambient_pod, eventually},
    kubelet::{Sandbox, cni, config},
    require_root, run, unique_name,
    world::{Node as World, Pod},
};
use serde_json::{Value, json};

const ISTIO: &str = "istio-cni";
const MESHCAP: &str = "meshcap-cni";

/// A throwaway directory tree, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The plugin types of a CNI file's chain, if libcni would use the file.
fn chain(name: &str, bytes: &[u8]) -> Option<Vec<String>> {
    let value: Value = serde_json::from_slice(bytes).ok()?;
    let types = |plugins: &[Value]| -> Option<Vec<String>> {
        plugins
            .iter()
            .map(|p| {
                p["type"]
                    .as_str()
                    .filter(|t| !t.is_empty())
                    .map(str::to_owned)
            })
            .collect()
    };
    if name.ends_with(".conflist") {
        value["name"].as_str()?;
        let plugins = value["plugins"].as_array().filter(|p| !p.is_empty())?;
        types(plugins)
    } else if name.ends_with(".conf") || name.ends_with(".json") {
        types(std::slice::from_ref(&value))
    } else {
        None
    }
}

/// The valid CNI files of `dir`, sorted by name as libcni sorts them: (name, chain).
fn valid_files(dir: &Path) -> Vec<(String, Vec<String>)> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
        .into_iter()
        .filter_map(|name| {
            let bytes = fs::read(dir.join(&name)).ok()?;
            chain(&name, &bytes).map(|types| (name, types))
        })
        .collect()
}

/// The chain the runtime would run for a pod created now.
fn runtime_chain(dir: &Path) -> Option<Vec<String>> {
    valid_files(dir).into_iter().next().map(|(_, types)| types)
}

fn types_of(path: &Path) -> Vec<String> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    fs::read(path)
        .ok()
        .and_then(|bytes| chain(name, &bytes))
        .unwrap_or_default()
}

/// Writes as Istio's `file.AtomicWrite` does: a temporary file, renamed over the target.
fn atomic_write(path: &Path, value: &Value) {
    let tmp = path.with_extension("istio-tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(value).expect("JSON")).expect("temporary file");
    fs::rename(&tmp, path).expect("rename");
}

/// Polls the conf dir as the runtime reads it until stopped; every chain seen with both
/// plugins or neither is kept.
struct Reader {
    stop: Arc<AtomicBool>,
    reads: Arc<AtomicUsize>,
    bad: Arc<Mutex<Vec<Vec<String>>>>,
    handle: Option<JoinHandle<()>>,
}

impl Reader {
    fn start(dir: &Path) -> Self {
        let (stop, reads, bad) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(Mutex::new(Vec::new())),
        );
        let handle = {
            let (dir, stop, reads, bad) = (
                dir.to_owned(),
                Arc::clone(&stop),
                Arc::clone(&reads),
                Arc::clone(&bad),
            );
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let chain = runtime_chain(&dir).unwrap_or_default();
                    let has = |t: &str| chain.iter().any(|c| c == t);
                    if has(ISTIO) == has(MESHCAP) {
                        bad.lock().expect("lock").push(chain);
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        Self {
            stop,
            reads,
            bad,
            handle: Some(handle),
        }
    }

    /// Stops; the chains seen with both plugins or neither, and how many reads were made.
    fn finish(mut self) -> (Vec<Vec<String>>, usize) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            handle.join().expect("reader");
        }
        let bad = std::mem::take(&mut *self.bad.lock().expect("lock"));
        (bad, self.reads.load(Ordering::Relaxed))
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The stand-in istio-cni agent (see the module documentation); `writes` counts its writes.
struct IstioCni {
    file: PathBuf,
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

impl IstioCni {
    /// Starts it on `dir`: it chooses the first valid file and chains its entry into it.
    fn start(dir: &Path) -> Self {
        let (first, _) = valid_files(dir)
            .into_iter()
            .next()
            .expect("a primary CNI configuration");
        let file = dir.join(first);
        let (stop, writes) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        insert_istio(&file);
        writes.fetch_add(1, Ordering::SeqCst);
        let handle = {
            let (file, stop, writes) = (file.clone(), Arc::clone(&stop), Arc::clone(&writes));
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    // Istio watches with inotify; polling its file every 5 ms answers as fast.
                    thread::sleep(Duration::from_millis(5));
                    if !types_of(&file).iter().any(|t| t == ISTIO) {
                        insert_istio(&file);
                        writes.fetch_add(1, Ordering::SeqCst);
                    }
                }
                // Installer.Cleanup: its entry out of its file, the rest kept.
                let mut value: Value =
                    serde_json::from_slice(&fs::read(&file).expect("its file")).expect("JSON");
                if let Some(plugins) = value["plugins"].as_array_mut() {
                    plugins.retain(|p| p["type"] != ISTIO);
                }
                atomic_write(&file, &value);
            })
        };
        Self {
            file,
            stop,
            writes,
            handle: Some(handle),
        }
    }

    fn writes(&self) -> usize {
        self.writes.load(Ordering::SeqCst)
    }

    /// Exits for good, with its clean-up.
    fn exit(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.take() {
            handle.join().expect("istio-cni stand-in");
        }
    }
}

impl Drop for IstioCni {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Istio's `insertCNIConfig`: its entry out of the list, then appended.
fn insert_istio(file: &Path) {
    let mut value: Value =
        serde_json::from_slice(&fs::read(file).expect("its file")).expect("JSON");
    let plugins = value["plugins"].as_array_mut().expect("a list");
    plugins.retain(|p| p["type"] != ISTIO);
    plugins.push(
        json!({"type": ISTIO, "name": ISTIO, "plugin_log_level": "info",
                        "cni_agent_run_dir": "/var/run/istio-cni", "ambient_enabled": false}),
    );
    atomic_write(file, &value);
}

/// A node's conf and bin dirs with Calico's configuration, and the agent installing into them.
/// The agent is declared first so that it stops before its directories are removed (fields
/// drop in order): a running agent puts its plugin binary back into a removed bin dir.
struct Node {
    agent: Option<Agent>,
    root: Scratch,
    pods: ManifestDir,
}

impl Node {
    fn new() -> Self {
        let root = Scratch(std::env::temp_dir().join(unique_name("meshcap-switch")));
        for dir in ["net.d", "bin"] {
            fs::create_dir_all(root.0.join(dir)).expect("scratch dirs");
        }
        fs::write(
            root.0.join("net.d/10-calico.conflist"),
            json!({"cniVersion": "1.0.0", "name": "k8s-pod-network",
                   "plugins": [{"type": "calico"}, {"type": "portmap"}]})
            .to_string(),
        )
        .expect("primary conflist");
        Self {
            agent: None,
            root,
            pods: ManifestDir::new(),
        }
    }

    fn conf_dir(&self) -> PathBuf {
        self.root.0.join("net.d")
    }

    fn primary(&self) -> PathBuf {
        self.conf_dir().join("10-calico.conflist")
    }

    fn start_agent(&mut self) -> &Agent {
        let (conf, bin) = (self.conf_dir(), self.root.0.join("bin"));
        let agent = Agent::start(
            Backend::Iptables,
            &[
                "--pods",
                "dir",
                "--pod-dir",
                self.pods.0.to_str().expect("utf-8"),
            ],
            &[
                ("MESHCAP_INSTALL_CNI", "true"),
                ("MESHCAP_CNI_CONF_DIR", conf.to_str().expect("utf-8")),
                ("MESHCAP_CNI_BIN_DIR", bin.to_str().expect("utf-8")),
            ],
        )
        .expect("agent");
        self.agent.insert(agent)
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("the agent runs")
    }

    fn readyz(&self) -> (u16, String) {
        self.agent().http_get("/readyz").expect("readyz")
    }
}

fn strings(types: &[&str]) -> Vec<String> {
    types.iter().map(|t| (*t).to_owned()).collect()
}

/// meshcap's agent starts on a node where istio-cni's still runs: meshcap's entry replaces
/// istio-cni's in one rename (its own file, in front), istio-cni's agent never has to write
/// again, and its exit hands the primary's file over; no chain ever holds both or neither.
#[test]
fn taking_over_from_a_running_istio_cni_leaves_no_window() {
    require_root();
    let mut node = Node::new();
    let istio = IstioCni::start(&node.conf_dir());
    assert_eq!(
        runtime_chain(&node.conf_dir()),
        Some(strings(&["calico", "portmap", ISTIO]))
    );
    let reader = Reader::start(&node.conf_dir());
    node.start_agent();
    let ours = strings(&["calico", "portmap", MESHCAP]);
    eventually("meshcap's entry replaces istio-cni's", || {
        runtime_chain(&node.conf_dir()).as_ref() == Some(&ours) && node.readyz().0 == 200
    })
    .expect("taken over");
    // istio-cni's agent sees its file as it left it: it has no reason to write.
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        istio.writes(),
        1,
        "istio-cni's agent had to put its entry back"
    );
    assert!(types_of(&node.primary()).iter().any(|t| t == ISTIO));
    let (code, body) = node.readyz();
    assert_eq!(code, 200, "{body}");

    istio.exit();
    eventually("meshcap's entry settles in the primary's file", || {
        types_of(&node.primary()) == ours && valid_files(&node.conf_dir()).len() == 1
    })
    .expect("settled");
    let (bad, reads) = reader.finish();
    assert!(reads > 100, "the reader read the dir {reads} times");
    assert!(
        bad.is_empty(),
        "chains with both plugins or neither: {bad:?}"
    );
    assert_eq!(node.readyz().0, 200);
}

/// An istio-cni agent started on a node meshcap has taken (the procedure not followed) chains
/// into meshcap's file; meshcap's entry goes in front of it again at once, istio-cni's agent is
/// left with nothing to fight, and meshcap is not ready, saying why, meanwhile.
#[test]
fn an_istio_cni_agent_started_after_the_takeover_is_reported_and_outrun() {
    require_root();
    let mut node = Node::new();
    node.start_agent();
    let ours = strings(&["calico", "portmap", MESHCAP]);
    eventually("meshcap chained into the primary's file", || {
        types_of(&node.primary()) == ours && node.readyz().0 == 200
    })
    .expect("installed");

    let istio = IstioCni::start(&node.conf_dir());
    eventually(
        "meshcap's entry alone in front again, and not ready",
        || {
            let (code, body) = node.readyz();
            runtime_chain(&node.conf_dir()).as_ref() == Some(&ours)
                && code == 503
                && body.contains("istio-cni's agent still runs on this node")
        },
    )
    .expect("reported");
    let reader = Reader::start(&node.conf_dir());
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        istio.writes(),
        1,
        "istio-cni's agent had to put its entry back"
    );
    assert_eq!(istio.file, node.primary());

    istio.exit();
    eventually("meshcap's entry settles in the primary's file", || {
        types_of(&node.primary()) == ours && valid_files(&node.conf_dir()).len() == 1
    })
    .expect("settled");
    let (bad, _) = reader.finish();
    assert!(
        bad.is_empty(),
        "chains with both plugins or neither: {bad:?}"
    );
}

/// A stand-in ztunnel connected to `socket`, once sent its snapshot; the lines it printed
/// before (`add <uid> …` for each pod of the snapshot).
fn ztunnel(world: &World, socket: &Path) -> (Proc, Vec<String>) {
    let at = meshcap_tests::Placement {
        cgroup: Some(&world.cgroup),
        ..world.client()
    };
    let mut zt = Proc::spawn(
        at,
        &bin::ztunnel(),
        &["--socket", socket.to_str().expect("utf-8")],
    )
    .expect("meshcap-ztunnel");
    let mut lines = Vec::new();
    loop {
        let line = zt.wait_line().expect("ztunnel");
        if line == "snapshot_sent" {
            return (zt, lines);
        }
        lines.push(line);
    }
}

/// Who answers the app's connection to its peer: `ztunnel` when captured.
fn outbound(world: &World, pod: &Pod) -> String {
    let app = pod.at(world, APP_UID, APP_UID);
    dial(app, &format!("tcp:{}:80", pod.peer_v4()), None)
        .expect("dial")
        .expect("an answer")
        .server
}

fn probe_addresses(world: &World) -> Vec<String> {
    world
        .netns
        .run_in(|| {
            let Ok(entries) = IpSets::open()?.list(PROBE_SET_V4) else {
                return Ok(Vec::new());
            };
            Ok(entries.into_iter().map(|e| e.ip.to_string()).collect())
        })
        .expect("listing the probe set")
}

fn probe_jumps(world: &World) -> usize {
    ["iptables-legacy-save", "iptables-nft-save"]
        .iter()
        .filter_map(|save| {
            run(
                "ip",
                &["netns", "exec", world.netns.name(), save, "-t", "nat"],
            )
            .ok()
        })
        .map(|out| {
            out.lines()
                .filter(|l| *l == "-A POSTROUTING -j ISTIO_POSTRT")
                .count()
        })
        .sum()
}

/// istio-cni's agent leaving a node meshcap's agent serves in ambient mode
/// (`cni/pkg/nodeagent/meshdataplane_linux.go`, `Stop`): the node's probe rule deleted and the
/// probe sets destroyed, and its ZDS listener closed, which unlinks the socket's path, where
/// meshcap listens; ztunnel reconnects. meshcap listens there again (ztunnel, reconnecting,
/// gets the enrolled pod in its snapshot) and puts the probe sets and rule back; the pod stays
/// captured for ztunnel.
#[test]
fn istio_cnis_exit_on_the_node_is_survived() {
    require_root();
    let mut world = World::new().expect("node");
    let pod = world.add_pod(false).expect("pod");
    let sockets = ManifestDir::new();
    let socket = sockets.0.join("ztunnel.sock");
    let api = ApiServer::with_configuration("ambient");
    let mut manifest = ambient_pod("shop", "web");
    manifest["spec"]["nodeName"] = json!("node-1");
    api.apply_pod(manifest);
    api.namespaces.lock().expect("namespaces").push(json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {}},
    }));
    let kubeconfig = api.kubeconfig(&sockets.0);
    let agent = Agent::start_in(
        Backend::Iptables,
        &["--pods", "kube", "--node-name", "node-1"],
        &[
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
            ("MESHCAP_AMBIENT_ENABLED", "true"),
            ("MESHCAP_ZTUNNEL_SOCKET", socket.to_str().expect("utf-8")),
            (
                "MESHCAP_NODE_NETNS",
                world.netns.path().to_str().expect("utf-8"),
            ),
            ("MESHCAP_STARTUP_TAINT", ""),
            ("MESHCAP_VERIFY_INTERVAL_SECONDS", "1"),
        ],
        Some(world.cgroup.path()),
    )
    .expect("agent");
    let (mut zt, _) = ztunnel(&world, &socket);
    let sandbox = Sandbox::new("shop", "web", &pod.netns);
    let conf = config("1.0.0", &agent.socket, &pod.v4().to_string());
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}\n{}", agent.log());
    assert!(zt.wait_line().expect("ztunnel").starts_with("add uid-web "));
    assert_eq!(outbound(&world, &pod), "ztunnel");
    assert!(probe_addresses(&world).contains(&pod.v4().to_string()));

    // istio-cni's exit: DeleteHostRules and the sets destroyed, then its listener closed.
    remove_from_node(
        Some(&world.netns.path()),
        FlavourChoice::Auto,
        HostProbeSnat::default(),
    )
    .expect("removing the probe rule and sets");
    assert!(probe_addresses(&world).is_empty());
    fs::remove_file(&socket).expect("unlinking the ZDS socket");
    // ztunnel, its connection to istio-cni's agent gone, reconnects by path.
    drop(zt);
    let (zt, snapshot) = ztunnel(&world, &socket);
    assert!(
        snapshot.iter().any(|l| l.starts_with("add uid-web ")),
        "the reconnected ztunnel was sent the pod: {snapshot:?}\n{}",
        agent.log()
    );
    eventually("the probe sets and their rule put back", || {
        probe_addresses(&world).contains(&pod.v4().to_string()) && probe_jumps(&world) == 1
    })
    .expect("put back");
    assert_eq!(
        outbound(&world, &pod),
        "ztunnel",
        "still captured for ztunnel"
    );
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
    drop(zt);
}

/// Handing a node back to istio-cni, as docs/install.md's "Rolling back" does it: istio-cni's
/// agent starts beside meshcap's (the node labelled `both`) and chains into the file meshcap's
/// entry is in; meshcap's entry goes in front of it again. The node is then relabelled out of
/// meshcap's DaemonSet's node affinity and meshcap's agent, stopped, uninstalls from the node:
/// its entry goes from istio-cni's file first, then its own file, so the runtime goes from
/// meshcap's chain to istio-cni's in one step; istio-cni's agent never has to write again.
#[test]
fn handing_a_node_back_to_istio_cni_leaves_no_window() {
    require_root();
    let api = ApiServer::start();
    let label = |value: &str| api.label_for_switch(value);
    api.apply_switch_affinity();
    label("meshcap");
    let node = ClusterNode::new(&api);
    let mut agent = node.start_agent(Backend::Iptables, &[]);
    let bridge = |last: &str| strings(&["bridge", last]);
    assert_eq!(runtime_chain(&node.conf_dir), Some(bridge(MESHCAP)));

    label("both");
    let started = Instant::now();
    let istio = IstioCni::start(&node.conf_dir);
    assert_eq!(
        istio.file, node.conflist,
        "istio-cni chose the primary's file"
    );
    // Until meshcap's agent answers the change, the runtime's chain holds both plugins.
    while runtime_chain(&node.conf_dir) != Some(bridge(MESHCAP)) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "meshcap's entry never went in front again: {:?}\n{}",
            valid_files(&node.conf_dir),
            agent.log()
        );
    }
    eprintln!(
        "both plugins in the runtime's chain for at most {:?}",
        started.elapsed()
    );
    let reader = Reader::start(&node.conf_dir);

    label("istio");
    let status = agent.terminate().expect("SIGTERM");
    let log = agent.log();
    assert!(status.success(), "{status}\n{log}");
    assert!(log.contains("no longer places a pod on this node"), "{log}");
    assert_eq!(
        runtime_chain(&node.conf_dir),
        Some(bridge(ISTIO)),
        "{:?}\n{log}",
        valid_files(&node.conf_dir)
    );
    assert_eq!(
        valid_files(&node.conf_dir).len(),
        1,
        "meshcap's own file is gone"
    );
    thread::sleep(Duration::from_millis(200));
    let (bad, reads) = reader.finish();
    assert!(reads > 100, "the reader read the dir {reads} times");
    assert!(
        bad.is_empty(),
        "chains with both plugins or neither: {bad:?}"
    );
    assert_eq!(
        istio.writes(),
        1,
        "istio-cni's agent had to put its entry back"
    );
}

/// meshcap's uninstall on a node being handed back to istio-cni (its entry in the CNI
/// configuration) leaves ambient mode's probe rule and sets, which istio-cni's agent uses under
/// the same names for the same pods and does not put back once it runs; without istio-cni's
/// entry the uninstall removes them, as Istio's agent does when it leaves for good.
#[test]
fn a_hand_back_leaves_the_probe_rule_and_sets_to_istio_cni() {
    require_root();
    let world = World::new().expect("node");
    let probes = HostProbes::open(
        Some(world.netns.path()),
        ProbeWay::Ipset,
        FlavourChoice::Auto,
        HostProbeSnat::default(),
        false,
    )
    .expect("probe sets");
    let address = "10.9.8.7";
    probes
        .add("uid-web", &[address.parse().expect("address")])
        .expect("entry");
    let node = Node::new();
    insert_istio(&node.primary());

    let left = uninstall::probes(
        Some(&world.netns.path()),
        FlavourChoice::Auto,
        &node.conf_dir(),
    )
    .expect("uninstalling the probes");
    assert_eq!(left.as_deref(), Some("10-calico.conflist"));
    assert_eq!(probe_addresses(&world), vec![address.to_owned()]);
    assert_eq!(probe_jumps(&world), 1);

    // istio-cni gone with its clean-up: nothing of the node's probes is anyone's any more.
    let mut value: Value =
        serde_json::from_slice(&fs::read(node.primary()).expect("primary")).expect("JSON");
    value["plugins"]
        .as_array_mut()
        .expect("a list")
        .retain(|p| p["type"] != ISTIO);
    atomic_write(&node.primary(), &value);
    let left = uninstall::probes(
        Some(&world.netns.path()),
        FlavourChoice::Auto,
        &node.conf_dir(),
    )
    .expect("uninstalling the probes");
    assert_eq!(left, None);
    assert!(probe_addresses(&world).is_empty());
    assert_eq!(probe_jumps(&world), 0);
}
