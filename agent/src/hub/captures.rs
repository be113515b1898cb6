//! The set of captures on this node: each pod's capture applied, checked and released through
//! the backend that serves its mode, and the node-wide views over all of them (GC, the status
//! report, the captured-pods gauge, captures whose netns went without a DEL).
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use meshcap_policy::{DataplaneMode, RedirectPolicy};
use tracing::{error, warn};

use super::{
    CaptureError,
    request::{Locks, off_the_runtime},
};
use crate::{
    ambient::{Adopted, Ambient, IstioEnrolled},
    backend::{AmbientCapture, CapturedPod, PodPolicy, Router},
    pod::{PodRef, made_in_place},
    probe::ProbeReport,
    status::metrics::Metrics,
};

/// Every capture, and what applies them.
pub(super) struct Captures {
    router: Arc<Router>,
    /// Why the node's backend.
    backend_reason: String,
    /// The kernel probe, when one ran.
    probe: Option<ProbeReport>,
    /// Ambient mode, when this node runs it: where enrolled pods are annotated.
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
        router: Router,
        backend_reason: String,
        probe: Option<ProbeReport>,
        ambient: Option<Arc<Ambient>>,
    ) -> Self {
        Self {
            router: Arc::new(router),
            backend_reason,
            probe,
            ambient,
            policies: Mutex::default(),
            gauge: Mutex::default(),
        }
    }

    /// The backends, by mode.
    pub(super) const fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// The node's backend's name.
    pub(super) fn backend_name(&self) -> &'static str {
        self.router.node_backend().name()
    }

    pub(super) fn backend_reason(&self) -> &str {
        &self.backend_reason
    }

    pub(super) fn probe(&self) -> Option<&ProbeReport> {
        self.probe.as_ref()
    }

    /// Captures `pod` for its sidecar, as `policy` says; the capture in words.
    pub(super) async fn capture(
        &self,
        pod: &PodRef,
        policy: Box<RedirectPolicy>,
        metrics: &Metrics,
    ) -> Result<String, CaptureError> {
        let summary = policy.summary();
        let policy = PodPolicy::Sidecar(policy);
        self.routed(pod, move |router, pod| router.add(pod, &policy))
            .await??;
        lock(&self.policies).insert(pod.container_id.clone(), summary.clone());
        self.update_gauge(metrics);
        Ok(format!(
            "captured by the {} backend: {summary}",
            self.backend_name()
        ))
    }

    /// Enrolls `pod` in ambient mode as `capture` says, annotated for istiod: whole or not at
    /// all (a pod that cannot be annotated is released again).
    pub(super) async fn enroll(
        &self,
        pod: &PodRef,
        capture: AmbientCapture,
    ) -> Result<(), CaptureError> {
        let ambient = self.ambient.clone().ok_or(CaptureError::NoAmbient)?;
        let policy = PodPolicy::Ambient(Box::new(capture));
        self.routed(pod, move |router, pod| router.add(pod, &policy))
            .await??;
        if let Err(err) = ambient.annotate_enrolled(&pod.pod_name()).await {
            let undone = self
                .routed(pod, |router, pod| {
                    router
                        .serving(DataplaneMode::Ambient)
                        .map_or(Ok(()), |ambient| ambient.remove(pod))
                })
                .await?;
            if let Err(undone) = undone {
                warn!(error = %undone, "undoing the enrollment of a pod that could not be annotated");
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Adopts a running pod istio-cni enrolled ([`Ambient::adopt_running`]).
    pub(super) async fn adopt(&self, pod: IstioEnrolled) -> Result<Adopted, CaptureError> {
        let ambient = self.ambient.clone().ok_or(CaptureError::NoAmbient)?;
        Ok(off_the_runtime(move || ambient.adopt_running(&pod)).await??)
    }

    /// Whether `pod` is captured as `policy` says.
    pub(super) async fn check(&self, pod: &PodRef, policy: PodPolicy) -> Result<(), CaptureError> {
        if policy.dataplane() == DataplaneMode::Ambient && self.ambient.is_none() {
            return Err(CaptureError::NoAmbient);
        }
        Ok(self
            .routed(pod, move |router, pod| router.check(pod, &policy))
            .await??)
    }

    /// Releases whatever captures `pod`, in either mode.
    pub(super) async fn release(
        &self,
        pod: &PodRef,
        metrics: &Metrics,
    ) -> Result<(), CaptureError> {
        self.routed(pod, |router, pod| router.remove(pod)).await??;
        lock(&self.policies).remove(&pod.container_id);
        self.update_gauge(metrics);
        Ok(())
    }

    /// Removes the captures the runtime no longer has (`valid`: the sandboxes it has), each
    /// under its container's lock, ambient mode's first; how many.
    pub(super) async fn collect(
        &self,
        valid: &[String],
        locks: &Locks,
        metrics: &Metrics,
    ) -> Result<usize, CaptureError> {
        let mut removed = 0;
        for (mode, backend) in self.router.modes() {
            let listed = {
                let backend = backend.clone();
                off_the_runtime(move || backend.list(mode)).await??
            };
            for stale in listed
                .into_iter()
                .filter(|c| collectable(&c.pod.container_id, valid))
            {
                let (pod, id) = (stale.pod.clone(), stale.pod.container_id.clone());
                let backend = backend.clone();
                match locks
                    .run(&id, off_the_runtime(move || backend.remove(&pod)))
                    .await?
                {
                    Ok(()) => removed += 1,
                    Err(err) => match mode {
                        DataplaneMode::Ambient => {
                            error!(container = %id, error = %err, "GC could not remove a stale ambient enrollment")
                        }
                        DataplaneMode::Sidecar => {
                            error!(container = %id, error = %err, "GC could not remove a stale capture")
                        }
                    },
                }
            }
        }
        self.update_gauge(metrics);
        Ok(removed)
    }

    /// Every capture, with the policy this process applied where it did; the node-wide programs,
    /// the other programs on their hooks, and the node backend's warnings.
    pub(super) async fn report(&self) -> Result<Report, CaptureError> {
        let router = self.router.clone();
        let (captured, programs, other_programs, warnings) = off_the_runtime(move || {
            let node = router.node_backend();
            (
                router.list(),
                node.programs(),
                node.other_programs(),
                node.warnings(),
            )
        })
        .await?;
        let policies = lock(&self.policies).clone();
        Ok(Report {
            pods: captured?
                .into_iter()
                .map(|c| (policies.get(&c.pod.container_id).cloned(), c))
                .collect(),
            programs,
            other_programs,
            warnings,
        })
    }

    /// The node backend's periodic checks: its warnings (which also keep meshcap's programs
    /// first where they can be moved), and the other programs on its hooks, counted in the
    /// metrics.
    pub(super) async fn check_backend(&self, metrics: &Metrics) -> Vec<String> {
        let node = self.router.node_backend().clone();
        let Ok((warnings, others)) =
            off_the_runtime(move || (node.warnings(), node.other_programs())).await
        else {
            return Vec::new();
        };
        metrics.set_other_programs(&others);
        warnings
    }

    /// Whether this node runs ambient mode.
    pub(super) const fn ambient_enabled(&self) -> bool {
        self.ambient.is_some()
    }

    /// Sets the gauges read at each scrape: the ztunnels connected now (0 without ambient
    /// mode) and the other programs on the node backend's hooks.
    pub(super) async fn scrape(&self, metrics: &Metrics) {
        metrics.set_ztunnel_connected(
            self.ambient
                .as_ref()
                .map_or(0, |ambient| ambient.ztunnels_connected()),
        );
        let node = self.router.node_backend().clone();
        if let Ok(others) = off_the_runtime(move || node.other_programs()).await {
            metrics.set_other_programs(&others);
        }
    }

    /// Drops the captures whose network namespace went without a DEL this agent saw (their
    /// runtime's DEL came while an earlier agent was down or dying, and the netns went after
    /// this one started): otherwise their pins and map entries, or iptables records (and an
    /// ambient pod's workload, probe addresses and ztunnel's hold), would stay until the next
    /// start. Mode by mode, each is dropped under its container's request lock and only if its
    /// netns is still gone there; what cannot be dropped is logged and tried again on the next
    /// call. Returns how many were dropped.
    pub(super) async fn drop_gone(&self, locks: &Locks, metrics: &Metrics) -> usize {
        let mut dropped = 0;
        for (mode, backend) in self.router.modes() {
            let gone = {
                let backend = backend.clone();
                match off_the_runtime(move || backend.gone(mode)).await {
                    Ok(Ok(gone)) => gone,
                    Ok(Err(err)) => {
                        warn!(error = %err, %mode, "looking for captures whose netns is gone");
                        continue;
                    }
                    Err(failure) => {
                        warn!(error = %failure, %mode, "looking for captures whose netns is gone");
                        continue;
                    }
                }
            };
            for pod in gone {
                let (id, name) = (pod.container_id.clone(), pod.to_string());
                let backend = backend.clone();
                let work = off_the_runtime(move || backend.drop_if_gone(&pod));
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
        }
        if dropped > 0 {
            self.update_gauge(metrics);
        }
        dropped
    }

    /// Sets the captured-pods gauge to what the node's backend holds now.
    pub(super) fn update_gauge(&self, metrics: &Metrics) {
        let _serial = lock(&self.gauge);
        let node = self.router.node_backend();
        if let Ok(count) = node.captured_count() {
            metrics.set_captured(node.name(), count);
        }
    }

    /// Runs `f` with the router for `pod`, as blocking work ([`off_the_runtime`]).
    async fn routed<T: Send + 'static>(
        &self,
        pod: &PodRef,
        f: impl FnOnce(&Router, &PodRef) -> T + Send + 'static,
    ) -> Result<T, CaptureError> {
        let (router, pod) = (self.router.clone(), pod.clone());
        off_the_runtime(move || f(&router, &pod)).await
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
