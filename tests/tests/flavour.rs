//! Istio's choice of iptables for a pod's netns, as the iptables backend makes it
//! (`FlavourChoice::Auto`): legacy where legacy rules already are, else nft. A new netns holds no
//! legacy table, so the backend decides that without running anything; a netns whose legacy
//! table is there but empty (as istio-cni's own detection leaves it: a no-op rule added to `nat`
//! and deleted) is asked, and still gets nft.
use std::net::IpAddr;

use meshcap_agent::{
    backend::{
        CaptureBackend, PodPolicy,
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
    },
    pod::PodRef,
};
use meshcap_policy as policy;
use meshcap_policy::{Decision, NodeSettings};
use meshcap_tests::{
    Netns,
    fixtures::{ManifestDir, leftovers, sidecar_pod},
    require_root, run, unique_name,
};

fn policy() -> PodPolicy {
    let manifest = sidecar_pod("shop", "web", &[]);
    let pod = policy::parse_pod_manifest(&manifest.to_string()).expect("manifest");
    let ip: IpAddr = "10.0.0.2".parse().expect("addr");
    match policy::decide(&pod, &[ip], &Default::default(), &NodeSettings::default()) {
        Ok(Decision::Sidecar { policy, .. }) => PodPolicy::Sidecar(policy),
        other => panic!("not a sidecar decision: {other:?}"),
    }
}

/// Which `*-save` lists the pod's rules once the backend captured a pod in a netns that
/// `before` was run in.
fn chosen(before: &[&[&str]]) -> Vec<String> {
    let netns = Netns::new("mc-flavour").expect("netns");
    for args in before {
        let mut all = vec!["netns", "exec", netns.name()];
        all.extend_from_slice(args);
        run("ip", &all).unwrap_or_else(|e| panic!("{args:?}: {e:#}"));
    }
    let state = ManifestDir::new();
    let backend = IptablesBackend::new(&IptablesConfig {
        state_dir: state.0.clone(),
        flavour: FlavourChoice::Auto,
    })
    .expect("iptables backend");
    let pod = PodRef {
        namespace: "shop".into(),
        name: "web".into(),
        container_id: unique_name("flavour"),
        netns: netns.path(),
    };
    backend.add(&pod, &policy()).expect("ADD");
    let mut saves: Vec<String> = leftovers(&netns)
        .expect("netns state")
        .iter()
        .filter_map(|l| Some(l.split_once(": ")?.0.to_owned()))
        .filter(|save| save.ends_with("-save"))
        .collect();
    saves.dedup();
    backend.remove(&pod).expect("DEL");
    assert_eq!(
        leftovers(&netns).expect("netns state"),
        Vec::<String>::new(),
        "released"
    );
    saves
}

/// A legacy rule that matches nothing (protocol 255), as istio-cni's detection adds (`-A`) and
/// deletes (`-D`) it, in `table`.
fn no_op_rule<'a>(table: &'a str, op: &'a str) -> [&'a str; 9] {
    [
        "iptables-legacy",
        "-t",
        table,
        op,
        "INPUT",
        "-p",
        "255",
        "-j",
        "RETURN",
    ]
}

#[test]
fn a_new_netns_gets_nft_and_one_with_legacy_rules_gets_legacy() {
    require_root();
    assert_eq!(chosen(&[]), ["iptables-nft-save"], "a new netns");
    assert_eq!(
        chosen(&[&no_op_rule("filter", "-A")]),
        ["iptables-legacy-save"],
        "a netns already holding a legacy rule"
    );
    assert_eq!(
        chosen(&[&no_op_rule("nat", "-A"), &no_op_rule("nat", "-D")]),
        ["iptables-nft-save"],
        "a netns whose legacy nat table is there but empty, as istio-cni's detection leaves it"
    );
}
