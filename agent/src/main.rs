//! `meshcap-agent`: the node daemon. Subcommands are the agent's user interface.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use meshcap_agent::{
    api::{Server, ServerConfig, http},
    backend::{
        BackendChoice, CaptureBackend,
        ebpf::{self, EbpfBackend, EbpfConfig},
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
    },
    bpf,
    capture::{Capture, Settings},
    install::{self, watch::InstallStatus},
    logging,
    pods::{PodSource, Retry, dir::DirPods, kube::KubePods},
    policy::{self, SelectConfig},
    probe::{self, ProbeReport},
    settings,
    status::StatusReport,
    taint,
};
use meshcap_cni::protocol::{self, Op, Reply, Request};
use tokio::sync::watch;
use tracing::{info, warn};

#[derive(Parser)]
#[command(name = "meshcap-agent", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t, global = true)]
    log_format: logging::LogFormat,
    /// Log level (`error`, `warn`, `info`, `debug`, `trace`, or a `RUST_LOG` filter, which
    /// takes precedence when set).
    #[arg(long, env = settings::LOG_LEVEL.env, default_value = settings::LOG_LEVEL.default, global = true)]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load every embedded kernel program (the verifier checks each) and report.
    Verify,
    /// A real uninstall (restarts and upgrades never do this): remove meshcap's plugin entry
    /// and binary from this node's CNI set-up, then detach and unpin the eBPF programs of every
    /// layout version, except those still capturing a live pod (it then fails, naming them:
    /// restart those pods and run it again). Reads the same MESHCAP_* settings as `run`.
    Uninstall {
        /// The eBPF layout directory; other versions beside it (`…/v<N>`) are removed too.
        #[arg(long, env = settings::BPFFS_DIR_ENV, default_value = ebpf::DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
    },
    /// Run the node agent: serve the CNI plugin, capture pods.
    Run(Box<RunArgs>),
    /// Show what a running agent captures, with which backend and why.
    Status {
        /// The agent's plugin socket.
        #[arg(long, env = "MESHCAP_SOCKET", default_value = meshcap_cni::cni::DEFAULT_AGENT_SOCKET)]
        socket: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe the kernel for the eBPF backend's needs and print the findings.
    Probe,
    /// Show what meshcap (and Istio's CNI plugin) would do with a pod: the decision and the
    /// redirect policy, or the exact iptables rules.
    Policy {
        /// The pod manifest, YAML or JSON (`kubectl get pod NAME -o yaml`).
        #[arg(long, value_name = "FILE")]
        pod: PathBuf,
        /// The pod's addresses (default: the manifest's `status.podIPs`).
        #[arg(long = "ip", value_name = "ADDR")]
        ips: Vec<IpAddr>,
        /// Namespaces whose pods are never captured.
        #[arg(long = "exclude-namespace", value_name = "NAMESPACE", default_values_t = policy::SelectConfig::default().exclude_namespaces)]
        exclude_namespaces: Vec<String>,
        /// `json`: the decision and the policy; `iptables`: iptables-restore input (then the
        /// ip6tables-restore input after a `# ip6tables-restore` line when the pod has IPv6).
        #[arg(long, value_enum, default_value_t)]
        format: PolicyFormat,
    },
}

#[derive(Clone, Copy, Default, ValueEnum)]
enum PolicyFormat {
    #[default]
    Json,
    Iptables,
}

#[derive(Clone, Copy, ValueEnum)]
enum PodSourceKind {
    /// The Kubernetes API (in-cluster, or $KUBECONFIG): a watch of this node's pods.
    Kube,
    /// A directory of pod manifests (standalone, no cluster).
    Dir,
}

#[derive(Args)]
struct RunArgs {
    /// The plugin socket (root only, mode 0600).
    #[arg(long, env = "MESHCAP_SOCKET", default_value = meshcap_cni::cni::DEFAULT_AGENT_SOCKET)]
    socket: PathBuf,
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
    /// Namespaces never captured (also decided by the plugin; repeat or comma-separate).
    #[arg(long, env = settings::EXCLUDE_NAMESPACES.env, value_delimiter = ',', default_value = settings::EXCLUDE_NAMESPACES.default)]
    exclude_namespaces: Vec<String>,
    /// The capture backend: auto probes the kernel.
    #[arg(long, env = settings::MODE.env, value_enum, default_value_t)]
    backend: BackendChoice,
    /// The iptables implementation of the iptables backend (auto: as Istio decides).
    #[arg(long, value_enum, default_value_t)]
    iptables_flavour: FlavourChoice,
    /// The cgroup v2 directory the eBPF programs attach to (default: the cgroup2 mount).
    #[arg(long, env = settings::CGROUP_ROOT_ENV)]
    cgroup_root: Option<PathBuf>,
    /// The bpffs directory the eBPF backend pins under (versioned: a new layout gets a new
    /// directory, never a reinterpreted old pin).
    #[arg(long, env = settings::BPFFS_DIR_ENV, default_value = ebpf::DEFAULT_BPFFS_DIR)]
    bpffs_dir: PathBuf,
    /// How pods' inbound programs attach (default: netlink TC on every kernel; TCX, Linux
    /// 6.6+, when asked for: it costs two RCU grace periods per pod). Tests force TCX to keep
    /// that path covered.
    #[arg(long, env = "MESHCAP_TC_ATTACH", value_enum, hide = true)]
    tc_attach: Option<ebpf::TcAttach>,
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
    /// the agent runs, so a second agent on it waits for the first to exit.
    #[arg(long, default_value = "/var/run/meshcap")]
    state_dir: PathBuf,
    /// Health, readiness and metrics endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "0.0.0.0:15022")]
    http_listen: SocketAddr,
    /// Seconds to read a request or write a response on the socket.
    #[arg(long, default_value_t = 5)]
    io_timeout_seconds: u64,
    /// Seconds to handle one request (pod lookups included); keep below the plugin's timeout.
    #[arg(long, default_value_t = 25)]
    request_timeout_seconds: u64,
    /// Connections served at once.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = logging::init(cli.log_format, &cli.log_level) {
        eprintln!("meshcap-agent: {err:#}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Verify => verify(),
        Command::Uninstall { bpffs_dir } => uninstall(&bpffs_dir),
        Command::Run(args) => run(*args),
        Command::Status { socket, json } => status(&socket, json),
        Command::Policy {
            pod,
            ips,
            exclude_namespaces,
            format,
        } => show_policy(&pod, &ips, exclude_namespaces, format),
        Command::Probe => probe_kernel(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

fn probe_kernel() -> anyhow::Result<()> {
    let report = probe::run();
    println!("{}", serde_json::to_string_pretty(&report)?);
    if !report.ok() {
        bail!("the eBPF backend cannot run here: {}", report.failures());
    }
    Ok(())
}

fn verify() -> anyhow::Result<()> {
    let mut ebpf = bpf::open()?;
    for name in bpf::load_all(&mut ebpf)? {
        println!("verified {name}");
    }
    Ok(())
}

fn uninstall(bpffs_dir: &std::path::Path) -> anyhow::Result<()> {
    let config = settings::install_config(
        |name| std::env::var(name).ok(),
        settings::PLUGIN_SOURCE.into(),
    )?;
    install::uninstall(&config)?;
    println!(
        "removed meshcap-cni from {} and {}",
        config.cni_conf_dir.display(),
        config.cni_bin_dir.display()
    );
    let mut kept = Vec::new();
    for dir in ebpf::layout::versions(bpffs_dir) {
        if !dir.exists() {
            continue;
        }
        let live = ebpf::layout::live_pods(&dir);
        if live.is_empty() {
            ebpf::layout::remove(&dir)?;
            println!(
                "detached meshcap's eBPF programs and removed {}",
                dir.display()
            );
        } else {
            let pods: Vec<String> = live
                .iter()
                .map(|p| format!("{}/{}", p.namespace, p.name))
                .collect();
            kept.push(format!(
                "{} still captures {} pod(s): {}",
                dir.display(),
                pods.len(),
                pods.join(", ")
            ));
        }
    }
    if !kept.is_empty() {
        bail!(
            "meshcap's eBPF programs stay attached, so those pods keep their capture: {}; \
             restart them (the CNI set-up now installed handles the new ones) and run \
             `meshcap-agent uninstall` again",
            kept.join("; ")
        );
    }
    Ok(())
}

fn status(socket: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let response = protocol::call(socket, &Request::new(Op::Status), Duration::from_secs(10))?;
    match response.reply {
        Reply::Ok {
            report: Some(report),
            ..
        } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                let report: StatusReport = serde_json::from_value(report)?;
                print!("{}", report.to_text());
            }
            Ok(())
        }
        Reply::Ok { .. } => bail!("the agent sent no status report"),
        Reply::Error { msg, .. } => bail!("{msg}"),
    }
}

/// The backend to use, why, and the probe's findings.
fn open_backend(
    choice: BackendChoice,
    iptables: IptablesConfig,
    ebpf: EbpfConfig,
) -> anyhow::Result<(Arc<dyn CaptureBackend>, String, Option<ProbeReport>)> {
    let iptables = || -> anyhow::Result<Arc<dyn CaptureBackend>> {
        Ok(Arc::new(IptablesBackend::new(&iptables)?))
    };
    let open_ebpf = |ebpf| -> anyhow::Result<Arc<dyn CaptureBackend>> {
        let backend = EbpfBackend::open(ebpf).context("opening the eBPF backend")?;
        if !backend.forward_kernel_logs()? {
            warn!("the programs' own log records will not reach this log");
        }
        Ok(Arc::new(backend))
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
async fn run(args: RunArgs) -> anyhow::Result<()> {
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
    let iptables = IptablesConfig {
        state_dir: args.state_dir.clone(),
        flavour: args.iptables_flavour,
    };
    let ebpf = EbpfConfig {
        cgroup_root: match args.cgroup_root.clone() {
            Some(root) => root,
            None => meshcap_agent::cgroup::cgroup2_mount().context("finding the cgroup2 mount")?,
        },
        bpffs_dir: args.bpffs_dir.clone(),
        tc_attach: args.tc_attach.unwrap_or_default(),
    };
    // Held until the process ends: nothing below may run beside another agent's writes.
    let state_dir = args.state_dir.clone();
    let _instance = tokio::task::spawn_blocking(move || {
        meshcap_agent::instance::lock(&state_dir, || {
            warn!(state_dir = %state_dir.display(), "another meshcap-agent holds this state directory: waiting for it to exit");
        })
        .with_context(|| format!("locking the state directory {}", state_dir.display()))
    })
    .await??;
    let choice = args.backend;
    let (backend, reason, probe) =
        tokio::task::spawn_blocking(move || open_backend(choice, iptables, ebpf)).await??;
    info!(backend = backend.name(), %reason, cgroup_root = ?args.cgroup_root, bpffs_dir = %args.bpffs_dir.display(), "backend chosen");
    let reconciling = backend.clone();
    let gone = tokio::task::spawn_blocking(move || reconciling.prune_gone())
        .await?
        .context("reconciling the captures of a previous run with live pods")?;
    info!(
        dropped = gone.len(),
        "reconciled with live pods: captures whose netns is gone dropped"
    );
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
            socket: args.socket.clone(),
        },
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let (http_addr, http_server) =
        http::bind(args.http_listen, capture.clone(), stopped(stop_rx.clone()))
            .await
            .with_context(|| format!("binding --http-listen {}", args.http_listen))?;
    info!(%http_addr, "health and metrics endpoint listening");
    let http_task = tokio::spawn(http_server);

    let server = Server::bind(ServerConfig {
        path: args.socket.clone(),
        io_timeout: Duration::from_secs(args.io_timeout_seconds),
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        max_connections: args.max_connections,
    })
    .await?;
    capture.set_serving(true);
    let serve = tokio::spawn(server.serve(capture.clone(), stopped(stop_rx)));

    let (install_tx, install_rx) = watch::channel(InstallStatus::Starting);
    let _installer = if args.install_cni {
        Some(start_install(&args, install_tx)?)
    } else {
        None
    };
    if let Some((client, node)) = kube_node
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

    shutdown_signal().await?;
    info!("shutting down: no new requests; captured pods stay captured");
    let _ = stop_tx.send(true);
    serve.await?;
    http_task.await??;
    info!("stopped");
    Ok(())
}

/// Installs the plugin and keeps its conflist entry in place (a watcher thread); the returned
/// watcher must live as long as the agent.
fn start_install(
    args: &RunArgs,
    status: watch::Sender<InstallStatus>,
) -> anyhow::Result<install::watch::Watcher> {
    let plugin = match &args.plugin_binary {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .context("locating meshcap-agent")?
            .with_file_name("meshcap-cni"),
    };
    let mut config = settings::install_config(|name| std::env::var(name).ok(), plugin)?;
    config.plugin.agent_socket.clone_from(&args.socket);
    info!(conf_dir = %config.cni_conf_dir.display(), bin_dir = %config.cni_bin_dir.display(), chained = config.chained, "installing meshcap-cni");
    Ok(install::watch::spawn(config, status)?)
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

async fn shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = int.recv() => info!("SIGINT"),
    }
    Ok(())
}

fn show_policy(
    path: &std::path::Path,
    ips: &[IpAddr],
    exclude_namespaces: Vec<String>,
    format: PolicyFormat,
) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let pod = policy::parse_pod_manifest(&text).with_context(|| path.display().to_string())?;
    let ips = if ips.is_empty() {
        policy::status_pod_ips(&pod)
    } else {
        ips.to_vec()
    };
    let selection = policy::select(&pod, &ips, &policy::SelectConfig { exclude_namespaces })?;
    match format {
        PolicyFormat::Json => println!("{}", serde_json::to_string_pretty(&selection)?),
        PolicyFormat::Iptables => match selection {
            policy::Selection::Skip { reason } => println!("# not captured: {reason}"),
            policy::Selection::Capture { policy } => {
                let rules = policy.render();
                print!("{}", rules.v4);
                if let Some(v6) = rules.v6 {
                    println!("# ip6tables-restore");
                    print!("{v6}");
                }
            }
        },
    }
    Ok(())
}
