//! A capture changed behind meshcap's back (by anything with `CAP_NET_ADMIN` in the pod's
//! netns, or by someone on the node): CHECK answers a mismatch (code 106), DEL removes what
//! is there and succeeds (the CNI spec: DEL succeeds when what it would remove is already
//! gone; a failing DEL keeps the pod Terminating), and an ADD restores the whole capture. One
//! case per kind of removal, on every backend.
use aya::maps::{HashMap, Map, MapData};
use meshcap_agent::{backend::ebpf::Pins, podnet};
use meshcap_common::{PodConfig, maps};
use meshcap_tests::{agent::Backend, one_pod::OnePod, require_root, run};

/// Runs `args` in the pod's netns.
fn in_pod(pod: &OnePod, args: &[&str]) {
    let mut all = vec!["netns", "exec", pod.wired.pod.name()];
    all.extend(args);
    run("ip", &all).unwrap_or_else(|e| panic!("{args:?}: {e:#}"));
}

/// The pod's netns cookie (the eBPF backend's key of it).
fn cookie(pod: &OnePod) -> u64 {
    podnet::cookie_of(&pod.wired.pod.path()).expect("cookie")
}

fn pins(pod: &OnePod) -> Pins {
    pod.agent.ebpf_config().expect("eBPF").pins()
}

/// A case: what is removed, and how.
type Tamper = (&'static str, fn(&OnePod));

/// What each case removes.
fn tampers(backend: Backend) -> Vec<Tamper> {
    match backend {
        Backend::Iptables => vec![
            ("the nat table flushed", |pod| {
                in_pod(pod, &["iptables-nft", "-t", "nat", "-F"]);
            }),
            ("the nat table's rules and Istio's chains deleted", |pod| {
                in_pod(pod, &["iptables-nft", "-t", "nat", "-F"]);
                in_pod(pod, &["iptables-nft", "-t", "nat", "-X"]);
            }),
            ("one jump from a kernel chain deleted", |pod| {
                in_pod(
                    pod,
                    &[
                        "iptables-nft",
                        "-t",
                        "nat",
                        "-D",
                        "OUTPUT",
                        "-j",
                        "ISTIO_OUTPUT",
                    ],
                );
            }),
        ],
        Backend::Nftables => vec![
            ("the nat table flushed", |pod| {
                in_pod(pod, &["nft", "flush", "table", "inet", "istio-proxy-nat"]);
            }),
            ("the nat table deleted", |pod| {
                in_pod(pod, &["nft", "delete", "table", "inet", "istio-proxy-nat"]);
            }),
            ("the jump from the output hook flushed", |pod| {
                in_pod(
                    pod,
                    &["nft", "flush", "chain", "inet", "istio-proxy-nat", "output"],
                );
            }),
        ],
        Backend::Ebpf => vec![
            ("the TC filter deleted", |pod| {
                in_pod(
                    pod,
                    &[
                        "tc", "filter", "del", "dev", "eth0", "ingress", "pref", "49153",
                    ],
                );
            }),
            ("the clsact qdisc deleted", |pod| {
                in_pod(pod, &["tc", "qdisc", "del", "dev", "eth0", "clsact"]);
            }),
            ("the pod's map entry deleted", |pod| {
                let data =
                    MapData::from_pin(pins(pod).map(maps::PODS)).expect("pinned MESHCAP_PODS");
                let mut map: HashMap<_, u64, PodConfig> =
                    HashMap::try_from(Map::HashMap(data)).expect("a hash map");
                map.remove(&cookie(pod)).expect("removing the entry");
            }),
            ("the pin recording its TC filter removed", |pod| {
                let record = pins(pod).pod(cookie(pod)).tc("eth0");
                std::fs::remove_dir_all(record.path()).expect("removing the record");
            }),
        ],
    }
}

meshcap_tests::test_on_every_backend!(a_capture_changed_behind_meshcaps_back);

fn a_capture_changed_behind_meshcaps_back(backend: Backend) {
    require_root();
    for (what, tamper) in tampers(backend) {
        let pod = OnePod::new(backend, None);
        let _servers = pod.wired.servers();
        let add = pod.cni("ADD");
        assert!(add.success, "{what}: ADD: {add:?}");
        pod.assert_captured(&format!("{what}: before"));

        tamper(&pod);
        let check = pod.cni("CHECK");
        assert_eq!(
            check.stdout["code"], 106,
            "{what}: CHECK must answer a mismatch: {check:?}"
        );
        let add = pod.cni("ADD");
        assert!(add.success, "{what}: ADD after the removal: {add:?}");
        pod.assert_captured(&format!("{what}: after ADD"));

        tamper(&pod);
        let del = pod.cni("DEL");
        assert!(del.success, "{what}: DEL after the removal: {del:?}");
        let mut held = pod.held();
        if what == "the pin recording its TC filter removed" {
            // Whether meshcap added the clsact qdisc went with the record: the filter goes
            // (recognised by its place and its program's name), the empty qdisc stays.
            held.retain(|h| !h.contains("clsact"));
        }
        assert_eq!(held, Vec::<String>::new(), "{what}: nothing left");
        assert_eq!(pod.wired.app_dial().0, "upstream", "{what}: released");
        let del = pod.cni("DEL");
        assert!(del.success, "{what}: DEL again: {del:?}");
    }
}
