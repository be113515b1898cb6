//! Istio's native nftables rules (`global.nativeNftables`): the transaction the policy module
//! renders ([`meshcap_policy::nftables`]), run whole with `nft -f -` in the pod's network
//! namespace, a sidecar's or ambient mode's in-pod one.
//!
//! - **Atomic**: each ADD, update, repair and DEL is one `nft -f -` transaction, which the
//!   kernel applies whole or not at all. Istio's transaction adds, flushes and refills its
//!   tables; meshcap's first deletes, in the same transaction, every table the pod's rules
//!   (and any earlier rules of its record) write, so that the tables are exactly what Istio
//!   writes into a fresh netns whatever was there: no chain of an earlier policy left empty, no
//!   chain added behind meshcap's back kept, no earlier table (a TPROXY pod's mangle table when
//!   it turns REDIRECT).
//! - **Records**: what was applied is recorded ahead per pod ([`records`], kept by the rules
//!   backends' [`Records`] in `<state dir>/nftables/`), so that a DEL, an ADD or a restarted
//!   agent knows which tables the netns may hold. DEL (its course: [`Records::release`])
//!   deletes every table a record names with `add table` then `delete table` in one
//!   transaction: a table already gone is no error, so DEL completes whatever is missing.
//! - **CHECK and drift**: right after applying, the tables are listed as the kernel holds them
//!   (`nft -s list table`, counters left out) and the listing is recorded; CHECK and the
//!   verifier ([`verify`]) compare the tables' listing now with it. A repair runs the pod's
//!   transaction again: the tables replaced atomically, never less in place than before.
//! - **Routes**: TPROXY's and ambient mode's policy routes over netlink, as with iptables
//!   ([`crate::podnet::route`]).
mod adopt;
pub(crate) mod nft;
mod records;
mod tables;
mod verify;

use std::path::PathBuf;

use meshcap_policy::{DataplaneMode, InterceptionMode, PolicyRoutes};
use nft::Nft;
use records::Applied;
pub use tables::NftablesRules;
use tables::{creation, deletion, difference, listing};
use tracing::{debug, info, warn};

use super::{
    BackendError, CaptureBackend, CapturedPod, PodCheck, PodPolicy, Verify,
    baseline::Baselines,
    records::{Record as _, Records},
    rules_backend::not_captured,
};
use crate::{
    crashpoint,
    pod::PodRef,
    podnet::{self, Visit, nftgen},
};

/// Backend configuration.
#[derive(Clone, Debug)]
pub struct NftablesConfig {
    /// Where the records of applied rules live (`<state_dir>/nftables/`).
    pub state_dir: PathBuf,
}

/// The native nftables backend.
#[derive(Debug)]
pub struct NftablesBackend {
    records: Records<Applied>,
    /// The verifier's view of each pod's tables when they were last found as applied.
    baselines: Baselines,
}

impl NftablesBackend {
    /// Whether `state_dir` holds records of pods an earlier agent captured with this backend
    /// (they keep its rules until they go). Reads the directory only; creates nothing.
    #[must_use]
    pub fn has_records(state_dir: &std::path::Path) -> bool {
        Records::<Applied>::present(state_dir)
    }

    /// Opens the backend and adopts the records of a previous run.
    ///
    /// # Errors
    /// [`BackendError::Unavailable`] without a working `nft`; when the state directory cannot
    /// be created or read.
    pub fn new(config: &NftablesConfig) -> Result<Self, BackendError> {
        let version = std::process::Command::new(nft::NFT)
            .arg("--version")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
            .ok_or_else(|| {
                BackendError::Unavailable(format!(
                    "native nftables is on, but `{} --version` does not run",
                    nft::NFT
                ))
            })?;
        let records = Records::open(&config.state_dir)?;
        info!(adopted = records.count(), %version, "nftables backend ready");
        Ok(Self {
            records,
            baselines: Baselines::open(&config.state_dir, "nftables"),
        })
    }

    /// The rules a policy renders, its interception mode, and whether they are ambient
    /// mode's.
    fn rules(policy: &PodPolicy) -> (NftablesRules, InterceptionMode, bool) {
        match policy {
            PodPolicy::Sidecar(policy) => (
                NftablesRules {
                    transaction: policy.render_nftables_applied(),
                    routes: policy.routes(),
                },
                policy.mode,
                false,
            ),
            PodPolicy::Ambient(ambient) => (
                NftablesRules {
                    transaction: ambient.policy.render_nftables(),
                    routes: ambient.policy.routes(),
                },
                InterceptionMode::Redirect,
                true,
            ),
        }
    }

    fn in_netns<T: Send>(
        &self,
        pod: &PodRef,
        f: impl FnOnce(&Nft, &mut Visit) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        let nft = Nft {
            who: pod.to_string(),
        };
        podnet::run_in(&pod.netns, |visit| f(&nft, visit)).map_err(|source| {
            BackendError::PodNet {
                pod: pod.to_string(),
                source,
            }
        })?
    }

    /// Applies `rules` to the pod's netns, recorded ahead so that a DEL, an ADD or a
    /// restarted agent removes whatever of them is there.
    fn apply(
        &self,
        pod: &PodRef,
        rules: &NftablesRules,
        mode: InterceptionMode,
        ambient: bool,
    ) -> Result<(), BackendError> {
        let previous = self.records.get(&pod.container_id);
        if let Some(prev) = &previous
            && prev.rules == *rules
            && prev.replacing.is_empty()
            && self.check_recorded(pod, rules).is_ok()
        {
            debug!("already captured with these rules");
            return Ok(());
        }
        let mut intent = Applied {
            pod: pod.clone(),
            rules: rules.clone(),
            replacing: previous
                .iter()
                .flat_map(Applied::rule_sets)
                .filter(|set| *set != rules)
                .cloned()
                .collect(),
            listing: String::new(),
            mode,
            ambient,
            found_routes: previous
                .as_ref()
                .map(|prev| prev.found_routes.clone())
                .unwrap_or_default(),
            adopted: false,
        };
        let applied = self.in_netns(pod, |nft, visit| {
            if previous.is_none() && rules.routes.mark_route.is_some() {
                // A first capture: the policy routes already there are not meshcap's.
                intent.found_routes = visit
                    .netlink()
                    .and_then(|netlink| podnet::route::found(netlink, &rules.routes))
                    .map_err(|source| BackendError::PodNet {
                        pod: pod.to_string(),
                        source,
                    })?;
            }
            // Written ahead: from here on the netns may hold the old tables or the new ones,
            // and the record names both.
            self.records.save(&intent)?;
            let new_tables = rules.tables();
            // A first capture creates its tables: one already there is not meshcap's (another
            // agent's rules), and the transaction fails whole, leaving it as it is.
            let clear = if previous.is_none() {
                creation(&new_tables)
            } else {
                deletion(intent.rule_sets().flat_map(NftablesRules::tables))
            };
            nft.apply(&(clear + &rules.transaction))?;
            let old_routes: Vec<PolicyRoutes> = if intent.replacing.is_empty() {
                vec![NO_ROUTES.clone()]
            } else {
                intent
                    .replacing
                    .iter()
                    .map(|set| intent.owned(&set.routes))
                    .collect()
            };
            if let Err(source) = update_routes(visit, &old_routes, &rules.routes) {
                // Back to what was there: the earlier rules whole, or none.
                let back = match &previous {
                    Some(prev) if prev.replacing.is_empty() => {
                        deletion(new_tables.into_iter().chain(prev.rules.tables()))
                            + &prev.rules.transaction
                    }
                    _ => deletion(new_tables),
                };
                if let Err(err) = nft.apply(&back) {
                    warn!(error = %err, "rolling back the nftables transaction");
                }
                return Err(BackendError::PodNet {
                    pod: pod.to_string(),
                    source,
                });
            }
            listing(nft, rules)
        });
        let listing = match applied {
            Ok(listing) => listing,
            Err(err) => {
                // Nothing of this call stays: the record goes back to what it was.
                match &previous {
                    Some(prev) => self.records.save(prev)?,
                    None => self.records.forget(&pod.container_id),
                }
                return Err(err);
            }
        };
        crashpoint::here(crashpoint::NFTABLES_ADD_APPLIED);
        self.records.save(&Applied {
            replacing: Vec::new(),
            listing,
            ..intent
        })?;
        info!(%mode, ambient, "nftables rules applied");
        Ok(())
    }

    /// Whether the pod's netns holds `rules` as recorded: its nf_tables generation unchanged
    /// since the verifier last found its tables so ([`crate::backend::baseline`]: one netlink
    /// request), else the tables listed and compared; and its policy route.
    fn check_recorded(&self, pod: &PodRef, rules: &NftablesRules) -> Result<(), BackendError> {
        let (id, record) = self.records.applied_whole(pod, rules)?;
        let baseline = self.baselines.get(&id);
        let missing = self.in_netns(&record.pod, |nft, visit| {
            let unchanged =
                baseline.is_some_and(|then| then.same_generation(rules, nftgen::generation().ok()));
            if !unchanged
                && let Some(difference) = difference(&record.listing, &listing(nft, rules)?)
            {
                return Ok(Some(difference));
            }
            missing_route(visit, &rules.routes).map_err(|source| BackendError::PodNet {
                pod: pod.to_string(),
                source,
            })
        })?;
        missing.map_or(Ok(()), |missing| Err(not_captured(pod, missing)))
    }
}

static NO_ROUTES: PolicyRoutes = PolicyRoutes {
    mark_route: None,
    loopback_addresses: Vec::new(),
};

/// Each of `old` swapped for `new` (the routes of each rule set the netns may hold).
fn update_routes(
    visit: &mut Visit,
    old: &[PolicyRoutes],
    new: &PolicyRoutes,
) -> Result<(), podnet::PodNetError> {
    for old in old {
        if old.is_empty() && new.is_empty() {
            continue;
        }
        podnet::route::update(visit.netlink()?, old, new)?;
    }
    Ok(())
}

fn missing_route(
    visit: &mut Visit,
    routes: &PolicyRoutes,
) -> Result<Option<String>, podnet::PodNetError> {
    if routes.mark_route.is_none() {
        return Ok(None);
    }
    podnet::route::missing(visit.netlink()?, routes)
}

/// What keeps conntrack and NAT running in a pod's netns once Istio's tables leave it for the
/// kernel programs ([`CaptureBackend::hand_over`]), in the same transaction: a table with an
/// empty `nat` base chain (the kernel translates a NATed connection's packets only while the
/// netns has a `nat` chain) holding one conntrack match (the kernel tracks the netns only
/// while something there uses conntrack; `inet`: both families). The connections Istio's
/// `redirect`s made keep their NAT only so, and Istio's tables were the only `nat` chains and
/// conntrack users there: without them, an established connection's next packet goes to its
/// original destination. iptables leaves its `nat` base chains behind, so its rules backend
/// keeps conntrack only.
const KEEP_CONNTRACK: &str = "add table inet meshcap-conntrack
add chain inet meshcap-conntrack nat { type nat hook prerouting priority dstnat; }
flush chain inet meshcap-conntrack nat
add rule inet meshcap-conntrack nat ct state invalid return
";

impl NftablesBackend {
    /// Releases `pod`'s capture: its tables deleted, with `then` (more of the same
    /// transaction), and its routes.
    fn release(&self, pod: &PodRef, then: &str) -> Result<(), BackendError> {
        let released = self.records.release(pod, |target, record| {
            self.in_netns(target, |nft, visit| {
                let mut transaction = deletion(record.rule_sets().flat_map(NftablesRules::tables));
                transaction.push_str(then);
                nft.apply(&transaction)?;
                for set in record.rule_sets() {
                    let owned = record.owned(&set.routes);
                    update_routes(visit, &[owned], &NO_ROUTES).map_err(|source| {
                        BackendError::PodNet {
                            pod: target.to_string(),
                            source,
                        }
                    })?;
                }
                Ok(())
            })
        });
        self.baselines.retain(|id| self.records.get(id).is_some());
        released
    }
}

impl CaptureBackend for NftablesBackend {
    fn name(&self) -> &'static str {
        "nftables"
    }

    #[tracing::instrument(name = "nftables_add", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        let (rules, mode, ambient) = Self::rules(policy);
        self.apply(pod, &rules, mode, ambient)
    }

    #[tracing::instrument(name = "nftables_check", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.check_recorded(pod, &Self::rules(policy).0)
    }

    #[tracing::instrument(name = "nftables_remove", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.release(pod, "")
    }

    #[tracing::instrument(name = "nftables_hand_over", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn hand_over(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.release(pod, KEEP_CONNTRACK)
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        Ok(self.records.list(mode))
    }

    fn forget_found_routes(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.records.forget_found_routes(&pod.container_id)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        Ok(self.records.prune_gone())
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        Ok(self.records.gone(mode))
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        Ok(self.records.drop_if_gone(pod))
    }

    fn verify(&self, pod: &PodRef, verify: Verify) -> Result<PodCheck, BackendError> {
        self.verify_pod(pod, verify)
    }

    #[tracing::instrument(name = "nftables_adopt", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn adopt(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        reconcile: bool,
    ) -> Result<super::Adoption, BackendError> {
        self.adopt_pod(pod, policy, reconcile)
    }
}
