//! A small node for scenario tests: a "node" network namespace with veth links to "pod"
//! namespaces, every pod with two interfaces (`eth0` and `eth1`), a stand-in Envoy (uid 1337)
//! and an app server in each pod, and peers on the node side.
//!
//! Addresses of pod number `i` (1-based):
//!
//! | what | IPv4 | IPv6 |
//! |---|---|---|
//! | pod `eth0` | `10.77.i.2/24` | `fd77:i::2/64` |
//! | node end of `eth0` (a peer) | `10.77.i.1` | `fd77:i::1` |
//! | pod `eth1` | `10.78.i.2/24` | |
//! | node end of `eth1` | `10.78.i.1` | |
//! | a "service" on the node's `lo` | `10.96.0.10` | `fd96::10` |
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::Context as _;
use meshcap_agent::pod::PodRef;

use crate::{
    ENVOY_OPTIONS, Netns, PROXY_UID, Placement, Proc, TestCgroup, start_server, start_server_with,
};

/// The app's uid and gid in scenario pods.
pub const APP_UID: u32 = 1000;

/// The node: its netns, and the cgroup every pod process joins (the backend's cgroup root).
#[derive(Debug)]
pub struct Node {
    /// The node's network namespace.
    pub netns: Netns,
    /// The cgroup pods' processes run in.
    pub cgroup: TestCgroup,
    /// Peer servers on the node side (`peer`).
    _peers: Proc,
    next: u8,
}

/// One pod wired to the node.
#[derive(Debug)]
pub struct Pod {
    /// Its network namespace.
    pub netns: Netns,
    /// Its number (addresses are derived from it).
    pub index: u8,
    /// Servers running in it; killed on drop (before the netns goes).
    servers: Vec<Proc>,
}

impl Node {
    /// Creates the node netns with a peer server listening on every address (TCP 80, 53, 3306,
    /// 5555, 15020; UDP 53) and a cgroup for pods.
    ///
    /// # Errors
    /// When the kernel refuses the namespace, its addresses or the cgroup.
    pub fn new() -> anyhow::Result<Self> {
        let netns = Netns::new("mc-node")?;
        netns.add_address("lo", "10.96.0.10/32")?;
        netns.add_address("lo", "fd96::10/128")?;
        let cgroup = TestCgroup::new("mc-pods")?;
        let mut listen = Vec::new();
        for port in [80, 53, 3306, 5555, 15020] {
            listen.push(format!("tcp:0.0.0.0:{port}"));
            listen.push(format!("tcp:[::]:{port}"));
        }
        listen.push("udp:0.0.0.0:53".into());
        listen.push("udp:[::]:53".into());
        let listen: Vec<&str> = listen.iter().map(String::as_str).collect();
        let peers = start_server(
            Placement {
                netns: &netns,
                cgroup: None,
                uid: 0,
                gid: 0,
            },
            "peer",
            &listen,
        )?;
        Ok(Self {
            netns,
            cgroup,
            _peers: peers,
            next: 1,
        })
    }

    /// Wires a new pod: `eth0` and `eth1` to the node, default routes by `eth0`, IPv6 on
    /// `eth0` when `ipv6`.
    ///
    /// # Errors
    /// When the kernel refuses a link, address or route.
    pub fn add_pod(&mut self, ipv6: bool) -> anyhow::Result<Pod> {
        let i = self.next;
        self.next += 1;
        let netns = Netns::new("mc-pod")?;
        for (n, (host, dev)) in [(format!("p{i}a"), "eth0"), (format!("p{i}b"), "eth1")]
            .iter()
            .enumerate()
        {
            self.netns.add_veth(host, &netns, dev)?;
            let net = 77 + n;
            self.netns
                .add_address(host, &format!("10.{net}.{i}.1/24"))?;
            self.netns.set_up(host)?;
            netns.add_address(dev, &format!("10.{net}.{i}.2/24"))?;
            netns.set_up(dev)?;
        }
        netns.add_default_route(&format!("10.77.{i}.1"))?;
        if ipv6 {
            self.netns
                .add_address(&format!("p{i}a"), &format!("fd77:{i}::1/64"))?;
            netns.add_address("eth0", &format!("fd77:{i}::2/64"))?;
            netns.add_default_route(&format!("fd77:{i}::1"))?;
        }
        Ok(Pod {
            netns,
            index: i,
            servers: Vec::new(),
        })
    }

    /// Has the node forward between its pods (`net.ipv4.ip_forward`), as a node does.
    ///
    /// # Errors
    /// When the sysctl cannot be written.
    pub fn forward(&self) -> anyhow::Result<()> {
        self.netns.run_in(|| {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .context("net.ipv4.ip_forward in the node's netns")
        })
    }

    /// Has the node forward IPv6 between its pods too (`net.ipv6.conf.all.forwarding`).
    ///
    /// # Errors
    /// When the sysctl cannot be written.
    pub fn forward_ipv6(&self) -> anyhow::Result<()> {
        self.netns.run_in(|| {
            std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1")
                .context("net.ipv6.conf.all.forwarding in the node's netns")
        })
    }

    /// A client on the node (outside every pod).
    #[must_use]
    pub fn client(&self) -> Placement<'_> {
        Placement {
            netns: &self.netns,
            cgroup: None,
            uid: 0,
            gid: 0,
        }
    }

    /// Kubelet on the node: a client outside every pod, as [`crate::kubelet::KUBELET_UID`]
    /// (the uid of the stand-in kubelet an ambient agent finds).
    #[must_use]
    pub fn kubelet(&self) -> Placement<'_> {
        Placement {
            uid: crate::kubelet::KUBELET_UID,
            gid: crate::kubelet::KUBELET_UID,
            ..self.client()
        }
    }
}

impl Pod {
    /// The pod as a backend is asked to capture it: `default/pod-<index>`, container
    /// `c<index>`, its netns.
    #[must_use]
    pub fn pod_ref(&self) -> PodRef {
        PodRef {
            namespace: "default".into(),
            name: format!("pod-{}", self.index),
            container_id: format!("c{}", self.index),
            netns: self.netns.path(),
        }
    }

    /// The pod's `eth0` IPv4 address.
    #[must_use]
    pub fn v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.index, 2)
    }

    /// The pod's `eth0` IPv6 address.
    #[must_use]
    pub fn v6(&self) -> Ipv6Addr {
        format!("fd77:{}::2", self.index)
            .parse()
            .unwrap_or(Ipv6Addr::LOCALHOST)
    }

    /// The node end of `eth0`.
    #[must_use]
    pub fn peer_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.index, 1)
    }

    /// The node end of `eth0`, IPv6.
    #[must_use]
    pub fn peer_v6(&self) -> Ipv6Addr {
        format!("fd77:{}::1", self.index)
            .parse()
            .unwrap_or(Ipv6Addr::LOCALHOST)
    }

    /// The pod's `eth1` address.
    #[must_use]
    pub fn side_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 78, self.index, 2)
    }

    /// The node end of `eth1`.
    #[must_use]
    pub fn side_peer_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 78, self.index, 1)
    }

    /// The pod's addresses as CNI reports them.
    #[must_use]
    pub fn ips(&self, ipv6: bool) -> Vec<IpAddr> {
        let mut ips = vec![IpAddr::V4(self.v4())];
        if ipv6 {
            ips.push(IpAddr::V6(self.v6()));
        }
        ips
    }

    /// A process of the pod as `uid`/`gid`.
    #[must_use]
    pub fn at<'a>(&'a self, node: &'a Node, uid: u32, gid: u32) -> Placement<'a> {
        Placement {
            netns: &self.netns,
            cgroup: Some(&node.cgroup),
            uid,
            gid,
        }
    }

    /// Starts the stand-in Envoy (uid/gid `proxy`) on 15001, 15006 (TCP, both families) and
    /// 15053 (TCP and UDP on loopback), and the app (uid 1000) on 8080, 8081, 15008 and 15020. With
    /// `transparent`, the inbound listener relays to the original destination from the
    /// client's address, as Envoy does in TPROXY mode.
    ///
    /// # Errors
    /// When a server cannot start.
    pub fn start_servers(
        &mut self,
        node: &Node,
        proxy: u32,
        transparent: bool,
    ) -> anyhow::Result<()> {
        let inbound = if transparent {
            "tcp:0.0.0.0:15006+transparent"
        } else {
            "tcp:0.0.0.0:15006"
        };
        let envoy = start_server_with(
            Placement {
                netns: &self.netns,
                cgroup: Some(&node.cgroup),
                uid: proxy,
                gid: proxy,
            },
            "envoy",
            &[
                "tcp:0.0.0.0:15001",
                inbound,
                "tcp:[::]:15001",
                "tcp:[::]:15006",
                "tcp:127.0.0.1:15053",
                "udp:127.0.0.1:15053",
                "tcp:[::1]:15053",
                "udp:[::1]:15053",
            ],
            ENVOY_OPTIONS,
        )
        .context("stand-in envoy")?;
        self.servers.push(envoy);
        self.start_app(node)
    }

    /// Starts the app alone (uid 1000) on 8080, 8081, 15008 and 15020: a pod whose proxy is
    /// not listening (yet, or any more).
    ///
    /// # Errors
    /// When it cannot start.
    pub fn start_app(&mut self, node: &Node) -> anyhow::Result<()> {
        let app = start_server(
            self.at(node, APP_UID, APP_UID),
            "app",
            &[
                "tcp:0.0.0.0:8080",
                "tcp:[::]:8080",
                "tcp:0.0.0.0:8081",
                "tcp:0.0.0.0:15008",
                "tcp:0.0.0.0:15020",
            ],
        )
        .context("app server")?;
        self.servers.push(app);
        Ok(())
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.servers.clear();
    }
}

/// `PROXY_UID`, for scenario tables.
pub const PROXY: u32 = PROXY_UID;
