//! The node-wide part: meshcap's object loaded once, its maps pinned (and adopted by a
//! restarted agent), the cgroup programs attached to the cgroup root as pinned `bpf_link`s,
//! and the shared inbound classifier put in `MESHCAP_TC_PROG` for every pod's stub to
//! tail-call.
use std::{
    fs,
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier, SkLookup},
};
use meshcap_common::{maps, programs};

use super::{EbpfError, pins::Pins, stub, sys, sys::CgroupAttach};
use crate::backend::AttachedProgram;

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
const MAPS: [&str; 13] = [
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
    maps::LISTENERS,
    maps::HANDOFFS,
];

/// Loads the embedded object with its maps pinned under `pins` (existing pins are adopted as
/// they are).
pub(super) fn load_object(pins: &Pins) -> Result<Ebpf, EbpfError> {
    if crate::bpf::object().is_empty() {
        return Err(EbpfError::Bpf {
            what: "opening the embedded object".into(),
            source: Box::new(crate::bpf::ObjectError::NotEmbedded),
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

/// Puts this build's programs on every node-wide hook of `cgroup_root`, in
/// [`CGROUP_PROGRAMS`]' order, and returns each one's program id. A hook whose pinned link
/// exists (an earlier agent's, maybe another build's) is switched to this build's program in
/// place (`BPF_LINK_UPDATE`, atomic: every call runs the old or the new program, never none); a
/// link whose cgroup is gone (`ENOLINK`) is replaced; a missing one is created and pinned.
/// Capture never lapses: no hook is ever empty, and the maps are the same layout's.
pub(super) fn attach_cgroup_programs(
    ebpf: &mut Ebpf,
    pins: &Pins,
    cgroup_root: &Path,
) -> Result<Vec<(&'static str, u32)>, EbpfError> {
    let cgroup = fs::File::open(cgroup_root)
        .map_err(|e| EbpfError::io(&format!("opening cgroup {}", cgroup_root.display()), e))?;
    let mut loaded = Vec::new();
    for (name, attach) in CGROUP_PROGRAMS {
        let program = ebpf.program_mut(name).ok_or(EbpfError::Missing(name))?;
        let fd = load_program(program, name)?;
        loaded.push((
            name,
            sys::prog_id(&fd).map_err(|e| EbpfError::io(&format!("reading {name}'s id"), e))?,
        ));
        let pin = pins.link(name);
        if let Ok(link) = sys::obj_get(&pin) {
            match sys::link_update(&link, &fd) {
                Ok(()) => {
                    tracing::debug!(program = name, pin = %pin.display(), "switched the pinned link to this build's program");
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => {
                    tracing::warn!(program = name, pin = %pin.display(), "the pinned link's cgroup is gone: attaching afresh");
                    super::pins::unpin_link(&pin)
                        .map_err(|e| EbpfError::io(&format!("unpinning {}", pin.display()), e))?;
                }
                Err(e) => {
                    return Err(EbpfError::io(
                        &format!("switching {} to this build's {name}", pin.display()),
                        e,
                    ));
                }
            }
        }
        // First on the hook where the kernel can order cgroup links (order.rs says why).
        let link = match super::order::create_first(fd.as_fd(), &cgroup, attach) {
            Ok(Some(link)) => Ok(link),
            Ok(None) => sys::link_create(fd.as_fd(), &cgroup, attach),
            Err(e) => Err(e),
        }
        .map_err(|e| EbpfError::io(&format!("attaching {name} to {}", cgroup_root.display()), e))?;
        sys::obj_pin(&link, &pin)
            .map_err(|e| EbpfError::io(&format!("pinning {}", pin.display()), e))?;
        tracing::info!(program = name, cgroup = %cgroup_root.display(), "attached");
    }
    Ok(loaded)
}

/// What runs on each node-wide hook now, from the pinned links, and the shared TC classifier.
#[must_use]
pub(super) fn attached(pins: &Pins, tc_prog: &std::os::fd::OwnedFd) -> Vec<AttachedProgram> {
    let mut out: Vec<AttachedProgram> = CGROUP_PROGRAMS
        .iter()
        .map(|(name, _)| {
            let ids = sys::obj_get(&pins.link(name)).and_then(sys::link_ids).ok();
            AttachedProgram {
                program: (*name).to_owned(),
                link_id: ids.map(|(link, _)| link),
                prog_id: ids.map(|(_, prog)| prog),
                tag: ids.and_then(|(_, prog)| sys::prog_tag(prog).ok()),
                this_agent: false,
            }
        })
        .collect();
    let tc = sys::prog_array_id(tc_prog, 0).ok();
    out.push(AttachedProgram {
        program: programs::INGRESS.to_owned(),
        link_id: None,
        prog_id: tc,
        tag: tc.and_then(|id| sys::prog_tag(id).ok()),
        this_agent: false,
    });
    out
}

/// A node-wide program whose pinned link is missing.
#[derive(Debug, thiserror::Error)]
#[error("node-wide program {name} is not attached: {source}")]
pub(super) struct NotAttached {
    name: &'static str,
    #[source]
    source: std::io::Error,
}

/// Fails naming the first node-wide program whose pinned link is missing.
pub(super) fn check_cgroup_links(pins: &Pins) -> Result<(), NotAttached> {
    for (name, _) in CGROUP_PROGRAMS {
        sys::obj_get(&pins.link(name)).map_err(|source| NotAttached { name, source })?;
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
pub(super) fn install_shared_tc(ebpf: &mut Ebpf) -> Result<u32, EbpfError> {
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
        .map_err(|e| EbpfError::map("setting the shared TC program", e))?;
    sys::prog_id(fd.as_fd()).map_err(|e| EbpfError::io("reading the TC program's id", e))
}

/// Loads (verifies) the socket lookup program, which each captured pod's netns gets (a link
/// per pod, pinned with the pod's records). Pods keep the instance of the agent that attached
/// them; every instance shares the pinned maps.
pub(super) fn load_handoff(ebpf: &mut Ebpf) -> Result<OwnedFd, EbpfError> {
    let prog: &mut SkLookup = ebpf
        .program_mut(programs::HANDOFF)
        .ok_or(EbpfError::Missing(programs::HANDOFF))?
        .try_into()
        .map_err(|e| EbpfError::program(programs::HANDOFF, e))?;
    prog.load()
        .map_err(|e| EbpfError::program(programs::HANDOFF, e))?;
    prog.fd()
        .map_err(|e| EbpfError::program(programs::HANDOFF, e))?
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| EbpfError::io(programs::HANDOFF, e))
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
