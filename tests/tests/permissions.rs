//! The shipped RBAC against what the agent and the plugin really ask, through the real binaries
//! and the test API server, which enforces the chart's RBAC as Kubernetes does: with the
//! default settings (`deploy/`) every rule granted is used and no request is refused; a
//! permission a setting needs and the RBAC lacks is named at start (readiness held, a Warning
//! Event on the agent's pod).
use meshcap_tests::{
    agent::Backend,
    apiserver::{AGENT_ACCOUNT, AGENT_POD, ApiServer, CNI_ACCOUNT, NODE},
    cluster::ClusterNode,
    fixtures::{eventually, plain_pod, sidecar_pod},
    require_root,
};
use serde_json::{Value, json};

/// Every grant `account` has is used, and nothing `account` asked was refused.
fn all_used_nothing_refused(api: &ApiServer, account: &str) {
    let (granted, used) = api.grants(account);
    let unused: Vec<_> = granted.iter().filter(|g| !used.contains(g)).collect();
    assert!(
        unused.is_empty(),
        "{account}: granted and never used: {unused:?}"
    );
    let refused = api.refused();
    assert!(refused.is_empty(), "refused: {refused:?}");
}

#[test]
fn with_the_default_settings_every_shipped_permission_is_used_and_none_is_missing() {
    require_root();
    let api = ApiServer::start();
    {
        let mut pods = api.pods.lock().expect("pods");
        pods.push(plain_pod("shop", "plain"));
        pods.push(sidecar_pod(
            "shop",
            "bad",
            &[("traffic.sidecar.istio.io/includeInboundPorts", "80,http")],
        ));
    }
    // A node created with the startup taint: the agent removes it (nodes get, patch).
    api.nodes.lock().expect("nodes")[0]["spec"]["taints"] =
        json!([{"key": "cni.meshcap.io/not-ready", "value": "true", "effect": "NoSchedule"}]);
    let node = ClusterNode::new(&api);
    let mut agent = node.start_agent(
        Backend::Iptables,
        &[("MESHCAP_STARTUP_TAINT", "cni.meshcap.io/not-ready")],
    );
    eventually("the startup taint removed", || {
        api.nodes.lock().expect("nodes")[0]["spec"]["taints"] == json!([])
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    // A pod whose annotation is invalid, twice: an Event, then (once the first is published)
    // its series patched.
    for count in [Value::Null, json!(2)] {
        let (out, _) = node.add("shop", "bad");
        assert!(!out.success, "{out:?}");
        assert_eq!(out.stdout["code"], 104, "{out:?}");
        eventually("the Event", || {
            api.events
                .lock()
                .expect("events")
                .iter()
                .any(|e| e["reason"] == "InvalidSidecarAnnotation" && e["series"]["count"] == count)
        })
        .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", api.events.lock(), agent.log()));
    }
    // A restart: the DaemonSet is read again; then the plugin decides with its own token.
    let status = agent.terminate().expect("SIGTERM");
    assert!(status.success(), "{}", agent.log());
    assert!(node.installed(), "{}", agent.log());
    let (plain, _) = node.add("shop", "plain");
    assert!(plain.success, "{plain:?}");
    all_used_nothing_refused(&api, AGENT_ACCOUNT);
    all_used_nothing_refused(&api, CNI_ACCOUNT);
}

#[test]
fn a_missing_permission_is_named_at_start() {
    require_root();
    // repair.labelPods set on the agent alone, not in the chart's values: its RBAC is missing.
    let api = ApiServer::start();
    let node = ClusterNode::new(&api);
    let env = node.env(&[
        ("MESHCAP_REPAIR_REPAIR_PODS", "false"),
        ("MESHCAP_REPAIR_LABEL_PODS", "true"),
    ]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let agent = meshcap_tests::agent::Agent::start(
        Backend::Iptables,
        &["--pods", "kube", "--node-name", NODE],
        &env,
    )
    .expect("agent");
    let wanted = "patch pods/status (repair.labelPods: labelling broken pods)";
    eventually("readiness names the missing permission", || {
        agent
            .http_get("/readyz")
            .is_ok_and(|(code, body)| code == 503 && body.contains(wanted))
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", agent.http_get("/readyz"), agent.log()));
    let mut event = Value::Null;
    eventually("a Warning Event on the agent's pod", || {
        event = api
            .events
            .lock()
            .expect("events")
            .iter()
            .find(|e| e["reason"] == "MissingPermissions")
            .cloned()
            .unwrap_or(Value::Null);
        !event.is_null()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert_eq!(event["regarding"]["name"], AGENT_POD, "{event}");
    assert_eq!(event["type"], "Warning", "{event}");
    assert!(
        event["note"].as_str().is_some_and(|n| n.contains(wanted)),
        "{event}"
    );
    // Asking is not using: the review granted nothing it lacked, and no request was refused
    // before the agent knew.
    assert!(api.refused().is_empty(), "{:?}", api.refused());
}

/// The plugin's own credential is checked at start too: without it, the node would learn that
/// it cannot decide pods only once the agent is away and every pod of the node fails.
#[test]
fn a_plugin_that_may_not_read_pods_is_named_at_start() {
    require_root();
    let api = ApiServer::start();
    api.delete("ClusterRoleBinding", "", "meshcap-cni");
    let node = ClusterNode::new(&api);
    let env = node.env(&[]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let agent = meshcap_tests::agent::Agent::start(
        Backend::Iptables,
        &["--pods", "kube", "--node-name", NODE],
        &env,
    )
    .expect("agent");
    let wanted = "the plugin may not get pods (the plugin's decision while no agent runs)";
    eventually("readiness names the plugin's missing permission", || {
        agent
            .http_get("/readyz")
            .is_ok_and(|(code, body)| code == 503 && body.contains(wanted))
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", agent.http_get("/readyz"), agent.log()));
    assert!(api.refused().is_empty(), "{:?}", api.refused());
}
