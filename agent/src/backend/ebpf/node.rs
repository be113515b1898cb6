//! The node-wide part: meshcap's object loaded once, its maps pinned (and adopted by a
//! restarted agent), the cgroup programs attached to the cgroup root as pinned `bpf_link`s,
//! and the shared inbound classifier put in `MESHCAP_TC_PROG` for every pod's stub to
//! tail-call.
use std::{fs, os::fd::AsFd as _, path::Path};

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier},
};
use meshcap_common::{maps, programs};

use super::{EbpfError, pins::Pins, stub, sys, sys::CgroupAttach};

/// The node-wide programs, in attach order: the original-destination plumbing (and the peer
/// address getpeername reports) before the redirects, so no redirected connection ever lacks
/// its answer.
pub(super) const CGROUP_PROGRAMS: [(&str, CgroupAttach); 10] = [
    (programs::SOCKOPS, CgroupAttach::SockOps),
    (programs::GETSOCKOPT, CgroupAttach::GetSockopt),
    (programs::GETPEERNAME4, CgroupAttach::GetPeerName4),
    (programs::GETPEERNAME6, CgroupAttach::GetPeerName6),
    (programs::RECVMSG4, CgroupAttach::RecvMsg4),
    (programs::RECVMSG6, CgroupAttach::RecvMsg6),
    (programs::CONNECT4, CgroupAttach::Connect4),
    (programs::CONNECT6, CgroupAttach::Connect6),
    (programs::SENDMSG4, CgroupAttach::SendMsg4),
    (programs::SENDMSG6, CgroupAttach::SendMsg6),
];

/// aya-log's ring buffer of kernel-side log records.
const KERNEL_LOG_MAP: &str = "AYA_LOGS";

/// Every map of the object (all pinned; aya-log's ring buffer too, so that a restarted agent
/// reads the records of the programs it adopted, which write to the buffer of their load).
const MAPS: [&str; 11] = [
    KERNEL_LOG_MAP,
    maps::PODS,
    maps::POD_ADDRS,
    maps::CIDRS4,
    maps::CIDRS6,
    maps::PORTS,
    maps::IFACES,
    maps::DIALED,
    maps::CONNECTING,
    maps::FLOWS,
    maps::TC_PROG,
];

/// Loads the embedded object with its maps pinned under `pins` (existing pins are adopted as
/// they are).
pub(super) fn load_object(pins: &Pins) -> Result<Ebpf, EbpfError> {
    if crate::bpf::object().is_empty() {
        return Err(EbpfError::Bpf {
            what: "opening the embedded object".into(),
            source: Box::new(crate::bpf::LoadError::NotEmbedded),
        });
    }
    let mut loader = EbpfLoader::new();
    for name in MAPS {
        loader.map_pin_path(name, pins.map(name));
    }
    loader
        .load(crate::bpf::object())
        .map_err(|e| EbpfError::map("loading the eBPF object", e))
}

/// Attaches every node-wide program to `cgroup_root` unless a pinned link says it already is,
/// and pins each new link.
pub(super) fn attach_cgroup_programs(
    ebpf: &mut Ebpf,
    pins: &Pins,
    cgroup_root: &Path,
) -> Result<(), EbpfError> {
    let cgroup = fs::File::open(cgroup_root)
        .map_err(|e| EbpfError::io(&format!("opening cgroup {}", cgroup_root.display()), e))?;
    for (name, attach) in CGROUP_PROGRAMS {
        let pin = pins.link(name);
        if sys::obj_get(&pin).is_ok() {
            tracing::debug!(program = name, pin = %pin.display(), "adopting pinned link");
            continue;
        }
        let program = ebpf.program_mut(name).ok_or(EbpfError::Missing(name))?;
        let fd = load_program(program, name)?;
        let link = sys::link_create(fd.as_fd(), &cgroup, attach).map_err(|e| {
            EbpfError::io(&format!("attaching {name} to {}", cgroup_root.display()), e)
        })?;
        sys::obj_pin(&link, &pin)
            .map_err(|e| EbpfError::io(&format!("pinning {}", pin.display()), e))?;
        tracing::info!(program = name, cgroup = %cgroup_root.display(), "attached");
    }
    Ok(())
}

/// Fails naming the first node-wide program whose pinned link is missing.
pub(super) fn check_cgroup_links(pins: &Pins) -> Result<(), String> {
    for (name, _) in CGROUP_PROGRAMS {
        sys::obj_get(&pins.link(name))
            .map_err(|e| format!("node-wide program {name} is not attached: {e}"))?;
    }
    Ok(())
}

fn load_program(
    program: &mut Program,
    name: &'static str,
) -> Result<aya::programs::ProgramFd, EbpfError> {
    let err = |e| EbpfError::program(name, e);
    match program {
        Program::CgroupSockAddr(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        Program::CgroupSockopt(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        Program::SockOps(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        _ => Err(err(ProgramError::UnexpectedProgramType)),
    }
}

/// Loads (verifies) the inbound classifier once and puts it in slot 0 of the pinned
/// `MESHCAP_TC_PROG`, which every pod's stub tail-calls. A restarted agent replaces it
/// atomically with its own instance.
pub(super) fn install_shared_tc(ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    let prog: &mut SchedClassifier = ebpf
        .program_mut(programs::INGRESS)
        .ok_or(EbpfError::Missing(programs::INGRESS))?
        .try_into()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?;
    prog.load()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?;
    let fd = prog
        .fd()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?
        .try_clone()
        .map_err(|e| EbpfError::io(programs::INGRESS, e))?;
    let map = ebpf
        .take_map(maps::TC_PROG)
        .ok_or(EbpfError::Missing(maps::TC_PROG))?;
    let mut slots = ProgramArray::<MapData>::try_from(map)
        .map_err(|e| EbpfError::map(&format!("map {}", maps::TC_PROG), e))?;
    slots
        .set(0, &fd, 0)
        .map_err(|e| EbpfError::map("setting the shared TC program", e))
}

/// Loads a pod's TC stub against `ebpf`'s (unpinned) `MESHCAP_TC_PROG`, and drops it: the
/// probe's trial load of what the agent assembles itself.
///
/// # Errors
/// When the object has no such map or the kernel refuses the stub.
pub fn trial_load_stub(ebpf: &Ebpf) -> Result<(), EbpfError> {
    let Some(aya::maps::Map::ProgramArray(slots)) = ebpf.map(maps::TC_PROG) else {
        return Err(EbpfError::Missing(maps::TC_PROG));
    };
    stub::load(0, slots.fd().as_fd())?;
    Ok(())
}

/// How many programs of each node-wide hook are attached to `cgroup_root`, whoever attached
/// them.
///
/// # Errors
/// When the cgroup cannot be queried.
pub fn cgroup_attachments(cgroup_root: &Path) -> Result<Vec<(&'static str, u32)>, EbpfError> {
    let cgroup =
        fs::File::open(cgroup_root).map_err(|e| EbpfError::io("opening the cgroup root", e))?;
    CGROUP_PROGRAMS
        .iter()
        .map(|(name, attach)| {
            sys::prog_count(&cgroup, *attach)
                .map(|n| (*name, n))
                .map_err(|e| EbpfError::io(&format!("querying {name}"), e))
        })
        .collect()
}
