//! Telling a guest whose vCPUs are stuck from one that is only quiet. A vCPU that keeps
//! interrupts off takes no timer, so the guest's own lock-up detectors never report it and
//! the console just goes silent until the run's timeout. While the console is quiet, the
//! runner samples every vCPU through QEMU's monitor (`info registers -a`): interrupts off on
//! every vCPU in every sample for [`STUCK_FOR`] is a hard lock-up.
//!
//! The emulator's own such lock-up (docs/development.md, "Emulator faults") has the vCPUs
//! trapping on an `int3` the kernel has already patched away, again and again: the guest's
//! init prints where the kernel's `int3` handling lives ([`INT3_PATH`], from `/proc/kallsyms`),
//! so that a sample inside it says which lock-up this is.
use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// What the guest's init prints before the ranges of the kernel's `int3` handling
/// (`asm_exc_int3`, `exc_int3`, `poke_int3_handler`), as `START-END` in hexadecimal.
pub const INT3_PATH: &str = "meshcap-vm: int3 path:";

/// How long every vCPU must be seen with interrupts off to be taken as locked up.
pub const STUCK_FOR: Duration = Duration::from_secs(30);

/// How long the console must be quiet before the vCPUs are sampled, and how often they are.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// One vCPU as the monitor shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpu {
    /// The instruction pointer.
    pub rip: u64,
    /// Whether it takes interrupts (RFLAGS.IF).
    pub interrupts: bool,
}

/// QEMU's human monitor on a Unix socket (`-monitor unix:PATH,server,nowait`).
pub struct Monitor(PathBuf);

impl Monitor {
    /// The monitor at `path`.
    pub fn at(path: &Path) -> Self {
        Self(path.to_owned())
    }

    /// Every vCPU's registers now; `None` when the monitor does not answer.
    pub fn sample(&self) -> Option<Vec<Cpu>> {
        let mut socket = UnixStream::connect(&self.0).ok()?;
        socket
            .set_read_timeout(Some(Duration::from_millis(500)))
            .ok()?;
        socket.write_all(b"info registers -a\n").ok()?;
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut text = Vec::new();
        let mut buf = [0_u8; 8192];
        // The greeting's prompt, then the answer's, ends it.
        while Instant::now() < deadline
            && String::from_utf8_lossy(&text).matches("(qemu)").count() < 2
        {
            match socket.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => text.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        let cpus = registers(&String::from_utf8_lossy(&text));
        (!cpus.is_empty()).then_some(cpus)
    }
}

/// The vCPUs in `info registers -a`'s answer (`RIP=… RFL=…` lines).
pub fn registers(text: &str) -> Vec<Cpu> {
    text.lines()
        .filter_map(|line| {
            let hex = |key: &str| {
                let (_, rest) = line.split_once(key)?;
                let digits = rest.split_whitespace().next()?;
                u64::from_str_radix(digits, 16).ok()
            };
            let (rip, flags) = (hex("RIP=")?, hex("RFL=")?);
            Some(Cpu {
                rip,
                interrupts: flags & 0x200 != 0,
            })
        })
        .collect()
}

/// Where the kernel handles `int3`, as the guest's init printed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Int3Path(Vec<(u64, u64)>);

impl Int3Path {
    /// The ranges in `line` (after [`INT3_PATH`]); `None` when it is not that line.
    pub fn parse(line: &str) -> Option<Self> {
        let (_, ranges) = line.split_once(INT3_PATH)?;
        let ranges = ranges
            .split_whitespace()
            .filter_map(|range| {
                let (start, end) = range.split_once('-')?;
                Some((
                    u64::from_str_radix(start, 16).ok()?,
                    u64::from_str_radix(end, 16).ok()?,
                ))
            })
            .collect();
        Some(Self(ranges))
    }

    fn contains(&self, rip: u64) -> bool {
        self.0
            .iter()
            .any(|&(start, end)| (start..end).contains(&rip))
    }
}

/// The samples taken while the console is quiet.
#[derive(Default)]
pub struct Stuck {
    since: Option<Instant>,
    in_int3: bool,
}

/// A hard lock-up, as the samples show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HardLockup {
    /// A sample had a vCPU in the kernel's `int3` handling.
    pub in_int3: bool,
}

impl Stuck {
    /// Takes one sample (taken at `now`); a hard lock-up once every vCPU has had interrupts off
    /// in every sample for [`STUCK_FOR`]. A sample with any vCPU taking interrupts starts over.
    pub fn observe(&mut self, cpus: &[Cpu], path: &Int3Path, now: Instant) -> Option<HardLockup> {
        if cpus.is_empty() || cpus.iter().any(|cpu| cpu.interrupts) {
            *self = Self::default();
            return None;
        }
        let since = *self.since.get_or_insert(now);
        self.in_int3 |= cpus.iter().any(|cpu| path.contains(cpu.rip));
        (now.duration_since(since) >= STUCK_FOR).then_some(HardLockup {
            in_int3: self.in_int3,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_are_read_off_the_monitor() {
        // Sampled from the 6.1 guest of docs/development.md ("Emulator faults").
        let text = "QEMU 7.2.22 monitor - type 'help' for more information\r\n(qemu) info \
                    registers -a\r\n\r\nCPU#0\r\nRAX=0000000000000000 RBX=ffff888003e3c000\r\n\
                    RIP=ffffffff81a04ffe RFL=00000046 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\r\n\
                    \r\nCPU#1\r\nRIP=ffffffff810e1725 RFL=00000202 [-------] CPL=0 II=0\r\n(qemu) ";
        assert_eq!(
            registers(text),
            [
                Cpu {
                    rip: 0xffff_ffff_81a0_4ffe,
                    interrupts: false
                },
                Cpu {
                    rip: 0xffff_ffff_810e_1725,
                    interrupts: true
                },
            ]
        );
    }

    #[test]
    fn only_interrupts_off_everywhere_for_long_enough_is_a_lockup() {
        let path = Int3Path::parse("meshcap-vm: int3 path: ffffffff81c00ba0-ffffffff81c00be0 x")
            .expect("the line");
        let off = |rip| Cpu {
            rip,
            interrupts: false,
        };
        let start = Instant::now();
        let mut stuck = Stuck::default();
        let spinning = [off(0x1000), off(0x2000)];
        assert_eq!(stuck.observe(&spinning, &path, start), None);
        assert_eq!(
            stuck.observe(&[off(0xffff_ffff_81c0_0bca), off(0x2000)], &path, start),
            None
        );
        // One vCPU took interrupts: not stuck, start over.
        let one_on = [
            off(0x1000),
            Cpu {
                rip: 0x2000,
                interrupts: true,
            },
        ];
        assert_eq!(stuck.observe(&one_on, &path, start + STUCK_FOR), None);
        assert_eq!(stuck.observe(&spinning, &path, start + STUCK_FOR), None);
        assert_eq!(
            stuck.observe(&spinning, &path, start + STUCK_FOR * 2),
            Some(HardLockup { in_int3: false })
        );
        let mut trapping = Stuck::default();
        trapping.observe(&[off(0xffff_ffff_81c0_0bca), off(0x2000)], &path, start);
        assert_eq!(
            trapping.observe(&spinning, &path, start + STUCK_FOR),
            Some(HardLockup { in_int3: true })
        );
    }
}
