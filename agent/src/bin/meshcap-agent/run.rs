//! `meshcap-agent run`: the daemon. Opens the backend (probing the kernel for `auto`), the pod
//! source and the plugin socket, installs the plugin and keeps it chained, serves until
//! SIGTERM, and removes the node's startup taint once pods can be captured.
use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use meshcap_agent::{
    ambient::Ambient,
    api::{Server, ServerConfig, http},
    backend::{
        BackendChoice, CaptureBackend,
        ebpf::{self, EbpfBackend, EbpfConfig},
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
    },
    capture::{Capture, Settings},
    enrollment::LiveEnrollment,
    events::EventSink,
    install::{self, watch::InstallStatus},
    paths::AgentPaths,
    pods::{PodSource, Retry, dir::DirPods, kube::KubePods},
    policy::{
        SelectConfig,
        ambient::{AmbientConfig, EnablementSelector},
    },
    probe::{self, ProbeReport},
    repair::{RepairConfig, Repairer},
    settings, taint, ztunnel,
};
use tokio::sync::watch;
use tracing::{info, warn};

#[derive(Clone, Copy, ValueEnum)]
pub enum PodSourceKind {
    /// The Kubernetes API (in-cluster, or $KUBECONFIG): a watch of this node's pods.
    Kube,
    /// A directory of pod manifests (standalone, no cluster).
    Dir,
}

#[derive(Args)]
pub struct RunArgs {
    /// A private agent beside the DaemonSet's (or another private one): derives the socket,
    /// state directory, bpffs directory, cgroup and endpoint from NAME so that nothing is
    /// shared (docs/standalone.md). Each of them can still be set on its own.
    #[arg(long, env = "MESHCAP_INSTANCE", value_name = "NAME")]
    instance: Option<String>,
    /// The plugin socket (root only, mode 0600) [default: /var/run/meshcap/agent.sock].
    #[arg(long, env = "MESHCAP_SOCKET")]
    socket: Option<PathBuf>,
    /// Where pods come from.
    #[arg(long, value_enum, default_value = "kube")]
    pods: PodSourceKind,
    /// The manifest directory, with `--pods dir`.
    #[arg(long, required_if_eq("pods", "dir"))]
    pod_dir: Option<PathBuf>,
    /// This node's name, with `--pods kube` (the DaemonSet passes spec.nodeName).
    #[arg(long, env = settings::NODE_NAME_ENV, required_if_eq("pods", "kube"))]
    node_name: Option<String>,
    /// Lookups of a pod the source does not have yet, at ADD.
    #[arg(long, default_value_t = 10)]
    pod_lookup_attempts: u32,
    /// Milliseconds between two lookups.
    #[arg(long, default_value_t = 500)]
    pod_lookup_interval_ms: u64,
    /// Seconds between two looks for captures whose netns went without a DEL this agent saw
    /// (a DEL that came while an earlier agent was down); they are dropped.
    #[arg(long, default_value_t = 60)]
    gone_check_seconds: u64,
    /// Namespaces never captured (also decided by the plugin; repeat or comma-separate).
    #[arg(long, env = settings::EXCLUDE_NAMESPACES.env, value_delimiter = ',', default_value = settings::EXCLUDE_NAMESPACES.default)]
    exclude_namespaces: Vec<String>,
    /// The capture backend: auto probes the kernel.
    #[arg(long, env = settings::MODE.env, value_enum, default_value_t)]
    backend: BackendChoice,
    /// The iptables implementation of the iptables backend (auto: as Istio decides).
    #[arg(long, value_enum, default_value_t)]
    iptables_flavour: FlavourChoice,
    /// The cgroup v2 directory the eBPF programs attach to (default: the cgroup2 mount): only
    /// processes in it are captured.
    #[arg(long, env = settings::CGROUP_ROOT_ENV)]
    cgroup_root: Option<PathBuf>,
    /// The bpffs directory the eBPF backend pins under (versioned: a new layout gets a new
    /// directory, never a reinterpreted old pin) [default: /sys/fs/bpf/meshcap/v3].
    #[arg(long, env = settings::BPFFS_DIR_ENV)]
    bpffs_dir: Option<PathBuf>,
    /// How pods' inbound programs attach (default: netlink TC on every kernel; TCX, Linux
    /// 6.6+, when asked for: it costs two RCU grace periods per pod). Tests force TCX to keep
    /// that path covered.
    #[arg(long, env = "MESHCAP_TC_ATTACH", value_enum, hide = true)]
    tc_attach: Option<ebpf::TcAttach>,
    /// Which pods get the socket lookup hand-off of inbound connections (default: where the
    /// kernel's bpf_sk_assign refuses SO_REUSEPORT listeners, before Linux 6.5); `always`
    /// sends every captured inbound connection through it, for benchmarks only (`cargo xtask
    /// bench --only inbound` measures its cost on a kernel that never needs it).
    #[arg(long, env = "MESHCAP_HANDOFF", value_enum, hide = true)]
    handoff: Option<ebpf::Handoff>,
    /// Install `meshcap-cni` into the CNI bin dir and chain it into the runtime's conflist,
    /// and keep it there (the DaemonSet's settings: cniBinDir, cniConfDir, chained, ...).
    /// Never removed on exit: pods created while the agent is away wait instead of starting
    /// uncaptured (`meshcap-agent uninstall` removes it).
    #[arg(long, env = settings::INSTALL_CNI_ENV)]
    install_cni: bool,
    /// The `meshcap-cni` binary to install (default: beside this binary).
    #[arg(long, env = "MESHCAP_PLUGIN_BINARY")]
    plugin_binary: Option<PathBuf>,
    /// With `--pods kube`: the taint removed from this node once meshcap is ready (empty: none).
    #[arg(long, env = settings::STARTUP_TAINT.env, default_value = settings::STARTUP_TAINT.default)]
    startup_taint: String,
    /// The agent's own state (records of applied iptables rules, xtables locks); locked while
    /// the agent runs, so a second agent on it waits for the first to exit
    /// [default: /var/run/meshcap].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Health, readiness and metrics endpoint (`/healthz`, `/readyz`, `/metrics`)
    /// [default: 0.0.0.0:15022].
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Seconds to read a request or write a response on the socket.
    #[arg(long, default_value_t = 5)]
    io_timeout_seconds: u64,
    /// Seconds to handle one request (pod lookups included); keep below the plugin's timeout.
    #[arg(long, default_value_t = 25)]
    request_timeout_seconds: u64,
    /// Connections served at once.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Where ztunnel connects in ambient mode (`ambient.enabled`; Istio's
    /// `ZTUNNEL_UDS_ADDRESS`).
    #[arg(long, env = "MESHCAP_ZTUNNEL_SOCKET", default_value = ztunnel::DEFAULT_SOCKET)]
    ztunnel_socket: PathBuf,
    /// The node's network namespace, where ambient mode SNATs kubelet's probes (Istio's
    /// `ISTIO_POSTRT` and `istio-inpod-probes` sets). Unset: the agent's own, which is the
    /// node's in the DaemonSet (host network).
    #[arg(long, env = settings::NODE_NETNS_ENV)]
    node_netns: Option<PathBuf>,
}

/// Istio's `ambient.*` values from the environment the DaemonSet maps them to: `None` when
/// ambient mode is off.
fn ambient_config() -> anyhow::Result<Option<AmbientConfig>> {
    let lookup = |name: &str| std::env::var(name).ok();
    if !settings::bool_setting(&lookup, settings::AMBIENT_ENABLED)? {
        return Ok(None);
    }
    let selectors = settings::AMBIENT_ENABLEMENT_SELECTORS;
    let text = lookup(selectors.env).unwrap_or_else(|| selectors.default.to_owned());
    let parsed: Vec<EnablementSelector> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: {text:?} is not a list of enablement selectors",
            selectors.env
        )
    })?;
    let mut config = AmbientConfig::new(parsed).with_context(|| selectors.env.to_owned())?;
    config.dns_capture = settings::bool_setting(&lookup, settings::AMBIENT_DNS_CAPTURE)?;
    config.ipv6 = settings::bool_setting(&lookup, settings::AMBIENT_IPV6)?;
    config.reconcile_on_startup =
        settings::bool_setting(&lookup, settings::AMBIENT_RECONCILE_IPTABLES_ON_STARTUP)?;
    if let Some(namespace) = lookup(settings::POD_NAMESPACE_ENV) {
        // ztunnel runs in the namespace Istio is installed in, which is this agent's.
        config.system_namespace = namespace;
    }
    Ok(Some(config))
}

/// Whether `ambient.inKernel` asks for ambient pods to be captured by the eBPF backend; where it
/// does not serve the node, the setting gives way (said here) and they get Istio's in-pod
/// rules. (ztunnel's listeners have
/// `SO_REUSEPORT`: before Linux 6.5 its inbound goes through the pods' socket lookup program,
/// as a sidecar's does, docs/ebpf.md.)
fn in_kernel_ambient(ebpf: Option<&Arc<EbpfBackend>>) -> anyhow::Result<bool> {
    let lookup = |name: &str| std::env::var(name).ok();
    if !settings::bool_setting(&lookup, settings::AMBIENT_IN_KERNEL)? {
        return Ok(false);
    }
    if ebpf.is_none() {
        warn!(
            setting = settings::AMBIENT_IN_KERNEL.key,
            "the eBPF backend does not serve this node: ambient pods get Istio's in-pod rules"
        );
    }
    Ok(true)
}

/// Where this agent keeps what it owns, every path resolved.
struct Paths {
    socket: PathBuf,
    state_dir: PathBuf,
    bpffs_dir: PathBuf,
    cgroup_root: PathBuf,
    http_listen: SocketAddr,
}

impl RunArgs {
    /// Each path as set, else as `--instance` derives it, else the DaemonSet's default. An
    /// instance's cgroup is created under the cgroup2 mount when missing.
    fn paths(&self) -> anyhow::Result<Paths> {
        let base = match &self.instance {
            Some(name) => AgentPaths::instance(name).map_err(anyhow::Error::msg)?,
            None => AgentPaths::default(),
        };
        let cgroup_root = match &self.cgroup_root {
            Some(root) => root.clone(),
            None => {
                let root = meshcap_agent::cgroup::cgroup2_mount()
                    .context("finding the cgroup2 mount")?
                    .join(&base.cgroup);
                std::fs::create_dir_all(&root)
                    .with_context(|| format!("creating the cgroup {}", root.display()))?;
                root
            }
        };
        Ok(Paths {
            socket: self.socket.clone().unwrap_or(base.socket),
            state_dir: self.state_dir.clone().unwrap_or(base.state_dir),
            bpffs_dir: self.bpffs_dir.clone().unwrap_or(base.bpffs_dir),
            cgroup_root,
            http_listen: self.http_listen.unwrap_or(base.http_listen),
        })
    }
}

/// The backend to use, why, and the probe's findings.
/// The backend chosen, and the eBPF backend itself when it is that one (ambient mode can
/// capture its pods with it).
struct Chosen {
    backend: Arc<dyn CaptureBackend>,
    ebpf: Option<Arc<EbpfBackend>>,
}

fn open_backend(
    choice: BackendChoice,
    iptables: IptablesConfig,
    ebpf: EbpfConfig,
) -> anyhow::Result<(Chosen, String, Option<ProbeReport>)> {
    let iptables = || -> anyhow::Result<Chosen> {
        Ok(Chosen {
            backend: Arc::new(IptablesBackend::new(&iptables)?),
            ebpf: None,
        })
    };
    let open_ebpf = |ebpf| -> anyhow::Result<Chosen> {
        let backend = EbpfBackend::open(ebpf).context("opening the eBPF backend")?;
        if !backend.forward_kernel_logs()? {
            warn!("the programs' own log records will not reach this log");
        }
        let backend = Arc::new(backend);
        Ok(Chosen {
            backend: backend.clone(),
            ebpf: Some(backend),
        })
    };
    match choice {
        BackendChoice::Iptables => Ok((iptables()?, "forced by --backend iptables".into(), None)),
        BackendChoice::Ebpf => Ok((open_ebpf(ebpf)?, "forced by --backend ebpf".into(), None)),
        BackendChoice::Auto => {
            let report = probe::run();
            if report.ok() {
                let reason = "auto: the kernel passed every probe".to_owned();
                return Ok((open_ebpf(ebpf)?, reason, Some(report)));
            }
            let reason = format!(
                "auto: the kernel cannot run the eBPF backend ({})",
                report.failures()
            );
            warn!(%reason, "using the iptables backend");
            Ok((iptables()?, reason, Some(report)))
        }
    }
}

#[tokio::main]
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Before anything else: a SIGTERM that arrives while the agent starts (a rollout, or the
    // DaemonSet deleted right after a restart) must end in the same orderly shutdown, not in
    // the default action that skips the uninstall.
    let mut shutdown = ShutdownSignal::register()?;
    let mut kube_node = None;
    let source = match args.pods {
        PodSourceKind::Dir => {
            let dir = args
                .pod_dir
                .clone()
                .context("--pod-dir is required with --pods dir")?;
            PodSource::Dir(DirPods::new(dir))
        }
        PodSourceKind::Kube => {
            let node = args
                .node_name
                .clone()
                .context("--node-name (or NODE_NAME) is required with --pods kube")?;
            let client = kube::Client::try_default()
                .await
                .context("building a Kubernetes client (in-cluster config or $KUBECONFIG)")?;
            kube_node = Some((client.clone(), node.clone()));
            PodSource::Kube(KubePods::start(client, node))
        }
    };
    let paths = args.paths()?;
    let iptables = IptablesConfig {
        state_dir: paths.state_dir.clone(),
        flavour: args.iptables_flavour,
    };
    let ebpf = EbpfConfig {
        cgroup_root: paths.cgroup_root.clone(),
        bpffs_dir: paths.bpffs_dir.clone(),
        tc_attach: args.tc_attach.unwrap_or_default(),
        handoff: args.handoff.unwrap_or_default(),
    };
    // Held until the process ends: nothing below may run beside another agent's writes.
    let _instance = tokio::select! {
        held = lock_state_dir(&paths.state_dir) => held?,
        () = shutdown.received() => {
            info!("stopped while waiting for the other agent: nothing was started");
            return Ok(());
        }
    };
    let choice = args.backend;
    let (Chosen { backend, ebpf }, reason, probe) =
        tokio::task::spawn_blocking(move || open_backend(choice, iptables, ebpf)).await??;
    info!(backend = backend.name(), %reason, cgroup_root = %paths.cgroup_root.display(), bpffs_dir = %paths.bpffs_dir.display(), "backend chosen");
    let reconciling = backend.clone();
    let gone = tokio::task::spawn_blocking(move || reconciling.prune_gone())
        .await?
        .context("reconciling the captures of a previous run with live pods")?;
    info!(
        dropped = gone.len(),
        "reconciled with live pods: captures whose netns is gone dropped"
    );
    let ambient = match ambient_config()? {
        None => None,
        Some(config) => {
            let (state_dir, flavour, socket, node_netns) = (
                paths.state_dir.clone(),
                args.iptables_flavour,
                args.ztunnel_socket.clone(),
                args.node_netns.clone(),
            );
            let api = kube_node.as_ref().map(|(client, _)| client.clone());
            let in_kernel = in_kernel_ambient(ebpf.as_ref())?;
            let kernel = ebpf.clone();
            let ambient = tokio::task::spawn_blocking(move || {
                Ambient::open(
                    config, &state_dir, flavour, &socket, api, node_netns, kernel, in_kernel,
                )
            })
            .await?
            .context("starting ambient mode")?;
            info!(ztunnel_socket = %args.ztunnel_socket.display(), capture = ambient.capture(), "ambient mode on: enrolled pods are captured for ztunnel");
            Some(Arc::new(ambient))
        }
    };
    let capture = Arc::new(Capture::new(
        source,
        backend,
        reason,
        probe,
        Settings {
            retry: Retry {
                attempts: args.pod_lookup_attempts,
                interval: Duration::from_millis(args.pod_lookup_interval_ms),
            },
            select: SelectConfig {
                exclude_namespaces: args.exclude_namespaces.clone(),
            },
            socket: paths.socket.clone(),
        },
    ));
    if let Some(ambient) = &ambient {
        capture.serve_ambient(ambient.clone());
    }
    tokio::spawn(log_warnings(capture.clone()));
    tokio::spawn(drop_gone(
        capture.clone(),
        Duration::from_secs(args.gone_check_seconds.max(1)),
    ));
    // Readiness waits for the plugin to be chained from the first answer on: the endpoint and
    // the socket come up before the first install ends (copying the binaries can take seconds),
    // and a ready agent whose plugin is not in the chain would let pods start uncaptured.
    let (install_tx, install_rx) = watch::channel(InstallStatus::Starting);
    if args.install_cni {
        capture.watch_install(install_rx.clone());
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let (http_addr, http_server) =
        http::bind(paths.http_listen, capture.clone(), stopped(stop_rx.clone()))
            .await
            .with_context(|| format!("binding --http-listen {}", paths.http_listen))?;
    info!(%http_addr, "health and metrics endpoint listening");
    let http_task = tokio::spawn(http_server);

    let server = Server::bind(ServerConfig {
        path: paths.socket.clone(),
        io_timeout: Duration::from_secs(args.io_timeout_seconds),
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        max_connections: args.max_connections,
    })
    .await?;
    capture.set_serving(true);
    let serve = tokio::spawn(server.serve(capture.clone(), stopped(stop_rx)));

    let installer = if args.install_cni {
        let metrics = capture.clone();
        Some(start_install(
            &args,
            &paths.socket,
            install_tx,
            move || {
                metrics.metrics().count_install();
            },
        )?)
    } else {
        None
    };
    if installer.is_some() {
        tokio::spawn(track_install(capture.clone(), install_rx.clone()));
    }
    if let Some((client, node)) = &kube_node {
        let events = EventSink::new(client.clone(), node);
        capture.publish_events(events.clone());
        let config = RepairConfig::from_settings(|name| std::env::var(name).ok())?;
        if let Some(repairer) = Repairer::new(
            client.clone(),
            node.clone(),
            config,
            capture.clone(),
            events,
            meshcap_agent::paths::NETNS_DIR.into(),
        ) {
            tokio::spawn(repairer.run());
        } else {
            info!("repair controller off (repair.enabled, or no repair mode set)");
        }
        if let Some(ambient) = &ambient {
            let live = LiveEnrollment::new(
                client.clone(),
                node.clone(),
                capture.clone(),
                ambient.clone(),
                args.exclude_namespaces.clone(),
                meshcap_agent::paths::NETNS_DIR.into(),
            );
            tokio::spawn(live.run());
        }
    }
    if let Some((client, node)) = kube_node.clone()
        && !args.startup_taint.is_empty()
    {
        let gate = args.install_cni.then_some(install_rx);
        tokio::spawn(untaint_when_ready(
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
    http_task.await??;
    if let (Some((watcher, config)), Some((client, _))) = (installer, kube_node) {
        // The watcher would put back what an uninstall removes.
        drop(watcher);
        let probes = ambient
            .is_some()
            .then(|| (args.node_netns.clone(), args.iptables_flavour));
        uninstall_if_deleted(&client, config, paths.bpffs_dir, probes).await;
    }
    info!("stopped");
    Ok(())
}

/// Stopped because meshcap is being deleted from the cluster (its DaemonSet gone or being
/// deleted, as `kubectl delete -f deploy/` does): removes the plugin from this node, so new pods
/// no longer wait for an agent that will never come back, and the eBPF programs once no pod
/// they capture lives. On a rolling update, a restart, an eviction or a drain the DaemonSet is
/// there and nothing is removed; when the API server cannot be asked, nothing is either.
/// With ambient mode on, `probes` (the node's netns and iptables) says where its probe rule
/// and sets go from.
async fn uninstall_if_deleted(
    client: &kube::Client,
    config: install::InstallConfig,
    bpffs_dir: PathBuf,
    probes: Option<(Option<PathBuf>, FlavourChoice)>,
) {
    let (Ok(namespace), Ok(pod)) = (
        std::env::var(settings::POD_NAMESPACE_ENV),
        std::env::var(settings::POD_NAME_ENV),
    ) else {
        return;
    };
    let why = match meshcap_agent::uninstall::is_being_deleted(client, &namespace, &pod).await {
        Ok(Some(why)) => why,
        Ok(None) => {
            info!("meshcap stays installed on this node (a restart, an update or a drain)");
            return;
        }
        Err(err) => {
            warn!(error = %err, "cannot tell whether meshcap is being deleted: it stays installed");
            return;
        }
    };
    info!(%why, "meshcap is being deleted: uninstalling it from this node");
    let removed = tokio::task::spawn_blocking(move || {
        if let Some((netns, flavour)) = probes {
            meshcap_agent::uninstall::probes(netns.as_deref(), flavour)?;
        }
        meshcap_agent::uninstall::node(Some(&config), &bpffs_dir)
    })
    .await;
    match removed {
        Ok(Ok(removed)) => {
            for (dir, pods) in &removed.kept {
                warn!(layout = %dir.display(), pods = %pods.join(", "), "eBPF programs kept: pods they capture still run (restart them; a node reboot or `meshcap-agent uninstall` then removes the programs)");
            }
            info!(layouts = removed.layouts.len(), "uninstalled");
        }
        Ok(Err(err)) => warn!(error = %err, "uninstalling"),
        Err(err) => warn!(error = %err, "uninstalling"),
    }
}

/// Keeps the install-ready gauge with the installation's state.
async fn track_install(capture: Arc<Capture>, mut status: watch::Receiver<InstallStatus>) {
    loop {
        let installed = status.borrow_and_update().is_installed();
        capture.metrics().set_install_ready(installed);
        if status.changed().await.is_err() {
            return;
        }
    }
}

/// Drops, every `every`, the captures whose netns went without a DEL this agent saw (see
/// [`Capture::drop_gone`]); the start-up reconciliation has done it once already.
async fn drop_gone(capture: Arc<Capture>, every: Duration) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let dropped = capture.drop_gone().await;
        if dropped > 0 {
            info!(
                dropped,
                "dropped the captures of pods whose netns went without a DEL"
            );
        }
    }
}

/// How often the backend's warnings are looked for.
const WARNINGS_EVERY: Duration = Duration::from_secs(60);

/// Logs each of the backend's warnings when it first appears (checked at start and every
/// [`WARNINGS_EVERY`]; `meshcap-agent status` shows the current ones), and keeps the metric
/// of other programs on its hooks current.
async fn log_warnings(capture: Arc<Capture>) {
    let mut logged = std::collections::HashSet::new();
    loop {
        let current = capture.check_backend().await;
        for warning in &current {
            if !logged.contains(warning) {
                warn!("{warning}");
            }
        }
        logged = current.into_iter().collect();
        tokio::time::sleep(WARNINGS_EVERY).await;
    }
}

/// Installs the plugin and keeps its conflist entry in place (a watcher thread); the returned
/// watcher must live as long as the agent.
fn start_install(
    args: &RunArgs,
    socket: &std::path::Path,
    status: watch::Sender<InstallStatus>,
    on_write: impl Fn() + Send + 'static,
) -> anyhow::Result<(install::watch::Watcher, install::InstallConfig)> {
    let plugin = match &args.plugin_binary {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .context("locating meshcap-agent")?
            .with_file_name("meshcap-cni"),
    };
    let mut config = settings::install_config(|name| std::env::var(name).ok(), plugin)?;
    socket.clone_into(&mut config.plugin.agent_socket);
    // While this agent is down, the plugin decides from the same source it uses: a copy of this
    // binary beside the plugin, and the API server's credentials or the manifest directory.
    config.decider_source = Some(std::env::current_exe().context("locating meshcap-agent")?);
    match args.pods {
        PodSourceKind::Kube => {
            config.kubeconfig_source =
                install::kubeconfig::Source::of_this_agent(|name| std::env::var(name).ok());
            if config.kubeconfig_source.is_some() {
                config.plugin.kubeconfig =
                    Some(config.cni_conf_dir.join(install::KUBECONFIG_FILE_NAME));
            }
        }
        PodSourceKind::Dir => config.plugin.pod_dir.clone_from(&args.pod_dir),
    }
    info!(conf_dir = %config.cni_conf_dir.display(), bin_dir = %config.cni_bin_dir.display(), chained = config.chained, "installing meshcap-cni");
    Ok((
        install::watch::spawn(config.clone(), status, on_write)?,
        config,
    ))
}

/// Removes the node's startup taint once pods can be captured: the agent serves and, when it
/// installs the plugin, the plugin is chained in. Retries until it succeeds.
async fn untaint_when_ready(
    client: kube::Client,
    node: String,
    key: String,
    install: Option<watch::Receiver<InstallStatus>>,
) {
    if let Some(mut install) = install
        && install.wait_for(InstallStatus::is_installed).await.is_err()
    {
        return;
    }
    loop {
        match taint::remove(client.clone(), &node, &key).await {
            Ok(removal) => {
                info!(%node, %key, ?removal, "startup taint handled: the node may run pods");
                return;
            }
            Err(err) => {
                warn!(%node, %key, "removing the startup taint: {err}; retrying in 5s");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// Takes the state directory's lock; while another agent holds it (an operator's `run` beside
/// the DaemonSet's, or a predecessor still shutting down), says so once and waits.
async fn lock_state_dir(
    dir: &std::path::Path,
) -> anyhow::Result<meshcap_agent::instance::Exclusive> {
    let mut told = false;
    loop {
        if let Some(held) = meshcap_agent::instance::try_lock(dir)
            .with_context(|| format!("locking the state directory {}", dir.display()))?
        {
            return Ok(held);
        }
        if !told {
            warn!(state_dir = %dir.display(), "another meshcap-agent holds this state directory: waiting for it to exit");
            told = true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGTERM and SIGINT, caught from the moment the agent starts; a signal that arrives before
/// the agent waits for it is kept until then.
struct ShutdownSignal {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    fn register() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("catching SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("catching SIGINT")?,
        })
    }

    async fn received(&mut self) {
        tokio::select! {
            _ = self.term.recv() => info!("SIGTERM"),
            _ = self.int.recv() => info!("SIGINT"),
        }
    }
}
