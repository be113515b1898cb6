//! What the connectivity test creates: its namespace and, on each node, five pods pinned by
//! `nodeName`, all of meshcap's own image running `meshcap-agent probe-pod`:
//! - `server-N`: the upstream, outside the mesh, on [`SERVER_PORT`];
//! - `sidecar-N`: the shape Istio's injector gives a pod (the `sidecar.istio.io/status`
//!   annotation, an `istio-proxy` container running as uid 1337 and listening on 15001 and
//!   15006, with `ISTIO_DUAL_STACK`), whose `app` dials the server (at each of its addresses
//!   in a dual-stack cluster);
//! - `excluded-N`: the same with `traffic.sidecar.istio.io/excludeOutboundIPRanges` covering the
//!   server's address;
//! - `outside-N`: no sidecar's shape; its `app` dials the server and the sidecar pod's
//!   [`SIDECAR_PORT`] (at each of its addresses), then the next node's sidecar pod;
//! - `dns-N`: the sidecar's shape with Istio's DNS capture on (`ISTIO_META_DNS_CAPTURE` in
//!   `istio-proxy`'s environment, as the injector renders the `proxy.istio.io/config`
//!   annotation's `proxyMetadata`), its proxy also on `localhost:15053` (TCP and UDP, as
//!   `pilot-agent`'s DNS proxy); its `app` sends a DNS-port datagram and connection to the server's address on
//!   [`probe::DNS_PORT`], where nothing listens;
//! - `ambient-N`, only on a node whose agent runs ambient mode: labelled
//!   `istio.io/dataplane-mode=ambient`, a server that waits to be enrolled.
//!
//! The pods need no privilege: they meet PodSecurity's `restricted` level, which the
//! namespace enforces. Every object carries [`MANAGED_BY`], by which a later run removes what a
//! killed one left.
use std::net::SocketAddr;

use meshcap_policy::ambient::ambient_keys;
use serde_json::{Value, json};

use super::{
    probe::{self, INBOUND_PORT, OUTBOUND_PORT},
    report::{Addresses, target},
};

/// The label every object of the test carries (key, value).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "meshcap-connectivity-test");
/// The label selector of [`MANAGED_BY`].
#[must_use]
pub fn selector() -> String {
    format!("{}={}", MANAGED_BY.0, MANAGED_BY.1)
}
/// The prefix of the test's namespaces (then 8 hex digits).
pub const NAMESPACE_PREFIX: &str = "meshcap-connectivity-";
/// The server's port.
pub const SERVER_PORT: u16 = 8080;
/// The port dialled on the sidecar pod (nothing listens on it: the capture takes it to 15006).
pub const SIDECAR_PORT: u16 = 9080;
/// Where the image has the agent.
pub const AGENT_PATH: &str = "/usr/local/bin/meshcap-agent";
/// The app's uid (any but the proxy's).
const APP_UID: u32 = 1000;
/// Envoy's uid, which the capture leaves alone.
const PROXY_UID: u32 = 1337;
/// What Istio's injector writes into `sidecar.istio.io/status` (with istio-cni, its init
/// container is `istio-validation`).
const SIDECAR_STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":[],"imagePullSecrets":null,"revision":"default"}"#;

/// `serve` as `role` on `ports`, of both families (Envoy's listeners are on `0.0.0.0` and
/// `[::]`): whichever the pod's address is; a family the node's kernel lacks is skipped.
fn serve(role: &str, ports: &[u16]) -> Vec<String> {
    let mut args = vec!["serve".to_owned(), "--role".to_owned(), role.to_owned()];
    for port in ports {
        for addr in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
            args.extend(["--listen".to_owned(), addr]);
        }
    }
    args
}

/// The pods of one node, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Server,
    Sidecar,
    Excluded,
    Outside,
    Dns,
    Ambient,
}

impl Role {
    /// The pod's name on node number `index`.
    #[must_use]
    pub fn pod(self, index: usize) -> String {
        let role = match self {
            Self::Server => "server",
            Self::Sidecar => "sidecar",
            Self::Excluded => "excluded",
            Self::Outside => "outside",
            Self::Dns => "dns",
            Self::Ambient => "ambient",
        };
        format!("{role}-{index}")
    }
}

/// One run's objects.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The namespace, `meshcap-connectivity-<8 hex>`.
    pub namespace: String,
    /// meshcap's image.
    pub image: String,
    /// How long the apps keep dialling a target that does not answer yet, in seconds.
    pub dial_seconds: u64,
}

impl Plan {
    /// A plan for a new namespace named from `suffix`.
    #[must_use]
    pub fn new(suffix: u32, image: &str, dial_seconds: u64) -> Self {
        Self {
            namespace: format!("{NAMESPACE_PREFIX}{suffix:08x}"),
            image: image.to_owned(),
            dial_seconds,
        }
    }

    /// The namespace: [`MANAGED_BY`], PodSecurity `restricted` enforced, and Istio's injector
    /// kept out (the test's pods are given the sidecar's shape, not a sidecar).
    #[must_use]
    pub fn namespace(&self) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": self.namespace, "labels": {
                MANAGED_BY.0: MANAGED_BY.1,
                "pod-security.kubernetes.io/enforce": "restricted",
                "istio-injection": "disabled",
            }},
        })
    }

    /// The server of node `node` (number `index`).
    #[must_use]
    pub fn server(&self, index: usize, node: &str) -> Value {
        let server = self.container("server", APP_UID, &serve("server", &[SERVER_PORT]));
        self.pod(Role::Server, index, node, &json!({}), vec![server])
    }

    /// The sidecar-shaped pod of node `node`, dialling `server` (both families' addresses in
    /// a dual-stack cluster). Its `istio-proxy` has `ISTIO_DUAL_STACK` on, as a dual-stack
    /// mesh's `proxyMetadata` renders it: without it Istio's rules capture one family only
    /// (`tools/common/config/config.go`, `getLocalIP`), with it both; in a single-stack
    /// cluster it changes nothing.
    #[must_use]
    pub fn sidecar(&self, index: usize, node: &str, server: Addresses) -> Value {
        let mut targets = vec![(target::SERVER, server.first)];
        targets.extend(server.second.map(|to| (target::SERVER_SECOND, to)));
        let mut pod = self.meshed(Role::Sidecar, index, node, &targets, &json!({}));
        pod["spec"]["containers"][1]["env"] =
            json!([{"name": "ISTIO_DUAL_STACK", "value": "true"}]);
        pod
    }

    /// The sidecar-shaped pod excluding `server`'s address from its capture.
    #[must_use]
    pub fn excluded(&self, index: usize, node: &str, server: SocketAddr) -> Value {
        let range = match server {
            SocketAddr::V4(v4) => format!("{}/32", v4.ip()),
            SocketAddr::V6(v6) => format!("{}/128", v6.ip()),
        };
        let annotations = json!({"traffic.sidecar.istio.io/excludeOutboundIPRanges": range});
        self.meshed(
            Role::Excluded,
            index,
            node,
            &[(target::SERVER, server)],
            &annotations,
        )
    }

    /// The pod outside the mesh, dialling `server` and then `sidecar` (its address of the
    /// second family too, in a dual-stack cluster), then the sidecar pod of another node,
    /// `other_node`, when there is one.
    #[must_use]
    pub fn outside(
        &self,
        index: usize,
        node: &str,
        server: Addresses,
        sidecar: Addresses,
        other_node: Option<SocketAddr>,
    ) -> Value {
        let mut targets = vec![
            (target::SERVER, server.first),
            (target::SIDECAR, sidecar.first),
        ];
        targets.extend(sidecar.second.map(|to| (target::SIDECAR_SECOND, to)));
        targets.extend(other_node.map(|to| (target::SIDECAR_OTHER_NODE, to)));
        let app = self.app(&targets);
        self.pod(Role::Outside, index, node, &json!({}), vec![app])
    }

    /// A pod in ambient mode by its label, running a server (ztunnel's to serve).
    #[must_use]
    pub fn ambient(&self, index: usize, node: &str) -> Value {
        let server = self.container("server", APP_UID, &serve("server", &[SERVER_PORT]));
        let mut pod = self.pod(Role::Ambient, index, node, &json!({}), vec![server]);
        pod["metadata"]["labels"][ambient_keys::DATAPLANE_MODE] = json!("ambient");
        pod
    }

    /// The sidecar-shaped pod with Istio's DNS capture on, whose app sends to `server`'s
    /// address on [`probe::DNS_PORT`].
    #[must_use]
    pub fn dns(&self, index: usize, node: &str, server: SocketAddr) -> Value {
        let to = SocketAddr::new(server.ip(), probe::DNS_PORT);
        let annotations = json!({
            "sidecar.istio.io/status": SIDECAR_STATUS,
            "proxy.istio.io/config": "proxyMetadata:\n  ISTIO_META_DNS_CAPTURE: \"true\"\n",
        });
        // Istio's DNS proxy listens on `localhost:15053` (`DefaultDNSProxyAddr`,
        // pkg/config/constants/constants.go; pkg/dns/client/dns.go), where the capture sends
        // port 53 and whence its answers' source is restored.
        let mut args = serve("proxy", &[OUTBOUND_PORT, INBOUND_PORT]);
        for flag in ["--listen", "--udp-listen"] {
            for host in ["127.0.0.1", "[::1]"] {
                args.extend([
                    flag.to_owned(),
                    format!("{host}:{}", probe::DNS_CAPTURE_PORT),
                ]);
            }
        }
        let mut proxy = self.container("istio-proxy", PROXY_UID, &args);
        proxy["env"] = json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]);
        let mut app = self.app(&[(target::DNS_TCP, to)]);
        if let Some(command) = app["command"].as_array_mut() {
            command.extend([json!("--udp"), json!(format!("{}={to}", target::DNS_UDP))]);
        }
        self.pod(Role::Dns, index, node, &annotations, vec![app, proxy])
    }

    fn meshed(
        &self,
        role: Role,
        index: usize,
        node: &str,
        targets: &[(&str, SocketAddr)],
        extra: &Value,
    ) -> Value {
        let mut annotations = json!({"sidecar.istio.io/status": SIDECAR_STATUS});
        for (key, value) in extra.as_object().into_iter().flatten() {
            annotations[key] = value.clone();
        }
        let proxy = self.container(
            "istio-proxy",
            PROXY_UID,
            &serve("proxy", &[OUTBOUND_PORT, INBOUND_PORT]),
        );
        let app = self.app(targets);
        self.pod(role, index, node, &annotations, vec![app, proxy])
    }

    fn app(&self, targets: &[(&str, SocketAddr)]) -> Value {
        let seconds = self.dial_seconds.to_string();
        let targets: Vec<String> = targets.iter().map(|(n, a)| format!("{n}={a}")).collect();
        let mut args = vec!["dial", "--deadline-seconds", &seconds];
        args.extend(targets.iter().map(String::as_str));
        self.container("app", APP_UID, &args)
    }

    /// A container running `meshcap-agent probe-pod ARGS` as `uid`, PodSecurity `restricted`.
    fn container(&self, name: &str, uid: u32, args: &[impl AsRef<str>]) -> Value {
        let mut command = vec![AGENT_PATH, "probe-pod"];
        command.extend(args.iter().map(AsRef::as_ref));
        json!({
            "name": name, "image": self.image, "imagePullPolicy": "IfNotPresent",
            "command": command,
            "securityContext": {
                "runAsUser": uid, "runAsGroup": uid, "runAsNonRoot": true,
                "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
            },
        })
    }

    fn pod(
        &self,
        role: Role,
        index: usize,
        node: &str,
        annotations: &Value,
        containers: Vec<Value>,
    ) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": role.pod(index), "namespace": self.namespace,
                "labels": {MANAGED_BY.0: MANAGED_BY.1, "app.kubernetes.io/name": "meshcap-connectivity-test"},
                "annotations": annotations,
            },
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": 1,
                // Pinned to its node like a DaemonSet's pod, whatever the node's taints.
                "tolerations": [{"operator": "Exists"}],
                "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": containers,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan::new(0xab, "ghcr.io/x/meshcap:1", 30)
    }

    #[test]
    fn the_namespace_is_labelled_for_clean_up_and_restricted() {
        let ns = plan().namespace();
        assert_eq!(ns["metadata"]["name"], "meshcap-connectivity-000000ab");
        assert_eq!(ns["metadata"]["labels"][MANAGED_BY.0], MANAGED_BY.1);
        assert_eq!(
            ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
            "restricted"
        );
    }

    #[test]
    fn the_sidecar_pod_has_istios_injected_shape() {
        let server = Addresses {
            first: "10.1.0.1:8080".parse().expect("addr"),
            second: Some("[fd00::1]:8080".parse().expect("addr")),
        };
        let pod = plan().sidecar(3, "node-b", server);
        assert_eq!(pod["metadata"]["name"], "sidecar-3");
        assert_eq!(pod["spec"]["nodeName"], "node-b");
        assert!(pod["metadata"]["annotations"]["sidecar.istio.io/status"].is_string());
        let proxy = &pod["spec"]["containers"][1];
        assert_eq!(proxy["name"], "istio-proxy");
        assert_eq!(proxy["securityContext"]["runAsUser"], 1337);
        assert_eq!(
            proxy["env"],
            json!([{"name": "ISTIO_DUAL_STACK", "value": "true"}])
        );
        let command = proxy["command"].to_string();
        assert!(
            ["0.0.0.0:15001", "[::]:15001", "0.0.0.0:15006", "[::]:15006"]
                .iter()
                .all(|a| command.contains(a)),
            "{command}"
        );
        let app = &pod["spec"]["containers"][0];
        assert_eq!(app["securityContext"]["runAsUser"], 1000);
        let command = app["command"].to_string();
        assert!(
            command.contains("\"server=10.1.0.1:8080\",\"server-family-2=[fd00::1]:8080\""),
            "{command}"
        );
    }

    #[test]
    fn the_excluded_pod_excludes_exactly_the_server() {
        let server: SocketAddr = "10.1.0.1:8080".parse().expect("addr");
        let pod = plan().excluded(0, "n", server);
        assert_eq!(
            pod["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeOutboundIPRanges"],
            "10.1.0.1/32"
        );
        let one = |addr: &str| Addresses {
            first: addr.parse().expect("addr"),
            second: None,
        };
        let pod = plan().outside(
            0,
            "n",
            one("10.1.0.1:8080"),
            one("10.1.0.2:9080"),
            Some("10.2.0.2:9080".parse().expect("addr")),
        );
        assert!(
            pod["spec"]["containers"][0]["command"]
                .to_string()
                .contains("\"sidecar-other-node=10.2.0.2:9080\"")
        );
        assert!(
            pod["metadata"]["annotations"]
                .as_object()
                .is_some_and(serde_json::Map::is_empty)
        );
        assert_eq!(pod["spec"]["containers"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn the_ambient_pod_is_labelled_for_ambient_mode() {
        let pod = plan().ambient(2, "n");
        assert_eq!(pod["metadata"]["name"], "ambient-2");
        assert_eq!(
            pod["metadata"]["labels"]["istio.io/dataplane-mode"],
            "ambient"
        );
        assert_eq!(pod["metadata"]["labels"][MANAGED_BY.0], MANAGED_BY.1);
    }

    #[test]
    fn the_dns_pod_asks_for_dns_capture_as_the_injector_renders_it() {
        let pod = plan().dns(1, "n", "10.1.0.1:8080".parse().expect("addr"));
        assert_eq!(pod["metadata"]["name"], "dns-1");
        let proxy = &pod["spec"]["containers"][1];
        assert_eq!(proxy["env"][0]["name"], "ISTIO_META_DNS_CAPTURE");
        assert_eq!(proxy["env"][0]["value"], "true");
        let command = proxy["command"].to_string();
        assert!(
            command.contains("\"--listen\",\"127.0.0.1:15053\"")
                && command.contains("\"--udp-listen\",\"[::1]:15053\""),
            "{command}"
        );
        let app = pod["spec"]["containers"][0]["command"].to_string();
        assert!(
            app.contains("\"dns-tcp=10.1.0.1:53\",\"--udp\",\"dns-udp=10.1.0.1:53\""),
            "{app}"
        );
    }
}
