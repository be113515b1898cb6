//! The per-pod TC stub, assembled here: it stores the pod's netns cookie in `skb->cb[0..2]`
//! and tail-calls the shared inbound classifier (slot 0 of the pinned `MESHCAP_TC_PROG`),
//! which reads the cookie back (`bpf_get_netns_cookie` is not available to TC programs
//! before Linux 6.15, and where it is, it answers for the skb's socket, which an inbound
//! packet does not have yet).
//!
//! Ten instructions with the cookie as an immediate: loading them raw takes the kernel tens
//! of microseconds, where aya's loader re-parsed the whole embedded object (every program,
//! its BTF and relocations) for each pod just to set one global.
//!
//! ```text
//! r2 = cookie & 0xffffffff        ; cb[0] = low half
//! *(u32 *)(r1 + cb[0]) = r2
//! r2 = cookie >> 32               ; cb[1] = high half
//! *(u32 *)(r1 + cb[1]) = r2
//! r2 = MESHCAP_TC_PROG ll         ; ld_imm64 with BPF_PSEUDO_MAP_FD
//! r3 = 0
//! call bpf_tail_call              ; does not return when slot 0 holds the classifier
//! r0 = TC_ACT_OK                  ; slot 0 empty (only before the agent's first open): pass
//! exit
//! ```
//!
//! Attached on a pod's interfaces, each attachment recorded in the pod's pins ([`TcRecord`]):
//! a netlink `cls_bpf` filter ([`crate::podnet::clsact`], the default) recorded as a directory
//! holding the stub pinned under the filter's place, or a TCX `bpf_link` pinned as the record
//! itself. Attach and detach run on the pod's netns thread; checking an attachment against the
//! kernel is [`super::pod`]'s.
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, OwnedFd};

use super::{EbpfError, pins::TcRecord, sys};
use crate::{
    crashpoint,
    podnet::{self, Visit, clsact},
};

/// The stub's name in the kernel (`bpftool prog`, `tc filter show`); at most 15 bytes.
pub const NAME: &str = "meshcap_tc_stub";
/// The name of an ambient pod's stub on `lo` ([`load_lo`]).
pub const LO_NAME: &str = "meshcap_lo_stub";

/// `offsetof(struct __sk_buff, cb[0])`.
const SKB_CB: i16 = 48;
/// `offsetof(struct __sk_buff, mark)`.
const SKB_MARK: i16 = 8;
/// `TC_ACT_OK`.
const TC_ACT_OK: i32 = 0;
/// `BPF_FUNC_tail_call`.
const FUNC_TAIL_CALL: i32 = 12;
/// `BPF_PSEUDO_MAP_FD`: the immediate of a `ld_imm64` is a map fd of the loading process.
const PSEUDO_MAP_FD: u8 = 1;

// Instruction classes, sizes, modes and operations (linux/bpf_common.h, linux/bpf.h).
const BPF_LD: u8 = 0x00;
const BPF_LDX: u8 = 0x01;
const BPF_STX: u8 = 0x03;
const BPF_JMP: u8 = 0x05;
const BPF_ALU64: u8 = 0x07;
const BPF_W: u8 = 0x00;
const BPF_DW: u8 = 0x18;
const BPF_IMM: u8 = 0x00;
const BPF_MEM: u8 = 0x60;
const BPF_MOV: u8 = 0xb0;
const BPF_AND: u8 = 0x50;
const BPF_JNE: u8 = 0x50;
const BPF_K: u8 = 0x00;
const BPF_CALL: u8 = 0x80;
const BPF_EXIT: u8 = 0x90;

const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;

/// One `struct bpf_insn`: opcode, registers (two nibbles), 16-bit offset, 32-bit immediate.
type Insn = [u8; 8];

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    // The register nibbles are a C bitfield: dst_reg first, i.e. the low nibble on
    // little-endian hosts and the high one on big-endian hosts.
    let regs = if cfg!(target_endian = "little") {
        (src << 4) | (dst & 0x0f)
    } else {
        (dst << 4) | (src & 0x0f)
    };
    let [o0, o1] = off.to_ne_bytes();
    let [i0, i1, i2, i3] = imm.to_ne_bytes();
    [code, regs, o0, o1, i0, i1, i2, i3]
}

/// `dst = imm` (64-bit move; the immediate is sign-extended, which a 32-bit store ignores).
fn mov_imm(dst: u8, imm: i32) -> Insn {
    insn(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)
}

/// `*(u32 *)(dst + off) = src`.
fn store_w(dst: u8, off: i16, src: u8) -> Insn {
    insn(BPF_STX | BPF_MEM | BPF_W, dst, src, off, 0)
}

/// `dst = map` (the two-slot `ld_imm64` with a map fd, replaced by the map by the kernel).
fn ld_map_fd(dst: u8, fd: i32) -> [Insn; 2] {
    [
        insn(BPF_LD | BPF_DW | BPF_IMM, dst, PSEUDO_MAP_FD, 0, fd),
        insn(0, 0, 0, 0, 0),
    ]
}

/// The stub's instructions for the pod with netns `cookie`, tail-calling through the program
/// array `prog_array` (an fd of this process).
fn program(cookie: u64, prog_array: i32) -> Vec<Insn> {
    let [lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3] = cookie.to_le_bytes();
    let low = i32::from_le_bytes([lo0, lo1, lo2, lo3]);
    let high = i32::from_le_bytes([hi0, hi1, hi2, hi3]);
    let mut insns = vec![
        mov_imm(R2, low),
        store_w(R1, SKB_CB, R2),
        mov_imm(R2, high),
        store_w(R1, SKB_CB + 4, R2),
    ];
    insns.extend(ld_map_fd(R2, prog_array));
    insns.extend([
        mov_imm(R3, 0),
        insn(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC_TAIL_CALL),
        mov_imm(R0, TC_ACT_OK),
        insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
    ]);
    insns
}

/// The stub of an ambient pod's `lo` (tail-calling through `prog_array`): there the
/// classifier only changes ztunnel's SYNs to the app, which carry ztunnel's mark (0x539 under
/// 0xfff), and needs no cookie. Every packet between the app and ztunnel crosses `lo`, so the
/// others (the app's, and without ztunnel's mark) pass here, without the tail call.
///
/// ```text
/// r2 = *(u32 *)(r1 + mark)
/// r2 &= 0xfff
/// if r2 != 0x539 goto pass
/// r2 = MESHCAP_TC_PROG ll
/// r3 = 0
/// call bpf_tail_call
/// pass: r0 = TC_ACT_OK
/// exit
/// ```
fn lo_program(prog_array: i32) -> Vec<Insn> {
    #[expect(clippy::cast_possible_wrap, reason = "12-bit constants")]
    let (mask, ztunnel) = (
        meshcap_common::AMBIENT_MARK_MASK as i32,
        meshcap_common::ZTUNNEL_MARK as i32,
    );
    let mut insns = vec![
        insn(BPF_LDX | BPF_MEM | BPF_W, R2, R1, SKB_MARK, 0),
        insn(BPF_ALU64 | BPF_AND | BPF_K, R2, 0, 0, mask),
        // Over the map load (two slots), r3 and the call.
        insn(BPF_JMP | BPF_JNE | BPF_K, R2, 0, 4, ztunnel),
    ];
    insns.extend(ld_map_fd(R2, prog_array));
    insns.extend([
        mov_imm(R3, 0),
        insn(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC_TAIL_CALL),
        mov_imm(R0, TC_ACT_OK),
        insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
    ]);
    insns
}

/// Loads the stub of an ambient pod's `lo` ([`lo_program`]), tail-calling through
/// `prog_array` (the pinned `MESHCAP_TC_PROG`).
///
/// # Errors
/// The kernel's refusal, with the verifier log.
pub fn load_lo(prog_array: impl AsFd) -> Result<OwnedFd, sys::Refused> {
    let insns = lo_program(prog_array.as_fd().as_raw_fd());
    sys::prog_load_sched_cls(LO_NAME, &insns, c"GPL")
}

/// Loads the stub of the pod with netns `cookie` (a `BPF_PROG_TYPE_SCHED_CLS` program,
/// direct-action) tail-calling through `prog_array` (the pinned `MESHCAP_TC_PROG`).
///
/// # Errors
/// The kernel's refusal, with the verifier log.
pub fn load(cookie: u64, prog_array: impl AsFd) -> Result<OwnedFd, sys::Refused> {
    let insns = program(cookie, prog_array.as_fd().as_raw_fd());
    // The classifier it tail-calls is GPL (it calls GPL-only helpers): so is the caller.
    sys::prog_load_sched_cls(NAME, &insns, c"GPL")
}

/// `lo`'s index in every network namespace (`LOOPBACK_IFINDEX`): an ambient pod's stub sits
/// there too.
pub(super) const LOOPBACK_IFINDEX: u32 = 1;

/// How pods' inbound stubs are attached to their interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// A TCX bpf_link (Linux 6.6+), pinned at `pods/<cookie>/tc-<ifname>`. Creating and
    /// releasing one each wait for an RCU grace period in the kernel (6–12 ms apiece), so it
    /// is only used when asked for.
    Tcx,
    /// A `cls_bpf` direct-action filter on the `clsact` qdisc, over netlink (every kernel
    /// meshcap runs on), recorded in the directory `pods/<cookie>/tc-<ifname>/`: the default,
    /// on every kernel (docs/ebpf.md says why).
    #[default]
    Netlink,
}

/// Attaches the pod's `stub` on the ingress of interface `ifindex` (`record`'s) in the visited
/// netns, and records it. Nothing is left attached without its record, even when the agent is
/// killed half-way.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn attach(
    visit: &mut Visit,
    mode: TcAttach,
    stub: impl AsFd,
    ifindex: u32,
    record: &TcRecord,
) -> Result<(), EbpfError> {
    let ifname = record.ifname();
    match mode {
        TcAttach::Tcx => {
            let link = sys::tcx_ingress_link_create(stub, ifindex)
                .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
            // Unpinned, the link goes with its fd: nothing stays attached.
            record.pin_link(&link).map_err(|e| {
                EbpfError::io(
                    &format!(
                        "pinning the TC link of {ifname} at {}",
                        record.path().display()
                    ),
                    e,
                )
            })
        }
        TcAttach::Netlink => attach_netlink(visit, stub.as_fd(), ifindex, record, false),
    }
}

/// Attaches the pod's `stub` on `ifindex` again where its record is gone or the kernel
/// contradicts it (the verifier's repair), in place: nothing of what is there is taken away
/// first. A netlink filter is replaced at meshcap's place (one atomic request) and recorded
/// anew, keeping what the old record said of the qdisc; a TCX link is created and pinned over
/// the old record, which goes only then. An interface without a record gets what `mode` says.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn reattach(
    visit: &mut Visit,
    mode: TcAttach,
    stub: impl AsFd,
    ifindex: u32,
    record: &TcRecord,
) -> Result<(), EbpfError> {
    if !record.exists() {
        return attach(visit, mode, stub, ifindex, record);
    }
    if record.is_filter() {
        let owned = record
            .filter()
            .is_ok_and(|(filter, _)| filter.created_qdisc)
            || record.may_own_qdisc();
        // Only the pins go: the filter stays until the new one replaces it.
        super::pins::remove_tree(record.path());
        return attach_netlink(visit, stub.as_fd(), ifindex, record, owned);
    }
    let ifname = record.ifname();
    let link = sys::tcx_ingress_link_create(stub, ifindex)
        .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
    // Beside the record, under a name no reader takes for a record (bpffs refuses dots).
    let staged = record.path().with_file_name(format!("new-tc-{ifname}"));
    let _ = std::fs::remove_file(&staged);
    sys::obj_pin(&link, &staged)
        .and_then(|()| std::fs::rename(&staged, record.path()))
        .map_err(|e| {
            let _ = std::fs::remove_file(&staged);
            let at = record.path().display();
            EbpfError::io(&format!("pinning the TC link of {ifname} at {at}"), e)
        })
}

/// The netlink filter, written ahead: the record's directory and its qdisc intent are pinned
/// before the kernel is asked for anything, so that an agent killed at any instant leaves a
/// record for whatever it attached ([`detach`] finishes the job). The intent stays only while
/// meshcap may own the qdisc without a filter record saying so (`owned_qdisc`: an earlier
/// record said meshcap added it).
fn attach_netlink(
    visit: &mut Visit,
    stub: BorrowedFd<'_>,
    ifindex: u32,
    record: &TcRecord,
    owned_qdisc: bool,
) -> Result<(), EbpfError> {
    let ifname = record.ifname();
    let recording = |e| {
        EbpfError::io(
            &format!(
                "recording the TC filter of {ifname} at {}",
                record.path().display()
            ),
            e,
        )
    };
    record.begin_filter().map_err(recording)?;
    let attached = visit.netlink().and_then(|netlink| {
        let created_qdisc = clsact::add_qdisc(netlink, ifindex, ifname)? || owned_qdisc;
        if !created_qdisc {
            record.drop_intent();
        }
        crashpoint::here(crashpoint::EBPF_ADD_QDISC);
        clsact::add_filter(netlink, ifindex, ifname, created_qdisc, stub, NAME)
    });
    let pinned = attached.map_err(EbpfError::from).and_then(|filter| {
        crashpoint::here(crashpoint::EBPF_ADD_FILTER);
        record.pin_filter(stub, &filter).map_err(recording)
    });
    if let Err(err) = pinned {
        detach(visit, record);
        return Err(err);
    }
    Ok(())
}

/// Detaches what [`attach`] attached (the visited netns) and removes its record. For netlink
/// TC only meshcap's filter goes, and the clsact qdisc only when meshcap added it and nothing
/// else uses it.
pub fn detach(visit: &mut Visit, record: &TcRecord) {
    let ifname = record.ifname();
    if record.is_filter()
        && let Ok(ifindex) = nix::net::if_::if_nametoindex(ifname)
    {
        let detached = visit.netlink().and_then(|netlink| match record.filter() {
            Ok((filter, id)) => clsact::detach(netlink, ifindex, ifname, id, filter),
            // An attach cut short before its filter was recorded: the filter by its place
            // and name, and the qdisc if the intent says meshcap may have added it.
            Err(_) => clsact::detach_named(netlink, ifindex, ifname, NAME, record.may_own_qdisc())
                .map(drop),
        });
        if let Err(err) = detached {
            tracing::warn!(interface = ifname, error = %err, "detaching the TC filter");
        }
    }
    record.remove();
}

/// Detaches meshcap's stub from every interface of the visited netns (and `lo` with
/// `with_lo`: an ambient pod's, or one whose kind is not known) that has none of `records`
/// yet runs it: a filter whose record was removed behind meshcap's back, or never written (an
/// agent killed in between). Recognised by its place and its program's name; its qdisc stays
/// (whether meshcap added it went with the record).
pub fn detach_unrecorded(visit: &mut Visit, records: &[TcRecord], with_lo: bool) {
    let mut interfaces = match podnet::inspect(visit, false) {
        Ok(net) => net.interfaces,
        Err(err) => {
            tracing::warn!(error = %err, "listing interfaces for unrecorded TC filters");
            return;
        }
    };
    if with_lo {
        interfaces.push((LOOPBACK_IFINDEX, "lo".to_owned()));
    }
    for (ifindex, ifname) in interfaces {
        if records
            .iter()
            .any(|record| record.ifname() == ifname.as_str())
        {
            continue;
        }
        let removed = visit
            .netlink()
            .and_then(|netlink| clsact::detach_named(netlink, ifindex, &ifname, NAME, false));
        match removed {
            Ok(true) => {
                tracing::warn!(interface = %ifname, "removed meshcap's TC filter, whose record was gone")
            }
            Ok(false) => {}
            Err(err) => {
                tracing::warn!(interface = %ifname, error = %err, "looking for an unrecorded TC filter")
            }
        }
    }
}

#[cfg(test)]
mod tests;
