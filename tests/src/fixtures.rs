//! What the end-to-end tests set pods up with: manifests as the injector leaves them, a
//! manifest directory for the agent's standalone pod source, the leftovers a removed capture
//! must not leave, addresses unique on the machine, and waiting for the agent's asynchronous
//! start-up.
use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU8, Ordering},
    thread,
    time::Duration,
};

use anyhow::ensure;
use serde_json::{Value, json};

use crate::{Netns, unique_name};

/// meshcap's cgroup programs still attached to `cgroup_root`, each with how many: empty once
/// every program is detached.
///
/// # Panics
/// When the cgroup cannot be queried.
#[must_use]
pub fn attached_programs(cgroup_root: &Path) -> Vec<(&'static str, u32)> {
    meshcap_agent::backend::ebpf::cgroup_attachments(cgroup_root)
        .expect("query the cgroup")
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The iptables state of a netns that mentions Istio (chains or jumps), from both
/// implementations, its nftables tables named `istio-*` (the native nftables backend's), its
/// ip rules for tables 133 (TPROXY) and 100 (ambient mode), its clsact
/// qdiscs and a `net.ipv4.tcp_fwmark_accept` other than 0: empty when nothing is left.
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
    let tables = crate::run(
        "ip",
        &["netns", "exec", netns.name(), "nft", "list", "tables"],
    )?;
    out.extend(
        tables
            .lines()
            .filter(|l| l.contains("istio-"))
            .map(|l| format!("nft: {l}")),
    );
    let rules = netns.ip(&["rule", "show"])?;
    out.extend(
        rules
            .lines()
            .filter(|l| l.contains("lookup 133") || l.contains("lookup 100"))
            .map(str::to_owned),
    );
    // The eBPF backend sets it for TPROXY and ambient pods, and puts the pod's own back. Read
    // from inside the netns by this process (the VMs' initramfs has no `cat`).
    let fwmark_accept = meshcap_agent::podnet::run_in(&netns.path(), |_| {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_fwmark_accept")
    })??;
    if fwmark_accept.trim() != "0" {
        out.push(format!(
            "net.ipv4.tcp_fwmark_accept = {}",
            fwmark_accept.trim()
        ));
    }
    // The eBPF backend's netlink TC filters live on a clsact qdisc it adds (and removes).
    let qdiscs = crate::run("tc", &["-n", netns.name(), "qdisc", "show"])?;
    out.extend(
        qdiscs
            .lines()
            .filter(|l| l.contains("clsact"))
            .map(str::to_owned),
    );
    Ok(out)
}

/// A pod manifest labelled `istio.io/dataplane-mode=ambient` (uid `uid-<name>`, service
/// account `web`), which ambient mode's default selectors enroll.
#[must_use]
pub fn ambient_pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": format!("uid-{name}"),
            "labels": {"istio.io/dataplane-mode": "ambient"},
        },
        "spec": {
            "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "app"}],
        },
    })
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

/// A pod manifest the mesh does not concern: no sidecar.
#[must_use]
pub fn plain_pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}")},
        "spec": {"nodeName": "node-1", "containers": [{"name": "app", "image": "app"}]},
    })
}

/// `pod` as kubelet reports it when it started without its capture: address `ip`, and its
/// `istio-validation` init container crash-looping on exit code 126 (`restarts` times).
#[must_use]
pub fn broken_pod(mut pod: Value, ip: &str, restarts: u32) -> Value {
    pod["status"] = json!({
        "podIP": ip, "podIPs": [{"ip": ip}],
        "initContainerStatuses": [{
            "name": "istio-validation", "image": "proxyv2", "imageID": "", "ready": false,
            "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 126, "reason": "Error"}},
        }],
    });
    pod
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

/// Writes a pod manifest into the directory source's directory.
///
/// # Panics
/// When the file cannot be written.
pub fn write_manifest(dir: &Path, pod: &Value) {
    let name = pod["metadata"]["name"].as_str().expect("name");
    std::fs::write(dir.join(format!("{name}.json")), pod.to_string()).expect("manifest");
}

/// A throwaway manifest directory, removed on drop.
pub struct ManifestDir(pub PathBuf);

impl ManifestDir {
    /// # Panics
    /// When the directory cannot be made.
    #[must_use]
    #[expect(
        clippy::new_without_default,
        reason = "it creates a directory: not a default value"
    )]
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(unique_name("meshcap-pods"));
        std::fs::create_dir_all(&dir).expect("manifest dir");
        Self(dir)
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An address no other test's namespace holds (the repair controller and ambient
/// mode's live enrollment find a pod's namespace by its address, among every namespace on the
/// machine).
#[must_use]
pub fn unique_ip() -> String {
    static NEXT: AtomicU8 = AtomicU8::new(1);
    format!(
        "100.{}.{}.{}",
        64 + (std::process::id() >> 16) % 64,
        (std::process::id() >> 8) % 256,
        (u32::from(NEXT.fetch_add(1, Ordering::Relaxed)) + std::process::id()) % 254 + 1
    )
}

/// Runs `program` with `args` in `netns`, `input` on its standard input (`iptables-restore`,
/// `nft -f -`), as another agent's plugin writes its rules.
///
/// # Panics
/// When it does not run or fails.
pub fn fed_in_netns(netns: &Netns, program: &str, args: &[&str], input: &str) {
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", netns.name(), program])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect(program);
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), input.as_bytes())
        .expect("its input");
    assert!(
        child.wait().expect(program).success(),
        "{program}:\n{input}"
    );
}
