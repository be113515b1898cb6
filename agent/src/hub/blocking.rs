//! How the hub runs its work: blocking backend calls on the request's own thread
//! ([`off_the_runtime`]), and one request at a time per container ([`Locks`]).
use std::{
    collections::HashMap,
    panic::{self, AssertUnwindSafe},
    sync::{Arc, Mutex},
};

use tokio::runtime::{Handle, RuntimeFlavor};

use super::CaptureError;

/// Runs blocking work (netns visits, netlink, BPF, iptables-restore) for async code, in the
/// caller's span. On a multi-thread runtime (the agent's) the calling worker does it itself
/// (`block_in_place`: the worker's other tasks move to another thread), so a request is not
/// handed to the blocking pool and back: on a busy node each hand-over is a wait for a CPU
/// (BENCHMARKS.md, pod set-up with the machine busy). A current-thread runtime cannot spare its
/// thread: there the work goes to the blocking pool. Either way the work is not interrupted
/// once it runs (the request timeout bounds the waits around it), and a panic in it is this
/// request's internal error.
pub(super) async fn off_the_runtime<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, CaptureError> {
    let span = tracing::Span::current();
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        return tokio::task::block_in_place(|| {
            panic::catch_unwind(AssertUnwindSafe(|| span.in_scope(f)))
        })
        .map_err(|_| CaptureError::Task("it panicked".to_owned()));
    }
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| CaptureError::Task(e.to_string()))
}

/// One lock per container with requests in flight: its requests run one at a time.
#[derive(Default)]
pub(super) struct Locks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Locks {
    /// Runs `work` holding the lock of `container_id`.
    pub(super) async fn run<T>(&self, container_id: &str, work: impl Future<Output = T>) -> T {
        let lock = self
            .entries()
            .entry(container_id.to_owned())
            .or_default()
            .clone();
        let out = {
            let _guard = lock.lock().await;
            work.await
        };
        let mut locks = self.entries();
        // Drop the entry when nobody else waits on it (the map holds one reference, we another).
        if locks
            .get(container_id)
            .is_some_and(|l| Arc::strong_count(l) <= 2)
        {
            locks.remove(container_id);
        }
        out
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
