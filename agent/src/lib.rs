//! meshcap-agent: the node daemon that captures sidecar pods' traffic.
//!
//! Layout, one concern per module:
//! - [`ambient`]: ambient mode: an enrolled pod's in-pod rules and its hand-over to ztunnel;
//! - [`api`]: the ways in: the plugin socket (root only, one bounded request per connection)
//!   and the health, readiness and metrics endpoint;
//! - [`backend`]: the capture backends (`ebpf`, pinned kernel programs; `iptables`) behind
//!   one trait;
//! - [`bpf`]: the embedded kernel programs and how they are loaded;
//! - [`cgroup`]: finding the cgroup v2 hierarchy the programs attach to;
//! - [`crashpoint`]: named points where the crash-consistency tests have the agent die;
//! - [`decide`]: a pod's decision without the agent, for the plugin while the agent is down;
//! - [`enrollment`]: ambient mode's live enrollment: running pods join and leave as their
//!   labels and their namespace's change;
//! - [`events`]: Kubernetes Events on pods whose capture failed;
//! - [`hub`]: what the agent does with a pod, whoever asks: lookup → decision → capture;
//! - [`install`]: the plugin binary and its chained CNI configuration on the node, kept in place;
//! - [`instance`]: one agent at a time per state directory (an exclusive lock);
//! - [`ipset`]: the kernel's IP sets over nfnetlink (ambient mode's probe set on the node);
//! - [`logging`]: `tracing` set-up, with aya-log and `log` records bridged in;
//! - [`mountinfo`]: the process's mounts (the cgroup v2 hierarchy, bind-mounted netns);
//! - [`paths`]: where things are on the node by default (the DaemonSet mounts exactly these);
//! - [`pod`]: who a pod is: its name, and the sandbox a capture is keyed by;
//! - [`podnet`]: everything done inside a pod's network namespace (entering it, its cookie,
//!   interfaces and addresses, routes, TC filters), over one netlink socket per visit, and
//!   finding a running pod's namespace by its address;
//! - [`pods`]: pod sources (Kubernetes API watch, manifest directory);
//! - [`policy`]: pod → capture decision and [`policy::RedirectPolicy`], Istio's semantics, its
//!   iptables rendering and an evaluator of the rendered rules;
//! - [`probe`]: can this kernel run the eBPF backend;
//! - [`repair`]: Istio's repair controller, for pods that started before their capture;
//! - [`sched`]: a short scheduler slice, so that a busy node's pods do not delay an ADD;
//! - [`settings`]: the ConfigMap's settings and the environment variables carrying them;
//! - [`status`]: the status report and metrics;
//! - [`taint`]: the startup taint, removed from this node once the agent is ready;
//! - [`uninstall`]: a real uninstall, by hand or when meshcap's DaemonSet is deleted;
//! - [`verify`]: every capture compared with its record periodically, drift put back, and
//!   `explain`;
//! - [`ztunnel`]: ZDS, the socket on which ambient pods are handed to ztunnel.
//!
//! An ADD, end to end: `meshcap-cni` sends it over the socket ([`api`]); [`capture`] looks the
//! pod up ([`pods`]), asks [`policy::select`] whether and how Istio would capture it, and hands
//! the [`policy::RedirectPolicy`] to the backend, run by the request's own worker thread
//! (`block_in_place`). The eBPF backend ([`backend::ebpf`]) encodes the policy into map
//! entries, visits the pod's network namespace once ([`podnet::run_in`]) to learn its cookie,
//! interfaces and routes and attach its inbound TC stub, then writes the pod's lists and,
//! last, its `MESHCAP_PODS` entry, which makes the node-wide programs act on it. The iptables
//! backend renders Istio's rules ([`policy::RedirectPolicy::render`]) and restores them in the
//! same kind of visit.
//! Dependencies point one way: api → capture → backend → podnet and policy.

pub mod ambient;
pub mod api;
pub mod backend;
pub mod bpf;
pub mod cgroup;
pub mod crashpoint;
pub mod decide;
pub mod enrollment;
pub mod events;
pub mod hub;
pub mod install;
pub mod instance;
pub mod ipset;
pub mod logging;
pub mod mountinfo;
pub mod paths;
pub mod pod;
pub mod podnet;
pub mod pods;
pub mod policy;
pub mod probe;
pub mod repair;
pub mod sched;
pub mod settings;
pub mod status;
pub mod taint;
pub mod uninstall;
pub mod verify;
pub mod ztunnel;
