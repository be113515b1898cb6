//! An upgrade (or any restart) swaps every kernel program for the new agent's, in place and
//! atomically: every pinned cgroup link is switched with `BPF_LINK_UPDATE` and the shared TC
//! classifier is replaced in its program array, while connections keep being captured and
//! established ones keep working. Each agent process loads its own program instances (new ids),
//! so "the new build's" is checked by id: after the restart every attached program is one the
//! running agent loaded.
//!
//! The first agent is this build unless `MESHCAP_UPGRADE_FROM` names a directory holding
//! another build's `meshcap-agent` (the previous release, say): then the restart is a real
//! upgrade from it, run by hand (`MESHCAP_UPGRADE_FROM=target/bench/baseline/bin-<commit>
//! cargo test -p meshcap-tests --test upgrade`; `cargo xtask bench --baseline <commit>`
//! builds it there), since CI has no other build.
use std::{
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use meshcap_tests::{
    APP_UID, Held,
    agent::{Agent, Backend, binaries},
    fixtures::{ManifestDir, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root,
    wired::Wired,
};
use serde_json::Value;

fn programs(agent: &Agent) -> Vec<Value> {
    let out = Command::new(binaries().join("meshcap-agent"))
        .args(["status", "--json", "--socket"])
        .arg(&agent.socket)
        .output()
        .expect("meshcap-agent status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    report["programs"].as_array().expect("programs").clone()
}

#[test]
fn a_restarted_agent_swaps_every_program_in_place_without_a_gap() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let dir = ManifestDir::new();
    write_manifest(&dir.0, &sidecar_pod("shop", "web", &[]));
    let from = std::env::var_os("MESHCAP_UPGRADE_FROM").map(std::path::PathBuf::from);
    let mut agent = Agent::start_from(
        from.as_deref().unwrap_or(binaries()),
        Backend::Ebpf,
        &["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")],
        &[],
        None,
    )
    .expect("agent");
    let wired = Wired::new(&agent);
    let _servers = wired.servers();
    let add = cni(
        "ADD",
        &Sandbox::new("shop", "web", &wired.pod),
        &config("1.0.0", &agent.socket, "10.0.0.2"),
    )
    .expect("ADD");
    assert!(add.success, "{add:?}");

    let before = programs(&agent);
    assert_eq!(
        before.len(),
        11,
        "ten cgroup hooks and the TC classifier: {before:?}"
    );
    assert!(
        before.iter().all(|p| p["this_agent"] == true),
        "the first agent's programs: {before:?}"
    );
    let mut held = Held::connect(wired.in_pod(APP_UID), "10.0.0.1:80".parse().expect("addr"))
        .expect("a held connection");
    let first = held.first().clone();

    let done = AtomicBool::new(false);
    let (captured, bypassed) = thread::scope(|scope| {
        let dials = scope.spawn(|| {
            let (mut captured, mut bypassed) = (0u32, Vec::new());
            while !done.load(Ordering::Relaxed) {
                match wired.app_dial() {
                    (server, Some(orig)) if server == "envoy" && orig == "10.0.0.1:80" => {
                        captured += 1;
                    }
                    other => bypassed.push(other),
                }
            }
            (captured, bypassed)
        });
        thread::sleep(Duration::from_millis(300));
        agent.kill().expect("stop the old agent");
        agent.set_exe(&binaries().join("meshcap-agent"));
        agent.restart().expect("start the new agent");
        thread::sleep(Duration::from_millis(300));
        done.store(true, Ordering::Relaxed);
        dials.join().expect("the dial loop")
    });
    assert!(
        bypassed.is_empty(),
        "{} of {} connections were not captured with their original destination across the \
         restart: {bypassed:?}",
        bypassed.len(),
        captured as usize + bypassed.len()
    );
    assert!(captured > 5, "the loop ran: {captured} connections");
    let answer = held
        .exchange("after the upgrade")
        .expect("the established connection");
    assert_eq!(
        answer, first,
        "the established connection still reaches its proxy"
    );

    let after = programs(&agent);
    assert_eq!(after.len(), before.len());
    for (old, new) in before.iter().zip(&after) {
        assert_eq!(old["program"], new["program"]);
        assert_eq!(new["this_agent"], true, "not the new agent's: {new}");
        assert_ne!(old["prog_id"], new["prog_id"], "not swapped: {new}");
        assert_eq!(
            old["link_id"], new["link_id"],
            "the link is updated in place, not re-created: {new}"
        );
        if from.is_none() {
            assert_eq!(old["tag"], new["tag"], "the same code: {new}");
        }
    }
    let config = agent.ebpf_config().expect("eBPF");
    for (program, count) in meshcap_agent::backend::ebpf::cgroup_attachments(&config.cgroup_root)
        .expect("BPF_PROG_QUERY")
    {
        assert_eq!(count, 1, "{program} attached {count} times");
    }
}
