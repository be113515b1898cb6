//! The kernel release, for the one behaviour meshcap cannot ask the kernel about without a
//! throwaway network: whether `bpf_sk_assign` takes `SO_REUSEPORT` listeners.

/// Whether `bpf_sk_assign` can hand a connection to a listener with `SO_REUSEPORT` (ztunnel's
/// listeners have it, as do Envoy's by default): before Linux 6.5 it refuses such sockets
/// (`-ESOCKTNOSUPPORT`; torvalds/linux 9c02bec95954, "bpf, net: Support SO_REUSEPORT sockets
/// with bpf_sk_assign"). The agent's one answer that is the kernel's version, not the kernel's
/// own behaviour: the symbol that series exported (`inet_lookup_reuseport`) was tried first and
/// is in Debian's 6.1 as well, whose `bpf_sk_assign` still refuses (found in the 6.1 VM). A
/// kernel with the support backported is answered no: the safe side (only the agent's log line
/// says it; every pod gets the socket lookup, which takes such listeners on every kernel, and
/// the classifier falls back on it when `bpf_sk_assign` refuses, whatever this says).
///
/// # Errors
/// When `/proc/sys/kernel/osrelease` cannot be read or does not start with a version.
pub fn assigns_to_reuseport_listeners() -> std::io::Result<bool> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let version = release_version(&release).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("kernel release {:?} has no version", release.trim()),
        )
    })?;
    Ok(version >= (6, 5))
}

/// Which captured SYNs go through the socket lookup program (`sk_lookup`) that every captured
/// pod's netns gets, which takes inbound connections to the proxy where `bpf_sk_assign` cannot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Handoff {
    /// Those `bpf_sk_assign` cannot hand over: to a `SO_REUSEPORT` listener before Linux 6.5
    /// ([`assigns_to_reuseport_listeners`]; the classifier finds out by the refusal), and on
    /// every kernel a SYN whose 4-tuple a `TIME_WAIT` socket holds.
    #[default]
    Auto,
    /// Every captured SYN: for benchmarks only (the agent's
    /// hidden `--handoff always`), so that the hand-off's cost can be measured on a kernel
    /// that never needs it.
    Always,
}

impl Handoff {
    /// The flags a pod's config gets.
    pub(super) const fn pod_flags(self) -> u32 {
        match self {
            Self::Auto => meshcap_common::flags::HANDOFF,
            Self::Always => meshcap_common::flags::HANDOFF | meshcap_common::flags::HANDOFF_ALWAYS,
        }
    }
}

/// The major and minor version a kernel release (`6.1.0-56-cloud-amd64`) starts with.
fn release_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::release_version;

    #[test]
    fn a_release_reads_as_its_major_and_minor_version() {
        assert_eq!(release_version("6.1.0-56-cloud-amd64\n"), Some((6, 1)));
        assert_eq!(release_version("6.18.44-fc-v595"), Some((6, 18)));
        assert_eq!(release_version("6.5-rc1"), Some((6, 5)));
        assert_eq!(release_version("5.10.257"), Some((5, 10)));
        assert_eq!(release_version("garbage"), None);
    }
}
