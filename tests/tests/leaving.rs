//! Leaving the cluster: every row of docs/install.md's decision table ("Uninstalling"), each
//! through the real agent and plugin against the test API server, which revokes tokens and
//! enforces the shipped RBAC as Kubernetes does, with the objects deleted in each uninstall's
//! order. Each uninstall must leave the node's CNI set-up without meshcap (pods start there);
//! each restart, update, credential problem or outage must leave it in place, with the plugin
//! still deciding: a pod outside the mesh starts, a mesh pod waits. No kernel path is crossed
//! here that the other tests do not cross (the agents run the iptables backend and capture no
//! pod): host only.
use meshcap_tests::{
    agent::{Agent, Backend},
    apiserver::{
        AGENT_ACCOUNT, AGENT_POD, ApiServer, CNI_ACCOUNT, CNI_TOKEN_SECRET, DAEMON_SET,
        SYSTEM_NAMESPACE,
    },
    cluster::ClusterNode,
    fixtures::{eventually, plain_pod, sidecar_pod},
    require_root,
};
use serde_json::json;

/// Deletes `(kind, name)` of meshcap's namespace (cluster-scoped kinds by name alone), in
/// order.
fn delete_all(api: &ApiServer, objects: &[(&str, &str)]) {
    for (kind, name) in objects {
        let namespace = if kind.starts_with("Cluster") {
            ""
        } else {
            SYSTEM_NAMESPACE
        };
        api.delete(kind, namespace, name);
    }
}

/// Every RBAC object `deploy/` ships, in file order.
const RBAC: &[(&str, &str)] = &[
    ("ClusterRole", "meshcap-agent"),
    ("ClusterRole", "meshcap-cni"),
    ("Role", "meshcap-agent"),
    ("ClusterRoleBinding", "meshcap-agent"),
    ("ClusterRoleBinding", "meshcap-cni"),
    ("RoleBinding", "meshcap-agent"),
];

/// The ServiceAccounts and the plugin's token Secret, in file order.
const IDENTITIES: &[(&str, &str)] = &[
    ("ServiceAccount", AGENT_ACCOUNT),
    ("ServiceAccount", CNI_ACCOUNT),
    ("Secret", CNI_TOKEN_SECRET),
];

/// One row: an agent installed on a node, `then` done to the cluster, the agent stopped as
/// kubelet stops it (SIGTERM); whether meshcap is then gone from the node. Returns the node
/// and the agent's log for more checks.
fn row(
    what: &str,
    then: impl FnOnce(&ApiServer, &Agent),
    uninstalls: bool,
) -> (ClusterNode, ApiServer) {
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
    (node, api)
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
    let (node, _api) = row(
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
    // kubectl delete -f deploy/: the namespace (its deletion starts), then each file's
    // objects; the namespace controller and the garbage collector stop the pod last.
    row(
        "kubectl delete -f deploy/ (401: the ServiceAccount went first)",
        |api, _| {
            api.mark_deleting("Namespace", "", SYSTEM_NAMESPACE);
            delete_all(api, IDENTITIES);
            delete_all(api, RBAC);
            api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
        },
        true,
    );
    row(
        "kubectl delete namespace meshcap-system",
        |api, _| {
            api.mark_deleting("Namespace", "", SYSTEM_NAMESPACE);
            delete_all(api, IDENTITIES);
            delete_all(
                api,
                &[("Role", "meshcap-agent"), ("RoleBinding", "meshcap-agent")],
            );
            api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
        },
        true,
    );
    // helm uninstall: the DaemonSet, then RBAC, then ServiceAccounts and Secrets, without
    // waiting for the pods.
    row(
        "helm uninstall (DaemonSet, RBAC, ServiceAccounts)",
        |api, _| {
            api.delete("DaemonSet", SYSTEM_NAMESPACE, DAEMON_SET);
            let mut rbac = RBAC.to_vec();
            rbac.reverse();
            delete_all(api, &rbac);
            delete_all(api, IDENTITIES);
        },
        true,
    );
    // RBAC deleted first, long enough before the DaemonSet for every watch to have ended and
    // been refused when it started again: the agent says it is not ready, then its DaemonSet
    // goes and nothing was seen; both identities may do nothing any more.
    row(
        "RBAC deleted before the DaemonSet (403, the watch refused)",
        |api, agent| {
            delete_all(api, RBAC);
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
    let (node, _api) = row(
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
