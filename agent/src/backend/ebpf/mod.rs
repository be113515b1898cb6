//! The eBPF backend: meshcap's kernel programs attached once, node-wide, and per-pod state in
//! maps keyed by the pod's network namespace cookie.
//!
//! Everything lives under one versioned bpffs directory ([`EbpfConfig::bpffs_dir`], default
//! `/sys/fs/bpf/meshcap/v3`), which is the source of truth across agent restarts:
//!
//! ```text
//! maps/<MAP>                                   every map, adopted as is when present
//! links/<program>                              the node-wide cgroup links (bpf_link pins)
//! pods/<cookie>/pod@<namespace>@<name>@<id>/    which pod a netns cookie belongs to
//! pods/<cookie>/tc-<ifname>/filter@<pref>@<handle>@<own|shared>-qdisc
//!                                              its netlink TC filter (the default): the
//!                                              pinned stub, or, with TCX (Linux 6.6+):
//! pods/<cookie>/tc-<ifname>                    the pod's TCX link
//! ```
//!
//! The maps' per-pod entries are indexed in memory (`index.rs`), rebuilt from the pinned maps
//! and pins when the backend opens. A restarted agent opens the pinned maps and links and
//! attaches nothing twice; killing it (even with SIGKILL) detaches nothing: every attachment
//! is a pinned bpf_link or a netlink TC filter, which outlives its creator.
mod bpffs;
mod encode;
mod index;
pub mod layout;
mod podnet;
mod stub;
mod sys;
mod tcnl;

use std::{
    fs, io,
    net::IpAddr,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::Mutex,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, LpmTrie, MapData, ProgramArray, lpm_trie::Key},
    programs::{Program, ProgramError, SchedClassifier},
};
pub use encode::{Entries, encode};
use meshcap_common::{
    CIDR_KEY_PREFIX_BITS, Cidr4Data, Cidr6Data, IfaceKey, PodConfig, PortKey, maps, programs,
};
pub use podnet::{PodNet, TcAttach};
use sys::CgroupAttach;

use super::PodRef;
use crate::{
    netns::{self, NetnsError},
    policy::RedirectPolicy,
};

/// A pod the backend captures, as the pins record it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedPod {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The sandbox container id.
    pub container_id: String,
    /// The pod's netns cookie (the maps' key).
    pub netns_cookie: u64,
    /// Interfaces with the inbound TC program.
    pub interfaces: Vec<String>,
}

/// Errors of the eBPF backend; each names what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// A filesystem or syscall failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// aya refused (object, map or link).
    #[error("{what}: {source}")]
    Bpf {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The kernel refused a program.
    #[error("program {name}: {source}")]
    Program {
        /// The program.
        name: &'static str,
        /// aya's error (with the verifier log).
        #[source]
        source: ProgramError,
    },
    /// The embedded object lacks a program or map.
    #[error("the embedded eBPF object has no {0}")]
    Missing(&'static str),
    /// A helper command failed.
    #[error("{0}")]
    Command(String),
    /// The pod's netns could not be entered.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// The kernel refused a pod's TC stub.
    #[error("loading the pod's TC stub: {0}")]
    Stub(#[from] sys::LoadError),
    /// A netlink TC request failed.
    #[error(transparent)]
    Tc(#[from] tcnl::TcError),
    /// A pod-level failure.
    #[error("{pod}: {message}")]
    Pod {
        /// `pod namespace/name`.
        pod: String,
        /// What is wrong.
        message: String,
    },
}

impl EbpfError {
    fn io(what: &str, source: io::Error) -> Self {
        Self::Io {
            what: what.to_owned(),
            source,
        }
    }

    fn program(name: &'static str, source: ProgramError) -> Self {
        Self::Program { name, source }
    }

    fn map(what: &str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Bpf {
            what: what.to_owned(),
            source: Box::new(source),
        }
    }

    fn pod(pod: &PodRef, message: impl Into<String>) -> Self {
        Self::Pod {
            pod: pod.to_string(),
            message: message.into(),
        }
    }
}

/// Where the backend attaches and pins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EbpfConfig {
    /// The cgroup the node-wide programs attach to: the cgroup v2 root in production, a
    /// throwaway child in tests.
    pub cgroup_root: PathBuf,
    /// The versioned bpffs directory (`/sys/fs/bpf/meshcap/v3`).
    pub bpffs_dir: PathBuf,
    /// How pods' inbound stubs attach: netlink TC ([`TcAttach::default`]) unless asked for TCX.
    pub tc_attach: TcAttach,
}

/// The default pin directory; the version changes whenever a map layout does.
pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/meshcap/v3";

impl EbpfConfig {
    /// The cgroup v2 root and [`DEFAULT_BPFFS_DIR`].
    ///
    /// # Errors
    /// When there is no cgroup2 mount.
    pub fn production() -> Result<Self, EbpfError> {
        Ok(Self {
            cgroup_root: crate::cgroup::cgroup2_mount()
                .map_err(|e| EbpfError::io("finding the cgroup2 mount", e))?,
            bpffs_dir: PathBuf::from(DEFAULT_BPFFS_DIR),
            tc_attach: TcAttach::default(),
        })
    }
}

/// The node-wide programs, in attach order: the original-destination plumbing before the
/// redirects, so no redirected connection ever lacks its answer.
const CGROUP_PROGRAMS: [(&str, CgroupAttach); 8] = [
    (programs::SOCKOPS, CgroupAttach::SockOps),
    (programs::GETSOCKOPT, CgroupAttach::GetSockopt),
    (programs::RECVMSG4, CgroupAttach::RecvMsg4),
    (programs::RECVMSG6, CgroupAttach::RecvMsg6),
    (programs::CONNECT4, CgroupAttach::Connect4),
    (programs::CONNECT6, CgroupAttach::Connect6),
    (programs::SENDMSG4, CgroupAttach::SendMsg4),
    (programs::SENDMSG6, CgroupAttach::SendMsg6),
];

/// The capacity of `MESHCAP_PODS` (ebpf/meshcap-ebpf/src/tables.rs).
const MAX_PODS: usize = 1_024;

/// aya-log's ring buffer of kernel-side log records.
const KERNEL_LOG_MAP: &str = "AYA_LOGS";

/// Every map of the object (all pinned; aya-log's ring buffer too, so that a restarted agent
/// reads the records of the programs it adopted, which write to the buffer of their load).
const MAPS: [&str; 10] = [
    KERNEL_LOG_MAP,
    maps::PODS,
    maps::CIDRS4,
    maps::CIDRS6,
    maps::PORTS,
    maps::IFACES,
    maps::DIALED,
    maps::CONNECTING,
    maps::FLOWS,
    maps::TC_PROG,
];

struct Tables {
    pods: HashMap<MapData, u64, PodConfig>,
    cidrs4: LpmTrie<MapData, Cidr4Data, u32>,
    cidrs6: LpmTrie<MapData, Cidr6Data, u32>,
    ports: HashMap<MapData, PortKey, u8>,
    ifaces: HashMap<MapData, IfaceKey, u32>,
    /// What those maps hold per pod (this process is their only writer once open).
    index: index::Index,
}

/// The eBPF capture backend. Cheap to call concurrently: map updates are serialised, netns
/// work runs on dedicated threads.
pub struct EbpfBackend {
    config: EbpfConfig,
    /// The pinned `MESHCAP_TC_PROG`, which every pod's stub tail-calls through.
    tc_prog: OwnedFd,
    tables: Mutex<Tables>,
    kernel_log: Mutex<Option<KernelLog>>,
}

/// aya-log's reader of the kernel-side records, writing them to `log` (bridged to `tracing`).
type KernelLog = aya_log::EbpfLogger<&'static dyn log::Log>;

impl std::fmt::Debug for EbpfBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfBackend")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn mkdir(path: &Path) -> Result<(), EbpfError> {
    fs::create_dir_all(path).map_err(|e| EbpfError::io(&format!("creating {}", path.display()), e))
}

impl EbpfBackend {
    /// Opens (or creates) the pinned maps, and attaches every node-wide program to the cgroup
    /// root unless a pinned link says it already is.
    ///
    /// # Errors
    /// When bpffs, the cgroup or the kernel refuse.
    pub fn open(config: EbpfConfig) -> Result<Self, EbpfError> {
        bpffs::ensure(&config.bpffs_dir).map_err(|e| EbpfError::io("bpffs", e))?;
        for sub in ["maps", "links", "pods"] {
            mkdir(&config.bpffs_dir.join(sub))?;
        }
        let mut ebpf = load_object(&config.bpffs_dir)?;
        let cgroup = fs::File::open(&config.cgroup_root).map_err(|e| {
            EbpfError::io(
                &format!("opening cgroup {}", config.cgroup_root.display()),
                e,
            )
        })?;
        for (name, attach) in CGROUP_PROGRAMS {
            let pin = config.bpffs_dir.join("links").join(name);
            if sys::obj_get(&pin).is_ok() {
                tracing::debug!(program = name, pin = %pin.display(), "adopting pinned link");
                continue;
            }
            let program = ebpf.program_mut(name).ok_or(EbpfError::Missing(name))?;
            let fd = load_program(program, name)?;
            let link = sys::link_create(fd.as_fd(), &cgroup, attach).map_err(|e| {
                EbpfError::io(
                    &format!("attaching {name} to {}", config.cgroup_root.display()),
                    e,
                )
            })?;
            sys::obj_pin(&link, &pin)
                .map_err(|e| EbpfError::io(&format!("pinning {}", pin.display()), e))?;
            tracing::info!(program = name, cgroup = %config.cgroup_root.display(), "attached");
        }
        install_shared_tc(&mut ebpf)?;
        let tc_prog_pin = config.bpffs_dir.join("maps").join(maps::TC_PROG);
        let tc_prog = sys::obj_get(&tc_prog_pin)
            .map_err(|e| EbpfError::io(&format!("opening {}", tc_prog_pin.display()), e))?;
        // Only taken here; drained by whoever calls `forward_kernel_logs` (the agent): a ring
        // buffer has one reader.
        let kernel_log = aya_log::EbpfLogger::init(&mut ebpf)
            .map_err(|e| tracing::warn!(error = %e, "kernel-side log records unavailable"))
            .ok();
        let mut tables = Tables {
            pods: take(&mut ebpf, maps::PODS)?,
            cidrs4: take(&mut ebpf, maps::CIDRS4)?,
            cidrs6: take(&mut ebpf, maps::CIDRS6)?,
            ports: take(&mut ebpf, maps::PORTS)?,
            ifaces: take(&mut ebpf, maps::IFACES)?,
            index: index::Index::default(),
        };
        tables.rebuild_index(&config.bpffs_dir);
        Ok(Self {
            config,
            tc_prog,
            tables: Mutex::new(tables),
            kernel_log: Mutex::new(kernel_log),
        })
    }

    /// Forwards the programs' log records (aya-log) to the agent's logs, as `log` records
    /// with target `meshcap_ebpf::…` that reach `tracing`, from a dedicated thread that
    /// sleeps in `poll(2)` on the ring buffer. Call once, in the agent only: a ring buffer has
    /// one reader, so a second caller (or a tool opening the backend) gets `false`.
    ///
    /// # Errors
    /// When the thread cannot be started.
    pub fn forward_kernel_logs(&self) -> Result<bool, EbpfError> {
        let Some(mut logger) = self
            .kernel_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        else {
            return Ok(false);
        };
        std::thread::Builder::new()
            .name("kernel-log".into())
            .spawn(move || {
                use std::os::fd::AsFd as _;
                loop {
                    let mut fds = [nix::poll::PollFd::new(
                        logger.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                        Ok(_) | Err(nix::errno::Errno::EINTR) => logger.flush(),
                        Err(err) => {
                            tracing::warn!(error = %err, "kernel-side log records: poll failed");
                            return;
                        }
                    }
                }
            })
            .map_err(|e| EbpfError::io("starting the kernel-log thread", e))?;
        Ok(true)
    }

    /// The configuration in use.
    #[must_use]
    pub fn config(&self) -> &EbpfConfig {
        &self.config
    }

    /// Captures `pod` with `policy`, or updates it to `policy`. Idempotent.
    ///
    /// # Errors
    /// When the pod's netns cannot be entered or the kernel refuses.
    pub fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), EbpfError> {
        self.add_entries(
            pod,
            encode::encode(policy),
            &policy.exclude_interfaces,
            &policy.reroute_virtual_interfaces,
        )
    }

    /// Verifies `pod` is captured with `policy`.
    ///
    /// # Errors
    /// What is missing or different, naming the pod.
    pub fn check(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), EbpfError> {
        self.check_entries(pod, &encode::encode(policy))
    }

    /// Captures `pod` with these map entries, or updates its entries. Idempotent.
    ///
    /// # Errors
    /// When the pod's netns cannot be entered or the kernel refuses.
    pub fn add_entries(
        &self,
        pod: &PodRef,
        mut entries: Entries,
        exclude_interfaces: &[String],
        reroute_interfaces: &[String],
    ) -> Result<(), EbpfError> {
        // One visit to the netns: learn it, then routes, then TC. The pod entry comes last,
        // so a pod is captured in full or not at all.
        let ipv6 = entries.config.has(meshcap_common::flags::IPV6);
        let tproxy = entries.config.has(meshcap_common::flags::TPROXY);
        let reroute = !reroute_interfaces.is_empty();
        let pods_dir = self.config.bpffs_dir.join("pods");
        let meta = meta_name(pod);
        let mode = self.config.tc_attach;
        let known = self.lock().index.cookie(&meta).is_some();
        let inside = netns::run_in(&pod.netns, || -> Result<PodNet, EbpfError> {
            let net = podnet::inspect(!exclude_interfaces.is_empty())?;
            let dir = pods_dir.join(net.cookie.to_string());
            mkdir(&dir.join(&meta))?;
            if tproxy || reroute {
                podnet::install_tproxy_route(ipv6, tproxy)?;
            }
            if ipv6 {
                podnet::add_passthrough6()?;
            }
            // An interface whose record the kernel confirms is attached already (by this agent
            // or the one before it): never twice. A record the kernel contradicts (the filter
            // deleted behind meshcap's back, the TCX link's interface replaced) is dropped and
            // the stub attached afresh.
            let mut tc = tcnl::Session::default();
            let mut todo = Vec::new();
            for (ifindex, name) in &net.interfaces {
                if exclude_interfaces.contains(name) {
                    continue;
                }
                let record = dir.join(format!("tc-{name}"));
                if record.exists() {
                    let Err(stale) = podnet::verify_tc(&mut tc, name, &record) else {
                        continue;
                    };
                    tracing::warn!(pod = %pod, interface = %name, reason = %stale, "re-attaching the inbound TC stub");
                    podnet::detach_tc(&mut tc, name, &record);
                }
                todo.push((*ifindex, name));
            }
            if !todo.is_empty() {
                // One stub per pod, shared by its interfaces.
                let stub = stub::load(net.cookie, &self.tc_prog)?;
                for (ifindex, name) in todo {
                    let record = dir.join(format!("tc-{name}"));
                    podnet::attach_tc(&mut tc, mode, stub.as_fd(), ifindex, name, &record)?;
                }
            }
            Ok(net)
        });
        let net = match inside {
            Ok(Ok(net)) => net,
            Ok(Err(err)) => {
                // Nothing half-applied: a pod this agent did not capture yet loses what this
                // ADD attached (an update keeps its capture as it was).
                if !known && let Err(undo) = self.remove(pod) {
                    tracing::warn!(pod = %pod, error = %undo, "undoing a failed ADD");
                }
                return Err(err);
            }
            Err(err) => return Err(err.into()),
        };
        entries.add_pod_net(&net, exclude_interfaces, reroute_interfaces);
        let config = entries.config;
        let cookie = net.cookie;
        let mut tables = self.lock();
        tables.index.set_cookie(meta, cookie);
        let old = tables.pods.get(&cookie, 0).ok();
        let pod_id = tables.index.allocate();
        let written = tables
            .write_lists(pod_id, &entries)
            .and_then(|()| tables.write_ifaces(cookie, &net, &entries))
            .and_then(|()| {
                tables
                    .pods
                    .insert(cookie, PodConfig { pod_id, ..config }, 0)
                    .map_err(|e| EbpfError::map("writing the pod entry", e))
            });
        if let Err(err) = written {
            // A full map (E2BIG): nothing of this ADD stays; an update keeps its old entry.
            tables.remove_lists(pod_id);
            drop(tables);
            if old.is_none() {
                self.remove(pod)?;
            }
            return Err(EbpfError::pod(
                pod,
                format!("capture not applied (a node holds at most {MAX_PODS} pods): {err}"),
            ));
        }
        if let Some(old) = old {
            tables.remove_lists(old.pod_id);
        }
        tracing::info!(pod = %pod, netns_cookie = cookie, pod_id, "captured");
        Ok(())
    }

    /// Stops capturing `pod` and removes everything of it. Idempotent; works when the netns
    /// is already gone.
    ///
    /// # Errors
    /// When the maps refuse.
    pub fn remove(&self, pod: &PodRef) -> Result<(), EbpfError> {
        let Some(cookie) = self.find_cookie(pod) else {
            return Ok(());
        };
        // Whether the pod may have the TPROXY policy route (TPROXY mode or a rerouted
        // interface): removing it forks `ip`, so only then (or when nothing says).
        let route = {
            let mut tables = self.lock();
            let config = tables.pods.get(&cookie, 0).ok();
            if let Some(config) = config {
                tables
                    .pods
                    .remove(&cookie)
                    .map_err(|e| EbpfError::map("removing the pod entry", e))?;
                tables.remove_lists(config.pod_id);
            }
            let rerouted = tables.remove_ifaces(cookie);
            tables.index.forget_cookie(cookie);
            config.is_none_or(|c| c.has(meshcap_common::flags::TPROXY)) || rerouted
        };
        let dir = self.pod_dir(cookie);
        let tc: Vec<(String, PathBuf)> = list_dir(&dir)
            .into_iter()
            .filter_map(|name| Some((name.strip_prefix("tc-")?.to_owned(), dir.join(&name))))
            .collect();
        let detached = netns::run_in(&pod.netns, || {
            let mut session = tcnl::Session::default();
            for (ifname, pin) in &tc {
                podnet::detach_tc(&mut session, ifname, pin);
            }
            if route {
                podnet::remove_tproxy_route();
            }
        });
        if detached.is_err() {
            // The netns is gone, and its devices with it: only the pins are left.
            for (_, pin) in &tc {
                let _ = unpin_link(pin);
            }
        }
        remove_tree(&dir);
        tracing::info!(pod = %pod, netns_cookie = cookie, "released");
        Ok(())
    }

    /// Verifies `pod` is captured with exactly these entries' configuration and its TC
    /// programs are attached.
    ///
    /// # Errors
    /// What is missing or different.
    pub fn check_entries(&self, pod: &PodRef, entries: &Entries) -> Result<(), EbpfError> {
        let cookie = netns::cookie_of(&pod.netns)?;
        let config = self
            .lock()
            .pods
            .get(&cookie, 0)
            .map_err(|_| EbpfError::pod(pod, "not captured: no entry for its netns"))?;
        let want = entries.config.flags & !meshcap_common::flags::EXCLUDED_ROUTES;
        if config.flags & !meshcap_common::flags::EXCLUDED_ROUTES != want
            || config.proxy_uid != entries.config.proxy_uid
            || config.proxy_gid != entries.config.proxy_gid
        {
            return Err(EbpfError::pod(
                pod,
                format!("captured with a different configuration: {config:?}"),
            ));
        }
        for (name, _) in CGROUP_PROGRAMS {
            let pin = self.config.bpffs_dir.join("links").join(name);
            sys::obj_get(&pin).map_err(|e| {
                EbpfError::pod(
                    pod,
                    format!("node-wide program {name} is not attached: {e}"),
                )
            })?;
        }
        let dir = self.pod_dir(cookie);
        let records: Vec<(String, PathBuf)> = list_dir(&dir)
            .into_iter()
            .filter_map(|name| Some((name.strip_prefix("tc-")?.to_owned(), dir.join(&name))))
            .collect();
        if records.is_empty() {
            return Err(EbpfError::pod(pod, "no inbound TC program attached"));
        }
        netns::run_in(&pod.netns, || {
            let mut tc = tcnl::Session::default();
            records
                .iter()
                .try_for_each(|(ifname, record)| podnet::verify_tc(&mut tc, ifname, record))
        })?
        .map_err(|message| EbpfError::pod(pod, message))
    }

    /// How many programs of each node-wide hook are attached to the cgroup root (1 each when
    /// healthy; 2 would mean a double attach).
    ///
    /// # Errors
    /// When the cgroup cannot be queried.
    pub fn attachments(&self) -> Result<Vec<(&'static str, u32)>, EbpfError> {
        cgroup_attachments(&self.config.cgroup_root)
    }

    /// How many entries each per-pod map holds (all zero when no pod is captured): the maps
    /// of pod configurations, CIDR lists, port lists and interfaces.
    #[must_use]
    pub fn entry_counts(&self) -> Vec<(&'static str, usize)> {
        let tables = self.lock();
        vec![
            (maps::PODS, tables.pods.keys().count()),
            (maps::CIDRS4, tables.cidrs4.keys().count()),
            (maps::CIDRS6, tables.cidrs6.keys().count()),
            (maps::PORTS, tables.ports.keys().count()),
            (maps::IFACES, tables.ifaces.keys().count()),
        ]
    }

    /// Every pod captured, from the pins.
    ///
    /// # Errors
    /// When the pin directory cannot be read.
    pub fn list(&self) -> Result<Vec<PinnedPod>, EbpfError> {
        Ok(pinned_pods(&self.config.bpffs_dir))
    }

    /// Detaches every node-wide program and removes every pin (maps included): the node is
    /// left as before the first [`Self::open`]. Pods' TC links go with their pins.
    ///
    /// # Errors
    /// When the directory cannot be removed.
    pub fn uninstall(self) -> Result<(), EbpfError> {
        let dir = self.config.bpffs_dir.clone();
        drop(self);
        layout::remove(&dir)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn pod_dir(&self, cookie: u64) -> PathBuf {
        self.config.bpffs_dir.join("pods").join(cookie.to_string())
    }

    /// The pod's cookie: as the pins record it (indexed), else from its netns while it
    /// exists.
    fn find_cookie(&self, pod: &PodRef) -> Option<u64> {
        self.lock()
            .index
            .cookie(&meta_name(pod))
            .or_else(|| netns::cookie_of(&pod.netns).ok())
    }
}

/// The pin-directory name recording which pod a cookie is (`@` is not in Kubernetes names).
fn meta_name(pod: &PodRef) -> String {
    format!("pod@{}@{}@{}", pod.namespace, pod.name, pod.container_id)
}

fn parse_meta_name(name: &str) -> Option<(String, String, String)> {
    let mut parts = name.strip_prefix("pod@")?.splitn(3, '@');
    Some((
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
    ))
}

fn list_dir(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// How many programs of each node-wide hook are attached to `cgroup_root`, whoever attached
/// them.
///
/// # Errors
/// When the cgroup cannot be queried.
pub fn cgroup_attachments(cgroup_root: &Path) -> Result<Vec<(&'static str, u32)>, EbpfError> {
    let cgroup =
        fs::File::open(cgroup_root).map_err(|e| EbpfError::io("opening the cgroup root", e))?;
    CGROUP_PROGRAMS
        .iter()
        .map(|(name, attach)| {
            sys::prog_count(&cgroup, *attach)
                .map(|n| (*name, n))
                .map_err(|e| EbpfError::io(&format!("querying {name}"), e))
        })
        .collect()
}

/// Every pod pinned under the layout directory `bpffs_dir` (only its `pods/` names are read,
/// so this works for any layout version).
fn pinned_pods(bpffs_dir: &Path) -> Vec<PinnedPod> {
    let pods_dir = bpffs_dir.join("pods");
    let mut out = Vec::new();
    for cookie_name in list_dir(&pods_dir) {
        let Ok(cookie) = cookie_name.parse::<u64>() else {
            continue;
        };
        let names = list_dir(&pods_dir.join(&cookie_name));
        let Some((namespace, name, container_id)) = names.iter().find_map(|n| parse_meta_name(n))
        else {
            continue;
        };
        out.push(PinnedPod {
            namespace,
            name,
            container_id,
            netns_cookie: cookie,
            interfaces: names
                .iter()
                .filter_map(|n| n.strip_prefix("tc-").map(str::to_owned))
                .collect(),
        });
    }
    out
}

/// Removes a bpffs tree: pins are files (links are detached first), the rest directories.
fn remove_tree(dir: &Path) {
    for name in list_dir(dir) {
        let path = dir.join(name);
        if path.is_dir() {
            remove_tree(&path);
        } else {
            let _ = unpin_link(&path);
        }
    }
    let _ = fs::remove_dir(dir);
}

/// Detaches the link pinned at `path` now (when it is a link) and removes the pin. Only
/// unlinking the pin would detach it later, from a kernel workqueue.
///
/// # Errors
/// When the pin cannot be removed.
pub fn unpin_link(path: &Path) -> io::Result<()> {
    if let Ok(fd) = sys::obj_get(path) {
        // Maps and netlink-era leftovers are not links: EINVAL, and nothing to detach.
        let _ = sys::link_detach(&fd);
    }
    fs::remove_file(path)
}

fn load_object(bpffs_dir: &Path) -> Result<Ebpf, EbpfError> {
    if crate::bpf::object().is_empty() {
        return Err(EbpfError::Bpf {
            what: "opening the embedded object".into(),
            source: Box::new(crate::bpf::LoadError::NotEmbedded),
        });
    }
    let mut loader = EbpfLoader::new();
    for name in MAPS {
        loader.map_pin_path(name, bpffs_dir.join("maps").join(name));
    }

    loader
        .load(crate::bpf::object())
        .map_err(|e| EbpfError::map("loading the eBPF object", e))
}

fn load_program(
    program: &mut Program,
    name: &'static str,
) -> Result<aya::programs::ProgramFd, EbpfError> {
    let err = |e| EbpfError::program(name, e);
    match program {
        Program::CgroupSockAddr(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        Program::CgroupSockopt(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        Program::SockOps(p) => {
            p.load().map_err(err)?;
            p.fd()
                .map_err(err)?
                .try_clone()
                .map_err(|e| EbpfError::io(name, e))
        }
        _ => Err(err(ProgramError::UnexpectedProgramType)),
    }
}

/// Loads a pod's TC stub against `ebpf`'s (unpinned) `MESHCAP_TC_PROG`, and drops it: the
/// probe's trial load of what the agent assembles itself.
///
/// # Errors
/// When the object has no such map or the kernel refuses the stub.
pub fn trial_load_stub(ebpf: &Ebpf) -> Result<(), EbpfError> {
    let Some(aya::maps::Map::ProgramArray(slots)) = ebpf.map(maps::TC_PROG) else {
        return Err(EbpfError::Missing(maps::TC_PROG));
    };
    stub::load(0, slots.fd().as_fd())?;
    Ok(())
}

/// Loads (verifies) the inbound classifier once and puts it in slot 0 of the pinned
/// `MESHCAP_TC_PROG`, which every pod's stub tail-calls. A restarted agent replaces it
/// atomically with its own instance.
fn install_shared_tc(ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    let prog: &mut SchedClassifier = ebpf
        .program_mut(programs::INGRESS)
        .ok_or(EbpfError::Missing(programs::INGRESS))?
        .try_into()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?;
    prog.load()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?;
    let fd = prog
        .fd()
        .map_err(|e| EbpfError::program(programs::INGRESS, e))?
        .try_clone()
        .map_err(|e| EbpfError::io(programs::INGRESS, e))?;
    let mut slots: ProgramArray<MapData> = take(ebpf, maps::TC_PROG)?;
    slots
        .set(0, &fd, 0)
        .map_err(|e| EbpfError::map("setting the shared TC program", e))
}

fn take<T: TryFrom<aya::maps::Map>>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    let map = ebpf.take_map(name).ok_or(EbpfError::Missing(name))?;
    T::try_from(map).map_err(|e| EbpfError::map(&format!("map {name}"), e))
}

impl Tables {
    /// Indexes what the maps and pins hold (an agent's restart, or the first open): one walk
    /// of each map, once.
    fn rebuild_index(&mut self, bpffs_dir: &Path) {
        for (_, config) in self.pods.iter().flatten() {
            self.index.use_id(config.pod_id);
        }
        for key in self.ports.keys().flatten() {
            self.index.lists_mut(key.pod_id).ports.push(key);
        }
        for key in self.cidrs4.keys().flatten() {
            let id = u32::from_be_bytes(key.data().pod);
            self.index.lists_mut(id).cidrs4.push(key);
        }
        for key in self.cidrs6.keys().flatten() {
            let id = u32::from_be_bytes(key.data().pod);
            self.index.lists_mut(id).cidrs6.push(key);
        }
        for (key, flags) in self.ifaces.iter().flatten() {
            self.index.add_iface(key.netns, key, flags);
        }
        for pinned in pinned_pods(bpffs_dir) {
            let pod = PodRef {
                namespace: pinned.namespace,
                name: pinned.name,
                container_id: pinned.container_id,
                netns: PathBuf::new(),
            };
            self.index.set_cookie(meta_name(&pod), pinned.netns_cookie);
        }
    }

    /// Writes `entries`' lists under `pod_id`, recording every key written (also when a
    /// later one fails, so that [`Self::remove_lists`] takes them all back).
    fn write_lists(&mut self, pod_id: u32, entries: &Entries) -> Result<(), EbpfError> {
        for (kind, port) in &entries.ports {
            let key = PortKey::new(pod_id, *kind, *port);
            self.ports
                .insert(key, 1, 0)
                .map_err(|e| EbpfError::map("writing a port list", e))?;
            self.index.lists_mut(pod_id).ports.push(key);
        }
        for (kind, addr, len, value) in &entries.cidrs {
            let prefix = CIDR_KEY_PREFIX_BITS + u32::from(*len);
            match addr {
                IpAddr::V4(a) => {
                    let key = Key::new(
                        prefix,
                        Cidr4Data::new(pod_id, *kind, u32::from_ne_bytes(a.octets())),
                    );
                    self.cidrs4
                        .insert(&key, *value, 0)
                        .map_err(|e| EbpfError::map("writing a CIDR list", e))?;
                    self.index.lists_mut(pod_id).cidrs4.push(key);
                }
                IpAddr::V6(a) => {
                    let key = Key::new(
                        prefix,
                        Cidr6Data::new(pod_id, *kind, meshcap_common::Addr::v6(a.octets()).words()),
                    );
                    self.cidrs6
                        .insert(&key, *value, 0)
                        .map_err(|e| EbpfError::map("writing a CIDR list", e))?;
                    self.index.lists_mut(pod_id).cidrs6.push(key);
                }
            }
        }
        Ok(())
    }

    /// Removes the lists written under `pod_id` and frees the id.
    fn remove_lists(&mut self, pod_id: u32) {
        let lists = self.index.release(pod_id);
        for key in &lists.ports {
            let _ = self.ports.remove(key);
        }
        for key in &lists.cidrs4 {
            let _ = self.cidrs4.remove(key);
        }
        for key in &lists.cidrs6 {
            let _ = self.cidrs6.remove(key);
        }
    }

    fn write_ifaces(
        &mut self,
        cookie: u64,
        net: &PodNet,
        entries: &Entries,
    ) -> Result<(), EbpfError> {
        self.remove_ifaces(cookie);
        for (ifindex, name) in &net.interfaces {
            if let Some((_, flags)) = entries.ifaces.iter().find(|(n, _)| n == name) {
                let key = IfaceKey {
                    netns: cookie,
                    ifindex: *ifindex,
                    pad: 0,
                };
                self.ifaces
                    .insert(key, *flags, 0)
                    .map_err(|e| EbpfError::map("writing interface flags", e))?;
                self.index.add_iface(cookie, key, *flags);
            }
        }
        Ok(())
    }

    /// Removes the interface entries of the pod with netns `cookie`; whether one of them
    /// was rerouted.
    fn remove_ifaces(&mut self, cookie: u64) -> bool {
        let mut rerouted = false;
        for (key, flags) in self.index.take_ifaces(cookie) {
            rerouted |= flags & meshcap_common::iface_flags::REROUTE != 0;
            let _ = self.ifaces.remove(&key);
        }
        rerouted
    }
}

impl super::CaptureBackend for EbpfBackend {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), super::BackendError> {
        Ok(Self::add(self, pod, policy)?)
    }

    fn remove(&self, pod: &PodRef) -> Result<(), super::BackendError> {
        Ok(Self::remove(self, pod)?)
    }

    fn check(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), super::BackendError> {
        Ok(Self::check(self, pod, policy)?)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, super::BackendError> {
        let live = netns::live_cookies();
        let mut gone = Vec::new();
        for pinned in Self::list(self)? {
            if live.contains(&pinned.netns_cookie) {
                continue;
            }
            let pod = PodRef {
                namespace: pinned.namespace,
                name: pinned.name,
                container_id: pinned.container_id,
                netns: PathBuf::new(),
            };
            Self::remove(self, &pod)?;
            tracing::info!(pod = %pod, container = %pod.container_id, netns_cookie = pinned.netns_cookie, "netns gone: entries and pins dropped");
            gone.push(pod);
        }
        Ok(gone)
    }

    fn captured_count(&self) -> Result<usize, super::BackendError> {
        Ok(self.lock().index.pods())
    }

    fn list(&self) -> Result<Vec<super::CapturedPod>, super::BackendError> {
        Ok(Self::list(self)?
            .into_iter()
            .map(|pinned| super::CapturedPod {
                summary: format!(
                    "netns cookie {}, inbound TC on {}",
                    pinned.netns_cookie,
                    if pinned.interfaces.is_empty() {
                        "no interface".to_owned()
                    } else {
                        pinned.interfaces.join(",")
                    }
                ),
                pod: PodRef {
                    namespace: pinned.namespace,
                    name: pinned.name,
                    container_id: pinned.container_id,
                    // The pins record the cookie, not the runtime's netns path.
                    netns: PathBuf::new(),
                },
                backend: "ebpf".to_owned(),
            })
            .collect())
    }
}
