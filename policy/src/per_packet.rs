//! The policy's own per-packet decision, written from Istio's documented semantics (not from
//! the rules). It is what the eBPF decision implements, and what the evaluator of the rendered
//! rules is checked against.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{
    model::{
        DNS_CAPTURE_PORT, DNS_PORT, INBOUND_CAPTURE_PORT, INBOUND_TUNNEL_PORT, InterceptionMode,
        OUTBOUND_CAPTURE_PORT, OUTBOUND_MARK, PortSelection, RedirectPolicy, TPROXY_MARK,
    },
    packet::{CtState, Direction, Outcome, Packet, Protocol, Verdict},
};

/// The loopback interface.
pub const LOOPBACK_INTERFACE: &str = "lo";
/// The source address of Envoy's inbound passthrough connections (IPv4); never captured.
pub const INBOUND_PASSTHROUGH_V4: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 6);
/// The source address of Envoy's inbound passthrough connections (IPv6, added to `lo`).
pub const INBOUND_PASSTHROUGH_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);

/// The one loopback address apps use to reach Envoy-aware local services directly.
fn is_host_loopback(ip: IpAddr) -> bool {
    ip == IpAddr::V4(Ipv4Addr::LOCALHOST) || ip == IpAddr::V6(Ipv6Addr::LOCALHOST)
}

fn is_passthrough_source(ip: IpAddr) -> bool {
    ip == IpAddr::V4(INBOUND_PASSTHROUGH_V4) || ip == IpAddr::V6(INBOUND_PASSTHROUGH_V6)
}

impl RedirectPolicy {
    /// What Istio's capture does to `packet` in this pod.
    #[must_use]
    pub fn decide(&self, packet: &Packet) -> Outcome {
        match packet.direction {
            Direction::Outbound => self.decide_outbound(packet),
            Direction::Inbound => self.decide_inbound(packet),
        }
    }

    fn family_enabled(&self, packet: &Packet) -> bool {
        packet.dst.is_ipv4() || self.ipv6
    }

    fn decide_outbound(&self, packet: &Packet) -> Outcome {
        let excluded_interface = self.exclude_interfaces.contains(&packet.interface);
        let mark = if self.family_enabled(packet) && !excluded_interface {
            self.outbound_mark(packet)
        } else {
            packet.mark
        };
        let verdict = if self.family_enabled(packet)
            && !excluded_interface
            && packet.ct_state == CtState::New
        {
            self.outbound_verdict(packet)
        } else {
            Verdict::Pass
        };
        Outcome { verdict, mark }
    }

    /// TPROXY mode marks the proxy's own loopback traffic (1338) so that the inbound side can
    /// tell it from the app's, and restores the connection's TPROXY mark on replies.
    fn outbound_mark(&self, packet: &Packet) -> u32 {
        let tcp = packet.protocol == Protocol::Tcp;
        if self.mode != InterceptionMode::Tproxy || !tcp {
            return packet.mark;
        }
        let on_lo = packet.interface == LOOPBACK_INTERFACE;
        if on_lo && packet.mark == TPROXY_MARK {
            return packet.mark;
        }
        let mut mark = packet.mark;
        if on_lo
            && !is_host_loopback(packet.dst)
            && (packet.uid == self.proxy_uid || packet.gid == self.proxy_gid)
        {
            mark = OUTBOUND_MARK;
        }
        if packet.ct_mark == TPROXY_MARK {
            mark = packet.ct_mark;
        }
        mark
    }

    fn outbound_verdict(&self, packet: &Packet) -> Verdict {
        let tcp = packet.protocol == Protocol::Tcp;
        let on_lo = packet.interface == LOOPBACK_INTERFACE;
        let port = packet.dst_port;
        if self.exclude_outbound_ports.contains(&port)
            || (on_lo && is_passthrough_source(packet.src))
        {
            return Verdict::Pass;
        }
        // The proxy's TCP connections to a local address other than 127.0.0.1 hairpin to its
        // inbound listener (a pod calling its own service), except to the HBONE port (and,
        // for the uid, DNS). Other proxy traffic passes.
        let hairpin = on_lo && !is_host_loopback(packet.dst) && tcp && port != INBOUND_TUNNEL_PORT;
        // The app's own loopback traffic passes unless the include list names a loopback
        // range; with DNS capture, its TCP port-53 and all its UDP traffic stay capturable.
        let app_loopback_passes = !self.include_outbound_ip_ranges.has_loopback()
            && on_lo
            && (!self.dns_capture || (tcp && port != DNS_PORT));
        for (is_proxy, dns_exempt) in [
            (packet.uid == self.proxy_uid, true),
            (packet.gid == self.proxy_gid, false),
        ] {
            if is_proxy && hairpin && !(dns_exempt && self.dns_capture && port == DNS_PORT) {
                return Verdict::Redirect(INBOUND_CAPTURE_PORT);
            }
            if is_proxy || app_loopback_passes {
                return Verdict::Pass;
            }
        }
        if self.dns_capture && port == DNS_PORT {
            return Verdict::Redirect(DNS_CAPTURE_PORT);
        }
        if is_host_loopback(packet.dst) || self.exclude_outbound_ip_ranges.contains(packet.dst) {
            return Verdict::Pass;
        }
        if tcp
            && (self.include_outbound_ports.contains(&port)
                || self.include_outbound_ip_ranges.contains(packet.dst))
        {
            return Verdict::Redirect(OUTBOUND_CAPTURE_PORT);
        }
        Verdict::Pass
    }

    fn decide_inbound(&self, packet: &Packet) -> Outcome {
        let mut outcome = Outcome {
            verdict: Verdict::Pass,
            mark: packet.mark,
        };
        if !self.family_enabled(packet) {
            return outcome;
        }
        let excluded_interface = self.exclude_interfaces.contains(&packet.interface);
        // In TPROXY mode excluded interfaces skip the mangle rules too.
        if !(self.mode == InterceptionMode::Tproxy && excluded_interface) {
            if self.invalid_drop && packet.ct_state == CtState::Invalid {
                outcome.verdict = Verdict::Drop;
                return outcome;
            }
            if self.mode == InterceptionMode::Tproxy {
                self.tproxy_inbound(packet, &mut outcome);
                if outcome.verdict != Verdict::Pass {
                    return outcome;
                }
            }
        }
        // NAT rules see only a connection's first packet, and never packets looping back from
        // a local socket (their NAT was decided on the way out).
        if packet.ct_state != CtState::New || packet.interface == LOOPBACK_INTERFACE {
            return outcome;
        }
        outcome.verdict = self.nat_inbound_verdict(packet, excluded_interface);
        outcome
    }

    fn tproxy_inbound(&self, packet: &Packet, outcome: &mut Outcome) {
        if packet.protocol != Protocol::Tcp || self.include_inbound_ports.is_none() {
            return;
        }
        let on_lo = packet.interface == LOOPBACK_INTERFACE;
        let skipped = packet.mark == TPROXY_MARK
            || (on_lo && is_passthrough_source(packet.src))
            || (on_lo && packet.mark != OUTBOUND_MARK);
        let captured_port = match &self.include_inbound_ports {
            PortSelection::All => !self.exclude_inbound_ports.contains(&packet.dst_port),
            PortSelection::Ports(ports) => ports.contains(&packet.dst_port),
        };
        if skipped || !captured_port {
            return;
        }
        if matches!(packet.ct_state, CtState::Established | CtState::Related) {
            // ISTIO_DIVERT: mark for the policy route to the established local socket.
            outcome.mark = TPROXY_MARK;
        } else if !is_host_loopback(packet.dst) {
            outcome.verdict = Verdict::Tproxy(INBOUND_CAPTURE_PORT);
            outcome.mark = TPROXY_MARK;
        }
    }

    fn nat_inbound_verdict(&self, packet: &Packet, excluded_interface: bool) -> Verdict {
        let tcp = packet.protocol == Protocol::Tcp;
        if self.reroute_virtual_interfaces.contains(&packet.interface) {
            // Treated as outbound: captured when the destination is in the include list.
            let included = self.include_outbound_ip_ranges.contains(packet.dst);
            return if tcp && included {
                Verdict::Redirect(OUTBOUND_CAPTURE_PORT)
            } else {
                Verdict::Pass
            };
        }
        if excluded_interface || self.mode == InterceptionMode::Tproxy || !tcp {
            return Verdict::Pass;
        }
        let port = packet.dst_port;
        let captured = match &self.include_inbound_ports {
            PortSelection::All => {
                port != INBOUND_TUNNEL_PORT && !self.exclude_inbound_ports.contains(&port)
            }
            PortSelection::Ports(ports) => port != INBOUND_TUNNEL_PORT && ports.contains(&port),
        };
        if captured {
            Verdict::Redirect(INBOUND_CAPTURE_PORT)
        } else {
            Verdict::Pass
        }
    }
}
