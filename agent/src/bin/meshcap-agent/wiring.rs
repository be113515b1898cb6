//! `meshcap-agent run`: the daemon, put together from its settings ([`RunArgs`]). Opens the pod
//! source and the backends (probing the kernel for `auto`; ambient mode's around the one that
//! captures its pods), builds the hub on them, serves the plugin socket and the health
//! endpoint, installs the plugin and keeps it chained, starts the controllers and the checks
//! of its standing in the cluster ([`crate::standing`]), serves until SIGTERM, and uninstalls
//! when meshcap is being deleted ([`crate::lifecycle`]).
use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use meshcap_agent::{
    access::WatchHealth,
    ambient::{Ambient, AmbientPlaces, IstioEnrolled, ProbeWay},
    api::{Server, ServerConfig, http},
    backend::{Router, ebpf::EbpfConfig},
    enrollment::LiveEnrollment,
    events::EventSink,
    hub::{Hub, Parts, Settings},
    install::watch::InstallStatus,
    pods::{PodSource, dir::DirPods, feed::PodFeed, kube::KubePods},
    privilege,
    probe::ProbeReport,
    repair::{RepairConfig, Repairer},
    takeover::IstioCaptured,
};
use meshcap_policy::NodeSettings;
use tokio::sync::watch;
use tracing::info;

use crate::{
    choice::{Chosen, RulesPath, Shared, ambient_ways, open_backend},
    lifecycle::{self, ShutdownSignal},
    run::{
        Paths, PodSourceKind, RunArgs, ambient_config, in_kernel_ambient, native_nftables,
        netns_dir, takeover_to_kernel, warn_not_supported,
    },
    standing::{self, Features, Holds},
};

/// The API server and this node's name, with `--pods kube`.
type KubeNode = (kube::Client, String);

#[tokio::main]
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Before anything else: a SIGTERM that arrives while the agent starts (a rollout, or the
    // DaemonSet deleted right after a restart) must end in the same orderly shutdown, not in
    // the default action that skips the uninstall.
    let mut shutdown = ShutdownSignal::register()?;
    warn_not_supported()?;
    // With the API server: readiness held until what the agent (and the plugin it installs)
    // may do is checked, and while a watch is refused.
    let holds = matches!(args.pods, PodSourceKind::Kube).then(|| Holds::new(args.install_cni));
    let (source, kube_node) = pod_source(&args, holds.as_ref()).await?;
    let paths = args.paths()?;
    // Held until the process ends: nothing below may run beside another agent's writes.
    let _instance = tokio::select! {
        held = lifecycle::lock_state_dir(&paths.state_dir) => held?,
        () = shutdown.received() => {
            info!("stopped while waiting for the other agent: nothing was started");
            return Ok(());
        }
    };
    let endpoints = bind_endpoints(&paths).await?;
    // The node's one pod watch: the adoptions below read its first list, and the controllers
    // further on follow it.
    let pod_feed = source.feed().cloned();
    let kube = kube_node
        .as_ref()
        .zip(pod_feed.as_ref())
        .map(|((client, _), pods)| (client, pods));
    let node = open_node(&args, &paths, kube).await?;
    // Readiness waits for the plugin to be chained from the first answer on: the endpoint and
    // the socket come up before the first install ends (copying the binaries can take seconds),
    // and a ready agent whose plugin is not in the chain would let pods start uncaptured.
    let (install_tx, install_rx) = watch::channel(InstallStatus::Starting);
    let events = kube_node
        .as_ref()
        .map(|(client, node)| EventSink::new(client.clone(), node));
    let source = Arc::new(source);
    let hub = Arc::new(Hub::new(
        Parts {
            source: source.clone(),
            router: node.router,
            backend_reason: node.reason,
            probe: node.probe,
            ambient: node.ambient.clone(),
            install: args.install_cni.then(|| install_rx.clone()),
            holds: holds
                .as_ref()
                .map(Holds::receivers)
                .unwrap_or_default()
                .into_iter()
                .chain(capability_hold())
                .collect(),
            events: events.clone(),
        },
        Settings {
            retry: args.retry(),
            node: node.settings.clone(),
            socket: paths.socket.clone(),
        },
    ));
    hub.adopt_istio_sidecars(node.istio_sidecars, takeover_to_kernel()?)
        .await;
    tokio::spawn(lifecycle::log_warnings(hub.clone()));
    tokio::spawn(lifecycle::drop_gone(
        hub.clone(),
        Duration::from_secs(args.gone_check_seconds.max(1)),
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    let (http_tasks, serve) = serve(&args, &paths, endpoints, &hub, &stop_rx).await?;
    let verifier = lifecycle::start_verifier(&hub, args.verify_interval_seconds, &stop_rx);
    let installer = if args.install_cni {
        let on_pass = lifecycle::on_install_pass(hub.clone());
        let installed = lifecycle::start_install(&args, &paths.socket, install_tx, on_pass)?;
        tokio::spawn(lifecycle::track_install(hub.clone(), install_rx.clone()));
        Some(installed)
    } else {
        None
    };
    let hand_back = lifecycle::HandBack {
        node: crate::handback::Node {
            kernel: ebpf_config(&args, &paths),
            state_dir: paths.state_dir.clone(),
            flavour: args.iptables_flavour,
            ambient: ambient_config()?,
        },
        source,
        settings: node.settings.clone(),
    };
    let mut standing = None;
    if let (Some((client, node_name)), Some(events), Some(holds)) = (&kube_node, events, holds) {
        let repair = RepairConfig::from_settings(|name| std::env::var(name).ok())?;
        let features = Features {
            node: node_name.clone(),
            startup_taint: !args.startup_taint.is_empty(),
            ambient: node.ambient_on,
            repair: repair.mode,
        };
        let plugin = installer
            .as_ref()
            .map(|(_, config)| (config.plugin.kubeconfig.clone(), install_rx.clone()));
        let health = holds.health.clone();
        let departure = standing::start(client, features.clone(), holds, &events, plugin);
        standing = Some((departure, features));
        let in_place = Controllers {
            events,
            ambient: node.ambient,
            settings: node.settings,
            netns_dir: netns_dir(),
            repair,
            health,
        };
        if let Some(pods) = &pod_feed {
            start_controllers(client, pods, &hub, in_place);
        }
    }
    if let Some((client, node)) = kube_node.clone()
        && !args.startup_taint.is_empty()
    {
        let gate = args.install_cni.then_some(install_rx);
        tokio::spawn(lifecycle::untaint_when_ready(
            client,
            node,
            args.startup_taint.clone(),
            gate,
        ));
    }

    shutdown.received().await;
    info!("shutting down: no new requests; captured pods stay captured");
    let _ = stop_tx.send(true);
    serve.await?;
    for http_task in http_tasks {
        http_task.await??;
    }
    // The pass in progress ends before anything is uninstalled: nothing is put back after.
    if let Some(verifier) = verifier {
        verifier.await?;
    }
    if let (Some((watcher, config)), Some((client, _)), Some((departure, features))) =
        (installer, kube_node, standing)
    {
        // The watcher would put back what an uninstall removes.
        drop(watcher);
        let probes = node
            .ambient_on
            .then(|| (args.node_netns.clone(), args.iptables_flavour));
        lifecycle::uninstall_if_deleted(&client, &departure, &features, config, hand_back, probes)
            .await;
    }
    info!("stopped");
    Ok(())
}

/// Readiness held for good when the agent lacks a capability every backend needs (named, with
/// what needs it): a runtime or policy removed what the DaemonSet adds, and every capture would
/// fail with `EPERM`.
fn capability_hold() -> Option<watch::Receiver<Option<String>>> {
    let why = match privilege::effective() {
        Ok(caps) => privilege::missing(caps)?,
        Err(err) => {
            tracing::warn!(error = %err, "reading this process's capabilities");
            return None;
        }
    };
    tracing::error!("{why}");
    Some(watch::channel(Some(why)).1)
}

/// Where pods come from: a manifest directory, or this node's pods from the API server (with
/// the client and the node's name, for the controllers; its watch's refusals held against
/// readiness by `holds`).
async fn pod_source(
    args: &RunArgs,
    holds: Option<&Holds>,
) -> anyhow::Result<(PodSource, Option<KubeNode>)> {
    Ok(match args.pods {
        PodSourceKind::Dir => {
            let dir = args
                .pod_dir
                .clone()
                .context("--pod-dir is required with --pods dir")?;
            (PodSource::Dir(DirPods::new(dir)), None)
        }
        PodSourceKind::Kube => {
            let node = args
                .node_name
                .clone()
                .context("--node-name (or NODE_NAME) is required with --pods kube")?;
            let client = kube::Client::try_default()
                .await
                .context("building a Kubernetes client (in-cluster config or $KUBECONFIG)")?;
            let health = holds.map(|h| h.health.clone()).unwrap_or_default();
            let source = PodSource::Kube(KubePods::start(client.clone(), node.clone(), health));
            (source, Some((client, node)))
        }
    })
}

/// Where the eBPF backend's layout is and how its programs attach, as the agent's settings say.
fn ebpf_config(args: &RunArgs, paths: &Paths) -> EbpfConfig {
    EbpfConfig {
        cgroup_root: paths.cgroup_root.clone(),
        bpffs_dir: paths.bpffs_dir.clone(),
        tc_attach: args.tc_attach.unwrap_or_default(),
        handoff: args.handoff.unwrap_or_default(),
    }
}

/// What the node captures with, and how it decides.
struct Node {
    router: Router,
    /// Why the node's backend.
    reason: String,
    probe: Option<ProbeReport>,
    ambient: Option<Arc<Ambient>>,
    ambient_on: bool,
    settings: NodeSettings,
    /// The sidecar pods istio-cni captured, to adopt before the plugin's socket is served.
    istio_sidecars: Vec<IstioCaptured>,
}

/// Opens the node's backend, reconciles what an earlier agent left with the live pods, and,
/// with ambient mode on, opens ambient mode around the backend that captures its pods; the
/// router sends each mode to its backend.
async fn open_node(
    args: &RunArgs,
    paths: &Paths,
    kube: Option<(&kube::Client, &PodFeed)>,
) -> anyhow::Result<Node> {
    let rules = RulesPath {
        state_dir: paths.state_dir.clone(),
        flavour: args.iptables_flavour,
        nftables: native_nftables()?,
    };
    let ebpf = ebpf_config(args, paths);
    let ambient_config = ambient_config()?;
    // Before anything is served: the sidecar pods istio-cni captured are adopted before the
    // first request about one of them.
    let istio_sidecars = match kube {
        Some((client, pods)) => {
            let settings = args.node_settings(ambient_config.clone());
            IstioCaptured::on_node(client, pods, &settings, &netns_dir()).await
        }
        None => Vec::new(),
    };
    let choice = args.backend;
    let adopting = !istio_sidecars.is_empty();
    let (Chosen { backend, ebpf }, reason, probe) = {
        let rules = rules.clone();
        tokio::task::spawn_blocking(move || open_backend(choice, &rules, ebpf, adopting)).await??
    };
    info!(backend = backend.name(), %reason, cgroup_root = %paths.cgroup_root.display(), bpffs_dir = %paths.bpffs_dir.display(), "backend chosen");
    let reconciling = backend.clone();
    let gone = tokio::task::spawn_blocking(move || reconciling.prune_gone())
        .await?
        .context("reconciling the captures of a previous run with live pods")?;
    info!(
        dropped = gone.len(),
        "reconciled with live pods: captures whose netns is gone dropped"
    );
    let ambient = match ambient_config.clone() {
        None => None,
        Some(config) => {
            let (state_dir, flavour, socket, node_netns) = (
                paths.state_dir.clone(),
                args.iptables_flavour,
                args.ztunnel_socket.clone(),
                args.node_netns.clone(),
            );
            // Istio's host rules follow `global.nativeNftables`, whichever backend captures.
            let probes = if rules.nftables {
                ProbeWay::Nftables {
                    host_proc: args.host_proc.clone(),
                }
            } else {
                ProbeWay::Ipset
            };
            let api = kube.map(|(client, _)| client.clone());
            let in_kernel = in_kernel_ambient(ebpf.is_some(), &reason)?;
            // Before ztunnel's socket is served: the pods istio-cni enrolled are in its first
            // snapshot.
            let istio_enrolled = match kube {
                Some((client, pods)) => {
                    let settings = args.node_settings(Some(config.clone()));
                    let state = &paths.state_dir;
                    IstioEnrolled::on_node(client, pods, &settings, &netns_dir(), state).await
                }
                None => Vec::new(),
            };
            let ambient = tokio::task::spawn_blocking(move || -> anyhow::Result<Ambient> {
                let in_pod = RulesPath {
                    state_dir: state_dir.join("ambient"),
                    ..rules
                };
                let (now, earlier) = ambient_ways(ebpf, in_kernel, &in_pod)?;
                let places = AmbientPlaces {
                    state_dir: &state_dir,
                    socket: &socket,
                    node_netns,
                    flavour,
                    probes,
                    istio_enrolled,
                };
                Ok(Ambient::open(config, now, earlier, places, api)?)
            })
            .await?
            .context("starting ambient mode")?;
            info!(ztunnel_socket = %args.ztunnel_socket.display(), capture = ambient.capture(), "ambient mode on: enrolled pods are captured for ztunnel");
            Some(Arc::new(ambient))
        }
    };
    let router = Router::new(backend, ambient.clone().map(|ambient| ambient as Shared));
    Ok(Node {
        router,
        reason,
        probe,
        ambient_on: ambient.is_some(),
        ambient,
        settings: args.node_settings(ambient_config),
        istio_sidecars,
    })
}

/// Binds the health, readiness and metrics listeners, before anything is opened: a port taken
/// on the node (the agent shares its network) stops the start naming the port and its use.
async fn bind_endpoints(paths: &Paths) -> anyhow::Result<Vec<http::Bound>> {
    let mut bound = Vec::new();
    for (addr, serves) in http::listeners(&paths.endpoints) {
        let listener = http::Bound::bind(addr, serves).await?;
        let addr = listener.local_addr()?;
        info!(%addr, ?serves, "health and metrics endpoint listening");
        bound.push(listener);
    }
    Ok(bound)
}

/// Serves the bound endpoints and binds and serves the plugin socket until `stop` says so;
/// their tasks.
async fn serve(
    args: &RunArgs,
    paths: &Paths,
    endpoints: Vec<http::Bound>,
    hub: &Arc<Hub>,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<(
    Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    tokio::task::JoinHandle<()>,
)> {
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let http_tasks = endpoints
        .into_iter()
        .map(|bound| tokio::spawn(bound.serve(hub.clone(), stopped(stop.clone()))))
        .collect();
    let server = Server::bind(ServerConfig {
        path: paths.socket.clone(),
        io_timeout: Duration::from_secs(args.io_timeout_seconds),
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        max_connections: args.max_connections,
    })
    .await?;
    hub.readiness().set_serving(true);
    let serve = tokio::spawn(server.serve(hub.clone(), stopped(stop.clone())));
    Ok((http_tasks, serve))
}

/// What the controllers that capture running pods in place work with besides the hub.
struct Controllers {
    events: EventSink,
    ambient: Option<Arc<Ambient>>,
    settings: NodeSettings,
    /// Where they look for a running pod's netns.
    netns_dir: PathBuf,
    repair: RepairConfig,
    /// Their watches' refusals, held against readiness.
    health: WatchHealth,
}

/// The controllers that follow this node's pods, fed from its one pod watch (`pods`): the
/// repair controller, and, with ambient mode on, live enrollment.
fn start_controllers(client: &kube::Client, pods: &PodFeed, hub: &Arc<Hub>, with: Controllers) {
    if let Some(repairer) = Repairer::new(
        client.clone(),
        with.repair,
        hub.clone(),
        with.events,
        with.netns_dir.clone(),
    ) {
        tokio::spawn(repairer.run(pods.subscribe()));
    } else {
        info!("repair controller off (repair.enabled, or no repair mode set)");
    }
    if let Some(ambient) = with.ambient {
        let live = LiveEnrollment::new(
            client.clone(),
            hub.clone(),
            ambient,
            with.settings,
            with.netns_dir,
        );
        tokio::spawn(live.run(pods.subscribe(), with.health));
    }
}
