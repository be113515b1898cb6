//! `cargo xtask manifests`: writes the plain manifests in `deploy/` from the chart in
//! `deploy/chart`, so that there is one source. Each file holds one kind, numbered in the order
//! `kubectl apply -f deploy/` creates them; its first lines say how it was rendered, and a test
//! (`agent/tests/chart.rs`) renders the same way and fails when a file is stale.
use std::{fs, process::Command};

use anyhow::{Context as _, bail};

use crate::{cmd, tools};

/// `helm template` arguments after the chart: the namespace the plain manifests create (with
/// Pod Security `privileged`), rendered for Kubernetes 1.29 so that AppArmor is set the way
/// every version from 1.29 on reads (the annotation; the field exists from 1.30).
pub const ARGS: &[&str] = &[
    "--namespace",
    "meshcap-system",
    "--kube-version",
    "1.29.0",
    "--set",
    "meshcap.createNamespace=true",
];

/// The file each kind goes to.
pub const FILES: &[(&str, &str)] = &[
    ("Namespace", "00-namespace.yaml"),
    ("ServiceAccount", "01-serviceaccount.yaml"),
    ("ClusterRole", "02-clusterrole.yaml"),
    ("Role", "02-role.yaml"),
    ("ClusterRoleBinding", "03-clusterrolebinding.yaml"),
    ("RoleBinding", "03-rolebinding.yaml"),
    ("ConfigMap", "04-configmap.yaml"),
    ("DaemonSet", "05-daemonset.yaml"),
];

pub fn run() -> anyhow::Result<()> {
    let root = cmd::root();
    let out = Command::new(tools::helm())
        .current_dir(&root)
        .args(["template", "meshcap", "deploy/chart"])
        .args(ARGS)
        .output()
        .context("running helm (cargo xtask setup installs it)")?;
    if !out.status.success() {
        bail!("helm template: {}", String::from_utf8_lossy(&out.stderr));
    }
    let rendered = String::from_utf8(out.stdout)?;
    let command = format!("helm template meshcap deploy/chart {}", ARGS.join(" "));
    let mut files: Vec<(&str, Vec<String>)> = FILES.iter().map(|(_, f)| (*f, Vec::new())).collect();
    for document in rendered.split("\n---\n") {
        let text: String = document
            .lines()
            .filter(|l| !l.starts_with("# Source: ") && *l != "---")
            .map(|l| format!("{l}\n"))
            .collect();
        let Some(kind) = text
            .lines()
            .find_map(|l| l.strip_prefix("kind: "))
            .map(str::trim)
        else {
            continue;
        };
        let Some((_, file)) = FILES.iter().find(|(k, _)| *k == kind) else {
            bail!("the chart's defaults render a {kind}, which has no file in deploy/");
        };
        let slot = files
            .iter_mut()
            .find(|(f, _)| f == file)
            .context("a file")?;
        slot.1.push(text);
    }
    for (file, documents) in files {
        if documents.is_empty() {
            bail!("the chart's defaults render nothing for deploy/{file}");
        }
        let path = root.join("deploy").join(file);
        let text = format!(
            "# Rendered from deploy/chart by `cargo xtask manifests`; edit the chart, not this file.\n\
             # {command}\n{}",
            documents.join("---\n")
        );
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("manifests: wrote deploy/{file}");
    }
    Ok(())
}
