//! Rules applied inside a pod's network namespace (under the netns's own xtables lock):
//! swapping one rule set for another with rollback, removing what is left of one, and checking
//! that every rule is in place.
use meshcap_policy::{IptablesRules, PolicyRoutes};
use tracing::warn;

use super::{Flavour, restore, xtables::Xtables};
use crate::{
    backend::BackendError,
    podnet::{self, Visit},
};

/// What every command run in a pod's netns needs.
pub(super) struct Ctx<'v> {
    pub(super) xt: Xtables,
    pub(super) visit: &'v mut Visit,
}

impl Ctx<'_> {
    /// Applies `new` over `old` (both rule sets of one pod), rolling back on failure.
    pub(super) fn swap(
        &mut self,
        flavour: Flavour,
        old: Option<&IptablesRules>,
        new: &IptablesRules,
    ) -> Result<(), BackendError> {
        let old_v4 = old.map(|r| r.v4.as_str());
        let old_v6 = old.and_then(|r| r.v6.as_deref());
        self.xt
            .restore(flavour, false, &restore::replace(old_v4, &new.v4))?;
        let undo_v4 = |ctx: &Self| {
            let back = restore::replace(Some(&new.v4), old_v4.unwrap_or(""));
            if let Err(err) = ctx.xt.restore(flavour, false, &back) {
                warn!(error = %err, "rolling back IPv4 rules");
            }
        };
        if let Err(err) = self.xt.restore(
            flavour,
            true,
            &restore::replace(old_v6, new.v6.as_deref().unwrap_or("")),
        ) {
            undo_v4(self);
            return Err(err);
        }
        let empty = PolicyRoutes::default();
        let old_routes = old.map_or(&empty, |r| &r.routes);
        let routed = if old_routes.is_empty() && new.routes.is_empty() {
            Ok(())
        } else {
            self.visit
                .netlink()
                .and_then(|netlink| podnet::route::update(netlink, old_routes, &new.routes))
        };
        if let Err(e) = routed {
            undo_v4(self);
            let back = restore::replace(new.v6.as_deref(), old_v6.unwrap_or(""));
            if let Err(err) = self.xt.restore(flavour, true, &back) {
                warn!(error = %err, "rolling back IPv6 rules");
            }
            return Err(BackendError::PodNet {
                pod: self.xt.who.clone(),
                source: e,
            });
        }
        Ok(())
    }

    /// Removes whatever of `rules` is still in the netns, whatever is already gone: the
    /// removal for a capture that is not as meshcap left it (rules or chains deleted behind
    /// its back, or an interrupted earlier call), where the one-transaction inverse fails on
    /// the first missing piece. Per table: each of its rules in the kernel's chains deleted on
    /// its own (one already gone is fine), then its own chains that exist flushed and
    /// deleted, then the policy route. Anything still there afterwards is an error.
    pub(super) fn scrub(
        &mut self,
        flavour: Flavour,
        rules: &IptablesRules,
    ) -> Result<(), BackendError> {
        for (ipv6, text) in [
            (false, Some(rules.v4.as_str())),
            (true, rules.v6.as_deref()),
        ] {
            let Some(text) = text else { continue };
            let program = flavour.binary(ipv6, "");
            for table in restore::tables(text) {
                let wait = || ["-w", "10"].map(str::to_owned).into_iter();
                for (delete, check) in restore::builtin_rules(&table) {
                    let delete: Vec<String> = wait().chain(delete).collect();
                    // Refused because it is gone, or still there: only the latter is an error.
                    if self.xt.run(&program, &delete).is_err()
                        && self
                            .xt
                            .run(&program, &wait().chain(check).collect::<Vec<_>>())
                            .is_ok()
                    {
                        return Err(self.xt.failed(
                            format!("{program} {}", delete.join(" ")),
                            "the rule is still there after deleting it",
                        ));
                    }
                }
                let save = flavour.binary(ipv6, "-save");
                let present = restore::saved_chains(
                    &self.xt.run(&save, &["-t".to_owned(), table.name.clone()])?,
                );
                let drop = restore::drop_chains(&table, &present);
                self.xt.restore(
                    flavour,
                    ipv6,
                    &restore::payload(&[(table.name.clone(), drop)]),
                )?;
            }
        }
        if rules.routes.is_empty() {
            return Ok(());
        }
        let pod = self.xt.who.clone();
        self.visit
            .netlink()
            .and_then(|netlink| {
                podnet::route::update(netlink, &rules.routes, &PolicyRoutes::default())
            })
            .map_err(|source| BackendError::PodNet { pod, source })
    }

    /// The families whose policy route of `rules` the netns holds already.
    pub(super) fn found_routes(
        &mut self,
        routes: &PolicyRoutes,
    ) -> Result<Vec<meshcap_policy::Family>, BackendError> {
        if routes.mark_route.is_none() {
            return Ok(Vec::new());
        }
        let pod = self.xt.who.clone();
        self.visit
            .netlink()
            .and_then(|netlink| podnet::route::found(netlink, routes))
            .map_err(|source| BackendError::PodNet { pod, source })
    }

    /// The first rule of `rules` that is not in place (asked for with `-C`, a fork each); not
    /// its policy route ([`Self::missing_route`]).
    pub(super) fn first_missing_rule(
        &self,
        flavour: Flavour,
        rules: &IptablesRules,
    ) -> Result<Option<String>, BackendError> {
        let families = [
            (false, Some(rules.v4.as_str())),
            (true, rules.v6.as_deref()),
        ];
        for (ipv6, text) in families {
            let Some(text) = text else { continue };
            let program = flavour.binary(ipv6, "");
            for table in restore::tables(text) {
                for mut args in restore::checks(&table) {
                    args.insert(0, "-w".to_owned());
                    args.insert(1, "10".to_owned());
                    if self.xt.run(&program, &args).is_err() {
                        return Ok(Some(format!("{program} rule `{}`", args[2..].join(" "))));
                    }
                }
            }
        }
        Ok(None)
    }

    /// `rules`' policy route, when it is not in place.
    pub(super) fn missing_route(
        &mut self,
        rules: &IptablesRules,
    ) -> Result<Option<String>, BackendError> {
        if rules.routes.mark_route.is_none() {
            return Ok(None);
        }
        let pod = self.xt.who.clone();
        self.visit
            .netlink()
            .and_then(|netlink| podnet::route::missing(netlink, &rules.routes))
            .map_err(|source| BackendError::PodNet { pod, source })
    }
}
