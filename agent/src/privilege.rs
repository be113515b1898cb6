//! Which capability a refused operation lacks. The kernel answers a missing capability with
//! `EPERM` and nothing more; this names the capability the operation needs, whether this
//! process holds it (its effective set), and the likely cause when it does: `RLIMIT_MEMLOCK`
//! on kernels before 5.11, which charge BPF maps to it, or a security module. Checked at start
//! for what every backend needs ([`missing`]), and wherever a privileged operation fails
//! ([`explain`]): loading the programs, creating their maps, entering a pod's network namespace.
use std::{error::Error, fmt, io};

/// A capability the agent is given (docs/install.md, "What gets installed").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    /// `CAP_NET_ADMIN`.
    NetAdmin,
    /// `CAP_NET_RAW`.
    NetRaw,
    /// `CAP_SYS_ADMIN`.
    SysAdmin,
    /// `CAP_SYS_RESOURCE`.
    SysResource,
    /// `CAP_BPF`.
    Bpf,
}

impl Capability {
    /// Its bit in the capability sets (`linux/capability.h`).
    const fn bit(self) -> u32 {
        match self {
            Self::NetAdmin => 12,
            Self::NetRaw => 13,
            Self::SysAdmin => 21,
            Self::SysResource => 24,
            Self::Bpf => 39,
        }
    }

    /// Whether the set `caps` holds it.
    #[must_use]
    pub const fn in_set(self, caps: u64) -> bool {
        (caps >> self.bit()) & 1 == 1
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NetAdmin => "CAP_NET_ADMIN",
            Self::NetRaw => "CAP_NET_RAW",
            Self::SysAdmin => "CAP_SYS_ADMIN",
            Self::SysResource => "CAP_SYS_RESOURCE",
            Self::Bpf => "CAP_BPF",
        })
    }
}

/// This process's effective capabilities (`CapEff` in `/proc/self/status`).
///
/// # Errors
/// When the file cannot be read or has no such line.
pub fn effective() -> io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no CapEff in /proc/self/status"))
}

/// A privileged operation the agent makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// Loading a BPF program or creating a BPF map (`bpf()`): `bpf_capable()`, and for the
    /// networking program types `CAP_NET_ADMIN` too; `CAP_SYS_ADMIN` grants both.
    Bpf,
    /// Entering a pod's network namespace (`setns()`), mounting bpffs or cgroup2.
    Namespace,
}

impl Operation {
    /// Sets of capabilities any one of which permits it.
    const fn needs(self) -> &'static [&'static [Capability]] {
        match self {
            Self::Bpf => &[
                &[Capability::SysAdmin],
                &[Capability::Bpf, Capability::NetAdmin],
            ],
            Self::Namespace => &[&[Capability::SysAdmin]],
        }
    }
}

/// What the chart adds for an operation, and what the agent needs at all: every backend enters
/// pods' network namespaces and writes their rules or filters.
pub const NEEDED: &[(Capability, &str)] = &[
    (
        Capability::SysAdmin,
        "entering pods' network namespaces, the kernel programs, mounting bpffs",
    ),
    (
        Capability::NetAdmin,
        "TC filters, iptables and nftables rules, the networking programs",
    ),
];

/// Of [`NEEDED`], what the effective set `caps` lacks, in one line (`None`: nothing).
#[must_use]
pub fn missing(caps: u64) -> Option<String> {
    let lacking: Vec<String> = NEEDED
        .iter()
        .filter(|(cap, _)| !cap.in_set(caps))
        .map(|(cap, why)| format!("{cap} ({why})"))
        .collect();
    (!lacking.is_empty()).then(|| {
        format!(
            "the agent lacks {}: the DaemonSet adds it, so the runtime or a policy (an admission \
             policy, a hardened runtime's bounding set) removed it",
            lacking.join(" and ")
        )
    })
}

/// Whether `err`, or an error it wraps, is the kernel's `EPERM`.
#[must_use]
pub fn is_eperm(err: &(dyn Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<io::Error>()
            && io.raw_os_error() == Some(libc::EPERM)
        {
            return true;
        }
        if let Some(errno) = err.downcast_ref::<nix::Error>()
            && *errno == nix::Error::EPERM
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// What the node says about a refused [`Operation::Bpf`] beyond capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memlock {
    /// The kernel is older than 5.11 (BPF maps charged to `RLIMIT_MEMLOCK`).
    pub charged: bool,
    /// The soft limit, bytes (`None`: unlimited or unknown).
    pub limit: Option<u64>,
}

impl Memlock {
    /// This node's and this process's.
    #[must_use]
    pub fn here() -> Self {
        let charged = aya::util::KernelVersion::current()
            .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 11, 0));
        let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
            .ok()
            .map(|(soft, _)| soft)
            .filter(|soft| *soft != libc::RLIM_INFINITY);
        Self { charged, limit }
    }
}

/// Why `op` was refused with `EPERM`, given the effective set `caps` and `memlock`: the
/// capability lacking, or when none is, the likely cause.
#[must_use]
pub fn why(op: Operation, caps: u64, memlock: Memlock) -> String {
    let needs = op.needs();
    if !needs
        .iter()
        .any(|set| set.iter().all(|cap| cap.in_set(caps)))
    {
        let each: Vec<String> = needs
            .iter()
            .map(|set| {
                set.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" with ")
            })
            .collect();
        return format!(
            "operation not permitted: the agent lacks {} (the DaemonSet adds CAP_SYS_ADMIN and \
             CAP_NET_ADMIN: the runtime or a policy removed them)",
            each.join(", or ")
        );
    }
    if op == Operation::Bpf && memlock.charged {
        let limit = memlock
            .limit
            .map_or_else(|| "unknown".to_owned(), |l| format!("{} KiB", l / 1024));
        let fix = if Capability::SysResource.in_set(caps) {
            "raise the runtime's memlock limit (LimitMEMLOCK of containerd's or CRI-O's unit)"
        } else {
            "set the chart's meshcap.sysResource=true (CAP_SYS_RESOURCE, to raise it)"
        };
        return format!(
            "operation not permitted: this kernel (before 5.11) charges BPF maps to \
             RLIMIT_MEMLOCK ({limit}), which the agent could not raise: {fix}"
        );
    }
    "operation not permitted although the agent holds the capabilities it needs: a seccomp \
     profile, AppArmor or SELinux, or kernel lockdown refused it"
        .to_owned()
}

/// [`why`] for this process, when `err` is an `EPERM`.
#[must_use]
pub fn explain(op: Operation, err: &(dyn Error + 'static)) -> Option<String> {
    if !is_eperm(err) {
        return None;
    }
    Some(match effective() {
        Ok(caps) => why(op, caps, Memlock::here()),
        Err(read) => format!("operation not permitted (its capabilities unknown: {read})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 = (1 << 41) - 1;

    fn without(caps: &[Capability]) -> u64 {
        caps.iter().fold(ALL, |set, cap| set & !(1 << cap.bit()))
    }

    const NEW: Memlock = Memlock {
        charged: false,
        limit: Some(8 << 20),
    };

    #[test]
    fn each_refusal_names_what_is_lacking_or_the_likely_cause() {
        let rows: &[(Operation, u64, Memlock, &str)] = &[
            (
                Operation::Bpf,
                without(&[Capability::SysAdmin, Capability::Bpf]),
                NEW,
                "lacks CAP_SYS_ADMIN, or CAP_BPF with CAP_NET_ADMIN",
            ),
            // CAP_BPF alone does not load networking programs.
            (
                Operation::Bpf,
                without(&[Capability::SysAdmin, Capability::NetAdmin]),
                NEW,
                "lacks CAP_SYS_ADMIN, or CAP_BPF with CAP_NET_ADMIN",
            ),
            (Operation::Bpf, without(&[Capability::Bpf]), NEW, "seccomp"),
            (
                Operation::Namespace,
                without(&[Capability::SysAdmin]),
                NEW,
                "lacks CAP_SYS_ADMIN (",
            ),
            (
                Operation::Bpf,
                without(&[Capability::SysResource]),
                Memlock {
                    charged: true,
                    limit: Some(64 << 10),
                },
                "RLIMIT_MEMLOCK (64 KiB), which the agent could not raise: set the chart's \
                 meshcap.sysResource=true",
            ),
            (
                Operation::Bpf,
                ALL,
                Memlock {
                    charged: true,
                    limit: Some(64 << 10),
                },
                "LimitMEMLOCK",
            ),
            // Memlock has nothing to do with entering a namespace.
            (
                Operation::Namespace,
                ALL,
                Memlock {
                    charged: true,
                    limit: None,
                },
                "seccomp",
            ),
        ];
        for (op, caps, memlock, says) in rows {
            let why = why(*op, *caps, *memlock);
            assert!(why.contains(says), "{op:?} {caps:x}: {why}");
        }
    }

    #[test]
    fn only_what_every_backend_needs_is_missing() {
        assert_eq!(missing(ALL), None);
        assert_eq!(
            missing(without(&[Capability::SysResource, Capability::Bpf])),
            None
        );
        let why = missing(without(&[Capability::NetAdmin])).expect("missing");
        assert!(
            why.contains("CAP_NET_ADMIN (") && !why.contains("CAP_SYS_ADMIN"),
            "{why}"
        );
    }

    #[test]
    fn an_eperm_is_found_under_the_errors_wrapping_it() {
        #[derive(Debug, thiserror::Error)]
        #[error("loading")]
        struct Wrapper(#[source] io::Error);
        assert!(is_eperm(&Wrapper(io::Error::from_raw_os_error(
            libc::EPERM
        ))));
        assert!(!is_eperm(&Wrapper(io::Error::from_raw_os_error(
            libc::EACCES
        ))));
        assert!(is_eperm(&nix::Error::EPERM));
    }
}
