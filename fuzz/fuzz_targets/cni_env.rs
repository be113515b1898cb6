//! The runtime's side, in the environment: any `CNI_*` variables give an invocation or a CNI
//! error naming the variable (never a panic), and `CNI_ARGS` reads the same whatever order the
//! runtime writes its pairs in (containerd's order varies).
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::{
    arbitrary::{self, Arbitrary},
    fuzz_target,
};
use meshcap_cni::cni::{Invocation, parse_cni_args};

#[derive(Arbitrary, Debug)]
struct Input {
    command: Option<String>,
    container_id: Option<String>,
    netns: Option<String>,
    ifname: Option<String>,
    /// `CNI_ARGS` as the runtime might write it, raw.
    raw_args: Option<String>,
    /// Pairs joined as `KEY=VALUE;...`, in the given order and reversed.
    pairs: Vec<(String, String)>,
}

/// A pair the runtime can write: no `;` anywhere, no `=` in the key, a key that is not empty.
fn writable((key, value): &(String, String)) -> bool {
    !key.is_empty() && !key.contains(['=', ';']) && !value.contains(';')
}

fuzz_target!(|input: Input| {
    let env = |name: &str| match name {
        "CNI_COMMAND" => input.command.clone(),
        "CNI_CONTAINERID" => input.container_id.clone(),
        "CNI_NETNS" => input.netns.clone(),
        "CNI_IFNAME" => input.ifname.clone(),
        "CNI_ARGS" => input.raw_args.clone(),
        _ => None,
    };
    if let Ok(invocation) = Invocation::from_env(env) {
        let args = parse_cni_args(input.raw_args.as_deref().unwrap_or_default())
            .expect("CNI_ARGS parsed once parses again");
        assert_eq!(invocation.args, args);
    }

    let pairs: Vec<_> = input.pairs.iter().filter(|p| writable(p)).collect();
    // One value per key: a key written twice is the runtime's bug, not an order.
    let mut expected = BTreeMap::new();
    let pairs: Vec<_> = pairs
        .into_iter()
        .filter(|(k, v)| {
            let first = !expected.contains_key(k);
            if first {
                expected.insert(k.clone(), v.clone());
            }
            first
        })
        .collect();
    let join = |pairs: &mut dyn Iterator<Item = &&(String, String)>| {
        pairs
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";")
    };
    let forward = join(&mut pairs.iter());
    let backward = join(&mut pairs.iter().rev());
    assert_eq!(
        parse_cni_args(&forward).expect("writable pairs parse"),
        expected
    );
    assert_eq!(
        parse_cni_args(&backward).expect("writable pairs parse"),
        expected
    );
});
