//! What the agent may do in the cluster, checked rather than discovered when it is too late.
//!
//! At start the agent asks the API server (a `SelfSubjectAccessReview` per request, which every
//! authenticated identity may make) whether it may make each request its enabled features will
//! make ([`needs`]): the pod watch, a pod's GET, Events, the startup taint's node patch, its
//! DaemonSet's watch (the uninstall's witness), and with ambient mode or a repair mode the
//! writes they do. Any it may not make holds readiness, named with the feature that needs it,
//! and is reported once as a Warning Event on the agent's own pod; the check is repeated until
//! the RBAC is fixed. While a watch the agent keeps is refused (401 or 403: its credential or
//! its binding went after the check), readiness is held too ([`WatchHealth`]).
use std::{
    collections::BTreeMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::{Api, api::PostParams};
use tokio::sync::watch;

/// One request the agent will make, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Need {
    /// `get`, `list`, `watch`, `create`, `patch`, `delete`.
    pub verb: &'static str,
    /// The API group (`""`: core).
    pub group: &'static str,
    /// The resource.
    pub resource: &'static str,
    /// Its subresource, or empty.
    pub subresource: &'static str,
    /// The namespace (empty: every namespace, or a cluster-scoped resource).
    pub namespace: String,
    /// The object's name (empty: any).
    pub name: String,
    /// The setting or part of the agent that makes the request.
    pub why: &'static str,
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ", self.verb)?;
        if !self.group.is_empty() {
            write!(f, "{}.", self.group)?;
        }
        f.write_str(self.resource)?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        if !self.name.is_empty() {
            write!(f, " {}", self.name)?;
        }
        if !self.namespace.is_empty() {
            write!(f, " in {}", self.namespace)?;
        }
        write!(f, " ({})", self.why)
    }
}

/// The repair controller's mode, as far as RBAC is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairWrites {
    /// Off, or repairing in place: the pod watch only.
    None,
    /// `repair.deletePods`.
    DeletePods,
    /// `repair.labelPods`.
    LabelPods,
}

/// The enabled features that talk to the API server.
#[derive(Clone, Debug)]
pub struct Features {
    /// This node.
    pub node: String,
    /// A startup taint is configured.
    pub startup_taint: bool,
    /// The agent's own namespace and the DaemonSet that owns its pod, when it has one.
    pub daemon_set: Option<(String, String)>,
    /// `ambient.enabled`.
    pub ambient: bool,
    /// The repair controller's writes.
    pub repair: RepairWrites,
}

fn need(
    verb: &'static str,
    group: &'static str,
    resource: &'static str,
    why: &'static str,
) -> Need {
    Need {
        verb,
        group,
        resource,
        subresource: "",
        namespace: String::new(),
        name: String::new(),
        why,
    }
}

/// Every request `features` make, as RBAC sees them (what the chart grants for those settings,
/// rule for rule: `agent/tests/chart.rs`).
#[must_use]
pub fn needs(features: &Features) -> Vec<Need> {
    let mut all = vec![
        need("list", "", "pods", "the pod watch of this node"),
        need("watch", "", "pods", "the pod watch of this node"),
        need("get", "", "pods", "a pod the watch has not delivered yet"),
        need("create", "events.k8s.io", "events", "Events on pods"),
        need(
            "patch",
            "events.k8s.io",
            "events",
            "Events on pods, repeated",
        ),
    ];
    if features.startup_taint {
        for verb in ["get", "patch"] {
            all.push(Need {
                name: features.node.clone(),
                ..need(
                    verb,
                    "",
                    "nodes",
                    "startupTaint: removing it from this node",
                )
            });
        }
    }
    if let Some((namespace, name)) = &features.daemon_set {
        // At a stop, with a DaemonSet that has a required node affinity: whether it still
        // takes this node (`uninstall::placement`). The startup taint gets it above.
        if !features.startup_taint {
            all.push(Need {
                name: features.node.clone(),
                ..need(
                    "get",
                    "",
                    "nodes",
                    "uninstall: whether the DaemonSet still places a pod on this node",
                )
            });
        }
        for verb in ["get", "list", "watch"] {
            all.push(Need {
                namespace: namespace.clone(),
                name: name.clone(),
                ..need(
                    verb,
                    "apps",
                    "daemonsets",
                    "uninstall: whether meshcap is being deleted",
                )
            });
        }
    }
    if features.ambient {
        for verb in ["get", "list", "watch"] {
            all.push(need(
                verb,
                "",
                "namespaces",
                "ambient.enabled: enrollment by namespace",
            ));
        }
        all.push(Need {
            subresource: "status",
            ..need(
                "patch",
                "",
                "pods",
                "ambient.enabled: annotating enrolled pods",
            )
        });
    }
    match features.repair {
        RepairWrites::None => {}
        RepairWrites::DeletePods => all.push(need(
            "delete",
            "",
            "pods",
            "repair.deletePods: deleting broken pods",
        )),
        RepairWrites::LabelPods => all.push(Need {
            subresource: "status",
            ..need(
                "patch",
                "",
                "pods",
                "repair.labelPods: labelling broken pods",
            )
        }),
    }
    all
}

/// Whether the identity behind `client` may make `need` (one `SelfSubjectAccessReview`).
///
/// # Errors
/// When the API server cannot be asked, or refuses the review (401: the credential itself is
/// refused).
pub async fn allowed(client: &kube::Client, need: &Need) -> Result<bool, kube::Error> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(need.verb.to_owned()),
                group: Some(need.group.to_owned()),
                resource: Some(need.resource.to_owned()),
                subresource: (!need.subresource.is_empty()).then(|| need.subresource.to_owned()),
                namespace: (!need.namespace.is_empty()).then(|| need.namespace.clone()),
                name: (!need.name.is_empty()).then(|| need.name.clone()),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// The `needs` the identity behind `client` may not make.
///
/// # Errors
/// When the API server cannot be asked.
pub async fn missing(client: &kube::Client, needs: &[Need]) -> Result<Vec<Need>, kube::Error> {
    let mut missing = Vec::new();
    for need in needs {
        if !allowed(client, need).await? {
            missing.push(need.clone());
        }
    }
    Ok(missing)
}

/// Why readiness is held, in words, from what [`missing`] found for `who` (`the agent`, `the
/// plugin`).
#[must_use]
pub fn describe_missing(who: &str, missing: &[Need]) -> String {
    let each: Vec<String> = missing.iter().map(ToString::to_string).collect();
    format!(
        "{who} may not {} (set these settings through the chart's values: it grants what they need)",
        each.join("; ")
    )
}

/// How often missing permissions are checked again.
const RECHECK: Duration = Duration::from_secs(30);

/// Checks that `who` (`the agent`, `the plugin`), with `client`, may make `needs`, now and
/// every [`RECHECK`] while any is missing, publishing why readiness is held on `gate` (`None`:
/// nothing missing) and calling `report` once per new set of missing permissions (the Warning
/// Event). A refused credential (401) is reported the same way.
pub async fn enforce(
    who: &'static str,
    client: kube::Client,
    needs: Vec<Need>,
    gate: watch::Sender<Option<String>>,
    report: impl Fn(String) + Send,
) {
    let mut reported = None;
    loop {
        let outcome = match missing(&client, &needs).await {
            Err(kube::Error::Api(status)) if status.code == 401 => Err(format!(
                "{who}'s token is refused (401): {}",
                status.message
            )),
            Err(err) => Ok(Err(format!(
                "cannot ask the API server what {who} may do: {err}"
            ))),
            Ok(missing) if missing.is_empty() => Ok(Ok(())),
            Ok(missing) => Err(describe_missing(who, &missing)),
        };
        let held = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(unknown)) => Some(unknown),
            Err(why) => {
                if reported.as_ref() != Some(&why) {
                    tracing::warn!("{why}");
                    report(why.clone());
                    reported = Some(why.clone());
                }
                Some(why)
            }
        };
        let done = held.is_none();
        gate.send_replace(held);
        if done {
            tracing::info!(
                checked = needs.len(),
                "{who} may make every request its settings need"
            );
            return;
        }
        tokio::time::sleep(RECHECK).await;
    }
}

/// Whether `err` says the request was refused for its credential (401) or its permissions
/// (403), rather than failed.
#[must_use]
pub fn is_refused(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 401 || status.code == 403)
}

/// The watches the agent keeps, and which of them the API server refuses now: a watch started
/// before its credential or binding went goes on streaming until it ends, and then cannot
/// start again. Readiness is held while any is refused.
#[derive(Clone, Debug)]
pub struct WatchHealth {
    refused: Arc<Mutex<BTreeMap<&'static str, String>>>,
    gate: watch::Sender<Option<String>>,
}

impl Default for WatchHealth {
    fn default() -> Self {
        Self {
            refused: Arc::default(),
            gate: watch::Sender::new(None),
        }
    }
}

impl WatchHealth {
    /// Why readiness is held, as [`WatchHealth::observe`] finds it.
    #[must_use]
    pub fn gate(&self) -> watch::Receiver<Option<String>> {
        self.gate.subscribe()
    }

    /// Records how the watch `name` fared: a refusal holds readiness until the same watch
    /// delivers again.
    pub fn observe<T>(
        &self,
        name: &'static str,
        outcome: &Result<T, kube::runtime::watcher::Error>,
    ) {
        use kube::runtime::watcher::Error;
        let refused = match outcome {
            Ok(_) => None,
            Err(
                Error::InitialListFailed(err)
                | Error::WatchStartFailed(err)
                | Error::WatchFailed(err),
            ) if is_refused(err) => Some(err.to_string()),
            Err(Error::WatchError(status)) if status.code == 401 || status.code == 403 => {
                Some(status.to_string())
            }
            Err(_) => return,
        };
        let mut map = self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = match refused {
            Some(why) => map.insert(name, why.clone()).as_ref() != Some(&why),
            None => map.remove(name).is_some(),
        };
        if changed {
            let held = (!map.is_empty()).then(|| {
                let each: Vec<String> = map
                    .iter()
                    .map(|(name, why)| format!("the {name} watch is refused: {why}"))
                    .collect();
                each.join("; ")
            });
            self.gate.send_replace(held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_follow_the_features() {
        let base = Features {
            node: "node-1".into(),
            startup_taint: false,
            daemon_set: None,
            ambient: false,
            repair: RepairWrites::None,
        };
        let text = |f: &Features| needs(f).iter().map(ToString::to_string).collect::<Vec<_>>();
        let plain = text(&base);
        assert_eq!(plain.len(), 5);
        assert!(
            plain
                .iter()
                .all(|n| !n.contains("nodes") && !n.contains("status"))
        );
        let watched = text(&Features {
            daemon_set: Some(("meshcap-system".into(), "meshcap-agent".into())),
            ..base.clone()
        });
        assert!(
            watched.iter().any(|n| n
                == "get nodes node-1 (uninstall: whether the DaemonSet still places a pod on this node)"),
            "{watched:#?}"
        );
        assert!(!watched.iter().any(|n| n.starts_with("patch nodes")));
        let all = text(&Features {
            startup_taint: true,
            daemon_set: Some(("meshcap-system".into(), "meshcap-agent".into())),
            ambient: true,
            repair: RepairWrites::LabelPods,
            ..base
        });
        for wanted in [
            "patch nodes node-1 (startupTaint: removing it from this node)",
            "watch apps.daemonsets meshcap-agent in meshcap-system (uninstall: whether meshcap is being deleted)",
            "patch pods/status (ambient.enabled: annotating enrolled pods)",
            "patch pods/status (repair.labelPods: labelling broken pods)",
            "watch namespaces (ambient.enabled: enrollment by namespace)",
        ] {
            assert!(all.iter().any(|n| n == wanted), "{wanted} in {all:#?}");
        }
    }
}
