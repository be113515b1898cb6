//! CNI network configuration files: which one the container runtime uses, and meshcap's entry
//! in it.
//!
//! The runtime (containerd and CRI-O through libcni, as kubelet did) reads the files of the conf
//! dir ending in `.conf`, `.conflist` or `.json`, sorted by name, and uses the first one that
//! parses: a `.conflist` needs a `name` and a non-empty `plugins` array whose members each have a
//! `type`; a `.conf`/`.json` is a single plugin and needs a `type`. meshcap chains itself last
//! into that file, as Istio's install-cni does. All of it is pure: the agent reads and writes
//! the files (its `install::conflist`).
use std::path::Path;

use serde_json::{Map, Value};

use super::PLUGIN_TYPE;

/// The extensions libcni reads, in no particular order (files are sorted by whole name).
const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// The name and version Istio gives the list it wraps a lone `.conf` in, used when the `.conf`
/// itself has none.
const WRAPPED_LIST_NAME: &str = "k8s-pod-network";
const WRAPPED_LIST_VERSION: &str = "0.3.1";

/// A CNI configuration file as found in the conf dir.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfFile {
    /// File name inside the conf dir.
    pub name: String,
    /// Its parsed content.
    pub value: Value,
}

impl ConfFile {
    /// Whether the file is a plugin list (`.conflist`) rather than a single plugin.
    #[must_use]
    pub fn is_list(&self) -> bool {
        is_list_name(&self.name)
    }
}

fn is_list_name(name: &str) -> bool {
    Path::new(name).extension().is_some_and(|e| e == "conflist")
}

/// Whether libcni would consider this file at all.
#[must_use]
pub fn has_cni_extension(name: &str) -> bool {
    Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e))
}

/// Why a file is not a usable CNI configuration, or `None` when it is. Mirrors libcni's
/// `ConfListFromBytes` / `ConfFromBytes` checks.
#[must_use]
pub fn invalid_reason(name: &str, bytes: &[u8]) -> Option<String> {
    let value: Value = match serde_json::from_slice(bytes) {
        Ok(value) => value,
        Err(err) => return Some(format!("not JSON: {err}")),
    };
    let Some(object) = value.as_object() else {
        return Some("not a JSON object".to_owned());
    };
    if is_list_name(name) {
        if !object.get("name").is_some_and(Value::is_string) {
            return Some("a .conflist without a \"name\"".to_owned());
        }
        let Some(plugins) = object.get("plugins").and_then(Value::as_array) else {
            return Some("a .conflist without a \"plugins\" array".to_owned());
        };
        if plugins.is_empty() {
            return Some("a .conflist with no plugins".to_owned());
        }
        if let Some(i) = plugins.iter().position(|p| !has_type(p)) {
            return Some(format!("plugin {i} has no \"type\""));
        }
        None
    } else if has_type(&value) {
        None
    } else {
        Some("a single-plugin config without a \"type\"".to_owned())
    }
}

fn has_type(plugin: &Value) -> bool {
    plugin
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| !t.is_empty())
}

/// The Istio CNI plugin's type.
pub const ISTIO_PLUGIN_TYPE: &str = "istio-cni";

/// Whether a plugin entry is istio-cni's (meshcap's takes its place in [`with_entry`]).
#[must_use]
pub fn is_istio_entry(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(ISTIO_PLUGIN_TYPE)
}

/// Whether a plugin entry is meshcap's own.
#[must_use]
pub fn is_meshcap_entry(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// The file meshcap chains itself into, from the sorted files of the conf dir.
///
/// With `configured` (Istio's `cniConfFileName`) that file is used, or its `.conf`/`.conflist`
/// twin when only the twin exists; otherwise the first valid file. `None` when there is none
/// yet (the primary CNI has not written its configuration): the caller waits for it.
#[must_use]
pub fn primary(files: &[(String, Vec<u8>)], configured: Option<&str>) -> Option<ConfFile> {
    let valid = |name: &str, bytes: &[u8]| {
        invalid_reason(name, bytes)
            .is_none()
            .then(|| serde_json::from_slice(bytes).ok())
            .flatten()
            .map(|value| ConfFile {
                name: name.to_owned(),
                value,
            })
    };
    match configured {
        Some(wanted) => {
            let twin = twin_name(wanted);
            let find = |n: &str| files.iter().find(|(name, _)| name == n);
            find(wanted)
                .or_else(|| twin.as_deref().and_then(find))
                .and_then(|(name, bytes)| valid(name, bytes))
        }
        None => files.iter().find_map(|(name, bytes)| valid(name, bytes)),
    }
}

/// `x.conf` ⇄ `x.conflist`.
fn twin_name(name: &str) -> Option<String> {
    if let Some(stem) = name.strip_suffix(".conflist") {
        Some(format!("{stem}.conf"))
    } else {
        name.strip_suffix(".conf")
            .map(|stem| format!("{stem}.conflist"))
    }
}

/// The file name a configuration has once meshcap is chained in: a single-plugin file becomes
/// a `.conflist` of the same stem.
#[must_use]
pub fn list_name(name: &str) -> String {
    if is_list_name(name) {
        return name.to_owned();
    }
    let stem = Path::new(name)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(name);
    format!("{stem}.conflist")
}

/// `conf` with meshcap's `entry` chained last: any older meshcap entry and istio-cni's entry are
/// removed first (so an upgrade replaces it, nothing is ever listed twice, and a pod never runs
/// through both plugins), and a single plugin is wrapped in a list that keeps its name and
/// version.
#[must_use]
pub fn with_entry(conf: &ConfFile, entry: &Value) -> ConfFile {
    let mut list = if conf.is_list() {
        conf.value.clone()
    } else {
        wrap(&conf.value)
    };
    if let Some(plugins) = list.get_mut("plugins").and_then(Value::as_array_mut) {
        plugins.retain(|p| !is_meshcap_entry(p) && !is_istio_entry(p));
        plugins.push(entry.clone());
    }
    ConfFile {
        name: list_name(&conf.name),
        value: list,
    }
}

/// Wraps a single plugin config in a list, as Istio's install-cni does. The list takes the
/// plugin's `name` and `cniVersion` (Istio's fixed values only when they are missing), so the
/// primary plugin keeps running at the version it was written for.
fn wrap(plugin: &Value) -> Value {
    let field = |key: &str, default: &str| {
        plugin
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    let mut list = Map::new();
    list.insert(
        "cniVersion".to_owned(),
        field("cniVersion", WRAPPED_LIST_VERSION).into(),
    );
    list.insert("name".to_owned(), field("name", WRAPPED_LIST_NAME).into());
    list.insert("plugins".to_owned(), Value::Array(vec![plugin.clone()]));
    Value::Object(list)
}

/// `conf` without meshcap's entries, or `None` when it has none.
#[must_use]
pub fn without_entry(conf: &ConfFile) -> Option<ConfFile> {
    let plugins = conf.value.get("plugins").and_then(Value::as_array)?;
    if !plugins.iter().any(is_meshcap_entry) {
        return None;
    }
    let mut value = conf.value.clone();
    if let Some(plugins) = value.get_mut("plugins").and_then(Value::as_array_mut) {
        plugins.retain(|p| !is_meshcap_entry(p));
    }
    Some(ConfFile {
        name: conf.name.clone(),
        value,
    })
}

/// The bytes meshcap writes for a configuration: two-space indented JSON with sorted keys (as
/// Istio's Go encoder writes them) and a final newline.
#[must_use]
pub fn render(value: &Value) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(value).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn files(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter()
            .map(|(n, c)| ((*n).to_owned(), c.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn validity_follows_libcni() {
        let cases = [
            (
                "a.conflist",
                r#"{"name":"k","plugins":[{"type":"x"}]}"#,
                true,
            ),
            ("a.conflist", r#"{"plugins":[{"type":"x"}]}"#, false),
            ("a.conflist", r#"{"name":"k","plugins":[]}"#, false),
            (
                "a.conflist",
                r#"{"name":"k","plugins":[{"name":"x"}]}"#,
                false,
            ),
            ("a.conflist", r#"{"name":"k"}"#, false),
            ("a.conf", r#"{"type":"bridge"}"#, true),
            ("a.json", r#"{"type":"bridge"}"#, true),
            ("a.conf", r#"{"name":"k","plugins":[{"type":"x"}]}"#, false),
            ("a.conf", "{", false),
            ("a.conf", "[]", false),
        ];
        for (name, content, valid) in cases {
            assert_eq!(
                invalid_reason(name, content.as_bytes()).is_none(),
                valid,
                "{name}: {content}"
            );
        }
    }

    #[test]
    fn the_first_valid_file_by_name_wins() {
        let dir = files(&[
            ("00-broken.conflist", "{"),
            ("05-empty.conflist", r#"{"name":"e","plugins":[]}"#),
            ("10-b.conf", r#"{"type":"b"}"#),
            ("10-a.conflist", r#"{"name":"a","plugins":[{"type":"a"}]}"#),
        ]);
        let mut sorted = dir.clone();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            primary(&sorted, None).map(|c| c.name).as_deref(),
            Some("10-a.conflist")
        );
    }

    #[test]
    fn a_configured_name_falls_back_to_its_twin() {
        let dir = files(&[
            (
                "05-first.conflist",
                r#"{"name":"f","plugins":[{"type":"f"}]}"#,
            ),
            (
                "10-calico.conflist",
                r#"{"name":"k","plugins":[{"type":"calico"}]}"#,
            ),
        ]);
        let chosen = primary(&dir, Some("10-calico.conf")).map(|c| c.name);
        assert_eq!(chosen.as_deref(), Some("10-calico.conflist"));
        assert_eq!(primary(&dir, Some("99-none.conflist")), None);
    }

    #[test]
    fn an_old_entry_is_replaced_and_never_doubled() {
        let conf = ConfFile {
            name: "10-x.conflist".to_owned(),
            value: json!({"name":"k","plugins":[{"type":"x"},{"type":"meshcap-cni","log_level":"old"},{"type":"portmap"}]}),
        };
        let entry = json!({"type":"meshcap-cni","log_level":"info"});
        let once = with_entry(&conf, &entry);
        assert_eq!(
            once.value["plugins"],
            json!([{"type":"x"},{"type":"portmap"},{"type":"meshcap-cni","log_level":"info"}])
        );
        assert_eq!(with_entry(&once, &entry), once);
        let removed = without_entry(&once).expect("had an entry");
        assert_eq!(
            removed.value["plugins"],
            json!([{"type":"x"},{"type":"portmap"}])
        );
        assert_eq!(without_entry(&removed), None);
    }

    #[test]
    fn istio_cnis_entry_is_replaced() {
        let conf = ConfFile {
            name: "10-x.conflist".to_owned(),
            value: json!({"name":"k","plugins":[{"type":"x"},{"type":"istio-cni"}]}),
        };
        let out = with_entry(&conf, &json!({"type":"meshcap-cni"}));
        assert_eq!(
            out.value["plugins"],
            json!([{"type":"x"},{"type":"meshcap-cni"}])
        );
    }

    #[test]
    fn a_single_plugin_keeps_its_name_and_version_in_the_wrapper() {
        let conf = ConfFile {
            name: "10-flannel.json".to_owned(),
            value: json!({"cniVersion":"1.0.0","name":"cbr0","type":"flannel"}),
        };
        let out = with_entry(&conf, &json!({"type":"meshcap-cni"}));
        assert_eq!(out.name, "10-flannel.conflist");
        assert_eq!(out.value["cniVersion"], "1.0.0");
        assert_eq!(out.value["name"], "cbr0");
        let bare = wrap(&json!({"type":"bridge"}));
        assert_eq!(bare["cniVersion"], WRAPPED_LIST_VERSION);
        assert_eq!(bare["name"], WRAPPED_LIST_NAME);
    }
}
