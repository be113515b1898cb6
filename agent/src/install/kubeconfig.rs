//! The credentials the plugin's fallback decision uses when the agent is down: a kubeconfig
//! beside the CNI configuration, as Istio's install-cni writes `ZZZ-istio-cni-kubeconfig`.
//!
//! Its token is the plugin's own, not the agent's: the `meshcap-cni` ServiceAccount's token
//! Secret, which the DaemonSet mounts at [`crate::paths::CNI_TOKEN_DIR`]. The agent's projected token is
//! bound to the agent's pod and stops working when that pod object is deleted — exactly when
//! the plugin is needed (an upgrade to an image that cannot be pulled, an eviction, a
//! node-affinity change); Istio's plugin, which uses its agent's token, fails there
//! (istio/istio#57438). The server and CA are the agent's (in-cluster, or `$KUBECONFIG`'s).
//! Rewritten whenever a file it is made from changes; readable by root only.
use std::{
    fs,
    path::{Path, PathBuf},
};

use base64::Engine as _;
use serde_json::json;

use super::{InstallError, conflist};

/// Where the service account's files are in a pod.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the plugin's kubeconfig is made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The API server at `server` with the in-cluster CA, and the plugin's token.
    ServiceAccount {
        /// `https://<KUBERNETES_SERVICE_HOST>:<KUBERNETES_SERVICE_PORT>`.
        server: String,
        /// The agent's service account directory (`ca.crt`).
        dir: PathBuf,
        /// The plugin's token file.
        token: PathBuf,
    },
    /// A kubeconfig file (the agent's `$KUBECONFIG`): copied with every user's credentials
    /// replaced by the plugin's token when `token` is set, as it is otherwise.
    File {
        /// The kubeconfig.
        path: PathBuf,
        /// The plugin's token file.
        token: Option<PathBuf>,
    },
}

impl Source {
    /// The agent's own server with the plugin's token, in `token_dir` (`--cni-token-dir`):
    /// `$KUBECONFIG` when set (with that token only when `token_dir` is given: an agent run
    /// by hand has none), else the in-cluster service account's server and CA with the token
    /// in `token_dir` or [`crate::paths::CNI_TOKEN_DIR`], else none.
    #[must_use]
    pub fn of_this_agent(
        lookup: impl Fn(&str) -> Option<String>,
        token_dir: Option<&Path>,
    ) -> Option<Self> {
        if let Some(path) = lookup("KUBECONFIG").filter(|p| !p.is_empty()) {
            return Some(Self::File {
                path: path.into(),
                token: token_dir.map(|dir| dir.join("token")),
            });
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
            token: token_dir
                .unwrap_or(Path::new(crate::paths::CNI_TOKEN_DIR))
                .join("token"),
        })
    }

    /// The kubeconfig's bytes.
    ///
    /// # Errors
    /// When a file cannot be read.
    pub fn render(&self) -> Result<Vec<u8>, InstallError> {
        let read = |path: &Path| fs::read(path).map_err(|e| InstallError::io("reading", path, e));
        let token_of = |path: &Path| -> Result<String, InstallError> {
            Ok(String::from_utf8_lossy(&read(path)?).trim().to_owned())
        };
        match self {
            Self::File { path, token: None } => read(path),
            Self::File {
                path,
                token: Some(token),
            } => {
                let token = token_of(token)?;
                let text = String::from_utf8_lossy(&read(path)?).into_owned();
                let mut config: serde_json::Value =
                    yaml_serde::from_str(&text).map_err(|e| InstallError::InvalidKubeconfig {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                for user in config["users"].as_array_mut().into_iter().flatten() {
                    user["user"] = json!({"token": token});
                }
                Ok(conflist::render(&config))
            }
            Self::ServiceAccount { server, dir, token } => {
                let token = token_of(token)?;
                let ca =
                    base64::engine::general_purpose::STANDARD.encode(read(&dir.join("ca.crt"))?);
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
            Source::of_this_agent(env, None),
            Some(Source::ServiceAccount {
                server: "https://[fd00::1]:6443".into(),
                dir: SERVICE_ACCOUNT_DIR.into(),
                token: PathBuf::from(crate::paths::CNI_TOKEN_DIR).join("token"),
            })
        );
        let dev = |name: &str| (name == "KUBECONFIG").then(|| "/root/.kube/config".to_owned());
        assert_eq!(
            Source::of_this_agent(dev, None),
            Some(Source::File {
                path: "/root/.kube/config".into(),
                token: None
            })
        );
        assert_eq!(
            Source::of_this_agent(dev, Some(Path::new("/run/cni-token"))),
            Some(Source::File {
                path: "/root/.kube/config".into(),
                token: Some("/run/cni-token/token".into())
            })
        );
        assert_eq!(Source::of_this_agent(|_| None, None), None);
    }

    #[test]
    fn a_rotated_token_is_written_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("token"), "first\n").unwrap();
        fs::write(dir.path().join("ca.crt"), "CA").unwrap();
        let source = Source::ServiceAccount {
            server: "https://10.96.0.1:443".into(),
            dir: dir.path().into(),
            token: dir.path().join("token"),
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

    #[test]
    fn a_kubeconfig_file_gets_the_plugins_token() {
        let dir = tempfile::tempdir().expect("tempdir");
        let agent = dir.path().join("kubeconfig");
        fs::write(
            &agent,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://api:6443\"}\n\
             users:\n- name: u\n  user: {token: agent-token, client-key: key}\n\
             contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\n",
        )
        .unwrap();
        fs::write(dir.path().join("token"), "plugin-token\n").unwrap();
        let source = Source::File {
            path: agent,
            token: Some(dir.path().join("token")),
        };
        let config: serde_json::Value = serde_json::from_slice(&source.render().unwrap()).unwrap();
        assert_eq!(config["users"][0]["user"], json!({"token": "plugin-token"}));
        assert_eq!(
            config["clusters"][0]["cluster"]["server"],
            "https://api:6443"
        );
    }
}
