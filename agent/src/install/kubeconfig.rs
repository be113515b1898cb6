//! The credentials the plugin's fallback decision uses when the agent is down: a kubeconfig
//! beside the CNI configuration, as Istio's install-cni writes `ZZZ-istio-cni-kubeconfig`.
//! In a cluster it is rendered from the agent's own service account (its token, CA and the API
//! server's in-cluster address) and rewritten whenever the token or CA changes (projected
//! tokens are rotated by kubelet); an agent started with `$KUBECONFIG` copies that file.
//! Readable by root only.
use std::{fs, path::PathBuf};

use base64::Engine as _;
use serde_json::json;

use super::{InstallError, conflist};

/// Where the service account's files are in a pod.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the plugin's kubeconfig is made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The agent's service account, for the API server at `server`.
    ServiceAccount {
        /// `https://<KUBERNETES_SERVICE_HOST>:<KUBERNETES_SERVICE_PORT>`.
        server: String,
        /// The service account's directory (`token`, `ca.crt`).
        dir: PathBuf,
    },
    /// A kubeconfig file, copied as it is.
    File(PathBuf),
}

impl Source {
    /// The agent's own: `$KUBECONFIG` when set, else its in-cluster service account, else none.
    #[must_use]
    pub fn of_this_agent(lookup: impl Fn(&str) -> Option<String>) -> Option<Self> {
        if let Some(path) = lookup("KUBECONFIG").filter(|p| !p.is_empty()) {
            return Some(Self::File(path.into()));
        }
        let host = lookup("KUBERNETES_SERVICE_HOST")?;
        let port = lookup("KUBERNETES_SERVICE_PORT").unwrap_or_else(|| "443".to_owned());
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Some(Self::ServiceAccount {
            server: format!("https://{host}:{port}"),
            dir: SERVICE_ACCOUNT_DIR.into(),
        })
    }

    /// The kubeconfig's bytes.
    ///
    /// # Errors
    /// When a file cannot be read.
    pub fn render(&self) -> Result<Vec<u8>, InstallError> {
        match self {
            Self::File(path) => fs::read(path).map_err(|e| InstallError::io("reading", path, e)),
            Self::ServiceAccount { server, dir } => {
                let read = |name: &str| {
                    let path = dir.join(name);
                    fs::read(&path).map_err(|e| InstallError::io("reading", &path, e))
                };
                let token = String::from_utf8_lossy(&read("token")?).trim().to_owned();
                let ca = base64::engine::general_purpose::STANDARD.encode(read("ca.crt")?);
                Ok(conflist::render(&json!({
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "meshcap", "cluster": {
                        "server": server,
                        "certificate-authority-data": ca,
                    }}],
                    "users": [{"name": "meshcap-cni", "user": {"token": token}}],
                    "contexts": [{"name": "meshcap", "context": {
                        "cluster": "meshcap",
                        "user": "meshcap-cni",
                    }}],
                    "current-context": "meshcap",
                })))
            }
        }
    }
}

/// Writes the kubeconfig rendered from `source` to `path` (mode 0600) unless it is already
/// there; whether it was written.
///
/// # Errors
/// When a file cannot be read or written.
pub fn ensure(source: &Source, path: &std::path::Path) -> Result<bool, InstallError> {
    let bytes = source.render()?;
    if fs::read(path).is_ok_and(|current| current == bytes) {
        return Ok(false);
    }
    conflist::write_atomic(path, &bytes, 0o600)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_cluster_the_service_account_is_used() {
        let env = |name: &str| match name {
            "KUBERNETES_SERVICE_HOST" => Some("fd00::1".to_owned()),
            "KUBERNETES_SERVICE_PORT" => Some("6443".to_owned()),
            _ => None,
        };
        assert_eq!(
            Source::of_this_agent(env),
            Some(Source::ServiceAccount {
                server: "https://[fd00::1]:6443".into(),
                dir: SERVICE_ACCOUNT_DIR.into()
            })
        );
        let dev = |name: &str| (name == "KUBECONFIG").then(|| "/root/.kube/config".to_owned());
        assert_eq!(
            Source::of_this_agent(dev),
            Some(Source::File("/root/.kube/config".into()))
        );
        assert_eq!(Source::of_this_agent(|_| None), None);
    }

    #[test]
    fn a_rotated_token_is_written_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("token"), "first\n").unwrap();
        fs::write(dir.path().join("ca.crt"), "CA").unwrap();
        let source = Source::ServiceAccount {
            server: "https://10.96.0.1:443".into(),
            dir: dir.path().into(),
        };
        let path = dir.path().join("meshcap-cni.kubeconfig");
        assert!(ensure(&source, &path).unwrap());
        assert!(!ensure(&source, &path).unwrap(), "unchanged: not written");
        let config: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(config["users"][0]["user"]["token"], "first");
        assert_eq!(
            config["clusters"][0]["cluster"]["certificate-authority-data"],
            "Q0E="
        );
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        fs::write(dir.path().join("token"), "second").unwrap();
        assert!(ensure(&source, &path).unwrap(), "rotated: written");
    }
}
