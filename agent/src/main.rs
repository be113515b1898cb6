//! `meshcap-agent`: the node daemon. Subcommands are the agent's user interface.
use std::{net::IpAddr, path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use meshcap_agent::{bpf, logging, policy};

#[derive(Parser)]
#[command(name = "meshcap-agent", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t, global = true)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load every embedded kernel program (the verifier checks each) and report.
    Verify,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = logging::init(cli.log_format, "info") {
        eprintln!("meshcap-agent: {err:#}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Verify => verify(),
        Command::Policy {
            pod,
            ips,
            exclude_namespaces,
            format,
        } => show_policy(&pod, &ips, exclude_namespaces, format),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

fn verify() -> anyhow::Result<()> {
    let mut ebpf = bpf::open()?;
    for name in bpf::load_all(&mut ebpf)? {
        println!("verified {name}");
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
