//! Where the agent finds things on the node, by default. `deploy/daemonset.yaml` mounts exactly
//! these paths (a test checks it), so a change here is a change to the manifests too.
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
pub const AGENT_SOCKET: &str = "/var/run/meshcap/agent.sock";

/// The host's bpffs, where programs, maps and links are pinned so they outlive the agent.
pub const BPFFS: &str = "/sys/fs/bpf";

/// The host's cgroup v2 root, mounted here in the container. Inside a container
/// `/sys/fs/cgroup` is the container's own cgroup namespace, whose root is the pod's cgroup,
/// not the node's; the programs must attach to the node's root, so the host's hierarchy is
/// mounted at a separate path and handed to the agent as its cgroup root.
pub const HOST_CGROUP_ROOT: &str = "/host/sys/fs/cgroup";

/// Where container runtimes create pod network namespaces; the CNI `CNI_NETNS` paths are here.
pub const NETNS_DIR: &str = "/var/run/netns";
