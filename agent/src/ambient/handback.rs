//! What a hand-back to istio-cni (`crate::uninstall::handback`) reads of an ambient pod
//! captured in the kernel: the capture it was enrolled with, from its workload record, so that
//! Istio's in-pod rules for it can be written without the API server.
use std::path::Path;

use meshcap_policy::ambient::AmbientConfig;

use super::{
    AmbientError,
    records::{Records, Workload},
};
use crate::{
    backend::{AmbientCapture, PodPolicy},
    pod::PodRef,
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

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use meshcap_policy::ambient::{EnablementSelector, HostProbeSnat, InpodPolicy};

    use super::*;

    fn workload(policy: Option<InpodPolicy>) -> Workload {
        Workload {
            container_id: "sandbox-1".into(),
            uid: "uid-1".into(),
            name: "web".into(),
            namespace: "shop".into(),
            service_account: "web-sa".into(),
            netns: "/var/run/netns/web".into(),
            policy,
            ips: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))],
        }
    }

    #[test]
    fn the_recorded_policy_is_given_back_under_the_nodes_settings_now() {
        let enrolled = InpodPolicy {
            inbound: true,
            dns: false,
            virtual_interfaces: vec!["tap0".into()],
            ipv6: true,
            host_probe_snat: HostProbeSnat::default(),
        };
        let mut config =
            AmbientConfig::new(EnablementSelector::istio_defaults()).expect("Istio's selectors");
        config.ipv6 = false;
        config.host_probe_snat.v4 = Ipv4Addr::new(169, 254, 7, 1);
        let Some(PodPolicy::Ambient(capture)) =
            capture_of(workload(Some(enrolled.clone())), &config)
        else {
            panic!("an ambient capture");
        };
        let want = InpodPolicy {
            ipv6: false,
            host_probe_snat: config.host_probe_snat,
            ..enrolled
        };
        assert_eq!(
            capture.policy, want,
            "the pod's own choices kept, the node's now"
        );
        assert_eq!(capture.ips, [IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))]);
        assert_eq!(
            (capture.uid.as_str(), capture.service_account.as_str()),
            ("uid-1", "web-sa")
        );
    }

    #[test]
    fn a_record_without_its_policy_gives_nothing_to_hand_back() {
        let config =
            AmbientConfig::new(EnablementSelector::istio_defaults()).expect("Istio's selectors");
        assert_eq!(capture_of(workload(None), &config), None);
    }
}
