//! The chart's configurations the tests' API server serves and enforces the RBAC of
//! (`tests/chart-configurations.yaml`, `meshcap_tests::chart::configuration`), rendered on the
//! host with the helm `setup` installs: the guests have no helm. Each goes into the initramfs as
//! `chart/NAME.yaml`; the init points the tests there (`MESHCAP_CHART_RENDERED`).
use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::tools;

/// Each configuration's name and its rendering.
pub fn render(workspace: &Path) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let path = workspace.join("tests/chart-configurations.yaml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let file: Value = yaml_serde::from_str(&text).with_context(|| path.display().to_string())?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let common = strings(&file["args"]);
    let mut rendered = Vec::new();
    for (name, sets) in file["configurations"]
        .as_object()
        .context("no configurations")?
    {
        let out = Command::new(tools::helm())
            .current_dir(workspace)
            .args(["template", "meshcap", "deploy/chart"])
            .args(&common)
            .args(strings(sets).iter().flat_map(|set| ["--set", set.as_str()]))
            .output()
            .context("running helm (cargo xtask setup installs it)")?;
        if !out.status.success() {
            bail!(
                "helm template ({name}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        rendered.push((name.clone(), out.stdout));
    }
    Ok(rendered)
}
