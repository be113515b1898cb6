//! The chart's DaemonSet runs: the image `cargo xtask image` builds is imported into a private
//! containerd (`MESHCAP_IMAGE_ARCHIVE`, which `cargo xtask test` builds from the test phase's
//! binaries; built here otherwise), and the agent's container is created through CRI exactly as
//! `deploy/chart` renders it, as kubelet would: its command and args, its environment with the
//! ConfigMap's keys resolved (optional ones left out when missing) and the downward API's fields,
//! its hostPath mounts with their propagation, its capabilities, seccomp and AppArmor profiles,
//! in a host-network sandbox. It must become ready on its readiness probe, log the Istio setting
//! it does not support (`ambient.enableAmbientDetectionRetry`), install the plugin into containerd's CNI
//! directories, and capture a pod sandbox created afterwards.
//!
//! The node is the test's: containerd runs in a network namespace and a mount namespace of its
//! own (`Containerd::prepare_node`: `/run` and `/sys/fs/bpf` there are fresh), and the chart's
//! values point the other host paths at the test's directories, as an operator points them at a
//! platform's: `cniBinDir`, `cniConfDir` and `cniNetnsDir` at containerd's, and
//! `meshcap.cgroupHostPath` at containerd's throwaway cgroup, which the eBPF programs then attach
//! to instead of the machine's root. The in-test API server serves the same rendering and
//! enforces its RBAC: the agent's pod is the DaemonSet's, the plugin's token Secret is mounted
//! where the DaemonSet mounts it (as kubelet writes a Secret volume), and no request the agent
//! makes may be refused. The one thing the rendered spec does not say is how the agent reaches
//! the API server (kubelet projects a service account token): a kubeconfig of the in-test API
//! server with the agent's token bound to its pod, mounted and named by `KUBECONFIG`. An agent
//! given `KUBECONFIG` copies it for the plugin as it is unless told where the plugin's token is
//! (in a pod it reads the Secret's mount by default), so the test names that mount in
//! `MESHCAP_CNI_TOKEN_DIR`.
use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use meshcap_tests::{
    APP_UID, Netns, PROXY_UID, Placement, Report,
    agent::binaries,
    apiserver::{AGENT_POD, ApiServer, CNI_TOKEN_SECRET},
    bin, chart,
    containerd::{Containerd, GATEWAY, IMAGE},
    cri::{self, ContainerSpec, Cri, PodMeta, v1},
    fixtures::sidecar_pod,
    require_root, start_server, unique_name,
};
use serde_json::Value;

/// The node's name (the pods' `spec.nodeName` in `fixtures`).
const NODE: &str = "node-1";
/// Where the app dials: a server in the node's network namespace, on the pods' gateway.
const PEER: &str = "10.244.0.1:8080";
/// Where the kubeconfig is mounted in the agent's container.
const KUBECONFIG: &str = "/var/run/meshcap-test/kubeconfig";

/// The image archive: `MESHCAP_IMAGE_ARCHIVE` (`cargo xtask test` builds it for amd64 and
/// arm64), or `cargo xtask image` from the binaries the other tests run and the arm64 ones
/// cross-built beside them ([`arm64_binaries`]): the chart's architectures are checked against
/// the image's, so both are in it.
fn image_archive(scratch: &Path) -> PathBuf {
    if let Some(archive) = std::env::var_os("MESHCAP_IMAGE_ARCHIVE") {
        return PathBuf::from(archive);
    }
    let out = scratch.join("meshcap.oci.tar");
    let bins = binaries();
    let arm64 = arm64_binaries(bins);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["run", "--quiet", "-p", "xtask", "--", "image", "--agent"])
        .arg(bins.join("meshcap-agent"))
        .arg("--plugin")
        .arg(bins.join("meshcap-cni"))
        .arg("--agent")
        .arg(arm64.join("meshcap-agent"))
        .arg("--plugin")
        .arg(arm64.join("meshcap-cni"))
        .arg("--out")
        .arg(&out)
        .status()
        .expect("cargo xtask image");
    assert!(status.success(), "cargo xtask image failed");
    out
}

/// The arm64 `meshcap-agent` and `meshcap-cni` beside the amd64 ones in the target directory:
/// the debug ones the arm64 guest's build writes (`cargo xtask integration --kernel
/// 6.12-arm64`, `cargo xtask test`), else the release ones of `cargo xtask build --arch arm64`.
fn arm64_binaries(amd64: &Path) -> PathBuf {
    let target = amd64
        .parent()
        .expect("the binaries' directory is in a target directory")
        .join("aarch64-unknown-linux-gnu");
    ["debug", "release"]
        .into_iter()
        .map(|profile| target.join(profile))
        .find(|dir| dir.join("meshcap-agent").is_file() && dir.join("meshcap-cni").is_file())
        .unwrap_or_else(|| {
            panic!(
                "no arm64 meshcap-agent and meshcap-cni in {}/{{debug,release}}: the image \
                 carries both architectures; cross-build them with `cargo xtask build --arch \
                 arm64`, or give MESHCAP_IMAGE_ARCHIVE",
                target.display()
            )
        })
}

/// The name `ctr images import` gives the archive's image (its index's annotation), and the
/// architectures it holds: the platforms of the image index `index.json` names.
fn image_name(archive: &Path) -> (String, Vec<String>) {
    let mut files = std::collections::HashMap::new();
    let mut tar = tar::Archive::new(std::fs::File::open(archive).expect("image archive"));
    for entry in tar.entries().expect("tar") {
        let mut entry = entry.expect("tar entry");
        let path = entry.path().expect("path").to_string_lossy().into_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).expect("reading the archive");
        files.insert(path, bytes);
    }
    let json = |path: &str| -> Value {
        let bytes = files
            .get(path)
            .unwrap_or_else(|| panic!("{}: no {path}", archive.display()));
        serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let layout = json("index.json");
    let image = &layout["manifests"][0];
    let name = image["annotations"]["io.containerd.image.name"]
        .as_str()
        .expect("the image's name")
        .to_owned();
    let digest = image["digest"].as_str().expect("the image's digest");
    let index = json(&format!(
        "blobs/sha256/{}",
        digest.trim_start_matches("sha256:")
    ));
    let architectures = index["manifests"]
        .as_array()
        .expect("the image is an index of platforms")
        .iter()
        .filter_map(|m| m["platform"]["architecture"].as_str().map(str::to_owned))
        .collect();
    (name, architectures)
}

/// `GET path` on the node's `port`, from the node's network namespace (as kubelet probes a
/// host-network pod): the status code and body.
fn http_get(node: &Netns, port: u16, path: &str) -> Option<(u16, String)> {
    node.run_in(|| {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: node\r\n\r\n")?;
        let mut reply = String::new();
        stream.read_to_string(&mut reply)?;
        let code = reply
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
        Ok((code, body.unwrap_or_default()))
    })
    .ok()
}

/// The container's environment as kubelet resolves it, and where the API server and the
/// plugin's token are.
fn environment(
    pod_spec: &Value,
    container: &Value,
    data: &BTreeMap<String, String>,
    pod: &PodMeta,
) -> Vec<v1::KeyValue> {
    let mut envs = Vec::new();
    for var in container["env"].as_array().expect("env") {
        let name = var["name"].as_str().expect("name").to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_owned()
        } else if let Some(key) = var["valueFrom"].get("configMapKeyRef") {
            assert_eq!(key["name"], "meshcap-config", "{name}");
            match data.get(key["key"].as_str().expect("key")) {
                Some(value) => value.clone(),
                None if key["optional"] == true => continue,
                None => panic!("{name}: ConfigMap key {} missing", key["key"]),
            }
        } else {
            match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => NODE.to_owned(),
                Some("metadata.namespace") => pod.namespace.clone(),
                Some("metadata.name") => pod.name.clone(),
                other => {
                    panic!("{name}: an env source kubelet's stand-in does not know: {other:?}")
                }
            }
        };
        envs.push(v1::KeyValue {
            key: name,
            value: value.into(),
        });
    }
    envs.push(v1::KeyValue {
        key: "KUBECONFIG".into(),
        value: KUBECONFIG.into(),
    });
    envs.push(v1::KeyValue {
        key: "MESHCAP_CNI_TOKEN_DIR".into(),
        value: token_mount(pod_spec, container).into(),
    });
    envs
}

/// Where the container mounts the plugin's token Secret.
fn token_mount(pod: &Value, container: &Value) -> String {
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["secret"]["secretName"] == CNI_TOKEN_SECRET)
        .expect("the plugin's token Secret as a volume");
    container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .and_then(|m| m["mountPath"].as_str())
        .expect("the plugin's token Secret mounted")
        .to_owned()
}

/// The container's mounts: each volume must be a hostPath this node has (`allowed`), so that
/// nothing of the machine's own is mounted, or the plugin's token Secret, which kubelet writes
/// into a directory of its own (`token_dir`, given the volume's `defaultMode` here).
fn mounts(
    pod: &Value,
    container: &Value,
    allowed: &[&Path],
    kubeconfig: &Path,
    token_dir: &Path,
) -> Vec<v1::Mount> {
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| (v["name"].as_str().expect("name"), v))
        .collect();
    let mut mounts = Vec::new();
    for mount in container["volumeMounts"].as_array().expect("volumeMounts") {
        let volume = volumes[mount["name"].as_str().expect("name")];
        if let Some(secret) = volume.get("secret") {
            assert_eq!(secret["secretName"], CNI_TOKEN_SECRET, "{volume}");
            let mode = u32::try_from(secret["defaultMode"].as_u64().unwrap_or(0o644))
                .expect("a file mode");
            for file in std::fs::read_dir(token_dir).expect("the token dir") {
                let path = file.expect("a token file").path();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .expect("the token's mode");
            }
            mounts.push(v1::Mount {
                container_path: mount["mountPath"].as_str().expect("mountPath").to_owned(),
                host_path: token_dir.display().to_string(),
                readonly: true,
                ..v1::Mount::default()
            });
            continue;
        }
        let host = volume["hostPath"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("volume {} is not a hostPath", volume["name"]));
        assert!(
            allowed.iter().any(|a| Path::new(host) == *a),
            "hostPath {host} is none of the test node's {allowed:?}"
        );
        if volume["hostPath"]["type"] == "Directory" {
            assert!(Path::new(host).is_dir(), "hostPath {host} must exist");
        }
        let propagation = match mount["mountPropagation"].as_str() {
            None | Some("None") => v1::MountPropagation::PropagationPrivate,
            Some("HostToContainer") => v1::MountPropagation::PropagationHostToContainer,
            Some("Bidirectional") => v1::MountPropagation::PropagationBidirectional,
            Some(other) => panic!("mountPropagation {other}"),
        };
        mounts.push(v1::Mount {
            container_path: mount["mountPath"].as_str().expect("mountPath").to_owned(),
            host_path: host.to_owned(),
            readonly: mount["readOnly"] == true,
            propagation: propagation as i32,
            ..v1::Mount::default()
        });
    }
    mounts.push(v1::Mount {
        container_path: KUBECONFIG.into(),
        host_path: kubeconfig.display().to_string(),
        readonly: true,
        ..v1::Mount::default()
    });
    mounts
}

/// The container's security context as kubelet passes it to the runtime.
fn security(
    pod: &Value,
    container: &Value,
    annotations: &Value,
) -> v1::LinuxContainerSecurityContext {
    let sc = &container["securityContext"];
    let names = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str().map(str::to_owned))
            .collect()
    };
    let profile = |v: &Value| {
        (v["type"] == "Unconfined").then_some(v1::SecurityProfile {
            profile_type: v1::security_profile::ProfileType::Unconfined as i32,
            localhost_ref: String::new(),
        })
    };
    let apparmor_annotation = format!(
        "container.apparmor.security.beta.kubernetes.io/{}",
        container["name"].as_str().expect("name")
    );
    let apparmor = profile(&sc["appArmorProfile"]).or_else(|| {
        (annotations[&apparmor_annotation] == "unconfined").then_some(v1::SecurityProfile {
            profile_type: v1::security_profile::ProfileType::Unconfined as i32,
            localhost_ref: String::new(),
        })
    });
    let int = |v: &Value| v.as_i64().map(|value| v1::Int64Value { value });
    let add = names(&sc["capabilities"]["add"]);
    // This machine's own bounding set (a sandbox) lacks CAP_SYS_RESOURCE, which runc then
    // cannot grant ("unable to apply caps"): the chart's defaults must not ask for it
    // (meshcap.sysResource), and the container gets exactly what they ask.
    let missing: Vec<&String> = add.iter().filter(|c| !in_bounding_set(c)).collect();
    assert!(
        missing.is_empty(),
        "the chart asks for {missing:?}, which this machine's runtime cannot grant"
    );
    v1::LinuxContainerSecurityContext {
        capabilities: Some(v1::Capability {
            add_capabilities: add,
            drop_capabilities: names(&sc["capabilities"]["drop"]),
            ..v1::Capability::default()
        }),
        privileged: sc["privileged"] == true,
        namespace_options: Some(namespaces(pod)),
        run_as_user: int(&sc["runAsUser"]),
        run_as_group: int(&sc["runAsGroup"]),
        seccomp: profile(&sc["seccompProfile"]),
        apparmor,
        ..v1::LinuxContainerSecurityContext::default()
    }
}

/// Whether this process's bounding set holds capability `name` (`SYS_RESOURCE`, ...).
fn in_bounding_set(name: &str) -> bool {
    const NAMES: [&str; 25] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
    ];
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let bounding = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .expect("CapBnd");
    let bit = NAMES
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("capability {name} is not in the test's table"));
    bounding >> bit & 1 == 1
}

/// hostNetwork: the node's network namespace (containerd's own).
fn namespaces(pod: &Value) -> v1::NamespaceOption {
    assert_eq!(
        pod["hostNetwork"], true,
        "the agent runs on the host network"
    );
    v1::NamespaceOption {
        network: v1::NamespaceMode::Node as i32,
        pid: v1::NamespaceMode::Container as i32,
        ..v1::NamespaceOption::default()
    }
}

/// `meshcap_<name>` samples of the agent's metrics.
fn samples(node: &Netns, port: u16, name: &str) -> Vec<String> {
    let (_, metrics) = http_get(node, port, "/metrics").expect("metrics");
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("meshcap_{name}")))
        .map(str::to_owned)
        .collect()
}

/// Runs an app container in `sandbox` that dials [`PEER`] once, and returns what answered.
fn app_dial(cri: &mut Cri, ctd: &Containerd, sandbox: &str, pod: &PodMeta) -> Report {
    let log_dir = ctd.log_dir.join(&pod.name);
    let container = cri
        .run_container(
            sandbox,
            pod,
            &ctd.cgroup_parent(),
            &log_dir,
            &ContainerSpec {
                name: "app".into(),
                image: IMAGE.into(),
                command: vec!["/meshcap-dial".into(), format!("tcp:{PEER}")],
                mounts: vec![
                    ("/usr".into(), "/usr".into()),
                    (bin::dial().display().to_string(), "/meshcap-dial".into()),
                ],
                uid: i64::from(APP_UID),
                log_path: "app.log".into(),
            },
        )
        .unwrap_or_else(|e| panic!("app container: {e:#}\n{}", ctd.log()));
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(exit) = cri.container_exit(&container).expect("ContainerStatus") {
            break exit;
        }
        assert!(Instant::now() < deadline, "the app container never exited");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(exit, 0, "{}", ctd.log());
    let log = std::fs::read_to_string(log_dir.join("app.log")).expect("app log");
    let line = log
        .lines()
        .find_map(|l| l.splitn(4, ' ').nth(3))
        .unwrap_or_else(|| panic!("app printed nothing: {log:?}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("app said {line:?}: {e}"))
}

#[test]
fn the_charts_daemon_set_runs_under_containerd_and_captures_a_pod() {
    require_root();
    let mut ctd = Containerd::prepare_node().expect("containerd's directories");
    let scratch = ctd.log_dir.join("test");
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let archive = image_archive(&scratch);
    let (image, architectures) = image_name(&archive);
    let mut cri = ctd.start().expect("containerd");
    let out = Command::new("/usr/bin/ctr")
        .arg("--address")
        .arg(&ctd.socket)
        .args(["--namespace", "k8s.io", "images", "import"])
        .arg(&archive)
        .output()
        .expect("ctr");
    assert!(
        out.status.success(),
        "ctr images import: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The chart, with this node's paths: `hub`/`image`/`tag` composed into the imported name.
    let (hub, rest) = image.rsplit_once('/').expect("a repository");
    let (name, tag) = rest.split_once(':').expect("a tag");
    let sets = [
        format!("hub={hub}"),
        format!("image={name}"),
        format!("tag={tag}"),
        format!("cniBinDir={}", ctd.bin_dir.display()),
        format!("cniConfDir={}", ctd.conf_dir.display()),
        format!("cniNetnsDir={}", ctd.netns_dir().display()),
        format!("meshcap.cgroupHostPath={}", ctd.cgroup.path().display()),
        // The in-test API server serves no Node objects.
        "meshcap.startupTaint=".to_owned(),
        // An Istio feature meshcap lacks: accepted, and the agent says so.
        "ambient.enableAmbientDetectionRetry=true".to_owned(),
    ];
    let mut args = vec!["--namespace", "istio-system", "--kube-version", "1.35.0"];
    for set in &sets {
        args.extend(["--set", set.as_str()]);
    }
    let objects = chart::render(&args).expect("the chart");
    // The API server where the node's pods are, serving this rendering (its RBAC, its
    // DaemonSet, the agent's pod, the plugin's token Secret): reachable from the node's network
    // namespace.
    let api = ctd
        .node
        .run_in(|| Ok(ApiServer::with_objects(objects.clone())))
        .expect("API server");
    let kubeconfig = api.kubeconfig(&scratch);
    let token_dir = api.cni_token_dir(&scratch);
    let data: BTreeMap<String, String> = serde_json::from_value(
        chart::one(&objects, "ConfigMap").expect("ConfigMap")["data"].clone(),
    )
    .expect("data");
    let ds = chart::one(&objects, "DaemonSet").expect("DaemonSet");
    let template = &ds["spec"]["template"];
    let (pod, container) = (&template["spec"], &template["spec"]["containers"][0]);
    assert_eq!(container["image"].as_str(), Some(image.as_str()));
    // Scheduled only where the image runs: the architectures its index holds.
    let mut scheduled: Vec<String> = serde_json::from_value(
        pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
            .clone(),
    )
    .expect("the architectures");
    scheduled.sort();
    let mut carried = architectures.clone();
    carried.sort();
    assert_eq!(
        scheduled, carried,
        "meshcap.imageArchitectures and the image"
    );

    // The agent's pod: a host-network sandbox, then its container from the rendered spec.
    let agent_pod = PodMeta {
        namespace: api.namespace.clone(),
        name: AGENT_POD.into(),
        uid: unique_name("uid-agent"),
    };
    let parent = ctd.cgroup_parent();
    let agent_logs = ctd.log_dir.join(&agent_pod.name);
    let mut sandbox_config = cri::sandbox_config(&agent_pod, &parent, &agent_logs);
    // A host-network pod keeps the node's hostname (runc cannot set one in the node's UTS
    // namespace).
    sandbox_config.hostname = String::new();
    if let Some(linux) = sandbox_config.linux.as_mut() {
        linux.security_context = Some(v1::LinuxSandboxSecurityContext {
            namespace_options: Some(namespaces(pod)),
            ..v1::LinuxSandboxSecurityContext::default()
        });
    }
    let sandbox = cri
        .run_sandbox(sandbox_config.clone())
        .unwrap_or_else(|e| panic!("the agent's sandbox: {e:#}\n{}", ctd.log()));
    let allowed = [
        ctd.bin_dir.as_path(),
        ctd.conf_dir.as_path(),
        &ctd.netns_dir(),
        ctd.cgroup.path(),
        // In containerd's mount namespace only: a tmpfs and a bpffs of the test's.
        Path::new("/var/run/meshcap"),
        Path::new("/var/run/ztunnel"),
        Path::new("/sys/fs/bpf"),
    ];
    let config = v1::ContainerConfig {
        metadata: Some(v1::ContainerMetadata {
            name: container["name"].as_str().expect("name").to_owned(),
            attempt: 0,
        }),
        image: Some(v1::ImageSpec {
            image: image.clone(),
            ..v1::ImageSpec::default()
        }),
        command: serde_json::from_value(container["command"].clone()).expect("command"),
        args: serde_json::from_value(
            container
                .get("args")
                .cloned()
                .unwrap_or(Value::Array(Vec::new())),
        )
        .expect("args"),
        envs: environment(pod, container, &data, &agent_pod),
        mounts: mounts(pod, container, &allowed, &kubeconfig, &token_dir),
        log_path: "agent.log".into(),
        linux: Some(v1::LinuxContainerConfig {
            security_context: Some(security(
                pod,
                container,
                &template["metadata"]["annotations"],
            )),
            ..v1::LinuxContainerConfig::default()
        }),
        ..v1::ContainerConfig::default()
    };
    cri.start_container(&sandbox, sandbox_config, config)
        .unwrap_or_else(|e| panic!("the agent's container: {e:#}\n{}", ctd.log()));
    let agent_log = || std::fs::read_to_string(agent_logs.join("agent.log")).unwrap_or_default();

    // Ready on its readiness probe, as kubelet asks it.
    let probe = &container["readinessProbe"]["httpGet"];
    let port = u16::try_from(probe["port"].as_u64().expect("port")).expect("a port");
    let path = probe["path"].as_str().expect("path");
    // Metrics on their own port, as the scrape annotation and the container's port name it.
    let metrics_port = container["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == "metrics"))
        .and_then(|p| p["containerPort"].as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .expect("the container's metrics port");
    assert_eq!(
        template["metadata"]["annotations"]["prometheus.io/port"],
        metrics_port.to_string(),
        "the scrape annotation names the metrics port"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let answer = http_get(&ctd.node, port, path);
        if answer.as_ref().is_some_and(|(code, _)| *code == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never became ready (last answer {answer:?})\nagent:\n{}\ncontainerd:\n{}",
            agent_log(),
            ctd.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = agent_log();
    assert!(
        log.contains("not supported by meshcap yet")
            && log.contains("ambient.enableAmbientDetectionRetry"),
        "the agent reports ambient.enableAmbientDetectionRetry:\n{log}"
    );
    // The plugin installed into containerd's directories, chained last.
    assert!(ctd.bin_dir.join("meshcap-cni").exists(), "{}", agent_log());
    let conflist: Value = serde_json::from_slice(
        &std::fs::read(ctd.conf_dir.join("10-bridge.conflist")).expect("conflist"),
    )
    .expect("JSON");
    assert_eq!(
        conflist["plugins"]
            .as_array()
            .and_then(|p| p.last())
            .map(|p| &p["type"]),
        Some(&Value::from("meshcap-cni")),
        "{conflist}"
    );
    // The plugin's kubeconfig carries its own token, read from the mounted Secret.
    let plugin_kubeconfig = std::fs::read_to_string(ctd.conf_dir.join("meshcap-cni.kubeconfig"))
        .expect("the plugin's kubeconfig");
    assert!(
        plugin_kubeconfig.contains(&api.cni_token()),
        "{plugin_kubeconfig}"
    );

    // A sidecar pod created afterwards is captured: its app's connection reaches the stand-in
    // Envoy with its original destination.
    let node = Placement {
        netns: &ctd.node,
        cgroup: None,
        uid: 0,
        gid: 0,
    };
    let _peer = start_server(node, "peer", &["tcp:0.0.0.0:8080"]).expect("peer");
    assert_eq!(PEER.split(':').next(), Some(GATEWAY));
    let mesh = PodMeta {
        namespace: "shop".into(),
        name: unique_name("web"),
        uid: String::new(),
    };
    let manifest = sidecar_pod(&mesh.namespace, &mesh.name, &[]);
    let mesh = PodMeta {
        uid: manifest["metadata"]["uid"]
            .as_str()
            .expect("uid")
            .to_owned(),
        ..mesh
    };
    api.apply_pod(manifest);
    let mesh_sandbox = cri
        .run_pod_sandbox(&mesh, &parent, &ctd.log_dir.join(&mesh.name))
        .unwrap_or_else(|e| panic!("{e:#}\nagent:\n{}\ncontainerd:\n{}", agent_log(), ctd.log()));
    let captured = samples(&ctd.node, metrics_port, "pods_captured");
    assert!(
        captured.len() == 1 && captured[0].ends_with(" 1"),
        "{captured:?}\n{}",
        agent_log()
    );
    let pid = cri.sandbox_pid(&mesh_sandbox).expect("sandbox pid");
    let pod_netns = Netns::existing(Path::new(&format!("/proc/{pid}/ns/net")));
    let _envoy = start_server(
        Placement {
            netns: &pod_netns,
            cgroup: Some(&ctd.cgroup),
            uid: PROXY_UID,
            gid: PROXY_UID,
        },
        "envoy",
        &["tcp:0.0.0.0:15001", "tcp:0.0.0.0:15006"],
    )
    .expect("stand-in envoy");
    let report = app_dial(&mut cri, &ctd, &mesh_sandbox, &mesh);
    assert_eq!(report.server, "envoy", "{report:?}\n{}", agent_log());
    assert_eq!(
        report.original_dst.map(|a| a.to_string()).as_deref(),
        Some(PEER),
        "{report:?}"
    );

    // Its removal (the CNI DEL) releases the capture.
    cri.stop_pod_sandbox(&mesh_sandbox).expect("stop");
    cri.remove_pod_sandbox(&mesh_sandbox).expect("remove");
    let captured = samples(&ctd.node, metrics_port, "pods_captured");
    assert!(
        captured.len() == 1 && captured[0].ends_with(" 0"),
        "{captured:?}"
    );
    // Everything the agent asked was within the chart's RBAC.
    assert!(
        api.refused().is_empty(),
        "{:?}\n{}",
        api.refused(),
        agent_log()
    );
}
