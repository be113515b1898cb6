//! Property tests: any annotations give a policy or an error (never a panic) whose rules
//! parse; and on generated packets the evaluator of the rendered rules agrees with the
//! policy's own decision.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy::{
    self as policy, CtState, Direction, Packet, Protocol, RedirectPolicy, RuleEvaluator,
    SelectConfig, Selection, keys,
};
use proptest::{collection::vec, prelude::*, sample::select};
use serde_json::json;

const CIDRS: [&str; 12] = [
    "10.0.0.0/8",
    "10.1.0.0/16",
    "127.0.0.0/8",
    "127.0.0.5/32",
    "192.168.0.0/16",
    "0.0.0.0/0",
    "10.0.0.2/32",
    "fd00::/8",
    "::1/128",
    "::/0",
    "2001:db8::/32",
    "fd00::2/128",
];
const PORTS: [u16; 14] = [
    0, 53, 80, 443, 3333, 5555, 8080, 15001, 15006, 15008, 15020, 15021, 15053, 15090,
];
const INTERFACES: [&str; 4] = ["lo", "eth0", "eth1", "net2"];
const ADDRESSES: [&str; 18] = [
    "10.0.0.2",
    "10.1.2.3",
    "10.2.0.1",
    "127.0.0.1",
    "127.0.0.5",
    "127.0.0.6",
    "192.168.1.1",
    "8.8.8.8",
    "0.0.0.0",
    "fd00::2",
    "fd00::99",
    "::1",
    "::6",
    "::5",
    "2001:db8::1",
    "2001:db9::1",
    "fe80::1",
    "::ffff:10.0.0.2",
];

fn pod(
    annotations: BTreeMap<String, String>,
    env: Vec<(String, String)>,
    uid: Option<i64>,
    gid: Option<i64>,
) -> Pod {
    let mut annotations = annotations;
    annotations.insert("sidecar.istio.io/status".into(), "{}".into());
    let env: Vec<_> = env
        .into_iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": "prop", "namespace": "default", "annotations": annotations},
        "spec": {"containers": [{"name": "istio-proxy", "env": env,
            "securityContext": {"runAsUser": uid, "runAsGroup": gid}}]},
    }))
    .unwrap()
}

/// A list of `items` joined with `,`, sometimes with spaces or empty entries.
fn list(items: &'static [&'static str]) -> impl Strategy<Value = String> {
    (vec(select(items), 0..4), select(&[",", ", ", ",,"][..]))
        .prop_map(|(items, sep)| items.join(sep))
}

fn port_list() -> impl Strategy<Value = String> {
    vec(select(&PORTS[..]), 0..4).prop_map(|ports| {
        ports
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// Values that are often valid, sometimes not.
fn value_for(key: &'static str) -> BoxedStrategy<String> {
    let noise = prop_oneof![
        Just(String::new()),
        Just("*".to_owned()),
        "\\PC{0,12}",
        "[0-9,./:a-f* ]{0,16}"
    ];
    let likely = match key {
        "sidecar.istio.io/interceptionMode" => select(&["REDIRECT", "TPROXY", "NONE"][..])
            .prop_map(str::to_owned)
            .boxed(),
        "traffic.sidecar.istio.io/includeOutboundIPRanges"
        | "traffic.sidecar.istio.io/excludeOutboundIPRanges" => prop_oneof![
            list(&CIDRS).prop_map(|v| v.replace(' ', "")),
            Just("*".to_owned())
        ]
        .boxed(),
        k if k.contains("Ports") => port_list().boxed(),
        _ => list(&INTERFACES[1..]).boxed(),
    };
    prop_oneof![4 => likely, 1 => noise].boxed()
}

fn annotations() -> impl Strategy<Value = BTreeMap<String, String>> {
    vec((select(&keys::POLICY_ANNOTATIONS[..]), any::<u32>()), 0..8).prop_flat_map(|picked| {
        let strategies: Vec<_> = picked
            .into_iter()
            .map(|(key, _)| value_for(key).prop_map(move |v| (key.to_owned(), v)))
            .collect();
        strategies.prop_map(|pairs| pairs.into_iter().collect::<BTreeMap<_, _>>())
    })
}

fn env() -> impl Strategy<Value = Vec<(String, String)>> {
    vec(
        (
            select(
                &[
                    "ISTIO_META_DNS_CAPTURE",
                    "INVALID_DROP",
                    "ISTIO_DUAL_STACK",
                    "DISABLE_ENVOY",
                ][..],
            ),
            select(&["true", "false", "1", "yes", ""][..]),
        ),
        0..4,
    )
    .prop_map(|pairs| {
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    })
}

fn id() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![
        Just(None),
        Just(Some(0)),
        Just(Some(1337)),
        Just(Some(1000)),
        Just(Some(-1)),
        any::<i64>().prop_map(Some)
    ]
}

fn pod_ips() -> impl Strategy<Value = Vec<IpAddr>> {
    vec(
        select(&["10.0.0.2", "fd00::2", "fe80::1", "::ffff:10.0.0.2"][..]),
        0..3,
    )
    .prop_map(|ips| ips.iter().map(|ip| ip.parse().unwrap()).collect())
}

fn packet(uid: u32, gid: u32) -> impl Strategy<Value = Packet> {
    (
        (
            select(&[Direction::Outbound, Direction::Inbound][..]),
            select(&[Protocol::Tcp, Protocol::Udp][..]),
        ),
        (
            select(&ADDRESSES[..]),
            select(&ADDRESSES[..]),
            select(&PORTS[..]),
            any::<u16>(),
            any::<bool>(),
        ),
        (
            select(vec![0, 1000, 1337, uid]),
            select(vec![0, 1000, 1337, gid]),
            select(&INTERFACES[..]),
        ),
        (
            select(&[0, 1337, 1338, 7][..]),
            select(&[0, 1337][..]),
            select(
                &[
                    CtState::New,
                    CtState::Established,
                    CtState::Related,
                    CtState::Invalid,
                ][..],
            ),
        ),
    )
        .prop_map(
            |(
                (direction, protocol),
                (src, dst, port, any_port, pick),
                (uid, gid, interface),
                (mark, ct_mark, ct_state),
            )| {
                let dst: IpAddr = dst.parse().unwrap();
                // Keep both addresses in one family.
                let src: IpAddr = match (src.parse::<IpAddr>().unwrap(), dst) {
                    (src @ IpAddr::V4(_), IpAddr::V4(_)) | (src @ IpAddr::V6(_), IpAddr::V6(_)) => {
                        src
                    }
                    (_, IpAddr::V4(_)) => "10.0.0.2".parse().unwrap(),
                    (_, IpAddr::V6(_)) => "fd00::2".parse().unwrap(),
                };
                Packet {
                    direction,
                    protocol,
                    src,
                    dst,
                    dst_port: if pick { port } else { any_port },
                    uid,
                    gid,
                    interface: interface.to_owned(),
                    mark,
                    ct_mark,
                    ct_state,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn any_annotations_give_a_selection_or_an_error(
        annotations in annotations(), env in env(), uid in id(), gid in id(), ips in pod_ips(),
    ) {
        let pod = pod(annotations, env, uid, gid);
        if let Ok(Selection::Capture { policy }) = policy::select(&pod, &ips, &SelectConfig::default()) {
            let rules = policy.render();
            prop_assert!(RuleEvaluator::new(&rules).is_ok(), "rendered rules do not parse: {rules:?}");
        }
    }

    #[test]
    fn rendered_rules_agree_with_the_policy(
        (policy, packets) in (annotations(), env(), id(), id(), pod_ips()).prop_filter_map(
            "invalid policy",
            |(annotations, env, uid, gid, ips)| RedirectPolicy::from_pod(&pod(annotations, env, uid, gid), &ips).ok(),
        ).prop_flat_map(|policy| {
            let packets = vec(packet(policy.proxy_uid, policy.proxy_gid), 32);
            (Just(policy), packets)
        }),
    ) {
        let evaluator = RuleEvaluator::new(&policy.render()).unwrap();
        for packet in &packets {
            let trace = evaluator.trace(packet);
            prop_assert_eq!(
                trace.outcome, policy.decide(packet),
                "packet {:?}\npolicy {:?}\nmatched {:#?}", packet, policy, trace.matched
            );
        }
    }
}
