//! The eBPF backend: meshcap's kernel programs attached once, node-wide, and per-pod state in
//! maps keyed by the pod's network namespace cookie.
//!
//! - [`node`](node.rs): the object loaded once, its maps pinned, the cgroup programs attached
//!   to the cgroup root and the shared inbound classifier installed;
//! - [`pod`](pod/mod.rs): each pod's capture as one transaction — observe its netns
//!   ([`crate::podnet`]: cookie, interfaces, addresses, routes), plan its entries
//!   ([`encode`](encode.rs) translates the policy and what was observed, once), attach its
//!   stub on its interfaces ([`stub`](stub/mod.rs), assembled and attached) and, where the
//!   kernel needs it ([`release`](release.rs)), the socket lookup program on its netns, then
//!   commit its entries through [`tables`](tables/mod.rs), the maps' only writer, which indexes
//!   what each pod holds; and each pod's CHECK and release;
//! - [`pins`](pins/mod.rs): the pinned layout under one versioned bpffs directory
//!   ([`EbpfConfig::bpffs_dir`], default `/sys/fs/bpf/meshcap/v3`), the source of truth across
//!   agent restarts, each pod's through the handle that creates, marks and removes its pins;
//!   [`layout`]: every layout version on the node, for uninstall;
//! - [`links`](links.rs): the node-wide programs compared with what the kernel runs, and put
//!   back (the verifier's node-wide part; each pod's is `pod`'s);
//! - [`order`](order.rs): other programs on the same hooks (a socket load balancer's), and
//!   meshcap's programs kept first where the kernel can order them;
//! - [`sys`](sys/mod.rs): the raw `bpf()` calls aya does not offer (links for every hook,
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
mod links;
mod node;
mod order;
mod pins;
mod pod;
mod release;
mod stub;
mod sys;
mod tables;

use std::{path::PathBuf, sync::Mutex};

pub use coverage::Uncovered;
pub use encode::{Entries, encode, encode_ambient};
pub use error::EbpfError;
use meshcap_common::maps;
pub use node::{cgroup_attachments, trial_load_stub};
pub use pins::{PinnedPod, Pins, PodPins, TcRecord, detach_link, unpin_link};
use pod::Pods;
pub use release::{Handoff, assigns_to_reuseport_listeners};
pub use stub::TcAttach;

use super::{AttachedProgram, OtherProgram};

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
    /// Which captured SYNs go through the pods' socket lookup ([`Handoff::Auto`]: by the
    /// kernel).
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

/// The eBPF capture backend: the node-wide programs, and each pod's capture (`pod::Pods`). Cheap
/// to call concurrently: map updates are serialised, netns work runs on each calling thread
/// (which enters the pod's netns and returns).
pub struct EbpfBackend {
    config: EbpfConfig,
    pods: Pods,
    kernel_log: Mutex<Option<klog::KernelLog>>,
    /// The ids of the programs this process loaded and put in place, by name.
    loaded: Vec<(&'static str, u32)>,
    /// The same programs, held open for the verifier.
    own: links::OwnPrograms,
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
        match config.handoff {
            Handoff::Auto if assigns_to_reuseport_listeners().unwrap_or(false) => {}
            Handoff::Auto => tracing::info!(
                "this kernel's bpf_sk_assign refuses SO_REUSEPORT listeners (before Linux 6.5): pods' inbound connections reach the proxy through the socket lookup"
            ),
            Handoff::Always => tracing::warn!(
                "--handoff always (benchmarks only): every captured inbound connection reaches the proxy through the socket lookup"
            ),
        }
        let handoff = node::load_handoff(&mut ebpf)?;
        Ok(Self {
            pods: Pods::new(
                pins,
                tables,
                tc_prog,
                handoff,
                config.handoff,
                config.tc_attach,
            ),
            config,
            kernel_log: Mutex::new(kernel_log),
            own: links::OwnPrograms::hold(&loaded)?,
            loaded,
        })
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
        let mut programs = node::attached(self.pods.pins(), self.pods.tc_prog());
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
            .neighbours()
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
            match order::put_first(&self.config.cgroup_root, self.pods.pins(), hook, attach) {
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
        self.pods.entry_counts()
    }

    /// Every pod captured, from the pins.
    #[must_use]
    pub fn pinned_pods(&self) -> Vec<PinnedPod> {
        self.pods.pins().pinned_pods()
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

    /// Other programs on the node-wide hooks, and where they run.
    #[must_use]
    pub fn neighbours(&self) -> Vec<OtherProgram> {
        order::neighbours(
            &self.config.cgroup_root,
            self.pods.pins(),
            &node::CGROUP_PROGRAMS,
        )
    }

    /// What an operator should know about the captures in place: processes the programs do
    /// not run for, and other programs ahead of meshcap's that rewrite destinations.
    #[must_use]
    pub fn node_warnings(&self) -> Vec<String> {
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
}
