//! Chaining into the runtime's network configuration. The first byte picks the file's name
//! and the plugin settings, the rest is the file. Any file is judged as libcni judges it,
//! never with a panic; and for every file the runtime would use:
//! - the file with meshcap chained in is a valid `.conflist` ending in exactly one meshcap
//!   entry, and chaining twice equals chaining once (a restart or an upgrade);
//! - removing the entry gives back the primary's own plugins, untouched (uninstall);
//! - the entry, as the runtime hands it to `meshcap-cni` (with the list's `name` and
//!   `cniVersion`), parses to exactly the settings the agent wrote.
#![no_main]

use std::{path::PathBuf, time::Duration};

use libfuzzer_sys::fuzz_target;
use meshcap_cni::cni::{
    NetConf, PluginSettings, check_version,
    conflist::{self, ConfFile},
};
use serde_json::Value;

const NAMES: [&str; 4] = [
    "10-calico.conflist",
    "10-bridge.conf",
    "05-cilium.json",
    "87-podman.conflist",
];

fn settings(pick: u8) -> PluginSettings {
    let default = PluginSettings::default();
    match pick % 4 {
        0 => default,
        1 => PluginSettings {
            kubeconfig: Some("/etc/cni/net.d/meshcap-cni.kubeconfig".into()),
            ..default
        },
        2 => PluginSettings {
            agent_socket: PathBuf::from("/run/mesh cap/\"agent\".sock"),
            exclude_namespaces: vec![],
            agent_pod_prefix: String::new(),
            log_level: "debug".to_owned(),
            timeout: Duration::from_secs(0),
            pod_dir: Some("/var/lib/meshcap/pods ü".into()),
            ..default
        },
        _ => PluginSettings {
            exclude_namespaces: vec![
                "kube-system".into(),
                "istio-system".into(),
                "ß\u{7f}".into(),
            ],
            agent_pod_namespace: "istio-system".into(),
            log_level: "error".to_owned(),
            timeout: Duration::from_secs(u64::from(u32::MAX)),
            ..default
        },
    }
}

fn plugins(value: &Value) -> &[Value] {
    value["plugins"].as_array().map_or(&[], Vec::as_slice)
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, file)) = data.split_first() else {
        return;
    };
    let name = NAMES[usize::from(pick & 3)];
    let settings = settings(pick >> 2);
    if conflist::invalid_reason(name, file).is_some() {
        return;
    }
    let conf = ConfFile {
        name: name.to_owned(),
        value: serde_json::from_slice(file).expect("a valid file is JSON"),
    };
    let entry = settings.entry();

    let added = conflist::with_entry(&conf, &entry);
    let written = conflist::render(&added.value);
    assert_eq!(
        conflist::invalid_reason(&added.name, &written),
        None,
        "meshcap writes a valid conflist: {}",
        String::from_utf8_lossy(&written)
    );
    assert!(added.is_list(), "{} is a list", added.name);
    let chained = plugins(&added.value);
    assert_eq!(chained.last(), Some(&entry), "meshcap runs last");
    assert_eq!(
        chained
            .iter()
            .filter(|p| conflist::is_meshcap_entry(p))
            .count(),
        1
    );
    assert_eq!(
        conflist::with_entry(&added, &entry),
        added,
        "chaining twice equals once"
    );

    let removed = conflist::without_entry(&added).expect("the entry is there to remove");
    let primary: Vec<Value> = if conf.is_list() {
        plugins(&conf.value).to_vec()
    } else {
        vec![conf.value.clone()]
    };
    let primary: Vec<Value> = primary
        .into_iter()
        .filter(|p| !conflist::is_meshcap_entry(p))
        .collect();
    assert_eq!(
        plugins(&removed.value),
        primary.as_slice(),
        "uninstall gives back the primary's plugins"
    );
    if conf.is_list() && conflist::without_entry(&conf).is_none() {
        assert_eq!(
            removed.value, conf.value,
            "uninstall gives back the file as it was"
        );
    }

    // As libcni hands the entry to the plugin: the list's name and version added.
    let version = added.value["cniVersion"]
        .as_str()
        .unwrap_or("0.1.0")
        .to_owned();
    if check_version(&version).is_err() {
        return;
    }
    let mut stdin = entry.clone();
    stdin["cniVersion"] = version.clone().into();
    stdin["name"] = added.value["name"].clone();
    let parsed = NetConf::parse(&serde_json::to_vec(&stdin).expect("JSON"))
        .unwrap_or_else(|err| panic!("the plugin refuses its own entry: {}", err.msg));
    let got = parsed.meshcap;
    assert_eq!(parsed.cni_version, version);
    assert_eq!(got.agent_socket, settings.agent_socket);
    assert_eq!(got.exclude_namespaces, settings.exclude_namespaces);
    assert_eq!(got.agent_pod_namespace, settings.agent_pod_namespace);
    assert_eq!(got.agent_pod_prefix, settings.agent_pod_prefix);
    assert_eq!(
        format!("{:?}", got.log_level).to_lowercase(),
        settings.log_level
    );
    assert_eq!(got.timeout(), settings.timeout.max(Duration::from_secs(1)));
    assert_eq!(got.kubeconfig, settings.kubeconfig);
    assert_eq!(got.pod_dir, settings.pod_dir);
});
