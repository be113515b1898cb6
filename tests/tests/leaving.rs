//! Leaving the cluster: every row of docs/install.md's decision table ("Uninstalling"), each
//! through the real agent and plugin against the test API server, which revokes tokens and
//! enforces the shipped RBAC as Kubernetes does, with the objects deleted in each uninstall's
//! order. Each uninstall must leave the node's CNI set-up without meshcap (pods start there);
//! each restart, update, credential problem or outage must leave it in place, with the plugin
//! still deciding: a pod outside the mesh starts, a mesh pod waits. No kernel path is crossed
//! here that the other tests do not cross (the agents run the iptables backend and capture no
//! pod): host only.
use std::path::Path;

use meshcap_tests::{
    agent::{Agent, Backend},
    apiserver::{AGENT_POD, ApiServer, CNI_TOKEN_SECRET, DAEMON_SET, SYSTEM_NAMESPACE},
    chart,
    cluster::ClusterNode,
    fixtures::{eventually, plain_pod, sidecar_pod},
    rbac, require_root,
};
use serde_json::{Value, json};

/// The order `helm uninstall` deletes a release's objects in, by kind (helm's `UninstallOrder`,
/// `pkg/release/v1/util/kind_sorter.go`, helm v4; the same order in v3), without waiting for
/// the DaemonSet's pods to stop.
const HELM_UNINSTALL_ORDER: &[&str] = &[
    "DaemonSet",
    "RoleBinding",
    "Role",
    "ClusterRoleBinding",
    "ClusterRole",
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "Namespace",
];

/// What `kubectl delete -f deploy/` deletes, in its order: the files by name, each file's
/// objects as written.
fn deploy_files() -> Vec<Value> {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    rbac::load(&[deploy.as_path()])
}

/// Deletes each of `objects` (rendered), in order, as the API server does: a Namespace starts
/// being deleted (its controller removes what it holds later), anything else goes at once.
fn delete_all<'a>(api: &ApiServer, objects: impl IntoIterator<Item = &'a Value>) {
    for object in objects {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let (kind, namespace, name) = (
            text(&object["kind"]),
            text(&object["metadata"]["namespace"]),
            text(&object["metadata"]["name"]),
        );
        if kind == "Namespace" {
            api.mark_deleting("Namespace", "", &name);
        } else {
            api.delete(&kind, &namespace, &name);
        }
    }
}

/// Of `objects`, those of the kinds `kinds`.
fn of_kinds<'a>(objects: &'a [Value], kinds: &[&str]) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| kinds.iter().any(|k| o["kind"] == *k))
        .collect()
}

/// The roles and bindings, as RBAC kinds.
const RBAC: &[&str] = &["ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding"];

/// One row: an agent installed on a node, `then` done to the cluster, the agent stopped as
/// kubelet stops it (SIGTERM); whether meshcap is then gone from the node. Returns the node,
/// the API server and the agent's log for more checks.
fn row(
    what: &str,
    then: impl FnOnce(&ApiServer, &Agent),
    uninstalls: bool,
) -> (ClusterNode, ApiServer, String) {
    let api = ApiServer::start();
    {
        let mut pods = api.pods.lock().expect("pods");
        pods.push(plain_pod("shop", "plain"));
        pods.push(sidecar_pod("shop", "web", &[]));
    }
    let node = ClusterNode::new(&api);
    let mut agent = node.start_agent(Backend::Iptables, &[]);
    then(&api, &agent);
    let status = agent.terminate().expect("SIGTERM");
    let log = agent.log();
    assert!(status.success(), "{what}: an orderly stop: {status}\n{log}");
    if uninstalls {
        assert!(
            node.clean(),
            "{what}: meshcap must be gone from the node: {} entries, {:?}\n{log}",
            node.entries(),
            node.files()
        );
        assert!(log.contains("meshcap is being deleted"), "{what}\n{log}");
    } else {
        assert!(
            node.installed(),
            "{what}: meshcap must stay: {:?}\n{log}",
            node.files()
        );
        assert!(log.contains("meshcap stays installed"), "{what}\n{log}");
    }
    (node, api, log)
}

/// With the agent gone and meshcap still installed, the node decides with the plugin's own
/// token: a pod outside the mesh starts, a mesh pod waits (code 11).
fn the_plugin_decides(what: &str, node: &ClusterNode) {
    let (plain, took) = node.add("shop", "plain");
    assert!(
        plain.success,
        "{what}: a pod outside the mesh starts: {plain:?}"
    );
    eprintln!("{what}: ADD of a pod outside the mesh, the agent gone: {took:?}");
    let (mesh, _) = node.add("shop", "web");
    assert!(!mesh.success, "{what}: a mesh pod waits: {mesh:?}");
    assert_eq!(mesh.stdout["code"], 11, "{what}");
}

#[test]
fn restarts_updates_evictions_and_drains_keep_meshcap() {
    require_root();
    // A restart (the pod stays), and a rolling update, an eviction or a drain (the pod is
    // being deleted): the DaemonSet is there, read with the agent's own token.
    row("a restart", |_, _| {}, false);
    let (node, _api, _) = row(
        "a rolling update, an eviction, a drain",
        |api, _| api.mark_deleting("Pod", SYSTEM_NAMESPACE, AGENT_POD),
        false,
    );
    the_plugin_decides("after a rolling update", &node);
    row(
        "a replaced DaemonSet",
        |api, _| {
            let mut ds = api.daemon_set();
            ds["metadata"]["uid"] = json!("ds-2");
            api.apply_daemon_set(ds);
        },
        false,
    );
}

/// The node-by-node switch between istio-cni and meshcap (docs/install.md) moves meshcap off a
/// node by its DaemonSet's required node affinity: the DaemonSet stays, but its pod never comes
/// back to that node, so the agent leaves it as Istio's does (`ShouldStopCleanup`); a node the
/// affinity still takes keeps meshcap.
#[test]
fn a_node_the_daemon_sets_affinity_no_longer_takes_is_left() {
    require_root();
    let affinity = |api: &ApiServer, node_label: &str| {
        api.apply_switch_affinity();
        api.label_for_switch(node_label);
    };
    let (_, _, log) = row(
        "the DaemonSet's node affinity takes this node",
        |api, _| affinity(api, "meshcap"),
        false,
    );
    assert!(log.contains("a restart, an update"), "{log}");
    let (_, _, log) = row(
        "the node relabelled out of the DaemonSet's node affinity",
        |api, _| affinity(api, "istio"),
        true,
    );
    assert!(
        log.contains("no longer places a pod on this node")
            && log.contains("meshcap.io/cni In [both, meshcap]"),
        "{log}"
    );
}

#[test]
fn each_uninstall_order_leaves_the_node_clean() {
    require_root();
    row(
        "kubectl delete daemonset (background, 404)",
        |api, _| api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET),
        true,
    );
    row(
        "a foreground deletion (deletionTimestamp)",
        |api, _| api.mark_deleting("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET),
        true,
    );
    // kubectl delete -f deploy/: file by file, the namespace first (its deletion starts; its
    // controller and the garbage collector stop the agent's pod last), the ServiceAccounts and
    // the plugin's token next: every token is refused (401) before the pod stops.
    row(
        "kubectl delete -f deploy/ (401: the ServiceAccounts went first)",
        |api, _| delete_all(api, &deploy_files()),
        true,
    );
    // kubectl delete namespace: its controller deletes what it holds (the cluster-wide RBAC
    // stays, bound to ServiceAccounts that are gone).
    row(
        "kubectl delete namespace meshcap-system",
        |api, _| {
            let objects = deploy_files();
            delete_all(api, of_kinds(&objects, &["Namespace"]));
            let held: Vec<&Value> = objects
                .iter()
                .filter(|o| !o["metadata"]["namespace"].is_null() && o["kind"] != "DaemonSet")
                .collect();
            delete_all(api, held);
            delete_all(api, of_kinds(&objects, &["DaemonSet"]));
        },
        true,
    );
    // helm uninstall: by kind in helm's order (the DaemonSet, then RBAC, then the plugin's
    // token and the ServiceAccounts), without waiting for the pods.
    row(
        "helm uninstall (DaemonSet, RBAC, Secret, ServiceAccounts)",
        |api, _| {
            let objects = chart::configuration("defaults").expect("the chart");
            for kind in HELM_UNINSTALL_ORDER {
                delete_all(api, of_kinds(&objects, &[kind]));
            }
        },
        true,
    );
    // RBAC deleted first, long enough before the DaemonSet for every watch to have ended and
    // been refused when it started again: the agent says it is not ready, then its DaemonSet
    // goes and nothing was seen; both identities may do nothing any more.
    row(
        "RBAC deleted before the DaemonSet (403, the watch refused)",
        |api, agent| {
            delete_all(api, of_kinds(&deploy_files(), RBAC));
            api.close_watches();
            eventually("the refused watch holds readiness", || {
                agent
                    .http_get("/readyz")
                    .is_ok_and(|(code, body)| code == 503 && body.contains("watch is refused"))
            })
            .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", agent.http_get("/readyz"), agent.log()));
            api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
        },
        true,
    );
}

#[test]
fn credential_problems_and_outages_never_uninstall() {
    require_root();
    // The agent's pod object deleted while the DaemonSet stays (a force deletion: its token is
    // revoked, as an expired one would be): 401, nothing seen, and the plugin's own token still
    // works. meshcap stays, and the plugin decides pods meanwhile.
    let (node, _api, _) = row(
        "the agent's token revoked (401), the DaemonSet there",
        |api, _| api.delete("Pod", SYSTEM_NAMESPACE, AGENT_POD),
        false,
    );
    the_plugin_decides("with the agent's pod object deleted", &node);
    // One rule removed by hand (403 on the DaemonSet): a misconfiguration, not an uninstall.
    row(
        "the agent's Role deleted (403), the rest there",
        |api, _| api.delete("RoleBinding", SYSTEM_NAMESPACE, "meshcap-agent"),
        false,
    );
    // The same two with the DaemonSet's watch no longer streaming (its restart refused): what
    // it last delivered says nothing of now, and what meshcap may still do decides.
    let (node, _api, _) = row(
        "the agent's token revoked (401), its watch's restart refused, the plugin's token works",
        |api, agent| {
            api.delete("Pod", SYSTEM_NAMESPACE, AGENT_POD);
            watch_refused(api, agent);
        },
        false,
    );
    the_plugin_decides(
        "with the agent's pod object deleted, its watch refused",
        &node,
    );
    row(
        "the agent's Role deleted (403), its watch's restart refused, the rest there",
        |api, agent| {
            api.delete("RoleBinding", SYSTEM_NAMESPACE, "meshcap-agent");
            watch_refused(api, agent);
        },
        false,
    );
}

/// Ends the API server's watches and waits until the agent's DaemonSet watch has been refused
/// when it started again (readiness says so).
fn watch_refused(api: &ApiServer, agent: &Agent) {
    api.close_watches();
    eventually("the DaemonSet's watch refused", || {
        agent.http_get("/readyz").is_ok_and(|(code, body)| {
            code == 503 && body.contains("the DaemonSet watch is refused")
        })
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", agent.http_get("/readyz"), agent.log()));
}

/// The plugin's token rotated as docs/install.md says (its Secret deleted, then created again
/// from `deploy/`: the token controller fills it with a new token, and the old one is refused
/// from the deletion on, until kubelet refreshes the node's copy) with the agent's pod object
/// force-deleted at each moment of it: before, between the two steps, after. Both tokens are
/// then refused at SIGTERM, and the DaemonSet's watch, streaming still, shows it there: meshcap
/// stays.
#[test]
fn a_token_rotation_with_the_agents_pod_force_deleted_keeps_meshcap() {
    require_root();
    let secret = deploy_files()
        .into_iter()
        .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == CNI_TOKEN_SECRET)
        .expect("deploy/ holds the plugin's token Secret");
    // The rotation's two steps, with the force deletion before the one numbered `at` (2: after
    // both).
    for at in 0..=2 {
        let what = format!("the agent's pod force-deleted before step {at} of the rotation");
        let (_node, _api, log) = row(
            &what,
            |api, _| {
                for step in 0..=2 {
                    if step == at {
                        api.delete("Pod", SYSTEM_NAMESPACE, AGENT_POD);
                    }
                    match step {
                        0 => api.delete("Secret", SYSTEM_NAMESPACE, CNI_TOKEN_SECRET),
                        1 => api.create(secret.clone()),
                        _ => {}
                    }
                }
            },
            false,
        );
        assert!(
            log.contains("as its watch, streaming still, delivers it"),
            "{what}: kept by what the watch delivers\n{log}"
        );
    }
    // The limit docs/install.md states: the DaemonSet's watch restarted (refused) between the
    // force deletion and the SIGTERM, so nothing says the DaemonSet is there now, and both
    // identities are refused everything, as when meshcap's ServiceAccounts are deleted.
    row(
        "the rotation, the agent's pod force-deleted, its watch's restart refused before SIGTERM",
        |api, agent| {
            api.delete("Secret", SYSTEM_NAMESPACE, CNI_TOKEN_SECRET);
            api.delete("Pod", SYSTEM_NAMESPACE, AGENT_POD);
            watch_refused(api, agent);
        },
        true,
    );
}

#[test]
fn an_unreachable_api_server_settles_only_on_what_the_watch_saw() {
    require_root();
    for (deleted, uninstalls) in [(false, false), (true, true)] {
        let api = ApiServer::start();
        let node = ClusterNode::new(&api);
        let mut agent = node.start_agent(Backend::Iptables, &[]);
        if deleted {
            api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
            // The watch delivers the deletion before the API server goes away.
            eventually("the agent's watch saw the deletion", || {
                agent.log().contains("the DaemonSet's watch saw it deleted")
            })
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
        }
        drop(api);
        let status = agent.terminate().expect("SIGTERM");
        assert!(status.success(), "{status}\n{}", agent.log());
        assert_eq!(
            node.clean(),
            uninstalls,
            "deleted: {deleted}\n{}",
            agent.log()
        );
        assert_eq!(
            node.installed(),
            !uninstalls,
            "deleted: {deleted}\n{}",
            agent.log()
        );
    }
}
