//! A stand-in for a primary CNI's socket load balancer (Cilium's with kube-proxy replacement):
//! a `cgroup/connect4` or `cgroup/sendmsg4` program, assembled here, that rewrites one service
//! address into one backend's, attached as a bpf_link to a cgroup. The coexistence tests put it before, after
//! and above meshcap's programs.
use std::{
    fs, io,
    net::SocketAddrV4,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;

/// The hook the balancer runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Hook {
    /// `BPF_CGROUP_INET4_CONNECT`: TCP (and connected UDP) connects.
    Connect4 = 10,
    /// `BPF_CGROUP_UDP4_SENDMSG`: unconnected UDP datagrams (DNS).
    SendMsg4 = 14,
}
const F_BEFORE: u32 = 1 << 3;

/// `struct bpf_sock_addr`: `user_ip4` and `user_port` (network order, in a u32).
const USER_IP4: i16 = 4;
const USER_PORT: i16 = 24;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a zeroed `union bpf_attr` of the size passed, and the pointers in it
    // (instructions, license) outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a successful BPF_PROG_LOAD or BPF_LINK_CREATE returns a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(i32::try_from(rc).map_err(io::Error::other)?) })
}

/// One instruction: opcode, dst and src registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst & 0xf) << 8)
        | (u64::from(src & 0xf) << 12)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

/// The address as `bpf_sock_addr` holds it, read as a native u32.
fn ip(addr: SocketAddrV4) -> i32 {
    i32::from_ne_bytes(addr.ip().octets())
}

fn port(addr: SocketAddrV4) -> i32 {
    i32::from(addr.port().to_be())
}

/// Loads the program rewriting `hook`'s destination `from` into `to`.
///
/// # Errors
/// The kernel's refusal.
pub fn load(hook: Hook, from: SocketAddrV4, to: SocketAddrV4) -> io::Result<OwnedFd> {
    // LDX_W r2 = ctx->user_ip4; JNE32 w2, from, +6; LDX_W r3 = ctx->user_port;
    // JNE32 w3, port, +4; r2 = to; STX_W ctx->user_ip4 = r2; r3 = to port;
    // STX_W ctx->user_port = r3; r0 = 1; exit.
    let insns = [
        insn(0x61, 2, 1, USER_IP4, 0),
        insn(0x56, 2, 0, 6, ip(from)),
        insn(0x61, 3, 1, USER_PORT, 0),
        insn(0x56, 3, 0, 4, port(from)),
        insn(0xb7, 2, 0, 0, ip(to)),
        insn(0x63, 1, 2, USER_IP4, 0),
        insn(0xb7, 3, 0, 0, port(to)),
        insn(0x63, 1, 3, USER_PORT, 0),
        insn(0xb7, 0, 0, 0, 1),
        insn(0x95, 0, 0, 0, 0),
    ];
    let license = c"GPL";
    let mut attr = [0u64; 16];
    attr[0] = u64::from(PROG_TYPE_CGROUP_SOCK_ADDR) | ((insns.len() as u64) << 32);
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    // prog_name at byte 48; expected_attach_type at byte 68.
    let name = *b"test_socklb\0\0\0\0\0";
    attr[6] = u64::from_ne_bytes(name[..8].try_into().expect("8 bytes"));
    attr[7] = u64::from_ne_bytes(name[8..].try_into().expect("8 bytes"));
    attr[8] = u64::from(hook as u32) << 32;
    bpf(BPF_PROG_LOAD, &mut attr)
}

/// Attaches `prog` (loaded for `hook`) to `cgroup`: after the programs there, or before all
/// of them (`first`, where the kernel can order cgroup links).
///
/// # Errors
/// The kernel's refusal (`EINVAL` for `first` where it cannot order them).
pub fn attach(prog: &OwnedFd, hook: Hook, cgroup: &Path, first: bool) -> io::Result<OwnedFd> {
    let cgroup = fs::File::open(cgroup)?;
    let mut attr = [0u64; 16];
    attr[0] = u64::from(prog.as_raw_fd() as u32) | (u64::from(cgroup.as_raw_fd() as u32) << 32);
    attr[1] = u64::from(hook as u32) | (u64::from(if first { F_BEFORE } else { 0 }) << 32);
    bpf(BPF_LINK_CREATE, &mut attr)
}

/// Whether this kernel orders cgroup links (`BPF_F_BEFORE`), found by trying it on a cgroup
/// of the test's own: the tests' own answer, not the agent's.
///
/// # Errors
/// When the program cannot be loaded or the kernel refuses for another reason.
pub fn kernel_orders_cgroup_links(scratch: &Path) -> io::Result<bool> {
    let prog = load(
        Hook::Connect4,
        SocketAddrV4::new([192, 0, 2, 1].into(), 1),
        SocketAddrV4::new([192, 0, 2, 2].into(), 1),
    )?;
    match attach(&prog, Hook::Connect4, scratch, true) {
        Ok(_link) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}
