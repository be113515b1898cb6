//! Playing kubelet: a running `meshcap-agent` and the real `meshcap-cni` binary, invoked with
//! the CNI environment and configuration a container runtime passes.
use std::{
    io::Write as _,
    net::TcpListener,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};

use crate::{Netns, unique_name};

/// Builds `meshcap-agent` and `meshcap-cni` once per test process (cargo does not build
/// another package's binaries for this crate's tests) and returns the directory holding them.
///
/// # Panics
/// When cargo fails.
#[must_use]
pub fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        // target/<profile>/deps/<test> → target/<profile>
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target directory")
            .to_owned();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "meshcap-agent", "-p", "meshcap-cni"]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(
            status.success(),
            "cargo build -p meshcap-agent -p meshcap-cni failed"
        );
        dir
    })
}

/// A free TCP port on 127.0.0.1.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running agent with throwaway socket and state directories; stopped (SIGTERM, by pid)
/// and its files removed on drop.
pub struct Agent {
    child: Child,
    dir: PathBuf,
    /// The plugin socket.
    pub socket: PathBuf,
    /// The health/metrics endpoint.
    pub http: String,
}

impl Agent {
    /// Starts `meshcap-agent run --backend iptables` with `source` (e.g. `--pods dir
    /// --pod-dir X`) and `env`, and waits until its socket exists and it answers /healthz.
    ///
    /// # Errors
    /// When it does not come up.
    pub fn start(source: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("meshcap-agent"));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("agent.sock");
        let http = format!("127.0.0.1:{}", free_port());
        let child = Command::new(binaries().join("meshcap-agent"))
            .arg("run")
            .args(source)
            .args(["--backend", "iptables", "--pod-lookup-attempts", "3"])
            .args(["--pod-lookup-interval-ms", "100"])
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--http-listen", &http])
            .env("RUST_LOG", "warn,meshcap_agent=info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .context("starting meshcap-agent")?;
        let mut agent = Self {
            child,
            dir,
            socket,
            http,
        };
        for _ in 0..200 {
            if let Some(status) = agent.child.try_wait()? {
                bail!("meshcap-agent exited during start-up: {status}");
            }
            if agent.socket.exists()
                && agent
                    .http_get("/healthz")
                    .is_ok_and(|(code, _)| code == 200)
            {
                return Ok(agent);
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("meshcap-agent did not become ready")
    }

    /// The agent's state directory.
    #[must_use]
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Whether the agent process still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// `GET path` on the health/metrics endpoint: status code and body.
    ///
    /// # Errors
    /// When the endpoint does not answer.
    pub fn http_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        use std::io::Read as _;
        let mut stream = std::net::TcpStream::connect(&self.http)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status line")?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((code, body))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
    let mut ip = json!({"address": format!("{pod_ip}/24"), "interface": 0});
    if !version.starts_with("1.") {
        ip["version"] = json!("4");
    }
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
            "ips": [ip],
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
    let mut cmd = Command::new(binaries().join("meshcap-cni"));
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
    run_plugin_raw(&env, conf.to_string().as_bytes(), 0)
}

/// The iptables state of a netns that mentions Istio (chains or jumps), from both
/// implementations, and its ip rules for table 133: empty when nothing is left.
///
/// # Errors
/// When the tools cannot run.
pub fn leftovers(netns: &Netns) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for save in [
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
    ] {
        let text = crate::run("ip", &["netns", "exec", netns.name(), save])?;
        out.extend(
            text.lines()
                .filter(|l| l.contains("ISTIO"))
                .map(|l| format!("{save}: {l}")),
        );
    }
    let rules = netns.ip(&["rule", "show"])?;
    out.extend(
        rules
            .lines()
            .filter(|l| l.contains("lookup 133"))
            .map(str::to_owned),
    );
    Ok(out)
}

/// A pod manifest with an injected sidecar, as the injector leaves it.
#[must_use]
pub fn sidecar_pod(namespace: &str, name: &str, annotations: &[(&str, &str)]) -> Value {
    let mut ann = serde_json::Map::new();
    ann.insert(
        "sidecar.istio.io/status".into(),
        json!("{\"containers\":[\"istio-proxy\"]}"),
    );
    for (k, v) in annotations {
        ann.insert((*k).to_owned(), json!(v));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "annotations": ann},
        "spec": {
            "nodeName": "node-1",
            "containers": [
                {"name": "app", "image": "app"},
                {"name": "istio-proxy", "image": "proxyv2", "args": ["proxy", "sidecar"]}
            ]
        }
    })
}

/// Waits until `f` holds (for the agent's asynchronous start-up), at most ~10 s.
///
/// # Errors
/// When it never does.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    for _ in 0..200 {
        if f() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    ensure!(f(), "{what} never happened");
    Ok(())
}
