//! What a hand-back to istio-cni (`crate::uninstall::handback`) reads of an ambient pod
//! captured in the kernel: the capture it was enrolled with, from its workload record, so that
//! Istio's in-pod rules for it can be written without the API server.
use std::path::Path;

use super::{
    AmbientError,
    records::{Records, Workload},
};
use crate::{
    backend::{AmbientCapture, PodPolicy},
    pod::PodRef,
    policy::ambient::AmbientConfig,
};

/// The capture `workload` was enrolled with, under the node's settings now (`config`): none
/// in records of builds before the policy was kept.
pub(super) fn capture_of(workload: Workload, config: &AmbientConfig) -> Option<PodPolicy> {
    let mut policy = workload.policy?;
    policy.ipv6 = config.ipv6;
    policy.host_probe_snat = config.host_probe_snat;
    Some(PodPolicy::Ambient(Box::new(AmbientCapture {
        policy,
        ips: workload.ips,
        uid: workload.uid,
        service_account: workload.service_account,
    })))
}

/// The capture ambient mode recorded for `pod` when it enrolled it (the records under
/// `state_dir/ambient`), under the node's settings now: `None` when there is no record of it,
/// or one of a build that did not keep the policy.
///
/// # Errors
/// When the records' directory cannot be opened.
pub fn recorded_capture(
    state_dir: &Path,
    config: &AmbientConfig,
    pod: &PodRef,
) -> Result<Option<PodPolicy>, AmbientError> {
    let records = Records::open(state_dir.join("ambient").join("workloads"))?;
    Ok(records
        .of(pod)
        .and_then(|(_, workload)| capture_of(workload, config)))
}
