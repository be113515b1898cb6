//! What the connectivity test concludes from what its apps printed: each check's outcome on
//! each node. Pure: the same judgement for a real cluster's pod
//! logs and for the tests' processes in captured network namespaces.
use std::{fmt, net::SocketAddr};

use super::probe::{Answer, DNS_CAPTURE_PORT, DNS_PORT, Dialled, INBOUND_PORT, OUTBOUND_PORT};

/// One check on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// meshcap's agent runs on the node and its pod and its `/readyz` say it is ready.
    AgentReady,
    /// The runtime created the agent's container with its mounts and capabilities, and the
    /// agent lacks none (docs/install.md, "Host prerequisites").
    Host,
    /// A sidecar pod's app connects to the server: redirected to its proxy's 15001, with the
    /// server's address as the original destination.
    Outbound,
    /// A pod outside the mesh connects to the sidecar pod: redirected to its proxy's 15006,
    /// with the dialled address as the original destination.
    Inbound,
    /// [`Self::Outbound`] to the server's address of the pods' second family, in a
    /// dual-stack cluster.
    OutboundSecond,
    /// [`Self::Inbound`] to the sidecar pod's address of the second family.
    InboundSecond,
    /// A sidecar pod with `traffic.sidecar.istio.io/excludeOutboundIPRanges` covering the
    /// server reaches it directly.
    Excluded,
    /// A pod without the sidecar's shape reaches the server directly.
    Untouched,
    /// A sidecar pod with Istio's DNS capture on: its app's connection to port 53 reaches the
    /// proxy's 15053 with the dialled address as the original destination, and its datagram
    /// to port 53 is answered by the proxy's 15053 from the address it was sent to.
    Dns,
    /// A pod outside the mesh on another node connects to the sidecar pod: redirected to its
    /// proxy's 15006 as [`Self::Inbound`], across the primary CNI's node-to-node path.
    CrossNode,
    /// On a node in ambient mode, a pod labelled for it is enrolled.
    Ambient,
}

impl Check {
    /// Every check, in the table's order.
    pub const ALL: [Self; 11] = [
        Self::AgentReady,
        Self::Host,
        Self::Outbound,
        Self::Inbound,
        Self::OutboundSecond,
        Self::InboundSecond,
        Self::Excluded,
        Self::Untouched,
        Self::Dns,
        Self::CrossNode,
        Self::Ambient,
    ];

    /// The checks the test's pods answer, judged by [`judge`].
    pub const PODS: [Self; 7] = [
        Self::Outbound,
        Self::Inbound,
        Self::OutboundSecond,
        Self::InboundSecond,
        Self::Excluded,
        Self::Untouched,
        Self::Dns,
    ];

    /// The table's column heading.
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Self::AgentReady => "agent ready",
            Self::Host => "host prerequisites",
            Self::Outbound => "sidecar outbound",
            Self::Inbound => "sidecar inbound",
            Self::OutboundSecond => "outbound, family 2",
            Self::InboundSecond => "inbound, family 2",
            Self::Excluded => "excluded range",
            Self::Untouched => "outside the mesh",
            Self::Dns => "DNS capture",
            Self::CrossNode => "cross-node inbound",
            Self::Ambient => "ambient enrolled",
        }
    }
}

/// A check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// It failed, and why.
    Fail(String),
    /// It could not be checked, and why.
    NotChecked(String),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ok => write!(f, "ok"),
            Self::Fail(why) => write!(f, "FAIL: {why}"),
            Self::NotChecked(why) => write!(f, "not checked: {why}"),
        }
    }
}

/// The [`Dialled`] lines of an app's output (its container's log); other lines are ignored.
#[must_use]
pub fn results(log: &str) -> Vec<Dialled> {
    log.lines()
        .filter_map(|line| serde_json::from_str(line.trim()).ok())
        .collect()
}

/// The result for the target `name` among `results`.
fn find<'a>(results: &'a [Dialled], name: &str) -> Option<&'a Dialled> {
    results.iter().find(|d| d.name == name)
}

/// The answer of `dialled`, or the failure that there was none.
fn answered(dialled: Option<&Dialled>) -> Result<&Answer, Outcome> {
    let dialled = dialled.ok_or_else(|| Outcome::Fail("the app printed no result".into()))?;
    match (&dialled.answer, &dialled.error) {
        (Some(answer), _) => Ok(answer),
        (None, error) => Err(Outcome::Fail(format!(
            "nothing answered {}: {}",
            dialled.to,
            error.as_deref().unwrap_or("no reason given")
        ))),
    }
}

/// Who answered, in words.
fn who(answer: &Answer) -> String {
    format!(
        "the {} answered on port {} (original destination {})",
        answer.role,
        answer.listener,
        answer
            .original_dst
            .map_or_else(|| "none".to_owned(), |a| a.to_string())
    )
}

/// A connection redirected to the proxy's `port` with `dialled` as its original destination.
fn redirected(dialled: Option<&Dialled>, port: u16, to: SocketAddr) -> Outcome {
    let answer = match answered(dialled) {
        Ok(answer) => answer,
        Err(outcome) => return outcome,
    };
    if answer.role != "proxy" {
        return Outcome::Fail(format!("not captured: {}", who(answer)));
    }
    if answer.listener != port {
        return Outcome::Fail(format!("captured to the wrong port: {}", who(answer)));
    }
    if answer.original_dst != Some(to) {
        return Outcome::Fail(format!(
            "wrong original destination, {to} was dialled: {}",
            who(answer)
        ));
    }
    Outcome::Ok
}

/// A datagram answered by the proxy's `port`, from the address it was sent to (the probe's
/// connected socket takes no other).
fn redirected_datagram(dialled: Option<&Dialled>, port: u16) -> Outcome {
    match answered(dialled) {
        Ok(answer) if answer.role == "proxy" && answer.listener == port => Outcome::Ok,
        Ok(answer) => Outcome::Fail(format!("not captured: {}", who(answer))),
        Err(outcome) => outcome,
    }
}

/// Both of the DNS pod's: the connection, then the datagram; the first that fails.
fn dns(app: &[Dialled], to: SocketAddr) -> Outcome {
    let tcp = redirected(find(app, target::DNS_TCP), DNS_CAPTURE_PORT, to);
    let udp = redirected_datagram(find(app, target::DNS_UDP), DNS_CAPTURE_PORT);
    match (tcp, udp) {
        (Outcome::Ok, Outcome::Ok) => Outcome::Ok,
        (Outcome::Fail(why), _) => Outcome::Fail(format!("TCP: {why}")),
        (_, Outcome::Fail(why)) => Outcome::Fail(format!("UDP: {why}")),
        (other, _) => other,
    }
}

/// A connection that reached the server itself, on the port dialled.
fn direct(dialled: Option<&Dialled>, to: SocketAddr) -> Outcome {
    let answer = match answered(dialled) {
        Ok(answer) => answer,
        Err(outcome) => return outcome,
    };
    if answer.role != "server" || answer.listener != to.port() {
        return Outcome::Fail(format!("captured: {}", who(answer)));
    }
    Outcome::Ok
}

/// A pod's address and the port dialled on it, and the same of its second family in a
/// dual-stack cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addresses {
    /// Of the pod's first address (`status.podIP`).
    pub first: SocketAddr,
    /// Of its address of the other family, when it has one (`status.podIPs`).
    pub second: Option<SocketAddr>,
}

/// What one node's apps printed, and the addresses they dialled.
#[derive(Clone, Debug, Default)]
pub struct NodeResults {
    /// The server's addresses.
    pub server: Option<Addresses>,
    /// The sidecar pod's addresses and the port dialled on it.
    pub sidecar: Option<Addresses>,
    /// The sidecar pod's app.
    pub sidecar_app: Vec<Dialled>,
    /// The excluded pod's app.
    pub excluded_app: Vec<Dialled>,
    /// The app of the pod outside the mesh (it also dials the sidecar pod).
    pub outside_app: Vec<Dialled>,
    /// The app of the pod with DNS capture.
    pub dns_app: Vec<Dialled>,
}

/// The target names the apps dial.
pub mod target {
    /// The server.
    pub const SERVER: &str = "server";
    /// The sidecar pod.
    pub const SIDECAR: &str = "sidecar";
    /// The server's address of the second family.
    pub const SERVER_SECOND: &str = "server-family-2";
    /// The sidecar pod's address of the second family.
    pub const SIDECAR_SECOND: &str = "sidecar-family-2";
    /// The sidecar pod of the next node, dialled by the pod outside the mesh.
    pub const SIDECAR_OTHER_NODE: &str = "sidecar-other-node";
    /// The DNS port of the server's address, over TCP.
    pub const DNS_TCP: &str = "dns-tcp";
    /// The same, over UDP.
    pub const DNS_UDP: &str = "dns-udp";
}

/// [`Check::CrossNode`] for the sidecar pod at `sidecar`, from what the app of the pod outside
/// the mesh on another node printed.
#[must_use]
pub fn cross_node(other_outside_app: &[Dialled], sidecar: SocketAddr) -> Outcome {
    redirected(
        find(other_outside_app, target::SIDECAR_OTHER_NODE),
        INBOUND_PORT,
        sidecar,
    )
}

/// A second-family check where the pods have one address: the cluster is not dual-stack.
fn one_family() -> Outcome {
    Outcome::NotChecked("the pods have addresses of one family (not a dual-stack cluster)".into())
}

/// Each of [`Check::PODS`]' outcome from `results`.
#[must_use]
pub fn judge(results: &NodeResults) -> Vec<(Check, Outcome)> {
    let missing = |what: &str| Outcome::NotChecked(format!("the {what} pod has no address"));
    Check::PODS
        .into_iter()
        .map(|check| {
            let outcome = match (check, results.server, results.sidecar) {
                (Check::AgentReady | Check::Host | Check::CrossNode | Check::Ambient, ..) => {
                    Outcome::NotChecked("not from the apps' results".into())
                }
                (_, None, _) => missing("server"),
                (Check::Inbound | Check::InboundSecond, _, None) => missing("sidecar"),
                (Check::Inbound, _, Some(sidecar)) => redirected(
                    find(&results.outside_app, target::SIDECAR),
                    INBOUND_PORT,
                    sidecar.first,
                ),
                (Check::InboundSecond, _, Some(sidecar)) => {
                    sidecar.second.map_or_else(one_family, |to| {
                        redirected(
                            find(&results.outside_app, target::SIDECAR_SECOND),
                            INBOUND_PORT,
                            to,
                        )
                    })
                }
                (Check::Outbound, Some(server), _) => redirected(
                    find(&results.sidecar_app, target::SERVER),
                    OUTBOUND_PORT,
                    server.first,
                ),
                (Check::OutboundSecond, Some(server), _) => {
                    server.second.map_or_else(one_family, |to| {
                        redirected(
                            find(&results.sidecar_app, target::SERVER_SECOND),
                            OUTBOUND_PORT,
                            to,
                        )
                    })
                }
                (Check::Excluded, Some(server), _) => {
                    direct(find(&results.excluded_app, target::SERVER), server.first)
                }
                (Check::Untouched, Some(server), _) => {
                    direct(find(&results.outside_app, target::SERVER), server.first)
                }
                (Check::Dns, Some(server), _) => dns(
                    &results.dns_app,
                    SocketAddr::new(server.first.ip(), DNS_PORT),
                ),
            };
            (check, outcome)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("address")
    }

    fn answered_by(name: &str, to: &str, role: &str, listener: u16, dst: Option<&str>) -> Dialled {
        Dialled {
            name: name.into(),
            to: addr(to),
            answer: Some(Answer {
                role: role.into(),
                listener,
                local: addr("10.0.0.2:1"),
                peer: addr("10.0.0.3:2"),
                original_dst: dst.map(addr),
            }),
            error: None,
        }
    }

    fn captured_node() -> NodeResults {
        let (server, sidecar) = ("10.1.0.1:8080", "10.1.0.2:9080");
        let (server6, sidecar6) = ("[fd00::1]:8080", "[fd00::2]:9080");
        NodeResults {
            server: Some(Addresses {
                first: addr(server),
                second: Some(addr(server6)),
            }),
            sidecar: Some(Addresses {
                first: addr(sidecar),
                second: Some(addr(sidecar6)),
            }),
            sidecar_app: vec![
                answered_by("server", server, "proxy", 15001, Some(server)),
                answered_by("server-family-2", server6, "proxy", 15001, Some(server6)),
            ],
            excluded_app: vec![answered_by("server", server, "server", 8080, None)],
            outside_app: vec![
                answered_by("server", server, "server", 8080, None),
                answered_by("sidecar", sidecar, "proxy", 15006, Some(sidecar)),
                answered_by("sidecar-family-2", sidecar6, "proxy", 15006, Some(sidecar6)),
            ],
            dns_app: vec![
                answered_by(
                    "dns-tcp",
                    "10.1.0.1:53",
                    "proxy",
                    15053,
                    Some("10.1.0.1:53"),
                ),
                answered_by("dns-udp", "10.1.0.1:53", "proxy", 15053, None),
            ],
        }
    }

    #[test]
    fn a_captured_node_passes_every_check() {
        let outcomes = judge(&captured_node());
        assert!(
            outcomes.iter().all(|(_, o)| *o == Outcome::Ok),
            "{outcomes:?}"
        );
    }

    #[test]
    fn each_wrong_answer_fails_its_check_naming_why() {
        let mut node = captured_node();
        node.sidecar_app[0] = answered_by("server", "10.1.0.1:8080", "server", 8080, None);
        node.excluded_app = vec![answered_by(
            "server",
            "10.1.0.1:8080",
            "proxy",
            15001,
            Some("10.1.0.1:8080"),
        )];
        node.outside_app[1] = answered_by("sidecar", "10.1.0.2:9080", "proxy", 15006, None);
        node.dns_app[1] = answered_by("dns-udp", "10.1.0.1:53", "proxy", 15001, None);
        let outcomes = judge(&node);
        let why = |check| match &outcomes.iter().find(|(c, _)| *c == check).expect("check").1 {
            Outcome::Fail(why) => why.clone(),
            other => panic!("{check:?}: {other:?}"),
        };
        assert!(why(Check::Outbound).starts_with("not captured: the server answered"));
        assert!(why(Check::Excluded).starts_with("captured: the proxy answered on port 15001"));
        assert!(why(Check::Inbound).starts_with("wrong original destination"));
        let found = |outcomes: &[(Check, Outcome)], check| {
            outcomes
                .iter()
                .find(|(c, _)| *c == check)
                .map(|(_, o)| o.clone())
        };
        assert_eq!(found(&outcomes, Check::Untouched), Some(Outcome::Ok));
        assert_eq!(found(&outcomes, Check::OutboundSecond), Some(Outcome::Ok));
        assert!(why(Check::Dns).starts_with("UDP: not captured: the proxy answered on port 15001"));
        node.dns_app[0] = answered_by("dns-tcp", "10.1.0.1:53", "proxy", 15053, None);
        node.sidecar_app[1] =
            answered_by("server-family-2", "[fd00::1]:8080", "server", 8080, None);
        let outcomes = judge(&node);
        assert_eq!(
            found(&outcomes, Check::Dns),
            Some(Outcome::Fail(
                "TCP: wrong original destination, 10.1.0.1:53 was dialled: the proxy answered on \
                 port 15053 (original destination none)"
                    .into()
            ))
        );
        assert_eq!(
            found(&outcomes, Check::OutboundSecond),
            Some(Outcome::Fail(
                "not captured: the server answered on port 8080 (original destination none)".into()
            ))
        );
        assert_eq!(
            found(&outcomes, Check::Outbound),
            Some(Outcome::Fail(why(Check::Outbound)))
        );
    }

    #[test]
    fn cross_node_inbound_is_the_other_nodes_outside_app_reaching_15006() {
        let sidecar = "10.2.0.2:9080";
        let app = vec![answered_by(
            "sidecar-other-node",
            sidecar,
            "proxy",
            15006,
            Some(sidecar),
        )];
        assert_eq!(cross_node(&app, addr(sidecar)), Outcome::Ok);
        let app = vec![Dialled {
            name: "sidecar-other-node".into(),
            to: addr(sidecar),
            answer: None,
            error: Some("connection refused".into()),
        }];
        assert_eq!(
            cross_node(&app, addr(sidecar)),
            Outcome::Fail("nothing answered 10.2.0.2:9080: connection refused".into())
        );
        assert_eq!(
            cross_node(&[], addr(sidecar)),
            Outcome::Fail("the app printed no result".into())
        );
    }

    #[test]
    fn no_answer_and_no_line_fail_and_no_address_is_not_checked() {
        let mut node = captured_node();
        node.sidecar_app = vec![Dialled {
            name: "server".into(),
            to: addr("10.1.0.1:8080"),
            answer: None,
            error: Some("connection refused".into()),
        }];
        node.outside_app.clear();
        node.sidecar = None;
        node.server = node.server.map(|server| Addresses {
            second: None,
            ..server
        });
        let outcomes = judge(&node);
        assert_eq!(
            outcomes,
            vec![
                (
                    Check::Outbound,
                    Outcome::Fail("nothing answered 10.1.0.1:8080: connection refused".into())
                ),
                (
                    Check::Inbound,
                    Outcome::NotChecked("the sidecar pod has no address".into())
                ),
                (Check::OutboundSecond, one_family()),
                (
                    Check::InboundSecond,
                    Outcome::NotChecked("the sidecar pod has no address".into())
                ),
                (Check::Excluded, Outcome::Ok),
                (
                    Check::Untouched,
                    Outcome::Fail("the app printed no result".into())
                ),
                (Check::Dns, Outcome::Ok),
            ]
        );
    }

    #[test]
    fn results_are_read_from_a_log_among_other_lines() {
        let line = serde_json::to_string(&captured_node().outside_app[1]).expect("json");
        let log = format!("starting\n{line}\nnot json\n");
        assert_eq!(results(&log), vec![captured_node().outside_app[1].clone()]);
    }
}
