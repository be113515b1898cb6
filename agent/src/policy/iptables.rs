//! Istio's iptables rules for a policy, as `iptables-restore` input: the same rules, in the
//! same order within each table, as `istio-iptables` (`tools/istio-iptables/pkg/capture`)
//! writes for the CNI plugin, plus the TPROXY policy route it installs over netlink.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::{
    model::{
        DNS_CAPTURE_PORT, DNS_PORT, Family, INBOUND_CAPTURE_PORT, INBOUND_TUNNEL_PORT,
        InterceptionMode, IpRanges, OUTBOUND_CAPTURE_PORT, OUTBOUND_MARK, PortSelection,
        RedirectPolicy, TPROXY_MARK,
    },
    routes::{PolicyRoutes, TproxyRoute},
};

/// A policy rendered for the iptables backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IptablesRules {
    /// `iptables-restore --noflush` input.
    pub v4: String,
    /// `ip6tables-restore --noflush` input, when the pod has IPv6.
    pub v6: Option<String>,
    /// What the rules need besides themselves, set up over netlink.
    pub routes: PolicyRoutes,
}

impl IptablesRules {
    /// The restore input of one family (`None` for IPv6 when the pod has no IPv6).
    #[must_use]
    pub fn family(&self, family: Family) -> Option<&str> {
        match family {
            Family::V4 => Some(&self.v4),
            Family::V6 => self.v6.as_deref(),
        }
    }
}

impl RedirectPolicy {
    /// Istio's rules for this policy.
    #[must_use]
    pub fn render(&self) -> IptablesRules {
        let mut builder = Builder {
            v4: Vec::new(),
            v6: Vec::new(),
            ipv6: self.ipv6,
        };
        self.build(&mut builder);
        let mut routes = if self.ipv6 {
            PolicyRoutes::passthrough6()
        } else {
            PolicyRoutes::default()
        };
        if self.mode == InterceptionMode::Tproxy && !self.include_inbound_ports.is_none() {
            routes.tproxy = Some(TproxyRoute::new(self.ipv6));
        }
        IptablesRules {
            v4: restore_text(&builder.v4),
            v6: self.ipv6.then(|| restore_text(&builder.v6)),
            routes,
        }
    }

    fn build(&self, b: &mut Builder) {
        let tproxy = self.mode == InterceptionMode::Tproxy;
        let uid = self.proxy_uid.to_string();
        let gid = self.proxy_gid.to_string();
        let tproxy_mark = TPROXY_MARK.to_string();
        let outbound_mark = OUTBOUND_MARK.to_string();

        for name in &self.exclude_interfaces {
            b.append(BOTH, NAT, PREROUTING, &["-i", name, "-j", RETURN]);
            b.append(BOTH, NAT, OUTPUT, &["-o", name, "-j", RETURN]);
        }
        if tproxy {
            for name in &self.exclude_interfaces {
                b.append(BOTH, MANGLE, PREROUTING, &["-i", name, "-j", RETURN]);
                b.append(BOTH, MANGLE, OUTPUT, &["-o", name, "-j", RETURN]);
            }
        }
        for name in &self.reroute_virtual_interfaces {
            b.insert(BOTH, NAT, PREROUTING, 1, &["-i", name, "-j", RETURN]);
        }
        if self.invalid_drop {
            b.append(
                BOTH,
                MANGLE,
                PREROUTING,
                &["-m", "conntrack", "--ctstate", "INVALID", "-j", ISTIO_DROP],
            );
            b.append(BOTH, MANGLE, ISTIO_DROP, &["-j", "DROP"]);
        }
        b.append(
            BOTH,
            NAT,
            ISTIO_INBOUND,
            &[
                "-p",
                "tcp",
                "--dport",
                &INBOUND_TUNNEL_PORT.to_string(),
                "-j",
                RETURN,
            ],
        );
        b.append(
            BOTH,
            NAT,
            ISTIO_REDIRECT,
            &[
                "-p",
                "tcp",
                "-j",
                "REDIRECT",
                "--to-ports",
                &OUTBOUND_CAPTURE_PORT.to_string(),
            ],
        );
        b.append(
            BOTH,
            NAT,
            ISTIO_IN_REDIRECT,
            &[
                "-p",
                "tcp",
                "-j",
                "REDIRECT",
                "--to-ports",
                &INBOUND_CAPTURE_PORT.to_string(),
            ],
        );
        self.build_inbound(b);

        b.append(BOTH, NAT, OUTPUT, &["-j", ISTIO_OUTPUT]);
        for port in &self.exclude_outbound_ports {
            let port = port.to_string();
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &["-p", "tcp", "--dport", &port, "-j", RETURN],
            );
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &["-p", "udp", "--dport", &port, "-j", RETURN],
            );
        }
        b.versioned(
            NAT,
            ISTIO_OUTPUT,
            PASSTHROUGH_V4,
            PASSTHROUGH_V6,
            &["-o", "lo", "-s", IP, "-j", RETURN],
        );
        let tunnel = INBOUND_TUNNEL_PORT.to_string();
        let dns_and_tunnel = format!("{DNS_PORT},{INBOUND_TUNNEL_PORT}");
        let dns = DNS_PORT.to_string();
        let app_loopback_passes = !self.include_outbound_ip_ranges.has_loopback();
        for (owner, id) in [("--uid-owner", &uid), ("--gid-owner", &gid)] {
            if self.dns_capture && owner == "--uid-owner" {
                b.versioned(
                    NAT,
                    ISTIO_OUTPUT,
                    HOST_LOOPBACK_V4,
                    HOST_LOOPBACK_V6,
                    &[
                        "-o",
                        "lo",
                        "!",
                        "-d",
                        IP,
                        "-p",
                        "tcp",
                        "-m",
                        "multiport",
                        "!",
                        "--dports",
                        &dns_and_tunnel,
                        "-m",
                        "owner",
                        owner,
                        id,
                        "-j",
                        ISTIO_IN_REDIRECT,
                    ],
                );
            } else {
                b.versioned(
                    NAT,
                    ISTIO_OUTPUT,
                    HOST_LOOPBACK_V4,
                    HOST_LOOPBACK_V6,
                    &[
                        "-o",
                        "lo",
                        "!",
                        "-d",
                        IP,
                        "-p",
                        "tcp",
                        "!",
                        "--dport",
                        &tunnel,
                        "-m",
                        "owner",
                        owner,
                        id,
                        "-j",
                        ISTIO_IN_REDIRECT,
                    ],
                );
            }
            if app_loopback_passes {
                if self.dns_capture {
                    b.append(
                        BOTH,
                        NAT,
                        ISTIO_OUTPUT,
                        &[
                            "-o", "lo", "-p", "tcp", "!", "--dport", &dns, "-m", "owner", "!",
                            owner, id, "-j", RETURN,
                        ],
                    );
                } else {
                    b.append(
                        BOTH,
                        NAT,
                        ISTIO_OUTPUT,
                        &["-o", "lo", "-m", "owner", "!", owner, id, "-j", RETURN],
                    );
                }
            }
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &["-m", "owner", owner, id, "-j", RETURN],
            );
        }
        if self.dns_capture {
            self.build_dns(b, &uid, &gid);
        }
        b.versioned(
            NAT,
            ISTIO_OUTPUT,
            HOST_LOOPBACK_V4,
            HOST_LOOPBACK_V6,
            &["-d", IP, "-j", RETURN],
        );
        for (family, cidrs) in [
            (V4, &self.exclude_outbound_ip_ranges.v4),
            (V6, &self.exclude_outbound_ip_ranges.v6),
        ] {
            for cidr in cidrs {
                b.append(
                    family,
                    NAT,
                    ISTIO_OUTPUT,
                    &["-d", &cidr.to_string(), "-j", RETURN],
                );
            }
        }
        for port in &self.include_outbound_ports {
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &[
                    "-p",
                    "tcp",
                    "--dport",
                    &port.to_string(),
                    "-j",
                    ISTIO_REDIRECT,
                ],
            );
        }
        for family in [V4, V6] {
            self.build_outbound_include(b, family);
        }

        if tproxy {
            b.append(
                BOTH,
                MANGLE,
                PREROUTING,
                &[
                    "-p",
                    "tcp",
                    "-m",
                    "mark",
                    "--mark",
                    &tproxy_mark,
                    "-j",
                    "CONNMARK",
                    "--save-mark",
                ],
            );
            b.append(
                BOTH,
                MANGLE,
                OUTPUT,
                &[
                    "-p",
                    "tcp",
                    "-o",
                    "lo",
                    "-m",
                    "mark",
                    "--mark",
                    &tproxy_mark,
                    "-j",
                    RETURN,
                ],
            );
            for (owner, id) in [("--uid-owner", &uid), ("--gid-owner", &gid)] {
                b.versioned(
                    MANGLE,
                    OUTPUT,
                    HOST_LOOPBACK_V4,
                    HOST_LOOPBACK_V6,
                    &[
                        "!",
                        "-d",
                        IP,
                        "-p",
                        "tcp",
                        "-o",
                        "lo",
                        "-m",
                        "owner",
                        owner,
                        id,
                        "-j",
                        "MARK",
                        "--set-mark",
                        &outbound_mark,
                    ],
                );
            }
            b.append(
                BOTH,
                MANGLE,
                OUTPUT,
                &[
                    "-p",
                    "tcp",
                    "-m",
                    "connmark",
                    "--mark",
                    &tproxy_mark,
                    "-j",
                    "CONNMARK",
                    "--restore-mark",
                ],
            );
            b.insert(
                BOTH,
                MANGLE,
                ISTIO_INBOUND,
                1,
                &[
                    "-p",
                    "tcp",
                    "-m",
                    "mark",
                    "--mark",
                    &tproxy_mark,
                    "-j",
                    RETURN,
                ],
            );
            b.insert(
                V4,
                MANGLE,
                ISTIO_INBOUND,
                2,
                &["-p", "tcp", "-s", PASSTHROUGH_V4, "-i", "lo", "-j", RETURN],
            );
            b.insert(
                V6,
                MANGLE,
                ISTIO_INBOUND,
                2,
                &["-p", "tcp", "-s", PASSTHROUGH_V6, "-i", "lo", "-j", RETURN],
            );
            b.insert(
                BOTH,
                MANGLE,
                ISTIO_INBOUND,
                3,
                &[
                    "-p",
                    "tcp",
                    "-i",
                    "lo",
                    "-m",
                    "mark",
                    "!",
                    "--mark",
                    &outbound_mark,
                    "-j",
                    RETURN,
                ],
            );
        }
    }

    fn build_inbound(&self, b: &mut Builder) {
        if self.include_inbound_ports.is_none() {
            return;
        }
        let tproxy = self.mode == InterceptionMode::Tproxy;
        let table = if tproxy {
            let tproxy_mark = TPROXY_MARK.to_string();
            b.append(
                BOTH,
                MANGLE,
                ISTIO_DIVERT,
                &["-j", "MARK", "--set-mark", &tproxy_mark],
            );
            b.append(BOTH, MANGLE, ISTIO_DIVERT, &["-j", "ACCEPT"]);
            b.versioned(
                MANGLE,
                ISTIO_TPROXY,
                HOST_LOOPBACK_V4,
                HOST_LOOPBACK_V6,
                &[
                    "!",
                    "-d",
                    IP,
                    "-p",
                    "tcp",
                    "-j",
                    "TPROXY",
                    "--tproxy-mark",
                    &format!("{tproxy_mark}/0xffffffff"),
                    "--on-port",
                    &INBOUND_CAPTURE_PORT.to_string(),
                ],
            );
            MANGLE
        } else {
            NAT
        };
        b.append(BOTH, table, PREROUTING, &["-p", "tcp", "-j", ISTIO_INBOUND]);
        match &self.include_inbound_ports {
            PortSelection::All => {
                for port in &self.exclude_inbound_ports {
                    b.append(
                        BOTH,
                        table,
                        ISTIO_INBOUND,
                        &["-p", "tcp", "--dport", &port.to_string(), "-j", RETURN],
                    );
                }
                if tproxy {
                    b.append(
                        BOTH,
                        MANGLE,
                        ISTIO_INBOUND,
                        &[
                            "-p",
                            "tcp",
                            "-m",
                            "conntrack",
                            "--ctstate",
                            "RELATED,ESTABLISHED",
                            "-j",
                            ISTIO_DIVERT,
                        ],
                    );
                    b.append(
                        BOTH,
                        MANGLE,
                        ISTIO_INBOUND,
                        &["-p", "tcp", "-j", ISTIO_TPROXY],
                    );
                } else {
                    b.append(
                        BOTH,
                        NAT,
                        ISTIO_INBOUND,
                        &["-p", "tcp", "-j", ISTIO_IN_REDIRECT],
                    );
                }
            }
            PortSelection::Ports(ports) => {
                for port in ports {
                    let port = port.to_string();
                    if tproxy {
                        b.append(
                            BOTH,
                            MANGLE,
                            ISTIO_INBOUND,
                            &[
                                "-p",
                                "tcp",
                                "--dport",
                                &port,
                                "-m",
                                "conntrack",
                                "--ctstate",
                                "RELATED,ESTABLISHED",
                                "-j",
                                ISTIO_DIVERT,
                            ],
                        );
                        b.append(
                            BOTH,
                            MANGLE,
                            ISTIO_INBOUND,
                            &["-p", "tcp", "--dport", &port, "-j", ISTIO_TPROXY],
                        );
                    } else {
                        b.append(
                            BOTH,
                            NAT,
                            ISTIO_INBOUND,
                            &["-p", "tcp", "--dport", &port, "-j", ISTIO_IN_REDIRECT],
                        );
                    }
                }
            }
        }
    }

    fn build_dns(&self, b: &mut Builder, uid: &str, gid: &str) {
        let dns = DNS_PORT.to_string();
        let dns_capture = DNS_CAPTURE_PORT.to_string();
        b.append(BOTH, RAW, OUTPUT, &["-j", ISTIO_OUTPUT_DNS]);
        b.append(BOTH, NAT, ISTIO_OUTPUT, &["-j", ISTIO_OUTPUT_DNS]);
        b.append(
            BOTH,
            NAT,
            ISTIO_OUTPUT_DNS,
            &[
                "-p",
                "tcp",
                "--dport",
                &dns,
                "-j",
                "REDIRECT",
                "--to-ports",
                &dns_capture,
            ],
        );
        b.append(
            BOTH,
            NAT,
            ISTIO_OUTPUT_DNS,
            &[
                "-p",
                "udp",
                "--dport",
                &dns,
                "-j",
                "REDIRECT",
                "--to-port",
                &dns_capture,
            ],
        );
        // Separate conntrack zones for proxy ↔ upstream (1) and app ↔ proxy (2) DNS flows.
        for (owner, id) in [("--uid-owner", uid), ("--gid-owner", gid)] {
            b.append(
                BOTH,
                RAW,
                ISTIO_OUTPUT_DNS,
                &[
                    "-p", "udp", "--dport", &dns, "-m", "owner", owner, id, "-j", "CT", "--zone",
                    "1",
                ],
            );
            b.append(
                BOTH,
                RAW,
                ISTIO_OUTPUT_DNS,
                &[
                    "-p",
                    "udp",
                    "--sport",
                    &dns_capture,
                    "-m",
                    "owner",
                    owner,
                    id,
                    "-j",
                    "CT",
                    "--zone",
                    "2",
                ],
            );
        }
        b.append(BOTH, RAW, PREROUTING, &["-j", ISTIO_INBOUND]);
        b.append(
            BOTH,
            RAW,
            ISTIO_OUTPUT_DNS,
            &["-p", "udp", "--dport", &dns, "-j", "CT", "--zone", "2"],
        );
        b.append(
            BOTH,
            RAW,
            ISTIO_INBOUND,
            &["-p", "udp", "--sport", &dns, "-j", "CT", "--zone", "1"],
        );
    }

    fn build_outbound_include(&self, b: &mut Builder, family: Families) {
        match &self.include_outbound_ip_ranges {
            IpRanges::All => {
                b.append(family, NAT, ISTIO_OUTPUT, &["-j", ISTIO_REDIRECT]);
                for name in &self.reroute_virtual_interfaces {
                    b.insert(
                        family,
                        NAT,
                        PREROUTING,
                        1,
                        &["-i", name, "-j", ISTIO_REDIRECT],
                    );
                }
            }
            IpRanges::Cidrs(set) => {
                let cidrs = if family == V4 { &set.v4 } else { &set.v6 };
                for cidr in cidrs {
                    let cidr = cidr.to_string();
                    for name in &self.reroute_virtual_interfaces {
                        b.insert(
                            family,
                            NAT,
                            PREROUTING,
                            1,
                            &["-i", name, "-d", &cidr, "-j", ISTIO_REDIRECT],
                        );
                    }
                    b.append(
                        family,
                        NAT,
                        ISTIO_OUTPUT,
                        &["-d", &cidr, "-j", ISTIO_REDIRECT],
                    );
                }
            }
        }
    }
}

const NAT: &str = "nat";
const MANGLE: &str = "mangle";
const RAW: &str = "raw";
const PREROUTING: &str = "PREROUTING";
const OUTPUT: &str = "OUTPUT";
const RETURN: &str = "RETURN";
const ISTIO_INBOUND: &str = "ISTIO_INBOUND";
const ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";
const ISTIO_OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
const ISTIO_REDIRECT: &str = "ISTIO_REDIRECT";
const ISTIO_IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
const ISTIO_DIVERT: &str = "ISTIO_DIVERT";
const ISTIO_TPROXY: &str = "ISTIO_TPROXY";
const ISTIO_DROP: &str = "ISTIO_DROP";
const PASSTHROUGH_V4: &str = "127.0.0.6/32";
const PASSTHROUGH_V6: &str = "::6/128";
const HOST_LOOPBACK_V4: &str = "127.0.0.1/32";
const HOST_LOOPBACK_V6: &str = "::1/128";
/// Stands for the family's address in [`Builder::versioned`] rules.
const IP: &str = "\0ip";
/// Chains and targets `-N` is never written for.
const BUILT_IN: [&str; 8] = [
    "INPUT",
    "OUTPUT",
    "FORWARD",
    "PREROUTING",
    "POSTROUTING",
    "ACCEPT",
    "RETURN",
    "DROP",
];

/// Which families a rule goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Families {
    v4: bool,
    v6: bool,
}
const BOTH: Families = Families { v4: true, v6: true };
const V4: Families = Families {
    v4: true,
    v6: false,
};
const V6: Families = Families {
    v4: false,
    v6: true,
};

struct Rule {
    table: &'static str,
    chain: &'static str,
    /// The rule as written after the table: `-A CHAIN …` or `-I CHAIN N …`.
    words: Vec<String>,
}

/// Collects rules per family in Istio's order (its `IptablesRuleBuilder`): IPv6 rules only
/// when the pod has IPv6.
struct Builder {
    v4: Vec<Rule>,
    v6: Vec<Rule>,
    ipv6: bool,
}

impl Builder {
    fn push(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        head: Vec<String>,
        params: &[&str],
        ip: Option<(&str, &str)>,
    ) {
        for (enabled, rules, family) in [
            (families.v4, &mut self.v4, Family::V4),
            (families.v6 && self.ipv6, &mut self.v6, Family::V6),
        ] {
            if !enabled {
                continue;
            }
            let mut words = head.clone();
            words.extend(params.iter().map(|word| match (ip, *word == IP, family) {
                (Some((v4, _)), true, Family::V4) => v4.to_owned(),
                (Some((_, v6)), true, Family::V6) => v6.to_owned(),
                _ => (*word).to_owned(),
            }));
            rules.push(Rule {
                table,
                chain,
                words,
            });
        }
    }

    fn append(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        params: &[&str],
    ) {
        self.push(
            families,
            table,
            chain,
            vec!["-A".into(), chain.into()],
            params,
            None,
        );
    }

    fn insert(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        position: u32,
        params: &[&str],
    ) {
        self.push(
            families,
            table,
            chain,
            vec!["-I".into(), chain.into(), position.to_string()],
            params,
            None,
        );
    }

    /// A rule for both families with [`IP`] standing for `v4` or `v6`.
    fn versioned(
        &mut self,
        table: &'static str,
        chain: &'static str,
        v4: &str,
        v6: &str,
        params: &[&str],
    ) {
        self.push(
            BOTH,
            table,
            chain,
            vec!["-A".into(), chain.into()],
            params,
            Some((v4, v6)),
        );
    }
}

/// `iptables-restore` input: tables in name order, each declaring its chains (those with
/// rules, in first-use order, then those only jumped to) before its rules.
fn restore_text(rules: &[Rule]) -> String {
    let mut tables: Vec<&str> = rules.iter().map(|rule| rule.table).collect();
    tables.sort_unstable();
    tables.dedup();
    let mut out = String::new();
    for table in tables {
        let in_table: Vec<&Rule> = rules.iter().filter(|rule| rule.table == table).collect();
        let mut declared: Vec<&str> = Vec::new();
        let used = in_table.iter().map(|rule| rule.chain);
        let jumped = in_table
            .iter()
            .filter_map(|rule| match rule.words.as_slice() {
                [.., jump, target] if jump == "-j" => Some(target.as_str()),
                _ => None,
            });
        for chain in used.chain(jumped) {
            if !BUILT_IN.contains(&chain) && !declared.contains(&chain) {
                declared.push(chain);
            }
        }
        let _ = writeln!(out, "* {table}");
        for chain in declared {
            let _ = writeln!(out, "-N {chain}");
        }
        for rule in in_table {
            let _ = writeln!(out, "{}", rule.words.join(" "));
        }
        out.push_str("COMMIT\n");
    }
    out
}
