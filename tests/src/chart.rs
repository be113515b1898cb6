//! The Helm chart in `deploy/chart`, rendered by the helm `cargo xtask setup` installs in
//! `target/tools` (`MESHCAP_TOOLS_DIR` elsewhere): the objects a configuration makes, as JSON.
//! `helm template deploy/chart --show-only templates/clusterrole.yaml --set ...` renders one
//! template; [`render`] takes the same arguments. The configurations the test API server serves
//! ([`configuration`]) are named in `tests/chart-configurations.yaml`, and come pre-rendered in
//! the guests of `cargo xtask integration` (`MESHCAP_CHART_RENDERED`), which have no helm.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use serde::Deserialize as _;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The helm binary.
///
/// # Errors
/// When `cargo xtask setup` has not installed it.
pub fn helm() -> anyhow::Result<PathBuf> {
    let tools = std::env::var_os("MESHCAP_TOOLS_DIR").map_or_else(
        || {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| root().join("target"), PathBuf::from)
                .join("tools")
        },
        PathBuf::from,
    );
    std::fs::read_dir(&tools)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("helm"))
        .find(|p| p.exists())
        .with_context(|| format!("no helm in {}: run `cargo xtask setup`", tools.display()))
}

/// `helm template meshcap deploy/chart <args>`: every object rendered.
///
/// # Errors
/// When helm fails (its message) or prints something that is not YAML.
pub fn render(args: &[&str]) -> anyhow::Result<Vec<Value>> {
    let out = Command::new(helm()?)
        .current_dir(root())
        .args(["template", "meshcap", "deploy/chart"])
        .args(args)
        .output()
        .context("running helm")?;
    if !out.status.success() {
        bail!("helm template: {}", String::from_utf8_lossy(&out.stderr));
    }
    documents(&String::from_utf8(out.stdout)?)
}

/// The one object of `kind` in `objects`.
///
/// # Errors
/// When there is none, or more than one.
pub fn one<'a>(objects: &'a [Value], kind: &str) -> anyhow::Result<&'a Value> {
    let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
    match found.as_slice() {
        [one] => Ok(one),
        other => bail!("{} objects of kind {kind}", other.len()),
    }
}

/// `tests/chart-configurations.yaml`: the arguments every configuration is rendered with, and
/// each configuration's `--set`s.
const CONFIGURATIONS: &str = include_str!("../chart-configurations.yaml");

/// The variable naming the directory of pre-rendered configurations (`NAME.yaml` each).
pub const RENDERED_ENV: &str = "MESHCAP_CHART_RENDERED";

/// The `helm template` arguments of the configuration `name` of
/// `tests/chart-configurations.yaml`.
///
/// # Errors
/// When it names no such configuration.
pub fn configuration_args(name: &str) -> anyhow::Result<Vec<String>> {
    let file: Value = yaml_serde::from_str(CONFIGURATIONS).context("chart-configurations.yaml")?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let sets = file["configurations"]
        .get(name)
        .with_context(|| format!("no configuration {name} in tests/chart-configurations.yaml"))?;
    let mut args = strings(&file["args"]);
    for set in strings(sets) {
        args.extend(["--set".to_owned(), set]);
    }
    Ok(args)
}

/// The objects of the configuration `name` of `tests/chart-configurations.yaml`: read from
/// `$MESHCAP_CHART_RENDERED/NAME.yaml` when that is set (in a guest), else rendered.
///
/// # Errors
/// When there is no such configuration, or it cannot be rendered or read.
pub fn configuration(name: &str) -> anyhow::Result<Vec<Value>> {
    if let Some(dir) = std::env::var_os(RENDERED_ENV) {
        let path = Path::new(&dir).join(format!("{name}.yaml"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        return documents(&text);
    }
    let args = configuration_args(name)?;
    render(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The objects of a YAML stream.
fn documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut objects = Vec::new();
    for document in yaml_serde::Deserializer::from_str(text) {
        let value = Value::deserialize(document).context("helm's output")?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `defaults` is what `deploy/` holds, object for object.
    #[test]
    fn the_default_configuration_is_deploy() {
        let rendered = configuration("defaults").expect("rendered");
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let shipped = crate::rbac::load(&[deploy.as_path()]);
        assert_eq!(rendered.len(), shipped.len());
        for object in &rendered {
            assert!(
                shipped.contains(object),
                "{} {} differs from deploy/",
                object["kind"],
                object["metadata"]["name"]
            );
        }
        assert!(configuration("nothing").is_err());
    }
}
