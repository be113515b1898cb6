//! The programs' own log records (aya-log), forwarded to the agent's logs from a dedicated
//! thread that sleeps in `poll(2)` on the pinned ring buffer.
use std::os::fd::AsFd as _;

use aya::Ebpf;

use super::EbpfError;

/// aya-log's reader of the kernel-side records, writing them to `log` (bridged to `tracing`).
pub(super) type KernelLog = aya_log::EbpfLogger<&'static dyn log::Log>;

/// The reader of `ebpf`'s ring buffer, or `None` (logged) when the object has none.
pub(super) fn reader(ebpf: &mut Ebpf) -> Option<KernelLog> {
    aya_log::EbpfLogger::init(ebpf)
        .map_err(|e| tracing::warn!(error = %e, "kernel-side log records unavailable"))
        .ok()
}

/// Forwards `logger`'s records from a new thread, until `poll` fails.
pub(super) fn forward(mut logger: KernelLog) -> Result<(), EbpfError> {
    std::thread::Builder::new()
        .name("kernel-log".into())
        .spawn(move || {
            loop {
                let mut fds = [nix::poll::PollFd::new(
                    logger.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => logger.flush(),
                    Err(err) => {
                        tracing::warn!(error = %err, "kernel-side log records: poll failed");
                        return;
                    }
                }
            }
        })
        .map(|_| ())
        .map_err(|e| EbpfError::io("starting the kernel-log thread", e))
}
