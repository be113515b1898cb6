//! The CNI side: spec versions, the network configuration with meshcap's keys, the
//! environment the runtime passes, results and errors.
//!
//! Spec versions 1.0.0 and 1.1.0 are spoken natively; 0.3.0, 0.3.1 and 0.4.0 configurations
//! (as kubelets and older conflists still write them) are accepted, and `prevResult` is
//! converted between the two result formats (they differ only in the `version` field of
//! `ips` entries).
use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::Deserialize;
use serde_json::Value;

/// CNI spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The newest spec version, used when the configuration's is unknown.
pub const LATEST_VERSION: &str = "1.1.0";

/// The agent's socket when the configuration names none.
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/meshcap/agent.sock";
/// The namespace of meshcap's own DaemonSet pods when the configuration names none: the one
/// `deploy/` creates (the agent's own conflist entry names it too).
pub const DEFAULT_AGENT_POD_NAMESPACE: &str = "meshcap-system";
/// The name prefix of meshcap's own DaemonSet pods when the configuration names none: the
/// DaemonSet's name (`deploy/`) and a dash.
pub const DEFAULT_AGENT_POD_PREFIX: &str = "meshcap-agent-";
/// How long the plugin waits for the agent when the configuration says nothing.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 30;

/// CNI error codes from the spec (meshcap's own start at 100, see the protocol module).
pub mod code {
    /// Incompatible CNI version.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// Unknown or unsupported environment variable / missing one.
    pub const INVALID_ENV: u32 = 4;
    /// I/O failure.
    pub const IO: u32 = 5;
    /// Failed to decode content.
    pub const DECODE: u32 = 6;
    /// Invalid network configuration.
    pub const INVALID_CONFIG: u32 = 7;
    /// Try again later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin is not available.
    pub const NOT_AVAILABLE: u32 = 50;
}

/// A CNI error, printed as the spec's error JSON on stdout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    /// The error code.
    pub code: u32,
    /// A one-line message.
    pub msg: String,
    /// Longer context, possibly empty.
    pub details: String,
}

impl CniError {
    /// An error without details.
    #[must_use]
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// The error JSON for a given spec version.
    #[must_use]
    pub fn to_json(&self, cni_version: &str) -> Value {
        let mut out = serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
        });
        if !self.details.is_empty() {
            out["details"] = Value::String(self.details.clone());
        }
        out
    }
}

/// The plugin's configuration (one entry of the conflist, as the runtime passes it on stdin).
#[derive(Clone, Debug, PartialEq)]
pub struct NetConf {
    /// The spec version of the configuration (and of our output).
    pub cni_version: String,
    /// The network's name.
    pub name: String,
    /// `prevResult`, from the previous plugin in the chain.
    pub prev_result: Option<Value>,
    /// meshcap's own keys.
    pub meshcap: PluginConfig,
    /// GC's `cni.dev/valid-attachments`.
    pub valid_attachments: Vec<Attachment>,
}

/// meshcap's keys in the plugin's configuration (all optional).
///
/// ```json
/// {
///   "type": "meshcap-cni",
///   "agent_socket": "/var/run/meshcap/agent.sock",
///   "exclude_namespaces": ["kube-system"],
///   "agent_pod_namespace": "meshcap-system",
///   "agent_pod_prefix": "meshcap-agent-",
///   "log_level": "info",
///   "timeout_seconds": 30,
///   "kubeconfig": "/etc/cni/net.d/meshcap-cni.kubeconfig",
///   "ambient_enabled": false,
///   "enablement_selectors": [{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}]
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginConfig {
    /// The agent's UNIX socket.
    pub agent_socket: PathBuf,
    /// Namespaces whose pods are never captured (decided here, without the agent).
    pub exclude_namespaces: Vec<String>,
    /// Namespace of meshcap's own pods: never captured, never sent to the agent.
    pub agent_pod_namespace: String,
    /// Name prefix of meshcap's own pods.
    pub agent_pod_prefix: String,
    /// `error`, `warn`, `info` or `debug` (stderr).
    pub log_level: LogLevel,
    /// How long to wait for the agent, in seconds (connect, send, answer).
    pub timeout_seconds: u64,
    /// When the agent is unreachable: decide from the API server with this kubeconfig...
    pub kubeconfig: Option<PathBuf>,
    /// ...or from this manifest directory (standalone). Neither: every pod that is not
    /// excluded here fails closed.
    pub pod_dir: Option<PathBuf>,
    /// The node runs ambient mode (Istio's `ambient_enabled`): deciding without the agent
    /// enrolls pods as it would.
    pub ambient_enabled: bool,
    /// Ambient mode's enablement selectors (Istio's `enablement_selectors`), passed on as
    /// they are.
    pub enablement_selectors: Option<Value>,
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self {
            agent_socket: PathBuf::from(DEFAULT_AGENT_SOCKET),
            exclude_namespaces: vec!["kube-system".to_owned()],
            agent_pod_namespace: DEFAULT_AGENT_POD_NAMESPACE.to_owned(),
            agent_pod_prefix: DEFAULT_AGENT_POD_PREFIX.to_owned(),
            log_level: LogLevel::default(),
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            kubeconfig: None,
            pod_dir: None,
            ambient_enabled: false,
            enablement_selectors: None,
        }
    }
}

impl PluginConfig {
    /// Sets one key from the configuration, naming it and its value when either is wrong.
    fn set(&mut self, key: &str, value: Value) -> Result<(), CniError> {
        fn parse<T: serde::de::DeserializeOwned>(key: &str, value: Value) -> Result<T, CniError> {
            serde_json::from_value(value.clone()).map_err(|e| {
                CniError::new(
                    code::INVALID_CONFIG,
                    format!("meshcap-cni configuration: {key}: {value} is invalid: {e}"),
                )
            })
        }
        match key {
            "agent_socket" => self.agent_socket = parse(key, value)?,
            "exclude_namespaces" => self.exclude_namespaces = parse(key, value)?,
            "agent_pod_namespace" => self.agent_pod_namespace = parse(key, value)?,
            "agent_pod_prefix" => self.agent_pod_prefix = parse(key, value)?,
            "log_level" => self.log_level = parse(key, value)?,
            "timeout_seconds" => self.timeout_seconds = parse(key, value)?,
            "kubeconfig" => self.kubeconfig = Some(parse(key, value)?),
            "pod_dir" => self.pod_dir = Some(parse(key, value)?),
            "ambient_enabled" => self.ambient_enabled = parse(key, value)?,
            "enablement_selectors" => self.enablement_selectors = Some(value),
            _ => {
                return Err(CniError {
                    code: code::INVALID_CONFIG,
                    msg: format!("meshcap-cni configuration: unknown key {key:?}"),
                    details: "meshcap-cni's keys: agent_socket, exclude_namespaces, \
                              agent_pod_namespace, agent_pod_prefix, log_level, timeout_seconds, \
                              kubeconfig, pod_dir, ambient_enabled, enablement_selectors"
                        .to_owned(),
                });
            }
        }
        Ok(())
    }

    /// The agent timeout.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_seconds.max(1))
    }
}

/// The plugin's log verbosity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Errors and warnings.
    Warn,
    /// Also decisions: captured, or passed through and why (the default, as Istio's plugin
    /// logs at `info`, and as the agent writes the plugin's entry).
    #[default]
    Info,
    /// Everything.
    Debug,
}

/// An attachment the runtime still holds (GC).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Attachment {
    /// The container ID.
    #[serde(rename = "containerID")]
    pub container_id: String,
    /// The interface.
    #[serde(default)]
    pub ifname: String,
}

/// Keys of the standard CNI configuration; everything else at the top level must be ours.
const STANDARD_KEYS: &[&str] = &[
    "cniVersion",
    "cniVersions",
    "name",
    "type",
    "args",
    "ipMasq",
    "ipam",
    "dns",
    "capabilities",
    "runtimeConfig",
    "prevResult",
    "cni.dev/valid-attachments",
    "cni.dev/attachments",
    "disableCheck",
    "disableGC",
];

impl NetConf {
    /// Parses the configuration the runtime wrote on stdin.
    ///
    /// # Errors
    /// Code 6 when it is not JSON, 1 when its version is not supported, 7 when a key is wrong.
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let value: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                code::DECODE,
                format!("the network configuration on stdin is not valid JSON: {e}"),
            )
        })?;
        let Value::Object(mut map) = value else {
            return Err(CniError::new(
                code::DECODE,
                "the network configuration on stdin is not a JSON object",
            ));
        };
        let cni_version = match map.get("cniVersion") {
            Some(Value::String(v)) => v.clone(),
            Some(other) => {
                return Err(CniError::new(
                    code::INVALID_CONFIG,
                    format!("cniVersion {other} is not a string"),
                ));
            }
            // The spec's default for a missing version, which nobody speaks any more.
            None => "0.1.0".to_owned(),
        };
        check_version(&cni_version)?;
        let name = match map.get("name") {
            Some(Value::String(n)) => n.clone(),
            _ => String::new(),
        };
        let prev_result = map.remove("prevResult").filter(|v| !v.is_null());
        let valid_attachments = match map.remove("cni.dev/valid-attachments") {
            None | Some(Value::Null) => Vec::new(),
            Some(list) => serde_json::from_value(list).map_err(|e| {
                CniError::new(
                    code::INVALID_CONFIG,
                    format!("cni.dev/valid-attachments: {e}"),
                )
            })?,
        };
        let mut meshcap = PluginConfig::default();
        for (key, value) in map {
            if !STANDARD_KEYS.contains(&key.as_str()) {
                meshcap.set(&key, value)?;
            }
        }
        Ok(Self {
            cni_version,
            name,
            prev_result,
            meshcap,
            valid_attachments,
        })
    }
}

/// Fails with code 1 unless `version` is one this plugin speaks.
///
/// # Errors
/// When it is not supported.
pub fn check_version(version: &str) -> Result<(), CniError> {
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(CniError {
            code: code::INCOMPATIBLE_VERSION,
            msg: format!("CNI version {version:?} is not supported by meshcap-cni"),
            details: format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
        })
    }
}

/// Whether a version uses the 1.x result format (no `version` in `ips`).
fn is_v1(version: &str) -> bool {
    version.starts_with("1.")
}

/// The result ADD prints: `prevResult` converted to `to`, or an empty result when there is none.
///
/// # Errors
/// Code 1 when `prevResult` claims a version not supported, 6 when it cannot be converted.
pub fn convert_result(prev: Option<&Value>, to: &str) -> Result<Value, CniError> {
    let Some(prev) = prev else {
        return Ok(serde_json::json!({ "cniVersion": to }));
    };
    let Value::Object(prev) = prev else {
        return Err(CniError::new(
            code::DECODE,
            "prevResult is not a JSON object",
        ));
    };
    let from = match prev.get("cniVersion") {
        Some(Value::String(v)) => {
            check_version(v).map_err(|e| CniError {
                msg: format!("prevResult: {}", e.msg),
                ..e
            })?;
            v.clone()
        }
        // The runtime hands prevResult over in the configuration's own version.
        _ => to.to_owned(),
    };
    let mut out = prev.clone();
    out.insert("cniVersion".to_owned(), Value::String(to.to_owned()));
    if is_v1(&from) == is_v1(to) {
        return Ok(Value::Object(out));
    }
    if let Some(Value::Array(ips)) = out.get_mut("ips") {
        for (i, ip) in ips.iter_mut().enumerate() {
            let Value::Object(ip) = ip else {
                return Err(CniError::new(
                    code::DECODE,
                    format!("prevResult.ips[{i}] is not an object"),
                ));
            };
            if is_v1(to) {
                ip.remove("version");
            } else {
                let family = match ip.get("address") {
                    Some(Value::String(a)) if a.contains(':') => "6",
                    Some(Value::String(_)) => "4",
                    _ => {
                        return Err(CniError::new(
                            code::DECODE,
                            format!("prevResult.ips[{i}] has no address"),
                        ));
                    }
                };
                ip.insert("version".to_owned(), Value::String(family.to_owned()));
            }
        }
    }
    Ok(Value::Object(out))
}

/// The pod addresses of a result (`ips[].address`, prefix length dropped); entries that do
/// not parse are left out.
#[must_use]
pub fn result_ips(result: &Value) -> Vec<std::net::IpAddr> {
    result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address")?.as_str()?.split('/').next()?.parse().ok())
        .collect()
}

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
    use serde_json::json;

    use super::*;

    #[test]
    fn minimal_config_takes_defaults() {
        let conf =
            NetConf::parse(br#"{"cniVersion":"1.0.0","name":"k8s","type":"meshcap-cni"}"#).unwrap();
        assert_eq!(conf.meshcap, PluginConfig::default());
        assert_eq!(conf.prev_result, None);
    }

    #[test]
    fn meshcap_keys_are_read() {
        let conf = NetConf::parse(
            br#"{"cniVersion":"0.3.1","name":"k8s","type":"meshcap-cni","agent_socket":"/tmp/a.sock",
                 "exclude_namespaces":["a","b"],"log_level":"debug","timeout_seconds":3,
                 "agent_pod_namespace":"meshcap","agent_pod_prefix":"mc-"}"#,
        )
        .unwrap();
        assert_eq!(conf.meshcap.agent_socket, PathBuf::from("/tmp/a.sock"));
        assert_eq!(conf.meshcap.exclude_namespaces, ["a", "b"]);
        assert_eq!(conf.meshcap.log_level, LogLevel::Debug);
        assert_eq!(conf.meshcap.timeout(), Duration::from_secs(3));
        assert_eq!(conf.meshcap.agent_pod_prefix, "mc-");
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let cases: &[(&[u8], u32, &str)] = &[
            (b"{not json", code::DECODE, "not valid JSON"),
            (b"[]", code::DECODE, "not a JSON object"),
            (br#"{"name":"x"}"#, code::INCOMPATIBLE_VERSION, "\"0.1.0\""),
            (
                br#"{"cniVersion":"2.0.0"}"#,
                code::INCOMPATIBLE_VERSION,
                "\"2.0.0\"",
            ),
            (br#"{"cniVersion":1}"#, code::INVALID_CONFIG, "not a string"),
            (
                br#"{"cniVersion":"1.0.0","timeout_seconds":"x"}"#,
                code::INVALID_CONFIG,
                "timeout_seconds",
            ),
            (
                br#"{"cniVersion":"1.0.0","agent_sockett":"/x"}"#,
                code::INVALID_CONFIG,
                "agent_sockett",
            ),
            (
                br#"{"cniVersion":"1.0.0","log_level":"loud"}"#,
                code::INVALID_CONFIG,
                "loud",
            ),
        ];
        for (input, code, needle) in cases {
            let err = NetConf::parse(input).unwrap_err();
            assert_eq!(err.code, *code, "{err:?}");
            assert!(
                err.msg.contains(needle) || err.details.contains(needle),
                "{err:?} should mention {needle}"
            );
        }
    }

    fn result_0_4() -> Value {
        json!({
            "cniVersion": "0.4.0",
            "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/x"}],
            "ips": [
                {"version": "4", "interface": 0, "address": "10.1.0.5/24", "gateway": "10.1.0.1"},
                {"version": "6", "interface": 0, "address": "fd00::5/64"}
            ],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.96.0.10"]}
        })
    }

    #[test]
    fn prev_result_passes_through_within_a_family() {
        let mut prev = result_0_4();
        let out = convert_result(Some(&prev), "0.3.1").unwrap();
        prev["cniVersion"] = json!("0.3.1");
        assert_eq!(out, prev);
    }

    #[test]
    fn prev_result_converts_between_families_both_ways() {
        let prev = result_0_4();
        let v1 = convert_result(Some(&prev), "1.0.0").unwrap();
        assert_eq!(v1["cniVersion"], "1.0.0");
        assert!(
            v1["ips"]
                .as_array()
                .unwrap()
                .iter()
                .all(|ip| ip.get("version").is_none())
        );
        assert_eq!(v1["routes"], prev["routes"]);
        assert_eq!(v1["dns"], prev["dns"]);
        let back = convert_result(Some(&v1), "0.4.0").unwrap();
        assert_eq!(back, prev);
    }

    #[test]
    fn prev_result_without_version_is_taken_as_the_configs() {
        let prev = json!({"ips": [{"address": "10.0.0.1/32"}]});
        let out = convert_result(Some(&prev), "1.1.0").unwrap();
        assert_eq!(
            out,
            json!({"cniVersion": "1.1.0", "ips": [{"address": "10.0.0.1/32"}]})
        );
    }

    #[test]
    fn result_ips_drop_the_prefix_length() {
        let ips = result_ips(&result_0_4());
        assert_eq!(
            ips,
            [
                "10.1.0.5".parse::<std::net::IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert!(result_ips(&json!({})).is_empty());
    }

    #[test]
    fn no_prev_result_is_an_empty_result() {
        assert_eq!(
            convert_result(None, "1.0.0").unwrap(),
            json!({"cniVersion": "1.0.0"})
        );
    }

    #[test]
    fn bad_prev_results_are_refused() {
        assert_eq!(
            convert_result(Some(&json!([])), "1.0.0").unwrap_err().code,
            code::DECODE
        );
        assert_eq!(
            convert_result(Some(&json!({"cniVersion": "9.9.9"})), "1.0.0")
                .unwrap_err()
                .code,
            code::INCOMPATIBLE_VERSION
        );
        let no_addr = json!({"cniVersion": "1.0.0", "ips": [{}]});
        assert_eq!(
            convert_result(Some(&no_addr), "0.4.0").unwrap_err().code,
            code::DECODE
        );
    }

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

    #[test]
    fn gc_attachments_are_read() {
        let conf = NetConf::parse(
            br#"{"cniVersion":"1.1.0","name":"k8s","type":"meshcap-cni",
                 "cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#,
        )
        .unwrap();
        assert_eq!(conf.valid_attachments[0].container_id, "a");
    }
}
