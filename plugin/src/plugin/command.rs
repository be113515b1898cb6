//! What each command does, and which pods pass through without asking the agent.
use serde_json::Value;

use super::{
    Log,
    agent::{Failure, ask, ask_or_fail, fail, without_agent},
    version_info,
};
use crate::{
    cni::{CniError, Command, Invocation, LogLevel, NetConf, code, convert_result},
    protocol::{CallError, Op, PodAttachment},
};

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

pub(super) fn execute(
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
