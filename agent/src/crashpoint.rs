//! Named points in the agent's state changes where a test can have it die, as a SIGKILL or an
//! OOM kill would stop it: between two steps of an ADD, a DEL or an update; or pause there, to
//! make something else happen in between (a ztunnel connecting while a pod leaves). Compiled
//! only with the `crash-points` feature, which the end-to-end tests enable (the test build's
//! agent binary has it, inert unless `MESHCAP_CRASH_AT` or `MESHCAP_PAUSE_AT` names a point); a
//! release build never has it.
//!
//! The tests kill the agent at each point and check that its next start reaches a state in
//! which the pod is either fully captured as its policy says or fully released, with nothing
//! left that nothing refers to (tests/tests/crash.rs).

/// The environment variable naming the point to die at.
pub const ENV: &str = "MESHCAP_CRASH_AT";

/// The environment variable naming a point to pause at and a file, `POINT=PATH`: the agent
/// creates the file there and goes on when the test removes it (or after a minute).
pub const PAUSE_ENV: &str = "MESHCAP_PAUSE_AT";

/// Every point, for the tests to iterate over.
pub const POINTS: [&str; 19] = [
    EBPF_ADD_PINNED,
    EBPF_ADD_QDISC,
    EBPF_ADD_FILTER,
    EBPF_ADD_ATTACHED,
    EBPF_ADD_LISTS,
    EBPF_ADD_IFACES,
    EBPF_REMOVE_ENTRY,
    EBPF_REMOVE_DETACHED,
    IPTABLES_ADD_APPLIED,
    IPTABLES_ADD_RECORD_WRITTEN,
    IPTABLES_REMOVE_REMOVED,
    NFTABLES_ADD_APPLIED,
    NFTABLES_ADD_RECORD_WRITTEN,
    NFTABLES_REMOVE_REMOVED,
    AMBIENT_ADD_RECORDED,
    AMBIENT_ADD_HANDED,
    AMBIENT_ADD_PROBED,
    AMBIENT_REMOVE_PROBES,
    AMBIENT_REMOVE_TOLD,
];

/// Ambient mode's own points on an enrollment (its in-pod rules pass the iptables ones too).
pub const AMBIENT_ADD: [&str; 3] = [AMBIENT_ADD_RECORDED, AMBIENT_ADD_HANDED, AMBIENT_ADD_PROBED];
/// Ambient mode's own points on a removal.
pub const AMBIENT_REMOVE: [&str; 2] = [AMBIENT_REMOVE_PROBES, AMBIENT_REMOVE_TOLD];

/// eBPF ADD: the pod's record pinned, nothing attached yet.
pub const EBPF_ADD_PINNED: &str = "ebpf-add-pinned";
/// eBPF ADD: the clsact qdisc added to an interface (netlink TC), meshcap's filter not yet.
pub const EBPF_ADD_QDISC: &str = "ebpf-add-qdisc";
/// eBPF ADD: meshcap's filter attached on an interface (netlink TC), its record not yet
/// pinned.
pub const EBPF_ADD_FILTER: &str = "ebpf-add-filter";
/// eBPF ADD: its stubs attached, no map entry written.
pub const EBPF_ADD_ATTACHED: &str = "ebpf-add-attached";
/// eBPF ADD (and update): its lists written under a fresh pod id, no pod entry (for an update,
/// the old one still in place).
pub const EBPF_ADD_LISTS: &str = "ebpf-add-lists";
/// eBPF ADD: its interface entries written, no pod entry.
pub const EBPF_ADD_IFACES: &str = "ebpf-add-ifaces";
/// eBPF DEL: the pod entry removed, its lists and interface entries not yet.
pub const EBPF_REMOVE_ENTRY: &str = "ebpf-remove-entry";
/// eBPF DEL: everything detached and removed from the maps, its pins not yet.
pub const EBPF_REMOVE_DETACHED: &str = "ebpf-remove-detached";
/// iptables ADD: the rules applied, no record written.
pub const IPTABLES_ADD_APPLIED: &str = "iptables-add-applied";
/// iptables ADD: the record written to its temporary file, not renamed into place.
pub const IPTABLES_ADD_RECORD_WRITTEN: &str = "iptables-add-record-written";
/// iptables DEL: the rules removed, the record not yet.
pub const IPTABLES_REMOVE_REMOVED: &str = "iptables-remove-removed";
/// nftables ADD: the transaction run, its final record not written.
pub const NFTABLES_ADD_APPLIED: &str = "nftables-add-applied";
/// nftables ADD: a record written to its temporary file, not renamed into place.
pub const NFTABLES_ADD_RECORD_WRITTEN: &str = "nftables-add-record-written";
/// nftables DEL: the tables deleted, the record not yet.
pub const NFTABLES_REMOVE_REMOVED: &str = "nftables-remove-removed";
/// Ambient ADD: what ztunnel is to be told written, no in-pod rule applied.
pub const AMBIENT_ADD_RECORDED: &str = "ambient-add-recorded";
/// Ambient ADD: ztunnel acked the pod, its addresses not in the probe set.
pub const AMBIENT_ADD_HANDED: &str = "ambient-add-handed";
/// Ambient ADD: its addresses in the probe set, the ADD not answered.
pub const AMBIENT_ADD_PROBED: &str = "ambient-add-probed";
/// Ambient DEL: its addresses out of the probe set, ztunnel not told.
pub const AMBIENT_REMOVE_PROBES: &str = "ambient-remove-probes";
/// Ambient DEL: ztunnel told, the in-pod rules and the records still there.
pub const AMBIENT_REMOVE_TOLD: &str = "ambient-remove-told";
/// Hand back (`meshcap-agent uninstall --hand-back`): Istio's rules written for a pod, its
/// kernel capture not yet released (both in place). Not in [`POINTS`]: the agent never
/// reaches it.
pub const HAND_BACK_BOTH: &str = "hand-back-both";

/// Dies here (SIGKILL to itself: nothing runs on the way out) when `MESHCAP_CRASH_AT` names
/// `point`; pauses here when `MESHCAP_PAUSE_AT` does ([`PAUSE_ENV`]).
#[cfg(feature = "crash-points")]
pub fn here(point: &str) {
    if std::env::var(ENV).is_ok_and(|wanted| wanted == point) {
        tracing::warn!(point, "crash point reached: killing myself");
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    }
    if let Ok(pause) = std::env::var(PAUSE_ENV)
        && let Some((wanted, file)) = pause.split_once('=')
        && wanted == point
    {
        let file = std::path::Path::new(file);
        tracing::warn!(point, file = %file.display(), "pause point reached: waiting for the file to go");
        if std::fs::write(file, b"").is_ok() {
            for _ in 0..6_000 {
                if !file.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// Without the `crash-points` feature: nothing.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn here(_point: &str) {}
