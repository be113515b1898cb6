//! What keeps the daemon's life in order around its work: signals caught from the start
//! ([`ShutdownSignal`]), one agent per state directory, the plugin installed and kept chained,
//! the node's startup taint removed once pods can be captured, the periodic looks (warnings,
//! captures whose netns went without a DEL), and the uninstall when meshcap is being deleted.
use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use meshcap_agent::{
    backend::iptables::FlavourChoice,
    hub::Hub,
    install::{
        self,
        watch::{InstallStatus, Pass},
    },
    pods::PodSource,
    settings, taint,
    uninstall::{
        verdict::Verdict,
        witness::{self, Departure},
    },
};
use meshcap_policy::NodeSettings;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::{
    handback::{Logs, Sidecars},
    run::{PodSourceKind, RunArgs},
    standing::Features,
};

/// At SIGTERM: removes meshcap from this node when it is being deleted from the cluster
/// (docs/install.md, "Uninstalling", and [`meshcap_agent::uninstall::verdict`]), so new pods no
/// longer wait for an agent that will never come back; then hands every pod the kernel
/// programs still capture back to Istio's own rules (`hand_back`: what the hand-back opens, the
/// pod source and the node's settings its sidecar pods are decided with), so that no program,
/// link or pin of meshcap's outlives the agent. On a restart, an update, an eviction or a
/// drain, and whenever nothing proves an uninstall, nothing is removed. `features` say what the
/// agent was given; with ambient mode on, `probes` (the node's netns and iptables) says where
/// its probe rule and sets go from.
pub async fn uninstall_if_deleted(
    client: &kube::Client,
    departure: &Departure,
    features: &Features,
    config: install::InstallConfig,
    hand_back: HandBack,
    probes: Option<(Option<PathBuf>, FlavourChoice)>,
) {
    let plugin = match &config.plugin.kubeconfig {
        Some(path) => match witness::plugin_client(path).await {
            Ok(plugin) => Some((plugin, witness::plugin_needs(features.ambient))),
            Err(err) => {
                warn!(kubeconfig = %path.display(), error = %err, "the plugin's kubeconfig");
                None
            }
        },
        None => None,
    };
    let owner = departure.owner().await;
    let needs = features.needs(owner.as_ref());
    let verdict = tokio::time::timeout(
        DECISION_TIMEOUT,
        departure.conclude(client, &features.node, &needs, plugin),
    )
    .await;
    let why = match verdict {
        Ok(Some(Verdict::Uninstall(why))) => why,
        Ok(Some(Verdict::Stay(why))) => {
            info!(%why, "meshcap stays installed on this node");
            return;
        }
        Ok(None) => {
            info!("no DaemonSet owns this agent: meshcap stays installed on this node");
            return;
        }
        Err(_) => {
            warn!(
                "no answer within {DECISION_TIMEOUT:?} on whether meshcap is being deleted: it stays installed"
            );
            return;
        }
    };
    info!(%why, "meshcap is being deleted: uninstalling it from this node");
    let runtime = tokio::runtime::Handle::current();
    let removed = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        if let Some((netns, flavour)) = probes
            && let Some(file) =
                meshcap_agent::uninstall::probes(netns.as_deref(), flavour, &config.cni_conf_dir)?
        {
            info!(%file, "istio-cni's entry is in the CNI configuration: ambient mode's probe rule and sets are left to its agent");
        }
        // The CNI set-up first: it is what new pods meet, and a hand-back cut short by the
        // grace period must not leave it behind.
        let removed =
            meshcap_agent::uninstall::node(Some(&config), &hand_back.node.kernel.bpffs_dir)?;
        if removed.kept.is_empty() {
            return Ok(removed);
        }
        let done = hand_back.node.hand_back(
            &Sidecars {
                source: &hand_back.source,
                settings: &hand_back.settings,
                runtime: &runtime,
            },
            Logs::Forwarded,
        )?;
        info!(
            pods = done.pods.len(),
            dropped = done.dropped.len(),
            failed = done.failed.len(),
            "handed back to Istio's rules"
        );
        Ok(meshcap_agent::uninstall::node(
            None,
            &hand_back.node.kernel.bpffs_dir,
        )?)
    })
    .await;
    match removed {
        Ok(Ok(removed)) => {
            for (dir, pods) in &removed.kept {
                warn!(layout = %dir.display(), pods = %pods.join(", "), "eBPF programs kept: pods they capture were not handed back (restart them; a node reboot or `meshcap-agent uninstall` then removes the programs)");
            }
            info!(layouts = removed.layouts.len(), "uninstalled");
        }
        Ok(Err(err)) => warn!(error = %err, "uninstalling"),
        Err(err) => warn!(error = %err, "uninstalling"),
    }
}

/// What the stopping agent hands its kernel-captured pods back with.
pub struct HandBack {
    /// The layout, the state directory and the settings the rules are written with.
    pub node: crate::handback::Node,
    /// The pod source the agent ran with (its store still holds the node's pods).
    pub source: Arc<PodSource>,
    /// The node's settings the pods were decided with.
    pub settings: NodeSettings,
}

/// How long a stopping agent may take to decide whether it is being uninstalled: within the
/// DaemonSet's `terminationGracePeriodSeconds`, leaving time to remove what it must.
const DECISION_TIMEOUT: Duration = Duration::from_secs(7);

/// Keeps the install-ready gauge with the installation's state.
pub async fn track_install(hub: Arc<Hub>, mut status: watch::Receiver<InstallStatus>) {
    loop {
        let installed = status.borrow_and_update().is_installed();
        hub.metrics().set_install_ready(installed);
        if status.changed().await.is_err() {
            return;
        }
    }
}

/// Drops, every `every`, the captures whose netns went without a DEL this agent saw (see
/// [`Hub::drop_gone`]); the start-up reconciliation has done it once already.
pub async fn drop_gone(hub: Arc<Hub>, every: Duration) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let dropped = hub.drop_gone().await;
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
pub async fn log_warnings(hub: Arc<Hub>) {
    let mut logged = std::collections::HashSet::new();
    loop {
        let current = hub.check_backend().await;
        for warning in &current {
            if !logged.contains(warning) {
                warn!("{warning}");
            }
        }
        logged = current.into_iter().collect();
        tokio::time::sleep(WARNINGS_EVERY).await;
    }
}

/// Starts the verifier ([`Hub::verify_every`]) every `seconds` until `stop`; `None` when
/// verification is off (0).
pub fn start_verifier(
    hub: &Arc<Hub>,
    seconds: u64,
    stop: &watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if seconds == 0 {
        info!(
            "verification off (meshcap.verifyIntervalSeconds is 0): drift is found only by CHECK"
        );
        return None;
    }
    let every = Duration::from_secs(seconds);
    Some(tokio::spawn(hub.clone().verify_every(every, stop.clone())))
}

/// What the CNI configuration watch does after each installation and each failure: counted
/// as Istio's installer counts them (`istio_cni_installs_total{result}`), and a re-insertion (a
/// primary CNI took the entry out) reported as drift put back.
pub fn on_install_pass(hub: Arc<Hub>) -> impl Fn(&Pass<'_>) + Send + 'static {
    let runtime = tokio::runtime::Handle::current();
    move |pass| {
        let (path, repaired) = match *pass {
            Pass::Failed(step) => return hub.metrics().count_install(Some(step)),
            Pass::Installed { path, repaired, .. } => (path, repaired),
        };
        hub.metrics().count_install(None);
        if repaired {
            let (hub, what) = (
                hub.clone(),
                format!("meshcap-cni was not in {}: put back", path.display()),
            );
            runtime.spawn(async move { hub.cni_config_repaired(what) });
        }
    }
}

/// Installs the plugin and keeps its conflist entry in place (a watcher thread); the returned
/// watcher must live as long as the agent.
pub fn start_install(
    args: &RunArgs,
    socket: &std::path::Path,
    status: watch::Sender<InstallStatus>,
    on_pass: impl Fn(&Pass<'_>) + Send + 'static,
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
            config.kubeconfig_source = install::kubeconfig::Source::of_this_agent(
                |name| std::env::var(name).ok(),
                args.cni_token_dir.as_deref(),
            );
            if config.kubeconfig_source.is_some() {
                config.plugin.kubeconfig =
                    Some(config.cni_conf_dir.join(install::KUBECONFIG_FILE_NAME));
            }
        }
        PodSourceKind::Dir => config.plugin.pod_dir.clone_from(&args.pod_dir),
    }
    if config.owned && !config.chained {
        warn!(
            setting = settings::ISTIO_OWNED_CNI_CONFIG.key,
            "no effect with chained=false: the standalone file is meshcap's own already"
        );
    }
    info!(conf_dir = %config.cni_conf_dir.display(), bin_dir = %config.cni_bin_dir.display(), chained = config.chained, owned = config.owned.then_some(config.owned_file_name.as_str()), "installing meshcap-cni");
    Ok((
        install::watch::spawn(config.clone(), status, on_pass)?,
        config,
    ))
}

/// Removes the node's startup taint once pods can be captured: the agent serves and, when it
/// installs the plugin, the plugin is chained in. Retries until it succeeds.
pub async fn untaint_when_ready(
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
pub async fn lock_state_dir(
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
pub struct ShutdownSignal {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    pub fn register() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("catching SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("catching SIGINT")?,
        })
    }

    pub async fn received(&mut self) {
        tokio::select! {
            _ = self.term.recv() => info!("SIGTERM"),
            _ = self.int.recv() => info!("SIGINT"),
        }
    }
}
