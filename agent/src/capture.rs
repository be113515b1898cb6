//! The agent's core: a plugin request in, a capture decision applied, a response out.
//!
//! ADD looks the pod up (bounded retries), asks the policy module whether and how Istio would
//! capture it — enrolled in ambient mode (when the node runs it, [`crate::ambient`]) or with
//! its sidecar — and applies that with the backend; DEL removes; CHECK re-derives the policy
//! and asks the backend whether it is in place. Requests for one container are serialized; the
//! backend's blocking work runs on the request's own worker thread (`off_the_runtime`).
use std::{
    collections::HashMap,
    panic::{self, AssertUnwindSafe},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use k8s_openapi::api::core::v1::Pod;
use meshcap_cni::protocol::{ErrorKind, Op, Outcome, PodAttachment, Reply, Response};
use tokio::{
    runtime::{Handle, RuntimeFlavor},
    sync::watch,
};
use tracing::{Instrument as _, error, info, info_span, warn};

use crate::{
    ambient::{Ambient, AmbientError},
    backend::{BackendError, CaptureBackend, PodRef},
    events::{EventSink, PodObject},
    install::watch::InstallStatus,
    podnet,
    pods::{PodSource, PodSourceError, Retry},
    policy::{
        self, RedirectPolicy, SelectConfig, Selection, SkipReason,
        ambient::{Enrollment, InpodPolicy},
    },
    probe::ProbeReport,
    status::{PodStatus, StatusReport, metrics::Metrics},
};

/// How the agent decides.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pod lookups at ADD and CHECK.
    pub retry: Retry,
    /// Node-level selection (excluded namespaces).
    pub select: SelectConfig,
    /// The plugin socket, for status.
    pub socket: PathBuf,
}

/// A failed request: its kind and message.
struct Failure {
    kind: ErrorKind,
    msg: String,
    details: String,
}

impl Failure {
    fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Self {
            kind,
            msg: msg.into(),
            details: String::new(),
        }
    }
}

impl From<PodSourceError> for Failure {
    fn from(err: PodSourceError) -> Self {
        let kind = match err {
            PodSourceError::NotFound { .. } => ErrorKind::PodNotFound,
            PodSourceError::Unavailable { .. } => ErrorKind::PodSourceUnavailable,
        };
        Self::new(kind, err.to_string())
    }
}

impl From<AmbientError> for Failure {
    fn from(err: AmbientError) -> Self {
        match err {
            AmbientError::Rules(err) => err.into(),
            other => Self::new(ErrorKind::Backend, other.to_string()),
        }
    }
}

/// What a pod gets.
enum Decision {
    /// Left alone.
    Skip(SkipReason),
    /// Its sidecar's capture.
    Sidecar(Box<RedirectPolicy>),
    /// Ambient mode's in-pod capture, handed to ztunnel.
    Ambient {
        policy: InpodPolicy,
        uid: String,
        service_account: String,
    },
}

impl From<BackendError> for Failure {
    fn from(err: BackendError) -> Self {
        let kind = match err {
            BackendError::NotCaptured { .. } => ErrorKind::CheckFailed,
            _ => ErrorKind::Backend,
        };
        Self::new(kind, err.to_string())
    }
}

/// The request handler.
pub struct Capture {
    source: PodSource,
    backend: Arc<dyn CaptureBackend>,
    backend_reason: String,
    probe: Option<ProbeReport>,
    settings: Settings,
    metrics: Metrics,
    serving: AtomicBool,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    policies: Mutex<HashMap<String, String>>,
    /// Where the plugin's installation stands, when this agent installs it: readiness waits
    /// for the entry to be in place.
    install: Mutex<Option<watch::Receiver<InstallStatus>>>,
    /// What else holds readiness ([`Capture::hold_readiness`]).
    holds: Mutex<Vec<watch::Receiver<Option<String>>>>,
    events: Mutex<Option<EventSink>>,
    /// Ambient mode, when this node runs it.
    ambient: Mutex<Option<Arc<Ambient>>>,
    /// Held while the captured-pods gauge is read and set, so that of requests finishing
    /// together the last to set it has read the last count (not one read before another
    /// request's change).
    gauge: Mutex<()>,
}

impl Capture {
    /// A handler over a pod source and a backend (`reason`: why this backend).
    #[must_use]
    pub fn new(
        source: PodSource,
        backend: Arc<dyn CaptureBackend>,
        backend_reason: String,
        probe: Option<ProbeReport>,
        settings: Settings,
    ) -> Self {
        let capture = Self {
            source,
            backend,
            backend_reason,
            probe,
            settings,
            metrics: Metrics::new(),
            serving: AtomicBool::new(false),
            locks: Mutex::new(HashMap::new()),
            policies: Mutex::new(HashMap::new()),
            install: Mutex::new(None),
            holds: Mutex::new(Vec::new()),
            events: Mutex::new(None),
            ambient: Mutex::new(None),
            gauge: Mutex::new(()),
        };
        capture.update_captured_gauge();
        capture
    }

    /// The metrics.
    #[must_use]
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Marks the agent as serving (or not: shutting down).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    /// Makes readiness wait for the plugin's entry to be in place (this agent installs it).
    pub fn watch_install(&self, status: watch::Receiver<InstallStatus>) {
        *lock(&self.install) = Some(status);
    }

    /// Holds readiness while `hold` says why (`Some`): a missing permission, a refused watch.
    pub fn hold_readiness(&self, hold: watch::Receiver<Option<String>>) {
        lock(&self.holds).push(hold);
    }

    /// Runs ambient mode: pods its selectors enroll are captured for ztunnel.
    pub fn serve_ambient(&self, ambient: Arc<Ambient>) {
        *lock(&self.ambient) = Some(ambient);
    }

    fn ambient(&self) -> Option<Arc<Ambient>> {
        lock(&self.ambient).clone()
    }

    /// Publishes a Kubernetes Event on each pod whose ADD fails.
    pub fn publish_events(&self, sink: EventSink) {
        *lock(&self.events) = Some(sink);
    }

    /// Why the agent is not ready, or `None` when it is: the backend is open (it is, once this
    /// exists), the plugin socket serves, the pod source has synced, and the plugin is chained
    /// into the CNI configuration (when this agent installs it).
    #[must_use]
    pub fn not_ready_reason(&self) -> Option<String> {
        if !self.serving.load(Ordering::Acquire) {
            return Some("the plugin socket is not serving".into());
        }
        if !self.source.is_ready() {
            return Some(format!("{} has not synced yet", self.source.describe()));
        }
        if let Some(install) = lock(&self.install).as_ref() {
            let status = install.borrow();
            if !status.is_installed() {
                return Some(format!("meshcap-cni is not in place: {}", *status));
            }
        }
        lock(&self.holds)
            .iter()
            .find_map(|hold| hold.borrow().clone())
    }

    fn update_captured_gauge(&self) {
        let _serial = lock(&self.gauge);
        if let Ok(count) = self.backend.captured_count() {
            self.metrics.set_captured(self.backend.name(), count);
        }
    }

    /// Handles one request.
    pub async fn handle(self: &Arc<Self>, op: Op) -> Response {
        let name = op.name();
        let span = match &op {
            Op::Add { pod } | Op::Del { pod } | Op::Check { pod } => info_span!(
                "cni", op = name, pod = %format!("{}/{}", pod.namespace, pod.name), container = %pod.container_id
            ),
            _ => info_span!("cni", op = name),
        };
        let started = Instant::now();
        let failed_add = match &op {
            Op::Add { pod } => Some(PodObject {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            }),
            _ => None,
        };
        let result = self.dispatch(op).instrument(span.clone()).await;
        let _enter = span.enter();
        match result {
            Ok(response) => {
                if let Reply::Ok {
                    outcome, message, ..
                } = &response.reply
                {
                    let outcome = serde_json::to_value(outcome)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    self.metrics.observe(name, &outcome, started.elapsed());
                    if !matches!(name, "ping" | "status") {
                        info!(
                            outcome,
                            took_ms = started.elapsed().as_millis(),
                            "{message}"
                        );
                    }
                }
                response
            }
            Err(failure) => {
                let reason = serde_json::to_value(failure.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                self.metrics.observe(name, "error", started.elapsed());
                self.metrics.error(name, &reason);
                warn!(reason, "{}", failure.msg);
                if let (Some(pod), Some(sink)) = (&failed_add, lock(&self.events).as_ref()) {
                    let event = match failure.kind {
                        ErrorKind::InvalidPod => Some("InvalidSidecarAnnotation"),
                        ErrorKind::Backend => Some("CaptureFailed"),
                        _ => None,
                    };
                    if let Some(event) = event {
                        sink.warn(pod.clone(), event, "Capture", failure.msg.clone());
                    }
                }
                Response::error(failure.kind, failure.msg, failure.details)
            }
        }
    }

    async fn dispatch(self: &Arc<Self>, op: Op) -> Result<Response, Failure> {
        if !matches!(op, Op::Status) && !self.serving.load(Ordering::Acquire) {
            return Err(Failure::new(
                ErrorKind::NotReady,
                "meshcap-agent is shutting down",
            ));
        }
        match op {
            Op::Add { pod } => self.locked(&pod.container_id.clone(), self.add(pod)).await,
            Op::Del { pod } => self.locked(&pod.container_id.clone(), self.del(pod)).await,
            Op::Check { pod } => {
                self.locked(&pod.container_id.clone(), self.check(pod))
                    .await
            }
            Op::Gc {
                valid_container_ids,
            } => self.gc(&valid_container_ids).await,
            Op::Ping => match self.not_ready_reason() {
                None => Ok(Response::ok(
                    Outcome::Alive,
                    format!("ready, backend {}", self.backend.name()),
                )),
                Some(reason) => Err(Failure::new(ErrorKind::NotReady, reason)),
            },
            Op::Status => {
                let report = self.status().await?;
                let mut response = Response::ok(Outcome::Status, "status");
                if let Reply::Ok { report: slot, .. } = &mut response.reply {
                    *slot = serde_json::to_value(report).ok();
                }
                Ok(response)
            }
        }
    }

    /// Runs `work` holding the lock of one container.
    async fn locked<T>(&self, container_id: &str, work: impl Future<Output = T>) -> T {
        let lock = {
            let mut locks = self
                .locks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            locks.entry(container_id.to_owned()).or_default().clone()
        };
        let out = {
            let _guard = lock.lock().await;
            work.await
        };
        let mut locks = self
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Drop the entry when nobody else waits on it (the map holds one reference, we another).
        if locks
            .get(container_id)
            .is_some_and(|l| Arc::strong_count(l) <= 2)
        {
            locks.remove(container_id);
        }
        out
    }

    /// Runs a blocking backend call ([`off_the_runtime`]).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn CaptureBackend) -> T + Send + 'static,
    ) -> Result<T, Failure> {
        let backend = self.backend.clone();
        off_the_runtime(move || f(backend.as_ref())).await
    }

    /// Ambient mode's decision for `found` (the pod as the API has it): `None` when the node
    /// does not run ambient mode or the pod is not enrolled.
    async fn ambient_decision(
        &self,
        pod: &PodAttachment,
        found: &Pod,
    ) -> Result<Option<Decision>, Failure> {
        let Some(ambient) = self.ambient() else {
            return Ok(None);
        };
        let exclude = &self.settings.select.exclude_namespaces;
        let enrollment =
            crate::decide::ambient_enrollment(&self.source, found, exclude, ambient.config())
                .await
                .map_err(|reason| {
                    Failure::new(
                        ErrorKind::PodSourceUnavailable,
                        format!("pod {}/{}: {reason}", pod.namespace, pod.name),
                    )
                })?;
        match enrollment {
            Err(e) => Err(Failure::new(ErrorKind::InvalidPod, e.to_string())),
            Ok(Enrollment::NotEnrolled { .. }) => Ok(None),
            Ok(Enrollment::Enrolled { policy, ignored }) => {
                for annotation in ignored {
                    warn!(
                        annotation = annotation.key,
                        value = annotation.value,
                        "not a boolean: ignored, as Istio does"
                    );
                }
                let uid = pod
                    .uid
                    .clone()
                    .or_else(|| found.metadata.uid.clone())
                    .unwrap_or_default();
                let service_account = found
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.service_account_name.clone())
                    .unwrap_or_else(|| "default".to_owned());
                Ok(Some(Decision::Ambient {
                    policy,
                    uid,
                    service_account,
                }))
            }
        }
    }

    /// Enrolls a running pod in ambient mode in place ([`crate::enrollment`]), deciding on
    /// `found`, the pod as the caller's watch last saw it (the pod source may not have seen
    /// that change yet), through the ADD's enrollment under the container's lock.
    ///
    /// # Errors
    /// As an ADD's; and when ambient mode does not enroll the pod after all.
    pub async fn enroll_running(&self, pod: PodAttachment, found: &Pod) -> Result<String, String> {
        let id = pod.container_id.clone();
        let work = async {
            match self.ambient_decision(&pod, found).await? {
                Some(Decision::Ambient {
                    policy,
                    uid,
                    service_account,
                }) => self.enroll(&pod, policy, uid, service_account).await,
                _ => Err(Failure::new(
                    ErrorKind::InvalidPod,
                    "ambient mode does not enroll it",
                )),
            }
        };
        match self.locked(&id, work).await {
            Ok(Response {
                reply: Reply::Ok { message, .. },
                ..
            }) => Ok(message),
            Ok(Response {
                reply: Reply::Error { msg, .. },
                ..
            }) => Err(msg),
            Err(failure) => Err(failure.msg),
        }
    }

    /// The pod's decision: skip (with the reason), ambient mode's capture (a node that runs it
    /// asks first, as Istio's plugin does) or its sidecar's.
    async fn decide(&self, pod: &PodAttachment) -> Result<Decision, Failure> {
        let found = self
            .source
            .get(
                &pod.namespace,
                &pod.name,
                pod.uid.as_deref(),
                self.settings.retry,
            )
            .await?;
        if let Some(enrolled) = self.ambient_decision(pod, &found).await? {
            return Ok(enrolled);
        }
        let ips = if pod.ips.is_empty() {
            let netns = PathBuf::from(&pod.netns);
            off_the_runtime(move || podnet::run_in(&netns, |_| podnet::global_addresses()))
                .await?
                .map_err(|e| {
                    Failure::new(
                        ErrorKind::BadRequest,
                        format!("pod {}/{}: {e}", pod.namespace, pod.name),
                    )
                })?
                .map_err(|e| {
                    Failure::new(
                        ErrorKind::Internal,
                        format!(
                            "pod {}/{}: listing addresses in {}: {e}",
                            pod.namespace, pod.name, pod.netns
                        ),
                    )
                })?
        } else {
            pod.ips.clone()
        };
        match policy::select(&found, &ips, &self.settings.select)
            .map_err(|e| Failure::new(ErrorKind::InvalidPod, e.to_string()))?
        {
            Selection::Skip { reason } => Ok(Decision::Skip(reason)),
            Selection::Capture { policy } => Ok(Decision::Sidecar(policy)),
        }
    }

    async fn add(&self, pod: PodAttachment) -> Result<Response, Failure> {
        let policy = match self.decide(&pod).await? {
            Decision::Skip(reason) => return Ok(skipped(&reason)),
            Decision::Ambient {
                policy,
                uid,
                service_account,
            } => return self.enroll(&pod, policy, uid, service_account).await,
            Decision::Sidecar(policy) => policy,
        };
        let target = pod_ref(&pod);
        let summary = policy.summary();
        let applied = policy.clone();
        self.blocking(move |b| b.add(&target, &applied)).await??;
        self.policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(pod.container_id.clone(), summary.clone());
        self.update_captured_gauge();
        Ok(Response::ok(
            Outcome::Captured,
            format!("captured by the {} backend: {summary}", self.backend.name()),
        ))
    }

    async fn enroll(
        &self,
        pod: &PodAttachment,
        policy: InpodPolicy,
        uid: String,
        service_account: String,
    ) -> Result<Response, Failure> {
        let ambient = self.ambient().ok_or_else(|| {
            Failure::new(
                ErrorKind::Internal,
                "ambient mode is not running on this node",
            )
        })?;
        let target = pod_ref(pod);
        {
            let (ambient, target) = (ambient.clone(), target.clone());
            let ips = pod.ips.clone();
            off_the_runtime(move || ambient.add(&target, &uid, &service_account, &policy, &ips))
                .await??;
        }
        if let Err(err) = ambient.annotate_enrolled(&target).await {
            let undo = ambient.clone();
            if let Err(undone) = off_the_runtime(move || undo.remove(&target)).await? {
                warn!(error = %undone, "undoing the enrollment of a pod that could not be annotated");
            }
            return Err(err.into());
        }
        Ok(Response::ok(
            Outcome::Captured,
            "enrolled in ambient mode: captured in the pod, ztunnel serves it",
        ))
    }

    async fn del(&self, pod: PodAttachment) -> Result<Response, Failure> {
        let target = pod_ref(&pod);
        if let Some(ambient) = self.ambient() {
            let target = target.clone();
            off_the_runtime(move || ambient.remove(&target)).await??;
        }
        self.blocking(move |b| b.remove(&target)).await??;
        self.policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&pod.container_id);
        self.update_captured_gauge();
        Ok(Response::ok(Outcome::Removed, "capture removed"))
    }

    async fn check(&self, pod: PodAttachment) -> Result<Response, Failure> {
        let policy = match self.decide(&pod).await? {
            Decision::Skip(reason) => return Ok(skipped(&reason)),
            Decision::Ambient { policy, .. } => {
                let ambient = self.ambient().ok_or_else(|| {
                    Failure::new(
                        ErrorKind::Internal,
                        "ambient mode is not running on this node",
                    )
                })?;
                let target = pod_ref(&pod);
                off_the_runtime(move || ambient.check(&target, &policy)).await??;
                return Ok(Response::ok(Outcome::Checked, "in-pod capture is in place"));
            }
            Decision::Sidecar(policy) => policy,
        };
        let target = pod_ref(&pod);
        self.blocking(move |b| b.check(&target, &policy)).await??;
        Ok(Response::ok(Outcome::Checked, "capture is in place"))
    }

    async fn gc(&self, valid: &[String]) -> Result<Response, Failure> {
        let mut removed = 0;
        if let Some(ambient) = self.ambient() {
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
                match self.locked(&id, work).await? {
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
            match self
                .locked(&id, self.blocking(move |b| b.remove(&pod)))
                .await?
            {
                Ok(()) => removed += 1,
                Err(err) => {
                    error!(container = %id, error = %err, "GC could not remove a stale capture")
                }
            }
        }
        self.update_captured_gauge();
        Ok(Response::ok(
            Outcome::Collected,
            format!("removed {removed} stale captures"),
        ))
    }

    /// The status report.
    async fn status(&self) -> Result<StatusReport, Failure> {
        let (captured, programs, other_programs, warnings) = self
            .blocking(|b| (b.list(), b.programs(), b.other_programs(), b.warnings()))
            .await?;
        let mut captured = captured?;
        if let Some(ambient) = self.ambient() {
            captured.extend(off_the_runtime(move || ambient.list()).await??);
        }
        let policies = self
            .policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Ok(StatusReport {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ready: self.not_ready_reason().is_none(),
            backend: self.backend.name().to_owned(),
            backend_reason: self.backend_reason.clone(),
            probe: self.probe.clone(),
            pod_source: self.source.describe(),
            socket: self.settings.socket.display().to_string(),
            pods: captured
                .into_iter()
                .map(|c| PodStatus {
                    policy: policies.get(&c.pod.container_id).cloned(),
                    captured: c,
                })
                .collect(),
            programs,
            other_programs,
            warnings,
        })
    }

    /// The metrics' text, with the other programs on the backend's hooks as they are now.
    pub async fn metrics_text(&self) -> String {
        if let Ok(others) = self.blocking(|b| b.other_programs()).await {
            self.metrics.set_other_programs(&others);
        }
        self.metrics.render()
    }

    /// The backend's periodic checks: its warnings (which also keep meshcap's programs first
    /// where they can be moved), and the other programs on its hooks, counted in the metrics.
    pub async fn check_backend(&self) -> Vec<String> {
        let Ok((warnings, others)) = self.blocking(|b| (b.warnings(), b.other_programs())).await
        else {
            return Vec::new();
        };
        self.metrics.set_other_programs(&others);
        warnings
    }

    /// Drops the captures whose network namespace went without a DEL this agent saw (their
    /// runtime's DEL came while an earlier agent was down or dying, and the netns went after
    /// this one started): otherwise their pins and map entries, or iptables records, would
    /// stay until the next start. Each is dropped under its container's request lock and only
    /// if its netns is still gone there; what cannot be dropped is logged and tried again on
    /// the next call. Returns how many were dropped.
    pub async fn drop_gone(&self) -> usize {
        let mut dropped = 0;
        if let Some(ambient) = self.ambient() {
            match off_the_runtime(move || ambient.prune_gone()).await {
                Ok(Ok(gone)) => dropped += gone.len(),
                Ok(Err(err)) => warn!(error = %err, "dropping ambient pods whose netns is gone"),
                Err(failure) => {
                    warn!(error = %failure.msg, "dropping ambient pods whose netns is gone")
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
                warn!(error = %failure.msg, "looking for captures whose netns is gone");
                return dropped;
            }
        };
        for pod in gone {
            let (id, name) = (pod.container_id.clone(), pod.to_string());
            let work = self.blocking(move |b| b.drop_if_gone(&pod));
            match self.locked(&id, work).await {
                Ok(Ok(done)) => dropped += usize::from(done),
                Ok(Err(err)) => {
                    warn!(pod = %name, container = %id, error = %err, "dropping the capture of a pod whose netns is gone")
                }
                Err(failure) => {
                    warn!(pod = %name, container = %id, error = %failure.msg, "dropping the capture of a pod whose netns is gone")
                }
            }
        }
        if dropped > 0 {
            self.update_captured_gauge();
        }
        dropped
    }
}

/// Runs blocking work (netns visits, netlink, BPF, iptables-restore) for async code, in the
/// caller's span. On a multi-thread runtime (the agent's) the calling worker does it itself
/// (`block_in_place`: the worker's other tasks move to another thread), so a request is not
/// handed to the blocking pool and back: on a busy node each hand-over is a wait for a CPU
/// (BENCHMARKS.md, pod set-up with the machine busy). A current-thread runtime cannot spare its
/// thread: there the work goes to the blocking pool. Either way the work is not interrupted
/// once it runs (the request timeout bounds the waits around it), and a panic in it is this
/// request's internal error.
async fn off_the_runtime<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failure> {
    let span = tracing::Span::current();
    let failed = |e: &dyn std::fmt::Display| {
        Failure::new(ErrorKind::Internal, format!("backend task failed: {e}"))
    };
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        return tokio::task::block_in_place(|| {
            panic::catch_unwind(AssertUnwindSafe(|| span.in_scope(f)))
        })
        .map_err(|_| failed(&"it panicked"));
    }
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| failed(&e))
}

fn pod_ref(pod: &PodAttachment) -> PodRef {
    PodRef {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        container_id: pod.container_id.clone(),
        netns: PathBuf::from(&pod.netns),
    }
}

/// What the ids of captures made in place begin with: meshcap records a running pod it
/// captures (the repair controller) or enrolls (ambient mode, [`crate::enrollment`]) under
/// an id of its own, as no runtime told it the pod's sandbox id. The runtime's DEL finds such a
/// capture by the pod's netns; its GC, which lists only sandbox ids, leaves it alone: it goes
/// with a DEL, or with its netns.
const IN_PLACE: &str = "in-place:";

/// The id a capture made in place by `by` (`repair`, `ambient`) is recorded under.
#[must_use]
pub fn in_place_id(by: &str, uid: &str) -> String {
    format!("{IN_PLACE}{by}:{uid}")
}

/// Whether the runtime's GC may remove the capture recorded under `id` when its list of valid
/// attachments does not name it: not one made in place.
fn collectable(id: &str, valid: &[String]) -> bool {
    !id.starts_with(IN_PLACE) && !valid.iter().any(|v| v == id)
}

/// The answer for a pod Istio's CNI plugin would leave alone (ADD and CHECK alike).
fn skipped(reason: &SkipReason) -> Response {
    Response::ok(Outcome::Skipped, format!("not captured: {reason}"))
}

/// The value behind `mutex`, also after a panic elsewhere held it (single assignments only).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
