//! A capture compared with what it should be: the pod's entry and lists in the maps against
//! its policy's, the node-wide programs' links, and every stub (and the socket lookup
//! program) against the kernel. What differs is named, for CHECK (and for whatever puts a
//! capture back in place: [`super::Pods::capture`] re-attaches what is gone).
use meshcap_common::flags;

use super::{Pods, encode};
use crate::{
    backend::{
        PodPolicy,
        ebpf::{EbpfError, node, sys, tc},
    },
    pod::PodRef,
    podnet,
};

impl Pods {
    /// Verifies `pod` is captured exactly as `policy` says and its stubs are attached.
    ///
    /// # Errors
    /// What is missing or different ([`EbpfError::Pod`]), or a failure to look.
    pub(in crate::backend::ebpf) fn check(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
    ) -> Result<(), EbpfError> {
        let entries = encode::policy_entries(policy);
        let cookie = podnet::cookie_of(&pod.netns)?;
        let config = self
            .lock()
            .pods
            .get(&cookie, 0)
            .map_err(|_| EbpfError::pod(pod, "not captured: no entry for its netns"))?;
        let handoff = if self.handoff.is_some() {
            flags::HANDOFF
        } else {
            0
        };
        let want = (entries.config.flags | handoff) & !flags::EXCLUDED_ROUTES;
        if config.flags & !flags::EXCLUDED_ROUTES != want
            || config.proxy_uid != entries.config.proxy_uid
            || config.proxy_gid != entries.config.proxy_gid
        {
            return Err(EbpfError::pod(
                pod,
                format!("captured with a different configuration: {config:?}"),
            ));
        }
        if let Some(differ) = self.lock().lists_differ(config.pod_id, &entries) {
            return Err(EbpfError::pod(pod, format!("captured, but {differ}")));
        }
        node::check_cgroup_links(&self.pins).map_err(|err| EbpfError::pod(pod, err.to_string()))?;
        let pins = self.pins.pod(cookie);
        let records = pins.tc_records();
        if records.is_empty() {
            return Err(EbpfError::pod(pod, "no inbound TC program attached"));
        }
        if handoff != 0 && sys::obj_get(&pins.handoff_link()).is_err() {
            return Err(EbpfError::pod(
                pod,
                "no socket lookup program on its netns (inbound to a SO_REUSEPORT proxy listener would be dropped)",
            ));
        }
        podnet::run_in(&pod.netns, |visit| {
            records
                .iter()
                .try_for_each(|record| tc::verify(visit, record))
        })?
        .map_err(|drift| EbpfError::pod(pod, drift.to_string()))
    }
}
