//! One invocation of the plugin: environment + stdin in, stdout + exit status out.
//!
//! Decisions that must not depend on the agent are made here: pods that are not Kubernetes
//! pods, meshcap's own pods and pods in excluded namespaces pass through untouched. Every
//! other pod is sent to the agent, and any failure to capture it fails the command (fail
//! closed: kubelet retries the sandbox rather than start it uncaptured).
//!
//! - `command`: what each command does, and which pods pass through without the agent;
//! - `agent`: asking the agent, and deciding without it when it is not listening.
use std::io::Write;

use serde_json::Value;

use crate::{
    cni::{self, CniError, Command, Invocation, LATEST_VERSION, LogLevel, NetConf},
    protocol::{self, LogLine, Op, PodAttachment, Reply, Request},
};

mod agent;
mod command;
#[cfg(test)]
mod tests;

use command::execute;

/// What the runtime gets back.
#[derive(Debug, PartialEq)]
pub struct Output {
    /// The JSON to print on stdout, if any.
    pub stdout: Option<Value>,
    /// Whether the command succeeded (exit status 0).
    pub success: bool,
}

impl Output {
    fn ok(stdout: Option<Value>) -> Self {
        Self {
            stdout,
            success: true,
        }
    }

    fn error(err: &CniError, version: &str) -> Self {
        Self {
            stdout: Some(err.to_json(version)),
            success: false,
        }
    }
}

/// Leveled log lines of one command: sent to the agent, which writes them into its own log
/// with the pod (as Istio's plugin sends its log to its agent, `cni/pkg/plugin/plugin.go`), or
/// written on stderr, where runtimes keep them, when no agent takes them.
struct Log<'a> {
    level: LogLevel,
    out: &'a mut dyn Write,
    pod: String,
    context: String,
    lines: Vec<LogLine>,
}

impl Log<'_> {
    fn at(&mut self, level: LogLevel, msg: &str) {
        if level <= self.level {
            let unix_micros = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
            self.lines.push(LogLine {
                level: format!("{level:?}").to_lowercase(),
                unix_micros,
                msg: msg.to_owned(),
            });
        }
    }

    /// Hands the lines to the agent; on stderr when it does not take them.
    fn deliver(self, conf: &NetConf) {
        if self.lines.is_empty() {
            return;
        }
        let request = Request::new(Op::Log {
            pod: self.pod,
            lines: self.lines,
        });
        // The agent answers at once or is away: the command waits no longer for its log.
        let timeout = conf
            .meshcap
            .timeout()
            .min(std::time::Duration::from_secs(2));
        if let Ok(response) = protocol::call(&conf.meshcap.agent_socket, &request, timeout)
            && matches!(response.reply, Reply::Ok { .. })
        {
            return;
        }
        let Op::Log { lines, .. } = request.op else {
            return;
        };
        for line in lines {
            // A log line that cannot be written must not fail the command.
            let _ = writeln!(
                self.out,
                "meshcap-cni {}{}: {}",
                line.level, self.context, line.msg
            );
        }
    }
}

/// Runs one CNI command. `env` reads an environment variable, `stdin` is the configuration and
/// `stderr` receives log lines.
pub fn run(env: impl Fn(&str) -> Option<String>, stdin: &[u8], stderr: &mut dyn Write) -> Output {
    let invocation = match Invocation::from_env(&env) {
        Ok(inv) => inv,
        Err(err) => {
            let version =
                NetConf::parse(stdin).map_or_else(|_| LATEST_VERSION.to_owned(), |c| c.cni_version);
            return Output::error(&err, &version);
        }
    };
    if invocation.command == Command::Version {
        return Output::ok(Some(version_info(stdin)));
    }
    let conf = match NetConf::parse(stdin) {
        Ok(conf) => conf,
        Err(err) => return Output::error(&err, LATEST_VERSION),
    };
    let pod = PodAttachment {
        namespace: invocation.arg("K8S_POD_NAMESPACE").unwrap_or("").to_owned(),
        name: invocation.arg("K8S_POD_NAME").unwrap_or("").to_owned(),
        uid: invocation.arg("K8S_POD_UID").map(str::to_owned),
        container_id: invocation.container_id.clone(),
        netns: invocation.netns.clone(),
        ifname: invocation.ifname.clone(),
        ips: conf
            .prev_result
            .as_ref()
            .map(cni::result_ips)
            .unwrap_or_default(),
    };
    let mut log = Log {
        level: conf.meshcap.log_level,
        out: stderr,
        pod: if pod.name.is_empty() {
            String::new()
        } else {
            format!("{}/{}", pod.namespace, pod.name)
        },
        lines: Vec::new(),
        context: if pod.name.is_empty() {
            String::new()
        } else {
            format!(
                " pod={}/{} container={}",
                pod.namespace, pod.name, pod.container_id
            )
        },
    };
    let output = match execute(&invocation, &conf, pod, &mut log) {
        Ok(stdout) => Output::ok(stdout),
        Err(err) => {
            log.at(
                LogLevel::Error,
                &format!("{:?} failed: {}", invocation.command, err.msg),
            );
            Output::error(&err, &conf.cni_version)
        }
    };
    log.deliver(&conf);
    output
}

/// The VERSION answer, in the version the caller asked about when it is one of ours.
#[must_use]
pub fn version_info(stdin: &[u8]) -> Value {
    let asked = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .filter(|v| cni::SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| LATEST_VERSION.to_owned());
    serde_json::json!({ "cniVersion": asked, "supportedVersions": cni::SUPPORTED_VERSIONS })
}
