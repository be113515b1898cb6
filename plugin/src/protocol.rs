//! The plugin ⇄ agent protocol: one request per connection on a UNIX socket.
//!
//! A message is a frame: a 4-byte big-endian length, then that many bytes of JSON. Every
//! message carries the protocol version `v`; a peer refuses a version it does not know with a
//! clear error instead of guessing. Requests are bounded by [`MAX_REQUEST_BYTES`], responses by
//! [`MAX_RESPONSE_BYTES`]; both sides put timeouts on every read and write.
//!
//! ```text
//! → {"v":1,"op":"add","pod":{"namespace":"default","name":"web","uid":"…","container_id":"…","netns":"/var/run/netns/cni-…","ifname":"eth0"}}
//! ← {"v":1,"status":"ok","outcome":"captured","message":"backend iptables, mode REDIRECT"}
//! ← {"v":1,"status":"error","kind":"invalid_pod","msg":"pod default/web: annotation …","details":""}
//! ```
//!
//! This module is shared: the plugin uses [`call`], the agent decodes with [`decode_request`]
//! and answers with [`encode`].
use std::{
    io::{self, Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// The largest request body an agent accepts.
pub const MAX_REQUEST_BYTES: u32 = 64 * 1024;
/// The largest response body a client accepts (status reports list every captured pod).
pub const MAX_RESPONSE_BYTES: u32 = 8 * 1024 * 1024;

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

/// Errors framing or decoding a message.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The announced length is over the limit.
    #[error("message of {len} bytes is larger than the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The body is not the JSON of a message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The message's version is not this build's.
    #[error(
        "protocol version {got} is not supported (this side speaks version {PROTOCOL_VERSION}); \
         upgrade meshcap-cni and meshcap-agent together"
    )]
    UnsupportedVersion {
        /// The version received.
        got: u64,
    },
    /// Reading or writing the socket failed.
    #[error("socket I/O: {0}")]
    Io(#[from] io::Error),
}

impl ProtocolError {
    /// The error kind an agent answers this with.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::UnsupportedVersion { .. } => ErrorKind::UnsupportedVersion,
            _ => ErrorKind::BadRequest,
        }
    }
}

/// Serializes `message` into a frame (length prefix included).
///
/// # Errors
/// When the body would exceed `max`.
pub fn encode<T: Serialize>(message: &T, max: u32) -> Result<Vec<u8>, ProtocolError> {
    let body = serde_json::to_vec(message).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|len| *len <= max)
        .ok_or(ProtocolError::TooLarge {
            len: body.len() as u64,
            max,
        })?;
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Checks a frame's announced length against `max`.
///
/// # Errors
/// When it is over the limit.
pub fn check_len(prefix: [u8; 4], max: u32) -> Result<usize, ProtocolError> {
    let len = u32::from_be_bytes(prefix);
    if len > max {
        return Err(ProtocolError::TooLarge {
            len: u64::from(len),
            max,
        });
    }
    Ok(len as usize)
}

/// Reads the protocol version of a JSON body, refusing any other than ours.
fn check_version(value: &serde_json::Value) -> Result<(), ProtocolError> {
    match value.get("v").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(PROTOCOL_VERSION) => Ok(()),
        Some(got) => Err(ProtocolError::UnsupportedVersion { got }),
        None => Err(ProtocolError::Malformed(
            "missing protocol version field \"v\"".to_owned(),
        )),
    }
}

fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ProtocolError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    check_version(&value)?;
    serde_json::from_value(value).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// Decodes a request body (without its length prefix).
///
/// # Errors
/// When it is not JSON, has another version, or is not a known operation.
pub fn decode_request(body: &[u8]) -> Result<Request, ProtocolError> {
    let request: Request = decode(body)?;
    if let Op::Add { pod } | Op::Del { pod } | Op::Check { pod } = &request.op {
        validate_pod(pod, matches!(request.op, Op::Del { .. }))?;
    }
    Ok(request)
}

fn validate_pod(pod: &PodAttachment, is_del: bool) -> Result<(), ProtocolError> {
    let missing = |field: &str| {
        Err(ProtocolError::Malformed(format!(
            "pod field {field:?} is empty"
        )))
    };
    if pod.namespace.is_empty() {
        return missing("namespace");
    }
    if pod.name.is_empty() {
        return missing("name");
    }
    if pod.container_id.is_empty() {
        return missing("container_id");
    }
    if pod.netns.is_empty() && !is_del {
        return missing("netns");
    }
    Ok(())
}

/// Decodes a response body (without its length prefix).
///
/// # Errors
/// When it is not JSON, has another version, or is not a response.
pub fn decode_response(body: &[u8]) -> Result<Response, ProtocolError> {
    decode(body)
}

/// Reads one frame from a blocking stream.
///
/// # Errors
/// On I/O errors, timeouts (as I/O errors) and frames over `max`.
pub fn read_frame(stream: &mut impl Read, max: u32) -> Result<Vec<u8>, ProtocolError> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix)?;
    let len = check_len(prefix, max)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(body)
}

/// Errors calling the agent.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Nothing listens on the socket (agent not running, or not yet started).
    #[error("meshcap-agent is not reachable at {path}: {source}")]
    Unreachable {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The agent did not answer in time.
    #[error("meshcap-agent at {path} did not answer within {timeout:?}")]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The timeout.
        timeout: Duration,
    },
    /// The agent closed or reset the connection before answering: it died or restarted in
    /// the middle of the request.
    #[error("meshcap-agent at {path} went away before answering (did it restart?): {source}")]
    Interrupted {
        /// The socket path.
        path: PathBuf,
        /// How the connection ended.
        #[source]
        source: io::Error,
    },
    /// The agent answered something that is not an answer (malformed, too large, another
    /// protocol version).
    #[error("talking to meshcap-agent at {path}: {source}")]
    Protocol {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: ProtocolError,
    },
}

/// Sends one request to the agent listening on `socket` and waits at most `timeout` for each
/// of connect, write and read.
///
/// # Errors
/// When the agent is unreachable, too slow, or answers garbage.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Response, CallError> {
    let path = socket.to_owned();
    let mut stream = UnixStream::connect(socket).map_err(|source| CallError::Unreachable {
        path: path.clone(),
        source,
    })?;
    let protocol = |source: ProtocolError| match source {
        ProtocolError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            CallError::Timeout {
                path: path.clone(),
                timeout,
            }
        }
        ProtocolError::Io(source) => CallError::Interrupted {
            path: path.clone(),
            source,
        },
        source => CallError::Protocol {
            path: path.clone(),
            source,
        },
    };
    let exchange = |stream: &mut UnixStream| -> Result<Response, ProtocolError> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let sent = stream.write_all(&encode(request, MAX_REQUEST_BYTES)?);
        // The agent may answer before reading (a refused peer): its answer beats our write
        // error.
        match read_frame(stream, MAX_RESPONSE_BYTES) {
            Ok(body) => decode_response(&body),
            Err(err) => Err(sent.err().map_or(err, ProtocolError::Io)),
        }
    };
    exchange(&mut stream).map_err(protocol)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodAttachment {
        PodAttachment {
            namespace: "default".into(),
            name: "web".into(),
            uid: Some("1234".into()),
            container_id: "abc".into(),
            netns: "/var/run/netns/x".into(),
            ifname: "eth0".into(),
            ips: vec!["10.0.0.9".parse().unwrap()],
        }
    }

    #[test]
    fn request_round_trips_in_a_frame() {
        let request = Request::new(Op::Add { pod: pod() });
        let frame = encode(&request, MAX_REQUEST_BYTES).unwrap();
        let body = read_frame(&mut frame.as_slice(), MAX_REQUEST_BYTES).unwrap();
        assert_eq!(decode_request(&body).unwrap(), request);
    }

    /// Found by the `protocol` fuzz target: a number in a status report, read with serde_json's
    /// fast float parser, came back one unit in the last place off after a re-encode.
    /// Numbers are parsed correctly rounded (serde_json's `float_roundtrip`), so what one side
    /// writes is what the other reads.
    #[test]
    fn a_response_number_survives_a_round_trip() {
        let body = format!(
            r#"{{"v":1,"status":"ok","outcome":"status","message":"","report":{{"n":{}}}}}"#,
            "1".repeat(114)
        );
        let response = decode_response(body.as_bytes()).unwrap();
        let frame = encode(&response, MAX_RESPONSE_BYTES).unwrap();
        let again = read_frame(&mut frame.as_slice(), MAX_RESPONSE_BYTES).unwrap();
        assert_eq!(decode_response(&again).unwrap(), response);
    }

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
    fn other_versions_are_refused_by_name() {
        let err = decode_request(br#"{"v":2,"op":"ping"}"#).unwrap_err();
        assert!(matches!(err, ProtocolError::UnsupportedVersion { got: 2 }));
        assert_eq!(err.kind(), ErrorKind::UnsupportedVersion);
        let err = decode_request(br#"{"op":"ping"}"#).unwrap_err();
        assert!(err.to_string().contains("\"v\""), "{err}");
    }

    #[test]
    fn garbage_and_unknown_ops_are_malformed() {
        for body in [
            &b"\x00\x01garbage"[..],
            b"{}",
            b"[1,2]",
            br#"{"v":1,"op":"explode"}"#,
            br#"{"v":1,"op":"add"}"#,
            br#"{"v":1,"op":"add","pod":{"namespace":"","name":"a","container_id":"c","netns":"/n"}}"#,
            br#"{"v":1,"op":"add","pod":{"namespace":"a","name":"a","container_id":"c"}}"#,
        ] {
            let err = decode_request(body).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::BadRequest, "{err}");
        }
    }

    #[test]
    fn del_may_omit_the_netns() {
        let body = br#"{"v":1,"op":"del","pod":{"namespace":"a","name":"b","container_id":"c"}}"#;
        assert!(decode_request(body).is_ok());
    }

    #[test]
    fn oversized_frames_are_refused_before_reading() {
        let mut frame = (MAX_REQUEST_BYTES + 1).to_be_bytes().to_vec();
        frame.extend_from_slice(b"{}");
        let err = read_frame(&mut frame.as_slice(), MAX_REQUEST_BYTES).unwrap_err();
        assert!(matches!(err, ProtocolError::TooLarge { .. }), "{err}");
        let big = Request::new(Op::Gc {
            valid_container_ids: vec!["x".repeat(70_000)],
        });
        assert!(encode(&big, MAX_REQUEST_BYTES).is_err());
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
