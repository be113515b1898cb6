//! Kubernetes Events on pods whose capture failed or drifted, as an operator looks for them
//! (`kubectl describe pod`, `kubectl get events`): the reason and the message, which names the
//! annotation and the value when one is at fault, or what was put back; node-wide drift on the
//! node (`kubectl describe node`). Published in the background: a request never
//! waits for the API server. RBAC: `create` and `patch` on `events.k8s.io` events.
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    Api,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use meshcap_policy::PodName;

/// Publishes events as `meshcap-agent` on this node.
#[derive(Clone)]
pub struct EventSink {
    client: kube::Client,
    recorder: Recorder,
    node: String,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink").finish_non_exhaustive()
    }
}

impl EventSink {
    /// A sink reporting as `meshcap-agent` on `node`.
    #[must_use]
    pub fn new(client: kube::Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "meshcap-agent".into(),
            instance: Some(node.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            node: node.to_owned(),
        }
    }

    /// A `Warning` event on this node (what is wrong is the node's, not one pod's), in the
    /// background.
    pub fn warn_node(&self, reason: &'static str, action: &'static str, note: String) {
        let recorder = self.recorder.clone();
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node.clone()),
            ..ObjectReference::default()
        };
        tokio::spawn(async move {
            let event = Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note),
                action: action.into(),
                secondary: None,
            };
            if let Err(err) = recorder.publish(&event, &reference).await {
                tracing::warn!(error = %err, "publishing an event on the node");
            }
        });
    }

    /// A `Warning` event on `pod`, in the background (a failure to publish is logged). `uid`
    /// is the pod's when the caller knows it (`K8S_POD_UID`); otherwise it is read from the
    /// API server, since `kubectl describe pod` shows only events that carry the pod's uid.
    pub fn warn(
        &self,
        pod: PodName,
        uid: Option<String>,
        reason: &'static str,
        action: &'static str,
        note: String,
    ) {
        let (client, recorder) = (self.client.clone(), self.recorder.clone());
        tokio::spawn(async move {
            let uid = match uid {
                Some(uid) => Some(uid),
                None => Api::<Pod>::namespaced(client, &pod.namespace)
                    .get_opt(&pod.name)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|found| found.metadata.uid),
            };
            let reference = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(pod.namespace.clone()),
                name: Some(pod.name.clone()),
                uid,
                ..ObjectReference::default()
            };
            let event = Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note),
                action: action.into(),
                secondary: None,
            };
            if let Err(err) = recorder.publish(&event, &reference).await {
                tracing::warn!(pod = %pod, error = %err, "publishing an event");
            }
        });
    }
}
