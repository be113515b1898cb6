//! Adopting the native nftables rules istio-cni left in a running pod's netns
//! ([`crate::backend::found`]): the tables the pod's rules write, as the kernel lists them
//! there, compared with the listing of the pod's transaction now applied in a scratch network
//! namespace of the agent's own (created for the comparison, gone with it). The same tables
//! are recorded as they are; others are left as they are, or, when asked (ambient mode's
//! reconciliation), replaced with the pod's in the one transaction that deletes them (never a
//! moment without a capture) and recorded.
use nix::sched::{CloneFlags, unshare};
use tracing::info;

use super::{
    NftablesBackend, NftablesRules, PodPolicy,
    nft::Nft,
    records::Applied,
    tables::{deletion, difference, listing},
};
use crate::{
    backend::{Adoption, BackendError},
    pod::PodRef,
};

impl NftablesBackend {
    /// [`crate::backend::CaptureBackend::adopt`] for the nftables backend.
    pub(super) fn adopt_pod(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        reconcile: bool,
    ) -> Result<Adoption, BackendError> {
        let (rules, mode, ambient) = Self::rules(policy);
        let present = |nft: &Nft| -> Result<Vec<&str>, BackendError> {
            let mut present = Vec::new();
            for table in rules.tables() {
                if nft.list(table)?.is_some() {
                    present.push(table);
                }
            }
            Ok(present)
        };
        // The scratch netns's listing only where there is something to compare it with: a
        // hand-back asks of every pod it hands back, nearly all of which hold nothing.
        if self.in_netns(pod, |nft, _| present(nft))?.is_empty() {
            return Ok(Adoption::Nothing);
        }
        let expected = scratch_listing(&rules)?;
        self.in_netns(pod, |nft, visit| {
            let present = present(nft)?;
            if present.is_empty() {
                return Ok(Adoption::Nothing);
            }
            let found = listing(nft, &rules)?;
            let missing_route = visit
                .netlink()
                .and_then(|netlink| crate::podnet::route::missing(netlink, &rules.routes))
                .map_err(|source| BackendError::PodNet {
                    pod: pod.to_string(),
                    source,
                })?
                .filter(|_| rules.routes.mark_route.is_some());
            let differs = difference(&expected, &found).or(missing_route);
            let tables = present.join(", ");
            let mut record = Applied {
                pod: pod.clone(),
                rules: rules.clone(),
                replacing: Vec::new(),
                listing: found,
                mode,
                ambient,
                found_routes: Vec::new(),
                adopted: true,
            };
            let Some(differs) = differs else {
                self.records.save(&record)?;
                info!(%tables, "adopted istio-cni's nftables rules as they are");
                return Ok(Adoption::Recognised(format!(
                    "nft ({tables}): the rules Istio writes for it now"
                )));
            };
            if !reconcile {
                return Ok(Adoption::NotRecognised(format!("nft ({tables}): {differs}")));
            }
            record.adopted = false;
            self.records.save(&Applied {
                listing: String::new(),
                ..record.clone()
            })?;
            nft.apply(&(deletion(present.iter().copied()) + &rules.transaction))?;
            crate::podnet::route::update(
                visit.netlink().map_err(|source| BackendError::PodNet {
                    pod: pod.to_string(),
                    source,
                })?,
                &meshcap_policy::PolicyRoutes::default(),
                &rules.routes,
            )
            .map_err(|source| BackendError::PodNet {
                pod: pod.to_string(),
                source,
            })?;
            record.listing = listing(nft, &rules)?;
            self.records.save(&record)?;
            info!(%tables, %differs, "istio-cni's nftables rules reconciled to the rules Istio writes now");
            Ok(Adoption::Reconciled(format!("nft ({tables}): {differs}")))
        })
    }
}

/// The listing of `rules`' tables as the kernel holds them once applied to a fresh network
/// namespace: one of this thread's own, made for it and gone with the thread.
fn scratch_listing(rules: &NftablesRules) -> Result<String, BackendError> {
    let rules = rules.clone();
    std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNET).map_err(|e| {
            BackendError::Unavailable(format!(
                "a scratch network namespace for comparing nftables rules: {e}"
            ))
        })?;
        let nft = Nft {
            who: "a scratch network namespace".to_owned(),
        };
        nft.apply(&rules.transaction)?;
        listing(&nft, &rules)
    })
    .join()
    .map_err(|_| BackendError::Unavailable("comparing nftables rules panicked".to_owned()))?
}
