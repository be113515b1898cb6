//! The set of captures on this node: each pod's capture applied, checked and released through
//! the backend that serves its mode, and the node-wide views over all of them (GC, the status
//! report, the captured-pods gauge, captures whose netns went without a DEL).
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use tracing::{error, warn};

use super::{
    CaptureError,
    blocking::{Locks, off_the_runtime},
};
use crate::{
    ambient::Ambient,
    backend::{CaptureBackend, CapturedPod},
    pod::{PodRef, made_in_place},
    policy::{RedirectPolicy, ambient::InpodPolicy},
    probe::ProbeReport,
    status::metrics::Metrics,
};

/// Every capture, and what applies them.
pub(super) struct Captures {
    backend: Arc<dyn CaptureBackend>,
    /// Why this backend.
    backend_reason: String,
    /// The kernel probe, when one ran.
    probe: Option<ProbeReport>,
    /// Ambient mode, when this node runs it.
    ambient: Option<Arc<Ambient>>,
    /// Each sidecar capture's policy in one line, by container, as this process applied it.
    policies: Mutex<HashMap<String, String>>,
    /// Held while the captured-pods gauge is read and set, so that of requests finishing
    /// together the last to set it has read the last count (not one read before another
    /// request's change).
    gauge: Mutex<()>,
}

impl Captures {
    pub(super) fn new(
        backend: Arc<dyn CaptureBackend>,
        backend_reason: String,
        probe: Option<ProbeReport>,
        ambient: Option<Arc<Ambient>>,
    ) -> Self {
        Self {
            backend,
            backend_reason,
            probe,
            ambient,
            policies: Mutex::default(),
            gauge: Mutex::default(),
        }
    }

    /// The sidecar backend's name.
    pub(super) fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    pub(super) fn backend_reason(&self) -> &str {
        &self.backend_reason
    }

    pub(super) fn probe(&self) -> Option<&ProbeReport> {
        self.probe.as_ref()
    }

    /// Ambient mode, or why not.
    fn ambient(&self) -> Result<&Arc<Ambient>, CaptureError> {
        self.ambient.as_ref().ok_or(CaptureError::NoAmbient)
    }

    /// Captures `pod` for its sidecar, as `policy` says; the capture in words.
    pub(super) async fn capture(
        &self,
        pod: &PodRef,
        policy: Box<RedirectPolicy>,
        metrics: &Metrics,
    ) -> Result<String, CaptureError> {
        let summary = policy.summary();
        let target = pod.clone();
        self.blocking(move |b| b.add(&target, &policy)).await??;
        lock(&self.policies).insert(pod.container_id.clone(), summary.clone());
        self.update_gauge(metrics);
        Ok(format!(
            "captured by the {} backend: {summary}",
            self.backend.name()
        ))
    }

    /// Enrolls `pod` in ambient mode as `policy` says, annotated for istiod: whole or not at
    /// all (a pod that cannot be annotated is released again).
    pub(super) async fn enroll(
        &self,
        pod: &PodRef,
        workload: (String, String),
        policy: InpodPolicy,
        ips: Vec<IpAddr>,
    ) -> Result<(), CaptureError> {
        let ambient = self.ambient()?.clone();
        {
            let (ambient, target) = (ambient.clone(), pod.clone());
            let (uid, service_account) = workload;
            off_the_runtime(move || ambient.add(&target, &uid, &service_account, &policy, &ips))
                .await??;
        }
        if let Err(err) = ambient.annotate_enrolled(pod).await {
            let (undo, target) = (ambient.clone(), pod.clone());
            if let Err(undone) = off_the_runtime(move || undo.remove(&target)).await? {
                warn!(error = %undone, "undoing the enrollment of a pod that could not be annotated");
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Whether `pod` is captured for its sidecar as `policy` says.
    pub(super) async fn check(
        &self,
        pod: &PodRef,
        policy: Box<RedirectPolicy>,
    ) -> Result<(), CaptureError> {
        let target = pod.clone();
        Ok(self.blocking(move |b| b.check(&target, &policy)).await??)
    }

    /// Whether `pod`'s in-pod capture is as `policy` says.
    pub(super) async fn check_enrolled(
        &self,
        pod: &PodRef,
        policy: InpodPolicy,
    ) -> Result<(), CaptureError> {
        let (ambient, target) = (self.ambient()?.clone(), pod.clone());
        Ok(off_the_runtime(move || ambient.check(&target, &policy)).await??)
    }

    /// Releases whatever captures `pod`, in either mode.
    pub(super) async fn release(
        &self,
        pod: &PodRef,
        metrics: &Metrics,
    ) -> Result<(), CaptureError> {
        if let Some(ambient) = self.ambient.clone() {
            let target = pod.clone();
            off_the_runtime(move || ambient.remove(&target)).await??;
        }
        let target = pod.clone();
        self.blocking(move |b| b.remove(&target)).await??;
        lock(&self.policies).remove(&pod.container_id);
        self.update_gauge(metrics);
        Ok(())
    }

    /// Removes the captures the runtime no longer has (`valid`: the sandboxes it has), each
    /// under its container's lock; how many.
    pub(super) async fn collect(
        &self,
        valid: &[String],
        locks: &Locks,
        metrics: &Metrics,
    ) -> Result<usize, CaptureError> {
        let mut removed = 0;
        if let Some(ambient) = &self.ambient {
            let enrolled = {
                let ambient = ambient.clone();
                off_the_runtime(move || ambient.list()).await??
            };
            for stale in enrolled
                .into_iter()
                .filter(|c| collectable(&c.pod.container_id, valid))
            {
                let (pod, id) = (stale.pod.clone(), stale.pod.container_id.clone());
                let ambient = ambient.clone();
                let work = off_the_runtime(move || ambient.remove(&pod));
                match locks.run(&id, work).await? {
                    Ok(()) => removed += 1,
                    Err(err) => {
                        error!(container = %id, error = %err, "GC could not remove a stale ambient enrollment")
                    }
                }
            }
        }
        let captured = self.blocking(|b| b.list()).await??;
        for stale in captured
            .into_iter()
            .filter(|c| collectable(&c.pod.container_id, valid))
        {
            let pod = stale.pod.clone();
            let id = pod.container_id.clone();
            match locks
                .run(&id, self.blocking(move |b| b.remove(&pod)))
                .await?
            {
                Ok(()) => removed += 1,
                Err(err) => {
                    error!(container = %id, error = %err, "GC could not remove a stale capture")
                }
            }
        }
        self.update_gauge(metrics);
        Ok(removed)
    }

    /// Every capture, with the policy this process applied where it did; the node-wide programs,
    /// the other programs on their hooks, and the backend's warnings.
    pub(super) async fn report(&self) -> Result<Report, CaptureError> {
        let (captured, programs, other_programs, warnings) = self
            .blocking(|b| (b.list(), b.programs(), b.other_programs(), b.warnings()))
            .await?;
        let mut captured = captured?;
        if let Some(ambient) = self.ambient.clone() {
            captured.extend(off_the_runtime(move || ambient.list()).await??);
        }
        let policies = lock(&self.policies).clone();
        Ok(Report {
            pods: captured
                .into_iter()
                .map(|c| (policies.get(&c.pod.container_id).cloned(), c))
                .collect(),
            programs,
            other_programs,
            warnings,
        })
    }

    /// The backend's periodic checks: its warnings (which also keep meshcap's programs first
    /// where they can be moved), and the other programs on its hooks, counted in the metrics.
    pub(super) async fn check_backend(&self, metrics: &Metrics) -> Vec<String> {
        let Ok((warnings, others)) = self.blocking(|b| (b.warnings(), b.other_programs())).await
        else {
            return Vec::new();
        };
        metrics.set_other_programs(&others);
        warnings
    }

    /// Counts the other programs on the backend's hooks as they are now.
    pub(super) async fn count_other_programs(&self, metrics: &Metrics) {
        if let Ok(others) = self.blocking(|b| b.other_programs()).await {
            metrics.set_other_programs(&others);
        }
    }

    /// Drops the captures whose network namespace went without a DEL this agent saw (their
    /// runtime's DEL came while an earlier agent was down or dying, and the netns went after
    /// this one started): otherwise their pins and map entries, or iptables records, would
    /// stay until the next start. Each is dropped under its container's request lock and only
    /// if its netns is still gone there; what cannot be dropped is logged and tried again on
    /// the next call. Returns how many were dropped.
    pub(super) async fn drop_gone(&self, locks: &Locks, metrics: &Metrics) -> usize {
        let mut dropped = 0;
        if let Some(ambient) = self.ambient.clone() {
            match off_the_runtime(move || ambient.prune_gone()).await {
                Ok(Ok(gone)) => dropped += gone.len(),
                Ok(Err(err)) => warn!(error = %err, "dropping ambient pods whose netns is gone"),
                Err(failure) => {
                    warn!(error = %failure, "dropping ambient pods whose netns is gone")
                }
            }
        }
        let gone = match self.blocking(|b| b.gone()).await {
            Ok(Ok(gone)) => gone,
            Ok(Err(err)) => {
                warn!(error = %err, "looking for captures whose netns is gone");
                return dropped;
            }
            Err(failure) => {
                warn!(error = %failure, "looking for captures whose netns is gone");
                return dropped;
            }
        };
        for pod in gone {
            let (id, name) = (pod.container_id.clone(), pod.to_string());
            let work = self.blocking(move |b| b.drop_if_gone(&pod));
            match locks.run(&id, work).await {
                Ok(Ok(done)) => dropped += usize::from(done),
                Ok(Err(err)) => {
                    warn!(pod = %name, container = %id, error = %err, "dropping the capture of a pod whose netns is gone")
                }
                Err(failure) => {
                    warn!(pod = %name, container = %id, error = %failure, "dropping the capture of a pod whose netns is gone")
                }
            }
        }
        if dropped > 0 {
            self.update_gauge(metrics);
        }
        dropped
    }

    /// Sets the captured-pods gauge to what the backend holds now.
    pub(super) fn update_gauge(&self, metrics: &Metrics) {
        let _serial = lock(&self.gauge);
        if let Ok(count) = self.backend.captured_count() {
            metrics.set_captured(self.backend.name(), count);
        }
    }

    /// Runs a blocking backend call ([`off_the_runtime`]).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn CaptureBackend) -> T + Send + 'static,
    ) -> Result<T, CaptureError> {
        let backend = self.backend.clone();
        off_the_runtime(move || f(backend.as_ref())).await
    }
}

/// The node's captures, for the status report.
pub(super) struct Report {
    /// Every capture, with its policy in one line where this process applied it.
    pub(super) pods: Vec<(Option<String>, CapturedPod)>,
    pub(super) programs: Vec<crate::backend::AttachedProgram>,
    pub(super) other_programs: Vec<crate::backend::OtherProgram>,
    pub(super) warnings: Vec<String>,
}

/// Whether the runtime's GC may remove the capture recorded under `id` when its list of valid
/// attachments does not name it: not one made in place.
fn collectable(id: &str, valid: &[String]) -> bool {
    !made_in_place(id) && !valid.iter().any(|v| v == id)
}

/// The value behind `mutex`, also after a panic elsewhere held it (single assignments only).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
