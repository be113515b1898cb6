//! A private containerd 1.6 (Debian's `containerd` and `runc`, `cargo xtask setup`) driving the
//! CNI chain exactly as it does under kubelet: its own root, state directory, socket and CNI
//! directories, in a network namespace of its own (the node's network as the pods see it: the
//! bridge plugin's `cni0` lives there, nothing touches the machine's) and in a cgroup of its own,
//! which its shims, sandboxes and containers inherit and under which the pods' cgroups are
//! made: the cgroup the eBPF programs attach to.
//!
//! [`Containerd::prepare_node`] also gives it a mount namespace of its own, the node's file
//! system as its pods and their CNI plugins see it: a fresh tmpfs on `/run` and a bpffs of its
//! own on `/sys/fs/bpf`, so that a DaemonSet's host paths there (`/var/run/meshcap`,
//! `/var/run/ztunnel`, `/sys/fs/bpf`) are the test's and nothing is shared with the machine's.
//!
//! On drop every sandbox is stopped and removed through CRI, containerd is stopped by its pid,
//! the shims it started and anything left in its cgroup are killed, and its directories,
//! mounts and cgroups are removed.
use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{Netns, Placement, Proc, TestCgroup, cri::Cri, oci, unique_name};

/// The image every sandbox and container runs (see [`oci`]).
pub const IMAGE: &str = "meshcap.test/pod:1";

/// Debian's CNI reference plugins.
const CNI_PLUGINS: &str = "/usr/lib/cni";

/// The primary network: a bridge with host-local addresses, as a simple cluster's CNI.
pub const POD_SUBNET: &str = "10.244.0.0/24";
/// The bridge's address in the node's network namespace (the pods' gateway).
pub const GATEWAY: &str = "10.244.0.1";

/// The running containerd.
pub struct Containerd {
    proc: Option<Proc>,
    dir: PathBuf,
    /// Whether it runs in a mount namespace of its own ([`Self::prepare_node`]).
    private_node: bool,
    /// The namespace containerd runs in: the node's network for the pods.
    pub node: Netns,
    /// The cgroup containerd and everything it starts live in.
    pub cgroup: TestCgroup,
    /// The CRI socket.
    pub socket: PathBuf,
    /// The CNI configuration directory containerd reads (the agent installs into it).
    pub conf_dir: PathBuf,
    /// The CNI binary directory (the reference plugins; the agent installs meshcap's).
    pub bin_dir: PathBuf,
    /// Where sandboxes' container logs go.
    pub log_dir: PathBuf,
}

impl Containerd {
    /// Prepares the directories, the primary CNI configuration and the reference plugins,
    /// without starting containerd: the agent installs meshcap into [`Self::conf_dir`] first.
    ///
    /// # Errors
    /// When the namespace, cgroup or directories cannot be made.
    pub fn prepare() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("meshcap-containerd"));
        let (conf_dir, bin_dir, log_dir) = (dir.join("net.d"), dir.join("bin"), dir.join("logs"));
        for d in [&conf_dir, &bin_dir, &log_dir, &dir.join("ipam")] {
            fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        for plugin in ["bridge", "host-local", "loopback"] {
            let from = Path::new(CNI_PLUGINS).join(plugin);
            fs::copy(&from, bin_dir.join(plugin)).with_context(|| {
                format!(
                    "copying {} (Debian's containernetworking-plugins)",
                    from.display()
                )
            })?;
        }
        fs::write(
            conf_dir.join("10-bridge.conflist"),
            serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "plugins": [{
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": dir.join("ipam"),
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                    },
                }],
            })
            .to_string(),
        )?;
        Ok(Self {
            proc: None,
            private_node: false,
            node: Netns::new("mc-ctd-node")?,
            cgroup: TestCgroup::new("meshcap-ctd")?,
            socket: dir.join("containerd.sock"),
            conf_dir,
            bin_dir,
            log_dir,
            dir,
        })
    }

    /// [`Self::prepare`], for a containerd that runs in a mount namespace of its own (module
    /// docs): the node a DaemonSet's pod runs on.
    ///
    /// # Errors
    /// As [`Self::prepare`].
    pub fn prepare_node() -> anyhow::Result<Self> {
        let mut ctd = Self::prepare()?;
        ctd.private_node = true;
        fs::create_dir_all(ctd.netns_dir())?;
        Ok(ctd)
    }

    /// The cgroup parent to give sandboxes: the containerd cgroup's path from the root.
    #[must_use]
    pub fn cgroup_parent(&self) -> String {
        format!(
            "/{}",
            self.cgroup
                .path()
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        )
    }

    /// Starts containerd, waits for its CRI service, and imports the test image.
    ///
    /// # Errors
    /// When it does not come up or the image cannot be imported.
    pub fn start(&mut self) -> anyhow::Result<Cri> {
        let config = self.dir.join("config.toml");
        fs::write(&config, self.config())?;
        let config = config.display().to_string();
        let placement = Placement {
            netns: &self.node,
            cgroup: Some(&self.cgroup),
            uid: 0,
            gid: 0,
        };
        let log = self.dir.join("containerd.log");
        self.proc = Some(if self.private_node {
            // util-linux's unshare makes every mount private first: nothing mounted here is
            // seen outside. Shared again inside, so that the runtime accepts HostToContainer
            // mounts (it wants their source on a shared or slave mount). `-n`: no utab, which
            // would be written under the machine's /run.
            Proc::spawn_logged(
                placement,
                Path::new("/usr/bin/unshare"),
                &[
                    "--mount",
                    "--propagation",
                    "private",
                    "/bin/sh",
                    "-ec",
                    "mount -n --make-rshared /\n\
                     mount -n -t tmpfs -o mode=0755 meshcap-node-run /run\n\
                     mkdir -p /run/meshcap /run/ztunnel\n\
                     mount -n -t bpf meshcap-node-bpffs /sys/fs/bpf\n\
                     exec /usr/bin/containerd --config \"$1\"",
                    "node",
                    &config,
                ],
                &log,
            )?
        } else {
            Proc::spawn_logged(
                placement,
                Path::new("/usr/bin/containerd"),
                &["--config", &config],
                &log,
            )?
        });
        for _ in 0..200 {
            if self.socket.exists()
                && let Ok(mut cri) = Cri::connect(&self.socket)
                && cri.version().is_ok()
            {
                let archive = self.dir.join("image.tar");
                oci::write_test_image(&archive, IMAGE)?;
                let out = std::process::Command::new("/usr/bin/ctr")
                    .arg("--address")
                    .arg(&self.socket)
                    .args(["--namespace", "k8s.io", "images", "import"])
                    .arg(&archive)
                    .output()
                    .context("running ctr")?;
                if !out.status.success() {
                    bail!(
                        "ctr images import: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                return Ok(cri);
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("containerd did not come up\n{}", self.log())
    }

    /// containerd's configuration: CRI with runc through cgroupfs (no systemd here), the
    /// test image as the sandbox image, and this instance's directories.
    fn config(&self) -> String {
        let d = self.dir.display();
        // Without CAP_SYS_RESOURCE (a container) containerd could not raise a pod's
        // oom_score_adj above its own; restrict it, as rootless and nested setups do.
        format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
            socket = self.socket.display(),
            bin = self.bin_dir.display(),
            conf = self.conf_dir.display(),
        )
    }

    /// containerd's log so far.
    #[must_use]
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// Where containerd keeps its pods' network namespace files
    /// (`netns_mounts_under_state_dir`: this instance's own, not the node's `/run/netns`).
    #[must_use]
    pub fn netns_dir(&self) -> PathBuf {
        self.dir.join("state/io.containerd.grpc.v1.cri/netns")
    }

    /// The network namespace files of its pods that still exist.
    #[must_use]
    pub fn own_netns(&self) -> Vec<PathBuf> {
        fs::read_dir(self.netns_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect()
    }

    /// What a pod's sandbox left: addresses still allocated by host-local.
    #[must_use]
    pub fn allocated_addresses(&self) -> Vec<String> {
        fs::read_dir(self.dir.join("ipam/k8s-pod-network"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.proc.is_some()
            && let Ok(mut cri) = Cri::connect(&self.socket)
        {
            for sandbox in cri.sandboxes().unwrap_or_default() {
                let _ = cri.stop_pod_sandbox(&sandbox);
                let _ = cri.remove_pod_sandbox(&sandbox);
            }
        }
        // containerd (SIGKILL by pid, through its guard), then what it started: the shims and
        // any container still in its cgroup tree.
        drop(self.proc.take());
        kill_cgroup_tree(self.cgroup.path());
        // Pods' netns files are mounts under the state dir, like the snapshots.
        unmount_under(&self.dir);
        if let Err(err) = fs::remove_dir_all(&self.dir) {
            eprintln!("cleanup: removing {}: {err}", self.dir.display());
        }
        remove_v1_cgroups(&self.cgroup_parent());
    }
}

/// SIGKILLs every process in `cgroup` and its descendants (each started by this test's
/// containerd), and removes the descendant cgroups.
fn kill_cgroup_tree(cgroup: &Path) {
    for _ in 0..50 {
        let mut alive = false;
        for dir in walk(cgroup) {
            let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
                alive = true;
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        if !alive {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let mut dirs = walk(cgroup);
    dirs.retain(|d| d != cgroup);
    for dir in dirs.iter().rev() {
        let _ = fs::remove_dir(dir);
    }
}

/// `dir` and every directory below it, parents first.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_owned()];
    let mut i = 0;
    while i < out.len() {
        let children: Vec<PathBuf> = fs::read_dir(&out[i])
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        out.extend(children);
        i += 1;
    }
    out
}

/// Unmounts everything mounted under `dir` (snapshots, shm, sandbox files), deepest first.
fn unmount_under(dir: &Path) {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The cgroup v1 directories runc made for `parent` in each v1 hierarchy (hybrid hosts).
fn remove_v1_cgroups(parent: &str) {
    for hierarchy in fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = hierarchy.path().join(parent.trim_start_matches('/'));
        if hierarchy.file_name() != "unified" && dir.is_dir() {
            for d in walk(&dir).iter().rev() {
                let _ = fs::remove_dir(d);
            }
        }
    }
}
