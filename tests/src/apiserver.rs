//! A tiny Kubernetes API server for the tests (no kube-apiserver can run on these machines):
//! list and watch of pods (by field selector, as kube-rs's watcher asks), GET of one pod or
//! DaemonSet, and creation of `events.k8s.io/v1` Events, with real JSON on the real paths;
//! kube-rs is the client.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use serde_json::{Value, json};

/// The server; stops when dropped.
pub struct ApiServer {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// The pods it serves; add or remove them at any time.
    pub pods: Arc<Mutex<Vec<Value>>>,
    /// The DaemonSets it serves (GET by namespace and name).
    pub daemon_sets: Arc<Mutex<Vec<Value>>>,
    /// The Events created through it (POST), in order.
    pub events: Arc<Mutex<Vec<Value>>>,
    stop: Arc<AtomicBool>,
}

impl ApiServer {
    /// Starts serving on a free port of 127.0.0.1.
    ///
    /// # Panics
    /// When it cannot bind.
    #[must_use]
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let pods = Arc::new(Mutex::new(Vec::<Value>::new()));
        let daemon_sets = Arc::new(Mutex::new(Vec::<Value>::new()));
        let events = Arc::new(Mutex::new(Vec::<Value>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let state = Served {
            pods: pods.clone(),
            daemon_sets: daemon_sets.clone(),
            events: events.clone(),
            stop: stop.clone(),
        };
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                if state.stop.load(Ordering::Relaxed) {
                    break;
                }
                let state = state.clone();
                thread::spawn(move || serve_api(stream, &state));
            }
        });
        Self {
            addr,
            pods,
            daemon_sets,
            events,
            stop,
        }
    }

    /// A kubeconfig for it (plain HTTP, no credentials), written into `dir`.
    ///
    /// # Panics
    /// When it cannot be written.
    #[must_use]
    pub fn kubeconfig(&self, dir: &Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"http://{}\"}}\n\
                 users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\n\
                 current-context: test\n",
                self.addr
            ),
        )
        .expect("kubeconfig");
        path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(&self.addr);
    }
}

/// What the server holds, shared by its connections.
#[derive(Clone)]
struct Served {
    pods: Arc<Mutex<Vec<Value>>>,
    daemon_sets: Arc<Mutex<Vec<Value>>>,
    events: Arc<Mutex<Vec<Value>>>,
    stop: Arc<AtomicBool>,
}

fn serve_api(mut stream: TcpStream, state: &Served) {
    let (pods, daemon_sets, stop) = (&state.pods, &state.daemon_sets, &state.stop);
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut length = 0;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let method = request_line
        .split_whitespace()
        .next()
        .unwrap_or("GET")
        .to_owned();
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_owned();
    let (route, query) = path.split_once('?').unwrap_or((&path, ""));
    let respond = |stream: &mut TcpStream, code: &str, body: &Value| {
        let body = body.to_string();
        let _ = write!(
            stream,
            "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    };
    let parts: Vec<&str> = route.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["apis", "events.k8s.io", "v1", "namespaces", _, "events"] if method == "POST" => {
            let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            state.events.lock().expect("events").push(event.clone());
            respond(&mut stream, "201 Created", &event);
        }
        ["api", "v1", "pods"] if query.contains("watch=true") || query.contains("watch=1") => {
            // A watch that stays open and quiet; new pods are found by the agent's GET.
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            );
            let _ = stream.flush();
            for _ in 0..600 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
        }
        ["api", "v1", "pods"] => {
            let items: Vec<Value> = pods.lock().expect("pods").clone();
            respond(
                &mut stream,
                "200 OK",
                &json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items
                }),
            );
        }
        ["api", "v1", "namespaces", ns, "pods", name]
        | ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name] => {
            let objects = if parts[0] == "api" { pods } else { daemon_sets };
            let found = objects
                .lock()
                .expect("objects")
                .iter()
                .find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name)
                .cloned();
            match found {
                Some(pod) => respond(&mut stream, "200 OK", &pod),
                None => respond(
                    &mut stream,
                    "404 Not Found",
                    &json!({
                        "apiVersion": "v1", "kind": "Status", "status": "Failure",
                        "message": format!("\"{name}\" not found"), "reason": "NotFound", "code": 404
                    }),
                ),
            }
        }
        _ => respond(
            &mut stream,
            "404 Not Found",
            &json!({"kind": "Status", "code": 404}),
        ),
    }
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
}
