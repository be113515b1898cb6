//! The scenario table through the product path: a running `meshcap-agent run --pods dir`,
//! a pod manifest whose annotations, proxy environment and security context say what the
//! row's [`RedirectPolicy`] says, and the real `meshcap-cni` binary invoked as a container
//! runtime would (ADD with the pod's netns and addresses in `prevResult`, DEL).
use std::{collections::HashMap, path::Path, sync::Mutex};

use anyhow::{Context as _, ensure};
use meshcap_agent::pod::PodRef;
use meshcap_policy as policy;
use meshcap_policy::{
    CidrSet, InterceptionMode, IpRanges, PodName, PortSelection, RedirectPolicy, SelectConfig,
    Selection, keys,
};
use serde_json::{Value, json};

use crate::{
    agent::{self, Agent},
    fixtures::{ManifestDir, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config_ips},
    scenario::Backend,
};

/// The manifest of a sidecar pod that Istio's selection turns into `policy` (its name and
/// namespace are the policy's pod). Every field is written out, defaults included, so the
/// manifest says exactly what the policy says; [`select_manifest`] reads it back.
#[must_use]
pub fn pod_manifest(policy: &RedirectPolicy) -> Value {
    let ports = |list: &[u16]| {
        list.iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let cidrs = |set: &CidrSet| {
        set.v4
            .iter()
            .chain(&set.v6)
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let mode = match policy.mode {
        InterceptionMode::Redirect => "REDIRECT",
        InterceptionMode::Tproxy => "TPROXY",
    };
    let include_ranges = match &policy.include_outbound_ip_ranges {
        IpRanges::All => "*".to_owned(),
        IpRanges::Cidrs(set) => cidrs(set),
    };
    let include_inbound = match &policy.include_inbound_ports {
        PortSelection::All => "*".to_owned(),
        PortSelection::Ports(list) => ports(list),
    };
    let annotations = [
        (keys::INTERCEPTION_MODE, mode.to_owned()),
        (keys::INCLUDE_OUTBOUND_IP_RANGES, include_ranges),
        (
            keys::EXCLUDE_OUTBOUND_IP_RANGES,
            cidrs(&policy.exclude_outbound_ip_ranges),
        ),
        (keys::INCLUDE_INBOUND_PORTS, include_inbound),
        (
            keys::EXCLUDE_INBOUND_PORTS,
            ports(&policy.exclude_inbound_ports),
        ),
        (
            keys::INCLUDE_OUTBOUND_PORTS,
            ports(&policy.include_outbound_ports),
        ),
        (
            keys::EXCLUDE_OUTBOUND_PORTS,
            ports(&policy.exclude_outbound_ports),
        ),
        (
            keys::EXCLUDE_INTERFACES,
            policy.exclude_interfaces.join(","),
        ),
        (
            keys::REROUTE_VIRTUAL_INTERFACES,
            policy.reroute_virtual_interfaces.join(","),
        ),
    ];
    let annotations: Vec<(&str, &str)> =
        annotations.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut pod = sidecar_pod(&policy.pod.namespace, &policy.pod.name, &annotations);
    let proxy = &mut pod["spec"]["containers"][1];
    proxy["env"] = json!([
        {"name": keys::ENV_DNS_CAPTURE, "value": policy.dns_capture.to_string()},
        {"name": keys::ENV_INVALID_DROP, "value": policy.invalid_drop.to_string()},
        {"name": keys::ENV_DUAL_STACK, "value": policy.dual_stack.to_string()},
    ]);
    proxy["securityContext"] = json!({
        "runAsUser": policy.proxy_uid,
        "runAsGroup": policy.proxy_gid,
    });
    pod
}

/// What the agent's selection makes of `manifest` for a pod with `pod_ips` (Istio's default
/// node settings).
///
/// # Errors
/// When the manifest is not a pod or the selection rejects it.
pub fn select_manifest(
    manifest: &Value,
    pod_ips: &[std::net::IpAddr],
) -> anyhow::Result<Selection> {
    let pod = policy::parse_pod_manifest(&manifest.to_string())?;
    Ok(policy::select(&pod, pod_ips, &SelectConfig::default())?)
}

/// Fails unless the agent reads `manifest` back as exactly `policy`.
///
/// # Errors
/// When it reads something else.
pub fn ensure_exact(manifest: &Value, policy: &RedirectPolicy) -> anyhow::Result<()> {
    let selection = select_manifest(manifest, &policy.pod_ips)?;
    let expected = Selection::Capture {
        policy: Box::new(policy.clone()),
    };
    ensure!(
        selection == expected,
        "the manifest {manifest} selects {selection:?}, not {expected:?}"
    );
    Ok(())
}

/// A running agent with a manifest directory as its pod source; [`Backend::add`] writes the
/// pod's manifest and runs the plugin's ADD, [`Backend::remove`] its DEL.
pub struct PluginUnderTest {
    agent: Agent,
    dir: ManifestDir,
    /// The plugin configuration of each added sandbox, for its DEL.
    configs: Mutex<HashMap<String, Value>>,
}

impl PluginUnderTest {
    /// Starts the agent with `backend`; an eBPF agent attaches to `cgroup_root`, the cgroup
    /// the pods' processes run in.
    ///
    /// # Errors
    /// When the agent does not come up.
    pub fn new(backend: agent::Backend, cgroup_root: &Path) -> anyhow::Result<Self> {
        let dir = ManifestDir::new();
        let agent = Agent::start_in(
            backend,
            &[
                "--pods",
                "dir",
                "--pod-dir",
                dir.0.to_str().context("utf-8 path")?,
            ],
            &[],
            Some(cgroup_root),
        )?;
        Ok(Self {
            agent,
            dir,
            configs: Mutex::new(HashMap::new()),
        })
    }

    /// The running agent.
    #[must_use]
    pub const fn agent(&self) -> &Agent {
        &self.agent
    }
}

fn sandbox(pod: &PodRef) -> Sandbox {
    Sandbox {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        container_id: pod.container_id.clone(),
        netns: pod.netns.clone(),
    }
}

impl Backend for PluginUnderTest {
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
        let mut policy = policy.clone();
        policy.pod = PodName {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
        };
        let manifest = pod_manifest(&policy);
        ensure_exact(&manifest, &policy)?;
        write_manifest(&self.dir.0, &manifest);
        let conf = config_ips("1.0.0", &self.agent.socket, &policy.pod_ips);
        let out = cni("ADD", &sandbox(pod), &conf)?;
        ensure!(
            out.success,
            "meshcap-cni ADD {}/{}: {}\n{}",
            pod.namespace,
            pod.name,
            out.msg(),
            out.stderr
        );
        self.configs
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .insert(pod.container_id.clone(), conf);
        Ok(())
    }

    fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
        let conf = self
            .configs
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .remove(&pod.container_id)
            .with_context(|| format!("{}/{} was never added", pod.namespace, pod.name))?;
        let out = cni("DEL", &sandbox(pod), &conf)?;
        ensure!(
            out.success,
            "meshcap-cni DEL {}/{}: {}\n{}",
            pod.namespace,
            pod.name,
            out.msg(),
            out.stderr
        );
        std::fs::remove_file(self.dir.0.join(format!("{}.json", pod.name)))?;
        Ok(())
    }
}
