//! meshcap-agent: the node daemon that captures the traffic of pods in Istio's mesh, sidecar
//! pods for their Envoy and ambient pods for ztunnel, in the kernel (eBPF) or with Istio's own
//! rules.
//!
//! Istio's semantics are not here: the pod's decision, its sidecar's policy or ambient mode's
//! in-pod policy, Istio's exact rules and an evaluator of them are the pure crate
//! `meshcap-policy` (policy/), which every module may use.
//!
//! Layout, one concern per module:
//! - [`access`]: what the agent and the plugin may do in the cluster, checked at start
//!   against what the enabled features ask, and the watches the API server refuses;
//! - [`ambient`]: ambient mode's own: ztunnel's hand-over, the node's probe sets, the pod's
//!   annotation and the workload records, around the backend that captures ambient pods;
//! - [`api`]: the ways in: the plugin socket (root only, one bounded request per connection;
//!   the only place the plugin's protocol is read and written; the plugin's log lines logged)
//!   and the health, readiness and metrics endpoints, on Istio's ports;
//! - [`backend`]: the capture backends (`ebpf`, pinned kernel programs; `iptables`, Istio's
//!   rules) behind one interface for both modes, and the router that sends each mode to the
//!   backend chosen to serve it;
//! - [`bpf`]: the embedded kernel programs and how they are loaded;
//! - [`cgroup`]: finding the cgroup v2 hierarchy the programs attach to;
//! - [`connectivity`]: `connectivity-test`, an operator's check of their cluster with pods of
//!   Istio's injected shape and not, and `probe-pod`, the workload those pods run;
//! - [`crashpoint`]: named points where the crash-consistency tests have the agent die;
//! - [`decide`]: a pod's decision without the agent, for the plugin while the agent is down;
//! - [`enrollment`]: ambient mode's live enrollment: running pods join and leave as their
//!   labels and their namespace's change;
//! - [`events`]: Kubernetes Events on pods whose capture failed;
//! - [`hub`]: what the agent does with a pod, whoever asks (the plugin, the repair controller,
//!   live enrollment): the request path, readiness, the set of captures, and the verifier's
//!   passes over them;
//! - [`install`]: the plugin binary and its chained CNI configuration on the node, kept in place;
//! - [`instance`]: one agent at a time per state directory (an exclusive lock);
//! - [`ipset`]: the kernel's IP sets over nfnetlink (ambient mode's probe set on the node);
//! - [`logging`]: `tracing` set-up, with aya-log and `log` records bridged in; JSON lines with
//!   Istio's keys;
//! - [`mountinfo`]: the process's mounts (the cgroup v2 hierarchy, bind-mounted netns);
//! - [`paths`]: where things are on the node by default (the DaemonSet mounts exactly these);
//! - [`pending`]: live enrollments that failed, tried again with backoff until done;
//! - [`pod`]: which pod a capture is: its name and sandbox, what a capture is asked for, the
//!   ids of captures made in place;
//! - [`podnet`]: everything done inside a pod's network namespace (a visit: entering it, its
//!   cookie, interfaces and addresses, its netlink socket; routes; TC filters), and finding a
//!   running pod's namespace by its address;
//! - [`pods`]: pod sources (Kubernetes API watch, manifest directory);
//! - [`privilege`]: which capability a refused operation lacks (an `EPERM` named), and what
//!   every backend needs, checked at start;
//! - [`probe`]: can this kernel run the eBPF backend;
//! - [`repair`]: Istio's repair controller, for pods that started before their capture;
//! - [`sched`]: a short scheduler slice, so that a busy node's pods do not delay an ADD;
//! - [`settings`]: the ConfigMap's settings and the environment variables carrying them;
//! - [`status`]: the status report and metrics (Istio's node agent's, `process_*`, meshcap's);
//! - [`taint`]: the startup taint, removed from this node once the agent is ready;
//! - [`takeover`]: istio-cni's sidecar captures on this node made the agent's at start, and
//!   reading the node's pods for both that and ambient mode's adoption from the pod watch's
//!   first list;
//! - [`uninstall`]: a real uninstall, by hand or when meshcap is deleted from the cluster, and
//!   how the agent tells that apart from a restart ([`uninstall::verdict`]);
//! - [`verify`]: what the verifier (the hub's passes: every capture compared with its record
//!   periodically, drift put back) found, and `explain`'s answer;
//! - [`ztunnel`]: ZDS, the socket on which ambient pods are handed to ztunnel.
//!
//! An ADD, end to end: `meshcap-cni` sends it over the socket ([`api`]), which hands the hub
//! a [`pod::Sandbox`]. The [`hub`] looks the pod up ([`pods`]), asks [`meshcap_policy::decide`] what
//! happens to it, and gives the policy to the [`backend::Router`], on the request's own worker
//! thread (`block_in_place`). The router sends a sidecar pod to the node's backend and an
//! ambient pod to [`ambient`], which records it, has its backend capture it and hands it to
//! ztunnel. The eBPF backend ([`backend::ebpf`]) captures a pod in one transaction: one visit
//! to its network namespace ([`podnet::run_in`]) observes it (cookie, interfaces, addresses),
//! plans its map entries and attaches its inbound TC stub, then it writes the pod's lists and,
//! last, its `MESHCAP_PODS` entry, which makes the node-wide programs act on it. The iptables
//! backend renders Istio's rules ([`meshcap_policy::RedirectPolicy::render`]) and restores them
//! in the same kind of visit. docs/development.md maps where each decision and each record
//! lives. Dependencies point one way: api → hub → ambient → backend → podnet and pod, and down
//! to `meshcap-policy`; every module's layer is in docs/development.md ("Layers"), which
//! `agent/tests/layering.rs` holds the imports to.

pub mod access;
pub mod ambient;
pub mod api;
pub mod backend;
pub mod bpf;
pub mod cgroup;
pub mod connectivity;
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
pub mod pending;
pub mod pod;
pub mod podnet;
pub mod pods;
pub mod privilege;
pub mod probe;
pub mod repair;
pub mod sched;
pub mod settings;
pub mod status;
pub mod taint;
pub mod takeover;
pub mod uninstall;
pub mod verify;
pub mod ztunnel;
