//! The kernel probe behind `--backend auto`: it knows every helper the embedded programs
//! call (an unknown one would silently send every node to the iptables fallback), and on a
//! kernel with the eBPF path's features it chooses eBPF.
use aya::util::KernelVersion;
use meshcap_agent::probe;
use meshcap_tests::require_root;

#[test]
fn auto_chooses_ebpf_exactly_where_the_kernel_can_run_it() {
    require_root();
    let report = probe::run();
    let unknown: Vec<_> = report
        .checks
        .iter()
        .filter(|check| check.detail.contains("unknown"))
        .collect();
    assert!(unknown.is_empty(), "the probe does not know: {unknown:?}");
    // The machines this suite runs on (and the VM kernels of `cargo xtask integration`) have
    // every program type and helper; what differs is TCX, from Linux 6.6.
    let tcx = KernelVersion::current().expect("kernel version") >= KernelVersion::new(6, 6, 0);
    assert_eq!(report.ok(), tcx, "probe: {}", report.failures());
}
