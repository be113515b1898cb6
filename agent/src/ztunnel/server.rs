//! The agent's end of ZDS: the listening socket, the connected ztunnels, the snapshot each new
//! one is sent, and the adds and deletes that follow.
//!
//! The socket's path is shared with istio-cni's agent (Istio's `/var/run/ztunnel/ztunnel.sock`),
//! which, when it stops (`cni/pkg/nodeagent/net_linux.go`, `NetServer.Stop`, closing its
//! listener in `ztunnelserver.go`), has Go unlink that path, whoever listens there by then. The
//! acceptor checks the path every [`PATH_CHECK`] and, when it is gone or names a socket file
//! nobody listens on, listens there again, so that ztunnel, which reconnects by path, finds
//! meshcap. When another process listens there ([`super::diag`]: istio-cni's agent starting on
//! the node, which removes the path and binds its own, as meshcap's does at its start), the path
//! is left to it: the handing back of a node to istio-cni. Connections already accepted are not
//! affected either way.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use nix::{
    fcntl::OFlag,
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::socket::{SockFlag, accept4},
    unistd::{pipe2, write},
};
use tracing::{info, warn};

use super::{
    ZdsError,
    conn::Connection,
    diag,
    listener::{Listener, SocketId, listen_at, relisten, socket_id},
    proto::{
        AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, WorkloadInfo, WorkloadRequest,
        workload_request::Payload,
    },
};

/// A pod ztunnel must serve, as the snapshot sends it.
#[derive(Debug)]
pub struct Enrolled {
    /// The pod's uid.
    pub uid: String,
    /// Its name, namespace and service account.
    pub workload: WorkloadInfo,
    /// Its network namespace, when the agent can open it (without, ztunnel is told to keep
    /// whatever it has for the pod).
    pub netns: Option<OwnedFd>,
}

type Snapshot = dyn Fn() -> Vec<Enrolled> + Send + Sync;

/// What the agent does when it leaves the path to another agent.
type OnYield = dyn Fn() + Send + Sync;

struct Shared {
    /// Connected ztunnels, oldest first. Each connection's lock pairs a request with its ack.
    connections: Mutex<Vec<Arc<Mutex<Connection>>>>,
    snapshot: Box<Snapshot>,
    /// The ztunnels sent their snapshot so far.
    greeted: AtomicU64,
    /// Whether the path is left to another agent listening there ([`another_listens`]).
    yielded: AtomicBool,
    /// Run (on a thread of its own) each time the path is left to another agent.
    on_yield: Box<OnYield>,
}

/// How often the acceptor checks that the socket's path is still its socket.
const PATH_CHECK: Duration = Duration::from_millis(500);

/// The ZDS socket and the ztunnels connected to it. Dropping it closes the socket.
pub struct ZtunnelServer {
    shared: Arc<Shared>,
    path: PathBuf,
    /// Written to stop the acceptor.
    stop: OwnedFd,
    /// The acceptor, which returns the identity of the socket it listened on last.
    acceptor: Option<JoinHandle<Option<SocketId>>>,
}

impl ZtunnelServer {
    /// Listens at `path` (replacing a file nobody listens on) and serves every ztunnel that
    /// connects, each first sent what `snapshot` returns; listens there again whenever the
    /// path is unlinked or replaced by a file nobody listens on. Where another agent listens
    /// at the path (at the start too: istio-cni's, on a node being handed back to it, when
    /// meshcap's agent restarts) the path is left to it and `on_yield` runs.
    ///
    /// # Errors
    /// The socket cannot be created.
    pub fn start(
        path: &Path,
        snapshot: impl Fn() -> Vec<Enrolled> + Send + Sync + 'static,
        on_yield: impl Fn() + Send + Sync + 'static,
    ) -> Result<Self, ZdsError> {
        let listener = match socket_id(path) {
            Some(other) if diag::listened_on(path, other, None).unwrap_or(false) => None,
            _ => Some(listen_at(path)?),
        };
        let (stop_rx, stop) = pipe2(OFlag::O_CLOEXEC).map_err(ZdsError::io)?;
        let shared = Arc::new(Shared {
            connections: Mutex::new(Vec::new()),
            snapshot: Box::new(snapshot),
            greeted: AtomicU64::new(0),
            yielded: AtomicBool::new(false),
            on_yield: Box::new(on_yield),
        });
        let acceptor = {
            let (shared, path) = (Arc::clone(&shared), path.to_owned());
            std::thread::Builder::new()
                .name("ztunnel-accept".to_owned())
                .spawn(move || accept_loop(&shared, &path, listener, &stop_rx))
                .map_err(ZdsError::Io)?
        };
        info!(socket = %path.display(), "serving ztunnel");
        Ok(Self {
            shared,
            path: path.to_owned(),
            stop,
            acceptor: Some(acceptor),
        })
    }

    /// Hands a pod to the newest ztunnel and waits for its ack: ztunnel then serves the pod
    /// (its listeners are open in `netns`).
    ///
    /// Not while another agent listens at the path: a ztunnel still connected here reconnects
    /// to that agent when this one goes, and is sent only the pods that agent knows.
    ///
    /// # Errors
    /// No ztunnel is connected, or it refused or did not answer; another agent listens at the
    /// path.
    pub fn add(
        &self,
        uid: &str,
        workload: WorkloadInfo,
        netns: BorrowedFd<'_>,
    ) -> Result<(), ZdsError> {
        if self.shared.yielded.load(Ordering::Acquire) {
            return Err(ZdsError::Yielded);
        }
        let connection = self.newest().ok_or(ZdsError::NotConnected)?;
        let request = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: uid.to_owned(),
                workload_info: Some(workload),
            })),
        };
        let result = lock(&connection).request(&request, Some(netns));
        if matches!(result, Err(ZdsError::Closed | ZdsError::Io(_))) {
            self.forget(&connection);
        }
        result
    }

    /// Tells every connected ztunnel that a pod is gone. The connections of ztunnels that went
    /// away are dropped first, as before an add: a restarted ztunnel's old connection is not
    /// written to (its error would be reported for a pod the new one was told about).
    ///
    /// # Errors
    /// A connected ztunnel refused or did not answer (the others were still told).
    pub fn delete(&self, uid: &str) -> Result<(), ZdsError> {
        let request = WorkloadRequest {
            payload: Some(Payload::Del(DelWorkload {
                uid: uid.to_owned(),
            })),
        };
        self.prune();
        let connections = lock(&self.shared.connections).clone();
        let mut first_error = None;
        for connection in connections {
            let result = lock(&connection).request(&request, None);
            if matches!(result, Err(ZdsError::Closed | ZdsError::Io(_))) {
                self.forget(&connection);
            }
            if let Err(err) = result {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether the newest ztunnel (the one adds go to) acked the pod whose uid is `uid` and was
    /// not told since that it is gone; `None` when no ztunnel is connected.
    #[must_use]
    pub fn serves(&self, uid: &str) -> Option<bool> {
        let newest = self.newest()?;
        let serves = lock(&newest).serves(uid);
        Some(serves)
    }

    /// How many ztunnels are connected.
    #[must_use]
    pub fn connected(&self) -> usize {
        self.prune();
        lock(&self.shared.connections).len()
    }

    /// How many ztunnels were sent their snapshot since the socket opened: a new one is
    /// there to be handed pods when it grows.
    #[must_use]
    pub fn greeted(&self) -> u64 {
        self.shared.greeted.load(Ordering::Acquire)
    }

    fn newest(&self) -> Option<Arc<Mutex<Connection>>> {
        self.prune();
        lock(&self.shared.connections).last().cloned()
    }

    /// Forgets the connections whose ztunnel has gone. A connection in use (its lock held, a
    /// request waiting for its ack) is kept: the request finds out.
    fn prune(&self) {
        lock(&self.shared.connections).retain(|connection| {
            connection
                .try_lock()
                .map_or(true, |connection| !connection.closed())
        });
    }

    fn forget(&self, gone: &Arc<Mutex<Connection>>) {
        lock(&self.shared.connections).retain(|connection| !Arc::ptr_eq(connection, gone));
    }
}

impl Drop for ZtunnelServer {
    fn drop(&mut self) {
        let _ = write(&self.stop, &[1]);
        let last = self
            .acceptor
            .take()
            .and_then(|acceptor| acceptor.join().ok());
        // The path goes only while it is still this server's socket: another agent's
        // listening there now is not ours to unlink.
        if last
            .flatten()
            .is_some_and(|id| socket_id(&self.path) == Some(id))
        {
            drop(std::fs::remove_file(&self.path));
        }
    }
}

/// Accepts ztunnels until `stop` is readable (none while `listener` is `None`), listening at
/// `path` again when the path no longer names the socket; returns the identity of the last
/// socket listened on (`None` when none could be bound at the end).
fn accept_loop(
    shared: &Arc<Shared>,
    path: &Path,
    mut listener: Option<Listener>,
    stop: &OwnedFd,
) -> Option<SocketId> {
    let mut yielded_to = None;
    let timeout = PollTimeout::try_from(PATH_CHECK).unwrap_or(PollTimeout::MAX);
    loop {
        let (accepting, stopping) = {
            let mut fds = vec![PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
            if let Some(listener) = &listener {
                fds.push(PollFd::new(listener.fd.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(_) => {
                    let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
                    (fds.get(1).is_some_and(ready), ready(&fds[0]))
                }
                Err(nix::errno::Errno::EINTR) => (false, false),
                Err(err) => {
                    warn!(%err, "waiting for ztunnel connections failed");
                    (false, false)
                }
            }
        };
        if stopping {
            return listener.map(|l| l.id);
        }
        if accepting && let Some(listener) = &listener {
            accept_one(shared, listener);
        }
        let found = socket_id(path);
        // No listener (the path left to another agent, or listening again failed) is checked
        // again each time, also when the path is gone.
        if listener.is_none() || listener.as_ref().map(|l| l.id) != found {
            let before = yielded_to;
            let own = listener.as_ref().map(|l| l.inode);
            let yielding =
                matches!(found, Some(other) if another_listens(path, other, own, &mut yielded_to));
            if yielding && yielded_to != before {
                let shared = Arc::clone(shared);
                let spawned = std::thread::Builder::new()
                    .name("ztunnel-yield".to_owned())
                    .spawn(move || (shared.on_yield)());
                if let Err(err) = spawned {
                    warn!(%err, "cannot run what follows leaving the ZDS socket's path");
                }
            }
            listener = if yielding {
                None
            } else {
                yielded_to = None;
                relisten(path)
            };
            shared.yielded.store(yielding, Ordering::Release);
        }
    }
}

/// Whether another process listens on the socket file `other` now at the path (istio-cni's
/// agent starting on the node while meshcap's runs): the path is then left to it, said once per
/// file in `yielded_to`. A file nobody listens on (left by an agent that is gone), or a table
/// that cannot be read, is replaced.
fn another_listens(
    path: &Path,
    other: SocketId,
    own: Option<u64>,
    yielded_to: &mut Option<SocketId>,
) -> bool {
    match diag::listened_on(path, other, own) {
        Ok(true) => {
            if *yielded_to != Some(other) {
                warn!(
                    "another agent listens on the ZDS socket's path (istio-cni's agent starting \
                     on this node): the path is left to it; the ztunnels connected here stay \
                     served until they reconnect"
                );
                *yielded_to = Some(other);
            }
            true
        }
        Ok(false) => false,
        Err(err) => {
            warn!(%err, "cannot tell whether another agent listens on the ZDS socket's path");
            false
        }
    }
}

fn accept_one(shared: &Arc<Shared>, listener: &Listener) {
    let socket = match accept4(listener.fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
        Err(_) => return,
    };
    let shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("ztunnel-hello".to_owned())
        .spawn(move || {
            if let Err(err) = greet(&shared, socket) {
                warn!(%err, "a ztunnel connection failed before it was served");
            }
        });
    if let Err(err) = spawned {
        warn!(%err, "cannot serve a ztunnel connection");
    }
}

/// Reads ztunnel's hello and sends the snapshot. The connection is listed (newest) before
/// the snapshot and locked until it is sent, so a pod added meanwhile follows the snapshot.
fn greet(shared: &Shared, socket: OwnedFd) -> Result<(), ZdsError> {
    let connection = Arc::new(Mutex::new(Connection::new(socket)?));
    let guard = lock(&connection);
    lock(&shared.connections).push(Arc::clone(&connection));
    let result = hello_and_snapshot(shared, &guard);
    drop(guard);
    if result.is_ok() {
        shared.greeted.fetch_add(1, Ordering::AcqRel);
    }
    if result.is_err() {
        lock(&shared.connections).retain(|c| !Arc::ptr_eq(c, &connection));
    }
    result
}

fn hello_and_snapshot(shared: &Shared, connection: &Connection) -> Result<(), ZdsError> {
    let hello = connection.read_hello()?;
    let pods = (shared.snapshot)();
    info!(
        version = hello.version,
        pods = pods.len(),
        "ztunnel connected; sending the snapshot"
    );
    for pod in pods {
        let (payload, netns) = match pod.netns {
            Some(netns) => (
                Payload::Add(AddWorkload {
                    uid: pod.uid.clone(),
                    workload_info: Some(pod.workload),
                }),
                Some(netns),
            ),
            None => (
                Payload::Keep(KeepWorkload {
                    uid: pod.uid.clone(),
                }),
                None,
            ),
        };
        let request = WorkloadRequest {
            payload: Some(payload),
        };
        match connection.request(&request, netns.as_ref().map(AsFd::as_fd)) {
            Err(ZdsError::Refused(error)) => warn!(
                uid = pod.uid,
                error, "ztunnel refused a pod of the snapshot"
            ),
            other => other?,
        }
    }
    let sent = WorkloadRequest {
        payload: Some(Payload::SnapshotSent(SnapshotSent {})),
    };
    connection.request(&sent, None)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use nix::sys::socket::{Backlog, MsgFlags, listen, recv, send};
    use prost::Message as _;

    use super::*;
    use crate::ztunnel::{
        listener::testing::{bound_at, dialled},
        proto::{Ack, Version, WorkloadResponse, ZdsHello, workload_response},
    };

    /// Connects to `path` as ztunnel does, says hello and acks the (empty) snapshot: the
    /// server serves whoever connects at `path`.
    fn hello_and_snapshot(path: &Path) -> OwnedFd {
        let fd = dialled(path).expect("connect");
        let hello = ZdsHello {
            version: Version::V1.into(),
        };
        send(fd.as_raw_fd(), &hello.encode_to_vec(), MsgFlags::empty()).expect("hello");
        let mut buf = [0u8; 1024];
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("snapshot");
        let request = WorkloadRequest::decode(&buf[..n]).expect("a request");
        assert!(matches!(request.payload, Some(Payload::SnapshotSent(_))));
        let ack = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack::default())),
        };
        send(fd.as_raw_fd(), &ack.encode_to_vec(), MsgFlags::empty()).expect("ack");
        fd
    }

    /// Waits (bounded: a liveness check) until `path` is a socket other than `not`.
    fn wait_for_socket(path: &Path, not: Option<SocketId>) -> SocketId {
        for _ in 0..200 {
            if let Some(id) = socket_id(path).filter(|id| Some(*id) != not) {
                return id;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{} was not listened on again", path.display());
    }

    #[test]
    fn an_unlinked_or_replaced_path_is_listened_on_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztunnel.sock");
        let server = ZtunnelServer::start(&path, Vec::new, || {}).expect("server");
        let _one = hello_and_snapshot(&path);
        let first = socket_id(&path).expect("listening");

        // istio-cni's agent stopping: Go's listener close unlinks the path.
        std::fs::remove_file(&path).expect("unlink");
        let second = wait_for_socket(&path, Some(first));
        let _two = hello_and_snapshot(&path);

        // Another socket bound at the path (an agent starting there removes what it finds).
        std::fs::remove_file(&path).expect("unlink");
        let _other = bound_at(&path);
        let intruder = socket_id(&path).expect("bound");
        assert_ne!(intruder, second);
        wait_for_socket(&path, Some(intruder));
        let _three = hello_and_snapshot(&path);
        assert_eq!(
            server.connected(),
            3,
            "the earlier connections are still served"
        );

        drop(server);
        assert!(!path.exists(), "the server's own socket goes with it");
    }
    /// A server at `path` with no pods, and how many times it has yielded the path.
    fn counting_yields(path: &Path) -> (ZtunnelServer, Arc<AtomicUsize>) {
        let yields = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&yields);
        let server = ZtunnelServer::start(path, Vec::new, move || {
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .expect("server");
        (server, yields)
    }

    /// Waits (bounded: a liveness check) until the server has yielded `n` times.
    fn wait_for_yields(yields: &AtomicUsize, n: usize) {
        for _ in 0..200 {
            if yields.load(Ordering::SeqCst) >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("yielded {} times, not {n}", yields.load(Ordering::SeqCst));
    }

    /// A socket that another process (istio-cni's agent, starting on the node) listens on at
    /// the path after removing meshcap's.
    fn listening_intruder(path: &Path) -> (OwnedFd, SocketId) {
        std::fs::remove_file(path).expect("unlink");
        let fd = bound_at(path);
        listen(&fd, Backlog::new(1).expect("backlog")).expect("listen");
        (fd, socket_id(path).expect("bound"))
    }

    #[test]
    fn a_path_another_agent_listens_on_is_left_to_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztunnel.sock");
        let (server, yields) = counting_yields(&path);
        let _ztunnel = hello_and_snapshot(&path);

        let (istio, id) = listening_intruder(&path);
        wait_for_yields(&yields, 1);
        std::thread::sleep(PATH_CHECK * 3);
        assert_eq!(
            socket_id(&path),
            Some(id),
            "the path is left to the other agent"
        );
        assert_eq!(
            yields.load(Ordering::SeqCst),
            1,
            "what follows a yield ran once"
        );
        let _dialer = dialled(&path).expect("connect");
        accept4(istio.as_raw_fd(), SockFlag::SOCK_CLOEXEC).expect("the other agent is reached");
        assert_eq!(
            server.connected(),
            1,
            "the ztunnel connected before is still served"
        );
        let netns = std::fs::File::open("/proc/self/ns/net").expect("a netns");
        assert!(
            matches!(
                server.add("uid-new", WorkloadInfo::default(), netns.as_fd()),
                Err(ZdsError::Yielded)
            ),
            "a new pod is not handed to a ztunnel that will reconnect to the other agent"
        );

        // The other agent goes and unlinks the path (Go's listener close): meshcap's is back.
        std::fs::remove_file(&path).expect("unlink");
        drop(istio);
        let back = wait_for_socket(&path, Some(id));
        let _again = hello_and_snapshot(&path);
        assert_eq!(server.connected(), 2);

        // Another agent listening there when meshcap's stops keeps its path.
        let (_istio, id) = listening_intruder(&path);
        assert_ne!(id, back);
        wait_for_yields(&yields, 2);
        drop(server);
        assert_eq!(
            socket_id(&path),
            Some(id),
            "another agent's path is not unlinked"
        );
    }

    /// An agent started (restarted) while another listens at the path leaves it to it from the
    /// start, and listens there once the other has gone.
    #[test]
    fn an_agent_started_beside_another_listening_leaves_it_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztunnel.sock");
        std::fs::write(&path, b"").expect("a file to replace");
        let (istio, id) = listening_intruder(&path);
        let (server, yields) = counting_yields(&path);
        wait_for_yields(&yields, 1);
        std::thread::sleep(PATH_CHECK * 3);
        assert_eq!(
            socket_id(&path),
            Some(id),
            "the other agent's path is left to it"
        );
        assert_eq!(yields.load(Ordering::SeqCst), 1);

        std::fs::remove_file(&path).expect("unlink");
        drop(istio);
        // Listened on again: the new file may reuse the old one's inode (ext4 does), so the
        // path is dialled rather than compared.
        let mut reached = false;
        for _ in 0..200 {
            if dialled(&path).is_ok() {
                reached = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(reached, "{} was not listened on again", path.display());
        let _ztunnel = hello_and_snapshot(&path);
        assert_eq!(server.connected(), 1);
    }
}
