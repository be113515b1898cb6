//! The pod → policy → rules path, differentially: any annotations, proxy environment, uid and
//! gid, namespace, inject label and pod addresses give a selection or an error naming the
//! field (never a panic); every rendered rule set parses in the evaluator; and on any packet
//! the evaluator of the rendered rules (netfilter's walk) agrees with the policy's own
//! decision, which is what the eBPF programs implement.
#![no_main]

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::{
    arbitrary::{self, Arbitrary},
    fuzz_target,
};
use meshcap_policy::{
    self as policy, CtState, Direction, Packet, Protocol, RuleEvaluator, SelectConfig, Selection,
    annotations, keys,
};
use serde_json::json;

/// Addresses that the rules and the decision single out, and their neighbours.
const ADDRESSES: [&str; 14] = [
    "10.0.0.2",
    "10.1.2.3",
    "127.0.0.1",
    "127.0.0.5",
    "127.0.0.6",
    "192.168.1.1",
    "0.0.0.0",
    "fd00::2",
    "::1",
    "::6",
    "::5",
    "2001:db8::1",
    "fe80::1",
    "::ffff:10.0.0.2",
];
const PORTS: [u16; 13] = [
    0, 53, 80, 443, 15001, 15006, 15008, 15020, 15021, 15053, 15090, 3333, 8080,
];
const INTERFACES: [&str; 4] = ["lo", "eth0", "eth1", "net2"];
const ENV: [&str; 4] = [
    keys::ENV_DNS_CAPTURE,
    keys::ENV_INVALID_DROP,
    keys::ENV_DUAL_STACK,
    keys::ENV_DISABLE_ENVOY,
];
const MARKS: [u32; 4] = [0, 1337, 1338, 7];

#[derive(Arbitrary, Debug)]
enum Ip {
    Known(u8),
    V4([u8; 4]),
    V6([u8; 16]),
}

impl Ip {
    fn get(&self) -> IpAddr {
        match self {
            Self::Known(i) => ADDRESSES[usize::from(*i) % ADDRESSES.len()]
                .parse()
                .unwrap(),
            Self::V4(octets) => Ipv4Addr::from(*octets).into(),
            Self::V6(octets) => Ipv6Addr::from(*octets).into(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Port {
    Known(u8),
    Any(u16),
}

impl Port {
    fn get(&self) -> u16 {
        match self {
            Self::Known(i) => PORTS[usize::from(*i) % PORTS.len()],
            Self::Any(port) => *port,
        }
    }
}

/// An annotation value: text as a user might write it, or one built from valid parts (joined
/// with the separators Istio accepts) so that the fuzzer reaches the rules quickly.
#[derive(Arbitrary, Debug)]
enum Value {
    Text(String),
    Star,
    Cidrs(Vec<(Ip, u8)>, bool),
    Ports(Vec<Port>, bool),
    Interfaces(Vec<u8>),
    Mode(u8),
}

impl Value {
    fn get(&self) -> String {
        let join = |items: Vec<String>, spaced: bool| items.join(if spaced { ", " } else { "," });
        match self {
            Self::Text(text) => text.clone(),
            Self::Star => "*".to_owned(),
            Self::Cidrs(cidrs, spaced) => join(
                cidrs
                    .iter()
                    .map(|(ip, len)| format!("{}/{}", ip.get(), len % 129))
                    .collect(),
                *spaced,
            ),
            Self::Ports(ports, spaced) => {
                join(ports.iter().map(|p| p.get().to_string()).collect(), *spaced)
            }
            Self::Interfaces(picks) => picks
                .iter()
                .map(|i| INTERFACES[usize::from(*i) % INTERFACES.len()])
                .collect::<Vec<_>>()
                .join(","),
            Self::Mode(i) => {
                ["REDIRECT", "TPROXY", "NONE", "redirect"][usize::from(*i) % 4].to_owned()
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
struct ArbPacket {
    outbound: bool,
    udp: bool,
    src: Ip,
    dst: Ip,
    port: Port,
    /// 0, 1000, the proxy's uid, or anything.
    uid: (u8, u32),
    gid: (u8, u32),
    interface: u8,
    mark: (u8, u32),
    ct_mark: bool,
    ct_state: u8,
}

#[derive(Arbitrary, Debug)]
struct Input {
    annotations: Vec<(u8, Value)>,
    env: Vec<(u8, String)>,
    uid: Option<i64>,
    gid: Option<i64>,
    namespace: Option<String>,
    inject_label: Option<String>,
    ips: Vec<Ip>,
    packets: Vec<ArbPacket>,
}

fn pod(input: &Input) -> Pod {
    let mut annotations: BTreeMap<String, String> = input
        .annotations
        .iter()
        .map(|(key, value)| {
            let key = keys::POLICY_ANNOTATIONS[usize::from(*key) % keys::POLICY_ANNOTATIONS.len()];
            (key.to_owned(), value.get())
        })
        .collect();
    annotations.insert(keys::STATUS.into(), "{}".into());
    let env: Vec<_> = input
        .env
        .iter()
        .map(|(name, value)| json!({"name": ENV[usize::from(*name) % ENV.len()], "value": value}))
        .collect();
    let labels: BTreeMap<_, _> = input
        .inject_label
        .iter()
        .map(|value| (keys::INJECT, value))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": "fuzz", "namespace": input.namespace, "labels": labels,
                     "annotations": annotations},
        "spec": {"containers": [{"name": keys::PROXY_CONTAINER, "env": env,
            "securityContext": {"runAsUser": input.uid, "runAsGroup": input.gid}}]},
    }))
    .expect("a pod")
}

fn packet(p: &ArbPacket, proxy_uid: u32, proxy_gid: u32) -> Packet {
    let dst = p.dst.get();
    // Both addresses in one family, as on the wire.
    let src = match (p.src.get(), dst) {
        (src @ IpAddr::V4(_), IpAddr::V4(_)) | (src @ IpAddr::V6(_), IpAddr::V6(_)) => src,
        (_, IpAddr::V4(_)) => IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
        (_, IpAddr::V6(_)) => "fd00::2".parse().unwrap(),
    };
    let id = |(pick, any): (u8, u32), proxy: u32| [0, 1000, proxy, any][usize::from(pick) % 4];
    Packet {
        direction: if p.outbound {
            Direction::Outbound
        } else {
            Direction::Inbound
        },
        protocol: if p.udp { Protocol::Udp } else { Protocol::Tcp },
        src,
        dst,
        dst_port: p.port.get(),
        uid: id(p.uid, proxy_uid),
        gid: id(p.gid, proxy_gid),
        interface: INTERFACES[usize::from(p.interface) % INTERFACES.len()].to_owned(),
        mark: match p.mark.0 % 5 {
            4 => p.mark.1,
            i => MARKS[usize::from(i)],
        },
        ct_mark: if p.ct_mark { 1337 } else { 0 },
        ct_state: [
            CtState::New,
            CtState::Established,
            CtState::Related,
            CtState::Invalid,
        ][usize::from(p.ct_state) % 4],
    }
}

fuzz_target!(|input: Input| {
    for (_, value) in &input.annotations {
        let text = value.get();
        let _ = annotations::parse_go_bool(&text);
        let _ = annotations::parse_port_list(&text);
        let _ = annotations::parse_cidr_list(&text);
        let _ = annotations::parse_interface_list(&text);
        let _ = text.parse::<policy::IpPrefix>();
    }
    let pod = pod(&input);
    let ips: Vec<IpAddr> = input.ips.iter().map(Ip::get).collect();
    let Ok(Selection::Capture { policy }) = policy::select(&pod, &ips, &SelectConfig::default())
    else {
        return;
    };
    let rules = policy.render();
    let evaluator = RuleEvaluator::new(&rules)
        .unwrap_or_else(|err| panic!("rendered rules do not parse: {err}\n{rules:?}"));
    for p in &input.packets {
        let packet = packet(p, policy.proxy_uid, policy.proxy_gid);
        let trace = evaluator.trace(&packet);
        assert_eq!(
            trace.outcome,
            policy.decide(&packet),
            "packet {packet:?}\npolicy {policy:?}\nmatched {:#?}",
            trace.matched
        );
    }
});
