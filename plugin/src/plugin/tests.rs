//! One invocation at a time, against no agent or a dying one.
use serde_json::json;

use super::*;
use crate::cni::env;

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
        // DEL, its log lines, ADD, its log lines.
        for _ in 0..4 {
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
