//! The messages: requests and their operations, responses and their replies, and the
//! classes of failure with their CNI error codes.
use serde::{Deserialize, Serialize};

use super::PROTOCOL_VERSION;

/// A request: the version and one operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Protocol version ([`PROTOCOL_VERSION`]).
    pub v: u32,
    /// What to do.
    #[serde(flatten)]
    pub op: Op,
}

impl Request {
    /// A request of this build's version.
    #[must_use]
    pub fn new(op: Op) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            op,
        }
    }
}

/// The operations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// CNI ADD: capture the pod (idempotent; a repeated ADD re-applies).
    Add {
        /// The pod and its sandbox.
        pod: PodAttachment,
    },
    /// CNI DEL: stop capturing (idempotent; unknown pods succeed).
    Del {
        /// The pod and its sandbox (`netns` may be empty).
        pod: PodAttachment,
    },
    /// CNI CHECK: is the pod still captured as its policy says?
    Check {
        /// The pod and its sandbox.
        pod: PodAttachment,
    },
    /// CNI GC: forget every capture whose container is not in `valid`.
    Gc {
        /// The container IDs the runtime still has attachments for.
        valid_container_ids: Vec<String>,
    },
    /// CNI STATUS: is the agent alive and ready?
    Ping,
    /// `meshcap-agent status`: the agent's state as JSON.
    Status,
    /// `meshcap-agent explain`: why a pod is (not) captured, and what is installed for it, as
    /// JSON.
    Explain {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// The plugin's log lines of one command, which the agent writes into its own log, as
    /// Istio's plugin sends its log to its node agent (`cni/pkg/plugin/plugin.go`).
    Log {
        /// The pod the command concerned, `namespace/name` (empty: none).
        #[serde(default)]
        pod: String,
        /// The lines, in order.
        lines: Vec<LogLine>,
    },
}

/// One of the plugin's log lines.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// `error`, `warn`, `info` or `debug`.
    pub level: String,
    /// When it was written, in microseconds since the epoch.
    pub unix_micros: u64,
    /// The message.
    pub msg: String,
}

impl Op {
    /// The operation's name on the wire.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::Add { .. } => "add",
            Self::Del { .. } => "del",
            Self::Check { .. } => "check",
            Self::Gc { .. } => "gc",
            Self::Ping => "ping",
            Self::Status => "status",
            Self::Explain { .. } => "explain",
            Self::Log { .. } => "log",
        }
    }
}

/// A pod's sandbox as the runtime describes it to CNI.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodAttachment {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_UID`, when the runtime passes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// `CNI_CONTAINERID`: the sandbox (pause) container.
    pub container_id: String,
    /// `CNI_NETNS`: the sandbox's network namespace file (may be empty on DEL).
    #[serde(default)]
    pub netns: String,
    /// `CNI_IFNAME`: the pod's interface.
    #[serde(default)]
    pub ifname: String,
    /// The pod's addresses from `prevResult` (empty: the agent reads them in the netns).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<std::net::IpAddr>,
}

/// A response: the version and the reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// Protocol version ([`PROTOCOL_VERSION`]).
    pub v: u32,
    /// Success or failure.
    #[serde(flatten)]
    pub reply: Reply,
}

impl Response {
    /// A success.
    #[must_use]
    pub fn ok(outcome: Outcome, message: impl Into<String>) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            reply: Reply::Ok {
                outcome,
                message: message.into(),
                report: None,
            },
        }
    }

    /// A failure.
    #[must_use]
    pub fn error(kind: ErrorKind, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            reply: Reply::Error {
                kind,
                msg: msg.into(),
                details: details.into(),
            },
        }
    }
}

/// The body of a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Reply {
    /// The operation succeeded.
    Ok {
        /// What happened.
        outcome: Outcome,
        /// One line for logs and humans.
        message: String,
        /// The `status` operation's report (and `explain`'s answer).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        report: Option<serde_json::Value>,
    },
    /// The operation failed; nothing was left half-applied.
    Error {
        /// The class of failure (decides the CNI error code).
        kind: ErrorKind,
        /// What failed, naming the pod, field and value.
        msg: String,
        /// More context (causes), possibly empty.
        #[serde(default)]
        details: String,
    },
}

/// What a successful operation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// ADD: the pod's traffic is now captured.
    Captured,
    /// ADD/CHECK: the pod is not to be captured (the reason is in the message).
    Skipped,
    /// DEL: capture removed (or there was none).
    Removed,
    /// CHECK: capture is in place as the policy says.
    Checked,
    /// GC: stale captures removed.
    Collected,
    /// PING: the agent is ready.
    Alive,
    /// STATUS: the report is attached.
    Status,
    /// EXPLAIN: the explanation is attached.
    Explained,
    /// LOG: the plugin's lines are in the agent's log.
    Logged,
}

/// Classes of failure, each mapped to a CNI error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request could not be decoded or is invalid.
    BadRequest,
    /// The request's protocol version is not spoken by the agent.
    UnsupportedVersion,
    /// The peer is not allowed to talk to the agent (not root).
    Forbidden,
    /// The pod could not be found in the pod source after bounded retries.
    PodNotFound,
    /// The pod source (Kubernetes API, directory) could not be reached or read.
    PodSourceUnavailable,
    /// The pod's annotations or spec are invalid for capture.
    InvalidPod,
    /// The backend failed to apply or remove capture.
    Backend,
    /// CHECK found the capture missing or different from the policy.
    CheckFailed,
    /// The agent is not ready yet (starting, shutting down).
    NotReady,
    /// Anything else.
    Internal,
}

impl ErrorKind {
    /// The CNI error code reported for this failure. Codes 11 ("try again later") and 50
    /// ("plugin not available") are the spec's; 100 and up are meshcap's own.
    #[must_use]
    pub fn cni_code(self) -> u32 {
        match self {
            Self::NotReady | Self::PodSourceUnavailable => 11,
            Self::BadRequest => 100,
            Self::UnsupportedVersion => 101,
            Self::Forbidden => 102,
            Self::PodNotFound => 103,
            Self::InvalidPod => 104,
            Self::Backend => 105,
            Self::CheckFailed => 106,
            Self::Internal => 107,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_is_flat_and_tagged() {
        let json = serde_json::to_value(Request::new(Op::Ping)).unwrap();
        assert_eq!(json, serde_json::json!({"v": 1, "op": "ping"}));
        let json = serde_json::to_value(Response::error(ErrorKind::InvalidPod, "m", "")).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"v": 1, "status": "error", "kind": "invalid_pod", "msg": "m", "details": ""})
        );
    }

    #[test]
    fn every_error_kind_has_a_distinct_plugin_code() {
        let kinds = [
            ErrorKind::BadRequest,
            ErrorKind::UnsupportedVersion,
            ErrorKind::Forbidden,
            ErrorKind::PodNotFound,
            ErrorKind::InvalidPod,
            ErrorKind::Backend,
            ErrorKind::CheckFailed,
            ErrorKind::Internal,
        ];
        let mut codes: Vec<_> = kinds.iter().map(|k| k.cni_code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), kinds.len());
        assert!(codes.iter().all(|c| *c >= 100));
    }
}
