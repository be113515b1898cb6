//! The runtime's side, on stdin: any bytes parse to a configuration or a CNI error (never a
//! panic); a `prevResult` converts to every supported version or fails cleanly, and a
//! conversion never changes the pod's addresses (what the plugin sends the agent).
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshcap_cni::cni::{NetConf, SUPPORTED_VERSIONS, convert_result, result_ips};

fuzz_target!(|data: &[u8]| {
    let answer = meshcap_cni::plugin::version_info(data);
    let asked = answer["cniVersion"]
        .as_str()
        .expect("VERSION names a version");
    assert!(
        SUPPORTED_VERSIONS.contains(&asked),
        "VERSION answers {asked}"
    );

    let Ok(conf) = NetConf::parse(data) else {
        return;
    };
    assert!(SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()));
    let ips = conf
        .prev_result
        .as_ref()
        .map(result_ips)
        .unwrap_or_default();
    for version in SUPPORTED_VERSIONS {
        let Ok(converted) = convert_result(conf.prev_result.as_ref(), version) else {
            continue;
        };
        assert_eq!(
            converted["cniVersion"], *version,
            "the result speaks the version asked"
        );
        assert_eq!(
            result_ips(&converted),
            ips,
            "conversion to {version} kept the addresses"
        );
    }
});
