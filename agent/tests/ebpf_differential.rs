//! The eBPF decision (meshcap-common, fed with the map entries the eBPF backend writes)
//! against the evaluator of the iptables rules Istio would write for the same policy: 100,000
//! generated (policy, connection) cases, zero disagreements; and the same for ambient mode's
//! in-pod capture against Istio's in-pod rules.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use meshcap_agent::{
    backend::ebpf::{Entries, encode, encode_ambient},
    podnet::PodNet,
};
use meshcap_common::{
    Addr, CidrKind, Existing, Inbound, Outbound, PodTables, PortKind, Proto, Verdict,
    decide_inbound, decide_outbound,
};
use meshcap_policy::{
    CidrSet, InterceptionMode, IpPrefix, IpRanges, Packet, PodName, PortSelection, RedirectPolicy,
    RuleEvaluator, Verdict as RuleVerdict,
    ambient::{HostProbeSnat, InpodPolicy},
};

/// A small deterministic generator (xorshift64*): reproducible failures, no dependencies.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        let len = u64::try_from(items.len()).unwrap_or(1);
        items[usize::try_from(self.next() % len).unwrap_or(0)]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn some<T: Copy>(&mut self, items: &[T], percent: u64) -> Vec<T> {
        items
            .iter()
            .copied()
            .filter(|_| self.chance(percent))
            .collect()
    }
}

const POD_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const POD_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
const PORTS: [u16; 12] = [
    53, 80, 443, 3306, 5555, 8080, 15001, 15006, 15008, 15020, 15021, 15090,
];
const IDS: [u32; 4] = [0, 1000, 1337, 1_000_670_000];
/// What a new connection's SYN can find under its 4-tuple in the pod: nothing, the listener,
/// or the pod's end of an earlier connection in `TIME_WAIT`. Istio's rules decide all three
/// alike (conntrack reopens a connection in `TIME_WAIT` on a SYN and NATs it again).
const SYN_FINDS: [Existing; 3] = [Existing::Nothing, Existing::Listener, Existing::TimeWait];
const CIDRS: [&str; 12] = [
    "127.0.0.0/8",
    "127.0.0.1/32",
    "10.0.0.0/8",
    "10.0.0.2/32",
    "10.1.0.0/16",
    "0.0.0.0/0",
    "192.168.0.0/16",
    "::1/128",
    "fd00::/8",
    "2001:db8::/32",
    "::/0",
    "8.8.8.8/32",
];

fn cidr_set(g: &mut Gen, percent: u64) -> CidrSet {
    let mut set = CidrSet::default();
    for text in g.some(&CIDRS, percent) {
        let p: IpPrefix = text.parse().expect("valid CIDR");
        if p.addr().is_ipv4() {
            set.v4.push(p);
        } else {
            set.v6.push(p);
        }
    }
    set
}

fn policy(g: &mut Gen) -> RedirectPolicy {
    let ipv6 = g.chance(50);
    let mut pod_ips = vec![IpAddr::V4(POD_V4)];
    if ipv6 {
        pod_ips.push(IpAddr::V6(POD_V6));
    }
    let include_inbound_ports = match g.next() % 3 {
        0 => PortSelection::All,
        1 => PortSelection::Ports(g.some(&PORTS, 30)),
        _ => PortSelection::Ports(Vec::new()),
    };
    let mut exclude_inbound_ports = g.some(&PORTS, 20);
    exclude_inbound_ports.extend([15020, 15021, 15090]);
    RedirectPolicy {
        pod: PodName {
            namespace: "default".into(),
            name: "gen".into(),
        },
        pod_ips,
        ipv6,
        dual_stack: ipv6,
        mode: if g.chance(30) {
            InterceptionMode::Tproxy
        } else {
            InterceptionMode::Redirect
        },
        include_outbound_ip_ranges: if g.chance(40) {
            IpRanges::All
        } else {
            IpRanges::Cidrs(cidr_set(g, 25))
        },
        exclude_outbound_ip_ranges: cidr_set(g, 15),
        include_inbound_ports,
        exclude_inbound_ports,
        include_outbound_ports: g.some(&PORTS, 15),
        exclude_outbound_ports: if g.chance(50) {
            vec![15020]
        } else {
            g.some(&PORTS, 15)
        },
        exclude_interfaces: Vec::new(),
        reroute_virtual_interfaces: Vec::new(),
        proxy_uid: g.pick(&[1337, 1337, 1_000_670_000]),
        proxy_gid: g.pick(&[1337, 1337, 1_000_670_001]),
        dns_capture: g.chance(40),
        invalid_drop: g.chance(10),
    }
}

/// The maps' content, on the host.
struct Tables(Entries);

fn bits(addr: IpAddr) -> (u128, u32) {
    match addr {
        IpAddr::V4(a) => (u128::from(u32::from(a)) << 96, 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

fn ip_of(addr: &Addr) -> IpAddr {
    match *addr {
        Addr::V4(a) => IpAddr::V4(Ipv4Addr::from(a.to_ne_bytes())),
        Addr::V6(w) => {
            let mut o = [0u8; 16];
            for (i, word) in w.iter().enumerate() {
                o[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(o))
        }
    }
}

impl PodTables for Tables {
    fn has_port(&self, kind: PortKind, port: u16) -> bool {
        self.0.ports.contains(&(kind, port))
    }

    fn lookup(&self, kind: CidrKind, addr: &Addr) -> Option<u32> {
        let ip = ip_of(addr);
        let (want, _) = bits(ip);
        self.0
            .cidrs
            .iter()
            .filter(|(k, net, len, _)| {
                let (have, _) = bits(*net);
                let mask = u128::MAX.checked_shl(128 - u32::from(*len)).unwrap_or(0);
                *k == kind && net.is_ipv4() == ip.is_ipv4() && have & mask == want & mask
            })
            .max_by_key(|(_, _, len, _)| *len)
            .map(|(_, _, _, v)| *v)
    }
}

fn addr(ip: IpAddr) -> Addr {
    match ip {
        IpAddr::V4(a) => Addr::v4(a.octets()),
        IpAddr::V6(a) => Addr::v6(a.octets()),
    }
}

fn same(ebpf: Verdict, rules: RuleVerdict) -> bool {
    match (ebpf, rules) {
        (Verdict::Pass, RuleVerdict::Pass) | (Verdict::Drop, RuleVerdict::Drop) => true,
        (Verdict::Redirect(a), RuleVerdict::Redirect(b) | RuleVerdict::Tproxy(b)) => a == b,
        _ => false,
    }
}

/// The source the kernel gives an unbound socket's connection to `dst`: the loopback address
/// for loopback destinations, else the pod's address.
fn source_for(dst: IpAddr) -> IpAddr {
    match dst {
        IpAddr::V4(a) if a.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_loopback() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        IpAddr::V4(_) => IpAddr::V4(POD_V4),
        IpAddr::V6(_) => IpAddr::V6(POD_V6),
    }
}

/// The unspecified address of `dst`'s family: an unbound socket's source.
fn unspecified(dst: IpAddr) -> IpAddr {
    if dst.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    }
}

/// Keeps a case where the eBPF decision and the rules differ.
fn disagree(
    disagreements: &mut Vec<String>,
    policy: &dyn std::fmt::Debug,
    packet: &Packet,
    got: Verdict,
    want: RuleVerdict,
) {
    if !same(got, want) {
        disagreements.push(format!(
            "{policy:?}\n{packet:?}\nebpf {got:?} rules {want:?}"
        ));
    }
}

fn assert_agree(disagreements: &[String], cases: usize) {
    assert!(
        disagreements.is_empty(),
        "{} of {cases} cases disagree; first:\n{}",
        disagreements.len(),
        disagreements.first().map_or("", String::as_str)
    );
}

#[test]
fn ebpf_decision_agrees_with_istios_rules() {
    let mut g = Gen(0x6d65_7368_6361_7001);
    let dsts: [IpAddr; 11] = [
        "127.0.0.1",
        "127.0.0.6",
        "127.0.0.53",
        "10.0.0.2",
        "10.1.2.3",
        "8.8.8.8",
        "192.168.1.1",
        "::1",
        "::6",
        "fd00::2",
        "2001:db8::1",
    ]
    .map(|s| s.parse().expect("address"));
    let mut disagreements = Vec::new();
    let mut cases = 0;
    while cases < 100_000 {
        let policy = policy(&mut g);
        let rules = RuleEvaluator::new(&policy.render()).expect("rendered rules parse");
        let mut entries = encode(&policy);
        let net = PodNet {
            addresses: policy.pod_ips.clone(),
            ..PodNet::default()
        };
        entries.add_pod_net(&net, &[], &[]);
        let pod = entries.config;
        let tables = Tables(entries);
        for _ in 0..20 {
            let dst = g.pick(&dsts);
            if dst.is_ipv6() && !policy.ipv6 {
                continue;
            }
            cases += 1;
            let port = g.pick(&PORTS);
            if g.chance(25) {
                let src: IpAddr = if dst.is_ipv4() {
                    "10.9.9.9".parse().expect("address")
                } else {
                    "2001:db8::9".parse().expect("address")
                };
                let own = if dst.is_ipv4() {
                    IpAddr::V4(POD_V4)
                } else {
                    IpAddr::V6(POD_V6)
                };
                let packet = Packet::inbound_tcp(src, own, port, "eth0");
                let want = rules.evaluate(&packet).verdict;
                for existing in SYN_FINDS {
                    let c = Inbound {
                        src: addr(src),
                        dst_port: port,
                        mark: 0,
                        iface: 0,
                        syn: true,
                        ack: false,
                        existing,
                    };
                    let got = decide_inbound(&pod, &c, &tables);
                    disagree(&mut disagreements, &policy, &packet, got, want);
                }
                continue;
            }
            let udp = g.chance(30);
            let (uid, gid) = (g.pick(&IDS), g.pick(&IDS));
            let via_lo = dst.is_loopback()
                || policy.pod_ips.contains(&dst)
                || dst == "::6".parse::<IpAddr>().expect("address");
            let bound: Option<IpAddr> = if g.chance(25) {
                Some(g.pick(&dsts[..]).to_owned()).filter(|b| {
                    b.is_ipv4() == dst.is_ipv4()
                        && (b.is_loopback() || *b == "::6".parse::<IpAddr>().expect("address"))
                })
            } else {
                None
            };
            let src = bound.unwrap_or_else(|| source_for(dst));
            let iface = if via_lo { "lo" } else { "eth0" };
            let mut packet = Packet::outbound_tcp(src, dst, port, uid, gid, iface);
            if udp {
                packet = packet.udp();
            }
            let want = rules.evaluate(&packet).verdict;
            let c = Outbound {
                proto: if udp { Proto::Udp } else { Proto::Tcp },
                dst: addr(dst),
                dst_port: port,
                src: addr(bound.unwrap_or_else(|| unspecified(dst))),
                uid,
                gid,
                mark: 0,
            };
            let got = decide_outbound(&pod, &c, &tables);
            disagree(&mut disagreements, &policy, &packet, got, want);
        }
    }
    assert_agree(&disagreements, cases);
}

/// The pod's interfaces in the ambient cases: its own, and one Istio may be told to reroute.
const AMBIENT_IFACES: [&str; 2] = ["eth0", "virt0"];
const MARKS: [u32; 6] = [0, 0x539, 0x1539, 0x111, 0x7111, 0x5];

#[test]
fn ebpf_ambient_decision_agrees_with_istios_inpod_rules() {
    let mut g = Gen(0x6d65_7368_6361_7002);
    let probe = HostProbeSnat::default();
    let dsts: [IpAddr; 13] = [
        "127.0.0.1",
        "127.0.0.2",
        "10.0.0.2",
        "10.1.2.3",
        "169.254.7.127",
        "8.8.8.8",
        "::1",
        "fd00::2",
        "2001:db8::1",
        "fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
        "10.0.0.9",
        "192.168.1.1",
        "::6",
    ]
    .map(|s| s.parse().expect("address"));
    let srcs: [IpAddr; 5] = [
        "10.9.9.9",
        "169.254.7.127",
        "10.0.0.2",
        "2001:db8::9",
        "fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
    ]
    .map(|s| s.parse().expect("address"));
    let mut disagreements = Vec::new();
    let mut cases = 0;
    while cases < 100_000 {
        let ipv6 = g.chance(50);
        let policy = InpodPolicy {
            inbound: g.chance(75),
            dns: g.chance(50),
            virtual_interfaces: if g.chance(30) {
                vec!["virt0".to_owned()]
            } else {
                Vec::new()
            },
            ipv6,
            host_probe_snat: probe,
        };
        let rules = RuleEvaluator::new(&policy.render()).expect("rendered rules parse");
        let mut pod_ips = vec![IpAddr::V4(POD_V4)];
        if ipv6 {
            pod_ips.push(IpAddr::V6(POD_V6));
        }
        let mut entries = encode_ambient(&policy, &pod_ips);
        let net = PodNet {
            addresses: pod_ips.clone(),
            interfaces: vec![(2, "eth0".to_owned()), (3, "virt0".to_owned())],
            ..PodNet::default()
        };
        entries.add_pod_net(&net, &[], &policy.virtual_interfaces);
        let pod = entries.config;
        let ifaces = entries.ifaces.clone();
        let tables = Tables(entries);
        for _ in 0..20 {
            let port = g.pick(&PORTS);
            let mark = g.pick(&MARKS);
            if g.chance(35) {
                let src = g.pick(&srcs);
                let own = if src.is_ipv4() {
                    IpAddr::V4(POD_V4)
                } else {
                    IpAddr::V6(POD_V6)
                };
                if src == own {
                    continue;
                }
                cases += 1;
                let iface = g.pick(&AMBIENT_IFACES);
                let mut packet = Packet::inbound_tcp(src, own, port, iface);
                packet.mark = mark;
                let want = rules.evaluate(&packet).verdict;
                for existing in SYN_FINDS {
                    let c = Inbound {
                        src: addr(src),
                        dst_port: port,
                        mark,
                        iface: ifaces
                            .iter()
                            .find(|(name, _)| name == iface)
                            .map_or(0, |(_, f)| *f),
                        syn: true,
                        ack: false,
                        existing,
                    };
                    let got = decide_inbound(&pod, &c, &tables);
                    disagree(&mut disagreements, &policy, &packet, got, want);
                }
                continue;
            }
            let dst = g.pick(&dsts);
            cases += 1;
            let udp = g.chance(35);
            let uid = g.pick(&IDS);
            let via_lo = dst.is_loopback() || pod_ips.contains(&dst);
            let src = source_for(dst);
            let iface = if via_lo { "lo" } else { "eth0" };
            let mut packet = Packet::outbound_tcp(src, dst, port, uid, uid, iface);
            if udp {
                packet = packet.udp();
            }
            packet.mark = mark;
            let want = rules.evaluate(&packet).verdict;
            let c = Outbound {
                proto: if udp { Proto::Udp } else { Proto::Tcp },
                dst: addr(dst),
                dst_port: port,
                src: addr(unspecified(dst)),
                uid,
                gid: uid,
                mark,
            };
            let got = decide_outbound(&pod, &c, &tables);
            disagree(&mut disagreements, &policy, &packet, got, want);
        }
    }
    assert_agree(&disagreements, cases);
}
