//! The decision against the Istio goldens (`../shared/reference/istio-cni-golden/`), rule by
//! rule, with plain collections for the maps.
use std::vec::Vec;

use super::*;
use crate::{PodConfig, flags};

const APP: u32 = 1000;
const PROXY: u32 = 1337;

#[derive(Default)]
struct Tables {
    ports: Vec<(PortKind, u16)>,
    cidrs: Vec<(CidrKind, Addr, u32, u32)>,
}

fn bits(addr: &Addr) -> u128 {
    match *addr {
        Addr::V4(a) => u128::from(u32::from_be(a)) << 96,
        Addr::V6(w) => w.iter().fold(0u128, |acc, word| {
            (acc << 32) | u128::from(u32::from_be(*word))
        }),
    }
}

impl PodTables for Tables {
    fn has_port(&self, kind: PortKind, port: u16) -> bool {
        self.ports.contains(&(kind, port))
    }

    fn lookup(&self, kind: CidrKind, addr: &Addr) -> Option<u32> {
        self.cidrs
            .iter()
            .filter(|(k, net, len, _)| {
                let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
                *k == kind && net.family() == addr.family() && bits(net) & mask == bits(addr) & mask
            })
            .max_by_key(|(_, _, len, _)| *len)
            .map(|(_, _, _, v)| *v)
    }
}

fn v4(text: &str) -> Addr {
    Addr::v4(text.parse::<std::net::Ipv4Addr>().unwrap().octets())
}

fn v6(text: &str) -> Addr {
    Addr::v6(text.parse::<std::net::Ipv6Addr>().unwrap().octets())
}

/// An entry with value 0; `len` counts from the start of the address (IPv4 addresses sit in
/// the top bits of [`bits`]).
fn cidr(kind: CidrKind, addr: Addr, len: u32) -> (CidrKind, Addr, u32, u32) {
    (kind, addr, len, 0)
}

/// The basic golden's pod: 10.0.0.2, everything default.
fn basic() -> (PodConfig, Tables) {
    let pod = PodConfig {
        pod_id: 1,
        flags: flags::INBOUND_ALL,
        proxy_uid: PROXY,
        proxy_gid: PROXY,
    };
    let mut t = Tables::default();
    t.ports.push((PortKind::ExcludeOutbound, 15020));
    for p in [15020, 15021, 15090] {
        t.ports.push((PortKind::ExcludeInbound, p));
    }
    t.cidrs
        .push(cidr(CidrKind::IncludeOutbound, v4("0.0.0.0"), 0));
    t.cidrs.push(cidr(CidrKind::IncludeOutbound, v6("::"), 0));
    t.cidrs.push(cidr(CidrKind::Local, v4("10.0.0.2"), 32));
    (pod, t)
}

fn tcp(dst: Addr, port: u16, uid: u32, gid: u32) -> Outbound {
    Outbound {
        proto: Proto::Tcp,
        dst,
        dst_port: port,
        src: if matches!(dst, Addr::V4(_)) {
            Addr::V4(0)
        } else {
            Addr::V6([0; 4])
        },
        uid,
        gid,
        mark: 0,
    }
}

fn udp(dst: Addr, port: u16, uid: u32) -> Outbound {
    Outbound {
        proto: Proto::Udp,
        ..tcp(dst, port, uid, uid)
    }
}

fn out(pod: &PodConfig, t: &Tables, c: Outbound) -> Verdict {
    decide_outbound(pod, &c, t)
}

const OUT: Verdict = Verdict::Redirect(PROXY_OUTBOUND_PORT);
const IN: Verdict = Verdict::Redirect(PROXY_INBOUND_PORT);
const DNS: Verdict = Verdict::Redirect(DNS_PROXY_PORT);
const PASS: Verdict = Verdict::Pass;

#[test]
fn basic_outbound() {
    let (pod, t) = basic();
    let cases = [
        (tcp(v4("10.1.2.3"), 80, APP, APP), OUT, "app to a service"),
        (
            tcp(v4("10.1.2.3"), 15020, APP, APP),
            PASS,
            "excluded port (tcp)",
        ),
        (udp(v4("10.1.2.3"), 15020, APP), PASS, "excluded port (udp)"),
        (
            udp(v4("10.1.2.3"), 53, APP),
            PASS,
            "udp without DNS capture",
        ),
        (
            tcp(v4("127.0.0.1"), 8080, APP, APP),
            PASS,
            "app to localhost",
        ),
        (tcp(v4("127.0.0.9"), 8080, APP, APP), PASS, "app loopback"),
        (
            tcp(v4("10.0.0.2"), 8080, APP, APP),
            PASS,
            "app to its own address",
        ),
        (tcp(v4("10.0.0.2"), 8080, PROXY, PROXY), IN, "proxy hairpin"),
        (
            tcp(v4("127.0.0.6"), 15002, PROXY, PROXY),
            IN,
            "istio-validation probe",
        ),
        (
            tcp(v4("127.0.0.1"), 15000, PROXY, PROXY),
            PASS,
            "proxy to localhost",
        ),
        (
            tcp(v4("10.0.0.2"), 15008, PROXY, PROXY),
            PASS,
            "proxy to HBONE",
        ),
        (
            tcp(v4("10.1.2.3"), 80, PROXY, PROXY),
            PASS,
            "proxy's own upstream",
        ),
        (tcp(v4("10.1.2.3"), 80, APP, PROXY), PASS, "proxy gid"),
        (
            tcp(v4("10.0.0.2"), 8080, APP, PROXY),
            PASS,
            "proxy gid, loopback: uid rule returns first",
        ),
        (
            tcp(v4("10.0.0.2"), 8080, PROXY, APP),
            IN,
            "proxy uid, other gid",
        ),
        (udp(v4("10.0.0.2"), 9999, PROXY), PASS, "proxy udp loopback"),
    ];
    for (c, want, what) in cases {
        assert_eq!(out(&pod, &t, c), want, "{what}: {c:?}");
    }
    let mut bound = tcp(v4("10.0.0.2"), 8080, PROXY, PROXY);
    bound.src = v4("127.0.0.6");
    assert_eq!(
        out(&pod, &t, bound),
        PASS,
        "inbound passthrough from 127.0.0.6"
    );
    bound.dst = v4("10.1.2.3");
    assert_eq!(
        out(&pod, &t, bound),
        PASS,
        "127.0.0.6 off loopback: proxy uid returns"
    );
}

#[test]
fn custom_uid_gid() {
    let (mut pod, t) = basic();
    pod.proxy_uid = 1_000_670_000;
    pod.proxy_gid = 1_000_670_001;
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 80, PROXY, PROXY)), OUT);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.1.2.3"), 80, 1_000_670_000, APP)),
        PASS
    );
    assert_eq!(
        out(&pod, &t, tcp(v4("10.0.0.2"), 80, 1_000_670_000, APP)),
        IN
    );
}

#[test]
fn include_exclude_ip() {
    let (mut pod, mut t) = basic();
    pod.flags |= flags::INCLUDE_LOOPBACK;
    t.cidrs.retain(|c| c.0 != CidrKind::IncludeOutbound);
    t.cidrs
        .push(cidr(CidrKind::IncludeOutbound, v4("127.0.0.0"), 8));
    t.cidrs
        .push(cidr(CidrKind::ExcludeOutbound, v4("10.0.0.0"), 8));
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.5"), 80, APP, APP)), OUT);
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.1"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 80, APP, APP)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.0.0.2"), 80, APP, APP)),
        PASS,
        "excluded own IP"
    );
    assert_eq!(out(&pod, &t, tcp(v4("8.8.8.8"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v6("2001:db8::1"), 80, APP, APP)), PASS);
    // With the loopback include, a gid-only proxy process on loopback is sent inbound.
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.5"), 80, APP, PROXY)), IN);
}

#[test]
fn ports() {
    let (pod, mut t) = basic();
    t.ports.retain(|p| p.0 != PortKind::ExcludeOutbound);
    t.ports.push((PortKind::ExcludeOutbound, 5555));
    t.cidrs.retain(|c| c.0 != CidrKind::IncludeOutbound);
    t.ports.push((PortKind::IncludeOutbound, 3306));
    t.cidrs
        .push(cidr(CidrKind::ExcludeOutbound, v4("10.9.0.0"), 16));
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 3306, APP, APP)), OUT);
    assert_eq!(out(&pod, &t, udp(v4("10.1.2.3"), 3306, APP)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.9.2.3"), 3306, APP, APP)),
        PASS,
        "exclude CIDR first"
    );
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 15020, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 5555, PROXY, PROXY)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.0.0.2"), 5555, PROXY, PROXY)),
        PASS,
        "excluded first"
    );
}

#[test]
fn dns_capture() {
    let (mut pod, t) = basic();
    pod.flags |= flags::DNS_CAPTURE;
    assert_eq!(out(&pod, &t, udp(v4("10.96.0.10"), 53, APP)), DNS);
    assert_eq!(out(&pod, &t, tcp(v4("10.96.0.10"), 53, APP, APP)), DNS);
    assert_eq!(
        out(&pod, &t, udp(v4("127.0.0.53"), 53, APP)),
        DNS,
        "local stub resolver"
    );
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.53"), 53, APP, APP)), DNS);
    assert_eq!(
        out(&pod, &t, udp(v4("127.0.0.1"), 53, APP)),
        DNS,
        "DNS before 127.0.0.1"
    );
    assert_eq!(
        out(&pod, &t, udp(v4("10.96.0.10"), 53, PROXY)),
        PASS,
        "proxy's own DNS"
    );
    assert_eq!(out(&pod, &t, tcp(v4("10.0.0.2"), 53, PROXY, PROXY)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.0.0.2"), 53, APP, PROXY)),
        IN,
        "gid rule has no 53"
    );
    assert_eq!(out(&pod, &t, udp(v4("127.0.0.9"), 5000, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.9"), 5000, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, udp(v4("10.1.2.3"), 5000, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("10.1.2.3"), 80, APP, APP)), OUT);
}

#[test]
fn ipv6() {
    let (mut pod, mut t) = basic();
    assert_eq!(
        out(&pod, &t, tcp(v6("2001:db8::9"), 80, APP, APP)),
        PASS,
        "v6 off"
    );
    pod.flags |= flags::IPV6;
    t.cidrs.push(cidr(CidrKind::Local, v6("fd00::2"), 128));
    t.cidrs.push(cidr(CidrKind::Local, v6("::6"), 128));
    assert_eq!(out(&pod, &t, tcp(v6("2001:db8::9"), 80, APP, APP)), OUT);
    assert_eq!(out(&pod, &t, tcp(v6("::1"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v6("::1"), 80, PROXY, PROXY)), PASS);
    assert_eq!(out(&pod, &t, tcp(v6("fd00::2"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v6("fd00::2"), 80, PROXY, PROXY)), IN);
    assert_eq!(out(&pod, &t, tcp(v6("::6"), 15002, PROXY, PROXY)), IN);
    let mut bound = tcp(v6("fd00::2"), 80, PROXY, PROXY);
    bound.src = v6("::6");
    assert_eq!(out(&pod, &t, bound), PASS);
}

#[test]
fn excluded_interface_routes() {
    let (mut pod, mut t) = basic();
    pod.flags |= flags::EXCLUDED_ROUTES;
    t.cidrs.push((CidrKind::Route, v4("0.0.0.0"), 0, 0));
    t.cidrs.push((CidrKind::Route, v4("192.168.0.0"), 16, 1));
    t.cidrs.push((CidrKind::Route, v4("192.168.5.0"), 24, 0));
    assert_eq!(out(&pod, &t, tcp(v4("192.168.1.1"), 80, APP, APP)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v4("192.168.5.1"), 80, APP, APP)),
        OUT,
        "longer route wins"
    );
    assert_eq!(out(&pod, &t, tcp(v4("10.1.1.1"), 80, APP, APP)), OUT);
}

#[test]
fn tproxy_marked_upstream() {
    let (mut pod, t) = basic();
    let mut c = tcp(v4("10.0.0.2"), 8080, PROXY, PROXY);
    c.src = v4("10.5.0.1");
    c.mark = TPROXY_MARK;
    assert_eq!(out(&pod, &t, c), IN, "REDIRECT mode ignores marks");
    pod.flags |= flags::TPROXY;
    assert_eq!(out(&pod, &t, c), PASS);
}

fn inbound(port: u16) -> Inbound {
    Inbound {
        src: v4("10.9.9.9"),
        dst_port: port,
        mark: 0,
        iface: 0,
        syn: true,
        ack: false,
        existing: Existing::Nothing,
    }
}

#[test]
fn inbound_default_and_lists() {
    let (mut pod, mut t) = basic();
    let dec = |pod: &PodConfig, t: &Tables, c: Inbound| decide_inbound(pod, &c, t);
    assert_eq!(dec(&pod, &t, inbound(8080)), IN);
    for port in [15008, 15020, 15021, 15090] {
        assert_eq!(dec(&pod, &t, inbound(port)), PASS, "{port}");
    }
    let established = Inbound {
        existing: Existing::Connection,
        ..inbound(8080)
    };
    assert_eq!(dec(&pod, &t, established), PASS);
    let reused = Inbound {
        existing: Existing::TimeWait,
        ..inbound(8080)
    };
    assert_eq!(
        dec(&pod, &t, reused),
        IN,
        "a SYN on a 4-tuple in TIME_WAIT opens a new connection, captured"
    );
    let late = Inbound {
        syn: false,
        ack: true,
        ..reused
    };
    assert_eq!(
        dec(&pod, &t, late),
        PASS,
        "the TIME_WAIT socket keeps the old connection's packets"
    );
    let uncaptured = Inbound {
        existing: Existing::TimeWait,
        ..inbound(15020)
    };
    assert_eq!(dec(&pod, &t, uncaptured), PASS, "not captured: let through");
    let cookie_ack = Inbound {
        syn: false,
        ack: true,
        existing: Existing::Listener,
        ..inbound(8080)
    };
    assert_eq!(
        dec(&pod, &t, cookie_ack),
        IN,
        "SYN cookie ACK still captured"
    );
    let reroute = Inbound {
        iface: iface_flags::REROUTE,
        ..inbound(15008)
    };
    assert_eq!(dec(&pod, &t, reroute), OUT);

    pod.flags |= flags::TPROXY;
    assert_eq!(
        dec(&pod, &t, inbound(15008)),
        IN,
        "TPROXY's mangle chain has no 15008 rule"
    );

    pod.flags &= !(flags::TPROXY | flags::INBOUND_ALL);
    t.ports.push((PortKind::IncludeInbound, 1111));
    t.ports.push((PortKind::ExcludeInbound, 1111));
    assert_eq!(
        dec(&pod, &t, inbound(1111)),
        IN,
        "exclude ignored with a list"
    );
    assert_eq!(dec(&pod, &t, inbound(8080)), PASS);

    pod.flags |= flags::INVALID_DROP;
    let junk = Inbound {
        syn: false,
        ack: false,
        ..inbound(1111)
    };
    assert_eq!(dec(&pod, &t, junk), Verdict::Drop);
}

/// The flags that skip lookups (set by the agent from the lists it writes) decide as the
/// lookups do, for the basic pod (`*` include, no exclude ranges, no include ports).
#[test]
fn skip_flags_decide_as_lookups() {
    let (pod, t) = basic();
    let skipping = PodConfig {
        flags: pod.flags | flags::INCLUDE_ALL | flags::NO_EXCLUDE_CIDRS | flags::NO_INCLUDE_PORTS,
        ..pod
    };
    let dsts = [
        v4("10.1.2.3"),
        v4("127.0.0.1"),
        v4("127.0.0.6"),
        v4("10.0.0.2"),
        v6("::1"),
        v6("2001:db8::1"),
    ];
    for dst in dsts {
        for port in [53, 80, 15001, 15006, 15008, 15020] {
            for uid in [APP, PROXY] {
                for c in [tcp(dst, port, uid, uid), udp(dst, port, uid)] {
                    assert_eq!(out(&pod, &t, c), out(&skipping, &t, c), "{c:?}");
                }
            }
        }
    }
    // An empty exclude-port list, skipped.
    let mut t = t;
    t.ports.retain(|p| p.0 != PortKind::ExcludeOutbound);
    let no_exclude = PodConfig {
        flags: skipping.flags | flags::NO_EXCLUDE_PORTS,
        ..pod
    };
    let c = tcp(v4("10.1.2.3"), 15020, APP, APP);
    assert_eq!(out(&pod, &t, c), OUT);
    assert_eq!(out(&no_exclude, &t, c), OUT);
}

/// An ambient pod as Istio's `default` in-pod golden: 10.0.0.2, DNS captured, no IPv6.
fn ambient() -> (PodConfig, Tables) {
    let pod = PodConfig {
        pod_id: 1,
        flags: flags::AMBIENT | flags::DNS_CAPTURE,
        proxy_uid: 0,
        proxy_gid: 0,
    };
    let mut t = Tables::default();
    t.cidrs.push(cidr(CidrKind::Local, v4("10.0.0.2"), 32));
    t.cidrs
        .push(cidr(CidrKind::ProbeSource, v4("169.254.7.127"), 32));
    (pod, t)
}

#[test]
fn ambient_outbound_as_the_inpod_golden() {
    let (mut pod, t) = ambient();
    let marked = |mut c: Outbound, mark: u32| {
        c.mark = mark;
        c
    };
    let remote = v4("10.1.2.3");
    assert_eq!(out(&pod, &t, tcp(remote, 80, APP, APP)), OUT);
    assert_eq!(
        out(&pod, &t, tcp(remote, 80, 0, 0)),
        OUT,
        "uids do not matter"
    );
    assert_eq!(
        out(&pod, &t, marked(tcp(remote, 80, 0, 0), 0x539)),
        PASS,
        "ztunnel's own"
    );
    assert_eq!(
        out(&pod, &t, marked(tcp(remote, 80, 0, 0), 0x7539)),
        PASS,
        "under the mask"
    );
    assert_eq!(
        out(&pod, &t, marked(tcp(remote, 80, 0, 0), 0x111)),
        PASS,
        "the reply mark"
    );
    assert_eq!(out(&pod, &t, tcp(v4("169.254.7.127"), 80, APP, APP)), PASS);
    assert_eq!(
        out(&pod, &t, udp(v4("169.254.7.127"), 53, APP)),
        DNS,
        "the probe rule is TCP only"
    );
    for local in ["10.0.0.2", "127.0.0.2"] {
        assert_eq!(out(&pod, &t, tcp(v4(local), 80, APP, APP)), PASS, "{local}");
    }
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.1"), 80, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, udp(remote, 53, APP)), DNS);
    assert_eq!(out(&pod, &t, tcp(remote, 53, APP, APP)), DNS);
    assert_eq!(
        out(&pod, &t, tcp(v4("10.0.0.2"), 53, APP, APP)),
        DNS,
        "TCP DNS to a local address other than 127.0.0.1 is captured before -o lo"
    );
    assert_eq!(out(&pod, &t, udp(v4("10.0.0.2"), 53, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(v4("127.0.0.1"), 53, APP, APP)), PASS);
    assert_eq!(out(&pod, &t, marked(udp(remote, 53, 0), 0x539)), PASS);
    assert_eq!(out(&pod, &t, udp(remote, 443, APP)), PASS);
    assert_eq!(
        out(&pod, &t, tcp(v6("2001:db8::1"), 80, APP, APP)),
        PASS,
        "no ip6tables rules without ambient.ipv6"
    );
    pod.flags &= !flags::DNS_CAPTURE;
    assert_eq!(out(&pod, &t, udp(remote, 53, APP)), PASS);
    assert_eq!(out(&pod, &t, tcp(remote, 53, APP, APP)), OUT);
}

#[test]
fn ambient_inbound_as_the_inpod_golden() {
    let (mut pod, t) = ambient();
    let dec = |pod: &PodConfig, c: Inbound| decide_inbound(pod, &c, &t);
    assert_eq!(dec(&pod, inbound(8080)), IN);
    assert_eq!(dec(&pod, inbound(15020)), IN, "no exclude list in ambient");
    assert_eq!(dec(&pod, inbound(15008)), PASS, "HBONE");
    let probe = Inbound {
        src: v4("169.254.7.127"),
        ..inbound(8080)
    };
    assert_eq!(dec(&pod, probe), PASS, "kubelet's probe");
    let marked = Inbound {
        mark: 0x1539,
        ..inbound(8080)
    };
    assert_eq!(dec(&pod, marked), PASS, "ztunnel's mark");
    let established = Inbound {
        existing: Existing::Connection,
        ..inbound(8080)
    };
    assert_eq!(dec(&pod, established), PASS);
    let reused = Inbound {
        existing: Existing::TimeWait,
        ..inbound(8080)
    };
    assert_eq!(dec(&pod, reused), IN, "a SYN on a 4-tuple in TIME_WAIT");
    let late = Inbound {
        syn: false,
        ack: true,
        ..reused
    };
    assert_eq!(dec(&pod, late), PASS, "the TIME_WAIT socket's packets");
    let reroute = Inbound {
        iface: iface_flags::REROUTE,
        ..probe
    };
    assert_eq!(dec(&pod, reroute), OUT, "rerouted before the probe rule");
    pod.flags |= flags::BYPASS_INBOUND;
    assert_eq!(dec(&pod, inbound(8080)), PASS);
    assert_eq!(dec(&pod, reroute), OUT);
}
