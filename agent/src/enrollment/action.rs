//! What to do with one running pod: its decision (the same as a CNI ADD's), its phase, and
//! what the node holds for it.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy as policy;
use meshcap_policy::{DataplaneMode, Decision, DecisionError, NodeSettings, ambient::ambient_keys};

use crate::pod::PodRef;

/// What to do with one pod.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Action {
    Enroll,
    Unenroll(PodRef),
    /// Not enrolled here and not to be, but annotated as enrolled: an enrollment cut off
    /// (the agent stopped between the annotation and its record) whose pod then left ambient
    /// mode while the agent was away. Istio removes the annotation of a pod annotated as
    /// enrolled that should not be (`informers.go`, `reconcilePod`: `RemovePodFromMesh`).
    Unannotate,
    Nothing,
}

/// What to do with `pod`, whose namespace carries `namespace_labels`, given its enrollment on
/// this node.
pub(super) fn decide(
    pod: &Pod,
    namespace_labels: &BTreeMap<String, String>,
    settings: &NodeSettings,
    enrolled: Option<PodRef>,
) -> Action {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let terminated = matches!(phase, Some("Succeeded" | "Failed"));
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let ips = policy::status_pod_ips(pod);
    let should = match policy::decide(pod, &ips, namespace_labels, settings) {
        Ok(Decision::Ambient { .. }) => !terminated,
        Ok(Decision::Skip { .. } | Decision::Sidecar { .. })
        | Err(DecisionError {
            dataplane: DataplaneMode::Sidecar,
            ..
        }) => false,
        // Annotations that do not parse: an ADD would fail, a running pod stays as it is.
        Err(_) => return Action::Nothing,
    };
    let annotated = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ambient_keys::REDIRECTION))
        .is_some_and(|value| value == "enabled");
    match enrolled {
        Some(target) if !should => Action::Unenroll(target),
        None if should && !deleting && phase == Some("Running") && !ips.is_empty() => {
            Action::Enroll
        }
        None if !should && annotated && !terminated && !deleting => Action::Unannotate,
        _ => Action::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use k8s_openapi::{
        api::core::v1::{PodIP, PodStatus},
        apimachinery::pkg::apis::meta::v1::Time,
    };
    use meshcap_policy::{SelectConfig, ambient::AmbientConfig};

    use super::*;
    use crate::pod::InPlace;

    /// A pod of namespace `shop` with `labels`, in `phase`, with an address unless `None`.
    fn pod(labels: &[(&str, &str)], phase: &str, ip: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some("web".to_owned());
        pod.metadata.namespace = Some("shop".to_owned());
        pod.metadata.uid = Some("uid-web".to_owned());
        pod.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        pod.status = Some(PodStatus {
            phase: Some(phase.to_owned()),
            pod_ips: ip.map(|ip| vec![PodIP { ip: ip.to_owned() }]),
            ..PodStatus::default()
        });
        pod
    }

    fn enrolled() -> Option<PodRef> {
        Some(PodRef {
            namespace: "shop".to_owned(),
            name: "web".to_owned(),
            container_id: InPlace::Ambient.container_id("uid-web"),
            netns: PathBuf::from("/var/run/netns/web"),
        })
    }

    const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

    fn action(pod: &Pod, namespace: &[(&str, &str)], enrolled: Option<PodRef>) -> Action {
        let labels = namespace
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let settings = NodeSettings {
            select: SelectConfig {
                exclude_namespaces: Vec::new(),
            },
            ambient: Some(AmbientConfig::default()),
        };
        decide(pod, &labels, &settings, enrolled)
    }

    #[test]
    fn a_running_pod_joins_and_leaves_as_istios_informers_decide() {
        let running = pod(&[AMBIENT], "Running", Some("10.0.0.2"));
        assert_eq!(action(&running, &[], None), Action::Enroll);
        assert_eq!(action(&running, &[], enrolled()), Action::Nothing);
        // By its namespace, unless the pod says none.
        let unlabelled = pod(&[], "Running", Some("10.0.0.2"));
        assert_eq!(action(&unlabelled, &[AMBIENT], None), Action::Enroll);
        let none = pod(
            &[("istio.io/dataplane-mode", "none")],
            "Running",
            Some("10.0.0.2"),
        );
        assert_eq!(action(&none, &[AMBIENT], None), Action::Nothing);
        assert_eq!(
            action(&none, &[AMBIENT], enrolled()),
            Action::Unenroll(enrolled().expect("enrolled"))
        );
        assert_eq!(
            action(&unlabelled, &[], enrolled()),
            Action::Unenroll(enrolled().expect("enrolled"))
        );
    }

    #[test]
    fn only_a_running_pod_with_an_address_is_enrolled_and_a_finished_one_leaves() {
        assert_eq!(
            action(&pod(&[AMBIENT], "Pending", Some("10.0.0.2")), &[], None),
            Action::Nothing
        );
        assert_eq!(
            action(&pod(&[AMBIENT], "Running", None), &[], None),
            Action::Nothing
        );
        let mut deleting = pod(&[AMBIENT], "Running", Some("10.0.0.2"));
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(action(&deleting, &[], None), Action::Nothing);
        for phase in ["Succeeded", "Failed"] {
            assert_eq!(
                action(&pod(&[AMBIENT], phase, Some("10.0.0.2")), &[], enrolled()),
                Action::Unenroll(enrolled().expect("enrolled")),
                "{phase}"
            );
        }
    }

    /// A pod annotated as enrolled that is not enrolled here and should not be loses the
    /// annotation; one that should be is enrolled (which annotates it again); an enrolled one
    /// leaves as before; a finished or deleting one is left alone.
    #[test]
    fn a_stale_enrollment_annotation_is_removed() {
        let annotated = |labels: &[(&str, &str)], phase: &str| {
            let mut pod = pod(labels, phase, Some("10.0.0.2"));
            pod.metadata.annotations =
                Some([(ambient_keys::REDIRECTION.to_owned(), "enabled".to_owned())].into());
            pod
        };
        let left = annotated(&[], "Running");
        assert_eq!(action(&left, &[], None), Action::Unannotate);
        assert_eq!(
            action(&left, &[], enrolled()),
            Action::Unenroll(enrolled().expect("enrolled"))
        );
        assert_eq!(
            action(&annotated(&[AMBIENT], "Running"), &[], None),
            Action::Enroll
        );
        assert_eq!(
            action(&annotated(&[], "Succeeded"), &[], None),
            Action::Nothing
        );
        let mut deleting = annotated(&[], "Running");
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(action(&deleting, &[], None), Action::Nothing);
        let mut other = annotated(&[], "Running");
        other.metadata.annotations =
            Some([(ambient_keys::REDIRECTION.to_owned(), "disabled".to_owned())].into());
        assert_eq!(action(&other, &[], None), Action::Nothing);
    }

    #[test]
    fn annotations_that_do_not_parse_leave_a_running_pod_as_it_is() {
        let mut bad = pod(&[AMBIENT], "Running", Some("10.0.0.2"));
        bad.metadata.annotations = Some(
            [(
                "istio.io/reroute-virtual-interfaces".to_owned(),
                "not an interface!".to_owned(),
            )]
            .into(),
        );
        assert_eq!(action(&bad, &[], enrolled()), Action::Nothing);
        assert_eq!(action(&bad, &[], None), Action::Nothing);
    }
}
