//! The node settings a cluster install gives the agent: the keys of the `meshcap-config`
//! ConfigMap, each named after the Helm value it comes from (Istio's istio-cni chart's names and
//! defaults where Istio has the setting, `deploy/chart`), and the environment variable the
//! DaemonSet passes each in. The chart's rendering is checked against this table by a test, and
//! the agent's `run` reads exactly these variables.
use crate::{install, paths, taint};

/// One setting: its ConfigMap key, the agent's environment variable and the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// Key in the ConfigMap (Istio's value name where one exists).
    pub key: &'static str,
    /// Environment variable the agent reads.
    pub env: &'static str,
    /// The default, as the ConfigMap ships it.
    pub default: &'static str,
}

/// `cniBinDir`: where the plugin binary is installed.
pub const CNI_BIN_DIR: Setting = Setting {
    key: "cniBinDir",
    env: "MESHCAP_CNI_BIN_DIR",
    default: paths::CNI_BIN_DIR,
};

/// `cniConfDir`: the runtime's CNI configuration directory.
pub const CNI_CONF_DIR: Setting = Setting {
    key: "cniConfDir",
    env: "MESHCAP_CNI_CONF_DIR",
    default: paths::CNI_CONF_DIR,
};

/// `cniConfFileName`: the file to chain into; empty picks the runtime's own choice.
pub const CNI_CONF_FILE_NAME: Setting = Setting {
    key: "cniConfFileName",
    env: "MESHCAP_CNI_CONF_FILE_NAME",
    default: "",
};

/// `chained`: `true` inserts into the primary CNI's list, `false` writes
/// [`install::STANDALONE_FILE_NAME`].
pub const CHAINED: Setting = Setting {
    key: "chained",
    env: "MESHCAP_CHAINED",
    default: "true",
};

/// `excludeNamespaces`: comma-separated namespaces the plugin never captures.
pub const EXCLUDE_NAMESPACES: Setting = Setting {
    key: "excludeNamespaces",
    env: "MESHCAP_EXCLUDE_NAMESPACES",
    default: "kube-system",
};

/// `logging.level` (or `global.logging.level`): the agent's and the plugin's log level, in
/// Istio's `--log_output_level` form ([`log_levels`]).
pub const LOG_LEVEL: Setting = Setting {
    key: "logging.level",
    env: "MESHCAP_LOG_LEVEL",
    default: "info",
};

/// `global.logAsJson`: the agent logs one JSON object per line.
pub const LOG_AS_JSON: Setting = Setting {
    key: "global.logAsJson",
    env: "MESHCAP_LOG_AS_JSON",
    default: "false",
};

/// `cniNetnsDir`: where the runtime bind-mounts pod network namespaces (the DaemonSet mounts it
/// at the same path); the repair controller and ambient mode look for a pod's netns there.
pub const CNI_NETNS_DIR: Setting = Setting {
    key: "cniNetnsDir",
    env: "MESHCAP_CNI_NETNS_DIR",
    default: paths::NETNS_DIR,
};

/// `meshcap.backend` (meshcap's own): `auto` (eBPF when the kernel can, else iptables), `ebpf`
/// or `iptables`.
pub const MODE: Setting = Setting {
    key: "meshcap.backend",
    env: "MESHCAP_MODE",
    default: "auto",
};

/// `meshcap.startupTaint` (meshcap's own): the taint key the agent removes from its node when
/// ready; empty disables.
pub const STARTUP_TAINT: Setting = Setting {
    key: "meshcap.startupTaint",
    env: "MESHCAP_STARTUP_TAINT",
    default: taint::DEFAULT_KEY,
};

/// `meshcap.verifyIntervalSeconds` (meshcap's own): seconds between two verifications of every
/// capture against its record (what drifted is put back, counted and reported); 0 turns
/// verification off.
pub const VERIFY_INTERVAL_SECONDS: Setting = Setting {
    key: "meshcap.verifyIntervalSeconds",
    env: "MESHCAP_VERIFY_INTERVAL_SECONDS",
    default: "30",
};

/// `repair.enabled`: run the repair controller (pods that started before their capture).
pub const REPAIR_ENABLED: Setting = Setting {
    key: "repair.enabled",
    env: "MESHCAP_REPAIR_ENABLED",
    default: "true",
};

/// `repair.repairPods`: capture a broken pod in place (the default mode; first of the three).
pub const REPAIR_REPAIR_PODS: Setting = Setting {
    key: "repair.repairPods",
    env: "MESHCAP_REPAIR_REPAIR_PODS",
    default: "true",
};

/// `repair.deletePods`: delete a broken pod (when `repairPods` is off).
pub const REPAIR_DELETE_PODS: Setting = Setting {
    key: "repair.deletePods",
    env: "MESHCAP_REPAIR_DELETE_PODS",
    default: "false",
};

/// `repair.labelPods`: label a broken pod (when the other two are off).
pub const REPAIR_LABEL_PODS: Setting = Setting {
    key: "repair.labelPods",
    env: "MESHCAP_REPAIR_LABEL_PODS",
    default: "false",
};

/// `repair.initContainerName`: the init container whose failure marks a broken pod.
pub const REPAIR_INIT_CONTAINER_NAME: Setting = Setting {
    key: "repair.initContainerName",
    env: "MESHCAP_REPAIR_INIT_CONTAINER_NAME",
    default: "istio-validation",
};

/// `repair.brokenPodLabelKey`: the label `labelPods` sets.
pub const REPAIR_BROKEN_POD_LABEL_KEY: Setting = Setting {
    key: "repair.brokenPodLabelKey",
    env: "MESHCAP_REPAIR_BROKEN_POD_LABEL_KEY",
    default: "cni.istio.io/uninitialized",
};

/// `repair.brokenPodLabelValue`: its value.
pub const REPAIR_BROKEN_POD_LABEL_VALUE: Setting = Setting {
    key: "repair.brokenPodLabelValue",
    env: "MESHCAP_REPAIR_BROKEN_POD_LABEL_VALUE",
    default: "true",
};

/// `ambient.enabled`: capture pods enrolled in ambient mode for ztunnel.
pub const AMBIENT_ENABLED: Setting = Setting {
    key: "ambient.enabled",
    env: "MESHCAP_AMBIENT_ENABLED",
    default: "false",
};

/// `ambient.dnsCapture`: DNS of enrolled pods to ztunnel's DNS proxy (unless a pod says not).
pub const AMBIENT_DNS_CAPTURE: Setting = Setting {
    key: "ambient.dnsCapture",
    env: "MESHCAP_AMBIENT_DNS_CAPTURE",
    default: "true",
};

/// `ambient.ipv6`: IPv6 in-pod rules beside IPv4.
pub const AMBIENT_IPV6: Setting = Setting {
    key: "ambient.ipv6",
    env: "MESHCAP_AMBIENT_IPV6",
    default: "true",
};

/// `meshcap.ambient.inKernel` (meshcap's own): ambient pods are captured by the kernel programs
/// (the eBPF backend, when it serves the node) instead of Istio's in-pod rules.
pub const AMBIENT_IN_KERNEL: Setting = Setting {
    key: "meshcap.ambient.inKernel",
    env: "MESHCAP_AMBIENT_IN_KERNEL",
    default: "false",
};

/// `ambient.reconcileIptablesOnStartup`: a starting agent rewrites the in-pod rules of pods
/// enrolled before it started where they differ from its own (an upgrade, or rules changed
/// behind its back).
pub const AMBIENT_RECONCILE_IPTABLES_ON_STARTUP: Setting = Setting {
    key: "ambient.reconcileIptablesOnStartup",
    env: "MESHCAP_AMBIENT_RECONCILE_IPTABLES_ON_STARTUP",
    default: "true",
};

/// `ambient.enablementSelectors`: which pods ambient mode enrolls, as YAML (Istio's chart renders
/// its list with `toYaml`; JSON is YAML too). Istio's chart default: the pod labelled
/// `istio.io/dataplane-mode=ambient`, or its namespace so labelled unless the pod says `none`.
pub const AMBIENT_ENABLEMENT_SELECTORS: Setting = Setting {
    key: "ambient.enablementSelectors",
    env: "MESHCAP_AMBIENT_ENABLEMENT_SELECTORS",
    default: r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#,
};

/// `istioOwnedCNIConfig`: Istio's own conflist merging the primary's (Istio 1.27). meshcap does
/// not have it yet: accepted, and reported at start when set ([`not_supported`]).
pub const ISTIO_OWNED_CNI_CONFIG: Setting = Setting {
    key: "istioOwnedCNIConfig",
    env: "MESHCAP_ISTIO_OWNED_CNI_CONFIG",
    default: "false",
};

/// `global.nativeNftables`: Istio's rules as native nftables (Istio 1.27). Not in meshcap yet
/// (its iptables backend picks legacy or nft iptables per pod, as Istio's iptables mode does).
pub const NATIVE_NFTABLES: Setting = Setting {
    key: "global.nativeNftables",
    env: "MESHCAP_NATIVE_NFTABLES",
    default: "false",
};

/// `ambient.enableAmbientDetectionRetry`: Istio's plugin retries its ambient check on API
/// errors. Not in meshcap yet.
pub const AMBIENT_DETECTION_RETRY: Setting = Setting {
    key: "ambient.enableAmbientDetectionRetry",
    env: "MESHCAP_AMBIENT_ENABLE_AMBIENT_DETECTION_RETRY",
    default: "false",
};

/// Istio settings meshcap accepts but does not act on yet, and what it does instead.
pub const NOT_SUPPORTED: [(Setting, &str); 3] = [
    (
        ISTIO_OWNED_CNI_CONFIG,
        "meshcap chains its entry into the primary CNI's configuration (or writes its \
         standalone file with chained=false)",
    ),
    (
        NATIVE_NFTABLES,
        "the iptables backend writes Istio's iptables rules (legacy or nft iptables, chosen per \
         pod as Istio does); the eBPF backend needs neither",
    ),
    (
        AMBIENT_DETECTION_RETRY,
        "the plugin asks the agent, which looks a pod up again while the pod source lags",
    ),
];

/// Every ConfigMap setting, in the ConfigMap's order.
pub const ALL: [Setting; 27] = [
    CNI_BIN_DIR,
    CNI_CONF_DIR,
    CNI_CONF_FILE_NAME,
    CNI_NETNS_DIR,
    CHAINED,
    EXCLUDE_NAMESPACES,
    LOG_LEVEL,
    LOG_AS_JSON,
    MODE,
    STARTUP_TAINT,
    VERIFY_INTERVAL_SECONDS,
    REPAIR_ENABLED,
    REPAIR_REPAIR_PODS,
    REPAIR_DELETE_PODS,
    REPAIR_LABEL_PODS,
    REPAIR_INIT_CONTAINER_NAME,
    REPAIR_BROKEN_POD_LABEL_KEY,
    REPAIR_BROKEN_POD_LABEL_VALUE,
    AMBIENT_ENABLED,
    AMBIENT_DNS_CAPTURE,
    AMBIENT_IPV6,
    AMBIENT_IN_KERNEL,
    AMBIENT_RECONCILE_IPTABLES_ON_STARTUP,
    AMBIENT_ENABLEMENT_SELECTORS,
    ISTIO_OWNED_CNI_CONFIG,
    NATIVE_NFTABLES,
    AMBIENT_DETECTION_RETRY,
];

/// The node the agent runs on (the downward API's `spec.nodeName`).
pub const NODE_NAME_ENV: &str = "MESHCAP_NODE_NAME";

/// The node's network namespace, where ambient mode SNATs kubelet's probes (unset: the agent's
/// own, the node's in the host-network DaemonSet).
pub const NODE_NETNS_ENV: &str = "MESHCAP_NODE_NETNS";

/// The agent's own namespace (the downward API's `metadata.namespace`).
pub const POD_NAMESPACE_ENV: &str = "MESHCAP_POD_NAMESPACE";

/// The agent's own pod name (the downward API's `metadata.name`): its DaemonSet, the pod's
/// owner, says at shutdown whether meshcap is being deleted.
pub const POD_NAME_ENV: &str = "MESHCAP_POD_NAME";

/// The cgroup v2 root the programs attach to ([`paths::HOST_CGROUP_ROOT`] in the DaemonSet;
/// found in mountinfo when unset).
pub const CGROUP_ROOT_ENV: &str = "MESHCAP_CGROUP_ROOT";

/// The versioned bpffs directory the agent pins under (on the [`paths::BPFFS`] mount;
/// [`crate::backend::ebpf::DEFAULT_BPFFS_DIR`] by default).
pub const BPFFS_DIR_ENV: &str = "MESHCAP_BPFFS_DIR";

/// `true` in the DaemonSet: install the plugin and keep its conflist entry in place.
pub const INSTALL_CNI_ENV: &str = "MESHCAP_INSTALL_CNI";

/// Where the `meshcap-cni` binary to install is, in the agent's image: beside the agent.
pub const PLUGIN_SOURCE: &str = "/usr/local/bin/meshcap-cni";

/// Parses `chained`'s value as Istio does (Go's `strconv.ParseBool`).
#[must_use]
pub fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Splits a comma-separated list, dropping empty elements and whitespace (Istio's
/// `config.Split`).
#[must_use]
pub fn parse_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A setting with a value the agent cannot use.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A boolean setting is not one.
    #[error("{env}: {value:?} is not true or false")]
    NotBool {
        /// The variable.
        env: &'static str,
        /// Its value.
        value: String,
    },
    /// A YAML setting is not YAML of the expected shape.
    #[error("{env}: {value:?} is not YAML of the expected shape: {reason}")]
    NotYaml {
        /// The variable.
        env: &'static str,
        /// Its value.
        value: String,
        /// The parser's complaint.
        reason: String,
    },
}

/// A boolean setting through `lookup`.
///
/// # Errors
/// When it is not a boolean: names the variable and the value.
pub fn bool_setting(
    lookup: &impl Fn(&str) -> Option<String>,
    setting: Setting,
) -> Result<bool, SettingsError> {
    let value = lookup(setting.env).unwrap_or_else(|| setting.default.to_owned());
    parse_bool(&value).ok_or(SettingsError::NotBool {
        env: setting.env,
        value,
    })
}

/// `ambient.enablementSelectors` as a JSON value: the YAML list Istio's chart renders (or
/// JSON, which is YAML too).
///
/// # Errors
/// When the text is not YAML, or not a list.
pub fn enablement_selectors(text: &str) -> Result<serde_json::Value, SettingsError> {
    let not_yaml = |reason: String| SettingsError::NotYaml {
        env: AMBIENT_ENABLEMENT_SELECTORS.env,
        value: text.to_owned(),
        reason,
    };
    let value: serde_json::Value =
        yaml_serde::from_str(text).map_err(|e| not_yaml(e.to_string()))?;
    if value.is_array() {
        Ok(value)
    } else {
        Err(not_yaml("not a list of selectors".to_owned()))
    }
}

/// The levels a `logging.level` value gives the agent and the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLevels {
    /// The agent's `tracing` filter (`RUST_LOG` still wins when set).
    pub agent: String,
    /// The plugin's `log_level`: `error`, `warn`, `info` or `debug`.
    pub plugin: &'static str,
}

/// Reads `logging.level` as Istio's `--log_output_level`: comma-separated `[scope:]level`, levels
/// `debug`, `info`, `warn`, `error`, `fatal`, `none`. A bare level, `all:` or `default:` sets
/// both; `cni-plugin:` the plugin's alone; any other Istio scope (`cni-agent`, `repair`, ...)
/// the agent's, the most verbose winning, since meshcap's agent is one scope. A value that is
/// not in that form is taken as a `tracing` filter for the agent (meshcap's older form), the
/// plugin then logging at `info`.
#[must_use]
pub fn log_levels(value: &str) -> LogLevels {
    fn rank(level: &str) -> Option<u8> {
        match level {
            "none" => Some(0),
            "fatal" | "error" => Some(1),
            "warn" => Some(2),
            "info" => Some(3),
            "debug" => Some(4),
            _ => None,
        }
    }
    const AGENT: [&str; 5] = ["off", "error", "warn", "info", "debug"];
    const PLUGIN: [&str; 5] = ["error", "error", "warn", "info", "debug"];
    let (mut all, mut plugin, mut agent) = (None, None, None::<u8>);
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (scope, level) = item.rsplit_once(':').unwrap_or(("default", item));
        let Some(level) = rank(level) else {
            return LogLevels {
                agent: value.to_owned(),
                plugin: "info",
            };
        };
        match scope {
            "default" | "all" => all = Some(level),
            "cni-plugin" => plugin = Some(level),
            _ => agent = Some(agent.map_or(level, |a| a.max(level))),
        }
    }
    let info = 3;
    let agent = match (all, agent) {
        (Some(a), Some(b)) => a.max(b),
        (a, b) => a.or(b).unwrap_or(info),
    };
    LogLevels {
        agent: AGENT[usize::from(agent)].to_owned(),
        plugin: PLUGIN[usize::from(plugin.or(all).unwrap_or(info))],
    }
}

/// The [`NOT_SUPPORTED`] settings turned on through `lookup`, each with what meshcap does
/// instead: the agent logs them at start.
///
/// # Errors
/// When one is not a boolean.
pub fn not_supported(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Vec<(&'static str, &'static str)>, SettingsError> {
    let mut on = Vec::new();
    for (setting, instead) in NOT_SUPPORTED {
        if bool_setting(lookup, setting)? {
            on.push((setting.key, instead));
        }
    }
    Ok(on)
}

/// The install configuration from these settings, read through `lookup` (e.g.
/// `|name| std::env::var(name).ok()`); unset variables take the defaults.
///
/// # Errors
/// When `chained` is not a boolean: names the variable and the value.
pub fn install_config(
    lookup: impl Fn(&str) -> Option<String>,
    plugin_source: std::path::PathBuf,
) -> Result<install::InstallConfig, SettingsError> {
    let get = |s: Setting| lookup(s.env).unwrap_or_else(|| s.default.to_owned());
    let mut config = install::InstallConfig::new(plugin_source);
    config.cni_bin_dir = get(CNI_BIN_DIR).into();
    config.cni_conf_dir = get(CNI_CONF_DIR).into();
    config.cni_conf_file_name = Some(get(CNI_CONF_FILE_NAME)).filter(|n| !n.is_empty());
    config.chained = bool_setting(&lookup, CHAINED)?;
    config.plugin.exclude_namespaces = parse_list(&get(EXCLUDE_NAMESPACES));
    config.plugin.log_level = log_levels(&get(LOG_LEVEL)).plugin.to_owned();
    if let Some(namespace) = lookup(POD_NAMESPACE_ENV) {
        config.plugin.agent_pod_namespace = namespace;
    }
    if bool_setting(&lookup, AMBIENT_ENABLED)? {
        config.plugin.ambient_selectors =
            Some(enablement_selectors(&get(AMBIENT_ENABLEMENT_SELECTORS))?);
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_install_modules() {
        let config = install_config(|_| None, PLUGIN_SOURCE.into()).expect("defaults");
        assert_eq!(
            config,
            install::InstallConfig::new(PLUGIN_SOURCE.into()),
            "the ConfigMap's defaults and the install module's must agree"
        );
    }

    #[test]
    fn values_are_read_as_istio_reads_them() {
        let env = |name: &str| match name {
            "MESHCAP_CHAINED" => Some("False".to_owned()),
            "MESHCAP_EXCLUDE_NAMESPACES" => Some(" kube-system,, istio-system ".to_owned()),
            "MESHCAP_CNI_CONF_FILE_NAME" => Some("10-calico.conflist".to_owned()),
            _ => None,
        };
        let config = install_config(env, PLUGIN_SOURCE.into()).expect("config");
        assert!(!config.chained);
        assert_eq!(
            config.plugin.exclude_namespaces,
            ["kube-system", "istio-system"]
        );
        assert_eq!(
            config.cni_conf_file_name.as_deref(),
            Some("10-calico.conflist")
        );
        let bad = install_config(
            |n| (n == "MESHCAP_CHAINED").then(|| "yes".to_owned()),
            PLUGIN_SOURCE.into(),
        );
        assert_eq!(
            bad.expect_err("yes is not a Go bool").to_string(),
            "MESHCAP_CHAINED: \"yes\" is not true or false"
        );
    }

    #[test]
    fn selectors_are_read_as_the_yaml_istios_chart_renders() {
        // `toYaml` of Istio's default list, as its chart and ours put it in the ConfigMap.
        let yaml = "- podSelector:\n    matchLabels:\n      istio.io/dataplane-mode: ambient\n\
                    - namespaceSelector:\n    matchLabels:\n      istio.io/dataplane-mode: ambient\n  \
                    podSelector:\n    matchExpressions:\n    - key: istio.io/dataplane-mode\n      \
                    operator: NotIn\n      values:\n      - none\n";
        assert_eq!(
            enablement_selectors(yaml).expect("YAML"),
            enablement_selectors(AMBIENT_ENABLEMENT_SELECTORS.default).expect("JSON")
        );
        let env = |name: &str| match name {
            "MESHCAP_AMBIENT_ENABLED" => Some("true".to_owned()),
            "MESHCAP_AMBIENT_ENABLEMENT_SELECTORS" => Some("podSelector: {}".to_owned()),
            _ => None,
        };
        assert_eq!(
            install_config(env, PLUGIN_SOURCE.into())
                .expect_err("a map, not a list")
                .to_string(),
            "MESHCAP_AMBIENT_ENABLEMENT_SELECTORS: \"podSelector: {}\" is not YAML of the expected \
             shape: not a list of selectors"
        );
    }

    #[test]
    fn log_levels_are_read_as_istios_log_output_level() {
        let levels = |v: &str| {
            let l = log_levels(v);
            (l.agent, l.plugin)
        };
        assert_eq!(levels("info"), ("info".to_owned(), "info"));
        assert_eq!(levels("debug"), ("debug".to_owned(), "debug"));
        assert_eq!(levels("none"), ("off".to_owned(), "error"));
        assert_eq!(levels("fatal"), ("error".to_owned(), "error"));
        assert_eq!(
            levels("default:warn,cni-plugin:debug"),
            ("warn".to_owned(), "debug")
        );
        assert_eq!(
            levels("all:info,cni-agent:debug,repair:error"),
            ("debug".to_owned(), "info")
        );
        assert_eq!(levels("cni-plugin:debug"), ("info".to_owned(), "debug"));
        // meshcap's older form: a tracing filter, for the agent alone.
        assert_eq!(
            levels("meshcap_agent=debug"),
            ("meshcap_agent=debug".to_owned(), "info")
        );
    }

    #[test]
    fn istio_features_meshcap_lacks_are_reported_when_on() {
        assert!(not_supported(&|_| None).expect("defaults").is_empty());
        let env = |name: &str| {
            [
                "MESHCAP_ISTIO_OWNED_CNI_CONFIG",
                "MESHCAP_NATIVE_NFTABLES",
                "MESHCAP_AMBIENT_ENABLE_AMBIENT_DETECTION_RETRY",
            ]
            .contains(&name)
            .then(|| "true".to_owned())
        };
        let on: Vec<_> = not_supported(&env)
            .expect("booleans")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        assert_eq!(
            on,
            [
                "istioOwnedCNIConfig",
                "global.nativeNftables",
                "ambient.enableAmbientDetectionRetry"
            ]
        );
    }
}
