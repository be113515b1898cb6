//! The node-wide programs this agent put in place, compared with what the kernel runs (the
//! verifier's node-wide part): each cgroup hook's pinned link is there, attached to the cgroup
//! root and running this build's program, and slot 0 of `MESHCAP_TC_PROG` holds this build's
//! classifier. What differs is put back without a moment in which a hook runs nothing of
//! meshcap's: a link running another program is switched in place (`BPF_LINK_UPDATE`), a link
//! gone or detached is created anew and pinned over the old pin (a detached link runs nothing
//! already), the classifier's slot is written atomically. The agent keeps a reference to each
//! of its programs, so that a program whose only link went can be attached again.
use std::{
    fs,
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

use meshcap_common::{maps, programs};

use super::{EbpfError, node::CGROUP_PROGRAMS, order, pins::Pins, sys, sys::CgroupAttach};
use crate::backend::{DriftKind, PodCheck, Verify};

/// This agent's node-wide programs, held open.
pub(super) struct OwnPrograms {
    cgroup: Vec<(&'static str, CgroupAttach, u32, OwnedFd)>,
    ingress: Option<(u32, OwnedFd)>,
}

impl OwnPrograms {
    /// The programs of `loaded` (name and id, as the backend put them in place), held open.
    ///
    /// # Errors
    /// When a program is already gone.
    pub(super) fn hold(loaded: &[(&'static str, u32)]) -> Result<Self, EbpfError> {
        let open = |name: &str, id: u32| {
            sys::prog_by_id(id).map_err(|e| EbpfError::io(&format!("holding {name}"), e))
        };
        let mut own = Self {
            cgroup: Vec::new(),
            ingress: None,
        };
        for &(name, id) in loaded {
            if name == programs::INGRESS {
                own.ingress = Some((id, open(name, id)?));
            } else if let Some(&(_, attach)) = CGROUP_PROGRAMS.iter().find(|(n, _)| *n == name) {
                own.cgroup.push((name, attach, id, open(name, id)?));
            }
        }
        Ok(own)
    }

    /// Compares every node-wide program with what the kernel runs, and with
    /// [`Verify::Repair`] puts back what differs.
    pub(super) fn verify(
        &self,
        pins: &Pins,
        cgroup_root: &Path,
        tc_prog: &OwnedFd,
        verify: Verify,
    ) -> PodCheck {
        let mut check = PodCheck::default();
        let cgroup = match fs::File::open(cgroup_root) {
            Ok(cgroup) => cgroup,
            Err(err) => {
                check.installed.push(format!(
                    "cgroup {} cannot be opened: {err}",
                    cgroup_root.display()
                ));
                return check;
            }
        };
        for (name, attach, id, prog) in &self.cgroup {
            let pin = pins.link(name);
            let found = link_state(&pin, &cgroup, *attach, *id);
            let what = match found {
                LinkState::InPlace(link_id) => {
                    check.installed.push(format!(
                        "{name}: link {link_id} on {} runs program {id}",
                        cgroup_root.display()
                    ));
                    continue;
                }
                LinkState::OtherProgram(other) => {
                    format!("the link of {name} runs program {other}, not this agent's {id}")
                }
                LinkState::Gone => format!("the pinned link of {name} is gone"),
                LinkState::Detached => format!(
                    "the link of {name} is detached from {}",
                    cgroup_root.display()
                ),
            };
            check
                .drift
                .push(verify.handle(DriftKind::CgroupLink, what, || {
                    put_back(&pin, &cgroup, *attach, prog, found)
                }));
        }
        if let Some((id, prog)) = &self.ingress {
            match sys::prog_array_id(tc_prog, 0) {
                Ok(found) if found == *id => check.installed.push(format!(
                    "{}: program {id} in {}",
                    programs::INGRESS,
                    maps::TC_PROG
                )),
                found => {
                    let what = found.map_or_else(
                        |_| format!("slot 0 of {} is empty", maps::TC_PROG),
                        |other| {
                            format!(
                                "slot 0 of {} holds program {other}, not this agent's {id}",
                                maps::TC_PROG
                            )
                        },
                    );
                    check
                        .drift
                        .push(verify.handle(DriftKind::TcProgram, what, || {
                            sys::prog_array_set(tc_prog, 0, prog)
                        }));
                }
            }
        }
        check
    }
}

/// Where a hook's pinned link stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkState {
    /// Pinned, attached, running this agent's program: the link's id.
    InPlace(u32),
    /// Pinned and attached, running another program.
    OtherProgram(u32),
    /// Not pinned (so not held by anything of meshcap's).
    Gone,
    /// Pinned, but its program no longer runs for the cgroup.
    Detached,
}

fn link_state(pin: &Path, cgroup: &fs::File, attach: CgroupAttach, own: u32) -> LinkState {
    let Ok(link) = sys::obj_get(pin) else {
        return LinkState::Gone;
    };
    let Ok((link_id, prog)) = sys::link_ids(&link) else {
        return LinkState::Detached;
    };
    let running = sys::effective_prog_ids(cgroup, attach).unwrap_or_default();
    if !running.contains(&prog) {
        return LinkState::Detached;
    }
    if prog == own {
        LinkState::InPlace(link_id)
    } else {
        LinkState::OtherProgram(prog)
    }
}

/// Puts this agent's `prog` back on the hook: switched in place on a link that runs another
/// program; a new link (first on the hook where the kernel orders them) pinned over the old pin
/// when the link is gone or detached.
fn put_back(
    pin: &Path,
    cgroup: &fs::File,
    attach: CgroupAttach,
    prog: &OwnedFd,
    found: LinkState,
) -> std::io::Result<()> {
    if let LinkState::OtherProgram(_) = found {
        return sys::link_update(sys::obj_get(pin)?, prog);
    }
    let link = match order::create_first(prog.as_fd(), cgroup, attach)? {
        Some(link) => link,
        None => sys::link_create(prog.as_fd(), cgroup, attach)?,
    };
    // bpffs refuses names with a dot.
    let name = pin
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staged = pin.with_file_name(format!("{name}_verified"));
    let _ = fs::remove_file(&staged);
    sys::obj_pin(&link, &staged)?;
    fs::rename(&staged, pin).inspect_err(|_| {
        let _ = fs::remove_file(&staged);
    })
}
