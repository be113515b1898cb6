//! Running `nft` in the calling thread's network namespace: a transaction on stdin
//! (`nft -f -`, which the kernel applies whole or not at all) and a table's listing.
//!
//! Unlike `iptables`' owner match, nftables' `meta skuid`/`skgid` keep the number written and
//! compare it with the socket's owner as the netns's own user namespace sees it, so `nft` needs
//! no user namespace of the pod's: the agent's capabilities over the netns are enough.
use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use tracing::debug;

use crate::backend::BackendError;

/// The program run.
pub(crate) const NFT: &str = "nft";

/// `nft` for one namespace: `who` names it (the pod) in errors.
pub(crate) struct Nft {
    pub(crate) who: String,
}

impl Nft {
    fn failed(&self, command: &str, stderr: impl Into<String>) -> BackendError {
        BackendError::Command {
            pod: self.who.clone(),
            command: command.to_owned(),
            stderr: stderr.into(),
        }
    }

    /// Runs `transaction` as one `nft -f -`: all of it, or nothing.
    pub(crate) fn apply(&self, transaction: &str) -> Result<(), BackendError> {
        if transaction.is_empty() {
            return Ok(());
        }
        let line = format!("{NFT} -f -");
        debug!(transaction, "nft transaction");
        let mut child = Command::new(NFT)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| self.failed(&line, e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(transaction.as_bytes())
                .map_err(|e| self.failed(&line, format!("writing the transaction: {e}")))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| self.failed(&line, e.to_string()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(self.failed(&line, String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// `inet table`'s listing without counters (`nft -s list table inet NAME`), `None` when
    /// the table does not exist. Reading creates nothing.
    pub(crate) fn list(&self, table: &str) -> Result<Option<String>, BackendError> {
        self.read(&["-s", "list", "table", "inet", table])
    }

    /// The set `set` of `inet table` as `nft -j` prints it (its elements with their
    /// comments), `None` when the table or the set does not exist.
    pub(crate) fn list_set_json(
        &self,
        table: &str,
        set: &str,
    ) -> Result<Option<String>, BackendError> {
        self.read(&["-j", "list", "set", "inet", table, set])
    }

    /// `nft ARGS`' output, `None` when what it lists does not exist.
    fn read(&self, args: &[&str]) -> Result<Option<String>, BackendError> {
        let line = format!("{NFT} {}", args.join(" "));
        let out = Command::new(NFT)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| self.failed(&line, e.to_string()))?;
        if out.status.success() {
            return Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()));
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No such file or directory") {
            Ok(None)
        } else {
            Err(self.failed(&line, stderr.trim()))
        }
    }
}
