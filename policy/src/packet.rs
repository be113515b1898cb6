//! The inputs and outputs of a capture decision, shared by the policy's own decision
//! ([`super::RedirectPolicy::decide`]) and the evaluator of the rendered rules
//! ([`super::RuleSet::evaluate`]), so that the two (and the eBPF decision) can be compared on
//! generated packets.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::model::Family;

/// Which way a packet goes, seen from the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Sent by a local socket (netfilter `OUTPUT`): the owner match (uid/gid) applies.
    Outbound,
    /// Received on an interface (netfilter `PREROUTING`).
    Inbound,
}

/// The transport protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// The packet's conntrack state. NAT rules only see the first packet of a connection
/// ([`CtState::New`]); the mangle rules see every packet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CtState {
    /// First packet of a connection.
    #[default]
    New,
    /// A packet of a connection that has seen traffic both ways.
    Established,
    /// A packet related to a known connection (ICMP errors, FTP data).
    Related,
    /// A packet conntrack cannot place.
    Invalid,
}

/// One packet (in practice: the first packet of a connection, or a UDP datagram).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Packet {
    /// Outbound (from a local socket) or inbound (from an interface).
    pub direction: Direction,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// Source address; same family as `dst`.
    pub src: IpAddr,
    /// Destination address; its family picks the rule set (iptables or ip6tables).
    pub dst: IpAddr,
    /// Destination port.
    pub dst_port: u16,
    /// The sending socket's uid (outbound only; ignored inbound).
    pub uid: u32,
    /// The sending socket's gid (outbound only; ignored inbound).
    pub gid: u32,
    /// The interface: outbound, the one the packet leaves by (`lo` for local destinations);
    /// inbound, the one it arrived on.
    pub interface: String,
    /// The packet mark (`skb->mark`) before the rules run.
    pub mark: u32,
    /// The connection's mark (`CONNMARK`).
    pub ct_mark: u32,
    /// The conntrack state.
    pub ct_state: CtState,
}

impl Packet {
    /// The first packet of a new outbound TCP connection from a socket owned by `uid`/`gid`.
    #[must_use]
    pub fn outbound_tcp(
        src: IpAddr,
        dst: IpAddr,
        dst_port: u16,
        uid: u32,
        gid: u32,
        interface: &str,
    ) -> Self {
        Self {
            direction: Direction::Outbound,
            protocol: Protocol::Tcp,
            src,
            dst,
            dst_port,
            uid,
            gid,
            interface: interface.to_owned(),
            mark: 0,
            ct_mark: 0,
            ct_state: CtState::New,
        }
    }

    /// The first packet of a new inbound TCP connection arriving on `interface`.
    #[must_use]
    pub fn inbound_tcp(src: IpAddr, dst: IpAddr, dst_port: u16, interface: &str) -> Self {
        Self {
            direction: Direction::Inbound,
            protocol: Protocol::Tcp,
            src,
            dst,
            dst_port,
            uid: 0,
            gid: 0,
            interface: interface.to_owned(),
            mark: 0,
            ct_mark: 0,
            ct_state: CtState::New,
        }
    }

    /// The same packet as UDP.
    #[must_use]
    pub fn udp(mut self) -> Self {
        self.protocol = Protocol::Udp;
        self
    }

    /// The address family (of the destination).
    #[must_use]
    pub fn family(&self) -> Family {
        Family::of(self.dst)
    }
}

/// What happens to a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "verdict", content = "port")]
pub enum Verdict {
    /// Left alone (not captured).
    Pass,
    /// NAT to this local port (15001 outbound, 15006 inbound, 15053 DNS); Envoy reads the
    /// original destination with `SO_ORIGINAL_DST`.
    Redirect(u16),
    /// Transparently delivered to the listener on this port (TPROXY mode inbound).
    Tproxy(u16),
    /// Dropped (`INVALID_DROP`).
    Drop,
}

/// A verdict and the packet mark the rules leave (TPROXY mode marks packets: 1337 for diverted
/// inbound traffic, 1338 for the proxy's own loopback traffic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Outcome {
    /// What happens to the packet.
    pub verdict: Verdict,
    /// The packet's mark afterwards.
    pub mark: u32,
}
