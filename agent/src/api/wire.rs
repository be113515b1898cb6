//! The plugin's protocol (`meshcap_cni::protocol`) turned into the hub's domain and back: the
//! only place the agent reads or writes it. A request's [`Op`] becomes a call of the
//! [`Hub`] with a [`Sandbox`]; what the hub did becomes the [`Response`].
use std::path::PathBuf;

use meshcap_cni::protocol::{ErrorKind, Op, Outcome, PodAttachment, Reply, Response};

use crate::{
    hub::{CaptureError, Done, ErrorClass, Hub},
    pod::{PodName, PodRef, Sandbox},
};

/// Serves one decoded request.
pub(super) async fn serve(hub: &Hub, op: Op) -> Response {
    let result = match op {
        Op::Add { pod } => hub.add(sandbox(pod)).await,
        Op::Del { pod } => hub.del(sandbox(pod).pod).await,
        Op::Check { pod } => hub.check(sandbox(pod)).await,
        Op::Gc {
            valid_container_ids,
        } => hub.gc(valid_container_ids).await,
        Op::Ping => hub.ping().await,
        Op::Status => hub.status().await,
        Op::Explain { namespace, name } => hub.explain(PodName { namespace, name }).await,
    };
    respond(result)
}

/// The pod the plugin names, as the hub takes it (the interface name is the plugin's alone).
fn sandbox(pod: PodAttachment) -> Sandbox {
    Sandbox {
        pod: PodRef {
            namespace: pod.namespace,
            name: pod.name,
            container_id: pod.container_id,
            netns: PathBuf::from(pod.netns),
        },
        uid: pod.uid,
        ips: pod.ips,
    }
}

fn respond(result: Result<Done, CaptureError>) -> Response {
    match result {
        Ok(Done::Status(report)) => with_report(Outcome::Status, "status", &report),
        Ok(Done::Explained(explanation)) => {
            with_report(Outcome::Explained, &explanation.decision, &explanation)
        }
        Ok(done) => Response::ok(outcome(&done), done.message()),
        Err(failure) => Response::error(kind(failure.class()), failure.to_string(), ""),
    }
}

/// A success carrying `report` as JSON.
fn with_report(outcome: Outcome, message: &str, report: &impl serde::Serialize) -> Response {
    let mut response = Response::ok(outcome, message);
    if let Reply::Ok { report: slot, .. } = &mut response.reply {
        *slot = serde_json::to_value(report).ok();
    }
    response
}

const fn outcome(done: &Done) -> Outcome {
    match done {
        Done::Captured(_) => Outcome::Captured,
        Done::Skipped(_) => Outcome::Skipped,
        Done::Removed => Outcome::Removed,
        Done::Checked(_) => Outcome::Checked,
        Done::Collected(_) => Outcome::Collected,
        Done::Alive(_) => Outcome::Alive,
        Done::Status(_) => Outcome::Status,
        Done::Explained(_) => Outcome::Explained,
    }
}

const fn kind(class: ErrorClass) -> ErrorKind {
    match class {
        ErrorClass::NotReady => ErrorKind::NotReady,
        ErrorClass::PodNotFound => ErrorKind::PodNotFound,
        ErrorClass::PodSourceUnavailable => ErrorKind::PodSourceUnavailable,
        ErrorClass::InvalidPod => ErrorKind::InvalidPod,
        ErrorClass::BadRequest => ErrorKind::BadRequest,
        ErrorClass::Backend => ErrorKind::Backend,
        ErrorClass::CheckFailed => ErrorKind::CheckFailed,
        ErrorClass::Internal => ErrorKind::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::SkipReason;

    /// The metrics count failures and outcomes by the names the plugin's protocol gives them.
    #[test]
    fn metric_labels_are_the_protocols_names() {
        for class in [
            ErrorClass::NotReady,
            ErrorClass::PodNotFound,
            ErrorClass::PodSourceUnavailable,
            ErrorClass::InvalidPod,
            ErrorClass::BadRequest,
            ErrorClass::Backend,
            ErrorClass::CheckFailed,
            ErrorClass::Internal,
        ] {
            assert_eq!(serde_json::json!(kind(class)), class.label(), "{class:?}");
        }
        for done in [
            Done::Captured(String::new()),
            Done::Skipped(SkipReason::NoProxy),
            Done::Removed,
            Done::Checked(""),
            Done::Collected(0),
            Done::Alive(String::new()),
            Done::Status(Box::default()),
            Done::Explained(Box::default()),
        ] {
            assert_eq!(serde_json::json!(outcome(&done)), done.label(), "{done:?}");
        }
    }

    #[test]
    fn a_request_is_answered_with_the_hubs_words() {
        let skipped = respond(Ok(Done::Skipped(SkipReason::HostNetwork)));
        assert_eq!(
            skipped.reply,
            Reply::Ok {
                outcome: Outcome::Skipped,
                message: "not captured: the pod uses the host network".to_owned(),
                report: None,
            }
        );
        let refused = respond(Err(CaptureError::NotReady("starting".to_owned())));
        assert_eq!(
            refused,
            Response::error(ErrorKind::NotReady, "starting", "")
        );
    }
}
