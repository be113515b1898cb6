//! The client side: one request to the agent's socket, with a timeout on every step.
use std::{
    io::{self, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use super::{
    MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, ProtocolError, Request, Response, decode_response,
    encode, read_frame,
};

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
