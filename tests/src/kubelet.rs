//! Playing kubelet: the real `meshcap-cni` binary invoked with the CNI environment and
//! configuration a container runtime passes.
use std::{
    io::Write as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::Context as _;
use serde_json::{Value, json};

use crate::{Netns, agent::binaries, unique_name};

/// A pod sandbox as kubelet describes it to CNI.
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`.
    pub netns: PathBuf,
}

impl Sandbox {
    /// The sandbox of pod `namespace/name` in `netns`.
    #[must_use]
    pub fn new(namespace: &str, name: &str, netns: &Netns) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            container_id: unique_name("sandbox"),
            netns: netns.path(),
        }
    }
}

/// The plugin's configuration as the runtime passes it: `cniVersion`, the agent socket and
/// a `prevResult` with the pod's address.
#[must_use]
pub fn config(version: &str, socket: &Path, pod_ip: &str) -> Value {
    config_with(version, socket, &[(format!("{pod_ip}/24"), "4")])
}

/// As [`config`], with every address of the pod (dual stack) in `prevResult`.
#[must_use]
pub fn config_ips(version: &str, socket: &Path, pod_ips: &[std::net::IpAddr]) -> Value {
    let addresses: Vec<(String, &str)> = pod_ips
        .iter()
        .map(|ip| match ip {
            std::net::IpAddr::V4(_) => (format!("{ip}/24"), "4"),
            std::net::IpAddr::V6(_) => (format!("{ip}/64"), "6"),
        })
        .collect();
    config_with(version, socket, &addresses)
}

fn config_with(version: &str, socket: &Path, addresses: &[(String, &str)]) -> Value {
    let ips: Vec<Value> = addresses
        .iter()
        .map(|(address, family)| {
            let mut ip = json!({"address": address, "interface": 0});
            if !version.starts_with("1.") {
                ip["version"] = json!(family);
            }
            ip
        })
        .collect();
    json!({
        "cniVersion": version,
        "name": "k8s-pod-network",
        "type": "meshcap-cni",
        "agent_socket": socket,
        "exclude_namespaces": ["kube-system"],
        "log_level": "debug",
        "prevResult": {
            "cniVersion": version,
            "interfaces": [{"name": "eth0", "sandbox": "/x"}],
            "ips": ips,
        }
    })
}

/// What the plugin printed and how it exited.
#[derive(Debug)]
pub struct CniOutput {
    /// Exit status 0.
    pub success: bool,
    /// stdout, parsed (`Null` when empty).
    pub stdout: Value,
    /// stderr (log lines).
    pub stderr: String,
}

impl CniOutput {
    /// The error JSON's `msg` (empty when there is none).
    #[must_use]
    pub fn msg(&self) -> &str {
        self.stdout["msg"].as_str().unwrap_or("")
    }
}

/// Runs `meshcap-cni` with `env` and `stdin` exactly (nothing inherited but PATH), as `uid`.
///
/// # Errors
/// When it cannot run or prints something that is not JSON.
pub fn run_plugin_raw(env: &[(&str, String)], stdin: &[u8], uid: u32) -> anyhow::Result<CniOutput> {
    run_plugin_at(&binaries().join("meshcap-cni"), env, stdin, uid)
}

/// The plugin installed in `bin_dir` run as the runtime runs an ADD of `namespace/name` with
/// `conf` (its entry, with the list's name and version), into a netns that does not exist, and
/// how long it took.
///
/// # Panics
/// When the plugin cannot be run.
#[must_use]
pub fn installed_add(
    bin_dir: &Path,
    conf: &Value,
    namespace: &str,
    name: &str,
) -> (CniOutput, std::time::Duration) {
    let env = [
        ("CNI_COMMAND", "ADD".to_owned()),
        ("CNI_CONTAINERID", unique_name("sandbox")),
        ("CNI_NETNS", "/var/run/netns/unused".to_owned()),
        ("CNI_IFNAME", "eth0".to_owned()),
        ("CNI_PATH", bin_dir.display().to_string()),
        (
            "CNI_ARGS",
            format!("K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};IgnoreUnknown=1"),
        ),
    ];
    let started = std::time::Instant::now();
    let out = run_plugin_at(
        &bin_dir.join("meshcap-cni"),
        &env,
        conf.to_string().as_bytes(),
        0,
    )
    .expect("running the installed plugin");
    (out, started.elapsed())
}

/// [`run_plugin_raw`] with the plugin at `plugin` (a copy the agent installed, say).
///
/// # Errors
/// When it cannot run or prints something that is not JSON.
pub fn run_plugin_at(
    plugin: &Path,
    env: &[(&str, String)],
    stdin: &[u8],
    uid: u32,
) -> anyhow::Result<CniOutput> {
    let mut cmd = Command::new(plugin);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if uid != 0 {
        cmd.uid(uid).gid(uid);
    }
    let mut child = cmd.spawn().context("starting meshcap-cni")?;
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let stdout = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(text.trim()).with_context(|| format!("plugin printed {text:?}"))?
    };
    Ok(CniOutput {
        success: out.status.success(),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs `meshcap-cni` for `command` (ADD, DEL, CHECK…) on a sandbox with a configuration.
///
/// # Errors
/// When it cannot run.
pub fn cni(command: &str, sandbox: &Sandbox, conf: &Value) -> anyhow::Result<CniOutput> {
    cni_with(&binaries().join("meshcap-cni"), command, sandbox, conf)
}

/// [`cni`] with the plugin at `plugin` (another build's, say: the benchmark's baseline).
///
/// # Errors
/// When it cannot run.
pub fn cni_with(
    plugin: &Path,
    command: &str,
    sandbox: &Sandbox,
    conf: &Value,
) -> anyhow::Result<CniOutput> {
    let env = [
        ("CNI_COMMAND", command.to_owned()),
        ("CNI_CONTAINERID", sandbox.container_id.clone()),
        ("CNI_NETNS", sandbox.netns.display().to_string()),
        ("CNI_IFNAME", "eth0".to_owned()),
        ("CNI_PATH", "/opt/cni/bin".to_owned()),
        (
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={}",
                sandbox.namespace, sandbox.name, sandbox.container_id
            ),
        ),
    ];
    run_plugin_at(plugin, &env, conf.to_string().as_bytes(), 0)
}

/// The uid a test's stand-in kubelet process runs as (not root, not the proxy's nor the
/// app's): kubelet's probes are sent as it, which the node's nftables probe rule matches.
pub const KUBELET_UID: u32 = 64_321;

/// A real process named `kubelet` (the harness's `meshcap-standin`, which the VM guests carry
/// too, run through a link of that name: the kernel names a process after the path it was
/// executed by; "kubelet" in its command line) running as [`KUBELET_UID`], for the agent to
/// find kubelet's uid as it finds it on a node. Its proc directory holds only it (a link to its
/// `/proc` entry), so that each test's agent finds its own kubelet while other tests run
/// theirs. Killed and removed on drop.
pub struct KubeletProcess {
    child: std::process::Child,
    dir: PathBuf,
}

impl KubeletProcess {
    /// Starts it.
    ///
    /// # Errors
    /// When `sleep` cannot be copied or started.
    pub fn start() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("meshcap-kubelet"));
        std::fs::create_dir_all(dir.join("proc"))?;
        let exe = dir.join("kubelet");
        // A link, not a copy: a copy's write descriptor, inherited by a fork of another test's
        // thread until its exec, would make this exec fail with ETXTBSY.
        std::os::unix::fs::symlink(crate::bin::standin(), &exe)
            .context("linking meshcap-standin as kubelet")?;
        // A listener on the loopback's ephemeral port keeps it running until killed.
        let child = Command::new(&exe)
            .args(["--name", "kubelet", "--listen", "tcp:127.0.0.1:0"])
            .stdout(Stdio::null())
            .uid(KUBELET_UID)
            .gid(KUBELET_UID)
            .stdin(Stdio::null())
            .spawn()
            .context("starting the stand-in kubelet")?;
        let pid = child.id().to_string();
        let this = Self { child, dir };
        std::os::unix::fs::symlink(Path::new("/proc").join(&pid), this.proc().join(&pid))?;
        Ok(this)
    }

    /// The proc directory the agent searches (`MESHCAP_HOST_PROC`).
    #[must_use]
    pub fn proc(&self) -> PathBuf {
        self.dir.join("proc")
    }

    /// Its process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for KubeletProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
