//! A tiny Kubernetes API server for the tests (no kube-apiserver can run on these machines):
//! list and watch of pods (filtered by the `spec.nodeName` field selector, as kube-rs's
//! watcher asks; the watch streams the changes made through [`ApiServer::apply_pod`] after the
//! resourceVersion it asks from) and of namespaces ([`ApiServer::apply_namespace`]), GET of one pod, DaemonSet or Namespace, DELETE of a pod with
//! preconditions, merge PATCH of a pod's labels and annotations through `pods/status` (null removes), and creation of
//! `events.k8s.io/v1` Events, with real JSON on the real paths; kube-rs is the client.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
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
    /// The Namespaces it serves (GET by name).
    pub namespaces: Arc<Mutex<Vec<Value>>>,
    /// The Events created through it (POST), in order.
    pub events: Arc<Mutex<Vec<Value>>>,
    /// The requests that changed pods (`DELETE …/pods/NAME` and `PATCH …/pods/NAME/status`):
    /// method, path and body, in order.
    pub writes: Arc<Mutex<Vec<(String, String, Value)>>>,
    /// Every change a watch streams (`ADDED`, `MODIFIED`, `DELETED` and the pod); a change's
    /// index + 1 is its resourceVersion.
    changes: Arc<Mutex<Vec<(String, Value)>>>,
    /// The same for namespaces changed through [`ApiServer::apply_namespace`].
    namespace_changes: Arc<Mutex<Vec<(String, Value)>>>,
    /// While set, each GET or list of Namespaces waits until it is cleared, counted in
    /// [`Self::held_namespace_gets`] as it starts waiting: a test holds the agent in the middle
    /// of a pod's decision (which reads its namespace's labels) to change the node meanwhile.
    pub hold_namespace_gets: Arc<AtomicBool>,
    /// The GETs and lists of Namespaces that waited.
    pub held_namespace_gets: Arc<AtomicUsize>,
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
        let namespaces = Arc::new(Mutex::new(Vec::<Value>::new()));
        let events = Arc::new(Mutex::new(Vec::<Value>::new()));
        let writes = Arc::new(Mutex::new(Vec::new()));
        let changes = Arc::new(Mutex::new(Vec::new()));
        let namespace_changes = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let hold_namespace_gets = Arc::new(AtomicBool::new(false));
        let held_namespace_gets = Arc::new(AtomicUsize::new(0));
        let state = Served {
            hold_namespace_gets: hold_namespace_gets.clone(),
            held_namespace_gets: held_namespace_gets.clone(),
            namespace_changes: namespace_changes.clone(),
            pods: pods.clone(),
            daemon_sets: daemon_sets.clone(),
            namespaces: namespaces.clone(),
            events: events.clone(),
            writes: writes.clone(),
            changes: changes.clone(),
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
            namespaces,
            events,
            writes,
            changes,
            namespace_changes,
            hold_namespace_gets,
            held_namespace_gets,
            stop,
        }
    }

    /// Adds `pod`, or replaces the pod of its namespace and name, as a change watches see
    /// (`ADDED` or `MODIFIED`), with a new resourceVersion.
    ///
    /// # Panics
    /// When a lock is poisoned.
    pub fn apply_pod(&self, pod: Value) {
        record(&self.pods, &self.changes, pod);
    }

    /// Adds `namespace`, or replaces its namesake, as a change namespace watches see.
    ///
    /// # Panics
    /// When a lock is poisoned.
    pub fn apply_namespace(&self, namespace: Value) {
        record(&self.namespaces, &self.namespace_changes, namespace);
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
    namespaces: Arc<Mutex<Vec<Value>>>,
    events: Arc<Mutex<Vec<Value>>>,
    writes: Arc<Mutex<Vec<(String, String, Value)>>>,
    changes: Arc<Mutex<Vec<(String, Value)>>>,
    namespace_changes: Arc<Mutex<Vec<(String, Value)>>>,
    hold_namespace_gets: Arc<AtomicBool>,
    held_namespace_gets: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

/// Waits while [`ApiServer::hold_namespace_gets`] is set, counted.
fn hold(state: &Served) {
    if state.hold_namespace_gets.load(Ordering::SeqCst) {
        state.held_namespace_gets.fetch_add(1, Ordering::SeqCst);
        while state.hold_namespace_gets.load(Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Stores `pod` (added or replacing its namesake) with the next resourceVersion and logs the
/// change.
fn record(pods: &Mutex<Vec<Value>>, changes: &Mutex<Vec<(String, Value)>>, mut pod: Value) {
    let mut changes = changes.lock().expect("changes");
    let mut pods = pods.lock().expect("pods");
    pod["metadata"]["resourceVersion"] = json!((changes.len() + 1).to_string());
    let same = |p: &Value| {
        p["metadata"]["namespace"] == pod["metadata"]["namespace"]
            && p["metadata"]["name"] == pod["metadata"]["name"]
    };
    let kind = if let Some(slot) = pods.iter_mut().find(|p| same(p)) {
        *slot = pod.clone();
        "MODIFIED"
    } else {
        pods.push(pod.clone());
        "ADDED"
    };
    changes.push((kind.to_owned(), pod));
}

/// Streams the `changes` after the resourceVersion `query` asks from, then each new one that
/// `keep` accepts, for a minute (kube-rs then watches again from the last it saw).
fn watch(
    stream: &mut TcpStream,
    changes: &Mutex<Vec<(String, Value)>>,
    query: &str,
    stop: &AtomicBool,
    keep: impl Fn(&Value) -> bool,
) {
    let mut next: usize = param(query, "resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0);
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let _ = stream.flush();
    for _ in 0..12_000 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let pending: Vec<(String, Value)> = {
            let changes = changes.lock().expect("changes");
            let new = changes.get(next..).unwrap_or_default().to_vec();
            next = changes.len().max(next);
            new
        };
        for (kind, object) in pending {
            if keep(&object) {
                let line = format!("{}\n", json!({"type": kind, "object": object}));
                if write!(stream, "{:x}\r\n{line}\r\n", line.len()).is_err() {
                    return;
                }
            }
        }
        let _ = stream.flush();
        thread::sleep(Duration::from_millis(5));
    }
}

/// The node a `fieldSelector=spec.nodeName=NODE` query asks for (URL-encoded or not).
fn node_selected(query: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let value = kv.strip_prefix("fieldSelector=")?;
        let value = value.replace("%3D", "=").replace("%3d", "=");
        value.strip_prefix("spec.nodeName=").map(str::to_owned)
    })
}

/// The query parameter `name`'s value.
fn param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

fn on_node(pod: &Value, node: Option<&str>) -> bool {
    node.is_none_or(|n| pod["spec"]["nodeName"] == n)
}

/// One JSON response, and the connection closed.
fn respond(stream: &mut TcpStream, code: &str, body: &Value) {
    let body = body.to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The API server's answer for an object it does not have.
fn not_found(stream: &mut TcpStream, name: &str) {
    respond(
        stream,
        "404 Not Found",
        &json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": format!("\"{name}\" not found"), "reason": "NotFound", "code": 404
        }),
    );
}

fn serve_api(mut stream: TcpStream, state: &Served) {
    let (pods, daemon_sets, stop) = (&*state.pods, &*state.daemon_sets, &*state.stop);
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
    let parts: Vec<&str> = route.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["apis", "events.k8s.io", "v1", "namespaces", _, "events"] if method == "POST" => {
            let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            state.events.lock().expect("events").push(event.clone());
            respond(&mut stream, "201 Created", &event);
        }
        ["api", "v1", "pods"] if param(query, "watch").is_some_and(|w| w == "true" || w == "1") => {
            let node = node_selected(query);
            watch(&mut stream, &state.changes, query, stop, |pod| {
                on_node(pod, node.as_deref())
            });
        }
        ["api", "v1", "namespaces"]
            if param(query, "watch").is_some_and(|w| w == "true" || w == "1") =>
        {
            watch(&mut stream, &state.namespace_changes, query, stop, |_| true);
        }
        ["api", "v1", "namespaces"] => {
            hold(state);
            let items = state.namespaces.lock().expect("namespaces").clone();
            let version = state
                .namespace_changes
                .lock()
                .expect("changes")
                .len()
                .to_string();
            respond(
                &mut stream,
                "200 OK",
                &json!({
                    "apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": version}, "items": items
                }),
            );
        }
        ["api", "v1", "pods"] => {
            let node = node_selected(query);
            let items: Vec<Value> = pods
                .lock()
                .expect("pods")
                .iter()
                .filter(|p| on_node(p, node.as_deref()))
                .cloned()
                .collect();
            let version = state.changes.lock().expect("changes").len().to_string();
            respond(
                &mut stream,
                "200 OK",
                &json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": version}, "items": items
                }),
            );
        }
        ["api", "v1", "namespaces", ns, "pods", name] if method == "DELETE" => {
            let options: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            state.writes.lock().expect("writes").push((
                method.clone(),
                route.to_owned(),
                options.clone(),
            ));
            let mut all = pods.lock().expect("pods");
            let index = all
                .iter()
                .position(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name);
            let conflict = index.is_some_and(|i| {
                let pre = &options["preconditions"];
                ["uid", "resourceVersion"]
                    .iter()
                    .any(|k| !pre[k].is_null() && pre[k] != all[i]["metadata"][k])
            });
            match index {
                Some(_) if conflict => respond(
                    &mut stream,
                    "409 Conflict",
                    &json!({"kind": "Status", "status": "Failure", "reason": "Conflict", "code": 409,
                            "message": "Precondition failed"}),
                ),
                Some(i) => {
                    let pod = all.remove(i);
                    drop(all);
                    state
                        .changes
                        .lock()
                        .expect("changes")
                        .push(("DELETED".into(), pod.clone()));
                    respond(&mut stream, "200 OK", &pod);
                }
                None => respond(
                    &mut stream,
                    "404 Not Found",
                    &json!({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                            "message": format!("pods \"{name}\" not found")}),
                ),
            }
        }
        ["api", "v1", "namespaces", ns, "pods", name, "status"] if method == "PATCH" => {
            let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            state.writes.lock().expect("writes").push((
                method.clone(),
                route.to_owned(),
                patch.clone(),
            ));
            let found = pods
                .lock()
                .expect("pods")
                .iter()
                .find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name)
                .cloned();
            if let Some(mut pod) = found {
                for field in ["labels", "annotations"] {
                    for (k, v) in patch["metadata"][field].as_object().into_iter().flatten() {
                        // A merge patch's null removes the key (RFC 7386).
                        match (v.is_null(), pod["metadata"][field].as_object_mut()) {
                            (true, Some(map)) => {
                                map.remove(k);
                            }
                            (true, None) => {}
                            (false, _) => pod["metadata"][field][k] = v.clone(),
                        }
                    }
                }
                record(pods, &state.changes, pod.clone());
                respond(&mut stream, "200 OK", &pod);
            } else {
                respond(
                    &mut stream,
                    "404 Not Found",
                    &json!({"kind": "Status", "code": 404}),
                );
            }
        }
        ["api", "v1", "namespaces", name] => {
            hold(state);
            let found = state
                .namespaces
                .lock()
                .expect("namespaces")
                .iter()
                .find(|n| n["metadata"]["name"] == *name)
                .cloned();
            match found {
                Some(namespace) => respond(&mut stream, "200 OK", &namespace),
                None => not_found(&mut stream, name),
            }
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
                None => not_found(&mut stream, name),
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
