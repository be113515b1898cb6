//! Framing and decoding: a 4-byte big-endian length, then that many bytes of JSON, checked for
//! its size, its protocol version and (for requests) the pod's required fields.
use std::io::{self, Read};

use serde::Serialize;

use super::{ErrorKind, Op, PROTOCOL_VERSION, PodAttachment, Request, Response};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};

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
}
