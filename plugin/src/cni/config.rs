//! The network configuration the runtime passes on stdin, with meshcap's own keys.
use std::{path::PathBuf, time::Duration};

use serde::Deserialize;
use serde_json::Value;

use super::{CniError, check_version, code};

/// The plugin's CNI `type`: its binary's name in the CNI bin dir.
pub const PLUGIN_TYPE: &str = "meshcap-cni";
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

#[cfg(test)]
mod tests {
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
