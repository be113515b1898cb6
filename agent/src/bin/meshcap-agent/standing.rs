//! meshcap's standing in the cluster, kept from the start: what the agent and the plugin may do
//! ([`meshcap_agent::access`]: every request the settings make, checked at start and until all
//! are granted, readiness held meanwhile and a Warning Event on the agent's pod naming what is
//! missing; the watches the API server refuses hold it too), and the agent's departure prepared
//! ([`Departure`]: the DaemonSet that owns its pod, watched until SIGTERM, when
//! [`crate::lifecycle::uninstall_if_deleted`] concludes from it).
use std::{path::PathBuf, sync::Arc};

use meshcap_agent::{
    access::{self, Need, RepairWrites, WatchHealth},
    events::EventSink,
    install::watch::InstallStatus,
    repair::Mode,
    settings,
    uninstall::witness::{self, Departure, Owner},
};
use meshcap_policy::PodName;
use tokio::sync::watch;

/// The settings that decide what the agent asks of the API server.
#[derive(Clone, Debug)]
pub struct Features {
    pub node: String,
    pub startup_taint: bool,
    pub ambient: bool,
    pub repair: Option<Mode>,
}

impl Features {
    /// Every request they make, with the DaemonSet `owner` watched.
    pub fn needs(&self, owner: Option<&Owner>) -> Vec<Need> {
        access::needs(&access::Features {
            node: self.node.clone(),
            startup_taint: self.startup_taint,
            daemon_set: owner.map(|o| (o.namespace.clone(), o.name.clone())),
            ambient: self.ambient,
            repair: match self.repair {
                Some(Mode::Delete) => RepairWrites::DeletePods,
                Some(Mode::Label) => RepairWrites::LabelPods,
                Some(Mode::Repair) | None => RepairWrites::None,
            },
        })
    }
}

/// The holds on readiness the checks release, made before the hub they are given to.
pub struct Holds {
    /// The watches the agent keeps, refused or not.
    pub health: WatchHealth,
    agent: watch::Sender<Option<String>>,
    plugin: Option<watch::Sender<Option<String>>>,
}

impl Holds {
    /// Held until checked: the agent's permissions and, with `plugin` (this agent installs
    /// the plugin), the plugin's.
    pub fn new(plugin: bool) -> Self {
        let held = |whose: &str| watch::Sender::new(Some(format!("checking what {whose} may do")));
        Self {
            health: WatchHealth::default(),
            agent: held("the agent"),
            plugin: plugin.then(|| held("the plugin")),
        }
    }

    /// For [`meshcap_agent::hub::Parts::holds`].
    pub fn receivers(&self) -> Vec<watch::Receiver<Option<String>>> {
        let mut all = vec![self.health.gate(), self.agent.subscribe()];
        all.extend(self.plugin.iter().map(watch::Sender::subscribe));
        all
    }
}

/// The agent's own pod, as the DaemonSet passes it (`metadata.namespace`, `metadata.name`).
pub fn own_pod() -> Option<PodName> {
    Some(PodName {
        namespace: std::env::var(settings::POD_NAMESPACE_ENV).ok()?,
        name: std::env::var(settings::POD_NAME_ENV).ok()?,
    })
}

/// Starts the checks and the departure's watch: the agent's permissions once its DaemonSet is
/// known, and the plugin's, with its own kubeconfig (`plugin`: its path, when one is written,
/// and the installation's state), once that is written.
pub fn start(
    client: &kube::Client,
    features: Features,
    holds: Holds,
    events: &EventSink,
    plugin: Option<(Option<PathBuf>, watch::Receiver<InstallStatus>)>,
) -> Arc<Departure> {
    let own = own_pod();
    let departure = Arc::new(Departure::start(
        client.clone(),
        own.as_ref().map(|p| (p.namespace.clone(), p.name.clone())),
        holds.health,
    ));
    let report = report_on(events.clone(), own);
    if let Some(gate) = holds.plugin {
        match plugin {
            Some((Some(kubeconfig), install)) => {
                tokio::spawn(check_plugin(
                    kubeconfig,
                    install,
                    features.ambient,
                    gate,
                    report.clone(),
                ));
            }
            // No kubeconfig of its own: the plugin decides from a manifest directory.
            _ => {
                gate.send_replace(None);
            }
        }
    }
    let (client, leaving) = (client.clone(), departure.clone());
    tokio::spawn(async move {
        let owner = leaving.owner().await;
        let needs = features.needs(owner.as_ref());
        access::enforce("the agent", client, needs, holds.agent, report).await;
    });
    departure
}

/// Publishes why readiness is held as a Warning Event on the agent's own pod.
fn report_on(events: EventSink, own: Option<PodName>) -> impl Fn(String) + Clone + Send {
    move |why| {
        if let Some(pod) = &own {
            events.warn(
                pod.clone(),
                None,
                "MissingPermissions",
                "CheckPermissions",
                why,
            );
        }
    }
}

/// Checks, once the plugin's kubeconfig is written, that the plugin may make what it asks while
/// no agent runs, with its own token: a token Secret never filled, or its ServiceAccount or
/// binding missing, would otherwise show only when the agent is away and every pod of the node
/// fails.
async fn check_plugin(
    kubeconfig: PathBuf,
    mut install: watch::Receiver<InstallStatus>,
    ambient: bool,
    gate: watch::Sender<Option<String>>,
    report: impl Fn(String) + Send,
) {
    if install.wait_for(InstallStatus::is_installed).await.is_err() {
        return;
    }
    let client = match witness::plugin_client(&kubeconfig).await {
        Ok(client) => client,
        Err(err) => {
            let why = format!("the plugin's kubeconfig {}: {err}", kubeconfig.display());
            tracing::warn!("{why}");
            report(why.clone());
            gate.send_replace(Some(why));
            return;
        }
    };
    let needs = witness::plugin_needs(ambient);
    access::enforce("the plugin", client, needs, gate, report).await;
}
