//! `meshcap-agent connectivity-test`: an operator's check of their own cluster (issue #45):
//! on each node, pods made from meshcap's own image, of Istio's injected shape and not, whose
//! connections show whether meshcap captures what Istio's CNI would. One concern per module:
//! - [`probe`]: the workload the pods run (`meshcap-agent probe-pod`): the stand-in proxy,
//!   the server, the app;
//! - [`agent`]: what each node runs, and whether meshcap's agent there says it is ready;
//! - [`host`]: the node's host prerequisites, from the agent's pod and its `/readyz`;
//! - [`ambient`]: whether a pod in ambient mode is enrolled, where the agent runs it;
//! - `pod_state`: what a test pod's status says;
//! - [`plan`]: the namespace and the pods' manifests;
//! - [`run`]: one run against the cluster, with the operator's credentials;
//! - [`report`]: each check's outcome from what the apps printed;
//! - [`table`]: the printout, with what each node runs, and the verdict.
//!
//! This module holds the two subcommands' arguments and entry points.
pub mod agent;
pub mod ambient;
pub mod host;
pub mod plan;
mod pod_state;
pub mod probe;
pub mod report;
pub mod run;
pub mod table;

use std::{net::SocketAddr, time::Duration};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use k8s_openapi::api::apps::v1::DaemonSet;

/// `meshcap-agent connectivity-test`'s arguments.
#[derive(Args, Debug)]
pub struct ConnectivityArgs {
    /// A node to check (repeatable; default: every node).
    #[arg(long = "node", value_name = "NODE")]
    pub nodes: Vec<String>,
    /// meshcap's image for the test's pods (default: the image of meshcap's DaemonSet).
    #[arg(long)]
    pub image: Option<String>,
    /// The namespace of meshcap's DaemonSet, whose image the pods run.
    #[arg(long, default_value = "meshcap-system")]
    pub agent_namespace: String,
    /// The name of meshcap's DaemonSet.
    #[arg(long, default_value = "meshcap-agent")]
    pub daemon_set: String,
    /// Leave the test's namespace and pods in place (a later run removes them).
    #[arg(long)]
    pub keep: bool,
    /// How long the whole run may take, in seconds; a pod not running by then fails its checks.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

/// `meshcap-agent probe-pod`: what the test's pods run.
#[derive(Subcommand, Debug)]
pub enum ProbeCommand {
    /// Answer each TCP connection with what it looked like here.
    Serve {
        /// `proxy` (the stand-in Envoy) or `server`.
        #[arg(long)]
        role: String,
        /// A TCP address to listen on (repeatable).
        #[arg(long)]
        listen: Vec<SocketAddr>,
        /// A UDP address to answer datagrams on (repeatable).
        #[arg(long)]
        udp_listen: Vec<SocketAddr>,
    },
    /// Dial each `NAME=ADDR:PORT` and print what answered.
    Dial {
        /// How long to keep dialling a target nothing answers yet.
        #[arg(long, default_value_t = 60)]
        deadline_seconds: u64,
        /// A `NAME=ADDR:PORT` to send a UDP datagram to (repeatable), after the TCP targets.
        #[arg(long = "udp", value_name = "TARGET")]
        udp: Vec<String>,
        /// The TCP targets.
        targets: Vec<String>,
    },
}

/// Runs the test workload.
///
/// # Errors
/// When a listener cannot be bound, a target is malformed, or stdout is gone.
pub fn probe_pod(command: &ProbeCommand) -> anyhow::Result<()> {
    match command {
        ProbeCommand::Serve {
            role,
            listen,
            udp_listen,
        } => probe::serve(role, listen, udp_listen)?,
        ProbeCommand::Dial {
            deadline_seconds,
            udp,
            targets,
        } => {
            let tcp = targets.iter().map(|t| (t, probe::Protocol::Tcp));
            let udp = udp.iter().map(|t| (t, probe::Protocol::Udp));
            let targets = tcp
                .chain(udp)
                .map(|(t, protocol)| probe::target(t).map(|(name, to)| (name, to, protocol)))
                .collect::<Result<Vec<_>, _>>()?;
            probe::dial(&targets, Duration::from_secs(*deadline_seconds))?;
        }
    }
    Ok(())
}

/// Runs the connectivity test with the kubeconfig's (or the pod's) credentials and prints its
/// table; `Ok(false)` when a check failed. Ctrl-C deletes the namespace before it returns.
///
/// # Errors
/// When the cluster cannot be reached or refuses what the test needs.
pub fn connectivity_test(args: &ConnectivityArgs) -> anyhow::Result<bool> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut config = kube::Config::infer()
            .await
            .context("reading the kubeconfig (or the in-cluster configuration)")?;
        // A 503 is an answer here (an agent's `/readyz` while it is not ready), which kube's
        // default retry would repeat for minutes; the run has its own deadline.
        config.default_retry = false;
        let client = kube::Client::try_from(config).context("connecting to the cluster")?;
        for name in run::remove_leftovers(&client).await? {
            println!("removed namespace {name}, left by an earlier run");
        }
        let daemon_set = read_daemon_set(&client, args).await?;
        let image = match (&args.image, &daemon_set) {
            (Some(image), _) => image.clone(),
            (None, Some(daemon_set)) => daemon_set_image(daemon_set, args)?,
            (None, None) => anyhow::bail!(
                "DaemonSet {}/{} is not in the cluster: give --agent-namespace and --daemon-set, \
                 or --image",
                args.agent_namespace,
                args.daemon_set
            ),
        };
        // The apps dial again only while their peer may not listen yet (a container of the
        // same pod starting): a third of the run.
        let plan = plan::Plan::new(suffix(), &image, (args.timeout / 3).max(5));
        let options = run::Options {
            nodes: args.nodes.clone(),
            image,
            keep: args.keep,
            timeout: Duration::from_secs(args.timeout),
            agent: (
                args.agent_namespace.clone(),
                args.daemon_set.clone(),
                daemon_set,
            ),
        };
        println!("namespace {} with image {}", plan.namespace, options.image);
        let report = tokio::select! {
            report = run::run(&client, &plan, &options) => report?,
            _ = tokio::signal::ctrl_c() => {
                run::delete_namespace(&client, &plan.namespace).await?;
                anyhow::bail!("interrupted; deleted namespace {}", plan.namespace);
            }
        };
        println!("{report}");
        if args.keep {
            println!("kept namespace {}", plan.namespace);
        }
        Ok(!report.failed())
    })
}

/// meshcap's DaemonSet, when it exists.
async fn read_daemon_set(
    client: &kube::Client,
    args: &ConnectivityArgs,
) -> anyhow::Result<Option<DaemonSet>> {
    let api: kube::Api<DaemonSet> = kube::Api::namespaced(client.clone(), &args.agent_namespace);
    api.get_opt(&args.daemon_set).await.with_context(|| {
        format!(
            "reading DaemonSet {}/{} for meshcap's image and its pods",
            args.agent_namespace, args.daemon_set
        )
    })
}

/// The image of meshcap's DaemonSet's first container.
fn daemon_set_image(ds: &DaemonSet, args: &ConnectivityArgs) -> anyhow::Result<String> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .with_context(|| {
            format!(
                "DaemonSet {}/{} names no image",
                args.agent_namespace, args.daemon_set
            )
        })
}

/// The namespace's 8 hex digits: from the clock and the process id, which is unique enough
/// for runs that delete their namespace (a clash fails the create, naming it).
fn suffix() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32).rotate_left(16))
        .unwrap_or_default();
    nanos ^ std::process::id().rotate_left(8)
}
