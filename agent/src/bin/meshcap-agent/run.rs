//! `meshcap-agent run`'s settings: every flag and `MESHCAP_*` variable of the daemon
//! ([`RunArgs`]), and how the ones that need it resolve (paths, ambient mode, its in-kernel
//! choice, pod lookups, the node's decision settings). What is made of them is
//! [`crate::wiring`]'s.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use meshcap_agent::{
    backend::{BackendChoice, ebpf, iptables::FlavourChoice},
    paths::{AgentPaths, Endpoints},
    pods::Retry,
    settings::{self, InKernel},
    ztunnel,
};
use meshcap_policy::{
    NodeSettings, SelectConfig,
    ambient::{AmbientConfig, EnablementSelector},
};
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
    pub(crate) instance: Option<String>,
    /// The plugin socket (root only, mode 0600) [default: /var/run/meshcap/agent.sock].
    #[arg(long, env = "MESHCAP_SOCKET")]
    pub(crate) socket: Option<PathBuf>,
    /// Where pods come from.
    #[arg(long, value_enum, default_value = "kube")]
    pub(crate) pods: PodSourceKind,
    /// The manifest directory, with `--pods dir`.
    #[arg(long, required_if_eq("pods", "dir"))]
    pub(crate) pod_dir: Option<PathBuf>,
    /// This node's name, with `--pods kube` (the DaemonSet passes spec.nodeName).
    #[arg(long, env = settings::NODE_NAME_ENV, required_if_eq("pods", "kube"))]
    pub(crate) node_name: Option<String>,
    /// Seconds between two verifications of every capture against its record: drift is put
    /// back in place, counted, logged and reported as an Event; 0 turns verification off.
    #[arg(long, env = settings::VERIFY_INTERVAL_SECONDS.env, default_value = settings::VERIFY_INTERVAL_SECONDS.default)]
    pub(crate) verify_interval_seconds: u64,
    /// Lookups of a pod the source does not have yet, at ADD.
    #[arg(long, default_value_t = 10)]
    pub(crate) pod_lookup_attempts: u32,
    /// Milliseconds between two lookups.
    #[arg(long, default_value_t = 500)]
    pub(crate) pod_lookup_interval_ms: u64,
    /// Seconds between two looks for captures whose netns went without a DEL this agent saw
    /// (a DEL that came while an earlier agent was down); they are dropped.
    #[arg(long, default_value_t = 60)]
    pub(crate) gone_check_seconds: u64,
    /// Namespaces never captured (also decided by the plugin; repeat or comma-separate).
    #[arg(long, env = settings::EXCLUDE_NAMESPACES.env, value_delimiter = ',', default_value = settings::EXCLUDE_NAMESPACES.default)]
    pub(crate) exclude_namespaces: Vec<String>,
    /// The capture backend: auto probes the kernel.
    #[arg(long, env = settings::MODE.env, value_enum, default_value_t)]
    pub(crate) backend: BackendChoice,
    /// The iptables implementation of the iptables backend (auto: as Istio decides).
    #[arg(long, value_enum, default_value_t)]
    pub(crate) iptables_flavour: FlavourChoice,
    /// The cgroup v2 directory the eBPF programs attach to (default: the cgroup2 mount): only
    /// processes in it are captured.
    #[arg(long, env = settings::CGROUP_ROOT_ENV)]
    pub(crate) cgroup_root: Option<PathBuf>,
    /// The bpffs directory the eBPF backend pins under (versioned: a new layout gets a new
    /// directory, never a reinterpreted old pin) [default: /sys/fs/bpf/meshcap/v3].
    #[arg(long, env = settings::BPFFS_DIR_ENV)]
    pub(crate) bpffs_dir: Option<PathBuf>,
    /// How pods' inbound programs attach (default: netlink TC on every kernel; TCX, Linux
    /// 6.6+, when asked for: it costs two RCU grace periods per pod). Tests force TCX to keep
    /// that path covered.
    #[arg(long, env = "MESHCAP_TC_ATTACH", value_enum, hide = true)]
    pub(crate) tc_attach: Option<ebpf::TcAttach>,
    /// Which captured inbound connections go through the socket lookup hand-off, which every
    /// captured pod gets (default: those bpf_sk_assign cannot hand over: to SO_REUSEPORT
    /// listeners before Linux 6.5, and a SYN on a 4-tuple in TIME_WAIT); `always` sends every
    /// captured inbound connection through it, for benchmarks only (`cargo xtask bench --only
    /// inbound` measures its cost on a kernel that never needs it for every connection).
    #[arg(long, env = "MESHCAP_HANDOFF", value_enum, hide = true)]
    pub(crate) handoff: Option<ebpf::Handoff>,
    /// Install `meshcap-cni` into the CNI bin dir and chain it into the runtime's conflist,
    /// and keep it there (the DaemonSet's settings: cniBinDir, cniConfDir, chained, ...).
    /// Never removed on exit: pods created while the agent is away wait instead of starting
    /// uncaptured (`meshcap-agent uninstall` removes it).
    #[arg(long, env = settings::INSTALL_CNI_ENV)]
    pub(crate) install_cni: bool,
    /// The `meshcap-cni` binary to install (default: beside this binary).
    #[arg(long, env = "MESHCAP_PLUGIN_BINARY")]
    pub(crate) plugin_binary: Option<PathBuf>,
    /// The directory holding the plugin's own token (`token`), which the agent writes into the
    /// plugin's kubeconfig [in a pod: /var/run/secrets/meshcap.io/cni, the DaemonSet's mount of
    /// the `meshcap-cni-token` Secret; with `$KUBECONFIG`: none, the file is copied as it is].
    #[arg(long, env = settings::CNI_TOKEN_DIR_ENV)]
    pub(crate) cni_token_dir: Option<PathBuf>,
    /// With `--pods kube`: the taint removed from this node once meshcap is ready (empty: none).
    #[arg(long, env = settings::STARTUP_TAINT.env, default_value = settings::STARTUP_TAINT.default)]
    pub(crate) startup_taint: String,
    /// The agent's own state (records of applied iptables rules, xtables locks); locked while
    /// the agent runs, so a second agent on it waits for the first to exit
    /// [default: /var/run/meshcap].
    #[arg(long)]
    pub(crate) state_dir: Option<PathBuf>,
    /// Health and readiness (`/healthz`, `/readyz`), on Istio's node agent's port by default
    /// (the DaemonSet: `meshcap.healthPort`) [default: 0.0.0.0:8000].
    #[arg(long, env = settings::HEALTH_LISTEN_ENV, conflicts_with = "http_listen")]
    pub(crate) health_listen: Option<SocketAddr>,
    /// Prometheus metrics (`/metrics`), on Istio's node agent's port by default (the
    /// DaemonSet: `meshcap.metricsPort`) [default: 0.0.0.0:15014].
    #[arg(long, env = settings::METRICS_LISTEN_ENV, conflicts_with = "http_listen")]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Health, readiness and metrics all on this one address instead (a private agent's
    /// default: 127.0.0.1, a port of the kernel's choosing).
    #[arg(long)]
    pub(crate) http_listen: Option<SocketAddr>,
    /// Seconds to read a request or write a response on the socket.
    #[arg(long, default_value_t = 5)]
    pub(crate) io_timeout_seconds: u64,
    /// Seconds to handle one request (pod lookups included); keep below the plugin's timeout.
    #[arg(long, default_value_t = 25)]
    pub(crate) request_timeout_seconds: u64,
    /// Connections served at once.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_connections: usize,
    /// Where ztunnel connects in ambient mode (`ambient.enabled`; Istio's
    /// `ZTUNNEL_UDS_ADDRESS`).
    #[arg(long, env = "MESHCAP_ZTUNNEL_SOCKET", default_value = ztunnel::DEFAULT_SOCKET)]
    pub(crate) ztunnel_socket: PathBuf,
    /// The node's network namespace, where ambient mode SNATs kubelet's probes (Istio's
    /// `ISTIO_POSTRT` and `istio-inpod-probes` sets). Unset: the agent's own, which is the
    /// node's in the DaemonSet (host network).
    #[arg(long, env = settings::NODE_NETNS_ENV)]
    pub(crate) node_netns: Option<PathBuf>,
    /// The host's `/proc`, where ambient mode with `global.nativeNftables` finds kubelet's uid
    /// for the node's probe rule (Istio's `/host/proc`, which the DaemonSet mounts).
    #[arg(long, env = settings::HOST_PROC_ENV, default_value = meshcap_agent::paths::HOST_PROC)]
    pub(crate) host_proc: PathBuf,
}

/// Istio's `ambient.*` values from the environment the DaemonSet maps them to: `None` when
/// ambient mode is off.
pub(crate) fn ambient_config() -> anyhow::Result<Option<AmbientConfig>> {
    let lookup = |name: &str| std::env::var(name).ok();
    if !settings::bool_setting(&lookup, settings::AMBIENT_ENABLED)? {
        return Ok(None);
    }
    let selectors = settings::AMBIENT_ENABLEMENT_SELECTORS;
    let text = lookup(selectors.env).unwrap_or_else(|| selectors.default.to_owned());
    let parsed: Vec<EnablementSelector> =
        serde_json::from_value(settings::enablement_selectors(&text)?).with_context(|| {
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

/// Warns of each setting Istio has and meshcap does not support yet that is on.
pub(crate) fn warn_not_supported() -> anyhow::Result<()> {
    for (key, instead) in settings::not_supported(&|name: &str| std::env::var(name).ok())? {
        warn!(
            setting = key,
            "not supported by meshcap yet, ignored: {instead}"
        );
    }
    Ok(())
}

/// Where the runtime keeps pods' network namespaces (`cniNetnsDir`): where the controllers
/// that capture pods in place look for them.
pub(crate) fn netns_dir() -> PathBuf {
    PathBuf::from(
        std::env::var(settings::CNI_NETNS_DIR.env)
            .unwrap_or_else(|_| settings::CNI_NETNS_DIR.default.to_owned()),
    )
}

/// Whether ambient pods are captured by the eBPF backend: as `ambient.inKernel` says, where it
/// serves the node (`kernel_serves`; `backend_reason` says why it does or not). `auto` (the
/// default) captures in the kernel wherever it can and gives way to Istio's in-pod rules
/// elsewhere; `true` where it cannot is refused, naming why, as `--backend ebpf` is on a kernel
/// that cannot run it: the agent does not start (its startup taint stays on a new node; an
/// earlier agent's plugin holds enrolled pods), so no pod starts uncaptured. (ztunnel's
/// listeners have `SO_REUSEPORT`: before Linux 6.5 its inbound goes through the pods' socket
/// lookup program, as a sidecar's does, docs/ebpf.md.)
pub(crate) fn in_kernel_ambient(kernel_serves: bool, backend_reason: &str) -> anyhow::Result<bool> {
    let lookup = |name: &str| std::env::var(name).ok();
    let key = settings::AMBIENT_IN_KERNEL.key;
    match settings::in_kernel(&lookup)? {
        InKernel::Off => Ok(false),
        InKernel::Auto if kernel_serves => Ok(true),
        InKernel::Auto => {
            info!(
                setting = key,
                backend = backend_reason,
                "auto: the eBPF backend does not serve this node, so ambient pods get Istio's in-pod rules"
            );
            Ok(false)
        }
        InKernel::Required if kernel_serves => Ok(true),
        InKernel::Required => bail!(
            "{key}=true, but the eBPF backend does not serve this node ({backend_reason}): \
             ambient pods cannot be captured in the kernel here; set it to auto (in the kernel \
             where the eBPF backend serves the node, else Istio's in-pod rules) or false"
        ),
    }
}

/// Whether `global.nativeNftables` asks for Istio's rules as native nftables wherever the
/// rules path captures pods.
pub(crate) fn native_nftables() -> anyhow::Result<bool> {
    let lookup = |name: &str| std::env::var(name).ok();
    Ok(settings::bool_setting(&lookup, settings::NATIVE_NFTABLES)?)
}

/// `meshcap.takeover.toKernel`: adopted sidecar pods moved to the kernel programs.
pub(crate) fn takeover_to_kernel() -> anyhow::Result<bool> {
    let lookup = |name: &str| std::env::var(name).ok();
    Ok(settings::bool_setting(
        &lookup,
        settings::TAKEOVER_TO_KERNEL,
    )?)
}

/// Where this agent keeps what it owns, every path resolved.
pub(crate) struct Paths {
    pub(crate) socket: PathBuf,
    pub(crate) state_dir: PathBuf,
    pub(crate) bpffs_dir: PathBuf,
    pub(crate) cgroup_root: PathBuf,
    pub(crate) endpoints: Endpoints,
}

impl RunArgs {
    /// Each path as set, else as `--instance` derives it, else the DaemonSet's default. An
    /// instance's cgroup is created under the cgroup2 mount when missing.
    pub(crate) fn paths(&self) -> anyhow::Result<Paths> {
        let base = match &self.instance {
            Some(name) => AgentPaths::instance(name)?,
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
            endpoints: self.http_listen.map_or_else(
                || base.endpoints.with(self.health_listen, self.metrics_listen),
                Endpoints::Combined,
            ),
        })
    }

    /// How a pod the source does not have yet is looked up again at ADD.
    pub(crate) const fn retry(&self) -> Retry {
        Retry {
            attempts: self.pod_lookup_attempts,
            interval: Duration::from_millis(self.pod_lookup_interval_ms),
        }
    }

    /// The node's settings every pod's decision reads: the excluded namespaces and ambient
    /// mode.
    pub(crate) fn node_settings(&self, ambient: Option<AmbientConfig>) -> NodeSettings {
        NodeSettings {
            select: SelectConfig {
                exclude_namespaces: self.exclude_namespaces.clone(),
            },
            ambient,
        }
    }
}
