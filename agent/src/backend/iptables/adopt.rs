//! Adopting the iptables rules istio-cni left in a running pod's netns
//! ([`crate::backend::found`]): what of Istio's is there (its `ISTIO_*` chains and the jumps
//! to them, in the iptables Istio would pick for the netns: legacy when legacy rules are
//! there, else nft) compared with the rules rendered for the pod now. The same rules — every
//! rendered rule in place (`-C`, as CHECK asks), as many of Istio's as rendered, the policy
//! route in place — are recorded as they are. Others are left as they are, or, when asked
//! (ambient mode's reconciliation), replaced with the rendered ones in one `iptables-restore`
//! transaction per table (the found chains and jumps removed and the new ones written
//! together: never a moment without a capture) and recorded.
use meshcap_policy::{IptablesRules, PolicyRoutes};
use tracing::info;

use super::{
    IptablesBackend, PodPolicy,
    inpod::Ctx,
    records::Applied,
    restore,
    verify::{Then, Whole},
};
use crate::{
    backend::{Adoption, BackendError, baseline::Baseline},
    pod::PodRef,
};

impl IptablesBackend {
    /// [`crate::backend::CaptureBackend::adopt`] for the iptables backend.
    pub(super) fn adopt_pod(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        reconcile: bool,
    ) -> Result<Adoption, BackendError> {
        let (rules, mode, ambient) = Self::rules(policy);
        let choice = self.flavour;
        self.in_netns(pod, |ctx| {
            let flavour = ctx.xt.detect(choice);
            let found = found_rules(ctx, flavour, rules.v6.is_some())?;
            if found.v4.is_empty() && found.v6.as_deref().is_none_or(str::is_empty) {
                return Ok(Adoption::Nothing);
            }
            let via = flavour.binary(false, "");
            let record = Applied {
                pod: pod.clone(),
                flavour,
                rules: rules.clone(),
                replacing: Vec::new(),
                mode,
                ambient,
                found_routes: Vec::new(),
                adopted: true,
            };
            let then = Then {
                baseline: None,
                elsewhere: &self.baselines,
            };
            let differs = match difference(ctx, flavour, &rules, &found, then)? {
                Err(differs) => differs,
                Ok(whole) => {
                    self.records.save(&record)?;
                    self.baselines.set(&pod.container_id, whole);
                    info!(flavour = via, "adopted istio-cni's rules as they are");
                    return Ok(Adoption::Recognised(format!(
                        "{via}: the rules Istio writes for it now"
                    )));
                }
            };
            if !reconcile {
                return Ok(Adoption::NotRecognised(format!("{via}: {differs}")));
            }
            // Written ahead: from here on the netns holds the found rules or the new ones.
            self.records.save(&Applied {
                replacing: vec![found.clone()],
                adopted: false,
                ..record.clone()
            })?;
            ctx.swap(flavour, Some(&found), &rules)?;
            self.records.save(&Applied {
                adopted: false,
                ..record
            })?;
            info!(flavour = via, %differs, "istio-cni's rules reconciled to the rules Istio writes now");
            Ok(Adoption::Reconciled(format!("{via}: {differs}")))
        })
    }
}

/// Istio's rules the netns holds in `flavour`, in the rendered form (IPv6's when there are
/// any or `ipv6` asks); no routes (a route found stays whatever becomes of the rules).
fn found_rules(
    ctx: &Ctx<'_>,
    flavour: super::Flavour,
    ipv6: bool,
) -> Result<IptablesRules, BackendError> {
    let saved = |ipv6| ctx.xt.run(&flavour.binary(ipv6, "-save"), &[]);
    let v6 = restore::istio_found(&saved(true).unwrap_or_default());
    Ok(IptablesRules {
        v4: restore::istio_found(&saved(false)?),
        v6: (ipv6 || !v6.is_empty()).then_some(v6),
        routes: PolicyRoutes::default(),
    })
}

/// How what was found differs from `rules`, or, when it does not, the tables as found whole
/// ([`Ctx::whole`]: compared in full only when no pod with the same rules had such tables).
fn difference(
    ctx: &mut Ctx<'_>,
    flavour: super::Flavour,
    rules: &IptablesRules,
    found: &IptablesRules,
    then: Then<'_>,
) -> Result<Result<Baseline, String>, BackendError> {
    for (family, rendered, was) in [
        ("IPv4", Some(rules.v4.as_str()), Some(found.v4.as_str())),
        ("IPv6", rules.v6.as_deref(), found.v6.as_deref()),
    ] {
        let (rendered, was) = (
            rendered.map_or(0, restore::istio_rule_count),
            was.map_or(0, restore::istio_rule_count),
        );
        if rendered != was {
            return Ok(Err(format!(
                "{was} {family} rules of Istio's where it writes {rendered} for the pod now"
            )));
        }
    }
    let whole = match ctx.whole(flavour, rules, then)? {
        Whole::Found(whole) => whole,
        Whole::Missing(missing) => return Ok(Err(format!("{missing} is not there"))),
    };
    if let Some(missing) = ctx.missing_route(rules)? {
        return Ok(Err(format!("{missing} is not there")));
    }
    Ok(Ok(whole))
}
