//! The plugin socket: a UNIX socket (mode 0600) on which only root peers (SO_PEERCRED) are
//! served, one length-bounded request per connection, with timeouts on the read and the
//! write. A bad request gets a clear error response; the server keeps serving.
//!
//! The only place the agent reads or writes the plugin's protocol (`meshcap_cni::protocol`):
//! a request's [`Op`] becomes a call of the [`Hub`] with a [`Sandbox`]; what the hub did becomes
//! the [`Response`].
use std::{
    fs, io,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use meshcap_cni::protocol::{
    self, ErrorKind, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, Op, Outcome, PodAttachment,
    ProtocolError, Reply, Response,
};
use meshcap_policy::PodName;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{UnixListener, UnixStream},
    sync::Semaphore,
    task::JoinSet,
};
use tracing::{debug, info, warn};

use crate::{
    hub::{CaptureError, Done, ErrorClass, Hub},
    pod::{PodRef, Sandbox},
};

/// Socket settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The socket path.
    pub path: PathBuf,
    /// Reading a request and writing a response, each.
    pub io_timeout: Duration,
    /// Handling one request (pod lookups with retries included).
    pub request_timeout: Duration,
    /// Connections served at once; more wait for a slot.
    pub max_connections: usize,
}

/// Errors setting up the socket.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Another agent serves the socket.
    #[error("{0} is served by another process (another meshcap-agent?)")]
    InUse(PathBuf),
    /// Creating, binding or securing the socket failed.
    #[error("plugin socket {path}: {source}")]
    Socket {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// The bound socket.
pub struct Server {
    listener: UnixListener,
    config: ServerConfig,
}

impl Server {
    /// Binds the socket with mode 0600, replacing a stale one left by a dead agent.
    ///
    /// # Errors
    /// When the socket is live or cannot be created.
    pub async fn bind(config: ServerConfig) -> Result<Self, ApiError> {
        let path = config.path.clone();
        let err = |source| ApiError::Socket {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(err)?;
        }
        if let Ok(meta) = fs::symlink_metadata(&path) {
            if meta.file_type().is_socket() && UnixStream::connect(&path).await.is_ok() {
                return Err(ApiError::InUse(path));
            }
            fs::remove_file(&path).map_err(err)?;
        }
        let listener = UnixListener::bind(&path).map_err(err)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).map_err(err)?;
        info!(socket = %path.display(), "plugin socket listening");
        Ok(Self { listener, config })
    }

    /// Serves until `shutdown` completes, then waits for requests in flight.
    pub async fn serve(self, hub: Arc<Hub>, shutdown: impl Future<Output = ()>) {
        let slots = Arc::new(Semaphore::new(self.config.max_connections.max(1)));
        let mut inflight = JoinSet::new();
        let config = Arc::new(self.config);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let Ok(permit) = slots.clone().acquire_owned().await else { break };
                        let (hub, config) = (hub.clone(), config.clone());
                        inflight.spawn(async move {
                            connection(stream, &hub, &config).await;
                            drop(permit);
                        });
                    }
                    Err(err) => {
                        warn!(error = %err, "accepting on the plugin socket");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
            }
        }
        hub.readiness().set_serving(false);
        info!(
            inflight = inflight.len(),
            "plugin socket closing; finishing requests in flight"
        );
        while inflight.join_next().await.is_some() {}
        remove_socket(&config.path);
    }
}

fn remove_socket(path: &Path) {
    if let Err(err) = fs::remove_file(path)
        && err.kind() != io::ErrorKind::NotFound
    {
        warn!(socket = %path.display(), error = %err, "removing the plugin socket");
    }
}

/// Serves one connection: one request, one response.
async fn connection(mut stream: UnixStream, hub: &Hub, config: &ServerConfig) {
    let mut verb = "decode";
    let response = match stream.peer_cred() {
        Ok(cred) if cred.uid() == 0 => match read_request(&mut stream, config.io_timeout).await {
            Ok(body) => match protocol::decode_request(&body) {
                Ok(request) => {
                    let op = request.op.name();
                    verb = op;
                    match tokio::time::timeout(config.request_timeout, serve(hub, request.op)).await
                    {
                        Ok(response) => response,
                        Err(_) => {
                            hub.metrics().error(op, "timeout");
                            Response::error(
                                ErrorKind::Internal,
                                format!("{op} did not finish within {:?}", config.request_timeout),
                                "",
                            )
                        }
                    }
                }
                Err(err) => reject(hub, &err),
            },
            Err(err) => reject(hub, &err),
        },
        Ok(cred) => {
            hub.metrics().error("connect", "forbidden");
            warn!(uid = cred.uid(), pid = ?cred.pid(), "refusing a non-root peer on the plugin socket");
            Response::error(
                ErrorKind::Forbidden,
                format!(
                    "uid {} may not use the meshcap-agent socket (root only)",
                    cred.uid()
                ),
                "",
            )
        }
        Err(err) => {
            warn!(error = %err, "reading the peer's credentials");
            return;
        }
    };
    let code = match &response.reply {
        Reply::Ok { .. } => 0,
        Reply::Error { kind, .. } => kind.cni_code(),
    };
    // meshcap-agent's own requests, and the plugin's log (Istio's goes to a socket of its own).
    let from_plugin = !matches!(verb, "status" | "explain" | "log");
    hub.metrics().plugin_request(
        verb,
        code,
        from_plugin.then(|| http_status(&response.reply)),
    );
    let frame = match protocol::encode(&response, MAX_RESPONSE_BYTES) {
        Ok(frame) => frame,
        Err(err) => {
            warn!(error = %err, "encoding a response");
            return;
        }
    };
    match tokio::time::timeout(config.io_timeout, stream.write_all(&frame)).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => debug!(error = %err, "writing a response: the plugin went away"),
        Err(_) => warn!("writing a response timed out"),
    }
}

/// The HTTP status Istio's node agent answers its plugin with for what `reply` says, for
/// `istio_cni_plugin_requests_total{response_code}` (`cni/pkg/nodeagent/cni-watcher.go`,
/// `handleAddEvent`): 200 done, 400 a request that could not be read, 500 anything the agent
/// could not do. A peer that is not root, which Istio's socket has no answer for, is 403.
const fn http_status(reply: &Reply) -> u16 {
    match reply {
        Reply::Ok { .. } => 200,
        Reply::Error { kind, .. } => match kind {
            ErrorKind::BadRequest | ErrorKind::UnsupportedVersion => 400,
            ErrorKind::Forbidden => 403,
            ErrorKind::PodNotFound
            | ErrorKind::PodSourceUnavailable
            | ErrorKind::InvalidPod
            | ErrorKind::Backend
            | ErrorKind::CheckFailed
            | ErrorKind::NotReady
            | ErrorKind::Internal => 500,
        },
    }
}

fn reject(hub: &Hub, err: &ProtocolError) -> Response {
    hub.metrics().error("decode", "bad_request");
    warn!(error = %err, "bad request on the plugin socket");
    Response::error(err.kind(), err.to_string(), "")
}

/// Reads one frame, bounded in size and time.
async fn read_request(
    stream: &mut UnixStream,
    timeout: Duration,
) -> Result<Vec<u8>, ProtocolError> {
    let read = async {
        let mut prefix = [0u8; 4];
        stream.read_exact(&mut prefix).await?;
        let len = protocol::check_len(prefix, MAX_REQUEST_BYTES)?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await?;
        Ok(body)
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| {
            Err(ProtocolError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no complete request within {timeout:?}"),
            )))
        })
}

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
        Op::Log { pod, lines } => return super::plugin_log::write(&pod, &lines),
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
    use meshcap_policy::SkipReason;

    use super::*;

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

    /// Istio's node agent's statuses: 200, 400 for what it cannot read, 500 for what it
    /// cannot do.
    #[test]
    fn istios_response_codes() {
        let error = |kind| Response::error(kind, "", "").reply;
        assert_eq!(http_status(&Response::ok(Outcome::Skipped, "").reply), 200);
        assert_eq!(http_status(&error(ErrorKind::BadRequest)), 400);
        assert_eq!(http_status(&error(ErrorKind::InvalidPod)), 500);
        assert_eq!(http_status(&error(ErrorKind::NotReady)), 500);
        assert_eq!(http_status(&error(ErrorKind::Forbidden)), 403);
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
