//! What the cluster runs on each node, and whether meshcap's agent there says it captures: the
//! pods of meshcap's DaemonSet (by its selector, on their node), their readiness, and, through
//! the API server's `pods/proxy`, the agent's own `/readyz` (on the port of the pod's readiness
//! probe) and `/metrics` (on its port named `metrics`), whose
//! `meshcap_pods_captured{backend=…}` names the node's backend. The agent serves both on the
//! node's network (`hostNetwork`), where the API server reaches the pod's address.
use std::collections::BTreeMap;

// kube's request type: the `http` crate, as axum re-exports it.
use axum::http;
use k8s_openapi::{
    api::{apps::v1::DaemonSet, core::v1::Pod},
    apimachinery::pkg::util::intstr::IntOrString,
};
use kube::{Api, Client, api::ListParams};

use super::{host, pod_state::state, report::Outcome};

/// The agent's readiness path (`agent/src/api/http.rs`).
const READYZ: &str = "/readyz";
/// The agent's metrics path.
const METRICS: &str = "/metrics";
/// The gauge whose `backend` label is the node's backend (`agent/src/status/metrics.rs`).
const CAPTURED: &str = "meshcap_pods_captured{backend=\"";
/// The gauge that says whether the agent runs ambient mode.
const AMBIENT: &str = "meshcap_ambient_enabled ";
/// The gauge of ztunnels connected to the agent (Istio's name).
const ZTUNNELS: &str = "ztunnel_connected ";

/// What the run found of one node's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAgent {
    /// The check "agent ready".
    pub outcome: Outcome,
    /// The check "host prerequisites".
    pub host: Outcome,
    /// The agent's pod, when there is one.
    pub pod: Option<String>,
    /// The backend the agent reports, or why it is not known.
    pub backend: Result<String, String>,
    /// Whether the agent runs ambient mode, when it says.
    pub ambient: Option<bool>,
    /// How many ztunnels are connected to it, when it says.
    pub ztunnels: Option<u64>,
}

/// The port of the agent container's readiness probe, and its port named `metrics`.
#[must_use]
pub fn ports(pod: &Pod) -> (Option<u16>, Option<u16>) {
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return (None, None);
    };
    let health = container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .and_then(|g| match &g.port {
            IntOrString::Int(port) => u16::try_from(*port).ok(),
            IntOrString::String(name) => named_port(container, name),
        });
    (health, named_port(container, "metrics"))
}

fn named_port(container: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<u16> {
    container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| u16::try_from(p.container_port).ok())
}

/// Whether kubelet reports the pod ready (its `Ready` condition).
#[must_use]
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The backend a metrics exposition names (the first `meshcap_pods_captured` sample's).
#[must_use]
pub fn backend(metrics: &str) -> Option<String> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(CAPTURED)?;
        Some(rest.split_once('"')?.0.to_owned())
    })
}

/// Whether the agent runs ambient mode, from its metrics (an agent older than the gauge: not
/// known).
#[must_use]
pub fn ambient(metrics: &str) -> Option<bool> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(AMBIENT))
        .map(|value| value.trim() == "1")
}

/// The ztunnels connected to the agent, from its metrics.
#[must_use]
pub fn ztunnels(metrics: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(ZTUNNELS))
        .and_then(|value| value.trim().parse().ok())
}

/// The check from the pod's readiness and what its `/readyz` answered (the body, or the error
/// with its HTTP status when there was one).
#[must_use]
pub fn judge(pod: &Pod, readyz: &Result<String, String>) -> Outcome {
    let name = pod.metadata.name.as_deref().unwrap_or("unnamed");
    match (pod_ready(pod), readyz) {
        (true, Ok(_)) => Outcome::Ok,
        (false, Ok(_)) => Outcome::Fail(format!(
            "agent pod {name} is not ready ({}), though its /readyz answers ready",
            state(pod)
        )),
        (true, Err(why)) => Outcome::Fail(format!("agent pod {name}: /readyz: {why}")),
        (false, Err(why)) => Outcome::Fail(format!(
            "agent pod {name} is not ready ({}); /readyz: {why}",
            state(pod)
        )),
    }
}

/// The label selector of the DaemonSet's pods (`KEY=VALUE,…`), when it has one.
fn selector(daemon_set: &DaemonSet) -> Option<String> {
    let labels = daemon_set.spec.as_ref()?.selector.match_labels.as_ref()?;
    let terms: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    (!terms.is_empty()).then(|| terms.join(","))
}

/// `GET PATH` on `pod`'s `port` through the API server's `pods/proxy`: the body, or why none.
async fn proxied(
    client: &Client,
    namespace: &str,
    pod: &str,
    port: u16,
    path: &str,
) -> Result<String, String> {
    let uri = format!("/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy{path}");
    let request = http::Request::get(&uri)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    match client.request_text(request).await {
        Ok(body) => Ok(body.trim().to_owned()),
        Err(kube::Error::Api(status)) => Err(format!(
            "answered {}: {}",
            status.code,
            status.message.trim()
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Each node's agent, from the pods of `daemon_set` (in `namespace`, named `name`): FAIL on a
/// node without one, or whose agent is not ready.
///
/// # Errors
/// When the DaemonSet's pods cannot be listed.
pub async fn node_agents(
    client: &Client,
    namespace: &str,
    name: &str,
    daemon_set: Option<&DaemonSet>,
    nodes: &[String],
) -> Result<BTreeMap<String, NodeAgent>, kube::Error> {
    let missing = |why: String| NodeAgent {
        outcome: Outcome::Fail(why.clone()),
        host: host::judge(None, &Err(why.clone())),
        pod: None,
        backend: Err(why),
        ambient: None,
        ztunnels: None,
    };
    let Some(selector) = daemon_set.and_then(selector) else {
        let why = format!("meshcap's DaemonSet {namespace}/{name} is not in the cluster");
        return Ok(nodes
            .iter()
            .map(|n| (n.clone(), missing(why.clone())))
            .collect());
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api
        .list(&ListParams::default().labels(&selector))
        .await?
        .items;
    let mut agents = BTreeMap::new();
    for node in nodes {
        let mut here: Vec<&Pod> = pods
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
            .collect();
        // During a rolling update a node has two: the ready one speaks for it.
        here.sort_by_key(|p| !pod_ready(p));
        let Some(pod) = here.first() else {
            agents.insert(
                node.clone(),
                missing(format!(
                    "no pod of DaemonSet {namespace}/{name} on this node ({selector})"
                )),
            );
            continue;
        };
        agents.insert(node.clone(), node_agent(client, namespace, pod).await);
    }
    Ok(agents)
}

async fn node_agent(client: &Client, namespace: &str, pod: &Pod) -> NodeAgent {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let (health, metrics) = ports(pod);
    let readyz = match health {
        Some(port) => proxied(client, namespace, &name, port, READYZ).await,
        None => Err("the pod has no HTTP readiness probe to read".to_owned()),
    };
    let metrics = match metrics {
        Some(port) => proxied(client, namespace, &name, port, METRICS).await,
        None => Err("the pod declares no port named metrics".to_owned()),
    };
    NodeAgent {
        outcome: judge(pod, &readyz),
        host: host::judge(Some(pod), &readyz),
        pod: Some(name),
        backend: metrics
            .as_deref()
            .map_err(Clone::clone)
            .and_then(|text| backend(text).ok_or_else(|| "its metrics name none".to_owned())),
        ambient: metrics.as_deref().ok().and_then(ambient),
        ztunnels: metrics.as_deref().ok().and_then(ztunnels),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(ready: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "meshcap-agent-ab12c"},
            "spec": {"nodeName": "n", "containers": [{
                "name": "agent",
                "ports": [{"name": "metrics", "containerPort": 15014}],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8000}},
            }]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": ready}]},
        }))
        .expect("pod")
    }

    #[test]
    fn the_ports_are_the_probes_and_the_one_named_metrics() {
        assert_eq!(ports(&pod("True")), (Some(8000), Some(15014)));
        let bare: Pod =
            serde_json::from_value(json!({"spec": {"containers": [{"name": "a"}]}})).expect("pod");
        assert_eq!(ports(&bare), (None, None));
    }

    #[test]
    fn the_backend_is_the_captured_gauges_label() {
        let text = "# HELP meshcap_pods_captured Pods\n\
                    meshcap_pods_captured_total 3\n\
                    meshcap_pods_captured{backend=\"nftables\"} 2\n";
        assert_eq!(backend(text), Some("nftables".to_owned()));
        assert_eq!(backend("istio_cni_install_ready 1\n"), None);
    }

    #[test]
    fn ambient_mode_is_the_gauges_value_or_not_known() {
        let text = "# TYPE meshcap_ambient_enabled gauge\nmeshcap_ambient_enabled 1\n";
        assert_eq!(ambient(text), Some(true));
        assert_eq!(ambient("meshcap_ambient_enabled 0\n"), Some(false));
        assert_eq!(ambient("meshcap_pods_captured{backend=\"ebpf\"} 0\n"), None);
    }

    #[test]
    fn the_ztunnels_are_istios_gauge() {
        let text = "# HELP ztunnel_connected number of connections to ztunnel\n\
                    ztunnel_connected 0\n";
        assert_eq!(ztunnels(text), Some(0));
        assert_eq!(ztunnels("ztunnel_connected 2\n"), Some(2));
        assert_eq!(ztunnels("meshcap_ambient_enabled 1\n"), None);
    }

    #[test]
    fn ready_only_when_the_pod_and_its_readyz_say_so() {
        assert_eq!(judge(&pod("True"), &Ok("ready".into())), Outcome::Ok);
        let why = "answered 503: not ready: meshcap-cni is not in place".to_owned();
        assert_eq!(
            judge(&pod("False"), &Err(why.clone())),
            Outcome::Fail(format!(
                "agent pod meshcap-agent-ab12c is not ready (Running); /readyz: {why}"
            ))
        );
        assert_eq!(
            judge(&pod("True"), &Err(why.clone())),
            Outcome::Fail(format!("agent pod meshcap-agent-ab12c: /readyz: {why}"))
        );
        assert!(matches!(
            judge(&pod("False"), &Ok("ready".into())),
            Outcome::Fail(why) if why.contains("is not ready (Running)")
        ));
    }
}
