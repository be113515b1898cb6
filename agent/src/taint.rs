//! The startup taint: the first-install race, closed.
//!
//! A node can run pods before meshcap's agent has ever run on it (a new node joins, or meshcap
//! is installed into a running cluster): until the agent has chained its plugin into the CNI
//! configuration, the runtime starts pods without it, uncaptured. Nodes created with this taint
//! (`NoSchedule`, on the node pool or in kubelet's `--register-with-taints`) get only pods that
//! tolerate it — meshcap's agent tolerates everything — and the agent removes it from its own
//! node once it is ready. This is the role Istio gives `cni.istio.io/not-ready`, removed there by
//! istiod's untaint controller; meshcap's agent removes its own, so no controller needs rights
//! over every node.
//!
//! The removal is a JSON patch that first tests the taint list it read and then replaces it, so
//! a concurrent edit of the node's taints (by another controller) is never overwritten: the
//! patch fails and is retried on a fresh read.
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

/// meshcap's own taint key, by default. Nodes already provisioned with Istio's key can keep it
/// by configuring `cni.istio.io/not-ready`; istiod's untaint controller, if on, removes the same
/// taint on the same condition (the agent's pod Ready; a taint already gone is [`Removal::Absent`]).
pub const DEFAULT_KEY: &str = "cni.meshcap.io/not-ready";

/// The key Istio uses for the same purpose.
pub const ISTIO_KEY: &str = "cni.istio.io/not-ready";

/// How often a removal is retried when the node's taints changed under it.
const CONFLICT_RETRIES: usize = 5;

/// What [`remove`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// The taint was on the node and is now gone.
    Removed,
    /// The node did not carry the taint.
    Absent,
}

/// Errors of the taint removal; each names the node and the key.
#[derive(Debug, thiserror::Error)]
pub enum TaintError {
    /// Reading or patching the node failed.
    #[error("node {node}: removing taint {key}: {source}")]
    Api {
        /// The node.
        node: String,
        /// The taint key.
        key: String,
        /// What the API server said.
        #[source]
        source: kube::Error,
    },
    /// Other writers kept changing the taints.
    #[error(
        "node {node}: removing taint {key}: its taints kept changing under {CONFLICT_RETRIES} attempts"
    )]
    Conflict {
        /// The node.
        node: String,
        /// The taint key.
        key: String,
    },
}

/// Removes every taint with `key` (whatever its effect) from `node`. Call it once the agent is
/// ready: its plugin is installed and its backend can capture pods.
///
/// # Errors
/// When the API server refuses or is unreachable, or the taints keep changing concurrently.
pub async fn remove(client: Client, node: &str, key: &str) -> Result<Removal, TaintError> {
    let nodes: Api<Node> = Api::all(client);
    let api_error = |source| TaintError::Api {
        node: node.to_owned(),
        key: key.to_owned(),
        source,
    };
    for _ in 0..CONFLICT_RETRIES {
        let current = nodes.get(node).await.map_err(api_error)?;
        let taints: Vec<Taint> = current
            .spec
            .and_then(|spec| spec.taints)
            .unwrap_or_default();
        let kept: Vec<&Taint> = taints.iter().filter(|t| t.key != key).collect();
        if kept.len() == taints.len() {
            return Ok(Removal::Absent);
        }
        let patch: json_patch::Patch = serde_json::from_value(json!([
            { "op": "test", "path": "/spec/taints", "value": taints },
            { "op": "replace", "path": "/spec/taints", "value": kept },
        ]))
        .map_err(|e| api_error(kube::Error::SerdeError(e)))?;
        match nodes
            .patch(node, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => {
                tracing::info!(node, key, "removed the startup taint");
                return Ok(Removal::Removed);
            }
            // A failed `test` op: the taints changed since the read. Read again.
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 409 => {
                tracing::debug!(node, key, "node taints changed concurrently; retrying");
            }
            Err(err) => return Err(api_error(err)),
        }
    }
    Err(TaintError::Conflict {
        node: node.to_owned(),
        key: key.to_owned(),
    })
}
