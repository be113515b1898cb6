//! `deploy/chart` with a real helm (`cargo xtask setup` installs it in `target/tools`): lint; a
//! matrix of values (defaults, an Istio-shaped values file, an IstioOperator's `spec.values`,
//! each platform, ambient, each repair mode, Multus) rendered for Kubernetes 1.29, 1.35 and the
//! newest that kubernetes-validate ships, every object validated strictly and offline (the
//! NetworkAttachmentDefinition against Multus's CRD schema, `testdata/chart`); each platform and
//! feature compared with what Istio's chart renders (`testdata/chart/istio-expectations.yaml`,
//! distilled from Istio's chart at 86c9f01); the RBAC of the agent's and the plugin's
//! ServiceAccounts against the requests the agent says each configuration's settings make; the
//! ConfigMap against the agent's settings; the plain manifests in `deploy/` against the chart's
//! rendering.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use meshcap_agent::settings;
use serde::Deserialize as _;
use serde_json::{Value, json};

/// Kubernetes versions every configuration is validated against: the oldest supported, the
/// newest the compatibility table claims, and the newest kubernetes-validate knows.
const KUBE_VERSIONS: &[&str] = &["1.29.0", "1.35.0", "1.37.0"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/testdata/chart")
        .join(name)
}

/// `target/tools`, where `cargo xtask setup` installs helm and kubernetes-validate.
fn tools() -> PathBuf {
    let dir = std::env::var_os("MESHCAP_TOOLS_DIR").map_or_else(
        || {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| root().join("target"), PathBuf::from)
                .join("tools")
        },
        PathBuf::from,
    );
    assert!(
        dir.join("venv/bin/kubernetes-validate").exists(),
        "{}: no kubernetes-validate; run `cargo xtask setup`",
        dir.display()
    );
    dir
}

fn helm() -> Command {
    let helm = fs::read_dir(tools())
        .expect("tools dir")
        .flatten()
        .map(|e| e.path().join("helm"))
        .find(|p| p.exists())
        .expect("helm in target/tools; run `cargo xtask setup`");
    let mut cmd = Command::new(helm);
    cmd.current_dir(root());
    cmd
}

/// `helm <args>`: its stdout, or its stderr as the error.
fn run_helm(args: &[String]) -> Result<String, String> {
    let out = helm().args(args).output().expect("running helm");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// One configuration: `--set`s and values files on top of the defaults.
#[derive(Clone, Debug, Default)]
struct Config {
    name: String,
    set: Vec<String>,
    files: Vec<PathBuf>,
}

impl Config {
    fn new(name: &str, set: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            set: set.iter().map(|s| (*s).to_owned()).collect(),
            files: Vec::new(),
        }
    }

    fn file(name: &str, file: &str) -> Self {
        Self {
            name: name.to_owned(),
            set: Vec::new(),
            files: vec![testdata(file)],
        }
    }

    fn args(&self, command: &str, kube_version: Option<&str>) -> Vec<String> {
        let mut args: Vec<String> = [
            command,
            "meshcap",
            "deploy/chart",
            "--namespace",
            "istio-system",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if let Some(version) = kube_version {
            args.extend(["--kube-version".to_owned(), version.to_owned()]);
        }
        for file in &self.files {
            args.extend(["-f".to_owned(), file.display().to_string()]);
        }
        for set in &self.set {
            args.extend(["--set".to_owned(), set.clone()]);
        }
        args
    }

    /// `helm template` for `kube_version`: the rendered text.
    fn template(&self, kube_version: &str) -> Result<String, String> {
        run_helm(&self.args("template", Some(kube_version)))
    }

    /// The rendered objects.
    fn render(&self, kube_version: &str) -> Vec<Value> {
        let text = self
            .template(kube_version)
            .unwrap_or_else(|e| panic!("{}: helm template: {e}", self.name));
        documents(&text)
    }

    /// What `helm install` prints after installing (NOTES.txt), without a cluster.
    fn notes(&self) -> String {
        let mut args = self.args("install", None);
        args.push("--dry-run=client".to_owned());
        let out = run_helm(&args).unwrap_or_else(|e| panic!("{}: helm install: {e}", self.name));
        out.split_once("NOTES:")
            .map(|(_, n)| n.to_owned())
            .unwrap_or_default()
    }
}

fn documents(text: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(objects, kind);
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

fn config_map(objects: &[Value]) -> BTreeMap<String, String> {
    serde_json::from_value(one(objects, "ConfigMap")["data"].clone()).expect("ConfigMap data")
}

fn pod_spec(objects: &[Value]) -> &Value {
    &one(objects, "DaemonSet")["spec"]["template"]["spec"]
}

fn container(objects: &[Value]) -> &Value {
    &pod_spec(objects)["containers"][0]
}

/// Istio's own values file (its chart's values.yaml: every key with its default, under
/// `_internal_defaults_do_not_set`), rebuilt from the expectations' table of them.
fn istio_values_file() -> PathBuf {
    let mut defaults = serde_json::Map::new();
    for (path, value) in expectations()["istioDefaults"]
        .as_object()
        .expect("istioDefaults")
    {
        let keys: Vec<&str> = path.split('.').collect();
        let mut map = &mut defaults;
        for key in &keys[..keys.len() - 1] {
            map = map
                .entry((*key).to_owned())
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("a map");
        }
        map.insert(keys[keys.len() - 1].to_owned(), value.clone());
    }
    let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("istio-cni-values.yaml");
    let text =
        yaml_serde::to_string(&json!({"_internal_defaults_do_not_set": defaults})).expect("YAML");
    fs::write(&file, text).expect("writing");
    file
}

/// The configurations every check runs over.
fn matrix() -> Vec<Config> {
    let mut all = vec![
        Config::new("defaults", &[]),
        Config {
            name: "Istio's own values file".to_owned(),
            set: Vec::new(),
            files: vec![istio_values_file()],
        },
        Config::file("an istio-cni values file", "istio-values.yaml"),
        Config::file(
            "an IstioOperator's spec.values",
            "istiooperator-values.yaml",
        ),
        Config::new("ambient", &["ambient.enabled=true"]),
        Config::new(
            "ambient in the kernel",
            &["profile=ambient", "meshcap.ambient.inKernel=true"],
        ),
        Config::new(
            "ambient by Istio's in-pod rules",
            &["ambient.enabled=true", "meshcap.ambient.inKernel=false"],
        ),
        Config::new("repair off", &["repair.enabled=false"]),
        Config::new(
            "repair deletePods",
            &["repair.repairPods=false", "repair.deletePods=true"],
        ),
        Config::new(
            "repair labelPods",
            &["repair.repairPods=false", "repair.labelPods=true"],
        ),
        Config::new("multus", &["provider=multus", "chained=false"]),
        Config::new("no startup taint", &["meshcap.startupTaint="]),
        Config::new("verification off", &["meshcap.verifyIntervalSeconds=0"]),
        Config::new("SYS_RESOURCE added", &["meshcap.sysResource=true"]),
        Config::new(
            "quota, policy, secrets",
            &[
                "resourceQuotas.enabled=true",
                "global.networkPolicy.enabled=true",
                "global.imagePullSecrets={a,b}",
            ],
        ),
        Config::new(
            "compatibility 1.25",
            &["compatibilityVersion=1.25", "profile=demo"],
        ),
    ];
    for platform in ["gke", "openshift", "k3s", "k3d", "microk8s", "minikube"] {
        all.push(Config::new(
            &format!("platform {platform}"),
            &[&format!("global.platform={platform}")],
        ));
    }
    all
}

#[test]
fn helm_lint_passes() {
    for config in [
        Config::new("defaults", &[]),
        Config::file("an istio-cni values file", "istio-values.yaml"),
    ] {
        let mut args = vec![
            "lint".to_owned(),
            "--strict".to_owned(),
            "deploy/chart".to_owned(),
        ];
        for file in &config.files {
            args.extend(["-f".to_owned(), file.display().to_string()]);
        }
        run_helm(&args).unwrap_or_else(|e| panic!("{}: helm lint: {e}", config.name));
    }
}

#[test]
fn every_configuration_validates_strictly_on_1_29_and_the_newest() {
    let tools = tools();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut multus = Vec::new();
    for version in KUBE_VERSIONS {
        let mut files = Vec::new();
        for (i, config) in matrix().iter().enumerate() {
            let text = config
                .template(version)
                .unwrap_or_else(|e| panic!("{} on {version}: {e}", config.name));
            for doc in documents(&text) {
                if doc["kind"] == "NetworkAttachmentDefinition" {
                    multus.push(doc);
                }
            }
            let file = dir.path().join(format!("{version}-{i}.yaml"));
            fs::write(&file, text).expect("writing");
            files.push(file);
        }
        let out = Command::new(tools.join("venv/bin/kubernetes-validate"))
            .args(["--strict", "--quiet", "-k", version])
            .args(&files)
            .output()
            .expect("kubernetes-validate");
        let report = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "Kubernetes {version}:\n{report}");
        // Only the NetworkAttachmentDefinition (a CRD) is unknown to Kubernetes' schemas; it is
        // checked against Multus's below.
        for line in report.lines().filter(|l| !l.trim().is_empty()) {
            assert!(
                line.contains("Couldn't find schema for kind NetworkAttachmentDefinition"),
                "Kubernetes {version}: {line}"
            );
        }
    }
    assert!(
        !multus.is_empty(),
        "Multus configurations render a NetworkAttachmentDefinition"
    );
    let nads = dir.path().join("nads.json");
    fs::write(&nads, Value::Array(multus).to_string()).expect("writing");
    let out = Command::new(tools.join("venv/bin/python"))
        .args([
            "-c",
            "import json, sys, jsonschema\n\
             schema = json.load(open(sys.argv[1]))\n\
             for nad in json.load(open(sys.argv[2])):\n    jsonschema.validate(nad, schema)\n",
        ])
        .arg(testdata("network-attachment-definition.schema.json"))
        .arg(&nads)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "NetworkAttachmentDefinition: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The expectations distilled from Istio's chart.
fn expectations() -> Value {
    let text = fs::read_to_string(testdata("istio-expectations.yaml")).expect("expectations");
    yaml_serde::from_str(&text).expect("expectations YAML")
}

/// `set` of an expectation row as `--set` arguments.
fn sets(row: &Value) -> Vec<String> {
    row["set"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(key, value)| match value {
            Value::String(s) => format!("{key}={s}"),
            other => format!("{key}={other}"),
        })
        .collect()
}

#[test]
fn values_have_every_istio_key_with_istios_default() {
    let values: Value = yaml_serde::from_str(
        &fs::read_to_string(root().join("deploy/chart/values.yaml")).expect("values.yaml"),
    )
    .expect("values.yaml");
    let defaults = &values["_internal_defaults_do_not_set"];
    let expected = expectations();
    let differs = expected["meshcapDefaults"]
        .as_object()
        .expect("meshcapDefaults");
    for (path, istio) in expected["istioDefaults"]
        .as_object()
        .expect("istioDefaults")
    {
        let ours = path.split('.').fold(defaults, |v, key| &v[key]);
        let want = differs.get(path).map_or(istio, |d| &d[0]);
        // YAML's numbers: 5000 is 5000 either way.
        assert_eq!(ours, want, "values.yaml {path}");
    }
}

#[test]
fn each_platform_renders_the_paths_and_objects_istios_renders() {
    let expected = expectations();
    let meshcap_kinds: Vec<&str> = expected["meshcapKinds"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for row in expected["platforms"].as_array().expect("platforms") {
        let name = row["name"].as_str().unwrap_or_default();
        let set = sets(row);
        let config = Config {
            name: name.to_owned(),
            set,
            files: Vec::new(),
        };
        let objects = config.render(row["kubeVersion"].as_str().expect("kubeVersion"));
        let volumes: BTreeMap<String, String> = pod_spec(&objects)["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| {
                Some((
                    v["name"].as_str()?.to_owned(),
                    v["hostPath"]["path"].as_str()?.to_owned(),
                ))
            })
            .collect();
        assert_eq!(volumes["cni-bin-dir"], row["binDir"], "{name}: bin dir");
        assert_eq!(volumes["cni-conf-dir"], row["confDir"], "{name}: conf dir");
        assert_eq!(volumes["netns"], row["netnsDir"], "{name}: netns dir");
        let data = config_map(&objects);
        assert_eq!(
            data["cniBinDir"], row["binDir"],
            "{name}: the agent's bin dir"
        );
        assert_eq!(
            data["chained"],
            row["chained"].as_bool().expect("chained").to_string(),
            "{name}"
        );
        assert_eq!(data["cniConfFileName"], row["confFileName"], "{name}");
        let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        let mut want: BTreeSet<&str> = row["kinds"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        want.extend(&meshcap_kinds);
        assert_eq!(kinds, want, "{name}: kinds");
        if kinds.contains("ResourceQuota") {
            let quota = one(&objects, "ResourceQuota");
            assert_eq!(quota["spec"]["hard"]["pods"], "5000", "{name}");
            assert_eq!(
                quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"],
                json!(["system-node-critical"]),
                "{name}"
            );
        }
        if kinds.contains("NetworkAttachmentDefinition") {
            let nad = one(&objects, "NetworkAttachmentDefinition");
            assert_eq!(
                (&nad["metadata"]["namespace"], &nad["metadata"]["name"]),
                (
                    &json!("default"),
                    &json!(meshcap_agent::install::STANDALONE_NETWORK_NAME)
                ),
                "{name}: the network Istio's injector attaches pods to"
            );
            assert!(
                nad.get("spec").is_none(),
                "{name}: Multus reads the agent's file"
            );
        }
        assert_eq!(
            container(&objects)["securityContext"]["seLinuxOptions"]["type"],
            row.get("seLinuxType").cloned().unwrap_or(Value::Null),
            "{name}"
        );
        if let Some(rule) = row.get("extraRule") {
            assert!(
                rules(&objects, "meshcap-agent").contains(rule.as_str().expect("rule")),
                "{name}: {rule}"
            );
        }
    }
}

/// The agent's ServiceAccount and the plugin's.
const ACCOUNTS: [&str; 2] = ["meshcap-agent", "meshcap-cni"];

/// Every rule the ServiceAccount `account` is bound to, as "group/resource[names]: verbs".
fn rules(objects: &[Value], account: &str) -> BTreeSet<String> {
    assert!(
        of_kind(objects, "ServiceAccount")
            .iter()
            .any(|sa| sa["metadata"]["name"] == account),
        "no ServiceAccount {account}"
    );
    let bindings = |to: &str| -> BTreeSet<(String, String)> {
        objects
            .iter()
            .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
            .filter(|b| {
                b["subjects"].as_array().is_some_and(|s| {
                    s.iter()
                        .any(|s| s["kind"] == "ServiceAccount" && s["name"] == to)
                })
            })
            .map(|b| {
                (
                    b["roleRef"]["kind"].as_str().unwrap_or_default().to_owned(),
                    b["roleRef"]["name"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let bound = bindings(account);
    let mut all = BTreeSet::new();
    for role in objects.iter().filter(|o| {
        let key = (
            o["kind"].as_str().unwrap_or_default().to_owned(),
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        bound.contains(&key)
    }) {
        for rule in role["rules"].as_array().into_iter().flatten() {
            let strings = |key: &str| -> Vec<String> {
                rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            };
            let names = strings("resourceNames");
            let names = if names.is_empty() {
                String::new()
            } else {
                format!("[{}]", names.join(","))
            };
            for group in strings("apiGroups") {
                for resource in strings("resources") {
                    all.insert(format!(
                        "{group}/{resource}{names}: {}",
                        strings("verbs").join(",")
                    ));
                }
            }
        }
    }
    let roles = objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRole" || o["kind"] == "Role")
        .count();
    let bound_to_either: usize = ACCOUNTS.iter().map(|a| bindings(a).len()).sum();
    assert_eq!(
        roles, bound_to_either,
        "every role is bound to the agent or the plugin, once"
    );
    all
}

/// `rules`, one verb a line: "group/resource[names]: verb".
fn each_verb(rules: &BTreeSet<String>) -> BTreeSet<String> {
    rules
        .iter()
        .flat_map(|rule| {
            let (what, verbs) = rule.split_once(": ").expect("a rule");
            verbs.split(',').map(move |verb| format!("{what}: {verb}"))
        })
        .collect()
}

/// What `needs` ask, in [`each_verb`]'s form; a node is named by RBAC for none (this node's
/// name is not known in advance).
fn needed(needs: &[meshcap_agent::access::Need]) -> BTreeSet<String> {
    needs
        .iter()
        .map(|n| {
            let resource = if n.subresource.is_empty() {
                n.resource.to_owned()
            } else {
                format!("{}/{}", n.resource, n.subresource)
            };
            let names = if n.name.is_empty() || n.resource == "nodes" {
                String::new()
            } else {
                format!("[{}]", n.name)
            };
            format!("{}/{resource}{names}: {}", n.group, n.verb)
        })
        .collect()
}

/// The requests the agent and the plugin make with the settings a configuration's ConfigMap
/// gives them, as the agent reads them (`meshcap_agent::access::needs`,
/// `uninstall::witness::plugin_needs`).
fn needs_of(objects: &[Value]) -> (BTreeSet<String>, BTreeSet<String>) {
    use meshcap_agent::{
        access::{Features, RepairWrites, needs},
        repair::{Mode, RepairConfig},
        uninstall::witness::plugin_needs,
    };
    let data = config_map(objects);
    let lookup = |env: &str| {
        settings::ALL
            .iter()
            .find(|s| s.env == env)
            .and_then(|s| data.get(s.key).cloned())
    };
    let ds = one(objects, "DaemonSet");
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let ambient = data[settings::AMBIENT_ENABLED.key] == "true";
    let features = Features {
        node: "any".to_owned(),
        startup_taint: !data[settings::STARTUP_TAINT.key].is_empty(),
        daemon_set: Some((
            text(&ds["metadata"]["namespace"]),
            text(&ds["metadata"]["name"]),
        )),
        ambient,
        repair: match RepairConfig::from_settings(lookup)
            .expect("repair settings")
            .mode
        {
            Some(Mode::Delete) => RepairWrites::DeletePods,
            Some(Mode::Label) => RepairWrites::LabelPods,
            Some(Mode::Repair) | None => RepairWrites::None,
        },
    };
    (needed(&needs(&features)), needed(&plugin_needs(ambient)))
}

#[test]
fn rbac_is_exactly_what_the_agent_calls_per_feature() {
    for row in expectations()["rbac"].as_array().expect("rbac") {
        let name = row["name"].as_str().unwrap_or_default();
        let config = Config {
            name: name.to_owned(),
            set: sets(row),
            files: Vec::new(),
        };
        let want: BTreeSet<String> = row["meshcap"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        assert_eq!(
            rules(&config.render("1.35.0"), "meshcap-agent"),
            want,
            "{name}"
        );
    }
}

/// In every configuration, each ServiceAccount is granted exactly the requests the agent's
/// list says its settings make: nothing missing (the agent would hold readiness), nothing
/// unused. OpenShift's SCC is no request of the agent's: its pod is admitted under it.
#[test]
fn rbac_is_exactly_what_the_agent_and_the_plugin_ask_in_every_configuration() {
    for config in matrix() {
        let objects = config.render("1.35.0");
        let (agent, plugin) = needs_of(&objects);
        let mut granted = each_verb(&rules(&objects, "meshcap-agent"));
        granted.retain(|rule| !rule.starts_with("security.openshift.io/"));
        assert_eq!(granted, agent, "{}: the agent", config.name);
        assert_eq!(
            each_verb(&rules(&objects, "meshcap-cni")),
            plugin,
            "{}: the plugin",
            config.name
        );
    }
}

#[test]
fn the_pod_spec_is_istios_where_it_should_be() {
    let expected = expectations();
    let pod = &expected["pod"];
    for version in KUBE_VERSIONS {
        let objects = Config::new("defaults", &[]).render(version);
        let spec = pod_spec(&objects);
        for key in [
            "nodeSelector",
            "priorityClassName",
            "terminationGracePeriodSeconds",
            "tolerations",
        ] {
            assert_eq!(spec[key], pod[key], "{key}");
        }
        assert_eq!(
            spec["hostNetwork"], true,
            "meshcap's agent is on the host network"
        );
        let labels = &one(&objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"];
        for (key, value) in pod["labels"].as_object().expect("labels") {
            assert_eq!(&labels[key], value, "{key}");
        }
        let security = &container(&objects)["securityContext"];
        for (key, value) in pod["securityContext"].as_object().expect("securityContext") {
            assert_eq!(&security[key], value, "{key}");
        }
        assert_eq!(security["capabilities"]["drop"], pod["capabilitiesDrop"]);
        assert_eq!(security["capabilities"]["add"], pod["capabilitiesAdd"]);
        assert_eq!(security["seccompProfile"], json!({"type": "Unconfined"}));
        // Scheduled on the architectures the image carries (the one value that says so).
        assert_eq!(
            spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
            json!([{"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}])
        );
    }
    // An operator's affinity keeps its terms, each with the architectures added.
    let objects = Config::file("an istio-cni values file", "istio-values.yaml").render("1.35.0");
    assert_eq!(
        pod_spec(&objects)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"],
        json!([{"matchExpressions": [
            {"key": "node-role.example.com/mesh", "operator": "Exists"},
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]},
        ]}])
    );
}

#[test]
fn sys_resource_is_requested_only_when_asked_for() {
    let caps = |config: Config| {
        container(&config.render("1.35.0"))["securityContext"]["capabilities"]["add"].clone()
    };
    let default = caps(Config::new("defaults", &[]));
    assert_eq!(
        default,
        json!(["SYS_ADMIN", "NET_ADMIN", "NET_RAW"]),
        "the default render requests no SYS_RESOURCE"
    );
    assert_eq!(
        caps(Config::new("sysResource", &["meshcap.sysResource=true"])),
        json!(["SYS_ADMIN", "NET_ADMIN", "NET_RAW", "SYS_RESOURCE"]),
        "meshcap.sysResource adds it"
    );
    assert_eq!(
        caps(Config::file(
            "an istio-cni values file",
            "istio-values.yaml"
        )),
        default,
        "an istio-cni values file adds none"
    );
}

#[test]
fn apparmor_is_the_annotation_below_1_30_and_the_field_from_1_30() {
    for row in expectations()["apparmor"].as_array().expect("apparmor") {
        let version = row["kubeVersion"].as_str().expect("kubeVersion");
        let annotation = row["useAppArmorAnnotation"].as_bool().expect("bool");
        let objects = Config::new(
            "apparmor",
            &[&format!("useAppArmorAnnotation={annotation}")],
        )
        .render(version);
        let mut found = Vec::new();
        let pod_annotations =
            &one(&objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"];
        if pod_annotations["container.apparmor.security.beta.kubernetes.io/agent"] == "unconfined" {
            found.push("annotation");
        }
        if container(&objects)["securityContext"]["appArmorProfile"]
            == json!({"type": "Unconfined"})
        {
            found.push("field");
        }
        assert_eq!(
            json!(found),
            row["meshcap"],
            "{version}, useAppArmorAnnotation={annotation}"
        );
    }
}

#[test]
fn an_istio_values_file_is_taken_as_it_is() {
    let config = Config::file("an istio-cni values file", "istio-values.yaml");
    let objects = config.render("1.35.0");
    let data = config_map(&objects);
    assert_eq!(data["excludeNamespaces"], "kube-system,istio-system");
    assert_eq!(data["logging.level"], "default:warn,cni-plugin:debug");
    let levels = settings::log_levels(&data["logging.level"]);
    assert_eq!((levels.agent.as_str(), levels.plugin), ("warn", "debug"));
    assert_eq!(data["global.logAsJson"], "true");
    assert_eq!(data["cniConfFileName"], "10-calico.conflist");
    assert_eq!(data["ambient.dnsCapture"], "false");
    assert_eq!(
        settings::enablement_selectors(&data["ambient.enablementSelectors"]).expect("YAML"),
        json!([{"podSelector": {"matchLabels": {"mesh": "ambient"}}}])
    );
    let container = container(&objects);
    assert_eq!(
        container["image"],
        "registry.example.com/mesh/meshcap:0.1.0"
    );
    assert_eq!(
        container["securityContext"]["seLinuxOptions"],
        json!({"level": "s0", "type": "spc_t"})
    );
    assert_eq!(container["resources"]["limits"]["memory"], "256Mi");
    assert!(
        container["env"]
            .as_array()
            .expect("env")
            .contains(&json!({"name": "EXTRA", "value": "1"}))
    );
    assert_eq!(pod_spec(&objects)["terminationGracePeriodSeconds"], 45);
    let agent_account = of_kind(&objects, "ServiceAccount")
        .into_iter()
        .find(|sa| sa["metadata"]["name"] == "meshcap-agent")
        .expect("the agent's ServiceAccount");
    assert_eq!(
        agent_account["imagePullSecrets"],
        json!([{"name": "registry-credentials"}])
    );
    assert_eq!(
        one(&objects, "DaemonSet")["metadata"]["labels"]["istio.io/rev"],
        "canary"
    );
    // istioOwnedCNIConfig reaches the agent, which acts on it; its file name is Istio's.
    assert_eq!(data["istioOwnedCNIConfig"], "true");
    assert_eq!(data["istioOwnedCNIConfigFileName"], "");
    // Istio's features meshcap lacks: reported, and passed on for the agent to log.
    let notes = config.notes();
    assert!(
        notes.contains("ambient.enableAmbientDetectionRetry: true"),
        "NOTES name it:\n{notes}"
    );
    assert!(!notes.contains("istioOwnedCNIConfig"), "{notes}");
    // global.nativeNftables reaches the agent, which acts on it.
    assert!(!notes.contains("nativeNftables"), "{notes}");
    assert_eq!(data["global.nativeNftables"], "true");
    let lookup = |name: &str| {
        settings::ALL
            .iter()
            .find(|s| s.env == name)
            .map(|s| data[s.key].clone())
    };
    let reported: Vec<_> = settings::not_supported(&lookup)
        .expect("booleans")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert_eq!(reported, ["ambient.enableAmbientDetectionRetry"]);
    let named = Config::new(
        "owned file named",
        &[
            "istioOwnedCNIConfig=true",
            "istioOwnedCNIConfigFileName=00-meshcap.conflist",
        ],
    );
    assert_eq!(
        config_map(&named.render("1.35.0"))["istioOwnedCNIConfigFileName"],
        "00-meshcap.conflist"
    );
    let standalone = Config::new(
        "owned but standalone",
        &["istioOwnedCNIConfig=true", "chained=false"],
    );
    assert!(
        standalone
            .notes()
            .contains("istioOwnedCNIConfig has no effect with chained: false"),
        "{}",
        standalone.notes()
    );
}

#[test]
fn an_istiooperators_values_cni_are_read_as_the_charts_own() {
    let config = Config::file(
        "an IstioOperator's spec.values",
        "istiooperator-values.yaml",
    );
    let objects = config.render("1.35.0");
    let data = config_map(&objects);
    assert_eq!(data["cniBinDir"], "/var/lib/cni/bin");
    assert_eq!(data["excludeNamespaces"], "kube-system,monitoring");
    assert_eq!(data["ambient.enabled"], "true");
    let notes = config.notes();
    assert!(
        notes.contains("Accepted with no effect") && notes.contains("logLevel"),
        "{notes}"
    );
    // Istio's own values file names Istio's node agent image: rendered, and said loudly.
    let istio = Config::new("istio's image", &["image=install-cni"]);
    assert!(
        istio
            .notes()
            .contains("WARNING: image localhost/install-cni:0.1.0 is Istio's node agent")
    );
}

#[test]
fn misspelt_or_unknown_values_are_refused() {
    for (set, says) in [
        (
            "meshcap.bakend=ebpf",
            "additional properties 'bakend' not allowed",
        ),
        (
            "cniBinDri=/opt/cni/bin",
            "additional properties 'cniBinDri' not allowed",
        ),
        (
            "meshcap.backend=bpf",
            "value must be one of 'auto', 'ebpf', 'iptables'",
        ),
        (
            "provider=mutlus",
            "value must be one of 'default', 'multus'",
        ),
        ("global.platform=aks", "platform \"aks\": unknown"),
        ("profile=default", "profile \"default\": unknown"),
        (
            "compatibilityVersion=1.24",
            "compatibilityVersion \"1.24\": unknown",
        ),
    ] {
        let err = Config::new(set, &[set]).template("1.35.0").expect_err(set);
        assert!(err.contains(says), "{set}: {err}");
    }
    // Any global.* is Istio's to define.
    Config::new(
        "global",
        &["global.meshID=mesh1", "global.proxy.privileged=true"],
    )
    .render("1.35.0");
}

#[test]
fn a_change_of_settings_rolls_the_daemon_set() {
    let checksum = |set: &[&str]| {
        let objects = Config::new("checksum", set).render("1.35.0");
        one(&objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            .clone()
    };
    let base = checksum(&[]);
    assert_eq!(
        base,
        checksum(&[]),
        "the same values, the same pod template"
    );
    assert_ne!(base, checksum(&["excludeNamespaces={kube-system,tools}"]));
    assert_ne!(base, checksum(&["meshcap.backend=iptables"]));
}

#[test]
fn the_config_map_and_env_carry_every_agent_setting_in_every_configuration() {
    for config in matrix() {
        let objects = config.render("1.35.0");
        let keys: BTreeSet<String> = config_map(&objects).into_keys().collect();
        let settings: BTreeSet<String> = settings::ALL.iter().map(|s| s.key.to_owned()).collect();
        assert_eq!(keys, settings, "{}", config.name);
        let env = container(&objects)["env"].as_array().expect("env").clone();
        for setting in settings::ALL {
            assert!(
                env.contains(&json!({
                    "name": setting.env,
                    "valueFrom": {"configMapKeyRef": {"name": "meshcap-config", "key": setting.key, "optional": true}},
                })),
                "{}: {}",
                config.name,
                setting.env
            );
        }
        // The netns dir the agent is told is the one mounted, at the host's path.
        let data = config_map(&objects);
        let mounts = container(&objects)["volumeMounts"]
            .as_array()
            .expect("mounts")
            .clone();
        for (volume, key) in [
            ("netns", "cniNetnsDir"),
            ("cni-bin-dir", "cniBinDir"),
            ("cni-conf-dir", "cniConfDir"),
        ] {
            assert!(
                mounts
                    .iter()
                    .any(|m| m["name"] == volume && m["mountPath"] == data[key].as_str()),
                "{}: {volume} at {}",
                config.name,
                data[key]
            );
        }
    }
}

#[test]
fn the_plain_manifests_are_the_charts_rendering() {
    let deploy = root().join("deploy");
    let mut command = None;
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(&deploy).expect("deploy/").flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = fs::read_to_string(&path).expect("reading");
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("# helm template "))
            .unwrap_or_else(|| panic!("{}: not rendered by cargo xtask manifests", path.display()))
            .to_owned();
        assert!(
            command.get_or_insert_with(|| line.clone()) == &line,
            "every file rendered alike"
        );
        files.insert(
            path.file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned(),
            documents(&text),
        );
    }
    let args: Vec<String> = std::iter::once("template".to_owned())
        .chain(
            command
                .expect("a rendered file")
                .split_whitespace()
                .map(str::to_owned),
        )
        .collect();
    let rendered = documents(&run_helm(&args).expect("helm template"));
    let on_disk: Vec<&Value> = files.values().flatten().collect();
    assert_eq!(
        on_disk.len(),
        rendered.len(),
        "deploy/ is stale: run `cargo xtask manifests`"
    );
    for object in &rendered {
        assert!(
            on_disk.contains(&object),
            "deploy/ is stale (run `cargo xtask manifests`): {} {} differs",
            object["kind"],
            object["metadata"]["name"]
        );
    }
    // One kind per file, the file named after it: a reader sees what `kubectl apply -f deploy/`
    // creates in which order.
    for (file, objects) in &files {
        for object in objects {
            let kind = object["kind"].as_str().unwrap_or_default().to_lowercase();
            assert!(
                file.ends_with(&format!("-{kind}.yaml")),
                "{file} holds a {kind}"
            );
        }
    }
}

/// The host's `/proc` is mounted read-only at `/host/proc` (the agent's `MESHCAP_HOST_PROC`
/// default, where ambient mode with `global.nativeNftables` finds kubelet's uid) exactly when
/// ambient mode is on, as Istio's chart mounts it for its node agent.
#[test]
fn the_hosts_proc_is_mounted_for_ambient_mode_only() {
    let mounted = |objects: &[Value]| {
        let mounts = container(objects)["volumeMounts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mount = mounts
            .iter()
            .find(|m| m["mountPath"] == meshcap_agent::paths::HOST_PROC)?;
        assert_eq!(mount["readOnly"], true, "{mount}");
        let volume = pod_spec(objects)["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .expect("the mount's volume")
            .clone();
        Some(volume["hostPath"].clone())
    };
    for config in matrix() {
        let objects = config.render("1.35.0");
        let ambient = config_map(&objects)[settings::AMBIENT_ENABLED.key] == "true";
        let expected = ambient.then(|| json!({"path": "/proc", "type": "Directory"}));
        assert_eq!(mounted(&objects), expected, "{}", config.name);
    }
}
