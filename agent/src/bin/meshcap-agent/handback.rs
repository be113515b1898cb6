//! `meshcap-agent uninstall --hand-back`: before meshcap leaves the node, every pod its kernel
//! programs capture gets Istio's own rules for it ([`meshcap_agent::uninstall::handback`]), so
//! that istio-cni's agent, installed next, finds what its plugin would have written and no pod
//! needs a restart; then nothing of meshcap's programs stays. Sidecar pods' policies come from
//! their pod objects (the API server, or `--pod-dir`) and the node's settings, as at their
//! ADD; ambient pods' from ambient mode's records of their enrollment.
use std::{net::IpAddr, path::PathBuf, sync::Arc};

use anyhow::{Context as _, bail};
use clap::Args;
use meshcap_agent::{
    ambient,
    backend::{
        CaptureBackend, PodPolicy,
        ebpf::{EbpfBackend, EbpfConfig, layout},
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
        nftables::{NftablesBackend, NftablesConfig},
    },
    paths::AgentPaths,
    pod::PodRef,
    pods::{PodSource, Retry, dir::DirPods, kube::KubePods},
    settings,
    uninstall::handback::{self, HandedBack, PolicyError},
};
use meshcap_policy as policy;
use meshcap_policy::{DataplaneMode, Decision, NodeSettings, SelectConfig, ambient::AmbientConfig};

use crate::run::{self, PodSourceKind};

/// How `uninstall` hands pods back, and where it finds what it needs.
#[derive(Args)]
pub struct HandBackArgs {
    /// Before removing anything, replace every pod's kernel capture with Istio's own rules for
    /// it (iptables, or native nftables with `global.nativeNftables`), one pod at a time, the
    /// rules first: istio-cni adopts the pods as they are, none needs a restart, and the
    /// programs and pins all go. A pod that cannot be handed back keeps its kernel capture and
    /// is named (the command then fails). Run with no agent on the node.
    #[arg(long)]
    pub hand_back: bool,
    /// Where sidecar pods' objects come from, for their policies.
    #[arg(long, value_enum, default_value = "kube")]
    pods: PodSourceKind,
    /// The manifest directory, with `--pods dir`.
    #[arg(long, required_if_eq("pods", "dir"))]
    pod_dir: Option<PathBuf>,
    /// Namespaces never captured (the agent's setting).
    #[arg(long, env = settings::EXCLUDE_NAMESPACES.env, value_delimiter = ',', default_value = settings::EXCLUDE_NAMESPACES.default)]
    exclude_namespaces: Vec<String>,
    /// The iptables implementation Istio's rules are written with (auto: as Istio decides).
    #[arg(long, value_enum, default_value_t)]
    iptables_flavour: FlavourChoice,
    /// The cgroup v2 directory the eBPF programs are attached to (default: the cgroup2 mount).
    #[arg(long, env = settings::CGROUP_ROOT_ENV)]
    cgroup_root: Option<PathBuf>,
    /// The agent's state directory, where the rules' records are written (as the agent's rules
    /// backend writes them) and ambient mode's records are read [default: /var/run/meshcap].
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

/// Hands back every live pod the kernel programs under `bpffs_dir` capture; says what it did.
/// A pod not handed back is named in the error, after every other pod was handed back.
pub fn hand_back(args: &HandBackArgs, bpffs_dir: &std::path::Path) -> anyhow::Result<()> {
    if layout::live_pods(bpffs_dir).is_empty() {
        return Ok(());
    }
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| AgentPaths::default().state_dir);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let Some(_lock) = meshcap_agent::instance::try_lock(&state_dir)
        .with_context(|| format!("locking the state directory {}", state_dir.display()))?
    else {
        bail!(
            "an agent holds {}: hand pods back only once the agent is gone from the node",
            state_dir.display()
        );
    };
    let cgroup_root = match &args.cgroup_root {
        Some(root) => root.clone(),
        None => meshcap_agent::cgroup::cgroup2_mount().context("finding the cgroup2 mount")?,
    };
    let ambient = run::ambient_config()?;
    let settings = NodeSettings {
        select: SelectConfig {
            exclude_namespaces: args.exclude_namespaces.clone(),
        },
        ambient: ambient.clone(),
    };
    // Multi-threaded, so that its handle can drive the API client's requests from here.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting a runtime for pod lookups")?;
    let source = pod_source(args, &runtime)?;
    let node = Node {
        kernel: EbpfConfig {
            cgroup_root,
            bpffs_dir: bpffs_dir.to_owned(),
            tc_attach: meshcap_agent::backend::ebpf::TcAttach::default(),
            handoff: meshcap_agent::backend::ebpf::Handoff::default(),
        },
        state_dir,
        flavour: args.iptables_flavour,
        ambient,
    };
    let done = node.hand_back(
        &Sidecars {
            source: &source,
            settings: &settings,
            runtime: runtime.handle(),
        },
        Logs::Forward,
    )?;
    report(&done)
}

/// What a hand-back opens and writes on this node.
pub struct Node {
    /// The kernel capture's layout, as the agent opened it.
    pub kernel: EbpfConfig,
    /// The agent's state directory: where the rules' records are written (as the agent's rules
    /// backend writes them) and ambient mode's records are read.
    pub state_dir: PathBuf,
    /// The iptables implementation Istio's rules are written with.
    pub flavour: FlavourChoice,
    /// Ambient mode's settings, when the node runs it.
    pub ambient: Option<AmbientConfig>,
}

/// Where sidecar pods' objects are found, and the node's settings they are decided with: the
/// pod source's store first (it keeps the pods it has seen even once the API server refuses
/// the agent), then a GET.
pub struct Sidecars<'a> {
    pub source: &'a PodSource,
    pub settings: &'a NodeSettings,
    /// Where the lookups run, from a thread outside it.
    pub runtime: &'a tokio::runtime::Handle,
}

/// Who forwards what the kernel programs log while pods are handed back (a refused SYN).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Logs {
    /// This process, which has not yet.
    Forward,
    /// The agent's backend, already.
    Forwarded,
}

impl Node {
    /// Hands back every live pod the kernel programs capture: sidecar pods with the policies
    /// `sidecars` decide, ambient pods with their enrollments' records. Blocking: called from
    /// outside `sidecars.runtime`.
    ///
    /// # Errors
    /// When the layout, the rules backends or the node's settings cannot be opened, or the
    /// kernel's captures cannot be listed; each pod's own failure is in the result.
    pub fn hand_back(&self, sidecars: &Sidecars<'_>, logs: Logs) -> anyhow::Result<HandedBack> {
        let kernel = EbpfBackend::open(self.kernel.clone())
            .context("opening the eBPF backend's pinned layout")?;
        if logs == Logs::Forward {
            kernel.forward_kernel_logs()?;
        }
        let nftables = run::native_nftables()?;
        let sidecar_rules = rules_backend(self.state_dir.clone(), self.flavour, nftables)?;
        let ambient_rules = match self.ambient {
            Some(_) => Some(rules_backend(
                self.state_dir.join("ambient"),
                self.flavour,
                nftables,
            )?),
            None => None,
        };
        let rules = |mode: DataplaneMode| -> Option<&dyn CaptureBackend> {
            match mode {
                DataplaneMode::Sidecar => Some(sidecar_rules.as_ref()),
                DataplaneMode::Ambient => ambient_rules.as_deref(),
            }
        };
        let mut policy_of =
            |pod: &PodRef, mode: DataplaneMode, ips: &[IpAddr]| -> Result<PodPolicy, PolicyError> {
                match (mode, &self.ambient) {
                    (DataplaneMode::Ambient, Some(config)) => {
                        ambient::recorded_capture(&self.state_dir, config, pod)?
                            .ok_or_else(|| "ambient mode has no record of its enrollment".into())
                    }
                    (DataplaneMode::Ambient, None) => {
                        Err("captured for ambient mode, which this node's settings turn off".into())
                    }
                    (DataplaneMode::Sidecar, _) => sidecars.runtime.block_on(sidecar_policy(
                        sidecars.source,
                        sidecars.settings,
                        pod,
                        ips,
                    )),
                }
            };
        Ok(handback::hand_back(&kernel, &rules, &mut policy_of)?)
    }
}

/// A rules backend writing Istio's rules and its records under `state_dir`.
fn rules_backend(
    state_dir: PathBuf,
    flavour: FlavourChoice,
    nftables: bool,
) -> anyhow::Result<Arc<dyn CaptureBackend>> {
    Ok(if nftables {
        Arc::new(NftablesBackend::new(&NftablesConfig { state_dir })?)
    } else {
        Arc::new(IptablesBackend::new(&IptablesConfig {
            state_dir,
            flavour,
        })?)
    })
}

fn pod_source(args: &HandBackArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<PodSource> {
    Ok(match (args.pods, &args.pod_dir) {
        (PodSourceKind::Dir, Some(dir)) => PodSource::Dir(DirPods::new(dir.clone())),
        (PodSourceKind::Dir, None) => bail!("--pods dir needs --pod-dir"),
        (PodSourceKind::Kube, _) => {
            let client = runtime
                .block_on(kube::Client::try_default())
                .context("an API client (in-cluster, or $KUBECONFIG)")?;
            PodSource::Kube(KubePods::get_only(client, String::new()))
        }
    })
}

/// A sidecar pod's policy, decided again from its object as at its ADD.
async fn sidecar_policy(
    source: &PodSource,
    node: &NodeSettings,
    pod: &PodRef,
    ips: &[IpAddr],
) -> Result<PodPolicy, PolicyError> {
    let once = Retry {
        attempts: 1,
        interval: std::time::Duration::ZERO,
    };
    let object = source.get(&pod.namespace, &pod.name, None, once).await?;
    let labels = source.labels_for_decision(&object, node).await?;
    match policy::decide(&object, ips, &labels, node)? {
        Decision::Sidecar { policy, .. } => Ok(PodPolicy::Sidecar(policy)),
        Decision::Ambient { .. } => {
            Err("its pod object asks for ambient mode now, not its sidecar's capture".into())
        }
        Decision::Skip { reason, .. } => {
            Err(format!("its pod object asks for no capture now: {reason}").into())
        }
    }
}

fn report(done: &HandedBack) -> anyhow::Result<()> {
    for pod in &done.pods {
        println!(
            "handed back {}/{}: Istio's rules in its network namespace, its kernel capture released",
            pod.namespace, pod.name
        );
    }
    for pod in &done.dropped {
        println!(
            "dropped the kernel capture of {}/{}: its network namespace is gone",
            pod.namespace, pod.name
        );
    }
    if done.failed.is_empty() {
        return Ok(());
    }
    let failed: Vec<String> = done
        .failed
        .iter()
        .map(|(pod, why)| format!("{}/{}: {why}", pod.namespace, pod.name))
        .collect();
    bail!(
        "{} pod(s) not handed back: {}",
        failed.len(),
        failed.join("; ")
    )
}
