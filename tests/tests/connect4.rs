//! The foundation's proof that the toolchain produces programs the kernel runs: every embedded
//! program passes the verifier, and the connect4 program, attached to a throwaway cgroup,
//! sends a pod's connection to its proxy and leaves everything else alone.
use aya::{
    maps::{HashMap, LpmTrie, lpm_trie::Key},
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use meshcap_common::{CIDR_KEY_PREFIX_BITS, Cidr4Data, CidrKind, PodConfig, maps};
use meshcap_tests::{Netns, PROXY_UID, Placement, TestCgroup, dial, require_root, start_server};

const APP_UID: u32 = 1000;

#[test]
fn every_embedded_program_passes_the_verifier() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut ebpf = meshcap_agent::bpf::open().expect("opening the embedded object");
    let loaded = meshcap_agent::bpf::load_all(&mut ebpf).expect("the verifier refused a program");
    assert!(
        loaded.iter().any(|name| name == "meshcap_connect4"),
        "loaded: {loaded:?}"
    );
}

#[test]
fn connect4_sends_the_pods_connections_to_its_proxy() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let pod = Netns::new("mc-pod").expect("pod netns");
    let other = Netns::new("mc-other").expect("second netns");
    for ns in [&pod, &other] {
        ns.ip(&["addr", "add", "10.99.0.1/32", "dev", "lo"])
            .expect("upstream address");
    }
    let cgroup = TestCgroup::new("mc-connect4").expect("cgroup");

    let mut ebpf = meshcap_agent::bpf::open().expect("opening the embedded object");
    let program: &mut CgroupSockAddr = ebpf
        .program_mut("meshcap_connect4")
        .expect("meshcap_connect4 in the object")
        .try_into()
        .expect("a cgroup_sock_addr program");
    program.load().expect("verifier");
    program
        .attach(cgroup.open().expect("cgroup fd"), CgroupAttachMode::Single)
        .expect("attach connect4 to the test cgroup");
    let mut pods: HashMap<_, u64, PodConfig> =
        HashMap::try_from(ebpf.map_mut(maps::PODS).expect("pods map")).expect("hash map");
    let proxy = PodConfig {
        pod_id: 1,
        flags: 0,
        proxy_uid: PROXY_UID,
        proxy_gid: PROXY_UID,
    };
    pods.insert(pod.cookie().expect("netns cookie"), proxy, 0)
        .expect("pod entry");
    let mut cidrs: LpmTrie<_, Cidr4Data, u32> =
        LpmTrie::try_from(ebpf.map_mut(maps::CIDRS4).expect("cidr map")).expect("lpm trie");
    let everything = Cidr4Data::new(1, CidrKind::IncludeOutbound, 0);
    cidrs
        .insert(&Key::new(CIDR_KEY_PREFIX_BITS, everything), 0, 0)
        .expect("include *");

    let in_pod = |uid| Placement {
        netns: &pod,
        cgroup: Some(&cgroup),
        uid,
        gid: uid,
    };
    let _envoy = start_server(in_pod(PROXY_UID), "envoy", &["tcp:0.0.0.0:15001"]).expect("envoy");
    let _upstream =
        start_server(in_pod(PROXY_UID), "upstream", &["tcp:10.99.0.1:80"]).expect("upstream");
    let _other_upstream = start_server(
        Placement {
            netns: &other,
            cgroup: None,
            uid: 0,
            gid: 0,
        },
        "other-upstream",
        &["tcp:10.99.0.1:80"],
    )
    .expect("upstream in the second netns");

    let answered_by = |at, what| {
        dial(at, "tcp:10.99.0.1:80", None)
            .expect("dial")
            .unwrap_or_else(|| panic!("{what}: nothing answered"))
    };

    let captured = answered_by(in_pod(APP_UID), "app in the pod");
    assert_eq!(
        (captured.server.as_str(), captured.listener),
        ("envoy", 15001),
        "{captured:?}"
    );

    let own = answered_by(in_pod(PROXY_UID), "the proxy itself");
    assert_eq!(
        own.server, "upstream",
        "the proxy's own connection must not be captured"
    );

    let outside = answered_by(
        Placement {
            netns: &pod,
            cgroup: None,
            uid: APP_UID,
            gid: APP_UID,
        },
        "a process outside the attached cgroup",
    );
    assert_eq!(outside.server, "upstream");

    let no_entry = answered_by(
        Placement {
            netns: &other,
            cgroup: Some(&cgroup),
            uid: APP_UID,
            gid: APP_UID,
        },
        "a netns without a pod entry",
    );
    assert_eq!(no_entry.server, "other-upstream");
}
