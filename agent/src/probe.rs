//! Can this kernel run the eBPF backend? Checks what the embedded programs actually use: their
//! program types, the helpers their instructions call (read from the object itself, so the
//! list never goes stale), the socket option the backend reads each pod's netns cookie with,
//! and a trial load of every program, which also validates their expected attach types. Every
//! answer is the kernel's own: no version number is consulted. The iptables backend is chosen
//! when anything fails, and the reason is logged and shown in `meshcap-agent status`. (The one
//! version check, whether inbound needs the socket lookup, is
//! [`assigns_to_reuseport_listeners`], which says why.)
use std::collections::BTreeSet;

use aya::{
    programs::{ProgramError, ProgramType},
    sys::{BpfHelper, is_helper_supported, is_program_supported},
};
use aya_obj::{Object, ProgramSection};
use serde::{Deserialize, Serialize};

pub use crate::backend::ebpf::assigns_to_reuseport_listeners;
use crate::{
    backend::ebpf,
    bpf, podnet,
    privilege::{self, Operation},
};

/// One probed feature.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// What was probed.
    pub what: String,
    /// Whether the kernel has it.
    pub ok: bool,
    /// The failure, when not ok.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// The probe's findings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// Every check, in order.
    pub checks: Vec<Check>,
}

impl ProbeReport {
    /// Whether everything passed.
    #[must_use]
    pub fn ok(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.ok)
    }

    /// The failed checks, in one line.
    #[must_use]
    pub fn failures(&self) -> String {
        self.checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| format!("{}: {}", c.what, c.detail))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn push(&mut self, what: String, result: Result<bool, ProbeError>) {
        let (ok, detail) = match result {
            Ok(true) => (true, String::new()),
            Ok(false) => (false, "not supported by this kernel".to_owned()),
            // A refusal (`EPERM`) names the capability lacking or its likely cause.
            Err(e) => match privilege::explain(Operation::Bpf, &e) {
                Some(why) => (false, format!("{e}: {why}")),
                None => (false, e.to_string()),
            },
        };
        self.checks.push(Check { what, ok, detail });
    }
}

/// Why a check could not say yes or no: its detail in the report.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    /// The embedded object does not parse.
    #[error(transparent)]
    Object(#[from] aya_obj::ParseError),
    /// A program is in a section the probe does not know.
    #[error("unexpected section {0}")]
    Section(String),
    /// A helper the probe cannot name.
    #[error("unknown to this agent's probe: add it to probe::KNOWN_HELPERS")]
    UnknownHelper,
    /// The kernel's answer to a program type or helper probe.
    #[error(transparent)]
    Kernel(#[from] ProgramError),
    /// The netns cookie cannot be read.
    #[error(transparent)]
    Cookie(#[from] podnet::PodNetError),
    /// The embedded object cannot be opened.
    #[error(transparent)]
    Open(#[from] bpf::ObjectError),
    /// A program does not load.
    #[error(transparent)]
    Load(#[from] bpf::ProgramLoadError),
    /// The pods' stub does not load.
    #[error(transparent)]
    Stub(#[from] ebpf::EbpfError),
}

fn program_type(section: &ProgramSection) -> Option<ProgramType> {
    Some(match section {
        ProgramSection::CgroupSockAddr { .. } => ProgramType::CgroupSockAddr,
        ProgramSection::CgroupSockopt { .. } => ProgramType::CgroupSockopt,
        ProgramSection::SockOps => ProgramType::SockOps,
        ProgramSection::SchedClassifier => ProgramType::SchedClassifier,
        ProgramSection::CgroupSock { .. } => ProgramType::CgroupSock,
        ProgramSection::CgroupSkb { .. } => ProgramType::CgroupSkb,
        ProgramSection::SkLookup => ProgramType::SkLookup,
        _ => return None,
    })
}

/// `BPF_JMP | BPF_CALL` with source register 0: a helper call (1 is a bpf-to-bpf call, 2 a
/// kfunc).
const HELPER_CALL: u8 = 0x05 | 0x80;

/// Helpers a meshcap program may call, so that an ID read from the object can be named and
/// probed (the kernel's enum has no checked conversion from a number).
const KNOWN_HELPERS: &[BpfHelper] = {
    use BpfHelper as H;
    &[
        H::BPF_FUNC_map_lookup_elem,
        H::BPF_FUNC_map_update_elem,
        H::BPF_FUNC_map_delete_elem,
        H::BPF_FUNC_ktime_get_ns,
        H::BPF_FUNC_trace_printk,
        H::BPF_FUNC_get_current_pid_tgid,
        H::BPF_FUNC_get_current_uid_gid,
        H::BPF_FUNC_get_socket_cookie,
        H::BPF_FUNC_get_netns_cookie,
        H::BPF_FUNC_perf_event_output,
        H::BPF_FUNC_skb_load_bytes,
        H::BPF_FUNC_skb_store_bytes,
        H::BPF_FUNC_l3_csum_replace,
        H::BPF_FUNC_l4_csum_replace,
        H::BPF_FUNC_redirect,
        H::BPF_FUNC_csum_diff,
        H::BPF_FUNC_skb_change_tail,
        H::BPF_FUNC_tail_call,
        H::BPF_FUNC_sk_lookup_tcp,
        H::BPF_FUNC_sk_lookup_udp,
        H::BPF_FUNC_skc_lookup_tcp,
        H::BPF_FUNC_sk_release,
        H::BPF_FUNC_sk_assign,
        H::BPF_FUNC_sk_fullsock,
        H::BPF_FUNC_tcp_sock,
        H::BPF_FUNC_get_listener_sock,
        H::BPF_FUNC_sk_storage_get,
        H::BPF_FUNC_sk_storage_delete,
        H::BPF_FUNC_sock_ops_cb_flags_set,
        H::BPF_FUNC_ringbuf_output,
        H::BPF_FUNC_ringbuf_reserve,
        H::BPF_FUNC_ringbuf_submit,
        H::BPF_FUNC_ringbuf_discard,
        H::BPF_FUNC_probe_read_kernel,
        H::BPF_FUNC_get_smp_processor_id,
        H::BPF_FUNC_skb_cgroup_id,
        H::BPF_FUNC_get_current_cgroup_id,
        H::BPF_FUNC_bind,
        H::BPF_FUNC_getsockopt,
        H::BPF_FUNC_setsockopt,
    ]
};

/// Probes the kernel for everything the embedded programs use.
#[must_use]
pub fn run() -> ProbeReport {
    let mut report = ProbeReport::default();
    let object = match Object::parse(bpf::object()) {
        Ok(object) => object,
        Err(e) => {
            report.push("parsing the embedded eBPF object".into(), Err(e.into()));
            return report;
        }
    };
    let mut types = BTreeSet::new();
    let mut helpers: Vec<(String, ProgramType, i32)> = Vec::new();
    for (name, program) in &object.programs {
        let Some(kind) = program_type(&program.section) else {
            report.push(
                format!("program {name}"),
                Err(ProbeError::Section(format!("{:?}", program.section))),
            );
            continue;
        };
        types.insert(format!("{kind:?}"));
        if let Some(function) = object.functions.get(&program.function_key()) {
            for insn in &function.instructions {
                if insn.code == HELPER_CALL && insn.src_reg() == 0 {
                    let entry = (format!("{kind:?}"), kind, insn.imm);
                    if !helpers.contains(&entry) {
                        helpers.push(entry);
                    }
                }
            }
        }
    }
    let mut probed = BTreeSet::new();
    for program in object.programs.values() {
        if let Some(kind) = program_type(&program.section)
            && probed.insert(format!("{kind:?}"))
        {
            report.push(
                format!("program type {kind:?}"),
                is_program_supported(kind).map_err(ProbeError::from),
            );
        }
    }
    for (type_name, kind, id) in helpers {
        let Some(helper) = KNOWN_HELPERS.iter().find(|h| **h as i32 == id) else {
            report.push(
                format!("helper #{id} in {type_name} programs"),
                Err(ProbeError::UnknownHelper),
            );
            continue;
        };
        report.push(
            format!("helper {helper:?} in {type_name} programs"),
            is_helper_supported(kind, *helper).map_err(ProbeError::from),
        );
    }
    // The pods' stubs are not in the object (the agent assembles them): their one helper.
    // Where they attach does not matter here: TCX links on 6.6+, netlink TC filters before.
    report.push(
        "helper BPF_FUNC_tail_call in the pods' TC stubs".into(),
        is_helper_supported(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_tail_call)
            .map_err(ProbeError::from),
    );
    // Not a BPF feature, but the backend keys each pod by its netns cookie, read this way.
    report.push(
        "socket option SO_NETNS_COOKIE (a pod's netns cookie)".into(),
        podnet::current_cookie()
            .map(|_| true)
            .map_err(ProbeError::from),
    );
    report.push(
        "trial load of every embedded program (with its attach type) and a pod's TC stub".into(),
        trial_load().map(|()| true),
    );
    report
}

/// Loads every embedded program and a pod's TC stub, and lets them go.
fn trial_load() -> Result<(), ProbeError> {
    let mut ebpf = bpf::open()?;
    bpf::load_all(&mut ebpf)?;
    Ok(ebpf::trial_load_stub(&ebpf)?)
}
