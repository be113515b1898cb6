//! Which backend captures: `--backend` as given, or for `auto` the kernel probe's answer and
//! else Istio's rules (iptables, or nftables with `global.nativeNftables`, each in front of the
//! pods an earlier agent captured with the other); and what captures ambient pods.
use std::{path::PathBuf, sync::Arc};

use meshcap_agent::{
    backend::{
        BackendChoice, BackendError, CaptureBackend,
        ebpf::{EbpfBackend, EbpfConfig},
        handover::Handover,
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
        nftables::{NftablesBackend, NftablesConfig},
    },
    privilege::{self, Operation},
    probe::{self, ProbeReport},
};
use tracing::{info, warn};

/// A backend, shared by the router and whoever else needs it.
pub(crate) type Shared = Arc<dyn CaptureBackend>;

/// The backend chosen, and the eBPF backend itself when it is that one (ambient mode can
/// capture its pods with it).
pub(crate) struct Chosen {
    pub(crate) backend: Shared,
    pub(crate) ebpf: Option<Arc<EbpfBackend>>,
}

/// Istio's rules, where the kernel programs do not capture: its iptables rules, or with
/// `global.nativeNftables` its nftables ones, as Istio's node agent chooses.
#[derive(Clone)]
pub(crate) struct RulesPath {
    /// Where the backend keeps its records.
    pub(crate) state_dir: PathBuf,
    /// Which iptables.
    pub(crate) flavour: FlavourChoice,
    /// `global.nativeNftables`.
    pub(crate) nftables: bool,
}

impl RulesPath {
    /// The iptables backend, in front of the pods an earlier agent captured with nftables.
    fn iptables(&self) -> Result<Shared, BackendError> {
        let now = Arc::new(IptablesBackend::new(&IptablesConfig {
            state_dir: self.state_dir.clone(),
            flavour: self.flavour,
        })?);
        Self::with_earlier(now, NftablesBackend::has_records(&self.state_dir), || {
            self.open_nftables()
        })
    }

    /// The nftables backend, in front of the pods an earlier agent captured with iptables.
    fn nftables(&self) -> Result<Shared, BackendError> {
        let now = self.open_nftables()?;
        Self::with_earlier(now, IptablesBackend::has_records(&self.state_dir), || {
            Ok(Arc::new(IptablesBackend::new(&IptablesConfig {
                state_dir: self.state_dir.clone(),
                flavour: self.flavour,
            })?))
        })
    }

    fn open_nftables(&self) -> Result<Shared, BackendError> {
        Ok(Arc::new(NftablesBackend::new(&NftablesConfig {
            state_dir: self.state_dir.clone(),
        })?))
    }

    /// `now`, or, when the other rules backend's records name pods an earlier agent captured
    /// with it (`recorded`), `now` in front of it: those pods keep their rules until they go
    /// (nothing is created to find out).
    fn with_earlier(
        now: Shared,
        recorded: bool,
        open: impl FnOnce() -> Result<Shared, BackendError>,
    ) -> Result<Shared, BackendError> {
        if !recorded {
            return Ok(now);
        }
        let earlier = open()?;
        info!(
            now = now.name(),
            earlier = earlier.name(),
            pods = earlier.captured_count()?,
            "pods captured by the earlier rules backend keep their rules until they go"
        );
        Ok(Arc::new(Handover::new(now, earlier)))
    }

    /// `kernel` (the eBPF backend), or, for the pods that keep Istio's rules — istio-cni's
    /// sidecar pods to adopt at start (`adopting`), or pods the rules backends' records name
    /// (an earlier agent ran the rules path) — the rules backend in front of it: their
    /// requests go to the rules, new pods to the kernel programs, never both to one pod.
    /// Without a rules backend that opens here (no `iptables` or `nft`), the kernel programs
    /// alone, logged: istio-cni's pods keep their rules, unadopted.
    fn in_front_of_kernel(&self, kernel: Shared, adopting: bool) -> Shared {
        let recorded = IptablesBackend::has_records(&self.state_dir)
            || NftablesBackend::has_records(&self.state_dir);
        if !adopting && !recorded {
            return kernel;
        }
        match self.open() {
            Ok(rules) => {
                info!(
                    rules = rules.name(),
                    "pods that keep Istio's rules are served by the rules backend; new pods by the kernel programs"
                );
                Arc::new(Handover::new(kernel, rules))
            }
            Err(err) => {
                warn!(error = %err, "no rules backend for the pods that keep Istio's rules: they stay as they are, not meshcap's");
                kernel
            }
        }
    }

    /// The rules backend the settings choose.
    fn open(&self) -> Result<Shared, BackendError> {
        if self.nftables {
            self.nftables()
        } else {
            self.iptables()
        }
    }
}

/// The backend `choice` picks (for `auto`, what the kernel probe says, then the rules path),
/// why, and the probe's findings; `adopting`: istio-cni's sidecar pods are to be adopted (the
/// kernel programs then have the rules backend in front, [`RulesPath::in_front_of_kernel`]).
pub(crate) fn open_backend(
    choice: BackendChoice,
    rules: &RulesPath,
    ebpf: EbpfConfig,
    adopting: bool,
) -> anyhow::Result<(Chosen, String, Option<ProbeReport>)> {
    let chosen = |backend: Shared| Chosen {
        backend,
        ebpf: None,
    };
    let open_ebpf = |ebpf| -> anyhow::Result<Chosen> {
        let backend = EbpfBackend::open(ebpf).map_err(|err| {
            let why = privilege::explain(Operation::Bpf, &err);
            let err = anyhow::Error::new(err);
            match why {
                Some(why) => err.context(format!("opening the eBPF backend: {why}")),
                None => err.context("opening the eBPF backend"),
            }
        })?;
        if !backend.forward_kernel_logs()? {
            warn!("the programs' own log records will not reach this log");
        }
        let backend = Arc::new(backend);
        Ok(Chosen {
            backend: rules.in_front_of_kernel(backend.clone(), adopting),
            ebpf: Some(backend),
        })
    };
    match choice {
        BackendChoice::Iptables => Ok((
            chosen(rules.iptables()?),
            "forced by --backend iptables".into(),
            None,
        )),
        BackendChoice::Nftables => Ok((
            chosen(rules.nftables()?),
            "forced by --backend nftables".into(),
            None,
        )),
        BackendChoice::Ebpf => Ok((open_ebpf(ebpf)?, "forced by --backend ebpf".into(), None)),
        BackendChoice::Auto => {
            let report = probe::run();
            if report.ok() {
                let reason = "auto: the kernel passed every probe".to_owned();
                return Ok((open_ebpf(ebpf)?, reason, Some(report)));
            }
            let reason = format!(
                "auto: the kernel cannot run the eBPF backend ({})",
                report.failures()
            );
            let backend = rules.open()?;
            warn!(%reason, backend = backend.name(), "using Istio's rules");
            Ok((chosen(backend), reason, Some(report)))
        }
    }
}

/// What captures ambient pods now, and what an earlier agent may have captured them with (the
/// other way, `ambient.inKernel` switched since): the kernel programs where `in_kernel` asks
/// for them and `kernel`, the eBPF backend, serves the node, else Istio's in-pod rules through
/// the rules path's machinery (iptables, or nftables with `global.nativeNftables`), in its
/// state directory (`<state dir>/ambient`).
pub(crate) fn ambient_ways(
    kernel: Option<Arc<EbpfBackend>>,
    in_kernel: bool,
    in_pod: &RulesPath,
) -> Result<(Shared, Option<Shared>), BackendError> {
    let in_pod_rules = || in_pod.open();
    Ok(match kernel {
        Some(ebpf) if in_kernel => (ebpf, Some(in_pod_rules()?)),
        Some(ebpf) => (in_pod_rules()?, Some(ebpf)),
        None => (in_pod_rules()?, None),
    })
}
