//! The decision for a pod when the agent is unreachable (not running: a crash loop, an image
//! pull failure, an eviction). A pod outside the mesh must still start; one in it must not
//! start uncaptured. The agent installs a copy of itself beside the plugin, and the plugin runs
//! `meshcap-agent decide`, which looks the pod up once (the API server with the kubeconfig the
//! agent wrote, or the manifest directory in standalone mode) and applies the same selection as
//! the agent: one selection function, and no Kubernetes client in the plugin.
use std::{
    io::{self, Read as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::{cni::PluginConfig, protocol::PodAttachment};

/// The agent's binary beside the plugin (`install::DECIDER_BINARY` in the agent).
pub const DECIDER_BINARY: &str = "meshcap-agent";

/// How long the decision may take: `decide` itself gives the API server 2 s to connect and
/// 5 s to answer.
const DECIDE_TIMEOUT: Duration = Duration::from_secs(10);

/// What `meshcap-agent decide` prints.
#[derive(Debug, Deserialize)]
pub struct Decision {
    /// The pod must be captured.
    pub capture: bool,
    /// Why.
    pub reason: String,
}

/// Where to decide from, if the configuration says.
fn source_args(conf: &PluginConfig) -> Option<Vec<String>> {
    match (&conf.kubeconfig, &conf.pod_dir) {
        (Some(path), _) => Some(vec!["--kubeconfig".into(), path.display().to_string()]),
        (None, Some(dir)) => Some(vec!["--pod-dir".into(), dir.display().to_string()]),
        (None, None) => None,
    }
}

/// The decider beside `plugin` (this executable).
fn decider(plugin: &Path) -> PathBuf {
    plugin.with_file_name(DECIDER_BINARY)
}

/// Why no decision could be made without the agent (the plugin then fails closed).
#[derive(Debug, thiserror::Error)]
pub enum FallbackError {
    /// The plugin's own executable cannot be found, so neither can the decider beside it.
    #[error("locating meshcap-cni: {0}")]
    Locate(#[source] io::Error),
    /// The decider could not be started.
    #[error("running {}: {source}", decider.display())]
    Run {
        /// The decider's path.
        decider: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Waiting for the decider failed.
    #[error("waiting for {}: {source}", decider.display())]
    Wait {
        /// The decider's path.
        decider: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The decider did not answer in time (it was killed).
    #[error("{} decide did not answer within {DECIDE_TIMEOUT:?}", decider.display())]
    Timeout {
        /// The decider's path.
        decider: PathBuf,
    },
    /// The decider failed, with the last line of its error output.
    #[error("{} decide: {reason}", decider.display())]
    Failed {
        /// The decider's path.
        decider: PathBuf,
        /// The last line it wrote on stderr.
        reason: String,
    },
    /// The decider's answer is not a decision.
    #[error("{} decide answered {answer:?}: {source}", decider.display())]
    Answer {
        /// The decider's path.
        decider: PathBuf,
        /// What it printed.
        answer: String,
        /// Why it is not a decision.
        #[source]
        source: serde_json::Error,
    },
}

/// Decides `pod` without the agent. `Ok(None)`: the configuration names no source (every pod
/// not excluded here fails closed, as before).
///
/// # Errors
/// Why no decision could be made: the caller fails closed.
pub fn decide(conf: &PluginConfig, pod: &PodAttachment) -> Result<Option<Decision>, FallbackError> {
    let Some(source) = source_args(conf) else {
        return Ok(None);
    };
    let exe = std::env::current_exe().map_err(FallbackError::Locate)?;
    let decider = decider(&exe);
    let mut cmd = Command::new(&decider);
    cmd.args(["decide", "--namespace", &pod.namespace, "--name", &pod.name])
        .args(source)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(uid) = &pod.uid {
        cmd.args(["--uid", uid]);
    }
    for ip in &pod.ips {
        cmd.arg("--ip").arg(ip.to_string());
    }
    for ns in &conf.exclude_namespaces {
        cmd.args(["--exclude-namespace", ns]);
    }
    if conf.ambient_enabled {
        cmd.arg("--ambient");
        if let Some(selectors) = &conf.enablement_selectors {
            cmd.args(["--enablement-selectors", &selectors.to_string()]);
        }
    }
    let mut child = cmd.spawn().map_err(|source| FallbackError::Run {
        decider: decider.clone(),
        source,
    })?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < DECIDE_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(None) => {
                // Our own child, by its handle.
                let _ = child.kill();
                let _ = child.wait();
                return Err(FallbackError::Timeout { decider });
            }
            Err(source) => return Err(FallbackError::Wait { decider, source }),
        }
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut stdout);
    }
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    if !status.success() {
        return Err(FallbackError::Failed {
            decider,
            reason: stderr.trim().lines().last().unwrap_or("failed").to_owned(),
        });
    }
    serde_json::from_str(stdout.trim())
        .map(Some)
        .map_err(|source| FallbackError::Answer {
            decider,
            answer: stdout,
            source,
        })
}
