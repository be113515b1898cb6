//! The Helm chart in `deploy/chart`, rendered by the helm `cargo xtask setup` installs in
//! `target/tools` (`MESHCAP_TOOLS_DIR` elsewhere): the objects a configuration makes, as JSON.
//! `helm template deploy/chart --show-only templates/clusterrole.yaml --set ...` renders one
//! template; [`render`] takes the same arguments.
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
    let text = String::from_utf8(out.stdout)?;
    let mut objects = Vec::new();
    for document in yaml_serde::Deserializer::from_str(&text) {
        let value = Value::deserialize(document).context("helm's output")?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
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
