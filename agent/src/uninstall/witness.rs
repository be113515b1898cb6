//! What the agent learns of its DaemonSet, for [`super::verdict`]: the owner of its pod (read at
//! start, while its credential surely works), a watch of that one DaemonSet's metadata for as
//! long as the agent runs, and at SIGTERM a fresh read and, when that is refused, what meshcap's
//! two identities may still do.
//!
//! The watch asks for metadata only (`PartialObjectMetadata`): its uid and deletion are all it
//! reads, and the DaemonSet changes with every status update the controller makes as pods come
//! and go on any node, each streamed to every node's agent. Metadata is a fraction of the
//! object (its pod template, its status).
use std::{path::Path, time::Duration};

use futures::StreamExt as _;
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{Node, Pod},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api,
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt as _,
        watcher::{self, Event},
    },
};
use tokio::sync::watch;

use super::{
    placement,
    verdict::{self, Fresh, Placement, Verdict, Witnessed},
};
use crate::access::{self, Need, WatchHealth};

/// The DaemonSet that owns the agent's pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// Its namespace (the agent's).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid when the pod was created.
    pub uid: String,
}

/// The DaemonSet owning the pod `namespace/pod`, if it has one (an agent run by hand has
/// none).
///
/// # Errors
/// When the API server cannot be asked.
pub async fn owner(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
) -> Result<Option<Owner>, kube::Error> {
    let Some(own) = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(pod)
        .await?
    else {
        return Ok(None);
    };
    Ok(own
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .find(|o| o.kind == "DaemonSet")
        .map(|o| Owner {
            namespace: namespace.to_owned(),
            name: o.name,
            uid: o.uid,
        }))
}

/// The running watch of the owner DaemonSet.
#[derive(Debug)]
pub struct Witness {
    seen: watch::Receiver<Witnessed>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The DaemonSet as a watch streaming still delivers it.
fn state(ds: &ObjectMeta) -> Witnessed {
    Witnessed::Present {
        uid: ds.uid.clone().unwrap_or_default(),
        deleting: ds.deletion_timestamp.is_some(),
        streaming: true,
    }
}

/// What was last delivered, once the watch failed or was refused: no longer a word on now.
fn stopped(seen: &mut Witnessed) {
    if let Witnessed::Present { streaming, .. } = seen {
        *streaming = false;
    }
}

impl Witness {
    /// Watches `owner`'s DaemonSet's metadata (one name, by field selector, which RBAC's
    /// resourceNames authorizes), reporting refusals to `health`.
    #[must_use]
    pub fn start(client: kube::Client, owner: &Owner, health: WatchHealth) -> Self {
        let (tx, seen) = watch::channel(Witnessed::Nothing);
        let api = Api::<PartialObjectMeta<DaemonSet>>::namespaced(client, &owner.namespace);
        let config = watcher::Config::default().fields(&format!("metadata.name={}", owner.name));
        let task = tokio::spawn(async move {
            // Backing off between failures, as every watch of the agent does: a refused or
            // unreachable API server must not make it spin (nor keep its runtime from stopping).
            let stream = watcher::watcher(api, config).default_backoff();
            futures::pin_mut!(stream);
            let mut listed = None;
            while let Some(event) = stream.next().await {
                health.observe("DaemonSet", &event);
                match event {
                    Ok(Event::Apply(ds)) => {
                        if ds.metadata.deletion_timestamp.is_some() {
                            tracing::info!("the DaemonSet's watch saw it being deleted");
                        }
                        tx.send_replace(state(&ds.metadata));
                    }
                    Ok(Event::Delete(_)) => {
                        tracing::info!("the DaemonSet's watch saw it deleted");
                        tx.send_replace(Witnessed::Gone);
                    }
                    Ok(Event::Init) => listed = Some(Witnessed::Gone),
                    Ok(Event::InitApply(ds)) => listed = Some(state(&ds.metadata)),
                    Ok(Event::InitDone) => {
                        if let Some(found) = listed.take() {
                            tx.send_replace(found);
                        }
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, "watching the DaemonSet; retrying");
                        tx.send_modify(stopped);
                    }
                }
            }
        });
        Self { seen, task }
    }

    /// What the watch last delivered.
    #[must_use]
    pub fn seen(&self) -> Witnessed {
        self.seen.borrow().clone()
    }

    /// Waits up to `within` for the watch to deliver a deletion of `owner_uid` (or its
    /// replacement); what it last delivered then.
    pub async fn settled(&mut self, owner_uid: &str, within: Duration) -> Witnessed {
        let decided = |w: &Witnessed| match w {
            Witnessed::Gone => true,
            Witnessed::Present { uid, deleting, .. } => uid != owner_uid || *deleting,
            Witnessed::Nothing => false,
        };
        let _ = tokio::time::timeout(within, self.seen.wait_for(decided)).await;
        self.seen()
    }
}

/// A fresh read of `owner`'s DaemonSet with `client`, and of the node `node` when the
/// DaemonSet constrains its nodes (a `nodeSelector`, a required node affinity).
pub async fn read(client: &kube::Client, owner: &Owner, node: &str) -> Fresh {
    match Api::<DaemonSet>::namespaced(client.clone(), &owner.namespace)
        .get_opt(&owner.name)
        .await
    {
        Ok(Some(ds)) => Fresh::Present {
            placement: placement_on(client, &ds, node).await,
            uid: ds.metadata.uid.unwrap_or_default(),
            deleting: ds.metadata.deletion_timestamp.is_some(),
        },
        Ok(None) => Fresh::Gone,
        Err(kube::Error::Api(status)) if status.code == 401 => Fresh::Unauthorized,
        Err(kube::Error::Api(status)) if status.code == 403 => Fresh::Forbidden,
        Err(err) => Fresh::Unreachable(err.to_string()),
    }
}

/// Whether `daemon_set` places a pod on `node` ([`placement`]).
async fn placement_on(client: &kube::Client, daemon_set: &DaemonSet, node: &str) -> Placement {
    if !placement::constrained(daemon_set) {
        return Placement::Takes;
    }
    if node.is_empty() {
        return Placement::Unknown("this agent was given no node name".into());
    }
    match Api::<Node>::all(client.clone()).get(node).await {
        Ok(found) => placement::of(daemon_set, &found, node),
        Err(err) => Placement::Unknown(format!("reading node {node}: {err}")),
    }
}

/// Whether the identity behind `client` may do none of `needs`: its token refused, or every
/// review denied. Unknown (the API server did not answer) counts as not lost.
pub async fn lost(client: &kube::Client, needs: &[Need]) -> bool {
    for need in needs {
        match access::allowed(client, need).await {
            Ok(true) => return false,
            Ok(false) => {}
            Err(err) => return access::is_refused(&err),
        }
    }
    true
}

/// Why a client with the plugin's kubeconfig cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PluginClientError {
    /// The file cannot be read, or is no kubeconfig kube-rs can use.
    #[error(transparent)]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// kube-rs cannot make a client of it.
    #[error(transparent)]
    Client(#[from] kube::Error),
}

/// A client with the plugin's kubeconfig (what `meshcap-agent decide` uses).
///
/// # Errors
/// When it cannot be read or is not a kubeconfig.
pub async fn plugin_client(kubeconfig: &Path) -> Result<kube::Client, PluginClientError> {
    let config = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(config, &kube::config::KubeConfigOptions::default())
            .await?;
    Ok(kube::Client::try_from(config)?)
}

/// What the plugin asks while no agent runs: a pod, and with ambient mode its namespace.
#[must_use]
pub fn plugin_needs(ambient: bool) -> Vec<Need> {
    let mut needs = vec![Need {
        verb: "get",
        group: "",
        resource: "pods",
        subresource: "",
        namespace: String::new(),
        name: String::new(),
        why: "the plugin's decision while no agent runs",
    }];
    if ambient {
        needs.push(Need {
            resource: "namespaces",
            why: "the plugin's ambient enrollment while no agent runs",
            ..needs[0].clone()
        });
    }
    needs
}

/// How long a stopping agent waits for its watch to deliver the DaemonSet's deletion when it
/// cannot read it itself: the deletion precedes the pod's stop, and its event follows within
/// milliseconds on a watch streaming still.
pub const WITNESS_GRACE: Duration = Duration::from_secs(3);

/// The whole decision at SIGTERM: the fresh read, the watch, and when both leave it open, what
/// the agent (`agent_needs`) and the plugin (`plugin`: its client and needs; `None`: it has no
/// credential of its own) may still do.
pub async fn conclude(
    client: &kube::Client,
    (owner, node): (&Owner, &str),
    witness: Option<&mut Witness>,
    agent_needs: &[Need],
    plugin: Option<(kube::Client, Vec<Need>)>,
) -> Verdict {
    let fresh = read(client, owner, node).await;
    let mut seen = witness.as_ref().map_or(Witnessed::Nothing, |w| w.seen());
    // Not read now: what the watch says decides, once a deletion in flight had time to come
    // down it (a watch streaming still that shows the DaemonSet there keeps meshcap).
    if let Some(witness) = witness
        && !matches!(fresh, Fresh::Present { .. } | Fresh::Gone)
    {
        seen = witness.settled(&owner.uid, WITNESS_GRACE).await;
    }
    match verdict::verdict(&owner.uid, &fresh, &seen) {
        Ok(verdict) => verdict,
        Err(refused) => {
            let plugin_lost = match &plugin {
                Some((client, needs)) => lost(client, needs).await,
                None => true,
            };
            let everything_lost = plugin_lost && lost(client, agent_needs).await;
            verdict::settle(&refused, everything_lost)
        }
    }
}

/// The agent's departure, prepared while it runs: its pod's owner (looked up in the
/// background until the API server answers) and the watch of that DaemonSet.
#[derive(Debug)]
pub struct Departure {
    owner: watch::Receiver<Option<Option<Owner>>>,
    witness: std::sync::Arc<tokio::sync::Mutex<Option<Witness>>>,
}

/// How often the owner lookup is retried while the API server does not answer.
const OWNER_RETRY: Duration = Duration::from_secs(5);

impl Departure {
    /// Looks up the owner of the pod `namespace/pod` (`None`: not run in a pod), then watches
    /// it.
    #[must_use]
    pub fn start(client: kube::Client, pod: Option<(String, String)>, health: WatchHealth) -> Self {
        let (tx, owner) = watch::channel(None);
        let witness = std::sync::Arc::new(tokio::sync::Mutex::new(None));
        let watching = witness.clone();
        tokio::spawn(async move {
            let Some((namespace, pod)) = pod else {
                tx.send_replace(Some(None));
                return;
            };
            let found = loop {
                match self::owner(&client, &namespace, &pod).await {
                    Ok(found) => break found,
                    // Not allowed to read its own pod: the permission check names it, and
                    // without an owner the agent never uninstalls itself.
                    Err(err) if access::is_refused(&err) => {
                        tracing::warn!(error = %err, "this agent may not read its own pod: it cannot tell an uninstall");
                        break None;
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "reading this agent's pod to find its DaemonSet; retrying");
                        tokio::time::sleep(OWNER_RETRY).await;
                    }
                }
            };
            if let Some(owner) = &found {
                *watching.lock().await = Some(Witness::start(client, owner, health));
            } else {
                tracing::info!(
                    "this agent's pod has no DaemonSet owner: it never uninstalls itself"
                );
            }
            tx.send_replace(Some(found));
        });
        Self { owner, witness }
    }

    /// The owner, once looked up.
    pub async fn owner(&self) -> Option<Owner> {
        let mut owner = self.owner.clone();
        owner
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|o| o.clone())
            .flatten()
    }

    /// The verdict at SIGTERM on the node `node` ([`conclude`]); `None` when no owner is known (not run by a
    /// DaemonSet, or its pod could never be read).
    pub async fn conclude(
        &self,
        client: &kube::Client,
        node: &str,
        agent_needs: &[Need],
        plugin: Option<(kube::Client, Vec<Need>)>,
    ) -> Option<Verdict> {
        let owner = self.owner.borrow().clone().flatten()?;
        let mut witness = self.witness.lock().await;
        Some(
            conclude(
                client,
                (&owner, node),
                witness.as_mut(),
                agent_needs,
                plugin,
            )
            .await,
        )
    }
}
