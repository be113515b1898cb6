//! The capture hub: what the agent does with a pod, whoever asks. The plugin's requests
//! ([`crate::api`] translates them), the repair controller and ambient mode's live enrollment
//! call it with domain values ([`Sandbox`], [`PodRef`]) and get a [`Done`] or a
//! [`CaptureError`].
//!
//! - the request path (here): ADD looks the pod up (with its namespace's labels where the
//!   decision reads them, and its addresses) and asks [`meshcap_policy::decide`] what happens
//!   to it, then captures it for its sidecar or enrolls it in ambient
//!   mode; DEL releases; CHECK re-decides and asks whether the capture is in place. Requests
//!   for one container run one at a time, their blocking work on the request's own worker
//!   thread, and each is observed (`request`);
//! - [`Readiness`]: whether the agent may be sent pods;
//! - `captures`: the set of captures, through the backend that serves each mode, and the
//!   node-wide views over it (GC, status, captures whose netns went without a DEL);
//! - the verifier's pass over them ([`verify_pass`](Hub::verify_pass), [`crate::verify`]) and
//!   `explain` ([`explain`](Hub::explain)).
//!
//! Every collaborator is given at construction ([`Parts`]).
mod adoption;
mod captures;
mod error;
mod explain;
mod lookup;
mod readiness;
mod request;
mod verify;

use std::{path::PathBuf, sync::Arc};

pub use error::{CaptureError, ErrorClass};
use k8s_openapi::api::core::v1::Pod;
use meshcap_policy::{DataplaneMode, Decision, NodeSettings, ambient::InpodPolicy};
pub use readiness::Readiness;
pub use request::Done;
use tokio::sync::watch;

use self::{
    captures::Captures,
    lookup::{Lookup, netns_still_the_pods},
    request::{Locks, Verb, off_the_runtime},
};
use crate::{
    ambient::{Adopted, Ambient, IstioEnrolled},
    backend::{self, AmbientCapture, PodPolicy, Router},
    events::EventSink,
    install::watch::InstallStatus,
    pending::Pending,
    pod::{PodRef, Sandbox},
    pods::{PodSource, Retry},
    probe::ProbeReport,
    status::{PodStatus, StatusReport, metrics::Metrics},
    takeover::LeftAlone,
    verify::Ledger,
};

/// How the hub decides.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pod lookups at ADD and CHECK.
    pub retry: Retry,
    /// The node's settings every pod's decision reads.
    pub node: NodeSettings,
    /// The plugin socket, for status.
    pub socket: PathBuf,
}

/// What the hub works with, each given once, at construction.
pub struct Parts {
    /// Where pods are looked up.
    pub source: Arc<PodSource>,
    /// The backend serving each mode.
    pub router: Router,
    /// Why the node's backend.
    pub backend_reason: String,
    /// The kernel probe, when one ran.
    pub probe: Option<ProbeReport>,
    /// Ambient mode, when this node runs it (the router sends it ambient pods; the hub has
    /// enrolled pods annotated through it).
    pub ambient: Option<Arc<Ambient>>,
    /// Where the plugin's installation stands, when this agent installs it: readiness waits
    /// for the entry to be in place.
    pub install: Option<watch::Receiver<InstallStatus>>,
    /// What else holds readiness while it says why: the permission checks and the watches the
    /// API server refuses ([`crate::access`]).
    pub holds: Vec<watch::Receiver<Option<String>>>,
    /// Where a Kubernetes Event is published on each pod whose ADD fails.
    pub events: Option<EventSink>,
}

/// The hub.
pub struct Hub {
    lookup: Lookup,
    captures: Captures,
    readiness: Readiness,
    events: Option<EventSink>,
    metrics: Metrics,
    locks: Locks,
    socket: PathBuf,
    /// What the verifier found.
    ledger: Arc<Ledger>,
    /// Live enrollments still to be done.
    pending: Pending,
    /// Sidecar pods whose istio-cni capture was left as it is.
    left: LeftAlone,
}

impl Hub {
    /// A hub over `parts`, deciding as `settings` say.
    #[must_use]
    pub fn new(parts: Parts, settings: Settings) -> Self {
        let ledger = Arc::new(Ledger::default());
        let hub = Self {
            readiness: Readiness::new(
                parts.source.clone(),
                parts.install,
                parts.holds,
                ledger.clone(),
            ),
            lookup: Lookup::new(parts.source, settings.node, settings.retry),
            captures: Captures::new(
                parts.router,
                parts.backend_reason,
                parts.probe,
                parts.ambient,
            ),
            events: parts.events,
            metrics: Metrics::new(),
            locks: Locks::default(),
            socket: settings.socket,
            ledger,
            pending: Pending::default(),
            left: LeftAlone::default(),
        };
        hub.captures.update_gauge(&hub.metrics);
        hub.metrics
            .set_ambient_enabled(hub.captures.ambient_enabled());
        hub
    }

    /// The metrics.
    #[must_use]
    pub const fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Whether the agent may be sent pods.
    #[must_use]
    pub const fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// What the verifier found.
    #[must_use]
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Live enrollments still to be done.
    #[must_use]
    pub const fn pending(&self) -> &Pending {
        &self.pending
    }

    /// ADD: captures `sandbox`'s pod as its decision says (or leaves it alone).
    ///
    /// # Errors
    /// When the pod cannot be looked up or decided, or its capture cannot be applied: nothing
    /// of it is left then.
    pub async fn add(&self, sandbox: Sandbox) -> Result<Done, CaptureError> {
        let pod = sandbox.pod.clone();
        let work = self.locks.run(&pod.container_id, self.capture(&sandbox));
        self.observed(Verb::Add, Some((&pod, sandbox.uid.as_deref())), work)
            .await
    }

    async fn capture(&self, sandbox: &Sandbox) -> Result<Done, CaptureError> {
        let (found, decision) = self.lookup.decide(sandbox).await?;
        if !matches!(decision, Decision::Skip { .. }) {
            netns_still_the_pods(sandbox).await?;
        }
        match decision {
            Decision::Skip { reason, .. } => Ok(Done::Skipped(reason)),
            Decision::Sidecar { policy, .. } => Ok(Done::Captured(
                self.captures
                    .capture(&sandbox.pod, policy, &self.metrics)
                    .await?,
            )),
            Decision::Ambient { policy, .. } => {
                let capture = ambient_capture(sandbox, &found, policy);
                self.captures.enroll(&sandbox.pod, capture).await?;
                Ok(Done::Captured(ENROLLED.to_owned()))
            }
        }
    }

    /// Enrolls a running pod in ambient mode in place (live enrollment), deciding on `found`,
    /// the pod as the caller's watch last saw it (the pod source may not have seen that change
    /// yet), as an ADD enrolls it, under the container's lock; the enrollment in words.
    ///
    /// # Errors
    /// As an ADD's; and when ambient mode does not enroll the pod after all.
    pub async fn enroll_in_place(
        &self,
        sandbox: Sandbox,
        found: &Pod,
    ) -> Result<String, CaptureError> {
        let work = async {
            let policy = match self.lookup.decide_on(&sandbox, found, false).await {
                Ok(Decision::Ambient { policy, .. }) => policy,
                Err(CaptureError::Invalid(err)) if err.dataplane == DataplaneMode::Ambient => {
                    return Err(CaptureError::Invalid(err));
                }
                Ok(_) | Err(CaptureError::Invalid(_)) => return Err(CaptureError::NotEnrolled),
                Err(other) => return Err(other),
            };
            netns_still_the_pods(&sandbox).await?;
            let (netns, who) = (sandbox.pod.netns.clone(), sandbox.pod.to_string());
            let istio =
                off_the_runtime(move || backend::found::istio_rules(&netns, &who)).await??;
            let capture = ambient_capture(&sandbox, found, policy);
            if !istio.is_empty() {
                // istio-cni's capture: adopted, never stacked on nor removed.
                let pod = IstioEnrolled {
                    pod: sandbox.pod.clone(),
                    capture,
                };
                return match self.captures.adopt(pod).await? {
                    Adopted::Enrolled(how) => Ok(how),
                    Adopted::Known => Ok(ENROLLED.to_owned()),
                    Adopted::Left(_) | Adopted::NotIstios => Err(CaptureError::Found {
                        pod: sandbox.pod.pod_name(),
                        found: istio.join("; "),
                    }),
                };
            }
            self.captures.enroll(&sandbox.pod, capture).await?;
            Ok(ENROLLED.to_owned())
        };
        self.locks.run(&sandbox.pod.container_id, work).await
    }

    /// DEL: releases whatever captures `pod`, in either mode. Always completes where the
    /// capture can be removed; an unknown pod, or one whose netns is gone, is fine.
    ///
    /// # Errors
    /// When a capture is there but cannot be removed.
    pub async fn del(&self, pod: PodRef) -> Result<Done, CaptureError> {
        let work = self.locks.run(&pod.container_id, async {
            self.captures.release(&pod, &self.metrics).await?;
            self.left.forget(&pod.pod_name());
            Ok(Done::Removed)
        });
        self.observed(Verb::Del, Some((&pod, None)), work).await
    }

    /// CHECK: re-decides `sandbox`'s pod and says whether its capture is in place.
    ///
    /// # Errors
    /// [`CaptureError::Backend`] naming what is missing, or a failure to decide or look.
    pub async fn check(&self, sandbox: Sandbox) -> Result<Done, CaptureError> {
        let pod = sandbox.pod.clone();
        let work = self.locks.run(&pod.container_id, async {
            let (found, decision) = self.lookup.decide(&sandbox).await?;
            match decision {
                Decision::Skip { reason, .. } => Ok(Done::Skipped(reason)),
                Decision::Ambient { policy, .. } => {
                    let capture = ambient_capture(&sandbox, &found, policy);
                    let policy = PodPolicy::Ambient(Box::new(capture));
                    self.captures.check(&sandbox.pod, policy).await?;
                    Ok(Done::Checked("in-pod capture is in place"))
                }
                Decision::Sidecar { policy, .. } => {
                    self.captures
                        .check(&sandbox.pod, PodPolicy::Sidecar(policy))
                        .await?;
                    Ok(Done::Checked("capture is in place"))
                }
            }
        });
        self.observed(Verb::Check, Some((&pod, sandbox.uid.as_deref())), work)
            .await
    }

    /// GC: removes the captures of sandboxes the runtime no longer has (`valid`: those it has);
    /// captures made in place are not the runtime's to collect.
    ///
    /// # Errors
    /// When the captures cannot be listed.
    pub async fn gc(&self, valid: Vec<String>) -> Result<Done, CaptureError> {
        let work = async {
            let removed = self
                .captures
                .collect(&valid, &self.locks, &self.metrics)
                .await?;
            Ok(Done::Collected(removed))
        };
        self.observed(Verb::Gc, None, work).await
    }

    /// PING: whether the agent is ready.
    ///
    /// # Errors
    /// [`CaptureError::NotReady`] with the reason.
    pub async fn ping(&self) -> Result<Done, CaptureError> {
        let work = async {
            match self.readiness.not_ready_reason() {
                None => Ok(Done::Alive(format!(
                    "ready, backend {}",
                    self.captures.backend_name()
                ))),
                Some(reason) => Err(CaptureError::NotReady(reason)),
            }
        };
        self.observed(Verb::Ping, None, work).await
    }

    /// STATUS: the status report.
    ///
    /// # Errors
    /// When the captures cannot be listed.
    pub async fn status(&self) -> Result<Done, CaptureError> {
        let work = async {
            let report = self.captures.report().await?;
            Ok(Done::Status(Box::new(StatusReport {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                ready: self.readiness.not_ready_reason().is_none(),
                backend: self.captures.backend_name().to_owned(),
                backend_reason: self.captures.backend_reason().to_owned(),
                probe: self.captures.probe().cloned(),
                pod_source: self.lookup.source().describe(),
                socket: self.socket.display().to_string(),
                pods: report
                    .pods
                    .into_iter()
                    .map(|(policy, captured)| PodStatus { captured, policy })
                    .collect(),
                programs: report.programs,
                other_programs: report.other_programs,
                warnings: report.warnings,
            })))
        };
        self.observed(Verb::Status, None, work).await
    }

    /// The metrics' text, with the other programs on the backend's hooks as they are now.
    pub async fn metrics_text(&self) -> String {
        self.captures.scrape(&self.metrics).await;
        self.metrics.render()
    }

    /// The backend's periodic checks: its warnings (which also keep meshcap's programs first
    /// where they can be moved), and the other programs on its hooks, counted in the metrics.
    pub async fn check_backend(&self) -> Vec<String> {
        self.captures.check_backend(&self.metrics).await
    }

    /// Drops the captures whose network namespace went without a DEL this agent saw (see
    /// `captures`); how many.
    pub async fn drop_gone(&self) -> usize {
        self.captures.drop_gone(&self.locks, &self.metrics).await
    }
}

/// An enrolled pod's capture: `policy` with the pod's addresses and what ztunnel is told it is,
/// its uid (the runtime's, else the API's) and its service account (`default` when the spec
/// names none).
fn ambient_capture(sandbox: &Sandbox, found: &Pod, policy: InpodPolicy) -> AmbientCapture {
    AmbientCapture {
        policy,
        ips: sandbox.ips.clone(),
        uid: sandbox
            .uid
            .clone()
            .or_else(|| found.metadata.uid.clone())
            .unwrap_or_default(),
        service_account: found
            .spec
            .as_ref()
            .and_then(|spec| spec.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned()),
    }
}

/// An ambient pod's ADD, in words.
const ENROLLED: &str = "enrolled in ambient mode: captured in the pod, ztunnel serves it";

#[cfg(test)]
mod tests;
