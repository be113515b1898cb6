//! meshcap's kernel programs. Every decision is made by `meshcap_common`; this crate only reads
//! the kernel's context, looks the pod up in the maps and applies the verdict.
//!
//! - [`outbound`]: `cgroup/connect4|6` (TCP, connected UDP), `cgroup/sendmsg4|6` and
//!   `cgroup/recvmsg4|6` (unconnected UDP DNS);
//! - [`flows`]: `sockops` carries a redirected socket's original destination to a
//!   netns-qualified 4-tuple, `cgroup/getsockopt` answers `SO_ORIGINAL_DST` from it;
//! - [`ingress`]: the TC classifier on a pod's interfaces (inbound capture with `bpf_sk_assign`);
//!   [`refuse`] answers a SYN no proxy listens for with the reset Istio's rules would give;
//! - [`handoff`]: `sk_lookup` takes over the assignment where `bpf_sk_assign` refuses the
//!   proxy's `SO_REUSEPORT` listeners (before Linux 6.5).
#![no_std]
#![no_main]

mod flows;
mod handoff;
mod ingress;
mod outbound;
mod refuse;
mod tables;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
