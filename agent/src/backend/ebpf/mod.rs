//! The eBPF backend: meshcap's kernel programs attached once, node-wide, and per-pod state in
//! maps keyed by the pod's network namespace cookie.
//!
//! - [`node`](node.rs): the object loaded once, its maps pinned, the cgroup programs attached
//!   to the cgroup root and the shared inbound classifier installed;
//! - [`pod`](pod.rs): each pod's ADD, CHECK and DEL: a visit to its netns
//!   ([`crate::podnet`]) for its cookie, interfaces and routes, its stub attached on its
//!   interfaces ([`tc`](tc.rs), assembled by [`stub`](stub.rs)) and, where the kernel
//!   needs it ([`release`](release.rs)), the socket lookup program on its netns, then its entries
//!   ([`encode`](encode.rs) translates the policy) written by [`tables`](tables.rs), the
//!   maps' only writer, which indexes what each pod holds;
//! - [`pins`](pins.rs): the pinned layout under one versioned bpffs directory
//!   ([`EbpfConfig::bpffs_dir`], default `/sys/fs/bpf/meshcap/v3`), the source of truth across
//!   agent restarts; [`layout`]: every layout version on the node, for uninstall;
//! - [`order`](order.rs): other programs on the same hooks (a socket load balancer's), and
//!   meshcap's programs kept first where the kernel can order them;
//! - [`sys`](sys.rs): the raw `bpf()` calls aya does not offer (links for every hook,
//!   pinning, queries); [`bpffs`](bpffs.rs) mounts bpffs where there is none; `klog.rs`
//!   forwards the programs' own log records.
//!
//! A restarted agent opens the pinned maps and links and attaches nothing twice; killing it
//! (even with SIGKILL) detaches nothing: every attachment is a pinned bpf_link or a netlink TC
//! filter, which outlives its creator.
mod bpffs;
mod coverage;
mod encode;
mod error;
mod klog;
pub mod layout;
mod node;
mod order;
mod pins;
mod pod;
mod release;
mod stub;
mod sys;
mod tables;
mod tc;

use std::{collections::HashSet, os::fd::OwnedFd, path::PathBuf, sync::Mutex};

pub use coverage::Uncovered;
pub use encode::{Entries, encode, encode_ambient};
pub use error::EbpfError;
use meshcap_common::maps;
pub use node::{cgroup_attachments, trial_load_stub};
pub use pins::{PinnedPod, Pins, unpin_link};
pub use release::{Handoff, assigns_to_reuseport_listeners};
pub use tc::TcAttach;

use super::{AttachedProgram, BackendError, CaptureBackend, CapturedPod, OtherProgram, PodRef};
use crate::{podnet, policy::RedirectPolicy};

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
    /// Which pods get the socket lookup hand-off ([`Handoff::Auto`]: by the kernel).
    pub handoff: Handoff,
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
            handoff: Handoff::default(),
        })
    }

    /// The pinned layout under [`Self::bpffs_dir`].
    #[must_use]
    pub fn pins(&self) -> Pins {
        Pins::new(&self.bpffs_dir)
    }
}

/// The eBPF capture backend. Cheap to call concurrently: map updates are serialised, netns
/// work runs on each calling thread (which enters the pod's netns and returns).
pub struct EbpfBackend {
    config: EbpfConfig,
    pins: Pins,
    /// The pinned `MESHCAP_TC_PROG`, which every pod's stub tail-calls through.
    tc_prog: OwnedFd,
    /// The socket lookup program, loaded where `bpf_sk_assign` refuses `SO_REUSEPORT`
    /// listeners (or with [`Handoff::Always`]): every captured pod's netns gets it
    /// (ebpf/meshcap-ebpf/src/handoff.rs).
    handoff: Option<OwnedFd>,
    tables: Mutex<tables::Tables>,
    kernel_log: Mutex<Option<klog::KernelLog>>,
    /// The ids of the programs this process loaded and put in place, by name.
    loaded: Vec<(&'static str, u32)>,
    /// The netns cookies [`CaptureBackend::gone`] last found dead. A netns never comes back
    /// and its cookie is never given to another, so dropping one of these needs no second walk
    /// of every namespace on the node.
    found_gone: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for EbpfBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfBackend")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl EbpfBackend {
    /// Opens (or creates) the pinned maps, and attaches every node-wide program to the cgroup
    /// root unless a pinned link says it already is.
    ///
    /// # Errors
    /// When bpffs, the cgroup or the kernel refuse.
    pub fn open(config: EbpfConfig) -> Result<Self, EbpfError> {
        let pins = config.pins();
        bpffs::ensure(pins.root()).map_err(|e| EbpfError::io("bpffs", e))?;
        pins.create_dirs().map_err(|e| {
            EbpfError::io(
                &format!("creating the layout in {}", pins.root().display()),
                e,
            )
        })?;
        let mut ebpf = node::load_object(&pins)?;
        let mut loaded = node::attach_cgroup_programs(&mut ebpf, &pins, &config.cgroup_root)?;
        loaded.push((
            meshcap_common::programs::INGRESS,
            node::install_shared_tc(&mut ebpf)?,
        ));
        let tc_prog_pin = pins.map(maps::TC_PROG);
        let tc_prog = sys::obj_get(&tc_prog_pin)
            .map_err(|e| EbpfError::io(&format!("opening {}", tc_prog_pin.display()), e))?;
        // Only taken here; drained by whoever calls `forward_kernel_logs` (the agent): a ring
        // buffer has one reader.
        let kernel_log = klog::reader(&mut ebpf);
        let tables = tables::Tables::open(&mut ebpf, &pins)?;
        let handoff = match config.handoff {
            Handoff::Auto if assigns_to_reuseport_listeners().unwrap_or(false) => None,
            Handoff::Auto => {
                tracing::info!(
                    "this kernel's bpf_sk_assign refuses SO_REUSEPORT listeners (before Linux 6.5): pods' inbound connections reach the proxy through the socket lookup"
                );
                Some(node::load_handoff(&mut ebpf)?)
            }
            Handoff::Always => {
                tracing::warn!(
                    "--handoff always (benchmarks only): every captured inbound connection reaches the proxy through the socket lookup"
                );
                Some(node::load_handoff(&mut ebpf)?)
            }
        };
        Ok(Self {
            config,
            pins,
            tc_prog,
            handoff,
            tables: Mutex::new(tables),
            kernel_log: Mutex::new(kernel_log),
            loaded,
            found_gone: Mutex::default(),
        })
    }

    /// The flags a pod's config gets for the socket lookup hand-off: none without it.
    fn handoff_flags(&self) -> u32 {
        match (&self.handoff, self.config.handoff) {
            (None, _) => 0,
            (Some(_), Handoff::Auto) => meshcap_common::flags::HANDOFF,
            (Some(_), Handoff::Always) => {
                meshcap_common::flags::HANDOFF | meshcap_common::flags::HANDOFF_ALWAYS
            }
        }
    }

    /// Forwards the programs' log records (aya-log) to the agent's logs, as `log` records
    /// with target `meshcap_ebpf::…` that reach `tracing`, from a dedicated thread. Call once,
    /// in the agent only: a ring buffer has one reader, so a second caller (or a tool opening
    /// the backend) gets `false`.
    ///
    /// # Errors
    /// When the thread cannot be started.
    pub fn forward_kernel_logs(&self) -> Result<bool, EbpfError> {
        let reader = self
            .kernel_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(reader) = reader else {
            return Ok(false);
        };
        klog::forward(reader)?;
        Ok(true)
    }

    /// The configuration in use.
    #[must_use]
    pub fn config(&self) -> &EbpfConfig {
        &self.config
    }

    /// How many programs of each node-wide hook are attached to the cgroup root (1 each when
    /// healthy; 2 would mean a double attach).
    ///
    /// # Errors
    /// When the cgroup cannot be queried.
    pub fn attachments(&self) -> Result<Vec<(&'static str, u32)>, EbpfError> {
        cgroup_attachments(&self.config.cgroup_root)
    }

    /// What runs on each node-wide hook and in the TC program slot, and whether this process
    /// put it there.
    #[must_use]
    pub fn attached(&self) -> Vec<AttachedProgram> {
        let mut programs = node::attached(&self.pins, &self.tc_prog);
        for program in &mut programs {
            program.this_agent = self
                .loaded
                .iter()
                .any(|(name, id)| *name == program.program && Some(*id) == program.prog_id);
        }
        programs
    }

    /// Moves meshcap's program first on each hook where another program runs before it and
    /// changes the original destination; returns those it could not move, and why.
    fn keep_first(&self) -> Vec<(OtherProgram, String)> {
        let ahead: Vec<OtherProgram> = self
            .other_programs()
            .into_iter()
            .filter(order::decides_destination)
            .collect();
        let mut stuck = Vec::new();
        for other in ahead {
            let Some(&(hook, attach)) = node::CGROUP_PROGRAMS
                .iter()
                .find(|(name, _)| *name == other.hook)
            else {
                continue;
            };
            match order::put_first(&self.config.cgroup_root, &self.pins, hook, attach) {
                Ok(order::Placed::First) => {
                    tracing::info!(program = %other.hook, other = %other, "moved meshcap's program before the other one");
                }
                Ok(order::Placed::CannotOrder) => {
                    stuck.push((other, "this kernel cannot order cgroup programs".to_owned()));
                }
                Err(err) => {
                    stuck.push((
                        other,
                        format!("moving meshcap's program first failed: {err}"),
                    ));
                }
            }
        }
        stuck
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
    #[must_use]
    pub fn pinned_pods(&self) -> Vec<PinnedPod> {
        self.pins.pinned_pods()
    }

    /// The processes of captured pods that the node-wide programs do not run for: outside
    /// the cgroup they are attached to, so not captured.
    #[must_use]
    pub fn uncovered(&self) -> Vec<Uncovered> {
        coverage::uncovered(&self.config.cgroup_root, &self.pinned_pods())
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

    /// The pods captured for ztunnel (ambient mode), which [`CaptureBackend::list`] leaves
    /// out: ambient mode lists them.
    #[must_use]
    pub fn list_ambient(&self) -> Vec<CapturedPod> {
        self.pinned_pods()
            .into_iter()
            .filter(|pinned| pinned.ambient)
            .map(|pinned| CapturedPod {
                summary: format!(
                    "ambient (ztunnel) in the kernel: netns cookie {}, TC on {}",
                    pinned.netns_cookie,
                    pinned.interfaces.join(",")
                ),
                pod: pinned.pod_ref(),
                backend: "ebpf".to_owned(),
            })
            .collect()
    }

    /// Drops the ambient captures whose network namespace is gone and returns those pods. The
    /// pins are listed before the namespaces are walked, as in `gone`.
    ///
    /// # Errors
    /// When an entry cannot be dropped.
    pub fn prune_gone_ambient(&self) -> Result<Vec<PodRef>, EbpfError> {
        let pinned_pods = self.pinned_pods();
        let live = podnet::live_cookies();
        let mut gone = Vec::new();
        for pinned in pinned_pods {
            if pinned.ambient && !live.contains(&pinned.netns_cookie) {
                let pod = pinned.pod_ref();
                Self::remove(self, &pod)?;
                gone.push(pod);
            }
        }
        Ok(gone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, tables::Tables> {
        self.tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn found_gone(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.found_gone
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl CaptureBackend for EbpfBackend {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError> {
        Ok(Self::add(self, pod, policy)?)
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        Ok(Self::remove(self, pod)?)
    }

    fn check(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError> {
        Self::check(self, pod, policy).map_err(EbpfError::into_check)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        // Listed before the walk, as in `gone`.
        let pinned_pods = self.pinned_pods();
        let live = podnet::live_cookies();
        let mut gone = Vec::new();
        let mut pinned = HashSet::new();
        for pod in pinned_pods {
            if live.contains(&pod.netns_cookie) {
                pinned.insert(pod.netns_cookie);
                continue;
            }
            let pod_ref = pod.pod_ref();
            Self::remove(self, &pod_ref)?;
            tracing::info!(pod = %pod_ref, container = %pod_ref.container_id, netns_cookie = pod.netns_cookie, "netns gone: entries and pins dropped");
            gone.push(pod_ref);
        }
        let orphans = self.lock().sweep_orphans(&pinned);
        if orphans > 0 {
            tracing::info!(
                entries = orphans,
                "dropped map entries an interrupted request left that no pod refers to"
            );
        }
        Ok(gone)
    }

    /// The pins are listed before the namespaces are walked: a pod pinned by an ADD running
    /// meanwhile, whose netns may be newer than the walk, is never judged on it.
    ///
    /// Sidecar captures only: an ambient one is its enrollment's to drop
    /// ([`Self::prune_gone_ambient`], which also tells ztunnel and forgets the probe
    /// addresses); dropped here, a netns going between the two looks would leave its
    /// enrollment behind.
    fn gone(&self) -> Result<Vec<PodRef>, BackendError> {
        let pinned_pods = self.pinned_pods();
        let live = podnet::live_cookies();
        let gone: Vec<_> = pinned_pods
            .into_iter()
            .filter(|pod| !pod.ambient && !live.contains(&pod.netns_cookie))
            .collect();
        *self.found_gone() = gone.iter().map(|pod| pod.netns_cookie).collect();
        Ok(gone.into_iter().map(|pod| pod.pod_ref()).collect())
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        let Some(cookie) = self.find_cookie(pod) else {
            return Ok(false);
        };
        // The container captured anew since `gone` looked has another cookie: walk for that.
        let known_gone = self.found_gone().contains(&cookie);
        if !known_gone && podnet::live_cookies().contains(&cookie) {
            return Ok(false);
        }
        Self::remove(self, pod)?;
        tracing::info!(pod = %pod, container = %pod.container_id, netns_cookie = cookie, "netns gone without a DEL this agent saw: entries and pins dropped");
        Ok(true)
    }

    fn programs(&self) -> Vec<AttachedProgram> {
        self.attached()
    }

    fn other_programs(&self) -> Vec<OtherProgram> {
        order::neighbours(&self.config.cgroup_root, &self.pins, &node::CGROUP_PROGRAMS)
    }

    fn warnings(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .uncovered()
            .into_iter()
            .map(|u| {
                format!(
                    "pod {}: process {} ({}) is outside the cgroup the programs are attached to ({}): its traffic is not captured",
                    u.pod,
                    u.pid,
                    u.comm,
                    self.config.cgroup_root.display()
                )
            })
            .collect();
        out.extend(self.keep_first().into_iter().map(|(other, why)| {
            format!(
                "{other} on {}, and {why}: a destination it rewrites (a socket load balancer's service to backend) reaches Envoy as the original destination; with Cilium set socketLB.hostNamespaceOnly=true (docs/install.md, Primary CNIs)",
                self.config.cgroup_root.display()
            )
        }));
        out
    }

    fn captured_count(&self) -> Result<usize, BackendError> {
        Ok(self.lock().pod_count())
    }

    fn list(&self) -> Result<Vec<CapturedPod>, BackendError> {
        Ok(self
            .pinned_pods()
            .into_iter()
            .filter(|pinned| !pinned.ambient)
            .map(|pinned| CapturedPod {
                summary: format!(
                    "netns cookie {}, inbound TC on {}",
                    pinned.netns_cookie,
                    if pinned.interfaces.is_empty() {
                        "no interface".to_owned()
                    } else {
                        pinned.interfaces.join(",")
                    }
                ),
                pod: pinned.pod_ref(),
                backend: "ebpf".to_owned(),
            })
            .collect())
    }
}
