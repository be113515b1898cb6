//! Asking the agent, and deciding without it when it is not listening.
use crate::{
    cni::{CniError, NetConf, code},
    fallback,
    protocol::{self, CallError, Op, PodAttachment, Reply, Request},
};

/// `details` of the error for an agent that is not listening.
const UNREACHABLE: &str = "agent unreachable";

/// Why a request got no answer to act on.
pub(super) enum Failure {
    /// The agent answered with an error.
    Agent(CniError),
    /// The agent gave no answer: not listening, the exchange broke, or no answer in time.
    NoAnswer(CallError),
}

/// Sends one request; the agent's answer, or why there is none.
pub(super) fn ask(conf: &NetConf, op: Op) -> Result<String, Failure> {
    let socket = &conf.meshcap.agent_socket;
    match protocol::call(socket, &Request::new(op), conf.meshcap.timeout()) {
        Ok(response) => match response.reply {
            Reply::Ok { message, .. } => Ok(message),
            Reply::Error { kind, msg, details } => Err(Failure::Agent(CniError {
                code: kind.cni_code(),
                msg,
                details,
            })),
        },
        Err(err) => Err(Failure::NoAnswer(err)),
    }
}

/// With the agent not listening: whether the pod may start without it (`Ok`, with why: the
/// mesh does not concern it), decided by `meshcap-agent decide` beside the plugin. A pod that
/// needs capture, and a pod that cannot be decided (no source configured, the API server
/// unreachable too), fail closed.
pub(super) fn without_agent(
    conf: &NetConf,
    pod: &PodAttachment,
    unreachable: &CallError,
) -> Result<String, CniError> {
    let closed = |why: String| CniError {
        code: code::TRY_AGAIN_LATER,
        msg: format!(
            "{unreachable}; is the meshcap-agent DaemonSet pod running on this node? ADD \
             refused: pod {}/{} {why}, and pods are never started uncaptured",
            pod.namespace, pod.name
        ),
        details: UNREACHABLE.to_owned(),
    };
    match fallback::decide(&conf.meshcap, pod) {
        Ok(Some(decision)) if !decision.capture => Ok(decision.reason),
        Ok(Some(decision)) => Err(closed(format!("must be captured ({})", decision.reason))),
        Ok(None) => Err(closed("cannot be decided without the agent".to_owned())),
        Err(why) => Err(closed(format!(
            "cannot be decided without the agent ({why})"
        ))),
    }
}

/// Sends one request and turns every failure into a CNI error: for every operation but DEL,
/// no answer fails (closed: an ADD never lets a pod start uncaptured).
pub(super) fn ask_or_fail(conf: &NetConf, op: Op) -> Result<String, CniError> {
    let name = op.name().to_ascii_uppercase();
    ask(conf, op).map_err(|failure| fail(failure, &name))
}

/// The CNI error for a request `name` that failed.
pub(super) fn fail(failure: Failure, name: &str) -> CniError {
    match failure {
        Failure::Agent(err) => err,
        Failure::NoAnswer(err @ CallError::Unreachable { .. }) => CniError {
            code: code::TRY_AGAIN_LATER,
            msg: format!(
                "{err}; is the meshcap-agent DaemonSet pod running on this node? \
                 ({name} refused: pods are never started uncaptured)"
            ),
            details: UNREACHABLE.to_owned(),
        },
        Failure::NoAnswer(err @ (CallError::Timeout { .. } | CallError::Interrupted { .. })) => {
            CniError::new(code::TRY_AGAIN_LATER, format!("{err} ({name})"))
        }
        Failure::NoAnswer(err @ CallError::Protocol { .. }) => {
            CniError::new(code::IO, format!("{err} ({name})"))
        }
    }
}
