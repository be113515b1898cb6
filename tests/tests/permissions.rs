//! The shipped RBAC against what the agent and the plugin really ask, through the real binaries
//! and the test API server, which enforces the chart's RBAC as Kubernetes does: with the
//! default settings (`deploy/`) every rule granted is used and no request is refused; a
//! permission a setting needs and the RBAC lacks is named at start (readiness held, a Warning
//! Event on the agent's pod); and what one node's agent asks grows with its node's pods, not
//! with the cluster's (issue #47's API server bill).
use meshcap_tests::{
    agent::Backend,
    apiserver::{AGENT_ACCOUNT, AGENT_POD, ApiServer, CNI_ACCOUNT, NODE},
    cluster::ClusterNode,
    fixtures::{ManifestDir, eventually, plain_pod, sidecar_pod},
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

/// One row of a node's bill: what its agent asked, how often, and the bytes it moved.
#[derive(Debug, Default)]
struct Row {
    /// `verb resource (scope)`.
    what: String,
    requests: usize,
    /// The bytes the agent sent (request lines, headers, bodies).
    received: u64,
    /// The bytes the API server answered with (a watch's so far).
    sent: u64,
}

/// What one node's agent asks of the API server (issue #47, item 3), with a cluster of many
/// other nodes' pods and namespaces: from its start to Ready, then while it runs steadily,
/// one row per `(verb, resource, scope)`. Everything about pods is narrowed to the agent's
/// node (`fieldSelector=spec.nodeName`), so its bill grows with its node, not with the
/// cluster; what it asks cluster-wide is named in docs/install.md ("The API server's bill").
fn bill(api: &ApiServer, since: usize) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for request in api.requests().into_iter().skip(since) {
        if request.user != meshcap_tests::rbac::service_account_user(&api.namespace, AGENT_ACCOUNT)
        {
            continue;
        }
        let a = &request.attrs;
        let scope = if request.query.contains("spec.nodeName") {
            "the node's".to_owned()
        } else if !a.name.is_empty() {
            "one object".to_owned()
        } else if a.namespace.is_empty() {
            "the cluster's".to_owned()
        } else {
            format!("namespace {}", a.namespace)
        };
        let sub = if a.subresource.is_empty() {
            String::new()
        } else {
            format!("/{}", a.subresource)
        };
        let what = format!("{} {}{sub} ({scope})", a.verb, a.resource);
        let at = match rows.iter().position(|r| r.what == what) {
            Some(at) => at,
            None => {
                rows.push(Row {
                    what,
                    ..Row::default()
                });
                rows.len() - 1
            }
        };
        let row = &mut rows[at];
        row.requests += 1;
        row.received += request.traffic.received();
        row.sent += request.traffic.sent();
    }
    rows.sort_by(|a, b| a.what.cmp(&b.what));
    rows
}

/// The bytes the API server has answered the node's pod watch with so far.
fn pod_watch_bytes(api: &ApiServer) -> u64 {
    bill(api, 0)
        .iter()
        .filter(|r| r.what == "watch pods (the node's)")
        .map(|r| r.sent)
        .sum()
}

/// The rows as docs/install.md tabulates them, with their totals.
fn print_bill(title: &str, rows: &[Row]) {
    eprintln!("{title}:\n| request | count | bytes sent | bytes answered |\n|---|---|---|---|");
    for r in rows {
        eprintln!(
            "| {} | {} | {} | {} |",
            r.what, r.requests, r.received, r.sent
        );
    }
    eprintln!(
        "| **all** | {} | {} | {} |",
        rows.iter().map(|r| r.requests).sum::<usize>(),
        rows.iter().map(|r| r.received).sum::<u64>(),
        rows.iter().map(|r| r.sent).sum::<u64>()
    );
}

#[test]
fn the_agents_requests_grow_with_its_node_not_with_the_cluster() {
    require_root();
    for ambient in [false, true] {
        // The chart rendered with ambient mode on grants what it reads.
        let api = if ambient {
            ApiServer::with_configuration("ambient")
        } else {
            ApiServer::start()
        };
        {
            // 200 pods on 20 other nodes, in 20 namespaces, beside 4 on the agent's.
            let mut pods = api.pods.lock().expect("pods");
            for i in 0..200 {
                let mut pod = sidecar_pod(&format!("team-{}", i % 20), &format!("p{i}"), &[]);
                pod["spec"]["nodeName"] = json!(format!("node-{}", i % 20 + 2));
                pods.push(pod);
            }
            for i in 0..4 {
                pods.push(sidecar_pod("shop", &format!("web-{i}"), &[]));
            }
        }
        for i in 0..20 {
            api.apply_namespace(json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": format!("team-{i}"), "uid": format!("ns-team-{i}")}
            }));
        }
        let node = ClusterNode::new(&api);
        // Ambient mode writes its probe rule in a throwaway node netns, and serves ztunnel on
        // a socket of the test's.
        let world = meshcap_tests::world::Node::new().expect("node netns");
        let sockets = ManifestDir::new();
        let (netns, socket) = (world.netns.path(), sockets.0.join("ztunnel.sock"));
        let env: Vec<(&str, &str)> = if ambient {
            vec![
                ("MESHCAP_AMBIENT_ENABLED", "true"),
                ("MESHCAP_AMBIENT_IN_KERNEL", "false"),
                ("MESHCAP_NODE_NETNS", netns.to_str().expect("utf-8")),
                ("MESHCAP_ZTUNNEL_SOCKET", socket.to_str().expect("utf-8")),
            ]
        } else {
            Vec::new()
        };
        let agent = node.start_agent(Backend::Iptables, &env);
        let at_start = bill(&api, 0);
        let ready = api.requests().len();
        std::thread::sleep(std::time::Duration::from_secs(3));
        let steady = bill(&api, ready);
        print_bill(&format!("ambient {ambient}: to Ready"), &at_start);
        print_bill(&format!("ambient {ambient}: then for 3 s"), &steady);
        // A change to another node's pod costs this node nothing; one to its own pod, that pod
        // once on the one watch.
        let before = pod_watch_bytes(&api);
        let mut elsewhere = sidecar_pod("team-0", "p0", &[("changed", "yes")]);
        elsewhere["spec"]["nodeName"] = json!("node-2");
        api.apply_pod(elsewhere);
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(
            pod_watch_bytes(&api),
            before,
            "another node's pod reached this node's watch"
        );
        let here = sidecar_pod("shop", "web-0", &[("changed", "yes")]);
        let size = here.to_string().len() as u64;
        api.apply_pod(here);
        eventually("the node's pod change is streamed", || {
            pod_watch_bytes(&api) > before + size
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}: {} bytes, {size} for the pod",
                pod_watch_bytes(&api) - before
            )
        });
        eprintln!(
            "ambient {ambient}: a change to one of the node's pods ({size} bytes of JSON): {} bytes on its watch",
            pod_watch_bytes(&api) - before
        );
        let cluster_wide: Vec<&String> = at_start
            .iter()
            .chain(&steady)
            .map(|r| &r.what)
            .filter(|k| {
                (k.starts_with("list ") || k.starts_with("watch ")) && k.contains("(the cluster's)")
            })
            .collect();
        // Namespaces are cluster-scoped objects: ambient mode reads their labels, as Istio's
        // node agent does (its namespace informer, cni/pkg/nodeagent/informers.go).
        let expected: Vec<String> = if ambient {
            vec![
                "list namespaces (the cluster's)".into(),
                "watch namespaces (the cluster's)".into(),
            ]
        } else {
            Vec::new()
        };
        assert_eq!(
            cluster_wide.into_iter().cloned().collect::<Vec<_>>(),
            expected,
            "ambient {ambient}: {at_start:?} {steady:?}\n{}",
            agent.log()
        );
        // One list of the node's pods: the watch's first, which the adoptions at start read
        // too (`agent/src/pods/feed.rs`).
        assert!(
            at_start
                .iter()
                .any(|r| r.what == "list pods (the node's)" && r.requests == 1),
            "one list of the node's pods: {at_start:?}"
        );
        // One pod watch, however many follow the node's pods (the pod source, the repair
        // controller, live enrollment): they share it, as Istio's share an informer.
        assert!(
            at_start
                .iter()
                .any(|r| r.what == "watch pods (the node's)" && r.requests == 1),
            "one watch of the node's pods: {at_start:?}"
        );
        // Its DaemonSet changes with every pod of it on any node (its status): the agent asks
        // for its metadata only, all it reads.
        let agent_user = meshcap_tests::rbac::service_account_user(&api.namespace, AGENT_ACCOUNT);
        let daemon_set_reads: Vec<bool> = api
            .requests()
            .iter()
            .filter(|r| {
                r.user == agent_user
                    && r.attrs.resource == "daemonsets"
                    && (r.attrs.verb == "list" || r.attrs.verb == "watch")
            })
            .map(|r| r.metadata_only)
            .collect();
        assert!(
            !daemon_set_reads.is_empty() && daemon_set_reads.iter().all(|m| *m),
            "the DaemonSet's list and watch ask for metadata only: {daemon_set_reads:?}"
        );
        assert!(
            steady.iter().all(|r| r.what.starts_with("watch ")),
            "steady: only watches, renewed: {steady:?}"
        );
    }
}
