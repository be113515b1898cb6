//! `deploy/` (the plain manifests, rendered from `deploy/chart` with its defaults) against the
//! agent: every manifest parses into its k8s-openapi type without a field lost (a misspelt field
//! would be dropped silently by the API server), the RBAC rules are exactly what the agent and the
//! plugin call with the default settings (the agent's own list of its requests,
//! `meshcap_agent::access::needs`), and the ConfigMap and DaemonSet carry exactly the settings and
//! host paths the agent's defaults name. `chart.rs` checks the chart's other configurations and
//! that these files are its.
use std::{collections::BTreeMap, fs, path::Path};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, PodSpec, Secret, ServiceAccount},
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
    secrets: Vec<Secret>,
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
                Some("Secret") => found.secrets.push(typed(&file, &doc)),
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

/// `(apiGroup, resource, verb)` of every rule of `roles` bound to `account` by `bindings`, with
/// the rule's resourceNames.
type Rules = BTreeMap<(String, String, String), Vec<String>>;

fn rules_of(roles: &[(String, Vec<k8s_openapi::api::rbac::v1::PolicyRule>)]) -> Rules {
    let mut all = Rules::new();
    for (_, rules) in roles {
        for rule in rules {
            assert!(rule.non_resource_urls.is_none());
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    for verb in &rule.verbs {
                        let previous = all.insert(
                            (group.clone(), resource.clone(), verb.clone()),
                            rule.resource_names.clone().unwrap_or_default(),
                        );
                        assert!(
                            previous.is_none(),
                            "{group}/{resource} {verb} granted twice"
                        );
                    }
                }
            }
        }
    }
    all
}

/// The roles bound to the ServiceAccount `account` of `namespace` in `m`.
fn bound(
    m: &Manifests,
    namespace: &str,
    account: &str,
) -> Vec<(String, Vec<k8s_openapi::api::rbac::v1::PolicyRule>)> {
    let subject = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == account
                && s.namespace.as_deref() == Some(namespace)
        })
    };
    let mut roles = Vec::new();
    for binding in m.bindings.iter().filter(|b| subject(&b.subjects)) {
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        let role = m
            .cluster_roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str()))
            .unwrap_or_else(|| panic!("ClusterRole {} not shipped", binding.role_ref.name));
        roles.push((
            binding.role_ref.name.clone(),
            role.rules.clone().unwrap_or_default(),
        ));
    }
    for binding in m.role_bindings.iter().filter(|b| subject(&b.subjects)) {
        assert_eq!(binding.metadata.namespace.as_deref(), Some(namespace));
        let role = m
            .roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str()))
            .unwrap_or_else(|| panic!("Role {} not shipped", binding.role_ref.name));
        assert_eq!(role.metadata.namespace.as_deref(), Some(namespace));
        roles.push((
            binding.role_ref.name.clone(),
            role.rules.clone().unwrap_or_default(),
        ));
    }
    roles
}

/// What `needs` ask, as rules: `(group, resource[/subresource], verb)` and the name.
fn rules_needed(needs: &[meshcap_agent::access::Need]) -> Rules {
    needs
        .iter()
        .map(|n| {
            let resource = if n.subresource.is_empty() {
                n.resource.to_owned()
            } else {
                format!("{}/{}", n.resource, n.subresource)
            };
            // A node's name is this node's: RBAC cannot name it in advance.
            let names = if n.name.is_empty() || n.resource == "nodes" {
                Vec::new()
            } else {
                vec![n.name.clone()]
            };
            ((n.group.to_owned(), resource, n.verb.to_owned()), names)
        })
        .collect()
}

#[test]
fn rbac_is_exactly_what_the_agent_and_the_plugin_call() {
    use meshcap_agent::access::{Features, RepairWrites, needs};

    let m = manifests();
    let ns = one(&m.namespaces, "Namespace")
        .metadata
        .name
        .clone()
        .expect("name");
    let ds = one(&m.daemon_sets, "DaemonSet");
    let ds_name = ds.metadata.name.clone().expect("name");
    // The defaults: a startup taint, repair in place, no ambient mode; the DaemonSet watched.
    let defaults = Features {
        node: "any".into(),
        startup_taint: true,
        daemon_set: Some((ns.clone(), ds_name.clone())),
        ambient: false,
        repair: RepairWrites::None,
    };
    let agent = rules_of(&bound(&m, &ns, "meshcap-agent"));
    assert_eq!(agent, rules_needed(&needs(&defaults)));
    // The plugin may read pods, nothing else.
    let plugin = rules_of(&bound(&m, &ns, "meshcap-cni"));
    let decide = meshcap_agent::uninstall::witness::plugin_needs(false);
    assert_eq!(plugin, rules_needed(&decide));
    let secret = one(&m.secrets, "Secret");
    assert_eq!(
        secret.type_.as_deref(),
        Some("kubernetes.io/service-account-token")
    );
    let token_of = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("kubernetes.io/service-account.name"));
    assert_eq!(token_of.map(String::as_str), Some("meshcap-cni"));
    let (pod, agent_container) = agent_container(ds);
    // Mounted read-only, root's alone (0400), at the path the agent reads it from.
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.secret
                .as_ref()
                .is_some_and(|s| s.secret_name == secret.metadata.name)
        })
        .expect("the DaemonSet mounts the plugin's token Secret");
    assert_eq!(
        volume.secret.as_ref().and_then(|s| s.default_mode),
        Some(0o400)
    );
    let mount = agent_container
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.name == volume.name)
        .expect("the agent mounts it");
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        (paths::CNI_TOKEN_DIR, Some(true))
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("meshcap-agent"));
    // The plugin recognises the agent's own pods by these (it must never wait for them).
    assert_eq!(ns, meshcap_agent::install::AGENT_POD_NAMESPACE);
    assert_eq!(ds_name + "-", meshcap_agent::install::AGENT_POD_PREFIX);
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
    // The host's directories; the plugin's token Secret is checked with the RBAC.
    let is_secret = |volume: &str| {
        pod.volumes
            .iter()
            .flatten()
            .any(|v| v.name == volume && v.secret.is_some())
    };
    let mounts: BTreeMap<_, _> = agent
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| !is_secret(&m.name))
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
        ["SYS_ADMIN", "NET_ADMIN", "NET_RAW"],
        "no SYS_RESOURCE by default (meshcap.sysResource)"
    );
}

#[test]
fn probes_and_scraping_point_at_the_agents_endpoints() {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use meshcap_agent::api::http;

    let m = manifests();
    let ds = one(&m.daemon_sets, "DaemonSet");
    let (_, agent) = agent_container(ds);
    // Istio's node agent's ports: health and readiness on 8000 (`constants.ReadinessPort`),
    // metrics on 15014 (`--monitoring-port`'s default), and the agent listens where the
    // DaemonSet points.
    let at = |addr: &str| addr.parse::<std::net::SocketAddr>().expect("an address");
    assert_eq!(at(paths::HEALTH_LISTEN).port(), 8000);
    assert_eq!(at(paths::METRICS_LISTEN).port(), 15014);
    let env: BTreeMap<_, _> = agent
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e.value.clone()))
        .collect();
    assert_eq!(
        env.get(settings::HEALTH_LISTEN_ENV)
            .cloned()
            .flatten()
            .as_deref(),
        Some(paths::HEALTH_LISTEN)
    );
    assert_eq!(
        env.get(settings::METRICS_LISTEN_ENV)
            .cloned()
            .flatten()
            .as_deref(),
        Some(paths::METRICS_LISTEN)
    );
    let (health, metrics) = (
        i32::from(at(paths::HEALTH_LISTEN).port()),
        i32::from(at(paths::METRICS_LISTEN).port()),
    );
    let probe = |which: &str, probe: Option<&k8s_openapi::api::core::v1::Probe>| {
        let get = probe
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("{which}: an httpGet probe"));
        assert_eq!(get.port, IntOrString::Int(health), "{which}");
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

    // The metrics port declared under Istio's name, as istio-cni's chart declares it.
    let ports: Vec<_> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.as_deref(), p.container_port))
        .collect();
    assert_eq!(ports, [(Some("metrics"), metrics)]);
    let annotations = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    let scrape: BTreeMap<&str, String> = [
        ("prometheus.io/scrape", "true".to_owned()),
        ("prometheus.io/port", metrics.to_string()),
        ("prometheus.io/path", http::METRICS.to_owned()),
    ]
    .into_iter()
    .collect();
    for (key, value) in &scrape {
        assert_eq!(annotations.get(*key), Some(value), "{key}");
    }
}

/// istiod's untaint controller removes its startup taint from a node once a Ready pod labelled
/// `k8s-app: istio-cni-node` runs there, among the pods of its CNI namespace
/// (`pilot/pkg/controllers/untaint/nodeuntainter.go`: `istioCniLabels`, `filterNamespace`);
/// `istioctl bug-report` collects the log of every pod with that label
/// (`tools/bug-report/pkg/cluster/cluster.go`). The agent's pods carry it, in the DaemonSet's
/// namespace, where its pods run; the DaemonSet's selector is meshcap's own, unchanged (a
/// selector cannot change on `helm upgrade`), and selects the pods it makes.
#[test]
fn istios_tools_find_the_agents_pods_by_istios_label() {
    let m = manifests();
    let ds = one(&m.daemon_sets, "DaemonSet");
    let namespace = ds.metadata.namespace.as_deref().expect("a namespace");
    assert_eq!(namespace, "meshcap-system");
    let spec = ds.spec.as_ref().expect("spec");
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    assert_eq!(
        labels.get("k8s-app").map(String::as_str),
        Some("istio-cni-node")
    );
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    assert_eq!(
        selector,
        BTreeMap::from([(
            "app.kubernetes.io/name".to_owned(),
            "meshcap-agent".to_owned()
        )])
    );
    for (key, value) in &selector {
        assert_eq!(labels.get(key), Some(value), "{key}");
    }
    // Only the label: nothing that makes Istio's installer take the pods for its own
    // (`istioctl uninstall` prunes what carries its component labels).
    assert!(!labels.contains_key("operator.istio.io/component"));
    assert_eq!(ds.metadata.name.as_deref(), Some("meshcap-agent"));
}
