//! Other programs on meshcap's cgroup hooks, and meshcap's place among them. A primary CNI's
//! socket load balancer (Cilium with kube-proxy replacement) also runs `connect4/6` and
//! `sendmsg4/6` programs and rewrites a service address into a backend's. Programs of one
//! cgroup run in attach order, then the ancestors' (effective order); when the balancer's runs
//! before meshcap's, meshcap records the backend as the original destination and Envoy loses
//! the service (istio/istio#27619). So meshcap creates its links first on the hook
//! (`BPF_F_BEFORE`) where the kernel can order cgroup links, moves them first again when it
//! finds another program ahead of them (a pinned link kept from before, or one attached later
//! with `BPF_F_BEFORE`), and where the kernel cannot, says so.
//!
//! Moving a link first: a new link for the same program is created first, pinned beside the
//! old one and renamed over its pin, which drops the old link. For a moment the program runs
//! twice; its second run sees the rewritten loopback destination, which it leaves alone.
use std::{fs, io, os::fd::AsFd as _, path::Path};

use meshcap_common::programs;

use super::sys::{self, CgroupAttach};
use crate::backend::{OtherProgram, ebpf::Pins};

/// The hooks where a program that runs before meshcap's changes the original destination.
pub const DECIDES_DESTINATION: [&str; 4] = [
    programs::CONNECT4,
    programs::CONNECT6,
    programs::SENDMSG4,
    programs::SENDMSG6,
];

/// Whether `other`'s place changes what meshcap takes as the original destination.
#[must_use]
pub fn decides_destination(other: &OtherProgram) -> bool {
    other.before && DECIDES_DESTINATION.contains(&other.hook.as_str())
}

/// Every other program on meshcap's `hooks` at `cgroup_root` (its own and its ancestors'), in
/// the order they run relative to meshcap's.
#[must_use]
pub fn neighbours(
    cgroup_root: &Path,
    pins: &Pins,
    hooks: &[(&'static str, CgroupAttach)],
) -> Vec<OtherProgram> {
    let Ok(cgroup) = fs::File::open(cgroup_root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &(hook, attach) in hooks {
        let Some(own) = own_prog(pins, hook) else {
            continue;
        };
        let Ok(ids) = sys::effective_prog_ids(&cgroup, attach) else {
            continue;
        };
        let at = ids.iter().position(|id| *id == own);
        for (i, id) in ids.iter().enumerate().filter(|(_, id)| **id != own) {
            out.push(OtherProgram {
                hook: hook.to_owned(),
                prog_id: *id,
                name: sys::prog_name(*id).unwrap_or_default(),
                before: at.is_some_and(|at| i < at),
            });
        }
    }
    out
}

/// The program meshcap's pinned link on `hook` runs.
fn own_prog(pins: &Pins, hook: &str) -> Option<u32> {
    let link = sys::obj_get(&pins.link(hook)).ok()?;
    sys::link_ids(link).ok().map(|(_, prog)| prog)
}

/// What [`put_first`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// meshcap's link on the hook now runs first.
    First,
    /// The kernel cannot order cgroup links (`EINVAL`): meshcap's stays where it is.
    CannotOrder,
}

/// Re-creates meshcap's link on `hook` (attached as `attach`) before every other program
/// there.
///
/// # Errors
/// When the link cannot be read, created, pinned or renamed.
pub fn put_first(
    cgroup_root: &Path,
    pins: &Pins,
    hook: &str,
    attach: CgroupAttach,
) -> io::Result<Placed> {
    let pin = pins.link(hook);
    let own = own_prog(pins, hook)
        .ok_or_else(|| io::Error::other(format!("no pinned link at {}", pin.display())))?;
    let prog = sys::prog_by_id(own)?;
    let cgroup = fs::File::open(cgroup_root)?;
    let link = match create_first(prog.as_fd(), &cgroup, attach)? {
        Some(link) => link,
        None => return Ok(Placed::CannotOrder),
    };
    // bpffs refuses names with a dot.
    let staged = pin.with_file_name(format!("{hook}_first"));
    let _ = fs::remove_file(&staged);
    sys::obj_pin(&link, &staged)?;
    fs::rename(&staged, &pin)?;
    Ok(Placed::First)
}

/// [`sys::link_create_first`], or `None` where the kernel cannot order cgroup links.
///
/// # Errors
/// Any other refusal.
pub fn create_first(
    prog: std::os::fd::BorrowedFd<'_>,
    cgroup: &fs::File,
    attach: CgroupAttach,
) -> io::Result<Option<std::os::fd::OwnedFd>> {
    match sys::link_create_first(prog, cgroup, attach) {
        Ok(link) => Ok(Some(link)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}
