//! One node of a cluster whose API server is the test server ([`crate::apiserver`]): its CNI
//! directories with a primary conflist, the agent's environment as the DaemonSet gives it (the
//! agent's token bound to its pod, the plugin's token Secret mounted, its pod's namespace and
//! name), and the plugin the agent installs, run as the runtime runs it.
use std::{
    fs,
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

use crate::{
    agent::{Agent, Backend, binaries},
    apiserver::{AGENT_POD, ApiServer, SYSTEM_NAMESPACE},
    fixtures::{ManifestDir, eventually},
    kubelet::{CniOutput, installed_add},
    unique_name,
};

/// The node's directories (removed on drop) and the API server's credentials.
pub struct ClusterNode {
    /// The scratch root.
    pub root: ManifestDir,
    /// The CNI configuration directory.
    pub conf_dir: PathBuf,
    /// The CNI bin directory.
    pub bin_dir: PathBuf,
    /// The primary CNI's conflist.
    pub conflist: PathBuf,
    kubeconfig: PathBuf,
    token_dir: PathBuf,
}

impl ClusterNode {
    /// A node of `api`'s cluster, with a bridge conflist.
    ///
    /// # Panics
    /// When the directories cannot be made.
    #[must_use]
    pub fn new(api: &ApiServer) -> Self {
        let root = ManifestDir(std::env::temp_dir().join(unique_name("meshcap-node")));
        let (conf_dir, bin_dir) = (root.0.join("net.d"), root.0.join("bin"));
        for dir in [&conf_dir, &bin_dir] {
            fs::create_dir_all(dir).expect("CNI dirs");
        }
        let conflist = conf_dir.join("10-bridge.conflist");
        fs::write(
            &conflist,
            json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [{"type": "bridge"}]})
                .to_string(),
        )
        .expect("primary conflist");
        let kubeconfig = api.kubeconfig(&root.0);
        let token_dir = api.cni_token_dir(&root.0);
        Self {
            root,
            conf_dir,
            bin_dir,
            conflist,
            kubeconfig,
            token_dir,
        }
    }

    /// The agent's environment as the DaemonSet sets it (CNI installed, no startup taint),
    /// then `extra`.
    #[must_use]
    pub fn env(&self, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let path = |p: &Path| p.display().to_string();
        let mut env = vec![
            ("KUBECONFIG".to_owned(), path(&self.kubeconfig)),
            ("MESHCAP_CNI_TOKEN_DIR".to_owned(), path(&self.token_dir)),
            ("MESHCAP_INSTALL_CNI".to_owned(), "true".to_owned()),
            ("MESHCAP_CNI_CONF_DIR".to_owned(), path(&self.conf_dir)),
            ("MESHCAP_CNI_BIN_DIR".to_owned(), path(&self.bin_dir)),
            (
                "MESHCAP_PLUGIN_BINARY".to_owned(),
                path(&binaries().join("meshcap-cni")),
            ),
            ("MESHCAP_STARTUP_TAINT".to_owned(), String::new()),
            (
                "MESHCAP_POD_NAMESPACE".to_owned(),
                SYSTEM_NAMESPACE.to_owned(),
            ),
            ("MESHCAP_POD_NAME".to_owned(), AGENT_POD.to_owned()),
            // An iptables agent's uninstall still looks for pins: never the host's.
            (
                "MESHCAP_BPFFS_DIR".to_owned(),
                path(&self.root.0.join("bpffs")),
            ),
        ];
        for (key, value) in extra {
            env.retain(|(k, _)| k != key);
            env.push(((*key).to_owned(), (*value).to_owned()));
        }
        env
    }

    /// Starts the agent with [`Self::env`] and `extra`, and waits until meshcap is installed
    /// and `/readyz` says ready.
    ///
    /// # Panics
    /// When it does not get there.
    #[must_use]
    pub fn start_agent(&self, backend: Backend, extra: &[(&str, &str)]) -> Agent {
        let env = self.env(extra);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let agent = Agent::start(
            backend,
            &["--pods", "kube", "--node-name", crate::apiserver::NODE],
            &env,
        )
        .expect("agent");
        eventually("meshcap installed and the agent ready", || {
            self.installed() && agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200)
        })
        .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", agent.http_get("/readyz"), agent.log()));
        agent
    }

    /// How many meshcap entries the primary conflist holds.
    ///
    /// # Panics
    /// When it cannot be read.
    #[must_use]
    pub fn entries(&self) -> usize {
        let conf: Value = serde_json::from_slice(&fs::read(&self.conflist).expect("conflist"))
            .expect("JSON conflist");
        conf["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .filter(|p| p["type"] == "meshcap-cni")
            .count()
    }

    /// What meshcap put on the node, each with whether it is there.
    #[must_use]
    pub fn files(&self) -> Vec<(PathBuf, bool)> {
        [
            self.bin_dir.join("meshcap-cni"),
            self.bin_dir.join("meshcap-agent"),
            self.conf_dir.join("meshcap-cni.kubeconfig"),
        ]
        .into_iter()
        .map(|p| {
            let there = p.exists();
            (p, there)
        })
        .collect()
    }

    /// Entry, plugin, decider and kubeconfig all in place.
    #[must_use]
    pub fn installed(&self) -> bool {
        self.entries() == 1 && self.files().iter().all(|(_, there)| *there)
    }

    /// Nothing of meshcap left in the CNI set-up: new pods start without it.
    #[must_use]
    pub fn clean(&self) -> bool {
        self.entries() == 0 && self.files().iter().all(|(_, there)| !*there)
    }

    /// The installed plugin's ADD of `namespace/name` with the entry the agent chained, as the
    /// runtime runs it, and how long it took.
    ///
    /// # Panics
    /// When no entry is chained or the plugin cannot be run.
    #[must_use]
    pub fn add(&self, namespace: &str, name: &str) -> (CniOutput, std::time::Duration) {
        let conf: Value = serde_json::from_slice(&fs::read(&self.conflist).expect("conflist"))
            .expect("JSON conflist");
        let mut entry = conf["plugins"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["type"] == "meshcap-cni"))
            .cloned()
            .expect("meshcap's entry");
        entry["cniVersion"] = json!("1.0.0");
        entry["name"] = json!("k8s-pod-network");
        entry["prevResult"] = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24"}]});
        installed_add(&self.bin_dir, &entry, namespace, name)
    }
}
