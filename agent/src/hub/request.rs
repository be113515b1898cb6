//! What every request gets: its outcome ([`Done`]); one request at a time per container
//! ([`Locks`]); its blocking work on its own thread ([`off_the_runtime`]); and its observation,
//! as an operator sees it: a span naming the pod, its outcome counted and logged, and, for an
//! ADD that fails on the pod's annotations or in the backend, a Warning Event on the pod.
use std::{
    collections::HashMap,
    panic::{self, AssertUnwindSafe},
    sync::{Arc, Mutex, atomic::Ordering},
    time::Instant,
};

use meshcap_policy::SkipReason;
use tokio::runtime::{Handle, RuntimeFlavor};
use tracing::{Instrument as _, info, info_span, warn};

use super::{CaptureError, ErrorClass, Hub};
use crate::{pod::PodRef, status::StatusReport, verify::Explanation};

/// What a request did.
#[derive(Debug)]
pub enum Done {
    /// ADD: the pod is captured (how, in words).
    Captured(String),
    /// ADD, CHECK: the pod is left alone, as Istio's plugin leaves it.
    Skipped(SkipReason),
    /// DEL: nothing of the pod's capture is left.
    Removed,
    /// CHECK: the capture is in place (which one, in words).
    Checked(&'static str),
    /// GC: this many stale captures removed.
    Collected(usize),
    /// PING: ready (with which backend, in words).
    Alive(String),
    /// STATUS: the report.
    Status(Box<StatusReport>),
    /// EXPLAIN: why a pod is (not) captured.
    Explained(Box<Explanation>),
}

impl Done {
    /// The outcome as the metrics count it.
    #[must_use]
    pub const fn label(&self) -> &'static str {
        match self {
            Self::Captured(_) => "captured",
            Self::Skipped(_) => "skipped",
            Self::Removed => "removed",
            Self::Checked(_) => "checked",
            Self::Collected(_) => "collected",
            Self::Alive(_) => "alive",
            Self::Status(_) => "status",
            Self::Explained(_) => "explained",
        }
    }

    /// The outcome in words, as logs and the plugin show it.
    #[must_use]
    pub fn message(&self) -> String {
        match self {
            Self::Captured(how) | Self::Alive(how) => how.clone(),
            Self::Skipped(reason) => format!("not captured: {reason}"),
            Self::Removed => "capture removed".to_owned(),
            Self::Checked(what) => (*what).to_owned(),
            Self::Collected(removed) => format!("removed {removed} stale captures"),
            Self::Status(_) => "status".to_owned(),
            Self::Explained(explanation) => explanation.decision.clone(),
        }
    }
}

/// What a request asks, as the metrics and logs name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verb {
    Add,
    Del,
    Check,
    Gc,
    Ping,
    Status,
    Explain,
}

impl Verb {
    const fn name(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Del => "del",
            Self::Check => "check",
            Self::Gc => "gc",
            Self::Ping => "ping",
            Self::Status => "status",
            Self::Explain => "explain",
        }
    }
}

impl Hub {
    /// Runs one request's `work` (`pod`: the pod it is about, with its uid when known), refused
    /// while the agent does not serve (the status report excepted), and observes it.
    pub(super) async fn observed(
        &self,
        verb: Verb,
        pod: Option<(&PodRef, Option<&str>)>,
        work: impl Future<Output = Result<Done, CaptureError>>,
    ) -> Result<Done, CaptureError> {
        let name = verb.name();
        let span = match pod {
            Some((pod, _)) => info_span!(
                "cni", op = name, pod = %format!("{}/{}", pod.namespace, pod.name), container = %pod.container_id
            ),
            None => info_span!("cni", op = name),
        };
        let started = Instant::now();
        let result = async {
            let answers_anyway = matches!(verb, Verb::Status | Verb::Explain);
            if !answers_anyway && !self.readiness.serving.load(Ordering::Acquire) {
                return Err(CaptureError::NotReady(
                    "meshcap-agent is shutting down".to_owned(),
                ));
            }
            work.await
        }
        .instrument(span.clone())
        .await;
        let _enter = span.enter();
        match &result {
            Ok(done) => {
                let outcome = done.label();
                self.metrics.observe(name, outcome, started.elapsed());
                if !matches!(verb, Verb::Ping | Verb::Status | Verb::Explain) {
                    info!(
                        outcome,
                        took_ms = started.elapsed().as_millis(),
                        "{}",
                        done.message()
                    );
                }
            }
            Err(failure) => {
                let reason = failure.class().label();
                self.metrics.observe(name, "error", started.elapsed());
                self.metrics.error(name, reason);
                warn!(reason, "{failure}");
                if let (Verb::Add, Some((pod, uid)), Some(sink)) = (verb, pod, &self.events) {
                    let event = match failure.class() {
                        ErrorClass::InvalidPod => Some("InvalidSidecarAnnotation"),
                        ErrorClass::Backend => Some("CaptureFailed"),
                        _ => None,
                    };
                    if let Some(event) = event {
                        sink.warn(
                            pod.pod_name(),
                            uid.map(str::to_owned),
                            event,
                            "Capture",
                            failure.to_string(),
                        );
                    }
                }
            }
        }
        result
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
pub(super) async fn off_the_runtime<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, CaptureError> {
    let span = tracing::Span::current();
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        return tokio::task::block_in_place(|| {
            panic::catch_unwind(AssertUnwindSafe(|| span.in_scope(f)))
        })
        .map_err(|_| CaptureError::Task("it panicked".to_owned()));
    }
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| CaptureError::Task(e.to_string()))
}

/// One lock per container with requests in flight: its requests run one at a time.
#[derive(Default)]
pub(super) struct Locks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Locks {
    /// Runs `work` holding the lock of `container_id`.
    pub(super) async fn run<T>(&self, container_id: &str, work: impl Future<Output = T>) -> T {
        let lock = self
            .entries()
            .entry(container_id.to_owned())
            .or_default()
            .clone();
        let out = {
            let _guard = lock.lock().await;
            work.await
        };
        let mut locks = self.entries();
        // Drop the entry when nobody else waits on it (the map holds one reference, we another).
        if locks
            .get(container_id)
            .is_some_and(|l| Arc::strong_count(l) <= 2)
        {
            locks.remove(container_id);
        }
        out
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
