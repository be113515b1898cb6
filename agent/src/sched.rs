//! The agent asks the scheduler for a short slice, so that on a busy node it runs as soon as a
//! request wakes it instead of after a busy pod's turn.
//!
//! A pod's ADD is a chain of short wake-ups: the runtime starts the plugin, the plugin asks
//! the agent, the agent (and, with the iptables backend, `iptables-restore`) works and
//! answers. On a node whose pods keep the CPUs busy, each wake-up can wait for a running
//! task's slice to end. Since Linux 6.12 a fair-class task may ask for a shorter slice
//! (`sched_attr.sched_runtime`); EEVDF gives a task that wakes with a shorter slice an earlier
//! deadline, so it preempts. The share of CPU time is unchanged (that is the weight's); only
//! the order changes. Earlier kernels ignore the field, and so does this: nothing else is
//! touched (policy and nice stay as the caller set them; a real-time policy is left alone).
//! Threads and processes started afterwards inherit the slice. The plugin does not ask: with
//! both ends short they preempt each other on every hand-over, and a quiet node's ADD got
//! slower (BENCHMARKS.md, session 12).
#![expect(
    unsafe_code,
    reason = "sched_getattr and sched_setattr have no safe wrapper"
)]

use std::{io, mem};

/// The slice asked for: the kernel's minimum (it clamps to 0.1–100 ms), as for any task that
/// runs briefly and often.
pub const SHORT_SLICE_NS: u64 = 100_000;

/// Asks for [`SHORT_SLICE_NS`] for the calling thread, keeping its policy and nice value.
///
/// # Errors
/// When the kernel refuses to read or set the thread's scheduling attributes.
pub fn ask_for_short_slice() -> io::Result<()> {
    let mut attr = attributes(0)?;
    if !matches!(
        i32::try_from(attr.sched_policy),
        Ok(libc::SCHED_OTHER | libc::SCHED_BATCH)
    ) {
        return Ok(());
    }
    attr.size = size();
    attr.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    attr.sched_runtime = SHORT_SLICE_NS;
    // SAFETY: `attr` is a valid `sched_attr` of the size it declares; 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The slice a thread (`tid`, 0 for the caller) runs with, in ns, as the kernel reports it:
/// `None` on kernels that report no slice for fair-class tasks (before Linux 6.12).
///
/// # Errors
/// When the kernel refuses to read the thread's scheduling attributes.
pub fn slice_ns(tid: i32) -> io::Result<Option<u64>> {
    let attr = attributes(tid)?;
    Ok((attr.sched_runtime != 0).then_some(attr.sched_runtime))
}

fn attributes(tid: i32) -> io::Result<libc::sched_attr> {
    // SAFETY: all-zero is a valid `sched_attr` (plain integers).
    let mut attr: libc::sched_attr = unsafe { mem::zeroed() };
    // SAFETY: the kernel writes at most `size()` bytes into `attr`.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, tid, &raw mut attr, size(), 0) };
    if rc == 0 {
        Ok(attr)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[expect(clippy::cast_possible_truncation, reason = "48 bytes")]
const fn size() -> u32 {
    mem::size_of::<libc::sched_attr>() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_asks_gets_the_short_slice_where_the_kernel_has_slices() {
        std::thread::spawn(|| {
            let before = slice_ns(0).unwrap();
            // SAFETY: getpriority takes no pointer; 0 is the calling thread.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            ask_for_short_slice().unwrap();
            let after = slice_ns(0).unwrap();
            match before {
                // Linux 6.12 and later report every fair task's slice.
                Some(_) => assert_eq!(after, Some(SHORT_SLICE_NS)),
                None => assert_eq!(after, None),
            }
            // SAFETY: as above.
            let nice_after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            assert_eq!(nice_after, nice);
        })
        .join()
        .unwrap();
    }
}
