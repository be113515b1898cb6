//! The kernel probe behind `--backend auto`: it knows every helper the embedded programs
//! call (an unknown one would silently send every node to the iptables fallback), and on a
//! kernel with the eBPF path's features it chooses eBPF.
use meshcap_agent::probe;
use meshcap_tests::require_root;

#[test]
fn auto_chooses_ebpf_where_the_kernel_can_run_it() {
    require_root();
    let report = probe::run();
    let unknown: Vec<_> = report
        .checks
        .iter()
        .filter(|check| check.detail.contains("unknown"))
        .collect();
    assert!(unknown.is_empty(), "the probe does not know: {unknown:?}");
    // The machines this suite runs on (and the VM kernels of `cargo xtask integration`, 6.1
    // and 6.12) have every program type and helper the eBPF path uses; TCX (6.6) is not
    // required: pods' inbound stubs attach as netlink TC filters without it.
    assert!(report.ok(), "probe: {}", report.failures());
    assert!(
        report
            .checks
            .iter()
            .any(|check| check.what.contains("BPF_FUNC_tail_call")),
        "the probe must check the stubs' tail call: {:?}",
        report.checks
    );
}
