//! Each request as an operator sees it: a span naming the pod, its outcome counted and logged,
//! and, for an ADD that fails on the pod's annotations or in the backend, a Warning Event on
//! the pod.
use std::time::Instant;

use tracing::{Instrument as _, info, info_span, warn};

use super::{CaptureError, Done, ErrorClass, Hub};
use crate::pod::PodRef;

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
            if !matches!(verb, Verb::Status | Verb::Explain) && !self.readiness.serving() {
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
