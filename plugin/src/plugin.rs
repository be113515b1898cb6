//! One invocation of the plugin: environment + stdin in, stdout + exit status out.
//!
//! Decisions that must not depend on the agent are made here: pods that are not Kubernetes
//! pods, meshcap's own pods and pods in excluded namespaces pass through untouched. Every
//! other pod is sent to the agent, and any failure to capture it fails the command (fail
//! closed: kubelet retries the sandbox rather than start it uncaptured).
use std::io::Write;

use serde_json::Value;

use crate::{
    cni::{
        self, CniError, Command, Invocation, LATEST_VERSION, LogLevel, NetConf, code,
        convert_result,
    },
    fallback,
    protocol::{self, CallError, Op, PodAttachment, Reply, Request},
};

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

/// Leveled log lines on stderr, where runtimes keep them.
struct Log<'a> {
    level: LogLevel,
    out: &'a mut dyn Write,
    context: String,
}

impl Log<'_> {
    fn at(&mut self, level: LogLevel, msg: &str) {
        if level <= self.level {
            let name = format!("{level:?}").to_lowercase();
            // A log line that cannot be written must not fail the command.
            let _ = writeln!(self.out, "meshcap-cni {name}{}: {msg}", self.context);
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
        context: if pod.name.is_empty() {
            String::new()
        } else {
            format!(
                " pod={}/{} container={}",
                pod.namespace, pod.name, pod.container_id
            )
        },
    };
    match execute(&invocation, &conf, pod, &mut log) {
        Ok(stdout) => Output::ok(stdout),
        Err(err) => {
            log.at(
                LogLevel::Error,
                &format!("{:?} failed: {}", invocation.command, err.msg),
            );
            Output::error(&err, &conf.cni_version)
        }
    }
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

/// Why a pod is passed through without asking the agent, if it is.
fn local_skip(conf: &NetConf, pod: &PodAttachment) -> Option<String> {
    let cfg = &conf.meshcap;
    if pod.namespace.is_empty() || pod.name.is_empty() {
        return Some("not a Kubernetes pod (no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS)".into());
    }
    if pod.namespace == cfg.agent_pod_namespace
        && !cfg.agent_pod_prefix.is_empty()
        && pod.name.starts_with(&cfg.agent_pod_prefix)
    {
        return Some("meshcap's own pod".into());
    }
    if cfg.exclude_namespaces.contains(&pod.namespace) {
        return Some(format!(
            "namespace {} is in exclude_namespaces",
            pod.namespace
        ));
    }
    None
}

fn execute(
    invocation: &Invocation,
    conf: &NetConf,
    pod: PodAttachment,
    log: &mut Log<'_>,
) -> Result<Option<Value>, CniError> {
    let per_pod = matches!(
        invocation.command,
        Command::Add | Command::Del | Command::Check
    );
    if per_pod && let Some(reason) = local_skip(conf, &pod) {
        log.at(LogLevel::Info, &format!("passing through: {reason}"));
        return match invocation.command {
            Command::Add => convert_result(conf.prev_result.as_ref(), &conf.cni_version).map(Some),
            _ => Ok(None),
        };
    }
    match invocation.command {
        Command::Add => {
            // Convert first: a prevResult we cannot pass on must fail before anything is applied.
            let result = convert_result(conf.prev_result.as_ref(), &conf.cni_version)?;
            match ask(conf, Op::Add { pod: pod.clone() }) {
                Ok(message) => log.at(LogLevel::Info, &message),
                Err(Failure::NoAnswer(err @ CallError::Unreachable { .. })) => {
                    let reason = without_agent(conf, &pod, &err)?;
                    log.at(
                        LogLevel::Warn,
                        &format!("{err}; not captured without the agent: {reason}"),
                    );
                }
                Err(failure) => return Err(fail(failure, "ADD")),
            }
            Ok(Some(result))
        }
        Command::Del => match ask(conf, Op::Del { pod }) {
            Ok(message) => {
                log.at(LogLevel::Info, &message);
                Ok(None)
            }
            // DEL must not wedge pod teardown when the agent cannot answer, wherever the
            // conversation broke (not listening, reset or closed mid-request, no answer in
            // time): whatever capture state is left goes with the pod's network namespace, and
            // the agent reconciles with live pods when it starts.
            Err(Failure::NoAnswer(err)) => {
                log.at(
                    LogLevel::Warn,
                    &format!(
                        "{err}; DEL succeeds regardless: the capture goes with the pod's network \
                         namespace, and the agent drops what is left when it starts"
                    ),
                );
                Ok(None)
            }
            Err(Failure::Agent(err)) => Err(err),
        },
        Command::Check => ask_or_fail(conf, Op::Check { pod }).map(|message| {
            log.at(LogLevel::Info, &message);
            None
        }),
        Command::Status => ask_or_fail(conf, Op::Ping)
            .map(|_| None)
            .map_err(|err| CniError {
                code: code::NOT_AVAILABLE,
                ..err
            }),
        Command::Gc => {
            let valid_container_ids = conf
                .valid_attachments
                .iter()
                .map(|a| a.container_id.clone())
                .collect();
            ask_or_fail(
                conf,
                Op::Gc {
                    valid_container_ids,
                },
            )
            .map(|message| {
                log.at(LogLevel::Info, &message);
                None
            })
        }
        Command::Version => Ok(Some(version_info(&[]))),
    }
}

/// `details` of the error for an agent that is not listening.
const UNREACHABLE: &str = "agent unreachable";

/// Why a request got no answer to act on.
enum Failure {
    /// The agent answered with an error.
    Agent(CniError),
    /// The agent gave no answer: not listening, the exchange broke, or no answer in time.
    NoAnswer(CallError),
}

/// Sends one request; the agent's answer, or why there is none.
fn ask(conf: &NetConf, op: Op) -> Result<String, Failure> {
    let socket = &conf.meshcap.agent_socket;
    match protocol::call(socket, &Request::new(op), conf.meshcap.timeout()) {
        Ok(response) => match response.reply {
            Reply::Ok { message, .. } => Ok(message),
            Reply::Error { kind, msg, details } => Err(Failure::Agent(CniError {
                code: kind.cni_code(),
                msg,
                details,
            })),
        },
        Err(err) => Err(Failure::NoAnswer(err)),
    }
}

/// With the agent not listening: whether the pod may start without it (`Ok`, with why: the
/// mesh does not concern it), decided by `meshcap-agent decide` beside the plugin. A pod that
/// needs capture, and a pod that cannot be decided (no source configured, the API server
/// unreachable too), fail closed.
fn without_agent(
    conf: &NetConf,
    pod: &PodAttachment,
    unreachable: &CallError,
) -> Result<String, CniError> {
    let closed = |why: String| CniError {
        code: code::TRY_AGAIN_LATER,
        msg: format!(
            "{unreachable}; is the meshcap-agent DaemonSet pod running on this node? ADD \
             refused: pod {}/{} {why}, and pods are never started uncaptured",
            pod.namespace, pod.name
        ),
        details: UNREACHABLE.to_owned(),
    };
    match fallback::decide(&conf.meshcap, pod) {
        Ok(Some(decision)) if !decision.capture => Ok(decision.reason),
        Ok(Some(decision)) => Err(closed(format!("must be captured ({})", decision.reason))),
        Ok(None) => Err(closed("cannot be decided without the agent".to_owned())),
        Err(why) => Err(closed(format!(
            "cannot be decided without the agent ({why})"
        ))),
    }
}

/// Sends one request and turns every failure into a CNI error: for every operation but DEL,
/// no answer fails (closed: an ADD never lets a pod start uncaptured).
fn ask_or_fail(conf: &NetConf, op: Op) -> Result<String, CniError> {
    let name = op.name().to_ascii_uppercase();
    ask(conf, op).map_err(|failure| fail(failure, &name))
}

/// The CNI error for a request `name` that failed.
fn fail(failure: Failure, name: &str) -> CniError {
    match failure {
        Failure::Agent(err) => err,
        Failure::NoAnswer(err @ CallError::Unreachable { .. }) => CniError {
            code: code::TRY_AGAIN_LATER,
            msg: format!(
                "{err}; is the meshcap-agent DaemonSet pod running on this node? \
                 ({name} refused: pods are never started uncaptured)"
            ),
            details: UNREACHABLE.to_owned(),
        },
        Failure::NoAnswer(err @ (CallError::Timeout { .. } | CallError::Interrupted { .. })) => {
            CniError::new(code::TRY_AGAIN_LATER, format!("{err} ({name})"))
        }
        Failure::NoAnswer(err @ CallError::Protocol { .. }) => {
            CniError::new(code::IO, format!("{err} ({name})"))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::cni::tests::env;

    fn add_env(ns: &str, name: &str) -> Vec<(&'static str, String)> {
        vec![
            ("CNI_COMMAND", "ADD".into()),
            ("CNI_CONTAINERID", "c1".into()),
            ("CNI_NETNS", "/var/run/netns/x".into()),
            ("CNI_IFNAME", "eth0".into()),
            (
                "CNI_ARGS",
                format!("K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name}"),
            ),
        ]
    }

    fn run_with(vars: &[(&'static str, String)], stdin: &Value) -> Output {
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut err = Vec::new();
        run(env(&vars), stdin.to_string().as_bytes(), &mut err)
    }

    fn conf(extra: Value) -> Value {
        let mut base = json!({
            "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "meshcap-cni",
            "agent_socket": "/nonexistent/meshcap-test.sock",
            "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.9/24"}]}
        });
        for (k, v) in extra.as_object().unwrap() {
            base[k] = v.clone();
        }
        base
    }

    #[test]
    fn excluded_namespaces_pass_through_without_the_agent() {
        let out = run_with(&add_env("kube-system", "coredns-1"), &conf(json!({})));
        assert!(out.success, "{out:?}");
        assert_eq!(out.stdout.unwrap()["ips"][0]["address"], "10.0.0.9/24");
    }

    #[test]
    fn the_agents_own_pods_pass_through_without_the_agent() {
        let c = conf(json!({"agent_pod_namespace": "meshcap", "exclude_namespaces": []}));
        let out = run_with(&add_env("meshcap", "meshcap-agent-x7k2p"), &c);
        assert!(out.success, "{out:?}");
        let out = run_with(&add_env("meshcap", "other"), &c);
        assert!(!out.success, "only the name prefix is exempt");
    }

    #[test]
    fn non_kubernetes_sandboxes_pass_through() {
        let mut vars = add_env("x", "y");
        vars.retain(|(k, _)| *k != "CNI_ARGS");
        let out = run_with(&vars, &conf(json!({"cniVersion": "0.4.0"})));
        assert!(out.success);
        assert_eq!(out.stdout.unwrap()["ips"][0]["version"], "4");
    }

    #[test]
    fn unreachable_agent_fails_add_closed_but_not_del() {
        let out = run_with(&add_env("default", "web"), &conf(json!({})));
        assert!(!out.success);
        let err = out.stdout.unwrap();
        assert_eq!(err["code"], 11);
        assert_eq!(err["cniVersion"], "1.0.0");
        assert!(
            err["msg"].as_str().unwrap().contains("not reachable"),
            "{err}"
        );

        let mut del = add_env("default", "web");
        del[0].1 = "DEL".into();
        let out = run_with(&del, &conf(json!({})));
        assert!(out.success, "{out:?}");
        assert_eq!(out.stdout, None);
    }

    /// An agent that dies mid-request: it accepts the connection, reads part of the request
    /// or all of it, and goes without a word (`close`: EOF) or with a reset (`SO_LINGER` 0).
    fn dying_agent(reset: bool) -> (std::path::PathBuf, std::thread::JoinHandle<()>) {
        use std::{io::Read as _, os::unix::net::UnixListener};
        let path =
            std::env::temp_dir().join(format!("meshcap-dying-{}-{reset}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind");
        let handle = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut stream, _) = listener.accept().expect("accept");
                let mut head = [0; 4];
                let _ = stream.read_exact(&mut head);
                if !reset {
                    // The whole request read, then closed unanswered: the plugin reads EOF.
                    let mut body = vec![0; u32::from_be_bytes(head) as usize];
                    let _ = stream.read_exact(&mut body);
                }
                // With part of the request unread, closing makes the kernel reset the
                // connection.
                drop(stream);
            }
        });
        (path, handle)
    }

    #[test]
    fn del_succeeds_when_the_agent_dies_mid_request_and_add_fails_closed() {
        for reset in [false, true] {
            let (socket, agent) = dying_agent(reset);
            let c = conf(json!({"agent_socket": socket, "timeout_seconds": 5}));
            let mut del = add_env("default", "web");
            del[0].1 = "DEL".into();
            let out = run_with(&del, &c);
            assert!(out.success, "reset {reset}: {out:?}");
            let out = run_with(&add_env("default", "web"), &c);
            assert!(!out.success, "reset {reset}: ADD must fail closed");
            let err = out.stdout.expect("the CNI error");
            assert_eq!(err["code"], 11, "reset {reset}: a transient failure: {err}");
            assert!(
                err["msg"].as_str().is_some_and(|m| m.contains("went away")),
                "reset {reset}: {err}"
            );
            agent.join().expect("agent thread");
            let _ = std::fs::remove_file(&socket);
        }
    }

    #[test]
    fn status_reports_an_unavailable_agent() {
        let out = run_with(
            &[("CNI_COMMAND", "STATUS".into())],
            &conf(json!({"cniVersion": "1.1.0"})),
        );
        assert!(!out.success);
        assert_eq!(out.stdout.unwrap()["code"], 50);
    }

    #[test]
    fn version_answers_without_a_config() {
        let out = run_with(
            &[("CNI_COMMAND", "VERSION".into())],
            &json!({"cniVersion": "0.4.0"}),
        );
        assert!(out.success);
        let v = out.stdout.unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["supportedVersions"].as_array().unwrap().len(), 5);
    }

    #[test]
    fn unsupported_version_is_error_1() {
        let out = run_with(
            &add_env("default", "web"),
            &conf(json!({"cniVersion": "0.2.0"})),
        );
        assert!(!out.success);
        assert_eq!(out.stdout.unwrap()["code"], 1);
    }
}
