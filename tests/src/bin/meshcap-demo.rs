//! The standalone demo: a throwaway "pod" (network namespace + cgroup) whose app traffic is
//! captured by meshcap's connect4 program and sent to a stand-in Envoy, while the proxy's own
//! traffic goes straight out. Everything is removed when it ends.
use aya::{
    maps::{HashMap, LpmTrie, lpm_trie::Key},
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use meshcap_common::{CIDR_KEY_PREFIX_BITS, Cidr4Data, CidrKind, PodConfig, maps};
use meshcap_tests::{
    Netns, PROXY_UID, Placement, Report, TestCgroup, dial, require_root, start_server,
};

const APP_UID: u32 = 1000;
const UPSTREAM: &str = "tcp:10.99.0.1:80";

fn main() -> anyhow::Result<()> {
    require_root();
    let pod = Netns::new("meshcap-demo")?;
    pod.ip(&["addr", "add", "10.99.0.1/32", "dev", "lo"])?;
    let cgroup = TestCgroup::new("meshcap-demo")?;
    println!(
        "pod: network namespace {} , cgroup {}",
        pod.name(),
        cgroup.path().display()
    );

    let mut ebpf = meshcap_agent::bpf::open()?;
    let connect4: &mut CgroupSockAddr = ebpf
        .program_mut("meshcap_connect4")
        .ok_or_else(|| anyhow::anyhow!("no meshcap_connect4 program"))?
        .try_into()?;
    connect4.load()?;
    connect4.attach(cgroup.open()?, CgroupAttachMode::Single)?;
    let mut pods: HashMap<_, u64, PodConfig> = HashMap::try_from(
        ebpf.map_mut(maps::PODS)
            .ok_or_else(|| anyhow::anyhow!("no pods map"))?,
    )?;
    pods.insert(
        pod.cookie()?,
        PodConfig {
            pod_id: 1,
            flags: 0,
            proxy_uid: PROXY_UID,
            proxy_gid: PROXY_UID,
        },
        0,
    )?;
    let mut cidrs: LpmTrie<_, Cidr4Data, u32> = LpmTrie::try_from(
        ebpf.map_mut(maps::CIDRS4)
            .ok_or_else(|| anyhow::anyhow!("no CIDR map"))?,
    )?;
    // includeOutboundIPRanges "*": a zero-length prefix in the pod's include list.
    let everything = Cidr4Data::new(1, CidrKind::IncludeOutbound, 0);
    cidrs.insert(&Key::new(CIDR_KEY_PREFIX_BITS, everything), 0, 0)?;
    println!(
        "meshcap: connect4 attached to the pod's cgroup, pod registered by its netns cookie\n"
    );

    let at = |uid| Placement {
        netns: &pod,
        cgroup: Some(&cgroup),
        uid,
        gid: uid,
    };
    let _envoy = start_server(at(PROXY_UID), "envoy", &["tcp:0.0.0.0:15001"])?;
    let _upstream = start_server(at(0), "upstream", &["tcp:10.99.0.1:80"])?;
    println!(
        "stand-in Envoy (uid {PROXY_UID}) listens on 15001; an upstream server on 10.99.0.1:80\n"
    );

    for (who, uid) in [
        ("the app (uid 1000)", APP_UID),
        ("the proxy (uid 1337)", PROXY_UID),
    ] {
        let answer = dial(at(uid), UPSTREAM, None)?;
        println!("{who} dials {UPSTREAM} -> {}", describe(answer.as_ref()));
    }
    println!("\nthe app's connection was captured; the proxy's own went straight to the upstream.");
    Ok(())
}

fn describe(report: Option<&Report>) -> String {
    match report {
        None => "nothing answered".into(),
        Some(r) if r.server == "envoy" => format!("CAPTURED by the proxy on :{}", r.listener),
        Some(r) => format!("not captured: answered by {} at {}", r.server, r.local),
    }
}
