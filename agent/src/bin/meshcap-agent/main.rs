//! `meshcap-agent`: the node daemon. Subcommands are the agent's user interface: `run` is
//! the daemon (its settings [`run`], what is made of them [`wiring`], what keeps its life in
//! order [`lifecycle`], its standing in the cluster [`standing`]); the others inspect or clean
//! up a node ([`commands`]).
mod choice;
mod commands;
mod explain;
mod handback;
mod lifecycle;
mod run;
mod standing;
mod wiring;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use meshcap_agent::{backend::ebpf, connectivity, logging, settings};
use run::RunArgs;

#[derive(Parser)]
#[command(name = "meshcap-agent", version, about)]
struct Cli {
    /// Log format (`--log_as_json`, or `MESHCAP_LOG_AS_JSON=true`, Istio's `global.logAsJson`,
    /// selects json).
    #[arg(long, value_enum, default_value_t, global = true)]
    log_format: logging::LogFormat,
    /// Istio's `--log_as_json`: JSON lines with Istio's keys (`level`, `time`, `scope`, `msg`);
    /// `--log_as_json=false` keeps text whatever `MESHCAP_LOG_AS_JSON` says.
    #[arg(long = "log_as_json", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", global = true)]
    log_as_json: Option<bool>,
    /// Log level, as Istio's `--log_output_level` (also accepted under that name): `debug`,
    /// `info`, `warn`, `error`, `none`, or `scope:level,...` (`cni-plugin:` sets the plugin's);
    /// or a `tracing` filter. `RUST_LOG` takes precedence when set.
    #[arg(long, visible_alias = "log_output_level", env = settings::LOG_LEVEL.env, default_value = settings::LOG_LEVEL.default, global = true)]
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
    /// restart those pods and run it again; or give them Istio's rules first, `--hand-back`).
    /// Reads the same MESHCAP_* settings as `run`.
    Uninstall {
        /// The eBPF layout directory; other versions beside it (`…/v<N>`) are removed too.
        #[arg(long, env = settings::BPFFS_DIR_ENV, default_value = ebpf::DEFAULT_BPFFS_DIR)]
        bpffs_dir: PathBuf,
        /// Leave the plugin and its CNI configuration entry alone: only the eBPF programs and
        /// pins go (a private agent's, which installed no plugin).
        #[arg(long)]
        pins_only: bool,
        #[command(flatten)]
        hand_back: Box<handback::HandBackArgs>,
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
    /// Ask the running agent why a pod is (not) captured: its decision and the label or
    /// annotation behind it, what is installed for it now (compared with its record), the last
    /// verification and the drift put back.
    Explain {
        /// The pod, as NAMESPACE/NAME.
        #[arg(value_name = "NAMESPACE/POD")]
        pod: String,
        /// The agent's plugin socket.
        #[arg(long, env = "MESHCAP_SOCKET", default_value = meshcap_cni::cni::DEFAULT_AGENT_SOCKET)]
        socket: PathBuf,
        /// Print the answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe the kernel for the eBPF backend's needs and print the findings.
    Probe,
    /// What the plugin runs when the agent does not answer: look the pod up once (API server
    /// or manifest directory) and print `{"capture": bool, "reason": "…"}`. Exits non-zero
    /// when the pod cannot be looked up.
    Decide(commands::DecideArgs),
    /// Show what meshcap (and Istio's CNI plugin) would do with a pod: the decision and the
    /// redirect policy, or the exact iptables or nftables rules (a dry run, as
    /// `istio-iptables --dry-run`).
    Policy(commands::PolicyArgs),
    /// Check the cluster with test pods on each node, as an operator (with a kubeconfig):
    /// a sidecar-shaped pod's outbound and inbound capture, an excluded range, a pod outside
    /// the mesh left alone. Prints a table; exits non-zero when a check fails.
    ConnectivityTest(connectivity::ConnectivityArgs),
    /// What the connectivity test's pods run.
    #[command(hide = true, subcommand)]
    ProbePod(connectivity::ProbeCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = match (
        cli.log_as_json,
        settings::bool_setting(
            &|name: &str| std::env::var(name).ok(),
            settings::LOG_AS_JSON,
        ),
    ) {
        (Some(true), _) | (None, Ok(true)) => logging::LogFormat::Json,
        (Some(false), _) | (None, Ok(false)) => cli.log_format,
        (None, Err(err)) => {
            eprintln!("meshcap-agent: {err}");
            return ExitCode::FAILURE;
        }
    };
    // The plugin's messages, which the agent logs for it, at the plugin's own level.
    let levels = settings::log_levels(&cli.log_level);
    let filter = format!(
        "{},{}={}",
        levels.agent,
        logging::PLUGIN_TARGET,
        levels.plugin
    );
    // kube's trace layer logs each 5xx answer as an error; the connectivity test reads agents'
    // `/readyz`, which answers 503 while not ready, and its table says so.
    let filter = if matches!(cli.command, Command::ConnectivityTest(_)) {
        format!("{filter},kube_client::client::builder=off")
    } else {
        filter
    };
    if let Err(err) = logging::init(format, &filter) {
        eprintln!("meshcap-agent: {err:#}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Verify => commands::verify(),
        Command::Uninstall {
            bpffs_dir,
            pins_only,
            hand_back,
        } => commands::uninstall(&bpffs_dir, pins_only, &hand_back),
        Command::Run(args) => {
            // Before the runtime starts its threads: they inherit it.
            if let Err(err) = meshcap_agent::sched::ask_for_short_slice() {
                tracing::warn!("the kernel refused a short scheduler slice: {err}");
            }
            wiring::run(*args)
        }
        Command::Status { socket, json } => commands::status(&socket, json),
        Command::Explain { pod, socket, json } => explain::explain(&socket, &pod, json),
        Command::Policy(args) => commands::show_policy(&args),
        Command::Probe => commands::probe_kernel(),
        Command::Decide(args) => commands::decide(&args),
        Command::ConnectivityTest(args) => match connectivity::connectivity_test(&args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(err) => Err(err),
        },
        Command::ProbePod(command) => connectivity::probe_pod(&command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}
