//! An enrolled pod compared with its workload record, for the verifier (and `explain`): its
//! in-pod capture (the backend's own comparison), its hand-over to ztunnel as the agent's record
//! of the ZDS exchange says (ZDS has no query: the newest ztunnel acked an add or keep of the
//! pod and was sent no delete since), and its addresses in the node's probe set. What differs is
//! put back: the pod handed to ztunnel again, its addresses added; node-wide, probe sets that
//! were destroyed, or that no rule matches any more, are set up again with their rule (which
//! kubelet's probes need).
use std::{fs, io};

use super::{Ambient, addresses};
use crate::{
    backend::{BackendError, DriftKind, PodCheck, Verify},
    pod::PodRef,
    ztunnel::ZdsError,
};

/// Why an enrolled pod could not be handed to ztunnel again.
#[derive(Debug, thiserror::Error)]
enum HandOverError {
    /// Its network namespace cannot be opened.
    #[error("{0}")]
    Netns(#[source] io::Error),
    /// ztunnel did not take it.
    #[error(transparent)]
    Ztunnel(#[from] ZdsError),
}

impl Ambient {
    /// `pod`'s enrollment against its record; with [`Verify::Repair`] what differs is put back.
    pub(super) fn verify_enrolled(
        &self,
        pod: &PodRef,
        verify: Verify,
    ) -> Result<PodCheck, BackendError> {
        let mut check = self.backend.verify(pod, verify)?;
        let Some((_, workload)) = self.records.of(pod) else {
            check
                .installed
                .push("no workload record: ztunnel is not told about it".to_owned());
            return Ok(check);
        };
        let uid = workload.uid.clone();
        match self.ztunnel.serves(&uid) {
            None => check.installed.push(
                "no ztunnel is connected: the next one is sent the pod in its snapshot".to_owned(),
            ),
            Some(true) => check
                .installed
                .push(format!("handed to ztunnel as uid {uid}, acked")),
            Some(false) => check.drift.push(verify.handle(
                DriftKind::Ztunnel,
                format!("the connected ztunnel has not acked uid {uid}"),
                || -> Result<(), HandOverError> {
                    let netns = fs::File::open(&workload.netns).map_err(HandOverError::Netns)?;
                    Ok(self
                        .ztunnel
                        .add(&uid, workload.info(), std::os::fd::AsFd::as_fd(&netns))?)
                },
            )),
        }
        let ips = if workload.ips.is_empty() {
            addresses(&workload.netns).unwrap_or_default()
        } else {
            workload.ips.clone()
        };
        match self.probes.missing(&ips) {
            Ok(missing) if missing.is_empty() => check.installed.push(format!(
                "kubelet's probes SNAT-ed: {} in the node's probe set",
                list(&ips)
            )),
            Ok(missing) => check.drift.push(verify.handle(
                DriftKind::ProbeSet,
                format!("{} not in the node's probe set", list(&missing)),
                || self.probes.add(&uid, &missing),
            )),
            Err(err) => check
                .installed
                .push(format!("the node's probe set cannot be read: {err}")),
        }
        Ok(check)
    }

    /// The node's probe sets are there, each matched by the node rule; with
    /// [`Verify::Repair`] what is not is set up again: the sets created (kept when there), the
    /// rule put back in front (one copy).
    pub(super) fn verify_sets(&self, verify: Verify) -> PodCheck {
        let mut check = PodCheck::default();
        match self.probes.not_in_place() {
            Ok(wrong) if wrong.is_empty() => check
                .installed
                .push("the node's probe sets are there, matched by its probe rule".to_owned()),
            Ok(wrong) => {
                check
                    .drift
                    .push(verify.handle(DriftKind::ProbeSet, wrong.join("; "), || {
                        self.probes.set_up()
                    }))
            }
            Err(err) => check
                .installed
                .push(format!("the node's probe sets cannot be read: {err}")),
        }
        check
    }
}

fn list(ips: &[std::net::IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
