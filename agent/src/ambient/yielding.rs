//! What ambient mode does when istio-cni's agent takes the ZDS socket's path on this node (the
//! node being handed back to istio-cni, docs/install.md "Rolling back"): before that agent
//! writes its in-pod rules into every enrolled pod (`reconcileExistingPod`, which it does only
//! once its informers have synced, after it listens), conntrack's loose pickup is turned off in
//! each pod the kernel captures.
//!
//! Istio's `nat` rules start conntrack in the pod's netns. The kernel capture uses none, so
//! with loose pickup (`net.netfilter.nf_conntrack_tcp_loose`, 1 by default) the next packet of
//! a connection the kernel carried would be taken as a new connection and redirected mid-stream
//! (a plaintext inbound connection ztunnel took is reset: [`crate::podnet::conntrack`]). The
//! hand-back at meshcap's exit turns it off too; this does it before istio-cni's rules come.
use tracing::{info, warn};

use super::records::Records;
use crate::podnet;

/// Turns loose pickup off in the netns of every pod `records` holds, when the kernel captures
/// ambient pods on this node (`in_kernel`); a pod whose netns is gone or whose kernel has no
/// conntrack to load is skipped. Pods adopted from istio-cni there hold Istio's rules, whose conntrack has
/// tracked each of their connections from its first packet: nothing changes for them.
pub(super) fn before_istio_cni(records: &Records, in_kernel: bool) {
    if !in_kernel {
        return;
    }
    let (mut done, mut without) = (0usize, 0usize);
    for (_, workload) in records.all() {
        let pod = workload.pod();
        match podnet::run_in(&pod.netns, |_| podnet::conntrack::no_loose_pickup()) {
            Ok(Ok(true)) => done += 1,
            Ok(Ok(false)) => without += 1,
            Ok(Err(err)) => warn!(pod = %pod, error = %err, "turning conntrack's loose pickup off"),
            Err(err) => warn!(pod = %pod, error = %err, "entering the pod's network namespace"),
        }
    }
    info!(
        pods = done,
        without_conntrack = without,
        "istio-cni's agent listens on the ZDS socket: conntrack's loose pickup is off in the pods \
         the kernel captures, before its in-pod rules arrive"
    );
}
