//! The repair controller against the in-test API server and the real kernel: a pod that
//! started without its capture (its `istio-validation` last exited 126) is captured in place in
//! `repairPods` mode, labelled in `labelPods`, deleted with preconditions in `deletePods`; a
//! healthy pod, a pod of another node and a pod repaired once are left alone. Each mode with
//! exactly the RBAC the chart renders for it, every rule of which it uses.
use meshcap_tests::{
    agent::{Agent, Backend},
    apiserver::{AGENT_ACCOUNT, ApiServer},
    fixtures::{ManifestDir, broken_pod, eventually, leftovers, sidecar_pod, unique_ip},
    kubelet::{Sandbox, cni, config},
    require_root,
    wired::Wired,
};
use serde_json::{Value, json};

meshcap_tests::test_on_both_backends!(a_pod_that_started_uncaptured_is_captured_in_place);

/// `pod` whose validation passed.
fn healthy(mut pod: Value, ip: &str) -> Value {
    pod["status"] = json!({
        "podIP": ip, "podIPs": [{"ip": ip}],
        "initContainerStatuses": [{
            "name": "istio-validation", "image": "proxyv2", "imageID": "", "ready": true,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        }],
    });
    pod
}

/// The agent's `istio_cni_repair_pods_repaired_total` samples, sorted.
fn repairs(agent: &Agent) -> Vec<String> {
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    let mut samples: Vec<String> = metrics
        .lines()
        .filter(|l| l.starts_with("istio_cni_repair_pods_repaired_total"))
        .map(str::to_owned)
        .collect();
    samples.sort();
    samples
}

fn kube_agent(backend: Backend, api: &ApiServer, dir: &ManifestDir, env: &[(&str, &str)]) -> Agent {
    let kubeconfig = api.kubeconfig(&dir.0);
    let mut all = vec![("KUBECONFIG", kubeconfig.to_str().expect("utf-8"))];
    all.extend_from_slice(env);
    let agent =
        Agent::start(backend, &["--pods", "kube", "--node-name", "node-1"], &all).expect("agent");
    eventually("the agent's pod watch syncs", || {
        agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200)
    })
    .expect("ready");
    agent
}

fn a_pod_that_started_uncaptured_is_captured_in_place(backend: Backend) {
    require_root();
    let api = ApiServer::start();
    let dir = ManifestDir::new();
    let agent = kube_agent(backend, &api, &dir, &[]);
    let wired = Wired::new(&agent);
    let ip = unique_ip();
    wired
        .pod
        .add_address("eth0", &format!("{ip}/32"))
        .expect("the pod's address");
    let (_envoy, _upstream) = wired.servers();
    assert_eq!(
        wired.app_dial().0,
        "upstream",
        "the pod started before its capture: its app bypasses Envoy"
    );

    // Never touched: a healthy pod, and a broken pod of another node (holding the same
    // address: seen, it would be repaired into this pod's namespace).
    api.apply_pod(healthy(sidecar_pod("shop", "fine", &[]), &unique_ip()));
    let mut elsewhere = broken_pod(sidecar_pod("shop", "elsewhere", &[]), &ip, 3);
    elsewhere["spec"]["nodeName"] = json!("node-2");
    api.apply_pod(elsewhere);

    let name = format!("web-{}", backend.name());
    api.apply_pod(broken_pod(sidecar_pod("shop", &name, &[]), &ip, 3));
    eventually("the repair controller captures the pod in place", || {
        wired.app_dial().0 == "envoy"
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert_eq!(
        wired.app_dial(),
        ("envoy".to_owned(), Some("10.0.0.1:80".to_owned()))
    );
    // Counted once the controller has its answer, a moment after the capture works.
    let repaired = ["istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"} 1"];
    eventually("the repair is counted", || repairs(&agent) == repaired)
        .unwrap_or_else(|e| panic!("{e}: {:?}", repairs(&agent)));
    let mut event = Value::Null;
    eventually("an Event on the repaired pod", || {
        event = api
            .events
            .lock()
            .expect("events")
            .iter()
            .find(|e| e["regarding"]["name"] == name.as_str())
            .cloned()
            .unwrap_or(Value::Null);
        !event.is_null()
    })
    .expect("event");
    assert_eq!(event["reason"], "RepairBrokenPod", "{event}");
    assert_eq!(event["regarding"]["uid"], format!("uid-{name}"), "{event}");
    assert!(
        api.events
            .lock()
            .expect("events")
            .iter()
            .all(|e| e["regarding"]["name"] == name.as_str()),
        "only the broken pod of this node is acted on"
    );

    // kubelet restarts the validation (which now passes, but the status still shows the last
    // failure for a moment): repaired once, never again.
    api.apply_pod(broken_pod(sidecar_pod("shop", &name, &[]), &ip, 4));
    // The controller handles changes in order: once a later pod (broken, with no namespace on
    // the machine: a failed repair) is counted, the change above has been handled too.
    api.apply_pod(broken_pod(
        sidecar_pod("shop", &format!("marker-{}", backend.name()), &[]),
        &unique_ip(),
        3,
    ));
    let after = [
        "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"fail\"} 1",
        "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"} 1",
    ];
    eventually("the later pod is handled", || repairs(&agent) == after)
        .unwrap_or_else(|e| panic!("{e}: {:?}", repairs(&agent)));

    // The runtime's own CHECK and DEL (its sandbox id, the pod's netns) find the capture.
    let sandbox = Sandbox::new("shop", &name, &wired.pod);
    let conf = config("1.1.0", &agent.socket, &ip);
    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert!(check.success, "{check:?}\n{}", agent.log());
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "{del:?}");
    assert_eq!(wired.app_dial().0, "upstream");
    assert_eq!(
        leftovers(&wired.pod).expect("leftovers"),
        Vec::<String>::new()
    );
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
}

#[test]
fn label_pods_patches_exactly_the_label() {
    require_root();
    let api = ApiServer::with_configuration("repair-label-pods");
    let dir = ManifestDir::new();
    let agent = kube_agent(
        Backend::Iptables,
        &api,
        &dir,
        &[
            ("MESHCAP_REPAIR_REPAIR_PODS", "false"),
            ("MESHCAP_REPAIR_LABEL_PODS", "true"),
        ],
    );
    let ip = unique_ip();
    api.apply_pod(broken_pod(sidecar_pod("shop", "labelled", &[]), &ip, 3));
    eventually("the controller labels the pod", || {
        !api.writes.lock().expect("writes").is_empty()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let writes = api.writes.lock().expect("writes").clone();
    assert_eq!(
        writes,
        [(
            "PATCH".to_owned(),
            "/api/v1/namespaces/shop/pods/labelled/status".to_owned(),
            json!({"metadata": {"labels": {"cni.istio.io/uninitialized": "true"}}})
        )]
    );
    // The labelled pod (a change the watch delivers) is skipped, not labelled again.
    eventually("the labelled pod is seen and skipped", || {
        repairs(&agent).len() == 2
    })
    .expect("skip");
    assert_eq!(
        repairs(&agent),
        [
            "istio_cni_repair_pods_repaired_total{type=\"label\",result=\"skip\"} 1",
            "istio_cni_repair_pods_repaired_total{type=\"label\",result=\"success\"} 1",
        ]
    );
    assert_eq!(api.writes.lock().expect("writes").len(), 1);
    api.assert_role_used(AGENT_ACCOUNT, "meshcap-agent-repair");
}

#[test]
fn delete_pods_deletes_with_preconditions() {
    require_root();
    let api = ApiServer::with_configuration("repair-delete-pods");
    let dir = ManifestDir::new();
    let agent = kube_agent(
        Backend::Iptables,
        &api,
        &dir,
        &[
            ("MESHCAP_REPAIR_REPAIR_PODS", "false"),
            ("MESHCAP_REPAIR_DELETE_PODS", "true"),
            ("MESHCAP_REPAIR_LABEL_PODS", "true"),
        ],
    );
    api.apply_pod(broken_pod(
        sidecar_pod("shop", "doomed", &[]),
        &unique_ip(),
        3,
    ));
    let version = api
        .pods
        .lock()
        .expect("pods")
        .iter()
        .find(|p| p["metadata"]["name"] == "doomed")
        .map(|p| p["metadata"]["resourceVersion"].clone())
        .expect("the pod");
    eventually("the controller deletes the pod", || {
        !api.writes.lock().expect("writes").is_empty()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let (method, path, options) = api.writes.lock().expect("writes")[0].clone();
    assert_eq!(
        (method.as_str(), path.as_str()),
        ("DELETE", "/api/v1/namespaces/shop/pods/doomed")
    );
    assert_eq!(
        options["preconditions"],
        json!({"uid": "uid-doomed", "resourceVersion": version}),
        "{options}"
    );
    assert!(
        !api.pods
            .lock()
            .expect("pods")
            .iter()
            .any(|p| p["metadata"]["name"] == "doomed")
    );
    // The server has the request before the controller has the answer it counts.
    let deleted = ["istio_cni_repair_pods_repaired_total{type=\"delete\",result=\"success\"} 1"];
    eventually("the deletion is counted", || repairs(&agent) == deleted)
        .unwrap_or_else(|e| panic!("{e}: {:?}", repairs(&agent)));
    assert_eq!(
        api.writes.lock().expect("writes").len(),
        1,
        "deletePods wins over labelPods"
    );
    api.assert_role_used(AGENT_ACCOUNT, "meshcap-agent-repair");
}
