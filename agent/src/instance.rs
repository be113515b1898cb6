//! One agent at a time per state directory. The capture backends' state has a single writer
//! (the eBPF backend indexes its maps in memory, the iptables backend records the rules it
//! applied), so `meshcap-agent run` holds an exclusive lock on its state directory for as long
//! as it lives. A second agent on the same directory (an operator's `run` beside the
//! DaemonSet's, or a new agent whose predecessor is still shutting down) waits until the first
//! has exited before it touches anything; the kernel releases the lock with the process,
//! however it ends (SIGKILL included).
use std::{
    fs::{self, File},
    io,
    path::Path,
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

/// The held lock: released when dropped, or when the process ends.
pub struct Exclusive(#[expect(dead_code, reason = "held for its Drop")] Flock<File>);

/// Takes the lock on `dir` (created if missing). When another process holds it, calls
/// `waiting` once, then blocks until that process lets go.
///
/// # Errors
/// When the directory cannot be created or opened, or the kernel refuses the lock.
pub fn lock(dir: &Path, waiting: impl FnOnce()) -> io::Result<Exclusive> {
    fs::create_dir_all(dir)?;
    // A directory opened read-only; `File::open` sets O_CLOEXEC, so the iptables tools the
    // agent runs never inherit (and never hold) the lock.
    let file = File::open(dir)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(Exclusive(held)),
        Err((file, Errno::EWOULDBLOCK)) => {
            waiting();
            Flock::lock(file, FlockArg::LockExclusive)
                .map(Exclusive)
                .map_err(|(_, errno)| errno.into())
        }
        Err((_, errno)) => Err(errno.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn a_second_holder_waits_for_the_first() {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let dir = tmp.path().join("state");
        let first = lock(&dir, || panic!("nobody holds it yet")).expect("first lock");
        let (told, waits) = mpsc::channel();
        let (took, taken) = mpsc::channel();
        let second = std::thread::spawn({
            let dir = dir.clone();
            move || {
                let held = lock(&dir, move || told.send(()).expect("waiting")).expect("lock");
                took.send(()).expect("taken");
                held
            }
        });
        waits.recv().expect("the second holder is told it waits");
        assert!(
            taken.try_recv().is_err(),
            "the second holder must not have the lock while the first holds it"
        );
        drop(first);
        taken
            .recv()
            .expect("the second holder gets the lock once the first lets go");
        drop(second.join().expect("second holder"));
    }
}
