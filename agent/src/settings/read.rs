//! Reading the settings: Istio's own value syntaxes (Go's booleans, comma lists, the
//! enablement selectors as the chart writes them, the log levels with their scopes), the
//! settings meshcap does not support yet, and the install configuration they make.
use super::{
    AMBIENT_ENABLED, AMBIENT_ENABLEMENT_SELECTORS, AMBIENT_IN_KERNEL, CHAINED, CNI_BIN_DIR,
    CNI_CONF_DIR, CNI_CONF_FILE_NAME, CNI_CONF_GROUP_READ_ENV, EXCLUDE_NAMESPACES,
    ISTIO_OWNED_CNI_CONFIG, ISTIO_OWNED_CNI_CONFIG_FILE_NAME, LOG_LEVEL, NOT_SUPPORTED,
    POD_NAMESPACE_ENV, Setting,
};
use crate::install;

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
    /// A setting that takes `auto` or a boolean is neither.
    #[error("{env}: {value:?} is not auto, true or false")]
    NotAutoOrBool {
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

/// `meshcap.ambient.inKernel`: how ambient pods are to be captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InKernel {
    /// By the kernel programs where the eBPF backend serves the node (the kernel probe passed,
    /// or `--backend ebpf`), else by Istio's in-pod rules: the default.
    Auto,
    /// By the kernel programs; an agent whose node the eBPF backend does not serve refuses to
    /// start, as `--backend ebpf` does on a kernel that cannot run it.
    Required,
    /// By Istio's in-pod rules.
    Off,
}

/// `meshcap.ambient.inKernel` through `lookup`: `auto`, unset or empty for [`InKernel::Auto`],
/// else a Go boolean.
///
/// # Errors
/// When it is none of these: names the variable and the value.
pub fn in_kernel(lookup: &impl Fn(&str) -> Option<String>) -> Result<InKernel, SettingsError> {
    let value = lookup(AMBIENT_IN_KERNEL.env).unwrap_or_else(|| AMBIENT_IN_KERNEL.default.into());
    match value.as_str() {
        "" | "auto" => Ok(InKernel::Auto),
        other => match parse_bool(other) {
            Some(true) => Ok(InKernel::Required),
            Some(false) => Ok(InKernel::Off),
            None => Err(SettingsError::NotAutoOrBool {
                env: AMBIENT_IN_KERNEL.env,
                value,
            }),
        },
    }
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
/// When `chained`, `istioOwnedCNIConfig` or `CNI_CONF_GROUP_READ` is not a boolean, or the
/// enablement selectors not a list: names the variable and the value.
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
    config.owned = bool_setting(&lookup, ISTIO_OWNED_CNI_CONFIG)?;
    if let Some(name) = lookup(ISTIO_OWNED_CNI_CONFIG_FILE_NAME.env).filter(|n| !n.is_empty()) {
        config.owned_file_name = name;
    }
    // Istio reads it through viper, where anything but a Go boolean is false; here it is an
    // error naming it.
    if let Some(value) = lookup(CNI_CONF_GROUP_READ_ENV) {
        let group_read = parse_bool(&value).ok_or(SettingsError::NotBool {
            env: CNI_CONF_GROUP_READ_ENV,
            value,
        })?;
        if group_read {
            config.conf_mode = install::CONF_MODE_GROUP_READ;
        }
    }
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
    use crate::settings::PLUGIN_SOURCE;

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
    fn in_kernel_is_auto_unless_a_boolean_says_otherwise() {
        let with = |value: Option<&str>| {
            let value = value.map(str::to_owned);
            in_kernel(&move |name: &str| {
                assert_eq!(name, "MESHCAP_AMBIENT_IN_KERNEL");
                value.clone()
            })
        };
        for (value, expected) in [
            (None, InKernel::Auto),
            (Some(""), InKernel::Auto),
            (Some("auto"), InKernel::Auto),
            (Some("true"), InKernel::Required),
            (Some("T"), InKernel::Required),
            (Some("false"), InKernel::Off),
            (Some("0"), InKernel::Off),
        ] {
            assert_eq!(with(value).expect("a value"), expected, "{value:?}");
        }
        let error = with(Some("yes")).expect_err("not a value").to_string();
        assert_eq!(
            error,
            r#"MESHCAP_AMBIENT_IN_KERNEL: "yes" is not auto, true or false"#
        );
    }

    #[test]
    fn values_are_read_as_istio_reads_them() {
        let env = |name: &str| match name {
            "MESHCAP_CHAINED" => Some("False".to_owned()),
            "MESHCAP_EXCLUDE_NAMESPACES" => Some(" kube-system,, istio-system ".to_owned()),
            "MESHCAP_CNI_CONF_FILE_NAME" => Some("10-calico.conflist".to_owned()),
            "MESHCAP_ISTIO_OWNED_CNI_CONFIG" => Some("1".to_owned()),
            "MESHCAP_ISTIO_OWNED_CNI_CONFIG_FILE_NAME" => Some("00-mesh.conflist".to_owned()),
            "CNI_CONF_GROUP_READ" => Some("TRUE".to_owned()),
            _ => None,
        };
        let config = install_config(env, PLUGIN_SOURCE.into()).expect("config");
        assert!(!config.chained);
        assert!(config.owned);
        assert_eq!(config.owned_file_name, "00-mesh.conflist");
        assert_eq!(config.conf_mode, 0o640);
        let defaults = install_config(|_| None, PLUGIN_SOURCE.into()).expect("defaults");
        assert_eq!(
            (defaults.owned, defaults.owned_file_name.as_str()),
            (false, "02-istio-cni.conflist")
        );
        assert_eq!(defaults.conf_mode, 0o600);
        let group_read = install_config(
            |n| (n == "CNI_CONF_GROUP_READ").then(|| "yes".to_owned()),
            PLUGIN_SOURCE.into(),
        );
        assert_eq!(
            group_read.expect_err("yes is not a Go bool").to_string(),
            "CNI_CONF_GROUP_READ: \"yes\" is not true or false"
        );
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
                "MESHCAP_NATIVE_NFTABLES",
                "MESHCAP_AMBIENT_ENABLE_AMBIENT_DETECTION_RETRY",
            ]
            .contains(&name)
            .then(|| "true".to_owned())
        };
        // Native nftables is supported: only the other is reported.
        let on: Vec<_> = not_supported(&env)
            .expect("booleans")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        assert_eq!(on, ["ambient.enableAmbientDetectionRetry"]);
    }
}
