//! The standard `process_*` metrics, read from `/proc/self` at each scrape, as the Prometheus
//! Go client's process collector (`prometheus/client_golang`, `process_collector_procfsenabled.go`)
//! does for Istio's node agent (its default registry, `pkg/monitoring/monitoring.go` in
//! istio/istio): CPU seconds, resident and virtual memory, open and maximum descriptors, start
//! time. A value that cannot be read is left out of the scrape, as the Go client does.
use std::fs;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

/// The collector; registered once, read at every scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// What `/proc/self` says now.
#[derive(Debug, Default, PartialEq)]
pub struct Sample {
    /// User and system CPU time, seconds.
    pub cpu_seconds: Option<f64>,
    /// Resident set size, bytes.
    pub resident_bytes: Option<f64>,
    /// Virtual memory size, bytes.
    pub virtual_bytes: Option<f64>,
    /// Seconds since the epoch at which the process started.
    pub start_time_seconds: Option<f64>,
    /// Open file descriptors.
    pub open_fds: Option<f64>,
    /// The soft limit on open file descriptors.
    pub max_fds: Option<f64>,
    /// The soft limit on the address space, bytes (`unlimited`: 2^64 - 1, as the Go client).
    pub virtual_max_bytes: Option<f64>,
}

impl Sample {
    /// Reads this process's numbers.
    #[must_use]
    pub fn read() -> Self {
        let stat = fs::read_to_string("/proc/self/stat").ok();
        let fields = stat.as_deref().map(stat_fields).unwrap_or_default();
        // Fields after the command (`comm`, which may hold spaces), numbered as proc(5) does.
        let field = |n: usize| -> Option<f64> { fields.get(n.checked_sub(3)?)?.parse().ok() };
        let ticks = clock_ticks();
        let page = page_size();
        let limits = fs::read_to_string("/proc/self/limits").ok();
        let limit = |name: &str| limits.as_deref().and_then(|l| soft_limit(l, name));
        Self {
            cpu_seconds: field(14)
                .zip(field(15))
                .zip(ticks)
                .map(|((user, system), ticks)| (user + system) / ticks),
            resident_bytes: field(24).zip(page).map(|(pages, page)| pages * page),
            virtual_bytes: field(23),
            start_time_seconds: field(22)
                .zip(ticks)
                .zip(boot_time())
                .map(|((start, ticks), boot)| boot + start / ticks),
            open_fds: fs::read_dir("/proc/self/fd")
                .ok()
                .map(|dir| dir.count() as f64),
            max_fds: limit("Max open files"),
            virtual_max_bytes: limit("Max address space"),
        }
    }
}

/// The fields of `/proc/self/stat` after `(comm)`, the process's state first.
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default()
}

/// The soft limit named `name` in `/proc/self/limits`.
fn soft_limit(limits: &str, name: &str) -> Option<f64> {
    let rest = limits.lines().find_map(|l| l.strip_prefix(name))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX as f64),
        value => value.parse().ok(),
    }
}

/// The boot time, seconds since the epoch (`btime` of `/proc/stat`).
fn boot_time() -> Option<f64> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

fn clock_ticks() -> Option<f64> {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    (ticks > 0).then_some(ticks as f64)
}

fn page_size() -> Option<f64> {
    let size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok()??;
    (size > 0).then_some(size as f64)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: Option<f64>,
) -> std::fmt::Result {
    let Some(value) = value else { return Ok(()) };
    let gauge = ConstGauge::new(value);
    gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let now = Sample::read();
        if let Some(seconds) = now.cpu_seconds {
            let counter = ConstCounter::new(seconds);
            counter.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                counter.metric_type(),
            )?)?;
        }
        let e = &mut encoder;
        gauge(
            e,
            "process_open_fds",
            "Number of open file descriptors.",
            now.open_fds,
        )?;
        gauge(
            e,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            now.max_fds,
        )?;
        gauge(
            e,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            now.virtual_bytes,
        )?;
        gauge(
            e,
            "process_virtual_memory_max_bytes",
            "Maximum amount of virtual memory available in bytes.",
            now.virtual_max_bytes,
        )?;
        gauge(
            e,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            now.resident_bytes,
        )?;
        gauge(
            e,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            now.start_time_seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test process's own numbers, each checked against what the kernel says another way.
    #[test]
    fn reads_this_process() {
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs_f64();
        let held = fs::File::open("/proc/self/stat").expect("a descriptor");
        let sample = Sample::read();
        let start = sample.start_time_seconds.expect("start time");
        assert!(
            start <= before + 1.0 && start > before - 24.0 * 3600.0,
            "{start} vs {before}"
        );
        assert!(sample.cpu_seconds.expect("cpu") >= 0.0);
        assert!(sample.resident_bytes.expect("rss") > 0.0);
        assert!(sample.virtual_bytes.expect("vsize") >= sample.resident_bytes.expect("rss"));
        let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .expect("getrlimit");
        assert_eq!(sample.max_fds, Some(soft as f64));
        assert!(sample.open_fds.expect("open fds") >= 1.0);
        drop(held);
    }

    #[test]
    fn a_command_with_spaces_and_parentheses_does_not_shift_the_fields() {
        let fields = stat_fields("42 (a b) c)) S 1 2 3");
        assert_eq!(fields, ["S", "1", "2", "3"]);
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n\
                      Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1024.0));
        assert_eq!(
            soft_limit(limits, "Max address space"),
            Some(u64::MAX as f64)
        );
    }
}
