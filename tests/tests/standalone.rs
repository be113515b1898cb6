//! Running the agent by hand (docs/standalone.md): a private agent beside another one needs
//! only `--instance`, and an agent whose programs cannot see a captured pod's processes says
//! so.
use std::{
    path::PathBuf,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use meshcap_agent::backend::ebpf::layout;
use meshcap_tests::{
    Placement, TestCgroup,
    agent::{Backend, binaries, ready_within},
    fixtures::{ManifestDir, eventually},
    one_pod::OnePod,
    require_root, start_server, unique_name,
};
use serde_json::Value;

fn status(socket: &std::path::Path) -> Value {
    let out = Command::new(binaries().join("meshcap-agent"))
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .expect("meshcap-agent status");
    assert!(
        out.status.success(),
        "status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a JSON report")
}

/// Removes what a private agent leaves on the node: it never uninstalls by itself.
struct Instance {
    run_dir: PathBuf,
    bpffs: PathBuf,
    cgroup: PathBuf,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = layout::remove(&self.bpffs);
        if let Some(parent) = self.bpffs.parent() {
            let _ = std::fs::remove_dir(parent);
        }
        let _ = std::fs::remove_dir_all(&self.run_dir);
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

/// Starts `meshcap-agent run --backend <backend> --instance <fresh name>` with an empty pod
/// directory, reads its status report and stops it (SIGTERM, by pid).
fn private_agent(backend: &str) -> (Instance, Value) {
    let name = unique_name("t");
    let instance = Instance {
        run_dir: PathBuf::from(format!("/var/run/meshcap-{name}")),
        bpffs: PathBuf::from(format!("/sys/fs/bpf/meshcap-{name}/v3")),
        cgroup: meshcap_agent::cgroup::cgroup2_mount()
            .expect("cgroup2")
            .join(format!("meshcap-{name}")),
    };
    let pods = ManifestDir::new();
    let mut child = Command::new(binaries().join("meshcap-agent"))
        .args([
            "run",
            "--backend",
            backend,
            "--pods",
            "dir",
            "--instance",
            &name,
        ])
        .arg("--pod-dir")
        .arg(&pods.0)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("meshcap-agent run --instance");
    let socket = instance.run_dir.join("agent.sock");
    // As long as any agent of the harness may take to come up (an emulated guest's is slow).
    let deadline = Instant::now() + ready_within();
    let up = loop {
        if socket.exists() {
            break Ok(());
        }
        if let Ok(Some(exit)) = child.try_wait() {
            break Err(format!("it exited before serving: {exit}"));
        }
        if Instant::now() > deadline {
            break Err(format!(
                "no socket at {} within {:?}",
                socket.display(),
                ready_within()
            ));
        }
        thread::sleep(Duration::from_millis(50));
    };
    let report = up.map(|()| status(&socket));
    // Our own child, by its pid.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    (instance, report.expect("the private agent serves"))
}

#[test]
fn auto_runs_the_backend_the_kernel_can_run() {
    require_root();
    let (_instance, report) = private_agent("auto");
    let reason = report["backend_reason"].as_str().unwrap_or_default();
    if meshcap_tests::ebpf_runs_here() {
        assert_eq!(report["backend"], "ebpf", "{report}");
        assert!(reason.contains("passed every probe"), "{reason}");
        return;
    }
    assert_eq!(report["backend"], "iptables", "{report}");
    // Each missing feature named from the kernel's own answers, not only as a failed load.
    let failed: Vec<String> = meshcap_agent::probe::run()
        .checks
        .into_iter()
        .filter(|c| !c.ok && !c.what.starts_with("trial load"))
        .map(|c| c.what)
        .collect();
    assert!(
        !failed.is_empty(),
        "the probe must name what this kernel lacks: {reason}"
    );
    for what in &failed {
        assert!(reason.contains(what.as_str()), "{what} not in {reason}");
    }
}

#[test]
fn an_instance_name_gives_a_private_agent_its_own_everything() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (instance, report) = private_agent("ebpf");
    let socket = instance.run_dir.join("agent.sock");
    assert_eq!(report["backend"], "ebpf");
    assert_eq!(report["socket"], socket.display().to_string());
    assert!(
        instance.bpffs.join("links").is_dir(),
        "pins under its own directory"
    );
    assert!(instance.cgroup.is_dir(), "its own cgroup");
    let attached =
        meshcap_agent::backend::ebpf::cgroup_attachments(&instance.cgroup).expect("BPF_PROG_QUERY");
    assert!(
        attached.iter().all(|(_, n)| *n == 1),
        "its programs on its own cgroup: {attached:?}"
    );
}

#[test]
fn a_pod_process_outside_the_programs_cgroup_is_reported() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let pod = OnePod::new(Backend::Ebpf, None);
    let add = pod.cni("ADD");
    assert!(add.success, "ADD: {add:?}");
    assert_eq!(
        status(&pod.agent.socket)["warnings"],
        Value::Null,
        "no warning while every process is inside"
    );
    // A process in the pod's netns but in a cgroup of its own, beside the agent's.
    let elsewhere = TestCgroup::new("mc-outside").expect("cgroup");
    // (A stand-in server: any long-running process would do, and it is in the VM's initramfs.)
    let stray = start_server(
        Placement {
            netns: &pod.wired.pod,
            cgroup: Some(&elsewhere),
            uid: 1000,
            gid: 1000,
        },
        "stray",
        &["tcp:127.0.0.1:9099"],
    )
    .expect("a process outside");
    let mut warnings = Value::Null;
    eventually("the warning", || {
        warnings = status(&pod.agent.socket)["warnings"].clone();
        warnings.is_array()
    })
    .expect("a warning about the stray process");
    let text = warnings.to_string();
    assert!(
        text.contains("shop/web") && text.contains(&stray.pid().to_string()),
        "{text}"
    );
    drop(stray);
}
