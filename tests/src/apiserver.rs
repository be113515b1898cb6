//! A tiny Kubernetes API server for the tests (no kube-apiserver can run on these machines).
//!
//! It authenticates and authorizes as Kubernetes does: every request carries a ServiceAccount
//! token, refused with 401 (a `Status` of reason `Unauthorized`) once its ServiceAccount, or the
//! pod or Secret it is bound to, is deleted; every authenticated request is decided by RBAC
//! ([`crate::rbac`]) from the chart's rendering (its configuration with the values a test turns
//! on: [`crate::chart::configuration`]), refused with 403 (a `Status` of reason `Forbidden` naming the
//! user, verb, resource and namespace as the API server words it). Self reviews
//! (`SelfSubjectAccessReview`, `SelfSubjectRulesReview`) are answered from the same RBAC. A
//! watch is authorized when it starts and streams on after the credential or the binding is
//! gone, as a real one does until it times out ([`ApiServer::close_watches`] ends them all).
//! Every grant used is recorded, so a test can require that nothing shipped goes unused.
//!
//! Served: list and watch of pods (filtered by the `spec.nodeName` field selector, as kube-rs's
//! watcher asks; the watch streams the changes made through [`ApiServer::apply_pod`] after the
//! resourceVersion it asks from) and of namespaces ([`ApiServer::apply_namespace`]), GET of one pod, DaemonSet, Node or Namespace, list and
//! watch of DaemonSets (one name, by field selector), a JSON patch of a Node, DELETE of a pod with
//! preconditions, merge PATCH of a pod's labels and annotations through `pods/status` (null removes), creation and merge patch of
//! `events.k8s.io/v1` Events, creation of Namespaces and pods, deletion of a Namespace with its
//! pods, lists of Nodes and of Namespaces by label, of a namespace's pods by label, a pod's log
//! ([`ApiServer::pod_logs`]), and `pods/proxy` (a GET relayed to the pod's `status.podIP` and
//! the port named, as the API server proxies it), with real JSON on the real paths (metadata
//! only, `PartialObjectMetadata`, when the client's `Accept` asks for it); kube-rs is the
//! client.
use std::{
    io::{self, BufRead as _, BufReader, Read as _, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    thread,
    time::Duration,
};

use serde_json::{Value, json};

use crate::rbac::{self, Attributes, Grant, param};

/// The namespace `deploy/` installs meshcap into (another when the objects served say so:
/// [`ApiServer::namespace`]).
pub const SYSTEM_NAMESPACE: &str = "meshcap-system";
/// The node label docs/install.md's switch between istio-cni and meshcap moves nodes with.
pub const SWITCH_LABEL: &str = "meshcap.io/cni";
/// The agent's ServiceAccount.
pub const AGENT_ACCOUNT: &str = "meshcap-agent";
/// The plugin's ServiceAccount (its decisions while no agent runs).
pub const CNI_ACCOUNT: &str = "meshcap-cni";
/// The Secret holding the plugin's token.
pub const CNI_TOKEN_SECRET: &str = "meshcap-cni-token";
/// The DaemonSet `deploy/` runs, and the uid this server gives it.
pub const DAEMON_SET: &str = "meshcap-agent";
/// The uid of the shipped DaemonSet here.
pub const DAEMON_SET_UID: &str = "ds-1";
/// The agent's pod, which owns the agent's token, on [`NODE`].
pub const AGENT_POD: &str = "meshcap-agent-x7k2p";
/// The node the tests' agents run on.
pub const NODE: &str = "node-1";

/// A ServiceAccount token the server issued.
#[derive(Clone, Debug)]
struct Token {
    value: String,
    namespace: String,
    account: String,
    account_uid: String,
    /// A pod (namespace, name, uid) or a Secret (namespace, name) it is bound to.
    pod: Option<(String, String, String)>,
    secret: Option<(String, String)>,
}

/// Identities, RBAC and what was asked of them.
#[derive(Default)]
struct Auth {
    /// The rendered objects that are not served as resources: ServiceAccounts, Secrets,
    /// Roles, ClusterRoles and their bindings, the ConfigMap.
    objects: Vec<Value>,
    tokens: Vec<Token>,
    /// Each allowed request's user and grant.
    used: Vec<(String, Grant)>,
    /// Each allowed request, in order.
    requests: Vec<Request>,
    /// Each refused request: user (empty: unauthenticated), attributes, code.
    refused: Vec<(String, Attributes, u16)>,
}

/// An allowed request: who asked what, with its query (a list's or watch's selectors).
#[derive(Clone, Debug)]
pub struct Request {
    /// The user.
    pub user: String,
    /// What it asked, as RBAC reads it (`watch` for a list with `watch=true`).
    pub attrs: Attributes,
    /// The query string.
    pub query: String,
    /// Whether it asked for metadata only (`PartialObjectMetadata`).
    pub metadata_only: bool,
    /// The bytes its connection carried.
    pub traffic: Arc<Traffic>,
}

/// The bytes one request moved over its connection, as HTTP/1.1 carries them (this server
/// speaks no TLS): the request line, headers and body it received, and everything it answered;
/// a watch's answer grows as it streams.
#[derive(Debug, Default)]
pub struct Traffic {
    received: AtomicU64,
    sent: AtomicU64,
}

impl Traffic {
    /// The bytes the client sent.
    #[must_use]
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// The bytes the server answered with so far.
    #[must_use]
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

/// A connection whose answer is counted in its request's [`Traffic`].
struct Conn {
    stream: TcpStream,
    traffic: Arc<Traffic>,
    /// The client asked for metadata only (`Accept: …;as=PartialObjectMetadata…`).
    metadata_only: bool,
}

impl Conn {
    /// `object` (or each item of a list) as the client asked for it: with metadata only, as
    /// the API server answers such a request (`PartialObjectMetadata`, `…List`).
    fn as_asked(&self, object: &Value) -> Value {
        if !self.metadata_only || object["kind"] == "Status" {
            return object.clone();
        }
        let partial = |o: &Value| json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": o["metadata"]});
        match object["items"].as_array() {
            Some(items) => json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                "metadata": object["metadata"], "items": items.iter().map(partial).collect::<Vec<_>>()
            }),
            None => partial(object),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let written = self.stream.write(buf)?;
        self.traffic
            .sent
            .fetch_add(written as u64, Ordering::Relaxed);
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// The server; stops when dropped.
pub struct ApiServer {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// The namespace meshcap is installed in: its DaemonSet's.
    pub namespace: String,
    /// The pods it serves; add or remove them at any time.
    pub pods: Arc<Mutex<Vec<Value>>>,
    /// The DaemonSets it serves; change them with [`ApiServer::apply_daemon_set`] and
    /// [`ApiServer::delete`] so that watches see it.
    pub daemon_sets: Arc<Mutex<Vec<Value>>>,
    /// The Namespaces it serves (GET by name).
    pub namespaces: Arc<Mutex<Vec<Value>>>,
    /// The Nodes it serves (GET, JSON patch).
    pub nodes: Arc<Mutex<Vec<Value>>>,
    /// The Events created through it (POST), in order.
    pub events: Arc<Mutex<Vec<Value>>>,
    /// The requests that changed pods (`DELETE …/pods/NAME` and `PATCH …/pods/NAME/status`)
    /// and the creations (`POST`, with the object stored) and namespace deletions (`DELETE
    /// /api/v1/namespaces/NAME`, body null): method, path and body, in order.
    pub writes: Arc<Mutex<Vec<(String, String, Value)>>>,
    /// Every change a watch streams (`ADDED`, `MODIFIED`, `DELETED` and the pod); a change's
    /// index + 1 is its resourceVersion.
    changes: Arc<Mutex<Vec<(String, Value)>>>,
    /// The same for namespaces changed through [`ApiServer::apply_namespace`].
    namespace_changes: Arc<Mutex<Vec<(String, Value)>>>,
    /// The same for DaemonSets.
    daemon_set_changes: Arc<Mutex<Vec<(String, Value)>>>,
    auth: Arc<Mutex<Auth>>,
    /// Bumped by [`ApiServer::close_watches`]: a watch started before ends.
    watch_epoch: Arc<AtomicUsize>,
    /// While set, each GET or list of Namespaces waits until it is cleared, counted in
    /// [`Self::held_namespace_gets`] as it starts waiting: a test holds the agent in the middle
    /// of a pod's decision (which reads its namespace's labels) to change the node meanwhile.
    pub hold_namespace_gets: Arc<AtomicBool>,
    /// The GETs and lists of Namespaces that waited.
    pub held_namespace_gets: Arc<AtomicUsize>,
    /// What `GET …/pods/NAME/log` answers, by namespace and pod (any container): a test
    /// playing kubelet fills it.
    pub pod_logs: Arc<Mutex<Vec<(String, String, String)>>>,
    stop: Arc<AtomicBool>,
}

impl ApiServer {
    /// Starts serving on a free port of 127.0.0.1 what `kubectl apply -f deploy/` creates (the
    /// chart's defaults): its namespace, ServiceAccounts (the plugin's with its token Secret
    /// filled, as the token controller does), RBAC and DaemonSet, the DaemonSet's pod on
    /// [`NODE`] (whose token [`ApiServer::kubeconfig`] hands out) and the node.
    ///
    /// # Panics
    /// When it cannot bind.
    #[must_use]
    pub fn start() -> Self {
        Self::with_configuration("defaults")
    }

    /// [`ApiServer::start`] with what the chart renders for the configuration `name` of
    /// `tests/chart-configurations.yaml` (`ambient`, `repair-label-pods`, ...): its RBAC is
    /// what a feature's test runs under.
    ///
    /// # Panics
    /// When it cannot bind, or the configuration cannot be rendered.
    #[must_use]
    pub fn with_configuration(name: &str) -> Self {
        Self::with_objects(
            crate::chart::configuration(name)
                .unwrap_or_else(|e| panic!("the chart's {name} configuration: {e:#}")),
        )
    }

    /// Serves `objects` (rendered manifests: `deploy/`, or `helm template` output).
    ///
    /// # Panics
    /// When it cannot bind, or the objects hold no DaemonSet for the agent.
    #[must_use]
    pub fn with_objects(objects: Vec<Value>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let namespace = objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == DAEMON_SET)
            .and_then(|o| o["metadata"]["namespace"].as_str())
            .expect("the objects hold meshcap's DaemonSet")
            .to_owned();
        let server = Self {
            addr,
            namespace,
            pods: Arc::default(),
            daemon_sets: Arc::default(),
            namespaces: Arc::default(),
            nodes: Arc::default(),
            events: Arc::default(),
            writes: Arc::default(),
            changes: Arc::default(),
            namespace_changes: Arc::default(),
            daemon_set_changes: Arc::default(),
            auth: Arc::default(),
            watch_epoch: Arc::default(),
            hold_namespace_gets: Arc::default(),
            held_namespace_gets: Arc::default(),
            pod_logs: Arc::default(),
            stop: Arc::default(),
        };
        server.install(objects);
        let state = Served {
            pods: server.pods.clone(),
            daemon_sets: server.daemon_sets.clone(),
            namespaces: server.namespaces.clone(),
            nodes: server.nodes.clone(),
            events: server.events.clone(),
            writes: server.writes.clone(),
            changes: server.changes.clone(),
            namespace_changes: server.namespace_changes.clone(),
            daemon_set_changes: server.daemon_set_changes.clone(),
            auth: server.auth.clone(),
            watch_epoch: server.watch_epoch.clone(),
            hold_namespace_gets: server.hold_namespace_gets.clone(),
            held_namespace_gets: server.held_namespace_gets.clone(),
            pod_logs: server.pod_logs.clone(),
            stop: server.stop.clone(),
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
        server
    }

    /// Creates what the manifests hold, as the API server and its controllers would.
    fn install(&self, objects: Vec<Value>) {
        let mut auth = self.auth.lock().expect("auth");
        for mut object in objects {
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            match kind.as_str() {
                "Namespace" => record(&self.namespaces, &self.namespace_changes, object),
                "DaemonSet" => {
                    object["metadata"]["uid"] = json!(DAEMON_SET_UID);
                    record(&self.daemon_sets, &self.daemon_set_changes, object);
                }
                "ServiceAccount" => {
                    object["metadata"]["uid"] = json!(format!("sa-{name}"));
                    auth.objects.push(object);
                }
                _ => auth.objects.push(object),
            }
        }
        drop(auth);
        self.fill_token_secrets();
        self.nodes.lock().expect("nodes").push(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "uid": "node-uid-1", "resourceVersion": "1",
                         "labels": {"kubernetes.io/hostname": NODE,
                                    "kubernetes.io/arch": "amd64",
                                    "kubernetes.io/os": "linux"}},
            "spec": {},
        }));
        self.apply_pod(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": AGENT_POD, "namespace": self.namespace, "uid": "agent-pod-1",
                         "labels": {"app.kubernetes.io/name": DAEMON_SET},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                              "name": DAEMON_SET, "uid": DAEMON_SET_UID,
                                              "controller": true}]},
            "spec": {"nodeName": NODE, "serviceAccountName": AGENT_ACCOUNT, "hostNetwork": true,
                     "containers": [{"name": "agent", "image": "meshcap/meshcap:0.1.0"}]},
        }));
    }

    /// Fills each ServiceAccount token Secret that has no token yet with a new one, as the
    /// token controller does.
    fn fill_token_secrets(&self) {
        let auth = self.auth.lock().expect("auth");
        let secrets: Vec<(String, String, String)> = auth
            .objects
            .iter()
            .filter(|o| {
                o["kind"] == "Secret"
                    && o["type"] == "kubernetes.io/service-account-token"
                    && o["data"]["token"].is_null()
            })
            .map(|o| {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                (
                    text(&o["metadata"]["namespace"]),
                    text(&o["metadata"]["name"]),
                    text(&o["metadata"]["annotations"]["kubernetes.io/service-account.name"]),
                )
            })
            .collect();
        drop(auth);
        for (namespace, secret, account) in secrets {
            let token = self.issue(&namespace, &account, None, Some(&secret));
            let mut auth = self.auth.lock().expect("auth");
            if let Some(object) = auth.objects.iter_mut().find(|o| {
                o["kind"] == "Secret"
                    && o["metadata"]["namespace"] == namespace.as_str()
                    && o["metadata"]["name"] == secret.as_str()
            }) {
                object["data"] = json!({"token": token});
            }
        }
    }

    /// Creates `object` (a Secret, role or binding) as the API server does: a ServiceAccount
    /// token Secret is filled with a new token, so one re-created under the name of a deleted
    /// one carries a token of its own, and the old token stays refused.
    ///
    /// # Panics
    /// When a lock is poisoned.
    pub fn create(&self, object: Value) {
        self.auth.lock().expect("auth").objects.push(object);
        self.fill_token_secrets();
    }

    /// Issues a token for the ServiceAccount `namespace/account`, bound to the pod `pod` of its
    /// namespace (as kubelet's projected tokens are) or to the Secret `secret`.
    ///
    /// # Panics
    /// When the ServiceAccount or the pod does not exist.
    #[must_use]
    pub fn issue(
        &self,
        namespace: &str,
        account: &str,
        pod: Option<&str>,
        secret: Option<&str>,
    ) -> String {
        let pod = pod.map(|name| {
            let pods = self.pods.lock().expect("pods");
            let found = pods
                .iter()
                .find(|p| p["metadata"]["namespace"] == namespace && p["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("no pod {namespace}/{name} to bind a token to"));
            (
                namespace.to_owned(),
                name.to_owned(),
                found["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        });
        let mut auth = self.auth.lock().expect("auth");
        let account_uid = account_uid(&auth.objects, namespace, account)
            .unwrap_or_else(|| panic!("no ServiceAccount {namespace}/{account}"));
        let value = format!("token-{account}-{}", auth.tokens.len() + 1);
        auth.tokens.push(Token {
            value: value.clone(),
            namespace: namespace.to_owned(),
            account: account.to_owned(),
            account_uid,
            pod,
            secret: secret.map(|s| (namespace.to_owned(), s.to_owned())),
        });
        value
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

    /// Gives meshcap's DaemonSet the required node affinity docs/install.md's switch gives it
    /// (`meshcap.io/cni In [both, meshcap]`).
    ///
    /// # Panics
    /// When the DaemonSet is not there.
    pub fn apply_switch_affinity(&self) {
        let mut ds = self.daemon_set();
        ds["spec"]["template"]["spec"]["affinity"] = json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": SWITCH_LABEL, "operator": "In",
                                       "values": ["both", "meshcap"]}]}]}}});
        self.apply_daemon_set(ds);
    }

    /// Labels the node `meshcap.io/cni=value`, as an operator moves it in the switch.
    ///
    /// # Panics
    /// When a lock is poisoned.
    pub fn label_for_switch(&self, value: &str) {
        self.nodes.lock().expect("nodes")[0]["metadata"]["labels"][SWITCH_LABEL] = json!(value);
    }

    /// Adds `daemon_set`, or replaces its namesake, as a change DaemonSet watches see.
    ///
    /// # Panics
    /// When a lock is poisoned.
    pub fn apply_daemon_set(&self, daemon_set: Value) {
        record(&self.daemon_sets, &self.daemon_set_changes, daemon_set);
    }

    /// The DaemonSet as served now.
    ///
    /// # Panics
    /// When it is not there.
    #[must_use]
    pub fn daemon_set(&self) -> Value {
        self.daemon_sets
            .lock()
            .expect("daemon sets")
            .iter()
            .find(|d| d["metadata"]["name"] == DAEMON_SET)
            .cloned()
            .expect("the DaemonSet")
    }

    /// Deletes the object `kind` `namespace/name` (`namespace` empty for a cluster-scoped
    /// one) as the API server does at once: a deleted ServiceAccount, pod or Secret revokes the
    /// tokens bound to it; a deleted DaemonSet or pod is a `DELETED` change for watches.
    ///
    /// # Panics
    /// When there is no such object.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) {
        let same = |o: &Value| {
            o["metadata"]["name"] == name
                && (namespace.is_empty() || o["metadata"]["namespace"] == namespace)
        };
        let (store, changes) = match kind {
            "Pod" => (&self.pods, &self.changes),
            "DaemonSet" => (&self.daemon_sets, &self.daemon_set_changes),
            _ => {
                let mut auth = self.auth.lock().expect("auth");
                let before = auth.objects.len();
                auth.objects.retain(|o| !(o["kind"] == kind && same(o)));
                assert!(auth.objects.len() < before, "no {kind} {namespace}/{name}");
                return;
            }
        };
        let mut changes = changes.lock().expect("changes");
        let mut objects = store.lock().expect("objects");
        let index = objects
            .iter()
            .position(same)
            .unwrap_or_else(|| panic!("no {kind} {namespace}/{name}"));
        let mut gone = objects.remove(index);
        gone["metadata"]["resourceVersion"] = json!((changes.len() + 1).to_string());
        changes.push(("DELETED".to_owned(), gone));
    }

    /// Marks the DaemonSet, a pod or a Namespace as being deleted (a `deletionTimestamp`, and
    /// for a DaemonSet the `foregroundDeletion` finalizer a foreground deletion sets), as a
    /// change watches see.
    ///
    /// # Panics
    /// When there is no such object.
    pub fn mark_deleting(&self, kind: &str, namespace: &str, name: &str) {
        let (store, changes) = match kind {
            "Pod" => (&self.pods, &self.changes),
            "DaemonSet" => (&self.daemon_sets, &self.daemon_set_changes),
            "Namespace" => (&self.namespaces, &self.namespace_changes),
            other => panic!("{other} is not served as a resource"),
        };
        let found = store
            .lock()
            .expect("objects")
            .iter()
            .find(|o| {
                o["metadata"]["name"] == name
                    && (namespace.is_empty() || o["metadata"]["namespace"] == namespace)
            })
            .cloned();
        let mut object = found.unwrap_or_else(|| panic!("no {kind} {namespace}/{name}"));
        object["metadata"]["deletionTimestamp"] = json!("2026-11-24T00:00:00Z");
        if kind == "DaemonSet" {
            object["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
        }
        record(store, changes, object);
    }

    /// Ends every watch now streaming (as an API server does when one times out): the clients
    /// then list and watch again, authorized afresh.
    pub fn close_watches(&self) {
        self.watch_epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// A kubeconfig for it (plain HTTP) with the agent's token, bound to [`AGENT_POD`] as
    /// kubelet's projected token is, written into `dir`.
    ///
    /// # Panics
    /// When it cannot be written.
    #[must_use]
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let token = self.agent_token();
        self.kubeconfig_with(dir, "kubeconfig", &token)
    }

    /// A token for the agent's ServiceAccount bound to [`AGENT_POD`], as kubelet projects it
    /// into the pod.
    ///
    /// # Panics
    /// When the ServiceAccount or the pod is gone.
    #[must_use]
    pub fn agent_token(&self) -> String {
        self.issue(&self.namespace, AGENT_ACCOUNT, Some(AGENT_POD), None)
    }

    /// The plugin's token, as the token controller filled its Secret.
    ///
    /// # Panics
    /// When the Secret is not there.
    #[must_use]
    pub fn cni_token(&self) -> String {
        let auth = self.auth.lock().expect("auth");
        auth.objects
            .iter()
            .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == CNI_TOKEN_SECRET)
            .and_then(|o| o["data"]["token"].as_str().map(str::to_owned))
            .expect("the plugin's token Secret, filled")
    }

    /// A kubeconfig for it with `token`, written into `dir/name`.
    ///
    /// # Panics
    /// When it cannot be written.
    #[must_use]
    pub fn kubeconfig_with(&self, dir: &Path, name: &str, token: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"http://{}\"}}\n\
                 users:\n- name: test\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\n\
                 current-context: test\n",
                self.addr
            ),
        )
        .expect("kubeconfig");
        path
    }

    /// The plugin's token Secret mounted as kubelet mounts it (a `token` file) under `dir`,
    /// for the agent's `MESHCAP_CNI_TOKEN_DIR`.
    ///
    /// # Panics
    /// When it cannot be written, or the Secret has no token.
    #[must_use]
    pub fn cni_token_dir(&self, dir: &Path) -> PathBuf {
        let token = self.cni_token();
        let mounted = dir.join("cni-token");
        std::fs::create_dir_all(&mounted).expect("token dir");
        std::fs::write(mounted.join("token"), token).expect("token");
        mounted
    }

    /// Every `(role, rule, verb)` the RBAC gives the ServiceAccount `account` of meshcap's
    /// namespace, and those that allowed at least one of its requests so far.
    ///
    /// # Panics
    /// When a lock is poisoned.
    #[must_use]
    pub fn grants(&self, account: &str) -> (Vec<Grant>, Vec<Grant>) {
        let user = rbac::service_account_user(&self.namespace, account);
        let auth = self.auth.lock().expect("auth");
        let granted = rbac::granted(&auth.objects, &user);
        let mut used: Vec<Grant> = auth
            .used
            .iter()
            .filter(|(u, _)| *u == user)
            .map(|(_, g)| g.clone())
            .collect();
        used.sort();
        used.dedup();
        (granted, used)
    }

    /// Asserts that every rule and verb of the ClusterRole `role` allowed at least one request
    /// of `account`, and that no request was refused: the RBAC a feature ships is the RBAC it
    /// uses.
    ///
    /// # Panics
    /// When one went unused, or a request was refused.
    pub fn assert_role_used(&self, account: &str, role: &str) {
        let (granted, used) = self.grants(account);
        let role = format!("ClusterRole/{role}");
        let of_role: Vec<&Grant> = granted.iter().filter(|g| g.0 == role).collect();
        assert!(!of_role.is_empty(), "{account} is not bound to {role}");
        let unused: Vec<&&Grant> = of_role.iter().filter(|g| !used.contains(g)).collect();
        assert!(
            unused.is_empty(),
            "{account}: granted and never used: {unused:?}"
        );
        let refused = self.refused();
        assert!(refused.is_empty(), "refused: {refused:?}");
    }

    /// The requests allowed so far, in order.
    #[must_use]
    pub fn requests(&self) -> Vec<Request> {
        self.auth.lock().expect("auth").requests.clone()
    }

    /// The requests refused so far: the user (empty when no valid token was presented), what
    /// was asked, 401 or 403.
    ///
    /// # Panics
    /// When a lock is poisoned.
    #[must_use]
    pub fn refused(&self) -> Vec<(String, Attributes, u16)> {
        self.auth.lock().expect("auth").refused.clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(&self.addr);
    }
}

fn account_uid(objects: &[Value], namespace: &str, account: &str) -> Option<String> {
    objects
        .iter()
        .find(|o| {
            o["kind"] == "ServiceAccount"
                && o["metadata"]["namespace"] == namespace
                && o["metadata"]["name"] == account
        })
        .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_owned))
}

/// What the server holds, shared by its connections.
#[derive(Clone)]
struct Served {
    pods: Arc<Mutex<Vec<Value>>>,
    daemon_sets: Arc<Mutex<Vec<Value>>>,
    namespaces: Arc<Mutex<Vec<Value>>>,
    nodes: Arc<Mutex<Vec<Value>>>,
    events: Arc<Mutex<Vec<Value>>>,
    writes: Arc<Mutex<Vec<(String, String, Value)>>>,
    changes: Arc<Mutex<Vec<(String, Value)>>>,
    namespace_changes: Arc<Mutex<Vec<(String, Value)>>>,
    daemon_set_changes: Arc<Mutex<Vec<(String, Value)>>>,
    auth: Arc<Mutex<Auth>>,
    watch_epoch: Arc<AtomicUsize>,
    hold_namespace_gets: Arc<AtomicBool>,
    held_namespace_gets: Arc<AtomicUsize>,
    pod_logs: Arc<Mutex<Vec<(String, String, String)>>>,
    stop: Arc<AtomicBool>,
}

impl Served {
    /// The user a bearer token authenticates, if it is valid: issued here, its ServiceAccount
    /// there with the same uid, and the pod or Secret it is bound to there too.
    fn authenticate(&self, bearer: Option<&str>) -> Option<String> {
        let bearer = bearer?;
        let auth = self.auth.lock().expect("auth");
        let token = auth.tokens.iter().find(|t| t.value == bearer)?;
        if account_uid(&auth.objects, &token.namespace, &token.account).as_deref()
            != Some(token.account_uid.as_str())
        {
            return None;
        }
        if let Some((ns, name, uid)) = &token.pod
            && !self.pods.lock().expect("pods").iter().any(|p| {
                p["metadata"]["namespace"] == ns.as_str()
                    && p["metadata"]["name"] == name.as_str()
                    && p["metadata"]["uid"] == uid.as_str()
            })
        {
            return None;
        }
        // As the legacy token authenticator: the Secret there, holding this very token (one
        // re-created under the same name holds another).
        if let Some((ns, name)) = &token.secret
            && !auth.objects.iter().any(|o| {
                o["kind"] == "Secret"
                    && o["metadata"]["namespace"] == ns.as_str()
                    && o["metadata"]["name"] == name.as_str()
                    && o["data"]["token"] == token.value.as_str()
            })
        {
            return None;
        }
        Some(rbac::service_account_user(&token.namespace, &token.account))
    }
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

/// Stores `object` (added or replacing its namesake) with the next resourceVersion and logs
/// the change.
fn record(objects: &Mutex<Vec<Value>>, changes: &Mutex<Vec<(String, Value)>>, mut object: Value) {
    let mut changes = changes.lock().expect("changes");
    let mut objects = objects.lock().expect("objects");
    object["metadata"]["resourceVersion"] = json!((changes.len() + 1).to_string());
    let same = |p: &Value| {
        p["metadata"]["namespace"] == object["metadata"]["namespace"]
            && p["metadata"]["name"] == object["metadata"]["name"]
    };
    let kind = if let Some(slot) = objects.iter_mut().find(|p| same(p)) {
        *slot = object.clone();
        "MODIFIED"
    } else {
        objects.push(object.clone());
        "ADDED"
    };
    changes.push((kind.to_owned(), object));
}

/// Streams the `changes` after the resourceVersion `query` asks from, then each new one that
/// `keep` accepts, for a minute or until [`ApiServer::close_watches`] (kube-rs then watches
/// again from the last it saw).
fn watch(
    stream: &mut Conn,
    changes: &Mutex<Vec<(String, Value)>>,
    query: &str,
    state: &Served,
    keep: impl Fn(&Value) -> bool,
) {
    let epoch = state.watch_epoch.load(Ordering::SeqCst);
    let mut next: usize = param(query, "resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0);
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let _ = stream.flush();
    for _ in 0..12_000 {
        if state.stop.load(Ordering::Relaxed) || state.watch_epoch.load(Ordering::SeqCst) != epoch {
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
                let object = stream.as_asked(&object);
                let line = format!("{}\n", json!({"type": kind, "object": object}));
                if write!(stream, "{:x}\r\n{line}\r\n", line.len()).is_err() {
                    return;
                }
            }
        }
        let _ = stream.flush();
        thread::sleep(Duration::from_millis(5));
    }
    let _ = write!(stream, "0\r\n\r\n");
}

/// The value a field selector `FIELD=VALUE` in `query` asks for (URL-encoded or not).
fn field_selected(query: &str, field: &str) -> Option<String> {
    let value = param(query, "fieldSelector")?;
    let value = value.replace("%3D", "=").replace("%3d", "=");
    value
        .strip_prefix(field)
        .and_then(|v| v.strip_prefix('='))
        .map(str::to_owned)
}

fn on_node(pod: &Value, node: Option<&str>) -> bool {
    node.is_none_or(|n| pod["spec"]["nodeName"] == n)
}

/// One JSON response, and the connection closed.
/// A `PodList` of `items` at the server's current resource version.
fn pod_list(stream: &mut Conn, state: &Served, items: Vec<Value>) {
    let version = state.changes.lock().expect("changes").len().to_string();
    respond(
        stream,
        "200 OK",
        &json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": version}, "items": items
        }),
    );
}

fn respond(stream: &mut Conn, code: &str, body: &Value) {
    let body = stream.as_asked(body).to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// A `Status` failure as the API server words it.
fn status(stream: &mut Conn, code: u16, reason: &str, message: &str, details: &Value) {
    let line = match code {
        401 => "401 Unauthorized",
        403 => "403 Forbidden",
        404 => "404 Not Found",
        409 => "409 Conflict",
        _ => "422 Unprocessable Entity",
    };
    let mut body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code
    });
    if !details.is_null() {
        body["details"] = details.clone();
    }
    respond(stream, line, &body);
}

/// The API server's answer for an object it does not have.
fn not_found(stream: &mut Conn, resource: &str, name: &str) {
    status(
        stream,
        404,
        "NotFound",
        &format!("{resource} \"{name}\" not found"),
        &json!({"name": name, "kind": resource}),
    );
}

/// The API server's 403, as `k8s.io/apiserver`'s `forbiddenMessage` words it.
fn forbidden(stream: &mut Conn, user: &str, attrs: &Attributes) {
    let resource = attrs.combined_resource();
    let subject = if attrs.name.is_empty() {
        resource.clone()
    } else {
        format!("{} \"{}\"", attrs.resource, attrs.name)
    };
    let scope = if attrs.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace \"{}\"", attrs.namespace)
    };
    status(
        stream,
        403,
        "Forbidden",
        &format!(
            "{subject} is forbidden: User \"{user}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
            attrs.verb, attrs.api_group
        ),
        &json!({"name": attrs.name, "group": attrs.api_group, "kind": attrs.resource}),
    );
}

/// A self review's answer, from the same RBAC as every request.
fn review(objects: &[Value], user: &str, resource: &str, mut body: Value) -> Value {
    if resource == "selfsubjectaccessreviews" {
        let a = &body["spec"]["resourceAttributes"];
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let attrs = Attributes {
            verb: text(&a["verb"]),
            api_group: text(&a["group"]),
            resource: text(&a["resource"]),
            subresource: text(&a["subresource"]),
            namespace: text(&a["namespace"]),
            name: text(&a["name"]),
            non_resource: false,
        };
        body["status"] = json!({"allowed": rbac::authorize(objects, user, &attrs).is_some()});
    } else {
        let namespace = body["spec"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let rules: Vec<Value> = objects
            .iter()
            .filter(|b| {
                (b["kind"] == "ClusterRoleBinding"
                    || (b["kind"] == "RoleBinding"
                        && b["metadata"]["namespace"] == namespace.as_str()))
                    && rbac::granted(std::slice::from_ref(b), user).is_empty()
                    && b["subjects"].as_array().is_some_and(|s| {
                        s.iter().any(|s| {
                            s["kind"] == "ServiceAccount"
                                && rbac::service_account_user(
                                    s["namespace"].as_str().unwrap_or_default(),
                                    s["name"].as_str().unwrap_or_default(),
                                ) == user
                        })
                    })
            })
            .flat_map(|b| {
                let kind = b["roleRef"]["kind"].as_str().unwrap_or_default();
                let name = b["roleRef"]["name"].as_str().unwrap_or_default();
                let ns = b["metadata"]["namespace"].as_str().unwrap_or_default();
                objects
                    .iter()
                    .find(|r| {
                        r["kind"] == kind
                            && r["metadata"]["name"] == name
                            && (kind == "ClusterRole" || r["metadata"]["namespace"] == ns)
                    })
                    .and_then(|r| r["rules"].as_array().cloned())
                    .unwrap_or_default()
            })
            .collect();
        body["status"] =
            json!({"resourceRules": rules, "nonResourceRules": [], "incomplete": false});
    }
    body
}

/// Applies the JSON patch `ops` (RFC 6902: `test`, `replace`, `add`, `remove`) to `target`;
/// `None` when a `test` fails or a path is missing (422).
fn json_patch(mut target: Value, ops: &Value) -> Option<Value> {
    for op in ops.as_array()? {
        let path = op["path"].as_str()?;
        let (parent, key) = path.rsplit_once('/')?;
        match op["op"].as_str()? {
            "test" => {
                if target.pointer(path)? != &op["value"] {
                    return None;
                }
            }
            "replace" | "add" => {
                target.pointer_mut(parent)?[key] = op["value"].clone();
            }
            "remove" => {
                target.pointer_mut(parent)?.as_object_mut()?.remove(key)?;
            }
            _ => return None,
        }
    }
    Some(target)
}

fn serve_api(stream: TcpStream, state: &Served) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let traffic = Arc::new(Traffic::default());
    let mut stream = Conn {
        stream,
        traffic: traffic.clone(),
        metadata_only: false,
    };
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut received = request_line.len();
    let mut length = 0;
    let mut bearer = None;
    loop {
        let mut header = String::new();
        let read = reader.read_line(&mut header);
        received += header.len();
        if read.is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            } else if name.trim().eq_ignore_ascii_case("authorization") {
                bearer = value.trim().strip_prefix("Bearer ").map(str::to_owned);
            } else if name.trim().eq_ignore_ascii_case("accept") {
                stream.metadata_only = value.contains("as=PartialObjectMetadata");
            }
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    traffic
        .received
        .store((received + length) as u64, Ordering::Relaxed);
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
    let attrs = Attributes::of(&method, route, query);
    let Some(user) = state.authenticate(bearer.as_deref()) else {
        state
            .auth
            .lock()
            .expect("auth")
            .refused
            .push((String::new(), attrs, 401));
        status(
            &mut stream,
            401,
            "Unauthorized",
            "Unauthorized",
            &Value::Null,
        );
        return;
    };
    {
        let mut auth = state.auth.lock().expect("auth");
        match rbac::authorize(&auth.objects, &user, &attrs) {
            Some(grant) => {
                auth.used.push((user.clone(), grant));
                auth.requests.push(Request {
                    user: user.clone(),
                    attrs: attrs.clone(),
                    query: query.to_owned(),
                    metadata_only: stream.metadata_only,
                    traffic,
                });
            }
            None => {
                auth.refused.push((user.clone(), attrs.clone(), 403));
                drop(auth);
                forbidden(&mut stream, &user, &attrs);
                return;
            }
        }
    }
    route_request(&mut stream, state, &method, route, query, &body, &user);
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
}

fn route_request(
    stream: &mut Conn,
    state: &Served,
    method: &str,
    route: &str,
    query: &str,
    body: &[u8],
    user: &str,
) {
    let (pods, daemon_sets) = (&*state.pods, &*state.daemon_sets);
    let watching = param(query, "watch").is_some_and(|w| w == "true" || w == "1");
    let parts: Vec<&str> = route.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["apis", "authorization.k8s.io", "v1", resource] if method == "POST" => {
            let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let objects = state.auth.lock().expect("auth").objects.clone();
            respond(
                stream,
                "201 Created",
                &review(&objects, user, resource, request),
            );
        }
        ["apis", "events.k8s.io", "v1", "namespaces", _, "events"] if method == "POST" => {
            let event: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            state.events.lock().expect("events").push(event.clone());
            respond(stream, "201 Created", &event);
        }
        [
            "apis",
            "events.k8s.io",
            "v1",
            "namespaces",
            _,
            "events",
            name,
        ] if method == "PATCH" => {
            let patch: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let mut events = state.events.lock().expect("events");
            match events.iter_mut().find(|e| e["metadata"]["name"] == *name) {
                Some(event) => {
                    for (k, v) in patch.as_object().into_iter().flatten() {
                        event[k] = v.clone();
                    }
                    respond(stream, "200 OK", event);
                }
                None => not_found(stream, "events", name),
            }
        }
        ["api", "v1", "pods"] if watching => {
            let node = field_selected(query, "spec.nodeName");
            watch(stream, &state.changes, query, state, |pod| {
                on_node(pod, node.as_deref())
            });
        }
        ["api", "v1", "namespaces"] if watching => {
            watch(stream, &state.namespace_changes, query, state, |_| true);
        }
        ["apis", "apps", "v1", "namespaces", ns, "daemonsets"] => {
            let name = field_selected(query, "metadata.name");
            let keep = |d: &Value| {
                d["metadata"]["namespace"] == *ns
                    && name.as_deref().is_none_or(|n| d["metadata"]["name"] == n)
            };
            if watching {
                watch(stream, &state.daemon_set_changes, query, state, keep);
            } else {
                let items: Vec<Value> = daemon_sets
                    .lock()
                    .expect("daemon sets")
                    .iter()
                    .filter(|d| keep(d))
                    .cloned()
                    .collect();
                let version = state
                    .daemon_set_changes
                    .lock()
                    .expect("changes")
                    .len()
                    .to_string();
                respond(
                    stream,
                    "200 OK",
                    &json!({"apiVersion": "apps/v1", "kind": "DaemonSetList",
                            "metadata": {"resourceVersion": version}, "items": items}),
                );
            }
        }
        ["api", "v1", "namespaces"] if method == "POST" => {
            let namespace: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            create(stream, state, route, "namespaces", namespace, |s| {
                (&*s.namespaces, &*s.namespace_changes)
            });
        }
        ["api", "v1", "namespaces", ns, "pods"] if method == "POST" => {
            let mut pod: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            pod["metadata"]["namespace"] = json!(ns);
            create(stream, state, route, "pods", pod, |s| {
                (&*s.pods, &*s.changes)
            });
        }
        ["api", "v1", "namespaces", ns, "pods"] => {
            let selected = labels_selected(query);
            let items: Vec<Value> = pods
                .lock()
                .expect("pods")
                .iter()
                .filter(|p| {
                    p["metadata"]["namespace"] == *ns
                        && selected
                            .iter()
                            .all(|(k, v)| p["metadata"]["labels"][k] == v.as_str())
                })
                .cloned()
                .collect();
            pod_list(stream, state, items);
        }
        [
            "api",
            "v1",
            "namespaces",
            ns,
            "pods",
            target,
            "proxy",
            path @ ..,
        ] => {
            proxy(stream, state, ns, target, &path.join("/"));
        }
        ["api", "v1", "namespaces", ns, "pods", name, "log"] => {
            let log = state
                .pod_logs
                .lock()
                .expect("logs")
                .iter()
                .find(|(n, p, _)| n == ns && p == name)
                .map(|(_, _, log)| log.clone());
            match log {
                Some(log) => {
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{log}",
                        log.len()
                    );
                }
                None => not_found(stream, "pods", name),
            }
        }
        ["api", "v1", "namespaces", name] if method == "DELETE" => {
            delete_namespace(stream, state, route, name);
        }
        ["api", "v1", "nodes"] => {
            let items = state.nodes.lock().expect("nodes").clone();
            respond(
                stream,
                "200 OK",
                &json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "1"}, "items": items}),
            );
        }
        ["api", "v1", "namespaces"] => {
            hold(state);
            let selected = labels_selected(query);
            let items: Vec<Value> = state
                .namespaces
                .lock()
                .expect("namespaces")
                .iter()
                .filter(|n| {
                    selected
                        .iter()
                        .all(|(k, v)| n["metadata"]["labels"][k] == v.as_str())
                })
                .cloned()
                .collect();
            let version = state
                .namespace_changes
                .lock()
                .expect("changes")
                .len()
                .to_string();
            respond(
                stream,
                "200 OK",
                &json!({
                    "apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": version}, "items": items
                }),
            );
        }
        ["api", "v1", "pods"] => {
            let node = field_selected(query, "spec.nodeName");
            let items: Vec<Value> = pods
                .lock()
                .expect("pods")
                .iter()
                .filter(|p| on_node(p, node.as_deref()))
                .cloned()
                .collect();
            pod_list(stream, state, items);
        }
        ["api", "v1", "nodes", name] => {
            let mut nodes = state.nodes.lock().expect("nodes");
            let Some(node) = nodes.iter_mut().find(|n| n["metadata"]["name"] == *name) else {
                return not_found(stream, "nodes", name);
            };
            if method == "PATCH" {
                let ops: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                match json_patch(node.clone(), &ops) {
                    Some(patched) => *node = patched,
                    None => {
                        return status(
                            stream,
                            422,
                            "Invalid",
                            "the server rejected our request due to an error in our request",
                            &Value::Null,
                        );
                    }
                }
            }
            respond(stream, "200 OK", node);
        }
        ["api", "v1", "namespaces", ns, "pods", name] if method == "DELETE" => {
            let options: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            state.writes.lock().expect("writes").push((
                method.to_owned(),
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
                Some(_) if conflict => {
                    status(stream, 409, "Conflict", "Precondition failed", &Value::Null)
                }
                Some(i) => {
                    let pod = all.remove(i);
                    drop(all);
                    state
                        .changes
                        .lock()
                        .expect("changes")
                        .push(("DELETED".into(), pod.clone()));
                    respond(stream, "200 OK", &pod);
                }
                None => not_found(stream, "pods", name),
            }
        }
        ["api", "v1", "namespaces", ns, "pods", name, "status"] if method == "PATCH" => {
            let patch: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            state.writes.lock().expect("writes").push((
                method.to_owned(),
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
                respond(stream, "200 OK", &pod);
            } else {
                not_found(stream, "pods", name);
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
                Some(namespace) => respond(stream, "200 OK", &namespace),
                None => not_found(stream, "namespaces", name),
            }
        }
        ["api", "v1", "namespaces", ns, "pods", name]
        | ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name] => {
            let (objects, resource) = if parts[0] == "api" {
                (pods, "pods")
            } else {
                (daemon_sets, "daemonsets.apps")
            };
            let found = objects
                .lock()
                .expect("objects")
                .iter()
                .find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name)
                .cloned();
            match found {
                Some(pod) => respond(stream, "200 OK", &pod),
                None => not_found(stream, resource, name),
            }
        }
        _ => status(
            stream,
            404,
            "NotFound",
            "the server could not find the requested resource",
            &Value::Null,
        ),
    }
}

/// `GET …/pods/NAME:PORT/proxy/PATH`, as the API server proxies it: `GET /PATH` on the pod's
/// address (`status.podIP`) and port, its answer relayed; 503 when nothing answers there.
fn proxy(stream: &mut Conn, state: &Served, ns: &str, target: &str, path: &str) {
    let (name, port) = target.split_once(':').unwrap_or((target, "80"));
    let ip = state
        .pods
        .lock()
        .expect("pods")
        .iter()
        .find(|p| p["metadata"]["namespace"] == ns && p["metadata"]["name"] == name)
        .map(|p| p["status"]["podIP"].as_str().unwrap_or_default().to_owned());
    let Some(ip) = ip else {
        return not_found(stream, "pods", name);
    };
    let answer = (|| {
        let mut upstream = TcpStream::connect(format!("{ip}:{port}"))?;
        upstream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        write!(
            upstream,
            "GET /{path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n"
        )?;
        let mut answer = Vec::new();
        upstream.read_to_end(&mut answer)?;
        std::io::Result::Ok(answer)
    })();
    match answer {
        Ok(answer) => {
            let _ = stream.write_all(&answer);
        }
        Err(e) => status(
            stream,
            503,
            "ServiceUnavailable",
            &format!("error trying to reach service: dial tcp {ip}:{port}: {e}"),
            &Value::Null,
        ),
    }
}

/// The `KEY=VALUE` terms of the label selector in `query` (URL-encoded or not).
fn labels_selected(query: &str) -> Vec<(String, String)> {
    let Some(value) = param(query, "labelSelector") else {
        return Vec::new();
    };
    let value = value
        .replace("%3D", "=")
        .replace("%3d", "=")
        .replace("%2F", "/")
        .replace("%2f", "/")
        .replace("%2C", ",")
        .replace("%2c", ",");
    value
        .split(',')
        .filter_map(|term| term.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// A POST creating `object` among the `resource` that `store` picks: 409 when its namesake
/// exists, else stored with a uid (and logged in [`ApiServer::writes`]).
fn create(
    stream: &mut Conn,
    state: &Served,
    route: &str,
    resource: &str,
    mut object: Value,
    store: impl Fn(&Served) -> (&Mutex<Vec<Value>>, &Mutex<Vec<(String, Value)>>),
) {
    let (objects, changes) = store(state);
    let name = object["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let exists = objects.lock().expect("objects").iter().any(|o| {
        o["metadata"]["name"] == name.as_str()
            && o["metadata"]["namespace"] == object["metadata"]["namespace"]
    });
    if exists {
        return status(
            stream,
            409,
            "AlreadyExists",
            &format!("{resource} \"{name}\" already exists"),
            &json!({"name": name, "kind": resource}),
        );
    }
    object["metadata"]["uid"] = json!(format!("{resource}-{name}"));
    state
        .writes
        .lock()
        .expect("writes")
        .push(("POST".into(), route.to_owned(), object.clone()));
    record(objects, changes, object.clone());
    respond(stream, "201 Created", &object);
}

/// A namespace deleted, with its pods, at once (no finalizers here).
fn delete_namespace(stream: &mut Conn, state: &Served, route: &str, name: &str) {
    let mut namespaces = state.namespaces.lock().expect("namespaces");
    let Some(index) = namespaces
        .iter()
        .position(|n| n["metadata"]["name"] == name)
    else {
        drop(namespaces);
        return not_found(stream, "namespaces", name);
    };
    let namespace = namespaces.remove(index);
    drop(namespaces);
    state
        .writes
        .lock()
        .expect("writes")
        .push(("DELETE".into(), route.to_owned(), Value::Null));
    state
        .namespace_changes
        .lock()
        .expect("changes")
        .push(("DELETED".into(), namespace.clone()));
    let mut pods = state.pods.lock().expect("pods");
    let (gone, kept): (Vec<Value>, Vec<Value>) = pods
        .drain(..)
        .partition(|p| p["metadata"]["namespace"] == name);
    *pods = kept;
    drop(pods);
    let mut changes = state.changes.lock().expect("changes");
    for pod in gone {
        changes.push(("DELETED".into(), pod));
    }
    drop(changes);
    respond(stream, "200 OK", &namespace);
}
