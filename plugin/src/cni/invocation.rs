//! The runtime's environment for one invocation: `CNI_COMMAND`, the container, the netns, the
//! interface and `CNI_ARGS`.
use std::collections::BTreeMap;

use super::{CniError, code};

/// The CNI commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// ADD.
    Add,
    /// DEL.
    Del,
    /// CHECK.
    Check,
    /// VERSION.
    Version,
    /// STATUS (1.1.0).
    Status,
    /// GC (1.1.0).
    Gc,
}

/// The runtime's environment for one invocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invocation {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID` (ADD, DEL, CHECK).
    pub container_id: String,
    /// `CNI_NETNS` (ADD, CHECK; may be empty on DEL).
    pub netns: String,
    /// `CNI_IFNAME` (ADD, DEL, CHECK).
    pub ifname: String,
    /// `CNI_ARGS`, parsed.
    pub args: BTreeMap<String, String>,
}

impl Invocation {
    /// Reads the environment (`get` returns a variable's value).
    ///
    /// # Errors
    /// Code 4 naming the missing or invalid variable.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, CniError> {
        let command = match get("CNI_COMMAND").as_deref() {
            Some("ADD") => Command::Add,
            Some("DEL") => Command::Del,
            Some("CHECK") => Command::Check,
            Some("VERSION") => Command::Version,
            Some("STATUS") => Command::Status,
            Some("GC") => Command::Gc,
            Some(other) => {
                return Err(CniError::new(
                    code::INVALID_ENV,
                    format!(
                        "CNI_COMMAND {other:?} is not a CNI command (ADD, DEL, CHECK, VERSION, STATUS, GC)"
                    ),
                ));
            }
            None => {
                return Err(CniError::new(
                    code::INVALID_ENV,
                    "CNI_COMMAND is not set; meshcap-cni is run by the container runtime as a CNI plugin",
                ));
            }
        };
        let per_pod = matches!(command, Command::Add | Command::Del | Command::Check);
        let required = |var: &str, needed: bool| -> Result<String, CniError> {
            match get(var).filter(|v| !v.is_empty()) {
                Some(v) => Ok(v),
                None if needed => Err(CniError::new(
                    code::INVALID_ENV,
                    format!("{var} is not set (required for CNI_COMMAND {command:?})"),
                )),
                None => Ok(String::new()),
            }
        };
        let container_id = required("CNI_CONTAINERID", per_pod)?;
        let netns = required(
            "CNI_NETNS",
            matches!(command, Command::Add | Command::Check),
        )?;
        let ifname = required("CNI_IFNAME", per_pod)?;
        let args = parse_cni_args(&get("CNI_ARGS").unwrap_or_default())?;
        Ok(Self {
            command,
            container_id,
            netns,
            ifname,
            args,
        })
    }

    /// A `K8S_*` argument from `CNI_ARGS`, when present and not empty.
    #[must_use]
    pub fn arg(&self, key: &str) -> Option<&str> {
        self.args
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

/// Parses `CNI_ARGS` (`KEY=VALUE;KEY=VALUE`).
///
/// # Errors
/// Code 4 when an element has no `=`.
pub fn parse_cni_args(raw: &str) -> Result<BTreeMap<String, String>, CniError> {
    raw.split(';')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| {
                    CniError::new(
                        code::INVALID_ENV,
                        format!("CNI_ARGS element {pair:?} is not KEY=VALUE"),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A CNI environment made of `vars` only, for [`Invocation::from_env`].
    pub(crate) fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn environment_of_an_add() {
        let inv = Invocation::from_env(env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=c1",
            ),
        ]))
        .unwrap();
        assert_eq!(inv.command, Command::Add);
        assert_eq!(inv.arg("K8S_POD_NAME"), Some("web"));
        assert_eq!(inv.arg("K8S_POD_UID"), None);
    }

    #[test]
    fn missing_environment_is_named() {
        let err = Invocation::from_env(env(&[])).unwrap_err();
        assert_eq!(err.code, code::INVALID_ENV);
        assert!(err.msg.contains("CNI_COMMAND"));
        let err = Invocation::from_env(env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
        ]))
        .unwrap_err();
        assert!(err.msg.contains("CNI_NETNS"), "{err:?}");
        let del = Invocation::from_env(env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
        ]));
        assert!(del.is_ok(), "DEL may come without a netns");
        let err = Invocation::from_env(env(&[("CNI_COMMAND", "FROB")])).unwrap_err();
        assert!(err.msg.contains("FROB"));
        let err = parse_cni_args("K8S_POD_NAME").unwrap_err();
        assert!(err.msg.contains("K8S_POD_NAME"));
    }
}
