//! The runtime's side: any stdin must parse to a configuration or a CNI error, and any
//! prevResult must convert or fail cleanly, in every supported version.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshcap_cni::cni::{NetConf, SUPPORTED_VERSIONS, convert_result, parse_cni_args};

fuzz_target!(|data: &[u8]| {
    if let Ok(conf) = NetConf::parse(data) {
        for version in SUPPORTED_VERSIONS {
            let _ = convert_result(conf.prev_result.as_ref(), version);
        }
    }
    if let Ok(args) = std::str::from_utf8(data) {
        let _ = parse_cni_args(args);
    }
    let _ = meshcap_cni::plugin::version_info(data);
});
