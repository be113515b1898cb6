//! The repair controller: Istio's answer to pods that started before their capture was in
//! place (`cni/pkg/repair/repaircontroller.go`, `repaircontroller_linux.go`). Such a pod's
//! `istio-validation` init container finds no redirection and exits 126, and kubelet restarts
//! it for ever. Pods scheduled before meshcap's first install on a node (no startup taint, or
//! pods that tolerate every taint) or started while the CNI entry was missing end up there.
//!
//! It follows this node's pods (the node's one pod watch, field selector `spec.nodeName`, shared
//! with the pod source as Istio's controllers share its informer: [`crate::pods::feed`]), picks
//! the broken ones exactly as Istio does ([`detect`]) and acts in one of Istio's three modes,
//! first set wins in Istio's order:
//!
//! - `repairPods` (default): captures the running pod in place, through the same path as a CNI
//!   ADD (same decision, same backend, same records, so a later CHECK and DEL work); the pod's
//!   next `istio-validation` run passes. Each pod (by uid) once. Needs no RBAC beyond the pod
//!   watch; its namespace is found by [`podnet::find`], and must still hold one of the pod's
//!   IPs when the capture is made (the hub checks it).
//! - `deletePods`: deletes the pod with uid and resourceVersion preconditions, so that it is
//!   rescheduled (RBAC: `pods` `delete`).
//! - `labelPods`: sets `brokenPodLabelKey=brokenPodLabelValue` through `pods/status` (RBAC:
//!   `pods/status` `patch`), unless the label is there.
//!
//! Each action is counted in Istio's `istio_cni_repair_pods_repaired_total{type,result}`
//! (`cni/pkg/repair/monitoring.go`, counted as `repaircontroller.go` counts it) and leaves a
//! Warning Event on the pod.
pub mod detect;

use std::{collections::HashMap, path::PathBuf, sync::Arc};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, Preconditions},
    runtime::watcher,
};
use meshcap_policy::PodName;
use tracing::{info, warn};

use crate::{
    events::EventSink,
    hub::{CaptureError, Done, Hub},
    pod::{InPlace, Sandbox},
    podnet::{self, find::FindError},
    pods::feed::PodEvents,
    settings::{self, SettingsError},
};

/// What the controller does with a broken pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Capture it in place (`repairPods`).
    Repair,
    /// Delete it (`deletePods`).
    Delete,
    /// Label it (`labelPods`).
    Label,
}

impl Mode {
    /// The metric's `type` label, as Istio's.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::Repair => "repair",
            Self::Delete => "delete",
            Self::Label => "label",
        }
    }
}

/// The controller's settings, Istio's names and defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepairConfig {
    /// The mode that acts; `None` when the controller is off or no mode is set.
    pub mode: Option<Mode>,
    /// Only pods with this annotation are looked at (`sidecar.istio.io/status`).
    pub sidecar_annotation: String,
    /// The init container whose failure marks a broken pod (`istio-validation`).
    pub init_container_name: String,
    /// Its exit code when it finds no capture (126); 0 accepts any.
    pub init_exit_code: i32,
    /// Its termination message, when one must match (empty: any).
    pub init_termination_msg: String,
    /// The label `labelPods` sets.
    pub label_key: String,
    /// Its value.
    pub label_value: String,
}

impl Default for RepairConfig {
    fn default() -> Self {
        Self {
            mode: Some(Mode::Repair),
            sidecar_annotation: "sidecar.istio.io/status".into(),
            init_container_name: settings::REPAIR_INIT_CONTAINER_NAME.default.into(),
            init_exit_code: 126,
            init_termination_msg: String::new(),
            label_key: settings::REPAIR_BROKEN_POD_LABEL_KEY.default.into(),
            label_value: settings::REPAIR_BROKEN_POD_LABEL_VALUE.default.into(),
        }
    }
}

impl RepairConfig {
    /// The settings through `lookup` (e.g. `|name| std::env::var(name).ok()`).
    ///
    /// # Errors
    /// When a boolean setting is not one.
    pub fn from_settings(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, SettingsError> {
        let get = |s: settings::Setting| lookup(s.env).unwrap_or_else(|| s.default.to_owned());
        let enabled = settings::bool_setting(&lookup, settings::REPAIR_ENABLED)?;
        let (repair, delete, label) = (
            settings::bool_setting(&lookup, settings::REPAIR_REPAIR_PODS)?,
            settings::bool_setting(&lookup, settings::REPAIR_DELETE_PODS)?,
            settings::bool_setting(&lookup, settings::REPAIR_LABEL_PODS)?,
        );
        // Istio's ReconcilePod: repairPods, else deletePods, else labelPods.
        let mode = match (enabled, repair, delete, label) {
            (false, ..) => None,
            (true, true, ..) => Some(Mode::Repair),
            (true, false, true, _) => Some(Mode::Delete),
            (true, false, false, true) => Some(Mode::Label),
            (true, false, false, false) => None,
        };
        Ok(Self {
            mode,
            init_container_name: get(settings::REPAIR_INIT_CONTAINER_NAME),
            label_key: get(settings::REPAIR_BROKEN_POD_LABEL_KEY),
            label_value: get(settings::REPAIR_BROKEN_POD_LABEL_VALUE),
            ..Self::default()
        })
    }
}

/// Why a broken pod was not repaired.
#[derive(Debug, thiserror::Error)]
enum RepairError {
    /// Looking for its netns did not finish.
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
    /// Its netns was not found.
    #[error("pod detected as broken, but its network namespace: {0}")]
    Netns(#[from] FindError),
    /// meshcap leaves the pod alone (how, in words).
    #[error("pod detected as broken, but meshcap would not capture it: {0}")]
    NotCaptured(String),
    /// Capturing it failed.
    #[error("pod detected as broken, but capturing it failed: {0}")]
    Capture(#[from] CaptureError),
    /// Deleting it failed.
    #[error("pod detected as broken, but failed to delete: {0}")]
    Delete(#[source] kube::Error),
    /// Labelling it failed.
    #[error("pod detected as broken, but failed to label: {0}")]
    Label(#[source] kube::Error),
}

/// The running controller's state.
pub struct Repairer {
    client: kube::Client,
    config: RepairConfig,
    mode: Mode,
    hub: Arc<Hub>,
    events: EventSink,
    netns_dir: PathBuf,
    /// Pods captured in place, by name, with the uid repaired (each once).
    repaired: HashMap<PodName, String>,
}

impl Repairer {
    /// A controller for the node's pods; `None` when `config` sets no mode.
    #[must_use]
    pub fn new(
        client: kube::Client,
        config: RepairConfig,
        hub: Arc<Hub>,
        events: EventSink,
        netns_dir: PathBuf,
    ) -> Option<Self> {
        Some(Self {
            mode: config.mode?,
            client,
            config,
            hub,
            events,
            netns_dir,
            repaired: HashMap::new(),
        })
    }

    /// Follows this node's pods (the node's one pod watch, [`PodEvents`]) until the watch
    /// ends (never, in practice: it retries with backoff).
    pub async fn run(mut self, mut pods: PodEvents) {
        info!(
            mode = self.mode.label(),
            "repair controller following this node's pods"
        );
        while let Some(event) = pods.next().await {
            match event {
                watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                    self.reconcile(&pod).await;
                }
                watcher::Event::Delete(pod) => {
                    self.repaired.remove(&PodName::of(&pod));
                }
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
        }
    }

    async fn reconcile(&mut self, pod: &Pod) {
        if !detect::is_broken(pod, &self.config) {
            return;
        }
        let name = PodName::of(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let result = match self.mode {
            Mode::Repair => {
                if self.repaired.get(&name) == Some(&uid) {
                    return;
                }
                let done = self.repair(pod).await;
                if done.is_ok() {
                    self.repaired.insert(name.clone(), uid.clone());
                }
                done
            }
            Mode::Delete => self.delete(pod).await,
            Mode::Label => self.label(pod).await,
        };
        let (outcome, note) = match result {
            Ok(Some(note)) => ("success", note),
            Ok(None) => ("skip", String::new()),
            Err(err) => ("fail", err.to_string()),
        };
        self.hub.metrics().repaired(self.mode.label(), outcome);
        if outcome == "fail" {
            warn!(pod = %name, mode = self.mode.label(), "broken pod not repaired: {note}");
        } else {
            info!(pod = %name, mode = self.mode.label(), outcome, "broken pod: {note}");
        }
        if outcome != "skip" {
            let reason = match self.mode {
                Mode::Repair => "RepairBrokenPod",
                Mode::Delete => "DeleteBrokenPod",
                Mode::Label => "LabelBrokenPod",
            };
            self.events.warn(name, Some(uid), reason, "Repair", note);
        }
    }

    /// Captures the running pod in place, as an ADD captures it: Ok(note) when captured.
    async fn repair(&self, pod: &Pod) -> Result<Option<String>, RepairError> {
        let ips = meshcap_policy::status_pod_ips(pod);
        let dir = self.netns_dir.clone();
        let search = ips.clone();
        let netns =
            tokio::task::spawn_blocking(move || podnet::find::find(&dir, &search)).await??;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        // The sandbox id is the runtime's; the API does not say it. The runtime's DEL names
        // the pod's netns, by which both backends find this capture.
        let sandbox =
            Sandbox::in_place(PodName::of(pod), &uid, InPlace::Repair, netns.clone(), ips);
        match self.hub.add(sandbox).await? {
            Done::Captured(message) => Ok(Some(format!(
                "pod detected as broken, captured in place in {}: {message}",
                netns.display()
            ))),
            other => Err(RepairError::NotCaptured(other.message())),
        }
    }

    /// Deletes the pod, if it is still the one seen.
    async fn delete(&self, pod: &Pod) -> Result<Option<String>, RepairError> {
        let PodName { namespace, name } = PodName::of(pod);
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: pod.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        Api::<Pod>::namespaced(self.client.clone(), &namespace)
            .delete(&name, &params)
            .await
            .map(|_| Some("pod detected as broken, deleted".to_owned()))
            .map_err(RepairError::Delete)
    }

    /// Labels the pod through `pods/status`, unless it carries the label already.
    async fn label(&self, pod: &Pod) -> Result<Option<String>, RepairError> {
        if pod
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(&self.config.label_key))
        {
            return Ok(None);
        }
        let PodName { namespace, name } = PodName::of(pod);
        let patch = serde_json::json!({
            "metadata": {"labels": {&self.config.label_key: &self.config.label_value}}
        });
        Api::<Pod>::namespaced(self.client.clone(), &namespace)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| {
                Some(format!(
                    "pod detected as broken, labeled {}={}",
                    self.config.label_key, self.config.label_value
                ))
            })
            .map_err(RepairError::Label)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_mode_acts_in_istios_order() {
        let with = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            RepairConfig::from_settings(move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
            .expect("settings")
        };
        assert_eq!(with(&[]), RepairConfig::default());
        assert_eq!(with(&[]).mode, Some(Mode::Repair));
        let all = [
            ("MESHCAP_REPAIR_DELETE_PODS", "true"),
            ("MESHCAP_REPAIR_LABEL_PODS", "true"),
        ];
        assert_eq!(with(&all).mode, Some(Mode::Repair));
        let mut no_repair = all.to_vec();
        no_repair.push(("MESHCAP_REPAIR_REPAIR_PODS", "false"));
        assert_eq!(with(&no_repair).mode, Some(Mode::Delete));
        assert_eq!(
            with(&[
                ("MESHCAP_REPAIR_REPAIR_PODS", "false"),
                ("MESHCAP_REPAIR_LABEL_PODS", "true")
            ])
            .mode,
            Some(Mode::Label)
        );
        assert_eq!(with(&[("MESHCAP_REPAIR_REPAIR_PODS", "false")]).mode, None);
        assert_eq!(with(&[("MESHCAP_REPAIR_ENABLED", "false")]).mode, None);
        let err = RepairConfig::from_settings(|name| {
            (name == "MESHCAP_REPAIR_LABEL_PODS").then(|| "yes".to_owned())
        })
        .expect_err("not a boolean");
        assert!(
            err.to_string().contains("MESHCAP_REPAIR_LABEL_PODS"),
            "{err}"
        );
    }
}
