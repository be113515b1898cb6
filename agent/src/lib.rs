//! meshcap-agent: the node daemon that captures sidecar pods' traffic.
//!
//! Layout, one concern per module:
//! - [`bpf`]: the embedded kernel programs and how they are loaded;
//! - [`cgroup`]: finding the cgroup v2 hierarchy the programs attach to;
//! - [`install`]: the plugin binary and its chained CNI configuration on the node, kept in place;
//! - [`logging`]: `tracing` set-up, with aya-log and `log` records bridged in;
//! - [`netns`]: entering a pod's network namespace and learning its cookie;
//! - [`paths`]: where things are on the node by default (the DaemonSet mounts exactly these);
//! - [`settings`]: the ConfigMap's settings and the environment variables carrying them;
//! - [`taint`]: the startup taint, removed from this node once the agent is ready.

pub mod bpf;
pub mod cgroup;
pub mod install;
pub mod logging;
pub mod netns;
pub mod paths;
pub mod settings;
pub mod taint;
