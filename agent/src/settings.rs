//! The node settings a cluster install gives the agent: the keys of the `meshcap-config`
//! ConfigMap, each named after the Helm value it comes from (Istio's istio-cni chart's names and
//! defaults where Istio has the setting, `deploy/chart`), and the environment variable the
//! DaemonSet passes each in. The chart's rendering is checked against this table by a test, and
//! the agent's `run` reads exactly these variables.
mod read;

pub use read::{
    InKernel, LogLevels, SettingsError, bool_setting, enablement_selectors, in_kernel,
    install_config, log_levels, not_supported, parse_bool, parse_list,
};

use crate::{paths, taint};

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
/// [`crate::install::STANDALONE_FILE_NAME`].
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

/// `meshcap.ambient.inKernel` (meshcap's own): whether ambient pods are captured by the kernel
/// programs instead of Istio's in-pod rules ([`InKernel`]): `auto` (unset or empty too) where
/// the eBPF backend serves the node, `true` required there, `false` never.
pub const AMBIENT_IN_KERNEL: Setting = Setting {
    key: "meshcap.ambient.inKernel",
    env: "MESHCAP_AMBIENT_IN_KERNEL",
    default: "auto",
};

/// `meshcap.takeover.toKernel`: on a node whose sidecar pods go to the kernel programs, the
/// sidecar pods whose istio-cni rules the agent adopts at start are moved to the kernel
/// programs in place (the kernel capture first, then Istio's rules removed); `false` (the
/// default) keeps Istio's rules until each pod goes.
pub const TAKEOVER_TO_KERNEL: Setting = Setting {
    key: "meshcap.takeover.toKernel",
    env: "MESHCAP_TAKEOVER_TO_KERNEL",
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

/// `istioOwnedCNIConfig` (Istio 1.27): chained, meshcap writes a file of its own that merges the
/// primary CNI's configuration with its entry, instead of editing the primary's file, so that
/// a primary rewriting its file cannot drop meshcap ([`crate::install::owned`]).
pub const ISTIO_OWNED_CNI_CONFIG: Setting = Setting {
    key: "istioOwnedCNIConfig",
    env: "MESHCAP_ISTIO_OWNED_CNI_CONFIG",
    default: "false",
};

/// `istioOwnedCNIConfigFileName`: that file's name; empty: Istio's
/// [`crate::install::OWNED_FILE_NAME`]. It must sort before the primary's.
pub const ISTIO_OWNED_CNI_CONFIG_FILE_NAME: Setting = Setting {
    key: "istioOwnedCNIConfigFileName",
    env: "MESHCAP_ISTIO_OWNED_CNI_CONFIG_FILE_NAME",
    default: "",
};

/// `global.nativeNftables`: Istio's rules as native nftables (Istio 1.27 sidecar, 1.28
/// ambient) wherever the rules path captures pods (the kernel programs still capture where they
/// run, unless the backend is pinned).
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
pub const NOT_SUPPORTED: [(Setting, &str); 1] = [(
    AMBIENT_DETECTION_RETRY,
    "the plugin asks the agent, which looks a pod up again while the pod source lags",
)];

/// Every ConfigMap setting, in the ConfigMap's order.
pub const ALL: [Setting; 29] = [
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
    TAKEOVER_TO_KERNEL,
    ISTIO_OWNED_CNI_CONFIG,
    ISTIO_OWNED_CNI_CONFIG_FILE_NAME,
    NATIVE_NFTABLES,
    AMBIENT_DETECTION_RETRY,
];

/// Istio's `CNI_CONF_GROUP_READ` (Istio 1.30), set through the chart's `env` as with Istio:
/// `true` writes meshcap's own CNI configuration files 0640 instead of 0600.
pub const CNI_CONF_GROUP_READ_ENV: &str = "CNI_CONF_GROUP_READ";

/// The node the agent runs on (the downward API's `spec.nodeName`).
pub const NODE_NAME_ENV: &str = "MESHCAP_NODE_NAME";

/// The node's network namespace, where ambient mode SNATs kubelet's probes (unset: the agent's
/// own, the node's in the host-network DaemonSet).
pub const NODE_NETNS_ENV: &str = "MESHCAP_NODE_NETNS";

/// The host's `/proc`, where ambient mode with `global.nativeNftables` finds kubelet's uid
/// ([`crate::paths::HOST_PROC`] by default, where the DaemonSet mounts it).
pub const HOST_PROC_ENV: &str = "MESHCAP_HOST_PROC";

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

/// The directory holding the plugin's token (`token`): [`paths::CNI_TOKEN_DIR`] in the
/// DaemonSet; with `$KUBECONFIG` (an agent run outside a pod) only when set.
pub const CNI_TOKEN_DIR_ENV: &str = "MESHCAP_CNI_TOKEN_DIR";

/// `true` in the DaemonSet: install the plugin and keep its conflist entry in place.
pub const INSTALL_CNI_ENV: &str = "MESHCAP_INSTALL_CNI";

/// Where the `meshcap-cni` binary to install is, in the agent's image: beside the agent.
pub const PLUGIN_SOURCE: &str = "/usr/local/bin/meshcap-cni";

/// The address of health and readiness (`meshcap-agent run --health-listen`), which the
/// DaemonSet sets from `meshcap.healthPort`.
pub const HEALTH_LISTEN_ENV: &str = "MESHCAP_HEALTH_LISTEN";

/// The address of the metrics (`meshcap-agent run --metrics-listen`), which the DaemonSet sets
/// from `meshcap.metricsPort`.
pub const METRICS_LISTEN_ENV: &str = "MESHCAP_METRICS_LISTEN";
