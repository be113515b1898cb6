//! meshcap's entry in the CNI configuration, as the agent writes it from its settings: what the
//! plugin is told, the keys [`PluginConfig`] reads.
use std::{path::PathBuf, time::Duration};

use serde_json::{Value, json};

#[cfg(doc)]
use super::PluginConfig;
use super::{
    DEFAULT_AGENT_POD_NAMESPACE, DEFAULT_AGENT_POD_PREFIX, DEFAULT_AGENT_SOCKET,
    DEFAULT_TIMEOUT_SECONDS, PLUGIN_TYPE,
};

/// What the plugin is told in its entry: the keys of [`PluginConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginSettings {
    /// The agent's socket (`agent_socket`).
    pub agent_socket: PathBuf,
    /// Namespaces the plugin passes through without asking the agent (`exclude_namespaces`).
    pub exclude_namespaces: Vec<String>,
    /// Namespace of the agent's own pods, never sent to the agent (`agent_pod_namespace`).
    pub agent_pod_namespace: String,
    /// Name prefix of the agent's own pods (`agent_pod_prefix`).
    pub agent_pod_prefix: String,
    /// The plugin's log level: error, warn, info or debug (`log_level`).
    pub log_level: String,
    /// How long the plugin waits for the agent, whole seconds (`timeout_seconds`).
    pub timeout: Duration,
    /// With the agent unreachable, the plugin decides from the API server with this
    /// kubeconfig (`kubeconfig`)...
    pub kubeconfig: Option<PathBuf>,
    /// ...or from this manifest directory (`pod_dir`, standalone mode).
    pub pod_dir: Option<PathBuf>,
    /// The node runs ambient mode with these enablement selectors (`ambient_enabled`,
    /// `enablement_selectors`), so that the plugin decides as the agent does without it.
    pub ambient_selectors: Option<Value>,
}

impl Default for PluginSettings {
    fn default() -> Self {
        Self {
            agent_socket: PathBuf::from(DEFAULT_AGENT_SOCKET),
            exclude_namespaces: vec!["kube-system".to_owned()],
            agent_pod_namespace: DEFAULT_AGENT_POD_NAMESPACE.to_owned(),
            agent_pod_prefix: DEFAULT_AGENT_POD_PREFIX.to_owned(),
            log_level: "info".to_owned(),
            timeout: Duration::from_secs(DEFAULT_TIMEOUT_SECONDS),
            kubeconfig: None,
            pod_dir: None,
            ambient_selectors: None,
        }
    }
}

impl PluginSettings {
    /// meshcap's plugin entry, as chained into the conflist.
    #[must_use]
    pub fn entry(&self) -> Value {
        let mut entry = json!({
            "type": PLUGIN_TYPE,
            "agent_socket": self.agent_socket,
            "exclude_namespaces": self.exclude_namespaces,
            "agent_pod_namespace": self.agent_pod_namespace,
            "agent_pod_prefix": self.agent_pod_prefix,
            "log_level": self.log_level,
            "timeout_seconds": self.timeout.as_secs().max(1),
        });
        if let Some(path) = &self.kubeconfig {
            entry["kubeconfig"] = json!(path);
        }
        if let Some(dir) = &self.pod_dir {
            entry["pod_dir"] = json!(dir);
        }
        if let Some(selectors) = &self.ambient_selectors {
            entry["ambient_enabled"] = json!(true);
            entry["enablement_selectors"] = selectors.clone();
        }
        entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_reads_the_entry_as_written() {
        let settings = PluginSettings {
            exclude_namespaces: vec!["kube-system".to_owned(), "istio-system".to_owned()],
            log_level: "debug".to_owned(),
            timeout: Duration::from_secs(7),
            ..PluginSettings::default()
        };
        // The runtime hands each plugin of a list its entry plus the list's name and version.
        let mut conf = settings.entry();
        conf["cniVersion"] = "1.0.0".into();
        conf["name"] = "k8s-pod-network".into();
        let bytes = serde_json::to_vec(&conf).expect("JSON");
        let parsed = super::super::NetConf::parse(&bytes).expect("the plugin accepts it");
        let plugin = parsed.meshcap;
        assert_eq!(plugin.agent_socket, settings.agent_socket);
        assert_eq!(plugin.exclude_namespaces, settings.exclude_namespaces);
        assert_eq!(plugin.agent_pod_namespace, DEFAULT_AGENT_POD_NAMESPACE);
        assert_eq!(plugin.agent_pod_prefix, DEFAULT_AGENT_POD_PREFIX);
        assert_eq!(plugin.timeout(), Duration::from_secs(7));
    }
}
