//! Telling a guest whose vCPUs are stuck from one that is only quiet. A vCPU that keeps
//! interrupts off takes no timer, so the guest's own lock-up detectors never report it and
//! the console just goes silent until the run's timeout. While the console is quiet, the
//! runner samples every vCPU through QEMU's monitor (`info registers -a`): interrupts off on
//! every vCPU in every sample for [`STUCK_FOR`] is a hard lock-up. On x86 "off" is RFLAGS.IF
//! clear, on arm64 PSTATE.I set (IRQs masked; Debian's arm64 kernel masks them there unless
//! booted with pseudo-NMIs, which these guests are not).
//!
//! The emulator's own such lock-up (docs/development.md, "Emulator faults"), an x86 guest's,
//! has the vCPUs trapping on an `int3` the kernel has already patched away, again and again:
//! the guest's init prints where the kernel's `int3` handling lives ([`INT3_PATH`], from
//! `/proc/kallsyms`), so that a sample inside it says which lock-up this is. An arm64 guest
//! prints no such path: every hard lock-up there fails the run.
use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::arch::Arch;

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
    /// The instruction pointer (RIP, PC).
    pub pc: u64,
    /// Whether it takes interrupts (RFLAGS.IF set, PSTATE.I clear).
    pub interrupts: bool,
}

/// QEMU's human monitor on a Unix socket (`-monitor unix:PATH,server,nowait`) of a guest of
/// one architecture.
pub struct Monitor(PathBuf, Arch);

impl Monitor {
    /// The monitor at `path`.
    pub fn at(path: &Path, arch: Arch) -> Self {
        Self(path.to_owned(), arch)
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
        let cpus = registers(self.1, &String::from_utf8_lossy(&text));
        (!cpus.is_empty()).then_some(cpus)
    }
}

/// The vCPUs in `info registers -a`'s answer: x86's `RIP=… RFL=…` lines, or arm64's `PC=…`
/// line followed, further down each vCPU's dump, by its `PSTATE=…`.
pub fn registers(arch: Arch, text: &str) -> Vec<Cpu> {
    let hex = |line: &str, key: &str| {
        let (before, rest) = line.split_once(key)?;
        // `PC=` must not match the end of another register's name.
        if before.ends_with(|c: char| c.is_ascii_alphanumeric()) {
            return None;
        }
        let digits = rest.split_whitespace().next()?;
        u64::from_str_radix(digits, 16).ok()
    };
    match arch {
        Arch::Amd64 => text
            .lines()
            .filter_map(|line| {
                let (pc, flags) = (hex(line, "RIP=")?, hex(line, "RFL=")?);
                Some(Cpu {
                    pc,
                    interrupts: flags & 0x200 != 0,
                })
            })
            .collect(),
        Arch::Arm64 => {
            let mut cpus = Vec::new();
            let mut pc = None;
            for line in text.lines() {
                if let Some(at) = hex(line, "PC=") {
                    pc = Some(at);
                }
                if let (Some(at), Some(pstate)) = (pc, hex(line, "PSTATE=")) {
                    cpus.push(Cpu {
                        pc: at,
                        interrupts: pstate & 0x80 == 0,
                    });
                    pc = None;
                }
            }
            cpus
        }
    }
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
        self.in_int3 |= cpus.iter().any(|cpu| path.contains(cpu.pc));
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
            registers(Arch::Amd64, text),
            [
                Cpu {
                    pc: 0xffff_ffff_81a0_4ffe,
                    interrupts: false
                },
                Cpu {
                    pc: 0xffff_ffff_810e_1725,
                    interrupts: true
                },
            ]
        );
    }

    #[test]
    fn arm64_registers_are_read_off_the_monitor() {
        // An arm64 guest's answer (`-cpu max`, trimmed: the X, P and Z registers run on for
        // 8 KiB): CPU#0 as sampled in an EL0 test process, CPU#1 in the kernel (EL1h) with
        // IRQs and FIQs masked (PSTATE's I and F bits, 0x80 and 0x40).
        let text = "(qemu) info registers -a\r\n\r\nCPU#0\r\n PC=0000aaaade24ed60 \
                    X00=0000000000000000 X01=0000000000000002\r\nX29=0000ffff82d2d7b0 \
                    X30=0000aaaade24f820  SP=0000ffff82d2d780\r\nPSTATE=20001000 --C- EL0t  \
                    SVCR=00000000 --  BTYPE=0     FPCR=00000000 FPSR=00000000\r\n\
                    P00=000000ffffffffff P01=0000000000000000\r\nCPU#1\r\n \
                    PC=ffff800080e1c5d4 X00=0000000000001429\r\nPSTATE=604000c5 -ZC- EL1h  \
                    SVCR=00000000 --  BTYPE=0\r\n(qemu) ";
        assert_eq!(
            registers(Arch::Arm64, text),
            [
                Cpu {
                    pc: 0x0000_aaaa_de24_ed60,
                    interrupts: true
                },
                Cpu {
                    pc: 0xffff_8000_80e1_c5d4,
                    interrupts: false
                },
            ]
        );
        // Neither architecture reads the other's dump.
        assert!(registers(Arch::Amd64, text).is_empty());
    }

    #[test]
    fn only_interrupts_off_everywhere_for_long_enough_is_a_lockup() {
        let path = Int3Path::parse("meshcap-vm: int3 path: ffffffff81c00ba0-ffffffff81c00be0 x")
            .expect("the line");
        let off = |pc| Cpu {
            pc,
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
                pc: 0x2000,
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
