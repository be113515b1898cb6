//! Captures taken away: a pod's release (DEL, a failed ADD undone), and the captures whose
//! netns went without a DEL this agent saw — dropped at start, with whatever an interrupted
//! request left that nothing refers to, and while the agent runs.
use std::collections::HashSet;

use meshcap_common::flags;
use meshcap_policy::{DataplaneMode, MarkRoute, PolicyRoutes};

use super::{Pods, attach::restore_fwmark_accept};
use crate::{
    backend::ebpf::{EbpfError, pins::unpin_link, stub},
    crashpoint,
    pod::PodRef,
    podnet,
};

impl Pods {
    /// Stops capturing `pod` and removes everything of it. Idempotent; works when the netns
    /// is already gone.
    ///
    /// # Errors
    /// When the maps refuse.
    pub(in crate::backend::ebpf) fn release(&self, pod: &PodRef) -> Result<(), EbpfError> {
        let Some(cookie) = self.find_cookie(pod) else {
            return Ok(());
        };
        let pins = self.pins.pod(cookie);
        // Every ADD pins the pod's directory before it touches the netns or the maps: with
        // neither, nothing was ever captured here (a pod outside the mesh), and the netns is
        // left alone.
        if !pins.exists() && !self.lock().has_pod(cookie) {
            tracing::debug!(netns_cookie = cookie, "nothing captured in this netns");
            return Ok(());
        }
        // The policy routes the pod may have: TPROXY's (TPROXY mode or a rerouted interface)
        // and ambient mode's; only those (or both when nothing says) are looked for, and `lo`'s
        // stub only on an ambient pod (or when nothing says).
        let (routes, ambient) = {
            let mut tables = self.lock();
            let config = tables.remove_pod(cookie)?;
            crashpoint::here(crashpoint::EBPF_REMOVE_ENTRY);
            let rerouted = tables.remove_ifaces(cookie);
            tables.forget_cookie(cookie);
            let ambient = config.is_none_or(|c| c.has(flags::AMBIENT));
            let tproxy = config.is_none_or(|c| c.has(flags::TPROXY)) || (rerouted && !ambient);
            (
                [
                    tproxy.then(|| MarkRoute::tproxy(true)),
                    ambient.then(|| MarkRoute::ambient(true)),
                ],
                ambient,
            )
        };
        let records = pins.tc_records();
        let fwmark_accept = pins.fwmark_accept_before();
        let found = pins.found_routes();
        let detached = podnet::run_in(&pod.netns, |visit| {
            if let Some(value) = fwmark_accept {
                restore_fwmark_accept(value);
            }
            for record in &records {
                stub::detach(visit, record);
            }
            stub::detach_unrecorded(visit, &records, ambient);
            for route in routes.iter().flatten() {
                let installed = PolicyRoutes {
                    mark_route: Some(route.clone()),
                    loopback_addresses: Vec::new(),
                }
                .without_found(&found);
                let removed = visit.netlink().and_then(|netlink| {
                    podnet::route::update(netlink, &installed, &PolicyRoutes::default())
                });
                if let Err(err) = removed {
                    tracing::warn!(error = %err, rule = route.describe_rule(), "removing a policy route");
                }
            }
        });
        if detached.is_err() {
            // The netns is gone, and its devices with it: only the pins are left.
            for record in &records {
                let _ = unpin_link(record.path());
            }
        }
        crashpoint::here(crashpoint::EBPF_REMOVE_DETACHED);
        pins.remove();
        self.forget_netns(cookie);
        tracing::info!(netns_cookie = cookie, "released");
        Ok(())
    }

    /// At start: drops every capture whose netns no longer exists, in either mode, and the
    /// map entries an interrupted request left that no live pod refers to. The pins are listed
    /// before the namespaces are walked, as in [`Self::gone`].
    pub(in crate::backend::ebpf) fn prune_gone(&self) -> Result<Vec<PodRef>, EbpfError> {
        let pinned_pods = self.pins.pinned_pods();
        let live = podnet::live_cookies();
        let mut gone = Vec::new();
        let mut pinned = HashSet::new();
        for pod in pinned_pods {
            if live.contains(&pod.netns_cookie) {
                pinned.insert(pod.netns_cookie);
                continue;
            }
            let pod_ref = pod.pod_ref();
            self.release(&pod_ref)?;
            tracing::info!(pod = %pod_ref, container = %pod_ref.container_id, netns_cookie = pod.netns_cookie, "netns gone: entries and pins dropped");
            gone.push(pod_ref);
        }
        let orphans = self.lock().sweep_orphans(&pinned);
        if orphans > 0 {
            tracing::info!(
                entries = orphans,
                "dropped map entries an interrupted request left that no pod refers to"
            );
        }
        Ok(gone)
    }

    /// The pods of `mode` whose netns is gone, while the agent runs; remembered for
    /// [`Self::drop_if_gone`]. The pins are listed before the namespaces are walked: a pod
    /// pinned by an ADD running meanwhile, whose netns may be newer than the walk, is never
    /// judged on it.
    pub(in crate::backend::ebpf) fn gone(&self, mode: DataplaneMode) -> Vec<PodRef> {
        let pinned_pods = self.pins.pinned_pods();
        let live = podnet::live_cookies();
        let gone: Vec<_> = pinned_pods
            .into_iter()
            .filter(|pod| pod.mode() == mode && !live.contains(&pod.netns_cookie))
            .collect();
        *self.found_gone() = gone.iter().map(|pod| pod.netns_cookie).collect();
        gone.into_iter().map(|pod| pod.pod_ref()).collect()
    }

    /// Drops `pod`'s capture if its netns is still gone; whether it did. The container
    /// captured anew since [`Self::gone`] looked has another cookie, whose netns lives.
    pub(in crate::backend::ebpf) fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, EbpfError> {
        let Some(cookie) = self.find_cookie(pod) else {
            return Ok(false);
        };
        let known_gone = self.found_gone().contains(&cookie);
        if !known_gone && podnet::live_cookies().contains(&cookie) {
            return Ok(false);
        }
        self.release(pod)?;
        tracing::info!(pod = %pod, container = %pod.container_id, netns_cookie = cookie, "netns gone without a DEL this agent saw: entries and pins dropped");
        Ok(true)
    }

    fn found_gone(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.found_gone
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
