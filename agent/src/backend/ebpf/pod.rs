//! Each pod's lifecycle in the eBPF backend: capture (ADD, and updates), check, release (DEL).
//!
//! ADD visits the pod's netns once: learns its cookie, interfaces, addresses (and routes for
//! `excludeInterfaces`), installs the policy route where TPROXY or rerouted interfaces need
//! it, and attaches the pod's stub on every interface (and, where `bpf_sk_assign` refuses
//! `SO_REUSEPORT` listeners, the socket lookup program on its netns); then writes the pod's
//! lists and interface flags, and last its `MESHCAP_PODS` entry, which is what makes the
//! programs act: a pod is captured in full or not at all.
use std::os::fd::AsFd as _;

use meshcap_common::{PodConfig, flags};

use super::{EbpfBackend, EbpfError, Entries, encode, node, pins, stub, sys, tc};
use crate::{
    backend::PodRef,
    crashpoint,
    podnet::{self, PodNet, Visit},
    policy::{MarkRoute, PolicyRoutes, RedirectPolicy, ambient::InpodPolicy},
};

/// The capacity of `MESHCAP_PODS` (ebpf/meshcap-ebpf/src/tables.rs).
const MAX_PODS: usize = 1_024;

impl EbpfBackend {
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

    /// Captures an ambient `pod` for ztunnel as Istio's in-pod rules would (`ips`: its
    /// addresses, the local address of its redirected connections), or updates it. Idempotent.
    ///
    /// # Errors
    /// When the pod's netns cannot be entered or the kernel refuses.
    pub fn add_ambient(
        &self,
        pod: &PodRef,
        policy: &InpodPolicy,
        ips: &[std::net::IpAddr],
    ) -> Result<(), EbpfError> {
        self.add_entries(
            pod,
            encode::encode_ambient(policy, ips),
            &[],
            &policy.virtual_interfaces,
        )
    }

    /// Verifies an ambient `pod` is captured with `policy`.
    ///
    /// # Errors
    /// What is missing or different, naming the pod.
    pub fn check_ambient(&self, pod: &PodRef, policy: &InpodPolicy) -> Result<(), EbpfError> {
        self.check_entries(pod, &encode::encode_ambient(policy, &[]))
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
        let ipv6 = entries.config.has(flags::IPV6);
        let tproxy = entries.config.has(flags::TPROXY);
        let ambient = entries.config.has(flags::AMBIENT);
        let reroute = !reroute_interfaces.is_empty();
        let record = pins::pod_record_name(pod);
        let known = self.lock().cookie(&record).is_some();
        let inside = podnet::run_in(&pod.netns, |visit| -> Result<PodNet, EbpfError> {
            let net = podnet::inspect(visit, !exclude_interfaces.is_empty())?;
            let pinned = self.pins.pod_record(net.cookie, pod);
            std::fs::create_dir_all(&pinned)
                .map_err(|e| EbpfError::io(&format!("creating {}", pinned.display()), e))?;
            if ambient {
                let marker = self.pins.ambient_marker(net.cookie);
                std::fs::create_dir_all(&marker)
                    .map_err(|e| EbpfError::io(&format!("creating {}", marker.display()), e))?;
            }
            crashpoint::here(crashpoint::EBPF_ADD_PINNED);
            // `::6` on lo (Envoy's IPv6 passthrough source) and, for TPROXY mode and rerouted
            // interfaces, the policy route, as Istio installs them.
            // In ambient mode: Istio's in-pod reply route, which rerouted interfaces share.
            let mut routes = if ipv6 && !ambient {
                PolicyRoutes::passthrough6()
            } else {
                PolicyRoutes::default()
            };
            if ambient {
                routes.mark_route = Some(MarkRoute::ambient(ipv6));
            } else if tproxy || reroute {
                routes.mark_route = Some(MarkRoute::tproxy(ipv6));
            }
            if !routes.is_empty() {
                podnet::route::update(visit.netlink()?, &PolicyRoutes::default(), &routes)?;
            }
            // Accepted sockets inherit the SYN's mark, so that the app's replies to the
            // original client source reach the proxy's transparent socket (in ambient mode,
            // the mark the classifier on `lo` gives ztunnel's SYNs). Rerouted interfaces need
            // only the route: their packets are marked by the TC program, and the proxy's
            // sockets must not inherit that mark.
            self.set_fwmark_accept(net.cookie, tproxy || ambient)?;
            self.attach_stubs(visit, &net, exclude_interfaces, ambient)?;
            self.attach_handoff(net.cookie)?;
            crashpoint::here(crashpoint::EBPF_ADD_ATTACHED);
            Ok(net)
        });
        let net = match inside {
            Ok(Ok(net)) => net,
            Ok(Err(err)) => {
                // Nothing half-applied: a pod this agent did not capture yet loses what this
                // ADD attached (an update keeps its capture as it was).
                if !known && let Err(undo) = self.remove(pod) {
                    tracing::warn!(error = %undo, "undoing a failed ADD");
                }
                return Err(err);
            }
            Err(err) => return Err(err.into()),
        };
        entries.add_pod_net(&net, exclude_interfaces, reroute_interfaces);
        entries.config.flags |= self.handoff_flags();
        let config = entries.config;
        let cookie = net.cookie;
        let mut tables = self.lock();
        tables.set_cookie(record, cookie);
        let old = tables.current_id(cookie);
        let pod_id = tables.allocate_id();
        let written = tables
            .write_lists(pod_id, &entries)
            .and_then(|()| {
                crashpoint::here(crashpoint::EBPF_ADD_LISTS);
                tables.write_ifaces(cookie, &net, &entries)
            })
            .and_then(|()| tables.set_addrs(cookie, entries.addrs))
            .and_then(|()| {
                crashpoint::here(crashpoint::EBPF_ADD_IFACES);
                tables.set_pod(cookie, PodConfig { pod_id, ..config })
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
            tables.remove_lists(old);
        }
        tracing::info!(netns_cookie = cookie, pod_id, "captured");
        Ok(())
    }

    /// Attaches the pod's stub on every interface but the excluded ones (and on `lo` for an
    /// ambient pod, where ztunnel's connections to the app are told apart), in the visited
    /// netns. An interface whose record the kernel confirms is attached already (by this
    /// agent or the one before it): never twice. A record the kernel contradicts (the filter
    /// deleted behind meshcap's back, the TCX link's interface replaced) is dropped and the
    /// stub attached afresh.
    fn attach_stubs(
        &self,
        visit: &mut Visit,
        net: &PodNet,
        exclude_interfaces: &[String],
        ambient: bool,
    ) -> Result<(), EbpfError> {
        let lo = (tc::LOOPBACK_IFINDEX, "lo".to_owned());
        let mut todo = Vec::new();
        for (ifindex, name) in net.interfaces.iter().chain(ambient.then_some(&lo)) {
            if exclude_interfaces.contains(name) {
                continue;
            }
            let record = self.pins.tc_record(net.cookie, name);
            if record.exists() {
                let Err(stale) = tc::verify(visit, name, &record) else {
                    continue;
                };
                tracing::warn!(interface = %name, reason = %stale, "re-attaching the inbound TC stub");
                tc::detach(visit, name, &record);
            }
            todo.push((*ifindex, name));
        }
        if todo.is_empty() {
            return Ok(());
        }
        // One stub per pod, shared by its interfaces; `lo` (ambient) gets a stub of its own,
        // which tail-calls only for ztunnel's packets.
        let mut stubs = (None, None);
        for (ifindex, name) in todo {
            let stub = if ifindex == tc::LOOPBACK_IFINDEX {
                if stubs.1.is_none() {
                    stubs.1 = Some(stub::load_lo(&self.tc_prog)?);
                }
                stubs.1.as_ref()
            } else {
                if stubs.0.is_none() {
                    stubs.0 = Some(stub::load(net.cookie, &self.tc_prog)?);
                }
                stubs.0.as_ref()
            };
            let Some(stub) = stub else {
                continue;
            };
            let record = self.pins.tc_record(net.cookie, name);
            tc::attach(
                visit,
                self.config.tc_attach,
                stub.as_fd(),
                ifindex,
                name,
                &record,
            )?;
        }
        Ok(())
    }

    /// Sets the visited netns' `net.ipv4.tcp_fwmark_accept` to 1 when `on`, first recording the
    /// pod's own value in the pins; otherwise puts a recorded value back (an update that needs
    /// it no more). Released pods get theirs back in [`Self::remove`].
    fn set_fwmark_accept(&self, cookie: u64, on: bool) -> Result<(), EbpfError> {
        let before = self.pins.fwmark_accept_before(cookie);
        if !on {
            if let Some(value) = before {
                restore_fwmark_accept(value);
                pins::remove_tree(&self.pins.fwmark_accept_record(cookie, value));
            }
            return Ok(());
        }
        if before.is_none() {
            let current = std::fs::read_to_string(FWMARK_ACCEPT)
                .map_err(|e| EbpfError::io("reading net.ipv4.tcp_fwmark_accept", e))?;
            let value = current.trim().parse().map_err(|_| {
                EbpfError::io(
                    "reading net.ipv4.tcp_fwmark_accept",
                    std::io::Error::other(format!("not a number: {current:?}")),
                )
            })?;
            let record = self.pins.fwmark_accept_record(cookie, value);
            std::fs::create_dir_all(&record)
                .map_err(|e| EbpfError::io(&format!("creating {}", record.display()), e))?;
        }
        std::fs::write(FWMARK_ACCEPT, "1")
            .map_err(|e| EbpfError::io("net.ipv4.tcp_fwmark_accept", e))
    }

    /// Attaches the socket lookup program to the visited netns, where this kernel needs it
    /// (ebpf/meshcap-ebpf/src/handoff.rs), unless its pinned link is there already.
    fn attach_handoff(&self, cookie: u64) -> Result<(), EbpfError> {
        let Some(prog) = &self.handoff else {
            return Ok(());
        };
        let pin = self.pins.handoff_link(cookie);
        if sys::obj_get(&pin).is_ok() {
            return Ok(());
        }
        let netns = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| EbpfError::io("opening the pod's netns", e))?;
        let link = sys::sk_lookup_link_create(prog, &netns)
            .map_err(|e| EbpfError::io("attaching the socket lookup program", e))?;
        sys::obj_pin(&link, &pin)
            .map_err(|e| EbpfError::io(&format!("pinning {}", pin.display()), e))
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
        // Every ADD pins the pod's directory before it touches the netns or the maps: with
        // neither, nothing was ever captured here (a pod outside the mesh), and the netns is
        // left alone.
        if !self.pins.pod(cookie).exists() && !self.lock().has_pod(cookie) {
            tracing::debug!(netns_cookie = cookie, "nothing captured in this netns");
            return Ok(());
        }
        // The policy routes the pod may have: TPROXY's (TPROXY mode or a rerouted interface)
        // and ambient mode's; only those (or both when nothing says) are looked for, and `lo`'s
        // stub only on an ambient pod (or when nothing says).
        let (routes, ambient) = {
            let mut tables = self.lock();
            let config = tables.remove_pod(cookie)?;
            crashpoint::here(crashpoint::EBPF_REMOVE_ENTRY);
            let rerouted = tables.remove_ifaces(cookie);
            tables.forget_cookie(cookie);
            let ambient = config.is_none_or(|c| c.has(flags::AMBIENT));
            let tproxy = config.is_none_or(|c| c.has(flags::TPROXY)) || (rerouted && !ambient);
            (
                [
                    tproxy.then(|| MarkRoute::tproxy(true)),
                    ambient.then(|| MarkRoute::ambient(true)),
                ],
                ambient,
            )
        };
        let records = self.pins.tc_records(cookie);
        let fwmark_accept = self.pins.fwmark_accept_before(cookie);
        let detached = podnet::run_in(&pod.netns, |visit| {
            if let Some(value) = fwmark_accept {
                restore_fwmark_accept(value);
            }
            for (ifname, record) in &records {
                tc::detach(visit, ifname, record);
            }
            tc::detach_unrecorded(visit, &records, ambient);
            for route in routes.iter().flatten() {
                let installed = PolicyRoutes {
                    mark_route: Some(route.clone()),
                    loopback_addresses: Vec::new(),
                };
                let removed = visit.netlink().and_then(|netlink| {
                    podnet::route::update(netlink, &installed, &PolicyRoutes::default())
                });
                if let Err(err) = removed {
                    tracing::warn!(error = %err, rule = route.describe_rule(), "removing a policy route");
                }
            }
        });
        if detached.is_err() {
            // The netns is gone, and its devices with it: only the pins are left.
            for (_, record) in &records {
                let _ = pins::unpin_link(record);
            }
        }
        crashpoint::here(crashpoint::EBPF_REMOVE_DETACHED);
        pins::remove_tree(&self.pins.pod(cookie));
        tracing::info!(netns_cookie = cookie, "released");
        Ok(())
    }

    /// Verifies `pod` is captured with exactly these entries' configuration and its TC
    /// programs are attached.
    ///
    /// # Errors
    /// What is missing or different.
    pub fn check_entries(&self, pod: &PodRef, entries: &Entries) -> Result<(), EbpfError> {
        let cookie = podnet::cookie_of(&pod.netns)?;
        let config = self
            .lock()
            .pods
            .get(&cookie, 0)
            .map_err(|_| EbpfError::pod(pod, "not captured: no entry for its netns"))?;
        let handoff = self.handoff_flags();
        // What the pod's netns adds is not in `entries`.
        let from_netns = flags::EXCLUDED_ROUTES | flags::LOCAL4_IS_POD_ADDR;
        let want = (entries.config.flags | handoff) & !from_netns;
        if config.flags & !from_netns != want
            || config.proxy_uid != entries.config.proxy_uid
            || config.proxy_gid != entries.config.proxy_gid
        {
            return Err(EbpfError::pod(
                pod,
                format!("captured with a different configuration: {config:?}"),
            ));
        }
        if let Some(differ) = self.lock().lists_differ(config.pod_id, entries) {
            return Err(EbpfError::pod(pod, format!("captured, but {differ}")));
        }
        node::check_cgroup_links(&self.pins).map_err(|message| EbpfError::pod(pod, message))?;
        let records = self.pins.tc_records(cookie);
        if records.is_empty() {
            return Err(EbpfError::pod(pod, "no inbound TC program attached"));
        }
        if handoff != 0 && sys::obj_get(&self.pins.handoff_link(cookie)).is_err() {
            return Err(EbpfError::pod(
                pod,
                "no socket lookup program on its netns (inbound to a SO_REUSEPORT proxy listener would be dropped)",
            ));
        }
        podnet::run_in(&pod.netns, |visit| {
            records
                .iter()
                .try_for_each(|(ifname, record)| tc::verify(visit, ifname, record))
        })?
        .map_err(|message| EbpfError::pod(pod, message))
    }

    /// The pod's cookie: as the pins record it (indexed), else from its netns while it
    /// exists.
    pub(super) fn find_cookie(&self, pod: &PodRef) -> Option<u64> {
        self.lock()
            .cookie(&pins::pod_record_name(pod))
            .or_else(|| podnet::cookie_of(&pod.netns).ok())
    }
}

/// The sysctl `tcp_fwmark_accept` of the calling thread's netns.
const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";

/// Puts the pod's own `tcp_fwmark_accept` back (in the visited netns). A failure leaves 1,
/// which nothing in a released pod relies on: logged, never fatal.
fn restore_fwmark_accept(value: u8) {
    if let Err(err) = std::fs::write(FWMARK_ACCEPT, value.to_string()) {
        tracing::warn!(error = %err, value, "restoring net.ipv4.tcp_fwmark_accept");
    }
}
