//! One agent at a time per state directory. The capture backends' state has a single writer
//! (the eBPF backend indexes its maps in memory, the iptables backend records the rules it
//! applied), so `meshcap-agent run` holds an exclusive lock on its state directory for as long
//! as it lives. A second agent on the same directory (an operator's `run` beside the
//! DaemonSet's, or a new agent whose predecessor is still shutting down) waits until the first
//! has exited before it touches anything, trying again every so often so that a SIGTERM can
//! end the wait; the kernel releases the lock with the process, however it ends (SIGKILL
//! included).
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

/// Takes the lock on `dir` (created if missing) when nobody holds it; `None` while another
/// process does. The agent polls, so that a SIGTERM while it waits ends the wait.
///
/// # Errors
/// When the directory cannot be created or opened, or the kernel refuses the lock.
pub fn try_lock(dir: &Path) -> io::Result<Option<Exclusive>> {
    fs::create_dir_all(dir)?;
    // A directory opened read-only; `File::open` sets O_CLOEXEC, so the iptables tools the
    // agent runs never inherit (and never hold) the lock.
    let file = File::open(dir)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(Some(Exclusive(held))),
        Err((_, Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(errno.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_gets_the_lock_only_once_the_first_lets_go() {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let dir = tmp.path().join("state");
        let first = try_lock(&dir)
            .expect("first lock")
            .expect("nobody holds it yet");
        assert!(
            try_lock(&dir).expect("second try").is_none(),
            "the second holder must not have the lock while the first holds it"
        );
        drop(first);
        assert!(
            try_lock(&dir).expect("third try").is_some(),
            "the lock is free once the first lets go"
        );
    }
}
