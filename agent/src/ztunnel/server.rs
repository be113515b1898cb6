//! The agent's end of ZDS: the listening socket, the connected ztunnels, the snapshot each new
//! one is sent, and the adds and deletes that follow.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use nix::sys::socket::{
    AddressFamily, Backlog, Shutdown, SockFlag, SockType, UnixAddr, accept4, bind, listen,
    shutdown, socket,
};
use tracing::{info, warn};

use super::{
    ZdsError,
    conn::Connection,
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

struct Shared {
    /// Connected ztunnels, oldest first. Each connection's lock pairs a request with its ack.
    connections: Mutex<Vec<Arc<Mutex<Connection>>>>,
    snapshot: Box<Snapshot>,
    /// The ztunnels sent their snapshot so far.
    greeted: AtomicU64,
}

/// The ZDS socket and the ztunnels connected to it. Dropping it closes the socket.
pub struct ZtunnelServer {
    shared: Arc<Shared>,
    listener: Arc<OwnedFd>,
    path: PathBuf,
    acceptor: Option<JoinHandle<()>>,
}

impl ZtunnelServer {
    /// Listens at `path` (replacing a stale socket there) and serves every ztunnel that
    /// connects, each first sent what `snapshot` returns.
    ///
    /// # Errors
    /// The socket cannot be created.
    pub fn start(
        path: &Path,
        snapshot: impl Fn() -> Vec<Enrolled> + Send + Sync + 'static,
    ) -> Result<Self, ZdsError> {
        match std::fs::remove_file(path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(ZdsError::Io(err));
            }
            _ => {}
        }
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(ZdsError::io)?;
        bind(
            listener.as_raw_fd(),
            &UnixAddr::new(path).map_err(ZdsError::io)?,
        )
        .map_err(ZdsError::io)?;
        listen(&listener, Backlog::new(8).map_err(ZdsError::io)?).map_err(ZdsError::io)?;
        let shared = Arc::new(Shared {
            connections: Mutex::new(Vec::new()),
            snapshot: Box::new(snapshot),
            greeted: AtomicU64::new(0),
        });
        let listener = Arc::new(listener);
        let acceptor = {
            let (shared, listener) = (Arc::clone(&shared), Arc::clone(&listener));
            std::thread::Builder::new()
                .name("ztunnel-accept".to_owned())
                .spawn(move || accept_loop(&shared, &listener))
                .map_err(ZdsError::Io)?
        };
        info!(socket = %path.display(), "serving ztunnel");
        Ok(Self {
            shared,
            listener,
            path: path.to_owned(),
            acceptor: Some(acceptor),
        })
    }

    /// Hands a pod to the newest ztunnel and waits for its ack: ztunnel then serves the pod
    /// (its listeners are open in `netns`).
    ///
    /// # Errors
    /// No ztunnel is connected, or it refused or did not answer.
    pub fn add(
        &self,
        uid: &str,
        workload: WorkloadInfo,
        netns: BorrowedFd<'_>,
    ) -> Result<(), ZdsError> {
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

    /// Tells every connected ztunnel that a pod is gone.
    ///
    /// # Errors
    /// A connected ztunnel refused or did not answer (the others were still told).
    pub fn delete(&self, uid: &str) -> Result<(), ZdsError> {
        let request = WorkloadRequest {
            payload: Some(Payload::Del(DelWorkload {
                uid: uid.to_owned(),
            })),
        };
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
        // Wakes the blocked accept(2) with an error, which ends the loop.
        let _ = shutdown(self.listener.as_raw_fd(), Shutdown::Both);
        if let Some(acceptor) = self.acceptor.take() {
            drop(acceptor.join());
        }
        drop(std::fs::remove_file(&self.path));
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        let socket = match accept4(listener.as_fd().as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            // SAFETY: accept4 returned a new descriptor that nothing else owns.
            Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::ECONNABORTED) => continue,
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
