//! `deploy/` (the plain manifests, rendered from `deploy/chart` with its defaults) against the
//! agent: every manifest parses into its k8s-openapi type without a field lost (a misspelt field
//! would be dropped silently by the API server), the RBAC rules are exactly what the agent calls,
//! and the ConfigMap and DaemonSet carry exactly the settings and host paths the agent's defaults
//! name. `chart.rs` checks the chart's other configurations and that these files are its.
use std::{collections::BTreeMap, fs, path::Path};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, PodSpec, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    },
    serde::{Deserialize as _, Serialize, de::DeserializeOwned},
};
use meshcap_agent::{paths, settings};
use serde_json::Value;

#[derive(Default)]
struct Manifests {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
}

/// Parses `doc` as `T` and checks that serializing it back gives the same document: nothing
/// was unknown to the type.
fn typed<T: DeserializeOwned + Serialize>(file: &str, doc: &Value) -> T {
    let object: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{file}: not a valid {}: {e}", doc["kind"]));
    let back = serde_json::to_value(&object).expect("serializing");
    assert_eq!(
        &back, doc,
        "{file}: fields lost in parsing (misspelt or misplaced?)"
    );
    object
}

fn manifests() -> Manifests {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut found = Manifests::default();
    let mut names: Vec<_> = fs::read_dir(&dir)
        .expect("deploy/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    names.sort();
    assert!(!names.is_empty());
    for path in names {
        let file = path.display().to_string();
        let text = fs::read_to_string(&path).expect("reading");
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let doc = Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: {e}"));
            match doc["kind"].as_str() {
                Some("Namespace") => found.namespaces.push(typed(&file, &doc)),
                Some("ServiceAccount") => found.service_accounts.push(typed(&file, &doc)),
                Some("ClusterRole") => found.cluster_roles.push(typed(&file, &doc)),
                Some("ClusterRoleBinding") => found.bindings.push(typed(&file, &doc)),
                Some("Role") => found.roles.push(typed(&file, &doc)),
                Some("RoleBinding") => found.role_bindings.push(typed(&file, &doc)),
                Some("ConfigMap") => found.config_maps.push(typed(&file, &doc)),
                Some("DaemonSet") => found.daemon_sets.push(typed(&file, &doc)),
                other => panic!("{file}: unexpected kind {other:?}"),
            }
        }
    }
    found
}

fn one<'a, T>(items: &'a [T], what: &str) -> &'a T {
    assert_eq!(items.len(), 1, "exactly one {what}");
    &items[0]
}

fn agent_container(ds: &DaemonSet) -> (&PodSpec, &Container) {
    let pod = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    (pod, one(&pod.containers, "container"))
}

#[test]
fn rbac_is_exactly_what_the_agent_calls() {
    let m = manifests();
    let role = one(&m.cluster_roles, "ClusterRole");
    let rules: Vec<_> = role
        .rules
        .iter()
        .flatten()
        .map(|r| {
            assert!(r.resource_names.is_none() && r.non_resource_urls.is_none());
            (
                r.api_groups.clone().unwrap_or_default(),
                r.resources.clone().unwrap_or_default(),
                r.verbs.clone(),
            )
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        rules,
        [
            (s(&[""]), s(&["pods"]), s(&["get", "list", "watch"])),
            (
                s(&["events.k8s.io"]),
                s(&["events"]),
                s(&["create", "patch"])
            ),
            // The default startup taint's removal.
            (s(&[""]), s(&["nodes"]), s(&["get", "patch"])),
        ]
    );

    let ns = one(&m.namespaces, "Namespace").metadata.name.clone();
    let sa = one(&m.service_accounts, "ServiceAccount");
    assert_eq!(sa.metadata.namespace, ns);
    let binding = one(&m.bindings, "ClusterRoleBinding");
    assert_eq!(
        binding.role_ref.name,
        role.metadata.name.clone().unwrap_or_default()
    );
    let subject = one(binding.subjects.as_deref().unwrap_or_default(), "subject");
    assert_eq!(
        (Some(subject.name.clone()), subject.namespace.clone()),
        (sa.metadata.name.clone(), ns.clone())
    );
    // In its own namespace only: its own DaemonSet, read when it stops (uninstall on deletion).
    let local = one(&m.roles, "Role");
    assert_eq!(local.metadata.namespace, ns);
    let local_rules: Vec<_> = local
        .rules
        .iter()
        .flatten()
        .map(|r| {
            (
                r.api_groups.clone().unwrap_or_default(),
                r.resources.clone().unwrap_or_default(),
                r.verbs.clone(),
                r.resource_names.clone().unwrap_or_default(),
            )
        })
        .collect();
    let ds_name = one(&m.daemon_sets, "DaemonSet").metadata.name.clone();
    assert_eq!(
        local_rules,
        [(
            s(&["apps"]),
            s(&["daemonsets"]),
            s(&["get"]),
            ds_name.into_iter().collect::<Vec<_>>()
        )]
    );
    let local_binding = one(&m.role_bindings, "RoleBinding");
    assert_eq!(local_binding.metadata.namespace, ns);
    assert_eq!(
        (
            local_binding.role_ref.kind.as_str(),
            Some(local_binding.role_ref.name.clone())
        ),
        ("Role", local.metadata.name.clone())
    );
    let subject = one(
        local_binding.subjects.as_deref().unwrap_or_default(),
        "subject",
    );
    assert_eq!(
        (Some(subject.name.clone()), subject.namespace.clone()),
        (sa.metadata.name.clone(), ns.clone())
    );
    let ds = one(&m.daemon_sets, "DaemonSet");
    assert_eq!(ds.metadata.namespace, ns);
    // The plugin recognises the agent's own pods by these (it must never wait for them).
    assert_eq!(
        ns.as_deref(),
        Some(meshcap_agent::install::AGENT_POD_NAMESPACE)
    );
    assert_eq!(
        ds.metadata.name.clone().map(|n| n + "-").as_deref(),
        Some(meshcap_agent::install::AGENT_POD_PREFIX)
    );
    let (pod, _) = agent_container(ds);
    assert_eq!(pod.service_account_name, sa.metadata.name);
}

#[test]
fn the_config_map_has_every_setting_with_its_default() {
    let m = manifests();
    let data = one(&m.config_maps, "ConfigMap")
        .data
        .clone()
        .unwrap_or_default();
    let mut expected: BTreeMap<String, String> = settings::ALL
        .iter()
        .map(|s| (s.key.to_owned(), s.default.to_owned()))
        .collect();
    // The selectors are YAML in the ConfigMap (the chart's toYaml of Istio's default list) and
    // JSON in the agent's default: the same list.
    let key = settings::AMBIENT_ENABLEMENT_SELECTORS.key;
    assert_eq!(
        settings::enablement_selectors(&data[key]).expect("YAML selectors"),
        settings::enablement_selectors(&expected[key]).expect("JSON selectors")
    );
    expected.insert(key.to_owned(), data[key].clone());
    assert_eq!(data, expected);
}

#[test]
fn the_daemon_set_passes_every_setting_in_its_variable() {
    let m = manifests();
    let config_map = one(&m.config_maps, "ConfigMap").metadata.name.clone();
    let (_, agent) = agent_container(one(&m.daemon_sets, "DaemonSet"));
    let env: BTreeMap<_, _> = agent
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    for setting in settings::ALL {
        let var = env
            .get(setting.env)
            .unwrap_or_else(|| panic!("{} is not set", setting.env));
        let key = var
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{} is not from the ConfigMap", setting.env));
        // Optional: a key deleted from the ConfigMap leaves the agent on its default instead of
        // failing the pod (CreateContainerConfigError).
        assert_eq!(
            (Some(key.name.clone()), key.key.as_str(), key.optional),
            (config_map.clone(), setting.key, Some(true))
        );
    }
    let field = |name: &str| {
        env.get(name)
            .and_then(|v| v.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(
        field(settings::NODE_NAME_ENV).as_deref(),
        Some("spec.nodeName")
    );
    assert_eq!(
        field(settings::POD_NAMESPACE_ENV).as_deref(),
        Some("metadata.namespace")
    );
    assert_eq!(
        field(settings::POD_NAME_ENV).as_deref(),
        Some("metadata.name")
    );
    let value = |name: &str| env.get(name).and_then(|v| v.value.clone());
    assert_eq!(
        value(settings::CGROUP_ROOT_ENV).as_deref(),
        Some(paths::HOST_CGROUP_ROOT)
    );
    assert_eq!(
        value(settings::BPFFS_DIR_ENV).as_deref(),
        Some(meshcap_agent::backend::ebpf::DEFAULT_BPFFS_DIR)
    );
    assert_eq!(value(settings::INSTALL_CNI_ENV).as_deref(), Some("true"));
    assert_eq!(
        agent
            .command
            .as_ref()
            .and_then(|c| c.first())
            .map(String::as_str),
        Path::new(settings::PLUGIN_SOURCE)
            .with_file_name("meshcap-agent")
            .to_str()
    );
}

#[test]
fn the_daemon_set_mounts_what_the_agent_expects() {
    let m = manifests();
    let ds = one(&m.daemon_sets, "DaemonSet");
    let (pod, agent) = agent_container(ds);
    let host_path = |volume: &str| {
        pod.volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone())
            .unwrap_or_else(|| panic!("volume {volume} is not a hostPath"))
    };
    let mounts: BTreeMap<_, _> = agent
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.mount_path.as_str(),
                (
                    host_path(&m.name),
                    m.mount_propagation.clone().unwrap_or_default(),
                    m.read_only.unwrap_or(false),
                ),
            )
        })
        .collect();
    let (host, to_container) = (String::new(), "HostToContainer".to_owned());
    let want = |host_dir: &str, propagation: &String, read_only| {
        (host_dir.to_owned(), propagation.clone(), read_only)
    };
    let expected: BTreeMap<&str, _> = [
        (paths::CNI_BIN_DIR, want(paths::CNI_BIN_DIR, &host, false)),
        (paths::CNI_CONF_DIR, want(paths::CNI_CONF_DIR, &host, false)),
        (paths::RUN_DIR, want(paths::RUN_DIR, &host, false)),
        (paths::BPFFS, want(paths::BPFFS, &to_container, false)),
        (
            paths::HOST_CGROUP_ROOT,
            want("/sys/fs/cgroup", &to_container, true),
        ),
        (
            paths::NETNS_DIR,
            want(paths::NETNS_DIR, &to_container, true),
        ),
        (paths::ZTUNNEL_DIR, want(paths::ZTUNNEL_DIR, &host, false)),
    ]
    .into_iter()
    .collect();
    assert_eq!(mounts, expected);
    assert!(
        Path::new(paths::AGENT_SOCKET).starts_with(paths::RUN_DIR),
        "the plugin reaches the socket through the run dir"
    );
    assert!(
        Path::new(meshcap_agent::ztunnel::DEFAULT_SOCKET).starts_with(paths::ZTUNNEL_DIR),
        "ztunnel reaches the ZDS socket through its dir"
    );
    // The ConfigMap's directories are where the DaemonSet mounts them.
    let data = one(&m.config_maps, "ConfigMap")
        .data
        .clone()
        .unwrap_or_default();
    for setting in [settings::CNI_BIN_DIR, settings::CNI_CONF_DIR] {
        let dir = data[setting.key].as_str();
        assert_eq!(
            mounts.get(dir).map(|m| m.0.as_str()),
            Some(dir),
            "{}",
            setting.key
        );
    }
}

#[test]
fn the_daemon_set_runs_first_everywhere_with_narrow_capabilities() {
    let m = manifests();
    let (pod, agent) = agent_container(one(&m.daemon_sets, "DaemonSet"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(pod.host_network, Some(true));
    let tolerations = pod.tolerations.as_deref().unwrap_or_default();
    for effect in ["NoSchedule", "NoExecute"] {
        assert!(
            tolerations
                .iter()
                .any(|t| t.operator.as_deref() == Some("Exists")
                    && t.key.is_none()
                    && t.effect.as_deref() == Some(effect)),
            "tolerates every {effect} taint, the startup taint included: {tolerations:?}"
        );
    }
    // Linux nodes only, and the architectures the image carries.
    assert_eq!(
        pod.node_selector
            .clone()
            .unwrap_or_default()
            .get("kubernetes.io/os")
            .map(String::as_str),
        Some("linux")
    );
    let security = agent.security_context.as_ref().expect("securityContext");
    assert_eq!(security.privileged, Some(false));
    let caps = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert_eq!(
        caps.add.clone().unwrap_or_default(),
        ["SYS_ADMIN", "NET_ADMIN", "NET_RAW", "SYS_RESOURCE"]
    );
}

#[test]
fn probes_and_scraping_point_at_the_agents_endpoints() {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use meshcap_agent::api::http;

    let m = manifests();
    let ds = one(&m.daemon_sets, "DaemonSet");
    let (_, agent) = agent_container(ds);
    let listen: std::net::SocketAddr = paths::HTTP_LISTEN.parse().expect("HTTP_LISTEN");
    let port = i32::from(listen.port());
    let probe = |which: &str, probe: Option<&k8s_openapi::api::core::v1::Probe>| {
        let get = probe
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("{which}: an httpGet probe"));
        assert_eq!(get.port, IntOrString::Int(port), "{which}");
        get.path.clone().unwrap_or_default()
    };
    assert_eq!(
        probe("readinessProbe", agent.readiness_probe.as_ref()),
        http::READYZ
    );
    let liveness = agent.liveness_probe.as_ref();
    assert_eq!(probe("livenessProbe", liveness), http::HEALTHZ);
    // Never kills an agent that is merely busy: a minute of silence before a restart.
    let liveness = liveness.expect("livenessProbe");
    let silent = liveness.period_seconds.unwrap_or(10) * liveness.failure_threshold.unwrap_or(3);
    assert!(silent >= 60, "liveness gives up after {silent} s");
    assert!(liveness.timeout_seconds.unwrap_or(1) >= 5);

    let ports: Vec<_> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    assert_eq!(ports, [port]);
    let annotations = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    let scrape: BTreeMap<&str, String> = [
        ("prometheus.io/scrape", "true".to_owned()),
        ("prometheus.io/port", port.to_string()),
        ("prometheus.io/path", http::METRICS.to_owned()),
    ]
    .into_iter()
    .collect();
    for (key, value) in &scrape {
        assert_eq!(annotations.get(*key), Some(value), "{key}");
    }
}
