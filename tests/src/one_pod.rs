//! One sidecar pod (`shop/web`, wired to an upstream with a server) and an agent that reads
//! its manifest from a directory: the scenario of the tests that break things (crashes,
//! tampering) and check what is left.
use meshcap_agent::crashpoint;
use serde_json::Value;

use crate::{
    agent::{Agent, Backend},
    fixtures::{ManifestDir, leftovers, sidecar_pod, write_manifest},
    kubelet::{CniOutput, Sandbox, cni, config},
    wired::Wired,
};

/// One pod of the scenario, with an agent reading manifests from a directory.
pub struct OnePod {
    /// The manifest directory the agent reads.
    pub dir: ManifestDir,
    /// The agent.
    pub agent: Agent,
    /// The pod.
    pub wired: Wired,
    /// Its sandbox, as the runtime names it to CNI.
    pub sandbox: Sandbox,
    /// The plugin's configuration.
    pub conf: Value,
}

impl OnePod {
    /// Pod `shop/web` with its manifest, and an agent of `backend` (that dies at `crash_at`).
    ///
    /// # Panics
    /// When the agent does not start.
    #[must_use]
    pub fn new(backend: Backend, crash_at: Option<&str>) -> Self {
        let dir = ManifestDir::new();
        write_manifest(&dir.0, &sidecar_pod("shop", "web", &[]));
        let env: Vec<(&str, &str)> = crash_at
            .map(|point| (crashpoint::ENV, point))
            .into_iter()
            .collect();
        let agent = Agent::start(
            backend,
            &["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")],
            &env,
        )
        .expect("agent");
        let wired = Wired::new(&agent);
        let sandbox = Sandbox::new("shop", "web", &wired.pod);
        let conf = config("1.0.0", &agent.socket, "10.0.0.2");
        Self {
            dir,
            agent,
            wired,
            sandbox,
            conf,
        }
    }

    /// Runs the plugin for `command` on the pod.
    ///
    /// # Panics
    /// When the plugin cannot run.
    #[must_use]
    pub fn cni(&self, command: &str) -> CniOutput {
        cni(command, &self.sandbox, &self.conf).expect(command)
    }

    /// Restarts the agent, which killed itself at `point`, without a crash point.
    ///
    /// # Panics
    /// When it did not die, or does not start again.
    pub fn restart_after_crash(&mut self, point: &str) {
        let status = self.agent.wait_exit().expect("the agent killed itself");
        assert!(
            !status.success(),
            "{point}: the agent exited cleanly: {status}"
        );
        self.agent.set_env(crashpoint::ENV, None);
        self.agent.restart().expect("restart");
    }

    /// Everything meshcap holds for the pod: eBPF pins and map entries, iptables rules, the
    /// policy route, clsact qdiscs, and iptables records (temporary ones too).
    ///
    /// # Panics
    /// When the state cannot be read.
    #[must_use]
    pub fn held(&self) -> Vec<String> {
        let mut out = self.agent.ebpf_leftovers().expect("eBPF state");
        out.extend(leftovers(&self.wired.pod).expect("netns state"));
        for backend in ["iptables", "nftables"] {
            let records = self.agent.state_dir().join(backend);
            out.extend(
                std::fs::read_dir(&records)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| format!("record {}", e.path().display())),
            );
        }
        out
    }

    /// The app's connection reaches Envoy with its original destination, and CHECK passes.
    ///
    /// # Panics
    /// When it is not.
    pub fn assert_captured(&self, when: &str) {
        assert_eq!(
            self.wired.app_dial(),
            ("envoy".into(), Some("10.0.0.1:80".into())),
            "{when}: the app's connection is captured"
        );
        let check = self.cni("CHECK");
        assert!(check.success, "{when}: CHECK: {check:?}");
    }

    /// Nothing captures the app's connection, and nothing is held.
    ///
    /// # Panics
    /// When something is.
    pub fn assert_released(&self, when: &str) {
        assert_eq!(self.wired.app_dial().0, "upstream", "{when}: not captured");
        assert_eq!(self.held(), Vec::<String>::new(), "{when}: nothing left");
    }
}
