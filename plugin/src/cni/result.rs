//! Results: `prevResult` converted to the configuration's spec version, and the pod addresses
//! it names.
use serde_json::Value;

use super::{
    CniError, code,
    version::{check_version, is_v1},
};

/// The result ADD prints: `prevResult` converted to `to`, or an empty result when there is none.
///
/// # Errors
/// Code 1 when `prevResult` claims a version not supported, 6 when it cannot be converted.
pub fn convert_result(prev: Option<&Value>, to: &str) -> Result<Value, CniError> {
    let Some(prev) = prev else {
        return Ok(serde_json::json!({ "cniVersion": to }));
    };
    let Value::Object(prev) = prev else {
        return Err(CniError::new(
            code::DECODE,
            "prevResult is not a JSON object",
        ));
    };
    let from = match prev.get("cniVersion") {
        Some(Value::String(v)) => {
            check_version(v).map_err(|e| CniError {
                msg: format!("prevResult: {}", e.msg),
                ..e
            })?;
            v.clone()
        }
        // The runtime hands prevResult over in the configuration's own version.
        _ => to.to_owned(),
    };
    let mut out = prev.clone();
    out.insert("cniVersion".to_owned(), Value::String(to.to_owned()));
    if is_v1(&from) == is_v1(to) {
        return Ok(Value::Object(out));
    }
    if let Some(Value::Array(ips)) = out.get_mut("ips") {
        for (i, ip) in ips.iter_mut().enumerate() {
            let Value::Object(ip) = ip else {
                return Err(CniError::new(
                    code::DECODE,
                    format!("prevResult.ips[{i}] is not an object"),
                ));
            };
            if is_v1(to) {
                ip.remove("version");
            } else {
                let family = match ip.get("address") {
                    Some(Value::String(a)) if a.contains(':') => "6",
                    Some(Value::String(_)) => "4",
                    _ => {
                        return Err(CniError::new(
                            code::DECODE,
                            format!("prevResult.ips[{i}] has no address"),
                        ));
                    }
                };
                ip.insert("version".to_owned(), Value::String(family.to_owned()));
            }
        }
    }
    Ok(Value::Object(out))
}

/// The pod addresses of a result (`ips[].address`, prefix length dropped); entries that do
/// not parse are left out.
#[must_use]
pub fn result_ips(result: &Value) -> Vec<std::net::IpAddr> {
    result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address")?.as_str()?.split('/').next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn result_0_4() -> Value {
        json!({
            "cniVersion": "0.4.0",
            "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/x"}],
            "ips": [
                {"version": "4", "interface": 0, "address": "10.1.0.5/24", "gateway": "10.1.0.1"},
                {"version": "6", "interface": 0, "address": "fd00::5/64"}
            ],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.96.0.10"]}
        })
    }

    #[test]
    fn prev_result_passes_through_within_a_family() {
        let mut prev = result_0_4();
        let out = convert_result(Some(&prev), "0.3.1").unwrap();
        prev["cniVersion"] = json!("0.3.1");
        assert_eq!(out, prev);
    }

    #[test]
    fn prev_result_converts_between_families_both_ways() {
        let prev = result_0_4();
        let v1 = convert_result(Some(&prev), "1.0.0").unwrap();
        assert_eq!(v1["cniVersion"], "1.0.0");
        assert!(
            v1["ips"]
                .as_array()
                .unwrap()
                .iter()
                .all(|ip| ip.get("version").is_none())
        );
        assert_eq!(v1["routes"], prev["routes"]);
        assert_eq!(v1["dns"], prev["dns"]);
        let back = convert_result(Some(&v1), "0.4.0").unwrap();
        assert_eq!(back, prev);
    }

    #[test]
    fn prev_result_without_version_is_taken_as_the_configs() {
        let prev = json!({"ips": [{"address": "10.0.0.1/32"}]});
        let out = convert_result(Some(&prev), "1.1.0").unwrap();
        assert_eq!(
            out,
            json!({"cniVersion": "1.1.0", "ips": [{"address": "10.0.0.1/32"}]})
        );
    }

    #[test]
    fn result_ips_drop_the_prefix_length() {
        let ips = result_ips(&result_0_4());
        assert_eq!(
            ips,
            [
                "10.1.0.5".parse::<std::net::IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert!(result_ips(&json!({})).is_empty());
    }

    #[test]
    fn no_prev_result_is_an_empty_result() {
        assert_eq!(
            convert_result(None, "1.0.0").unwrap(),
            json!({"cniVersion": "1.0.0"})
        );
    }

    #[test]
    fn bad_prev_results_are_refused() {
        assert_eq!(
            convert_result(Some(&json!([])), "1.0.0").unwrap_err().code,
            code::DECODE
        );
        assert_eq!(
            convert_result(Some(&json!({"cniVersion": "9.9.9"})), "1.0.0")
                .unwrap_err()
                .code,
            code::INCOMPATIBLE_VERSION
        );
        let no_addr = json!({"cniVersion": "1.0.0", "ips": [{}]});
        assert_eq!(
            convert_result(Some(&no_addr), "0.4.0").unwrap_err().code,
            code::DECODE
        );
    }
}
