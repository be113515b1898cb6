//! Running `iptables*` in the calling thread's network namespace: commands and
//! `iptables-restore --noflush` under an xtables lock, and Istio's choice of iptables. For a pod
//! whose network namespace a user namespace of its own owns (`hostUsers: false`), each command
//! enters that user namespace first, as Istio's `nsenter --user` does: the kernel takes an owner
//! match only from there (`crate::podnet::userns`).
use std::{
    io::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
    sync::OnceLock,
};

use tracing::debug;

use super::{Flavour, FlavourChoice};
use crate::{backend::BackendError, podnet::userns::UserNs};

/// Runs iptables for one namespace: `who` names it in errors (the pod, or the node), `lock` is
/// its xtables lock file (`None`: the system's, shared with every other user of the node's
/// namespace, as kube-proxy), `userns` the user namespace owning it when not the agent's.
pub(super) struct Xtables {
    pub(super) who: String,
    pub(super) lock: Option<PathBuf>,
    pub(super) userns: Option<UserNs>,
}

impl Xtables {
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        if let Some(lock) = &self.lock {
            cmd.env("XTABLES_LOCKFILE", lock);
        }
        if let Some(userns) = &self.userns {
            userns.enter_in_child(&mut cmd);
        }
        cmd
    }

    pub(super) fn failed(&self, command: String, stderr: impl Into<String>) -> BackendError {
        BackendError::Command {
            pod: self.who.clone(),
            command,
            stderr: stderr.into(),
        }
    }

    /// Runs a command, returning its stdout.
    pub(super) fn run(&self, program: &str, args: &[String]) -> Result<String, BackendError> {
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
    pub(super) fn restore(
        &self,
        flavour: Flavour,
        ipv6: bool,
        payload: &str,
    ) -> Result<(), BackendError> {
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

    /// Istio's choice of iptables for this namespace: legacy when legacy rules are already
    /// there, else nft when it works, else plain `iptables`.
    pub(super) fn detect(&self, choice: FlavourChoice) -> Flavour {
        match choice {
            FlavourChoice::Legacy => return Flavour::Legacy,
            FlavourChoice::Nft => return Flavour::Nft,
            FlavourChoice::Auto => {}
        }
        // Legacy rules need a legacy table, and the kernel lists every one it made in the
        // namespace: with none (a new pod's netns), nothing is run to know it.
        let has_rules = |ipv6| {
            legacy_tables_here(ipv6)
                && self
                    .run(&Flavour::Legacy.binary(ipv6, "-save"), &[])
                    .is_ok_and(|out| out.lines().any(|l| l.starts_with("-A ")))
        };
        if has_rules(false) || has_rules(true) {
            Flavour::Legacy
        } else if self.nft_works() {
            Flavour::Nft
        } else {
            Flavour::Plain
        }
    }

    /// Whether `iptables-nft-save` runs: asked until it has once (its binary and the kernel's
    /// nf_tables are the node's, the same for every namespace).
    fn nft_works(&self) -> bool {
        if NFT_WORKED.get().is_some() {
            return true;
        }
        let works = self.run(&Flavour::Nft.binary(false, "-save"), &[]).is_ok();
        if works {
            let _ = NFT_WORKED.set(());
        }
        works
    }
}

/// Set once `iptables-nft-save` has run in this process.
static NFT_WORKED: OnceLock<()> = OnceLock::new();

/// Whether the calling thread's namespace holds any legacy table of the family
/// (`ip_tables_names`, `ip6_tables_names`: absent until the module is loaded, which no
/// namespace's table can be without).
fn legacy_tables_here(ipv6: bool) -> bool {
    let names = if ipv6 {
        "/proc/thread-self/net/ip6_tables_names"
    } else {
        "/proc/thread-self/net/ip_tables_names"
    };
    std::fs::read_to_string(names).map_or_else(
        // Unreadable for another reason than its absence: ask iptables, as before.
        |err| err.kind() != std::io::ErrorKind::NotFound,
        |listed| !listed.trim().is_empty(),
    )
}
