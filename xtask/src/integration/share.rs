//! Which tests each guest runs, and what running them there proves.
//!
//! The host runs the whole suite on its own kernel (x86, 6.18). A guest runs only what crosses
//! a kernel path that differs on its kernel or architecture, not the agent's own logic (its
//! install, the API, metrics, ZDS, records, crash points), which is the same code on every
//! kernel and is proven once on the host: under TCG a guest test costs 3 to 10 times its host
//! time, and CI's budget pays for what a kernel proves, not for running every binary
//! everywhere (docs/development.md, "Which tests run where"). `--whole-suite` runs every test
//! the VMs can (all but `build::HOST_ONLY`) on any guest.
use crate::arch::Arch;

/// The oldest kernel the eBPF backend runs on (docs/ebpf.md: `bpf_get_netns_cookie` in
/// sock_ops and cgroup_sockopt programs, 5.15); older ones run the iptables fallback.
const EBPF_FLOOR: (u32, u32) = (5, 15);

/// The oldest kernel series the native nftables backend's tests run on (issue 37: 6.1 and
/// 6.12, the kernels Istio's nftables mode is used with; 5.10 keeps the iptables fallback).
const NATIVE_NFTABLES_FLOOR: (u32, u32) = (6, 1);

/// A kernel series' major and minor version (`6.1` → (6, 1)).
fn version(series: &str) -> (u32, u32) {
    let mut parts = series.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Whether the tests must find the eBPF backend usable on a kernel of `series` (the tests'
/// oracle, not the agent's, which probes: `meshcap_tests::ebpf_runs_here`).
pub fn runs_ebpf(series: &str) -> bool {
    version(series) >= EBPF_FLOOR
}

/// Whether a guest of `series` may run the native nftables backend's tests.
pub fn runs_native_nftables(series: &str) -> bool {
    version(series) >= NATIVE_NFTABLES_FLOOR
}

/// A guest's share of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Share {
    /// A kernel below the eBPF floor (5.10): the iptables fallback.
    Fallback,
    /// A kernel of the host's architecture that runs the eBPF backend (6.1, the oldest).
    Ebpf,
    /// A kernel of another architecture (arm64's 6.12).
    Cross,
}

impl Share {
    /// The share of a guest running a kernel of `series` for `arch`.
    pub fn of(series: &str, arch: Arch) -> Self {
        if Arch::host() != Some(arch) {
            Self::Cross
        } else if !runs_ebpf(series) {
            Self::Fallback
        } else {
            Self::Ebpf
        }
    }

    /// The share's selections of `binary::test` names (`*` for any characters; the VM init's
    /// `selected`), each with what it proves on such a kernel.
    pub fn tests(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Fallback => FALLBACK,
            Self::Ebpf => EBPF,
            Self::Cross => CROSS,
        }
    }
}

/// Below the eBPF floor: the kernel's own answers choose the fallback, and Istio's rules work
/// on that kernel's netfilter (its xt matches and targets, ipset, TPROXY, conntrack marks).
const FALLBACK: &[(&str, &str)] = &[
    (
        "probe::",
        "the probe's answer: what this kernel lacks, by name",
    ),
    (
        "standalone::auto_runs_the_backend_the_kernel_can_run",
        "the agent's automatic choice of the iptables fallback, naming each missing feature",
    ),
    (
        "ambient::in_kernel_required_where_the_ebpf_backend_does_not_serve_is_refused",
        "`ambient.inKernel: required` refused where the kernel cannot run it",
    ),
    (
        "scenarios::iptables_agent_through_the_plugin",
        "every row of the semantics table through Istio's iptables rules, written by the real \
         agent and plugin",
    ),
    (
        "streams::edge_cases_through_istios_rules",
        "half-closes, resets and large writes through the REDIRECT and TPROXY paths",
    ),
    (
        "ambient::an_ambient_pod_is_captured_for_ztunnel_and_released::iptables",
        "ambient mode's in-pod rules and the node's probe rule (ipset) for ztunnel",
    ),
    (
        "ambient::two_ambient_pods_talk_over_hbone_and_dns_is_proxied",
        "HBONE and DNS over UDP and TCP through Istio's in-pod rules",
    ),
];

/// The oldest kernel that runs the eBPF backend: its verifier, netlink TC without TCX, the
/// socket hand-off before 6.5, cgroup programs without `BPF_F_BEFORE`, and Istio's nftables
/// rules on its nf_tables.
const EBPF: &[(&str, &str)] = &[
    ("probe::", "the probe's answer"),
    (
        "standalone::auto_runs_the_backend_the_kernel_can_run",
        "the agent's automatic choice of the eBPF backend",
    ),
    (
        "connect4::",
        "every embedded program through this verifier; connect4 on a cgroup",
    ),
    (
        "scenarios::ebpf_agent_through_the_plugin",
        "every row of the semantics table in the kernel programs, through the agent and plugin",
    ),
    (
        "scenarios::nftables_agent_through_the_plugin",
        "every row through Istio's native nftables rules on this nf_tables",
    ),
    (
        "backend::",
        "the eBPF backend's life cycle: pins, adoption, netlink TC, the socket hand-off, release",
    ),
    (
        "reset::",
        "a SYN no proxy takes answered as a closed port answers it, with and without offload",
    ),
    (
        "timewait::ebpf_",
        "a client port reused while the pod's end is in TIME_WAIT reaches the proxy through the \
         socket lookup, before 6.5 and before 6.10's refusal of a request socket under it",
    ),
    (
        "streams::edge_cases_through_ebpf",
        "half-closes, resets and large writes through the kernel programs",
    ),
    (
        "coexist::",
        "another load balancer's cgroup programs beside meshcap's, in this kernel's order",
    ),
    (
        "upgrade::",
        "a restarted agent swaps every program in place without a gap, over netlink TC",
    ),
    (
        "ambient::an_ambient_pod_is_captured_in_the_kernel",
        "ambient mode's capture in the kernel programs for ztunnel, and its release",
    ),
    (
        "ambient::two_ambient_pods_in_the_kernel",
        "HBONE and DNS between two ambient pods captured in the kernel",
    ),
    (
        "ambient::an_ambient_pod_is_captured_for_ztunnel_and_released::nftables",
        "ambient mode's in-pod rules and the node's probe rule with native nftables",
    ),
    (
        "takeover::a_sidecar_pod_istio_cni_captured_is_adopted::ebpf",
        "a sidecar pod istio-cni captured adopted by the rules in front of the kernel programs, \
         a new pod beside it captured in the kernel",
    ),
    (
        "takeover::an_adopted_sidecar_pod_moves_to_the_kernel",
        "a pod moved live from Istio's rules to the kernel programs: this kernel's NAT hook \
         against TC's assignment, conntrack after the rules, the socket lookup before 6.5",
    ),
    (
        "natchain::",
        "a nat rule added in a captured pod's netns: this kernel's NAT hook takes TC's \
         assignment back, and the socket lookup gives the SYN the proxy's listener",
    ),
    (
        "handback::a_",
        "a pod handed back live from the kernel programs to Istio's rules: the same NAT hook \
         while the rules arrive, conntrack's loose pickup off, held connections kept",
    ),
    (
        "takeover::a_sidecar_pod_whose_rules_istio_writes_differently_now_is_left_and_reported",
        "rules istio-cni wrote that this kernel's netfilter lists back otherwise than Istio's \
         now are left untouched, never stacked on",
    ),
    (
        "ambient::a_pod_istio_cni_enrolled_is_adopted_where_the_kernel_captures",
        "an ambient pod istio-cni enrolled keeps Istio's in-pod rules and its ztunnel, and this \
         kernel's programs never also capture it",
    ),
    (
        "ambient::an_enrollment_in_the_kernel_before_ztunnel_connects_is_retried",
        "an enrollment rolled back takes only the kernel capture and routes meshcap added on \
         this kernel, and is retried until ztunnel takes the pod",
    ),
    (
        "ambient::an_ambient_pod_captured_in_the_kernel_is_handed_back",
        "an ambient pod handed back from this kernel's programs to Istio's in-pod rules, \
         staying in ztunnel",
    ),
    (
        "ambient::an_ambient_pod_istio_cnis_agent_reconciled_is_handed_back",
        "istio-cni's agent writing its in-pod rules on top of this kernel's capture (a node \
         handed back): both capture the pod, and the hand-back keeps Istio's rules as written",
    ),
    (
        "switch::istio_cnis_exit_on_the_node_is_survived",
        "istio-cni's exit clean-up (its host rules and probe sets on this kernel) survived by \
         the node meshcap took over",
    ),
];

/// Another architecture: the kernel programs through its JIT and on its kernel's own
/// structures, and the fallback's rules written by that architecture's iptables; 6.12 has TCX.
/// The backend's bookkeeping (records, pins, adoption, a full table, netlink TC's records),  Istio's
/// nftables rules (nf_tables is the same C on every architecture) and two pods' programs side
/// by side are the same on every architecture: the host and 6.1 run them.
pub const CROSS: &[(&str, &str)] = &[
    (
        "scenarios::ebpf_agent_through_the_plugin",
        "every row of the semantics table in the kernel programs, through the real agent and \
         plugin",
    ),
    (
        "scenarios::iptables_agent_through_the_plugin",
        "every row through Istio's iptables rules written by the arm64 iptables the image \
         ships (the fallback on an arm64 node's older kernel)",
    ),
    (
        "scenarios::*with_tcx",
        "the inbound rows with the pods' programs attached as TCX links",
    ),
    (
        "backend::identical_loopback_tuples",
        "two pods' identical loopback 4-tuples kept apart in the kernel's maps",
    ),
    (
        "backend::closed_captured_connections",
        "a closed connection's entries gone from the kernel's maps",
    ),
    (
        "backend::the_app_sees_its_dialled_peer",
        "getpeername's dialled peer after the proxy closed (a race the slower CPUs showed)",
    ),
    (
        "backend::a_connection_let_through",
        "a connection let through after its 4-tuple was captured reaches the app",
    ),
    (
        "ambient::an_ambient_pod_is_captured_in_the_kernel",
        "ambient mode's capture in the kernel programs for ztunnel, and its release",
    ),
    (
        "ambient::two_ambient_pods_in_the_kernel",
        "HBONE between two ambient pods, DNS over UDP and TCP and IPv6 through the stand-in \
         ztunnel, captured in the kernel",
    ),
    (
        "connect4::",
        "every embedded program through the verifier; connect4 on a cgroup",
    ),
    ("probe::", "the kernel probe's answer"),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every selection names a test binary of `tests/tests/` that the VMs run.
    #[test]
    fn every_selection_names_a_binary_the_guests_run() {
        let dir = crate::cmd::root().join("tests/tests");
        for share in [Share::Fallback, Share::Ebpf, Share::Cross] {
            for (selection, why) in share.tests() {
                assert!(!why.is_empty(), "{selection}");
                let mut parts = selection.split("::");
                let binary = parts.next().unwrap_or_default();
                let source = std::fs::read_to_string(dir.join(format!("{binary}.rs")))
                    .unwrap_or_else(|_| {
                        panic!("{share:?}: {selection}: no tests/tests/{binary}.rs")
                    });
                let test = parts.next().unwrap_or_default();
                for fragment in test.split('*').filter(|f| !f.is_empty()) {
                    assert!(
                        source.contains(fragment),
                        "{share:?}: {selection}: no test of {binary} has {fragment:?} in its name"
                    );
                }
                assert!(
                    !super::super::build::HOST_ONLY
                        .iter()
                        .any(|(h, _)| *h == binary),
                    "{share:?}: {selection} is host-only"
                );
            }
        }
    }
}
