//! Rules applied inside a pod's network namespace: `iptables-restore --noflush` under the
//! netns's own xtables lock, Istio's choice of iptables, swapping one rule set for another with
//! rollback, and checking that every rule is in place.
use std::{
    io::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use tracing::{debug, warn};

use super::{Flavour, FlavourChoice, restore};
use crate::{
    backend::BackendError,
    podnet::{self, Visit},
    policy::{IptablesRules, PolicyRoutes},
};

/// What every command run in a pod's netns needs.
pub(super) struct Ctx<'v> {
    pub(super) pod: String,
    pub(super) lock: PathBuf,
    pub(super) visit: &'v mut Visit,
}

impl Ctx<'_> {
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("XTABLES_LOCKFILE", &self.lock);
        cmd
    }

    pub(super) fn failed(&self, command: String, stderr: impl Into<String>) -> BackendError {
        BackendError::Command {
            pod: self.pod.clone(),
            command,
            stderr: stderr.into(),
        }
    }

    /// Runs a command, returning its stdout.
    fn run(&self, program: &str, args: &[String]) -> Result<String, BackendError> {
        let line = format!("{program} {}", args.join(" "));
        let out = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| self.failed(line.clone(), e.to_string()))?;
        if !out.status.success() {
            return Err(self.failed(line, String::from_utf8_lossy(&out.stderr).trim().to_owned()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `iptables-restore --noflush -w` with `payload` on stdin.
    fn restore(&self, flavour: Flavour, ipv6: bool, payload: &str) -> Result<(), BackendError> {
        if payload.is_empty() {
            return Ok(());
        }
        let program = flavour.binary(ipv6, "-restore");
        let line = format!("{program} --noflush -w 10");
        debug!(%program, payload, "restoring");
        let mut child = self
            .command(&program)
            .args(["--noflush", "-w", "10"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| self.failed(line.clone(), e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(payload.as_bytes())
                .map_err(|e| self.failed(line.clone(), format!("writing rules: {e}")))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| self.failed(line.clone(), e.to_string()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(self.failed(line, String::from_utf8_lossy(&out.stderr).trim().to_owned()))
        }
    }

    /// Istio's choice of iptables for this netns.
    pub(super) fn detect(&self, choice: FlavourChoice) -> Flavour {
        match choice {
            FlavourChoice::Legacy => return Flavour::Legacy,
            FlavourChoice::Nft => return Flavour::Nft,
            FlavourChoice::Auto => {}
        }
        let has_rules = |ipv6| {
            self.run(&Flavour::Legacy.binary(ipv6, "-save"), &[])
                .is_ok_and(|out| out.lines().any(|l| l.starts_with("-A ")))
        };
        if has_rules(false) || has_rules(true) {
            Flavour::Legacy
        } else if self.run(&Flavour::Nft.binary(false, "-save"), &[]).is_ok() {
            Flavour::Nft
        } else {
            Flavour::Plain
        }
    }

    /// Applies `new` over `old` (both rule sets of one pod), rolling back on failure.
    pub(super) fn swap(
        &mut self,
        flavour: Flavour,
        old: Option<&IptablesRules>,
        new: &IptablesRules,
    ) -> Result<(), BackendError> {
        let old_v4 = old.map(|r| r.v4.as_str());
        let old_v6 = old.and_then(|r| r.v6.as_deref());
        self.restore(flavour, false, &restore::replace(old_v4, &new.v4))?;
        let undo_v4 = |ctx: &Self| {
            let back = restore::replace(Some(&new.v4), old_v4.unwrap_or(""));
            if let Err(err) = ctx.restore(flavour, false, &back) {
                warn!(error = %err, "rolling back IPv4 rules");
            }
        };
        if let Err(err) = self.restore(
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
            if let Err(err) = self.restore(flavour, true, &back) {
                warn!(error = %err, "rolling back IPv6 rules");
            }
            return Err(BackendError::PodNet {
                pod: self.pod.clone(),
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
                    if self.run(&program, &delete).is_err()
                        && self
                            .run(&program, &wait().chain(check).collect::<Vec<_>>())
                            .is_ok()
                    {
                        return Err(self.failed(
                            format!("{program} {}", delete.join(" ")),
                            "the rule is still there after deleting it",
                        ));
                    }
                }
                let save = flavour.binary(ipv6, "-save");
                let present = restore::saved_chains(
                    &self.run(&save, &["-t".to_owned(), table.name.clone()])?,
                );
                let drop = restore::drop_chains(&table, &present);
                self.restore(
                    flavour,
                    ipv6,
                    &restore::payload(&[(table.name.clone(), drop)]),
                )?;
            }
        }
        if rules.routes.is_empty() {
            return Ok(());
        }
        let pod = self.pod.clone();
        self.visit
            .netlink()
            .and_then(|netlink| {
                podnet::route::update(netlink, &rules.routes, &PolicyRoutes::default())
            })
            .map_err(|source| BackendError::PodNet { pod, source })
    }

    /// The first rule of `rules` that is not in place, if any.
    pub(super) fn first_missing(
        &mut self,
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
                    if self.run(&program, &args).is_err() {
                        return Ok(Some(format!("{program} rule `{}`", args[2..].join(" "))));
                    }
                }
            }
        }
        if rules.routes.mark_route.is_none() {
            return Ok(None);
        }
        let pod = self.pod.clone();
        self.visit
            .netlink()
            .and_then(|netlink| podnet::route::missing(netlink, &rules.routes))
            .map_err(|source| BackendError::PodNet { pod, source })
    }
}
