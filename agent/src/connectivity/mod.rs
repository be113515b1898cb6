//! `meshcap-agent connectivity-test`: an operator's check of their own cluster (issue #45):
//! on each node, pods made from meshcap's own image, of Istio's injected shape and not, whose
//! connections show whether meshcap captures what Istio's CNI would. One concern per module:
//! - [`probe`]: the workload the pods run (`meshcap-agent probe-pod`): the stand-in proxy,
//!   the server, the app;
//! - [`plan`]: the namespace and the pods' manifests;
//! - [`run`]: one run against the cluster, with the operator's credentials;
//! - [`report`]: each check's outcome from what the apps printed, the table and the verdict.
//!
//! This module holds the two subcommands' arguments and entry points.
pub mod plan;
pub mod probe;
pub mod report;
pub mod run;

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
        /// An address to listen on (repeatable).
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
    },
    /// Dial each `NAME=ADDR:PORT` and print what answered.
    Dial {
        /// How long to keep dialling a target nothing answers yet.
        #[arg(long, default_value_t = 60)]
        deadline_seconds: u64,
        /// The targets.
        #[arg(required = true)]
        targets: Vec<String>,
    },
}

/// Runs the test workload.
///
/// # Errors
/// When a listener cannot be bound, a target is malformed, or stdout is gone.
pub fn probe_pod(command: &ProbeCommand) -> anyhow::Result<()> {
    match command {
        ProbeCommand::Serve { role, listen } => probe::serve(role, listen)?,
        ProbeCommand::Dial {
            deadline_seconds,
            targets,
        } => {
            let targets = targets
                .iter()
                .map(|t| probe::target(t))
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
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster (kubeconfig or in-cluster)")?;
        for name in run::remove_leftovers(&client).await? {
            println!("removed namespace {name}, left by an earlier run");
        }
        let image = match &args.image {
            Some(image) => image.clone(),
            None => daemon_set_image(&client, args).await?,
        };
        // The apps dial again only while their peer may not listen yet (a container of the
        // same pod starting): a third of the run.
        let plan = plan::Plan::new(suffix(), &image, (args.timeout / 3).max(5));
        let options = run::Options {
            nodes: args.nodes.clone(),
            image,
            keep: args.keep,
            timeout: Duration::from_secs(args.timeout),
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

/// The image of meshcap's DaemonSet's first container.
async fn daemon_set_image(
    client: &kube::Client,
    args: &ConnectivityArgs,
) -> anyhow::Result<String> {
    let api: kube::Api<DaemonSet> = kube::Api::namespaced(client.clone(), &args.agent_namespace);
    let ds = api.get(&args.daemon_set).await.with_context(|| {
        format!(
            "reading DaemonSet {}/{} for meshcap's image (or give --image)",
            args.agent_namespace, args.daemon_set
        )
    })?;
    ds.spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.image)
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
