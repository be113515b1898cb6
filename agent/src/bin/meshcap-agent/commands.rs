//! The subcommands other than `run`: the kernel probe, the verifier check, the status report,
//! a pod's policy, the plugin's decision while the agent is down, and uninstall.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::Args;
use meshcap_agent::{
    bpf, decide,
    pods::{PodSource, dir::DirPods, kube::KubePods},
    probe, settings,
    status::StatusReport,
};
use meshcap_cni::protocol::{self, Op, Reply, Request};
use meshcap_policy as policy;
use meshcap_policy::PodName;

use crate::handback::HandBackArgs;

/// How `meshcap-agent policy` prints a pod's policy.
#[derive(Clone, Copy, Default, clap::ValueEnum)]
pub enum PolicyFormat {
    #[default]
    Json,
    Iptables,
    Nftables,
}

pub fn probe_kernel() -> anyhow::Result<()> {
    let report = probe::run();
    println!("{}", serde_json::to_string_pretty(&report)?);
    if !report.ok() {
        bail!("the eBPF backend cannot run here: {}", report.failures());
    }
    Ok(())
}

pub fn verify() -> anyhow::Result<()> {
    let mut ebpf = bpf::open()?;
    for name in bpf::load_all(&mut ebpf)? {
        println!("verified {name}");
    }
    Ok(())
}

pub fn uninstall(
    bpffs_dir: &Path,
    pins_only: bool,
    hand_back: &HandBackArgs,
) -> anyhow::Result<()> {
    // First, while meshcap's plugin still makes new mesh pods wait for an agent.
    let handed_back = if hand_back.hand_back {
        crate::handback::hand_back(hand_back, bpffs_dir)
    } else {
        Ok(())
    };
    let config = if pins_only {
        None
    } else {
        Some(settings::install_config(
            |name| std::env::var(name).ok(),
            settings::PLUGIN_SOURCE.into(),
        )?)
    };
    let lookup = |name: &str| std::env::var(name).ok();
    if let Some(config) = &config
        && settings::bool_setting(&lookup, settings::AMBIENT_ENABLED)?
    {
        let netns = std::env::var_os(settings::NODE_NETNS_ENV).map(PathBuf::from);
        match meshcap_agent::uninstall::probes(
            netns.as_deref(),
            meshcap_agent::backend::iptables::FlavourChoice::Auto,
            &config.cni_conf_dir,
        )? {
            None => println!("removed ambient mode's probe rule and sets from the node"),
            Some(file) => println!(
                "left ambient mode's probe rule and sets to istio-cni's agent (its entry is in {file})"
            ),
        }
    }
    let removed = meshcap_agent::uninstall::node(config.as_ref(), bpffs_dir)?;
    if let Some((conf_dir, bin_dir)) = &removed.cni {
        println!(
            "removed meshcap-cni from {} and {}",
            conf_dir.display(),
            bin_dir.display()
        );
    }
    for dir in &removed.layouts {
        println!(
            "detached meshcap's eBPF programs and removed {}",
            dir.display()
        );
    }
    handed_back?;
    if !removed.kept.is_empty() {
        let kept: Vec<String> = removed
            .kept
            .iter()
            .map(|(dir, pods)| {
                format!(
                    "{} still captures {} pod(s): {}",
                    dir.display(),
                    pods.len(),
                    pods.join(", ")
                )
            })
            .collect();
        bail!(
            "meshcap's eBPF programs stay attached, so those pods keep their capture: {}; \
             restart them (the CNI set-up now installed handles the new ones) and run \
             `meshcap-agent uninstall` again",
            kept.join("; ")
        );
    }
    Ok(())
}

pub fn status(socket: &Path, json: bool) -> anyhow::Result<()> {
    let response = protocol::call(socket, &Request::new(Op::Status), Duration::from_secs(10))?;
    print_report(
        response.reply,
        json,
        "the agent sent no status report",
        StatusReport::to_text,
    )
}

/// Prints the report of an agent's `reply`, as JSON or as `text` renders it; `missing` says
/// what it means that the reply carries none.
pub fn print_report<T: serde::de::DeserializeOwned>(
    reply: Reply,
    json: bool,
    missing: &str,
    text: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    match reply {
        Reply::Ok {
            report: Some(report),
            ..
        } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", text(&serde_json::from_value(report)?));
            }
            Ok(())
        }
        Reply::Ok { .. } => bail!("{missing}"),
        Reply::Error { msg, .. } => bail!("{msg}"),
    }
}

/// `meshcap-agent policy`: a pod and the node's settings that decide its capture.
#[derive(Args)]
pub struct PolicyArgs {
    /// The pod manifest, YAML or JSON (`kubectl get pod NAME -o yaml`).
    #[arg(long, value_name = "FILE")]
    pod: PathBuf,
    /// The pod's addresses (default: the manifest's `status.podIPs`).
    #[arg(long = "ip", value_name = "ADDR")]
    ips: Vec<IpAddr>,
    /// Namespaces whose pods are never captured.
    #[arg(long = "exclude-namespace", value_name = "NAMESPACE", default_values_t = policy::SelectConfig::default().exclude_namespaces)]
    exclude_namespaces: Vec<String>,
    /// Decide as a node with ambient mode on (Istio's `ambient.enabled`): an enrolled pod gets
    /// ztunnel's in-pod capture, any other pod the sidecar decision.
    #[arg(long)]
    ambient: bool,
    /// A label of the pod's namespace (ambient enrollment reads them), repeated.
    #[arg(long = "namespace-label", value_name = "KEY=VALUE", value_parser = label)]
    namespace_labels: Vec<(String, String)>,
    /// Istio's `ambient.dnsCapture`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ambient_dns_capture: bool,
    /// Istio's `ambient.ipv6`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ambient_ipv6: bool,
    /// `json`: the decision and the policy; `iptables`: iptables-restore input (then the
    /// ip6tables-restore input after a `# ip6tables-restore` line when the pod has IPv6);
    /// `nftables`: the `nft -f` transaction of `global.nativeNftables`.
    #[arg(long, value_enum, default_value_t)]
    format: PolicyFormat,
    /// With `--ambient` and `--format nftables`: also the node's own transaction, the rule
    /// SNAT-ing kubelet's probes of ambient pods (Istio's, matching the socket's owner: this
    /// uid, kubelet's), after a `# node` line.
    #[arg(long, value_name = "UID")]
    kubelet_uid: Option<u32>,
}

fn label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

pub fn show_policy(args: &PolicyArgs) -> anyhow::Result<()> {
    let path = &args.pod;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let pod = policy::parse_pod_manifest(&text).with_context(|| path.display().to_string())?;
    let ips = if args.ips.is_empty() {
        policy::status_pod_ips(&pod)
    } else {
        args.ips.clone()
    };
    let node = policy::NodeSettings {
        select: policy::SelectConfig {
            exclude_namespaces: args.exclude_namespaces.clone(),
        },
        ambient: args.ambient.then(|| {
            let mut config = policy::ambient::AmbientConfig::default();
            config.dns_capture = args.ambient_dns_capture;
            config.ipv6 = args.ambient_ipv6;
            config
        }),
    };
    let namespace_labels = args.namespace_labels.iter().cloned().collect();
    let decision = policy::decide(&pod, &ips, &namespace_labels, &node)?;
    let (enrollment, selection) = (decision.enrollment(), decision.selection());
    match args.format {
        PolicyFormat::Json => match (enrollment, selection) {
            (Some(ambient), Some(sidecar)) => print_json(&serde_json::json!({
                "ambient": ambient,
                "sidecar": sidecar,
            }))?,
            (Some(ambient), None) => print_json(&serde_json::json!({ "ambient": ambient }))?,
            (None, sidecar) => print_json(&sidecar)?,
        },
        PolicyFormat::Iptables => {
            if let Some(policy::ambient::Enrollment::NotEnrolled { reason }) = enrollment {
                println!("# not enrolled in ambient mode: {reason}");
            }
            let rules = match decision {
                policy::Decision::Ambient { policy, .. } => policy.render(),
                policy::Decision::Sidecar { policy, .. } => policy.render(),
                policy::Decision::Skip { reason, .. } => {
                    println!("# not captured: {reason}");
                    return Ok(());
                }
            };
            print_restore(&rules.v4, rules.v6.as_deref());
        }
        PolicyFormat::Nftables => {
            if let Some(policy::ambient::Enrollment::NotEnrolled { reason }) = enrollment {
                println!("# not enrolled in ambient mode: {reason}");
            }
            let transaction = match decision {
                policy::Decision::Ambient { policy, .. } => policy.render_nftables(),
                policy::Decision::Sidecar { policy, .. } => policy.render_nftables_applied(),
                policy::Decision::Skip { reason, .. } => {
                    println!("# not captured: {reason}");
                    return Ok(());
                }
            };
            print!("{transaction}");
            if let (Some(ambient), Some(uid)) = (&node.ambient, args.kubelet_uid) {
                println!("# node");
                print!(
                    "{}",
                    ambient.host_probe_snat.render_nftables(ambient.ipv6, uid)
                );
            }
        }
    }
    Ok(())
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn print_restore(v4: &str, v6: Option<&str>) {
    print!("{v4}");
    if let Some(v6) = v6 {
        println!("# ip6tables-restore");
        print!("{v6}");
    }
}

/// `meshcap-agent decide`: the plugin's inputs.
#[derive(Args)]
pub struct DecideArgs {
    /// `K8S_POD_NAMESPACE`.
    #[arg(long)]
    namespace: String,
    /// `K8S_POD_NAME`.
    #[arg(long)]
    name: String,
    /// `K8S_POD_UID`.
    #[arg(long)]
    uid: Option<String>,
    /// The pod's addresses (`prevResult`).
    #[arg(long = "ip", value_name = "ADDR")]
    ips: Vec<IpAddr>,
    /// Namespaces never captured.
    #[arg(long = "exclude-namespace", value_name = "NAMESPACE")]
    exclude_namespaces: Vec<String>,
    /// The node runs ambient mode (the plugin's `ambient_enabled`).
    #[arg(long)]
    ambient: bool,
    /// Ambient mode's enablement selectors, JSON (default: Istio's).
    #[arg(long, value_name = "JSON")]
    enablement_selectors: Option<String>,
    /// Ask the API server with this kubeconfig.
    #[arg(long, conflicts_with = "pod_dir", required_unless_present = "pod_dir")]
    kubeconfig: Option<PathBuf>,
    /// Read the pod from this manifest directory (standalone mode).
    #[arg(long)]
    pod_dir: Option<PathBuf>,
}

/// How long `decide` waits for the API server: to connect, and for an answer. The plugin's
/// ADD for a pod outside the mesh costs at most these plus the process start.
const API_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const API_READ_TIMEOUT: Duration = Duration::from_secs(5);

#[tokio::main(flavor = "current_thread")]
pub async fn decide(args: &DecideArgs) -> anyhow::Result<()> {
    let source = match (&args.kubeconfig, &args.pod_dir) {
        (_, Some(dir)) => PodSource::Dir(DirPods::new(dir.clone())),
        (Some(path), None) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let mut config = kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .with_context(|| format!("the kubeconfig {}", path.display()))?;
            config.connect_timeout = Some(API_CONNECT_TIMEOUT);
            config.read_timeout = Some(API_READ_TIMEOUT);
            let client = kube::Client::try_from(config).context("building an API client")?;
            PodSource::Kube(KubePods::get_only(client, String::new()))
        }
        (None, None) => bail!("--kubeconfig or --pod-dir is required"),
    };
    let ambient = if args.ambient {
        let selectors = match &args.enablement_selectors {
            Some(text) => serde_json::from_str(text)
                .with_context(|| format!("--enablement-selectors {text:?}"))?,
            None => policy::ambient::EnablementSelector::istio_defaults(),
        };
        Some(policy::ambient::AmbientConfig::new(selectors)?)
    } else {
        None
    };
    let request = decide::Request {
        pod: PodName {
            namespace: args.namespace.clone(),
            name: args.name.clone(),
        },
        uid: args.uid.clone(),
        ips: args.ips.clone(),
        node: policy::NodeSettings {
            select: policy::SelectConfig {
                exclude_namespaces: args.exclude_namespaces.clone(),
            },
            ambient,
        },
    };
    let answer = decide::decide(&source, &request).await?;
    println!("{}", serde_json::to_string(&answer)?);
    Ok(())
}
