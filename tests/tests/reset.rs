//! The reset that refuses a connection no proxy listens for, as it crosses the wire. The
//! scenario table checks that the client's `connect` is refused, as under Istio's `REDIRECT`;
//! here the segment itself is read off the node's end of the pod's link and checked field by
//! field against what the kernel sends for a closed port (`tcp_v4_send_reset`): from the
//! address and port dialled, `SEQ=0`, `ACK=` the SYN's sequence + 1, RST|ACK, no options, no
//! window, and checksums a receiver checks. Both ways a SYN reaches the pod: with the node's
//! transmit checksum offload on (the local default: the checksum left for the device to
//! finish, which must still be left so) and off (complete checksums, as on a physical network,
//! where a wrong one makes the client drop the reset and wait out its SYN retries).
use std::{net::IpAddr, time::Duration};

use meshcap_agent::{backend::CaptureBackend as _, pod::PodRef};
use meshcap_tests::{
    dial_failure, require_root,
    scenario::{EbpfUnderTest, default_policy},
    wire::{Capture, Segment, set_tx_checksum},
    world::Node,
};

const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;
/// Long enough for a reset on a local link; only a failing test waits it out.
const PATIENCE: Duration = Duration::from_secs(5);

#[test]
fn a_syn_no_proxy_takes_is_answered_with_the_reset_a_closed_port_gives() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    let mut failures = Vec::new();
    for offload in [true, false] {
        for v6 in [false, true] {
            let mut pod = node.add_pod(true).expect("pod");
            pod.start_app(&node).expect("app");
            let pod_ref = PodRef {
                namespace: "default".into(),
                name: format!("reset-{}", pod.index),
                container_id: format!("c{}", pod.index),
                netns: pod.netns.path(),
            };
            backend
                .get()
                .add(&pod_ref, &default_policy("reset", pod.ips(true)).into())
                .expect("add");
            let link = format!("p{}a", pod.index);
            let capture = node
                .netns
                .run_in(|| {
                    set_tx_checksum(&link, offload)?;
                    Capture::open(&link)
                })
                .expect("capture");
            let server: IpAddr = if v6 { pod.v6().into() } else { pod.v4().into() };
            let target = std::net::SocketAddr::new(server, 8080);
            let failed = dial_failure(node.client(), &format!("tcp:{target}")).expect("dial");
            let seen = |flags| {
                capture.segment(PATIENCE, |s: &Segment| {
                    s.flags & (SYN | RST | ACK) == flags && (s.src == server || s.dst == server)
                })
            };
            let case = format!("offload {offload}, {target}");
            match seen(SYN).and_then(|syn| Ok((seen(RST | ACK)?, syn))) {
                Ok((rst, syn)) => {
                    let expected = Segment {
                        src: server,
                        dst: syn.src,
                        sport: 8080,
                        dport: syn.sport,
                        seq: 0,
                        ack: syn.seq.wrapping_add(1),
                        flags: RST | ACK,
                        window: 0,
                        header_len: 20,
                        payload_len: 0,
                        ttl: 64,
                        ip_checksum_ok: true,
                        checksum_ok: !offload,
                        checksum_partial: offload,
                    };
                    if rst != expected || failed != "ConnectionRefused" {
                        failures.push(format!(
                            "{case}: client {failed}\n  got      {rst:?}\n  expected {expected:?}"
                        ));
                    }
                }
                Err(err) => failures.push(format!("{case}: client {failed}, {err:#}")),
            }
            backend.get().remove(&pod_ref).expect("remove");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
