//! A pod wired to an upstream by a veth pair, with a server behind it, its processes in the
//! agent's cgroup: the scenario runner for the agent-level tests.
use std::sync::Arc;

use crate::{
    APP_UID, ENVOY_OPTIONS, Netns, PROXY_UID, Placement, Proc, TestCgroup, agent::Agent, dial,
    start_server, start_server_with,
};

/// A pod netns wired to an "upstream" netns by a veth pair: pod 10.0.0.2/24 on eth0, upstream
/// 10.0.0.1/24, with a server on 10.0.0.1:80. The pod's processes run in the agent's cgroup
/// (eBPF), as a real pod's run under the cgroup root the programs are attached to.
pub struct Wired {
    /// The pod's netns.
    pub pod: Netns,
    /// The upstream's netns.
    pub upstream: Netns,
    cgroup: Option<Arc<TestCgroup>>,
    /// What the pod's user namespace maps its id 0 to on the node (0: it has none of its own).
    ids_base: u32,
}

impl Wired {
    /// Wires a new pod for `agent` (its processes go to the agent's cgroup, if any).
    ///
    /// # Panics
    /// When the kernel refuses.
    #[must_use]
    pub fn new(agent: &Agent) -> Self {
        Self::in_cgroup(agent.cgroup())
    }

    /// Wires a new pod whose processes go to `cgroup` (the cgroup root an agent started with
    /// [`Agent::start_in`] attaches to).
    ///
    /// # Panics
    /// When the kernel refuses.
    #[must_use]
    pub fn in_cgroup(cgroup: Option<Arc<TestCgroup>>) -> Self {
        Self::around(Netns::new("mc-e2e-pod").expect("pod netns"), cgroup, 0)
    }

    /// Wires a new pod with a user namespace of its own (`hostUsers: false`) mapping its ids
    /// to the node's from `base`; its processes run as the node's ids of the pod's.
    ///
    /// # Panics
    /// When the kernel refuses.
    #[must_use]
    pub fn in_user_namespace(cgroup: Option<Arc<TestCgroup>>, base: u32) -> Self {
        let pod = Netns::in_user_namespace("mc-e2e-userns", base).expect("pod netns");
        Self::around(pod, cgroup, base)
    }

    fn around(pod: Netns, cgroup: Option<Arc<TestCgroup>>, ids_base: u32) -> Self {
        let upstream = Netns::new("mc-e2e-up").expect("upstream netns");
        pod.add_veth("eth0", &upstream, "eth0").expect("veth pair");
        for (ns, addr) in [(&pod, "10.0.0.2/24"), (&upstream, "10.0.0.1/24")] {
            ns.add_address("eth0", addr).expect("address");
            ns.set_up("eth0").expect("link up");
        }
        Self {
            pod,
            upstream,
            cgroup,
            ids_base,
        }
    }

    /// A process of the pod running as the pod's `uid` (and gid): the node's id its user
    /// namespace maps it to, which is what the kernel compares (a process inside that user
    /// namespace with the pod's id has it too).
    #[must_use]
    pub fn in_pod(&self, uid: u32) -> Placement<'_> {
        Placement {
            netns: &self.pod,
            cgroup: self.cgroup.as_deref(),
            uid: self.ids_base + uid,
            gid: self.ids_base + uid,
        }
    }

    /// Servers: the stand-in Envoy in the pod (uid 1337; its listeners hold connections open,
    /// see [`crate::Held`]) and the upstream.
    /// # Panics
    /// When a server cannot start.
    #[must_use]
    pub fn servers(&self) -> (Proc, Proc) {
        let envoy = start_server_with(
            self.in_pod(PROXY_UID),
            "envoy",
            &["tcp:0.0.0.0:15001+hold", "tcp:0.0.0.0:15006+hold"],
            ENVOY_OPTIONS,
        )
        .expect("stand-in envoy");
        let upstream = start_server(
            Placement {
                netns: &self.upstream,
                cgroup: None,
                uid: 0,
                gid: 0,
            },
            "upstream",
            &["tcp:10.0.0.1:80"],
        )
        .expect("upstream server");
        (envoy, upstream)
    }

    /// Who answers the app's connection to 10.0.0.1:80, and the original destination Envoy saw.
    /// # Panics
    /// When the client cannot run or nothing answers.
    #[must_use]
    pub fn app_dial(&self) -> (String, Option<String>) {
        let report = dial(self.in_pod(APP_UID), "tcp:10.0.0.1:80", None)
            .expect("dial")
            .expect("something answers 10.0.0.1:80");
        (report.server, report.original_dst.map(|a| a.to_string()))
    }
}
