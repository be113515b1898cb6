//! Live enrollment's retries: an enrollment that failed stays pending ([`crate::pending`])
//! and is tried again once due, until it is done or the pod should not be enrolled any more.
use k8s_openapi::api::core::v1::Pod;
use meshcap_policy::PodName;
use tracing::info;

use super::{LiveEnrollment, LiveError};
use crate::hub::CaptureError;

impl LiveEnrollment {
    /// Reconciles the pods whose pending enrollment is due, as last seen.
    pub(super) async fn retry_due(&self) {
        let due = self.hub.pending().due(self.ambient.ztunnels_greeted());
        if due.is_empty() {
            return;
        }
        let pods: Vec<Pod> = self
            .pods
            .values()
            .filter(|p| p.metadata.uid.as_ref().is_some_and(|u| due.contains(u)))
            .cloned()
            .collect();
        for pod in pods {
            self.reconcile(&pod).await;
        }
    }

    /// Keeps `uid`'s enrollment pending until it is done, and counts it: an enrollment refused
    /// for the pod's own sake (its annotations, or a decision that changed) waits for the pod's
    /// next change instead.
    pub(super) fn settle(&self, uid: &str, name: &PodName, enrolled: &Result<String, LiveError>) {
        let (pending, metrics) = (self.hub.pending(), self.hub.metrics());
        match enrolled {
            Ok(_) if pending.done(uid) => metrics.enrollment_retry("enrolled", pending.len()),
            Ok(_)
            | Err(LiveError::Enroll(CaptureError::NotEnrolled | CaptureError::Invalid(_))) => {
                pending.done(uid);
            }
            Err(err) => {
                let greeted = self.ambient.ztunnels_greeted();
                let attempts = pending.failed(uid, name.clone(), err.to_string(), greeted);
                metrics.enrollment_retry("failed", pending.len());
                info!(pod = %name, attempts, "the enrollment will be tried again");
            }
        }
    }
}
