//! Capture backends: the eBPF data path ([`ebpf`]) and Istio's iptables rules.

pub mod ebpf;
