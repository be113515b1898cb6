//! meshcap's kernel programs. Every decision is made by `meshcap_common`; this crate only reads
//! the kernel's context, looks up the maps and applies the verdict.
#![no_std]
#![no_main]

use aya_ebpf::{
    helpers::{bpf_get_current_uid_gid, bpf_get_netns_cookie},
    macros::{cgroup_sock_addr, map},
    maps::HashMap,
    programs::SockAddrContext,
};
use meshcap_common::{PROXY_OUTBOUND_PORT, PodConfig};

/// Keep the connection going.
const ALLOW: i32 = 1;

#[map(name = "MESHCAP_PODS")]
static PODS: HashMap<u64, PodConfig> = HashMap::with_max_entries(65_536, 0);

/// Outbound TCP: send the pod's connections to its proxy.
#[cgroup_sock_addr(connect4)]
pub fn meshcap_connect4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the duration of the program.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    // SAFETY: the map value is only read; the agent writes whole entries.
    let Some(pod) = (unsafe { PODS.get(cookie) }) else {
        return ALLOW;
    };
    let uid_gid = bpf_get_current_uid_gid();
    // Truncation intended: the helper packs gid in the high and uid in the low 32 bits.
    #[expect(clippy::cast_possible_truncation, reason = "uid is the low half")]
    let uid = uid_gid as u32;
    let gid = (uid_gid >> 32) as u32;
    if uid == pod.proxy_uid || gid == pod.proxy_gid {
        return ALLOW;
    }
    // SAFETY: `sock_addr` points at the kernel's `bpf_sock_addr` for this call.
    unsafe {
        (*ctx.sock_addr).user_ip4 = u32::from_ne_bytes([127, 0, 0, 1]);
        (*ctx.sock_addr).user_port = u32::from(PROXY_OUTBOUND_PORT.to_be());
    }
    ALLOW
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
