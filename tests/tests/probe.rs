//! The kernel probe behind `--backend auto`: it knows every helper the embedded programs
//! call (an unknown one would silently send every node to the iptables fallback), and its
//! answer is the one the runner expects of this kernel (every feature on the host's and on
//! 6.1 and 6.12; on 5.10 the missing ones named, see `standalone::auto_runs_…`).
use std::io::Write as _;

use meshcap_agent::probe;
use meshcap_tests::require_root;

#[test]
fn the_probe_knows_every_helper_and_answers_as_the_kernel_does() {
    require_root();
    let report = probe::run();
    let unknown: Vec<_> = report
        .checks
        .iter()
        .filter(|check| check.detail.contains("unknown to this agent's probe"))
        .collect();
    assert!(unknown.is_empty(), "the probe does not know: {unknown:?}");
    // The findings, one line each, for the kernel table of docs/ebpf.md: straight to the
    // stderr fd, so that the VMs' consoles show them for a passing test too.
    let mut stderr = std::io::stderr().lock();
    for check in &report.checks {
        let answer = if check.ok { "yes" } else { "NO" };
        let why = check.detail.lines().next().unwrap_or_default();
        let _ = writeln!(stderr, "probe: {answer}: {} {why}", check.what);
    }
    drop(stderr);
    for must in ["BPF_FUNC_tail_call", "SO_NETNS_COOKIE"] {
        assert!(
            report.checks.iter().any(|check| check.what.contains(must)),
            "the probe must check {must}: {:?}",
            report.checks
        );
    }
    // TCX (6.6) is not required: pods' inbound stubs attach as netlink TC filters without it.
    // `ebpf_runs_here` fails the test when the probe's answer is not the runner's.
    assert_eq!(
        meshcap_tests::ebpf_runs_here(),
        report.ok(),
        "probe: {}",
        report.failures()
    );
}
