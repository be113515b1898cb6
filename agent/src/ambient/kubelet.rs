//! Kubelet's uid, which the node's nftables probe rule matches (`meta skuid`), found among the
//! host's processes as Istio's node agent finds it (`cni/pkg/nftables/kubeletuid_linux.go`,
//! `getKubeletUIDFromPath`, on the host's `/proc` the DaemonSet mounts at `/host/proc`): the
//! first process, in the order the proc directory lists them, whose `comm` is `kubelet` or
//! `kubelite` (MicroK8s) with "kubelet" in one of its arguments, or `k3s` (which embeds
//! kubelet); its uid is the first (real) one of its `status`. A process that exits while it
//! is read is passed over.
use std::{
    fs,
    path::{Path, PathBuf},
};

/// A process name kubelet runs under, and whether one of its arguments must name kubelet.
const KUBELETS: [(&str, bool); 3] = [("kubelet", true), ("kubelite", true), ("k3s", false)];

/// No process of the proc directory is kubelet, or the directory cannot be read.
#[derive(Debug, thiserror::Error)]
#[error(
    "kubelet's uid: {reason} in {proc} (looked for a process whose comm is `kubelet` or \
     `kubelite` with \"kubelet\" in its command line, or `k3s`)",
    proc = .proc.display()
)]
pub struct KubeletNotFound {
    /// The proc directory searched.
    pub proc: PathBuf,
    /// What was found instead.
    pub reason: String,
}

/// The uid kubelet runs as, from the processes of `proc` (the host's `/proc`).
///
/// # Errors
/// When `proc` cannot be read or none of its processes is kubelet.
pub fn kubelet_uid(proc: &Path) -> Result<u32, KubeletNotFound> {
    let not_found = |reason: String| KubeletNotFound {
        proc: proc.to_owned(),
        reason,
    };
    let entries = fs::read_dir(proc).map_err(|e| not_found(format!("cannot be listed: {e}")))?;
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    let searched = pids.len();
    pids.into_iter()
        .find_map(|pid| uid_if_kubelet(&proc.join(pid.to_string())))
        .ok_or_else(|| not_found(format!("no kubelet among {searched} processes")))
}

/// The uid of the process at `dir` when it is kubelet.
fn uid_if_kubelet(dir: &Path) -> Option<u32> {
    let comm = fs::read_to_string(dir.join("comm")).ok()?;
    let (_, needs_argument) = KUBELETS.iter().find(|(name, _)| *name == comm.trim_end())?;
    if *needs_argument {
        let cmdline = fs::read(dir.join("cmdline")).ok()?;
        let named = cmdline.split(|b| *b == 0).any(|arg| {
            String::from_utf8_lossy(arg)
                .to_lowercase()
                .contains("kubelet")
        });
        if !named {
            return None;
        }
    }
    let status = fs::read_to_string(dir.join("status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proc directory holding `procs` as (pid, comm, arguments, real uid).
    fn proc_dir(procs: &[(u32, &str, &[&str], u32)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (pid, comm, args, uid) in procs {
            let p = dir.path().join(pid.to_string());
            fs::create_dir(&p).expect("pid dir");
            fs::write(p.join("comm"), format!("{comm}\n")).expect("comm");
            let cmdline: Vec<u8> = args
                .iter()
                .flat_map(|a| [a.as_bytes(), b"\0"].concat())
                .collect();
            fs::write(p.join("cmdline"), cmdline).expect("cmdline");
            let status =
                format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n");
            fs::write(p.join("status"), status).expect("status");
        }
        fs::create_dir(dir.path().join("self")).expect("not a pid");
        dir
    }

    #[test]
    fn kubelet_is_found_by_its_name_and_an_argument_naming_it() {
        let dir = proc_dir(&[
            (1, "systemd", &["/sbin/init"], 0),
            (7, "kubelet", &["/usr/local/bin/other"], 5),
            (40, "kubelet", &["/usr/bin/kubelet", "--config=x"], 1001),
        ]);
        assert_eq!(kubelet_uid(dir.path()).expect("found"), 1001);
    }

    #[test]
    fn kubelite_and_k3s_are_kubelet_too() {
        let dir = proc_dir(&[(
            3,
            "kubelite",
            &[
                "/snap/microk8s/kubelite",
                "--kubelet-args-file=/var/snap/args/kubelet",
            ],
            0,
        )]);
        assert_eq!(kubelet_uid(dir.path()).expect("kubelite"), 0);
        let dir = proc_dir(&[(3, "k3s", &["k3s", "agent"], 77)]);
        assert_eq!(kubelet_uid(dir.path()).expect("k3s"), 77);
        let dir = proc_dir(&[(3, "kubelite", &["/usr/bin/other"], 0)]);
        assert!(kubelet_uid(dir.path()).is_err());
    }

    #[test]
    fn without_kubelet_the_error_names_the_directory_and_what_was_searched() {
        let dir = proc_dir(&[
            (1, "systemd", &["/sbin/init"], 0),
            (2, "kubeletx", &["kubelet"], 0),
        ]);
        let err = kubelet_uid(dir.path()).expect_err("no kubelet").to_string();
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(err.contains("no kubelet among 2 processes"), "{err}");
        assert!(err.contains("`kubelite`") && err.contains("`k3s`"), "{err}");
        let gone = dir.path().join("absent");
        let err = kubelet_uid(&gone).expect_err("no directory").to_string();
        assert!(err.contains("cannot be listed"), "{err}");
    }
}
