//! Where the agent finds things on the node, by default. The DaemonSet in `deploy/` mounts
//! exactly these paths (`agent/tests/deploy.rs` checks it), so a change here is a change to the
//! manifests too.
//!
//! Host directories are mounted at the same path inside the agent's container, so one set of
//! defaults serves both the DaemonSet and a host-installed agent.

/// Where the container runtime looks for CNI plugin binaries (Istio's `cniBinDir`).
pub const CNI_BIN_DIR: &str = "/opt/cni/bin";

/// Where the container runtime reads CNI network configurations (Istio's `cniConfDir`).
pub const CNI_CONF_DIR: &str = "/etc/cni/net.d";

/// The agent's run directory on the host: its socket for the plugin lives here.
pub const RUN_DIR: &str = "/var/run/meshcap";

/// The plugin ⇄ agent socket, inside [`RUN_DIR`].
pub const AGENT_SOCKET: &str = meshcap_cni::cni::DEFAULT_AGENT_SOCKET;

/// The host's bpffs, where programs, maps and links are pinned so they outlive the agent.
pub const BPFFS: &str = "/sys/fs/bpf";

/// The host's `/proc`, where ambient mode with `global.nativeNftables` finds kubelet's uid
/// (the DaemonSet mounts it read-only there, as Istio's does).
pub const HOST_PROC: &str = "/host/proc";

/// The host's cgroup v2 root, mounted here in the container. Inside a container
/// `/sys/fs/cgroup` is the container's own cgroup namespace, whose root is the pod's cgroup,
/// not the node's; the programs must attach to the node's root, so the host's hierarchy is
/// mounted at a separate path and handed to the agent as its cgroup root.
pub const HOST_CGROUP_ROOT: &str = "/host/sys/fs/cgroup";

/// Where ztunnel finds the agent's ZDS socket (ambient mode; Istio's `/var/run/ztunnel`).
pub const ZTUNNEL_DIR: &str = "/var/run/ztunnel";

/// Where container runtimes create pod network namespaces; the CNI `CNI_NETNS` paths are here.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Where the DaemonSet mounts the plugin's own token (the `meshcap-cni-token` Secret, read
/// only): the agent writes it into the plugin's kubeconfig (`install::kubeconfig`).
pub const CNI_TOKEN_DIR: &str = "/var/run/secrets/meshcap.io/cni";

/// Health and readiness (`/healthz`, `/readyz`), on every address of the node: Istio's node
/// agent's port (`constants.ReadinessPort`, `cni/pkg/constants/constants.go`).
pub const HEALTH_LISTEN: &str = "0.0.0.0:8000";

/// Prometheus metrics (`/metrics`), on every address of the node: Istio's node agent's
/// `--monitoring-port` default (`cni/pkg/cmd/root.go`).
pub const METRICS_LISTEN: &str = "0.0.0.0:15014";

/// Where the agent serves health, readiness and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// Health and readiness on one address, metrics on another (the DaemonSet's, as Istio's).
    Split {
        /// `/healthz` and `/readyz`.
        health: std::net::SocketAddr,
        /// `/metrics`.
        metrics: std::net::SocketAddr,
    },
    /// All three on one address (`--http-listen`; a private agent's).
    Combined(std::net::SocketAddr),
}

impl Default for Endpoints {
    fn default() -> Self {
        Self::Split {
            health: HEALTH_LISTEN.parse().expect("a socket address"),
            metrics: METRICS_LISTEN.parse().expect("a socket address"),
        }
    }
}

impl Endpoints {
    /// These, with health or metrics moved where given (an address not given stays; for
    /// [`Self::Combined`], the one address).
    #[must_use]
    pub fn with(
        self,
        health: Option<std::net::SocketAddr>,
        metrics: Option<std::net::SocketAddr>,
    ) -> Self {
        let (h, m) = match self {
            Self::Split { health, metrics } => (health, metrics),
            Self::Combined(addr) => (addr, addr),
        };
        match (health, metrics) {
            (None, None) => self,
            (health, metrics) => Self::Split {
                health: health.unwrap_or(h),
                metrics: metrics.unwrap_or(m),
            },
        }
    }
}

/// A private agent's name that cannot name its paths.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("instance name {0:?}: use 1 to 40 lowercase letters, digits and '-'")]
pub struct InstanceNameError(pub String);

/// Where one agent keeps everything it owns on the node: the DaemonSet's ([`Self::default`]),
/// or a private agent's beside it ([`Self::instance`]), so that a second agent started by hand
/// never shares a socket, state, pins, cgroup or port with the first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentPaths {
    /// The plugin socket.
    pub socket: std::path::PathBuf,
    /// The state directory (locked while the agent runs).
    pub state_dir: std::path::PathBuf,
    /// The versioned bpffs directory the eBPF backend pins under.
    pub bpffs_dir: std::path::PathBuf,
    /// The cgroup the eBPF programs attach to, relative to the cgroup2 mount (empty: the
    /// mount itself).
    pub cgroup: std::path::PathBuf,
    /// Where health, readiness and metrics are served.
    pub endpoints: Endpoints,
}

impl Default for AgentPaths {
    fn default() -> Self {
        Self {
            socket: AGENT_SOCKET.into(),
            state_dir: RUN_DIR.into(),
            bpffs_dir: crate::backend::ebpf::DEFAULT_BPFFS_DIR.into(),
            cgroup: std::path::PathBuf::new(),
            endpoints: Endpoints::default(),
        }
    }
}

impl AgentPaths {
    /// The paths of the private agent `name`: `/var/run/meshcap-<name>/` (socket and state),
    /// `/sys/fs/bpf/meshcap-<name>/<layout>/`, the cgroup `meshcap-<name>` under the cgroup2
    /// mount (only processes in it are captured), and an endpoint on a port of the kernel's
    /// choosing on 127.0.0.1 (the agent logs it).
    ///
    /// # Errors
    /// When `name` is not 1 to 40 lowercase letters, digits and `-`.
    pub fn instance(name: &str) -> Result<Self, InstanceNameError> {
        if name.is_empty()
            || name.len() > 40
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(InstanceNameError(name.to_owned()));
        }
        let run = std::path::PathBuf::from(format!("{RUN_DIR}-{name}"));
        let layout = std::path::Path::new(crate::backend::ebpf::DEFAULT_BPFFS_DIR)
            .file_name()
            .unwrap_or_default();
        Ok(Self {
            socket: run.join("agent.sock"),
            state_dir: run,
            bpffs_dir: std::path::Path::new(BPFFS)
                .join(format!("meshcap-{name}"))
                .join(layout),
            cgroup: format!("meshcap-{name}").into(),
            endpoints: Endpoints::Combined("127.0.0.1:0".parse().expect("a socket address")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_shares_nothing_with_the_daemon_set() {
        let default = AgentPaths::default();
        let private = AgentPaths::instance("dev-1").expect("a valid name");
        assert_eq!(
            private.socket,
            std::path::Path::new("/var/run/meshcap-dev-1/agent.sock")
        );
        assert_eq!(
            private.bpffs_dir,
            std::path::Path::new("/sys/fs/bpf/meshcap-dev-1/v3")
        );
        assert_eq!(private.cgroup, std::path::Path::new("meshcap-dev-1"));
        assert_ne!(private.state_dir, default.state_dir);
        assert_ne!(private.endpoints, default.endpoints);
        for bad in ["", "Dev", "a/b", "a_b", &"x".repeat(41)] {
            assert!(AgentPaths::instance(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn health_or_metrics_moved_alone() {
        let at = |s: &str| s.parse::<std::net::SocketAddr>().expect("an address");
        assert_eq!(
            Endpoints::default().with(Some(at("0.0.0.0:9000")), None),
            Endpoints::Split {
                health: at("0.0.0.0:9000"),
                metrics: at(METRICS_LISTEN)
            }
        );
        let private = Endpoints::Combined(at("127.0.0.1:0"));
        assert_eq!(private.with(None, None), private);
        assert_eq!(
            private.with(None, Some(at("127.0.0.1:9100"))),
            Endpoints::Split {
                health: at("127.0.0.1:0"),
                metrics: at("127.0.0.1:9100")
            }
        );
    }
}
