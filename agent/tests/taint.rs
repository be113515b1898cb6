//! Startup-taint removal against an in-test HTTP server that speaks the real Node API paths
//! (`GET` and `PATCH /api/v1/nodes/{name}`, `application/json-patch+json`, applying the patch as
//! the API server does, `test` op included), with kube-rs on the client side. No kube-apiserver
//! can be installed on these machines; this is the closest real thing.
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use meshcap_agent::taint::{self, Removal, TaintError};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream},
};

const NODE: &str = "node-1";

/// The API server's state: one node, the requests it served, and an optional concurrent edit
/// applied just before the first PATCH is handled.
#[derive(Default)]
struct State {
    node: Value,
    requests: Vec<(String, String, String)>,
    interfere: Option<Value>,
}

struct ApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl ApiServer {
    async fn start(taints: Value) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(State {
            node: json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": { "name": NODE, "resourceVersion": "1" },
                "spec": { "podCIDR": "10.244.0.0/24", "taints": taints },
            }),
            ..State::default()
        }));
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone()));
            }
        });
        Self { addr, state }
    }

    fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        kube::Client::try_from(kube::Config::new(url)).expect("kube client")
    }

    fn taints(&self) -> Value {
        self.state.lock().expect("state").node["spec"]["taints"].clone()
    }

    fn requests(&self) -> Vec<(String, String, String)> {
        self.state.lock().expect("state").requests.clone()
    }
}

/// One HTTP/1.1 connection: requests with Content-Length bodies, answered with JSON.
async fn serve(stream: TcpStream, state: Arc<Mutex<State>>) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).await.unwrap_or(0) == 0 {
            return;
        }
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_owned();
        let target = parts.next().unwrap_or_default().to_owned();
        let (mut length, mut content_type) = (0, String::new());
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).await.unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap_or(0),
                    "content-type" => value.trim().clone_into(&mut content_type),
                    _ => {}
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        let (code, reply) = handle(&state, &method, &target, &content_type, &body);
        let reply = reply.to_string();
        let response = format!(
            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        );
        if reader
            .get_mut()
            .write_all(response.as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

fn handle(
    state: &Mutex<State>,
    method: &str,
    target: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, Value) {
    let mut state = state.lock().expect("state");
    let path = target.split('?').next().unwrap_or_default().to_owned();
    state
        .requests
        .push((method.to_owned(), path.clone(), content_type.to_owned()));
    let Some(name) = path.strip_prefix("/api/v1/nodes/") else {
        return status(404, "NotFound", &format!("no route {path}"));
    };
    if name != NODE {
        return status(404, "NotFound", &format!("nodes \"{name}\" not found"));
    }
    match method {
        "GET" => (200, state.node.clone()),
        "PATCH" if content_type == "application/json-patch+json" => {
            if let Some(taints) = state.interfere.take() {
                state.node["spec"]["taints"] = taints;
            }
            let Ok(patch) = serde_json::from_slice::<json_patch::Patch>(body) else {
                return status(400, "BadRequest", "not a JSON patch");
            };
            let mut node = state.node.clone();
            match json_patch::patch(&mut node, &patch) {
                Ok(()) => {
                    state.node = node;
                    (200, state.node.clone())
                }
                Err(err) => status(422, "Invalid", &err.to_string()),
            }
        }
        _ => status(415, "UnsupportedMediaType", content_type),
    }
}

fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code,
        }),
    )
}

fn not_ready(key: &str) -> Value {
    json!({ "key": key, "effect": "NoSchedule" })
}

#[tokio::test]
async fn removes_only_its_own_taint_with_a_json_patch() {
    let other = json!({ "key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule" });
    let server = ApiServer::start(json!([other, not_ready(taint::DEFAULT_KEY)])).await;
    let removal = taint::remove(server.client(), NODE, taint::DEFAULT_KEY)
        .await
        .expect("removal");
    assert_eq!(removal, Removal::Removed);
    assert_eq!(server.taints(), json!([other]));
    let requests = server.requests();
    assert_eq!(
        requests,
        [
            ("GET".into(), format!("/api/v1/nodes/{NODE}"), String::new()),
            (
                "PATCH".into(),
                format!("/api/v1/nodes/{NODE}"),
                "application/json-patch+json".into()
            ),
        ]
    );

    let again = taint::remove(server.client(), NODE, taint::DEFAULT_KEY)
        .await
        .expect("second removal");
    assert_eq!(again, Removal::Absent, "a second call patches nothing");
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn a_node_without_taints_is_left_alone() {
    let server = ApiServer::start(Value::Null).await;
    let removal = taint::remove(server.client(), NODE, taint::ISTIO_KEY)
        .await
        .expect("removal");
    assert_eq!(removal, Removal::Absent);
    assert!(server.requests().iter().all(|(method, ..)| method == "GET"));
}

#[tokio::test]
async fn a_concurrent_edit_is_kept_and_the_removal_retried() {
    let server = ApiServer::start(json!([not_ready(taint::ISTIO_KEY)])).await;
    let added = json!({ "key": "example.com/maintenance", "effect": "NoExecute" });
    server.state.lock().expect("state").interfere =
        Some(json!([not_ready(taint::ISTIO_KEY), added]));
    let removal = taint::remove(server.client(), NODE, taint::ISTIO_KEY)
        .await
        .expect("removal");
    assert_eq!(removal, Removal::Removed);
    assert_eq!(
        server.taints(),
        json!([added]),
        "the other writer's taint survives"
    );
    let patches = server
        .requests()
        .iter()
        .filter(|(method, ..)| method == "PATCH")
        .count();
    assert_eq!(
        patches, 2,
        "the first patch's test op failed, the second applied"
    );
}

#[tokio::test]
async fn errors_name_the_node_and_the_key() {
    let server = ApiServer::start(json!([])).await;
    let err = taint::remove(server.client(), "node-9", taint::DEFAULT_KEY)
        .await
        .expect_err("no such node");
    assert!(matches!(err, TaintError::Api { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.starts_with("node node-9: removing taint cni.meshcap.io/not-ready:"),
        "{message}"
    );
}
