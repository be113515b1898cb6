//! The standalone demo (`cargo xtask demo`): the real `meshcap-agent` (pods from a manifest
//! directory) and the real `meshcap-cni` binary, played as kubelet plays it, against a
//! throwaway pod — on the eBPF backend, then on the iptables fallback. A stand-in Envoy in the
//! pod tells which connections reached it and their original destination. Everything is
//! removed when it ends, also on failure.
use meshcap_tests::{
    APP_UID, PROXY_UID, Placement, Report,
    agent::{Agent, Backend},
    dial,
    fixtures::{ManifestDir, leftovers, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root, start_server,
    wired::Wired,
};

/// The pod's annotations: one excluded port and one excluded address.
const EXCLUDED_PORT: &str = "9000";
const EXCLUDED_IP: &str = "10.0.0.3";

fn main() -> anyhow::Result<()> {
    require_root();
    println!(
        "meshcap demo: a pod with an Istio sidecar, captured by meshcap-agent through meshcap-cni"
    );
    println!("  pod 10.0.0.2 (app uid {APP_UID}, stand-in Envoy uid {PROXY_UID} on 15001/15006)");
    println!("  upstream 10.0.0.1 and {EXCLUDED_IP}, servers on :80 and :{EXCLUDED_PORT}");
    println!(
        "  annotations: excludeOutboundPorts={EXCLUDED_PORT}, excludeOutboundIPRanges={EXCLUDED_IP}/32"
    );
    for backend in [Backend::Ebpf, Backend::Iptables] {
        demo(backend)?;
    }
    println!("\ndone: both backends made the same decisions; nothing was left behind.");
    Ok(())
}

fn demo(backend: Backend) -> anyhow::Result<()> {
    println!("\n== backend: {} ==", backend.name());
    let dir = ManifestDir::new();
    let agent = Agent::start(
        backend,
        &["--pods", "dir", "--pod-dir", &dir.0.display().to_string()],
        &[],
    )?;
    let wired = Wired::new(&agent);
    wired
        .upstream
        .ip(&["addr", "add", &format!("{EXCLUDED_IP}/24"), "dev", "eth0"])?;
    let _envoy = start_server(
        wired.in_pod(PROXY_UID),
        "envoy",
        &["tcp:0.0.0.0:15001", "tcp:0.0.0.0:15006"],
    )?;
    let upstream_at = Placement {
        netns: &wired.upstream,
        cgroup: None,
        uid: 0,
        gid: 0,
    };
    let _upstream = start_server(
        upstream_at,
        "upstream",
        &["tcp:0.0.0.0:80", &format!("tcp:0.0.0.0:{EXCLUDED_PORT}")],
    )?;
    write_manifest(
        &dir.0,
        &sidecar_pod(
            "shop",
            "web",
            &[
                (
                    "traffic.sidecar.istio.io/excludeOutboundPorts",
                    EXCLUDED_PORT,
                ),
                (
                    "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                    &format!("{EXCLUDED_IP}/32"),
                ),
            ],
        ),
    );
    let sandbox = Sandbox::new("shop", "web", &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");

    let add = cni("ADD", &sandbox, &conf)?;
    anyhow::ensure!(add.success, "ADD failed: {}", add.msg());
    row("CNI ADD shop/web", "ok: captured");

    let show = |what: &str, uid: u32, target: &str| -> anyhow::Result<()> {
        let answer = dial(wired.in_pod(uid), target, None)?;
        row(what, &describe(answer.as_ref()));
        Ok(())
    };
    show("app -> 10.0.0.1:80", APP_UID, "tcp:10.0.0.1:80")?;
    show("proxy -> 10.0.0.1:80", PROXY_UID, "tcp:10.0.0.1:80")?;
    show(
        &format!("app -> 10.0.0.1:{EXCLUDED_PORT} (excluded port)"),
        APP_UID,
        &format!("tcp:10.0.0.1:{EXCLUDED_PORT}"),
    )?;
    show(
        &format!("app -> {EXCLUDED_IP}:80 (excluded CIDR)"),
        APP_UID,
        &format!("tcp:{EXCLUDED_IP}:80"),
    )?;
    show(
        "validation probe: proxy -> 127.0.0.6:15002",
        PROXY_UID,
        "tcp:127.0.0.6:15002",
    )?;

    let del = cni("DEL", &sandbox, &conf)?;
    anyhow::ensure!(del.success, "DEL failed: {}", del.msg());
    let mut left = leftovers(&wired.pod)?;
    left.extend(agent.ebpf_leftovers()?);
    row(
        "CNI DEL shop/web",
        &if left.is_empty() {
            "ok: nothing left (rules, routes, map entries, pins)".to_owned()
        } else {
            format!("LEFT BEHIND: {left:?}")
        },
    );
    show("app -> 10.0.0.1:80", APP_UID, "tcp:10.0.0.1:80")?;
    anyhow::ensure!(left.is_empty(), "DEL left {left:?}");
    Ok(())
}

fn row(what: &str, outcome: &str) {
    println!("  {what:<44} {outcome}");
}

fn describe(answer: Option<&Report>) -> String {
    match answer {
        None => "no answer".into(),
        Some(r) if r.server == "envoy" => format!(
            "captured: Envoy :{} sees original destination {}",
            r.listener,
            r.original_dst
                .map_or_else(|| "(none)".to_owned(), |a| a.to_string())
        ),
        Some(r) => format!("not captured: reached {} directly", r.local),
    }
}
