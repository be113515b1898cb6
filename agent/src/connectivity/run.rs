//! One run of the connectivity test against a cluster, with the operator's credentials: the
//! leftovers of killed runs removed by label, the namespace and its pods created in three
//! rounds (each round's pods need the addresses of the last's), the apps' logs read and
//! judged, the namespace deleted. Each wait ends at the run's deadline: a pod that never runs
//! (not scheduled, image not pulled, refused) fails the checks it serves, naming the pod and
//! its state, instead of hanging the run.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Namespace, Node, Pod},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, LogParams, PostParams},
};
use serde_json::Value;

use super::{
    agent::node_agents,
    ambient,
    plan::{Plan, Role, SERVER_PORT, SIDECAR_PORT, selector},
    pod_state::{address, app_ended, second_address, state},
    report::{self, Addresses, Check, NodeResults, Outcome, judge, results},
    table::Report,
};

/// How often pods are looked at while waiting.
const POLL: Duration = Duration::from_secs(1);

/// What the operator asked for.
#[derive(Clone, Debug)]
pub struct Options {
    /// The nodes to check (empty: every node).
    pub nodes: Vec<String>,
    /// meshcap's image.
    pub image: String,
    /// Leave the namespace in place.
    pub keep: bool,
    /// The whole run's deadline.
    pub timeout: Duration,
    /// meshcap's DaemonSet: its namespace, its name, and itself when it exists.
    pub agent: (String, String, Option<DaemonSet>),
}

/// Errors that end a run (a check failing is not one: it is in the [`Report`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("the manifest of {what}: {source}")]
    Manifest {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("no node to check")]
    NoNodes,
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Kube { what, source }
}

/// Deletes every namespace carrying the test's label (a killed run's); returns their names.
///
/// # Errors
/// When they cannot be listed or deleted.
pub async fn remove_leftovers(client: &Client) -> Result<Vec<String>, RunError> {
    let api: Api<Namespace> = Api::all(client.clone());
    let list = api
        .list(&ListParams::default().labels(&selector()))
        .await
        .map_err(kube_err("listing the namespaces of earlier runs"))?;
    let mut removed = Vec::new();
    for ns in list.items {
        let Some(name) = ns.metadata.name else {
            continue;
        };
        delete(&api, &name).await?;
        removed.push(name);
    }
    Ok(removed)
}

/// Deletes the namespace `name` (gone already is fine).
///
/// # Errors
/// When the API server refuses.
pub async fn delete_namespace(client: &Client, name: &str) -> Result<(), RunError> {
    delete(&Api::all(client.clone()), name).await
}

async fn delete(api: &Api<Namespace>, name: &str) -> Result<(), RunError> {
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(kube_err(format!("deleting namespace {name}"))(e)),
    }
}

/// The nodes to check, the named ones or every Linux node of the cluster (a node labelled
/// `kubernetes.io/os` with another system runs neither meshcap nor its image), each with its
/// kernel as its kubelet reports it.
async fn nodes(client: &Client, named: &[String]) -> Result<Vec<(String, String)>, RunError> {
    let list = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube_err("listing the nodes"))?;
    let kernel = |node: &Node| {
        node.status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map_or_else(|| "unknown".to_owned(), |i| i.kernel_version.clone())
    };
    let kernels: BTreeMap<String, String> = list
        .items
        .iter()
        .filter(|n| {
            !named.is_empty()
                || n.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("kubernetes.io/os"))
                    .is_none_or(|os| os == "linux")
        })
        .filter_map(|n| Some((n.metadata.name.clone()?, kernel(n))))
        .collect();
    let nodes: Vec<(String, String)> = if named.is_empty() {
        kernels.into_iter().collect()
    } else {
        named
            .iter()
            .map(|n| {
                let kernel = kernels.get(n).cloned();
                (
                    n.clone(),
                    kernel.unwrap_or_else(|| "unknown (no such node)".into()),
                )
            })
            .collect()
    };
    if nodes.is_empty() {
        return Err(RunError::NoNodes);
    }
    Ok(nodes)
}

/// Runs the test in the namespace of `plan`, and deletes it unless `options.keep`.
///
/// # Errors
/// When the cluster refuses what the test needs (it then still tries to delete the namespace).
pub async fn run(client: &Client, plan: &Plan, options: &Options) -> Result<Report, RunError> {
    let outcome = checks(client, plan, options).await;
    if !options.keep {
        let deleted = delete_namespace(client, &plan.namespace).await;
        if outcome.is_ok() {
            deleted?;
        }
    }
    outcome
}

async fn checks(client: &Client, plan: &Plan, options: &Options) -> Result<Report, RunError> {
    let deadline = Instant::now() + options.timeout;
    let (nodes, kernels): (Vec<String>, Vec<String>) =
        nodes(client, &options.nodes).await?.into_iter().unzip();
    let (agent_namespace, daemon_set, found) = &options.agent;
    let agents = node_agents(client, agent_namespace, daemon_set, found.as_ref(), &nodes)
        .await
        .map_err(kube_err(format!(
            "listing the pods of DaemonSet {agent_namespace}/{daemon_set}"
        )))?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &from_value("the namespace", plan.namespace())?,
        )
        .await
        .map_err(kube_err(format!("creating namespace {}", plan.namespace)))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &plan.namespace);
    let mut run = Round {
        pods: &pods,
        deadline,
        created: BTreeSet::new(),
        stuck: BTreeMap::new(),
    };

    let ambient_on = |node: &String| agents.get(node).and_then(|a| a.ambient);
    let mut first = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        first.push((Role::Server.pod(i), plan.server(i, node)));
        if ambient_on(node) == Some(true) {
            first.push((Role::Ambient.pod(i), plan.ambient(i, node)));
        }
    }
    let server_ips = run.create_and_wait(first).await?;
    let at = |ips: &BTreeMap<String, (IpAddr, Option<IpAddr>)>, pod: String, port: u16| {
        ips.get(&pod).map(|(ip, second)| Addresses {
            first: SocketAddr::new(*ip, port),
            second: second.map(|ip| SocketAddr::new(ip, port)),
        })
    };
    let server = |i: usize| at(&server_ips, Role::Server.pod(i), SERVER_PORT);

    let mut meshed = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Some(server) = server(i) {
            meshed.push((Role::Sidecar.pod(i), plan.sidecar(i, node, server)));
            meshed.push((Role::Excluded.pod(i), plan.excluded(i, node, server.first)));
            meshed.push((Role::Dns.pod(i), plan.dns(i, node, server.first)));
        }
    }
    let meshed_ips = run.create_and_wait(meshed).await?;
    let sidecar = |i: usize| at(&meshed_ips, Role::Sidecar.pod(i), SIDECAR_PORT);

    // Each node's pod outside the mesh also dials the next node's sidecar pod.
    let next = |i: usize| (nodes.len() > 1).then(|| (i + 1) % nodes.len());
    let previous = |i: usize| (nodes.len() > 1).then(|| (i + nodes.len() - 1) % nodes.len());
    let mut outside = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let other = next(i).and_then(sidecar).map(|s| s.first);
        if let (Some(server), Some(sidecar)) = (server(i), sidecar(i)) {
            outside.push((
                Role::Outside.pod(i),
                plan.outside(i, node, server, sidecar, other),
            ));
        }
    }
    run.create_and_wait(outside).await?;
    let mut outside_apps = Vec::new();
    for i in 0..nodes.len() {
        outside_apps.push(run.app_results(&Role::Outside.pod(i)).await);
    }

    let mut report = Report::default();
    for (i, (node, kernel)) in nodes.iter().zip(kernels).enumerate() {
        let agent = agents.get(node);
        let backend = agent.map_or_else(
            || "backend unknown".to_owned(),
            |a| match &a.backend {
                Ok(backend) => format!("backend {backend}"),
                Err(why) => format!("backend unknown ({why})"),
            },
        );
        let pod = agent
            .and_then(|a| a.pod.as_deref())
            .map_or_else(String::new, |p| format!("agent pod {p}, "));
        report
            .about
            .push((node.clone(), format!("{pod}{backend}, kernel {kernel}")));
        let mut results = NodeResults {
            server: server(i),
            sidecar: sidecar(i),
            ..NodeResults::default()
        };
        results.sidecar_app = run.app_results(&Role::Sidecar.pod(i)).await;
        results.excluded_app = run.app_results(&Role::Excluded.pod(i)).await;
        results.outside_app = outside_apps[i].clone();
        results.dns_app = run.app_results(&Role::Dns.pod(i)).await;
        let (ready, host) = agent.map_or_else(
            || {
                let none = Outcome::NotChecked("no agent found".into());
                (none.clone(), none)
            },
            |a| (a.outcome.clone(), a.host.clone()),
        );
        let name = Role::Ambient.pod(i);
        let enrolled = match (ambient::not_checked(ambient_on(node)), run.stuck.get(&name)) {
            (Some(outcome), _) => outcome,
            (None, Some(why)) => Outcome::Fail(why.clone()),
            (None, None) => ambient::with_ztunnels(
                ambient::enrolled(&pods, &name, deadline).await,
                agent.and_then(|a| a.ztunnels),
            ),
        };
        // The pods of two nodes: this one's server and sidecar, the one before's outside.
        let stuck = [Role::Server.pod(i), Role::Sidecar.pod(i)]
            .into_iter()
            .chain(previous(i).map(|from| Role::Outside.pod(from)))
            .find_map(|pod| run.stuck.get(&pod));
        let cross = match (previous(i), stuck, sidecar(i)) {
            (None, ..) => {
                Outcome::NotChecked("one node: no pod of another node to dial from".into())
            }
            (Some(_), Some(why), _) => Outcome::Fail(why.clone()),
            (Some(_), None, None) => Outcome::NotChecked("the sidecar pod has no address".into()),
            (Some(from), None, Some(sidecar)) => {
                report::cross_node(&outside_apps[from], sidecar.first)
            }
        };
        let outcomes = [(Check::AgentReady, ready), (Check::Host, host)]
            .into_iter()
            .chain(judge(&results))
            .chain([(Check::CrossNode, cross), (Check::Ambient, enrolled)])
            .map(|(check, outcome)| {
                let stuck = roles(check)
                    .iter()
                    .find_map(|role| run.stuck.get(&role.pod(i)));
                (
                    check,
                    stuck.map_or(outcome, |why| Outcome::Fail(why.clone())),
                )
            })
            .collect();
        report.nodes.push((node.clone(), outcomes));
    }
    Ok(report)
}

/// The pods a check needs, in the order they are created.
fn roles(check: Check) -> &'static [Role] {
    match check {
        Check::AgentReady | Check::Host => &[],
        Check::Outbound | Check::OutboundSecond => &[Role::Server, Role::Sidecar],
        Check::Inbound | Check::InboundSecond => &[Role::Server, Role::Sidecar, Role::Outside],
        Check::Excluded => &[Role::Server, Role::Excluded],
        Check::Untouched => &[Role::Server, Role::Sidecar, Role::Outside],
        Check::Dns => &[Role::Server, Role::Dns],
        // The pods of two nodes: judged where the outcome is made.
        Check::CrossNode => &[],
        Check::Ambient => &[Role::Ambient],
    }
}

fn from_value<T: serde::de::DeserializeOwned>(what: &str, value: Value) -> Result<T, RunError> {
    serde_json::from_value(value).map_err(|source| RunError::Manifest {
        what: what.to_owned(),
        source,
    })
}

/// The pods of one run and the deadline they share.
struct Round<'a> {
    pods: &'a Api<Pod>,
    deadline: Instant,
    /// The pods created.
    created: BTreeSet<String>,
    /// Each pod that did not get as far as it had to, and its state.
    stuck: BTreeMap<String, String>,
}

impl Round<'_> {
    /// Creates `pods` and waits until each has an address (or the deadline); returns the
    /// addresses, each with the pod's address of the other family in a dual-stack cluster.
    async fn create_and_wait(
        &mut self,
        pods: Vec<(String, Value)>,
    ) -> Result<BTreeMap<String, (IpAddr, Option<IpAddr>)>, RunError> {
        for (name, manifest) in &pods {
            let pod: Pod = from_value(name, manifest.clone())?;
            self.pods
                .create(&PostParams::default(), &pod)
                .await
                .map_err(kube_err(format!("creating pod {name}")))?;
            self.created.insert(name.clone());
        }
        let mut ips = BTreeMap::new();
        let mut waiting: Vec<String> = pods.into_iter().map(|(name, _)| name).collect();
        loop {
            let mut still = Vec::new();
            for name in waiting {
                let pod = self
                    .pods
                    .get(&name)
                    .await
                    .map_err(kube_err(format!("reading pod {name}")))?;
                match address(&pod) {
                    Some(ip) => {
                        ips.insert(name, (ip, second_address(&pod)));
                    }
                    None if Instant::now() >= self.deadline => {
                        self.stuck.insert(
                            name.clone(),
                            format!("pod {name} is not running: {}", state(&pod)),
                        );
                    }
                    None => still.push(name),
                }
            }
            if still.is_empty() {
                return Ok(ips);
            }
            waiting = still;
            tokio::time::sleep(POLL).await;
        }
    }

    /// What the `app` container of `name` printed, once it has ended (or at the deadline);
    /// nothing for a pod not created (what it needed was stuck) or already known stuck.
    async fn app_results(&mut self, name: &str) -> Vec<super::probe::Dialled> {
        if !self.created.contains(name) || self.stuck.contains_key(name) {
            return Vec::new();
        }
        loop {
            let pod = match self.pods.get(name).await {
                Ok(pod) => pod,
                Err(e) => {
                    self.stuck
                        .insert(name.to_owned(), format!("pod {name}: {e}"));
                    return Vec::new();
                }
            };
            if app_ended(&pod) || Instant::now() >= self.deadline {
                let params = LogParams {
                    container: Some("app".into()),
                    ..LogParams::default()
                };
                return match self.pods.logs(name, &params).await {
                    Ok(log) => results(&log),
                    Err(e) => {
                        self.stuck.insert(
                            name.to_owned(),
                            format!("pod {name}: its app's log: {e} ({})", state(&pod)),
                        );
                        Vec::new()
                    }
                };
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
