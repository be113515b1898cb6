//! A pod's tables compared with its record, for the verifier (and `explain`), in one visit to
//! its netns, and put back in place.
//!
//! The comparison is CHECK's: the tables as the kernel lists them now (`nft -s list table`,
//! counters left out) against the listing recorded right after they were applied — but only
//! when the namespace's nf_tables generation ([`crate::podnet::nftgen`], one netlink request)
//! changed since the tables were last found as applied, which the agent keeps across restarts
//! ([`crate::backend::baseline`]). Tables that differ are replaced in one transaction (the
//! pod's own, after deleting them), so that no instant sees less of the capture than before the
//! repair; a missing policy route is added.
use super::{Applied, NftablesBackend, deletion, difference, listing};
use crate::{
    backend::{
        BackendError, DriftKind, PodCheck, Verify, baseline::Baseline, records::Record as _,
        rules_backend::route_drift,
    },
    pod::PodRef,
    podnet::nftgen,
};

impl NftablesBackend {
    /// Compares `pod`'s tables (and route) with its record; with [`Verify::Repair`] puts back
    /// what differs.
    pub(super) fn verify_pod(
        &self,
        pod: &PodRef,
        verify: Verify,
    ) -> Result<PodCheck, BackendError> {
        let describe = |record: &Applied| {
            format!(
                "{} rules via nft: tables {}",
                record.whose(),
                record.rules.tables().join(", ")
            )
        };
        let (mut check, id, record) = match self.records.to_verify(pod, describe) {
            Ok(found) => found,
            Err(check) => return Ok(check),
        };
        let rules = &record.rules;
        let baseline = self.baselines.get(&id);
        let mut whole = None;
        let found = self.in_netns(&record.pod, |nft, visit| {
            let mut found = PodCheck::default();
            // Read before the tables are: a change made while they are compared shows next time.
            let generation = nftgen::generation().ok();
            if baseline.is_some_and(|then| then.same_generation(rules, generation)) {
                found.installed.push(
                    "every table as applied (nf_tables unchanged since last found so)".to_owned(),
                );
            } else {
                match difference(&record.listing, &listing(nft, rules)?) {
                    None => {
                        found
                            .installed
                            .push("every table as applied (nft lists them unchanged)".to_owned());
                        whole = Some(Baseline::new(rules, generation, &()));
                    }
                    Some(what) => found.drift.push(verify.handle(DriftKind::Rules, what, || {
                        // The tables replaced in one transaction: nothing less at any instant.
                        nft.apply(&(deletion(rules.tables()) + &rules.transaction))?;
                        let now = listing(nft, rules)?;
                        difference(&record.listing, &now).map_or(Ok(()), |missing| {
                            Err(BackendError::NotCaptured {
                                pod: record.pod.to_string(),
                                missing,
                            })
                        })
                    })),
                }
            }
            // The policy route is no table's: it is looked at on every pass (one netlink dump).
            found.drift.extend(route_drift(
                visit,
                &record.pod.to_string(),
                &rules.routes,
                verify,
            )?);
            Ok(found)
        })?;
        if let Some(whole) = whole
            && found.drift.is_empty()
        {
            self.baselines.set(&id, whole);
        }
        check.extend(found);
        // Those of pods released since go (after a start, those of pods gone while no agent
        // ran).
        if self.baselines.count() > self.records.count() {
            self.baselines.retain(|id| self.records.get(id).is_some());
        }
        Ok(check)
    }
}
