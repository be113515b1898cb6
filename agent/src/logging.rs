//! Logging: `tracing` everywhere. `try_init` also installs tracing-subscriber's `log` bridge, so
//! `log` records (aya, aya-log's kernel-side messages) reach the same subscriber.
//!
//! As JSON (`--log_as_json`, Istio's `global.logAsJson`), each line is what Istio's logger writes
//! (`pkg/log/config.go` in istio/istio: zap's JSON encoder with keys `level`, `time`, `scope`,
//! `msg`; lowercase levels; the time in UTC with microseconds, `2006-01-02T15:04:05.000000Z`),
//! then the event's fields and its spans' (`pod`, ...), as Istio's `WithLabels` adds its labels.
//! The scope is Istio's: `cni-plugin` for the plugin's messages ([`PLUGIN_TARGET`]; their own
//! `time` kept, as Istio's agent keeps its plugin's), `cni-agent` for everything else.
use std::{
    fmt::{self, Write as _},
    io::IsTerminal as _,
};

use serde_json::{Map, Value};
use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
};
use tracing_subscriber::{
    EnvFilter,
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{JsonFields, Writer},
        time::{FormatTime as _, SystemTime},
    },
    prelude::*,
    registry::LookupSpan,
};

/// The target of the plugin's messages, which the agent logs for it: Istio's `cni-plugin`
/// scope.
pub const PLUGIN_TARGET: &str = "meshcap_cni";

/// Output format of the agent's logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line with Istio's keys, for log collectors.
    Json,
}

/// Installs the global subscriber. `default_level` applies unless `RUST_LOG` says otherwise.
///
/// # Errors
/// When a subscriber or the `log` bridge is already installed.
pub fn init(format: LogFormat, default_level: &str) -> anyhow::Result<()> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        // Colours only for a terminal: a log file or a container's log stream gets plain text.
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init()?,
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(JsonFields::new())
                    .event_format(IstioJson)
                    .with_writer(std::io::stderr),
            )
            .try_init()?,
    }
    Ok(())
}

/// Istio's JSON lines.
struct IstioJson;

impl<S, N> FormatEvent<S, N> for IstioJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Map::new();
        // Outermost span first, so that an inner span's field and the event's own win.
        for span in ctx.event_scope().into_iter().flat_map(|s| s.from_root()) {
            if let Some(formatted) = span.extensions().get::<FormattedFields<N>>()
                && let Ok(Value::Object(span_fields)) = serde_json::from_str(&formatted.fields)
            {
                fields.extend(span_fields);
            }
        }
        let mut own = JsonVisitor(Map::new());
        event.record(&mut own);
        fields.extend(own.0);
        let meta = event.metadata();
        let plugin = meta.target().starts_with(PLUGIN_TARGET);
        let time = match fields.remove("time") {
            Some(Value::String(time)) if plugin => time,
            _ => {
                let mut now = String::new();
                SystemTime.format_time(&mut Writer::new(&mut now))?;
                now
            }
        };
        let msg = match fields.remove("message") {
            Some(Value::String(msg)) => msg,
            Some(other) => other.to_string(),
            None => String::new(),
        };
        let line = istio_line(
            level_name(*meta.level()),
            &time,
            if plugin { "cni-plugin" } else { "cni-agent" },
            &msg,
            fields,
        );
        writeln!(writer, "{line}")
    }
}

/// `unix_micros` (microseconds since the epoch) as Istio's logger writes a time: UTC,
/// `2006-01-02T15:04:05.000000Z` (`formatDate`, `pkg/log/config.go`).
#[must_use]
pub fn utc_time(unix_micros: u64) -> String {
    let (secs, micros) = (unix_micros / 1_000_000, unix_micros % 1_000_000);
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = i64::try_from(days).unwrap_or(i64::MAX / 2) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Istio's level names (zap's `LowercaseLevelEncoder`; Istio has no trace level).
fn level_name(level: tracing::Level) -> &'static str {
    match level {
        tracing::Level::ERROR => "error",
        tracing::Level::WARN => "warn",
        tracing::Level::INFO => "info",
        tracing::Level::DEBUG | tracing::Level::TRACE => "debug",
    }
}

/// One line in zap's key order: `level`, `time`, `scope`, `msg`, then the fields.
fn istio_line(
    level: &str,
    time: &str,
    scope: &str,
    msg: &str,
    fields: Map<String, Value>,
) -> String {
    let mut line = format!(
        "{{\"level\":{},\"time\":{},\"scope\":{},\"msg\":{}",
        Value::from(level),
        Value::from(time),
        Value::from(scope),
        Value::from(msg)
    );
    for (key, value) in fields {
        if !matches!(key.as_str(), "level" | "time" | "scope" | "msg") {
            let _ = write!(line, ",{}:{value}", Value::from(key));
        }
    }
    line.push('}');
    line
}

/// An event's fields as JSON values.
struct JsonVisitor(Map<String, Value>);

impl Visit for JsonVisitor {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::from(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_has_istios_keys_in_zaps_order() {
        let mut fields = Map::new();
        fields.insert("pod".into(), Value::from("shop/web"));
        fields.insert("msg".into(), Value::from("not a second msg"));
        let line = istio_line(
            "info",
            "2026-11-28T06:22:01.123456Z",
            "cni-agent",
            "a \"quoted\" word",
            fields,
        );
        assert_eq!(
            line,
            r#"{"level":"info","time":"2026-11-28T06:22:01.123456Z","scope":"cni-agent","msg":"a \"quoted\" word","pod":"shop/web"}"#
        );
        assert_eq!(level_name(tracing::Level::TRACE), "debug");
        assert_eq!(utc_time(0), "1970-01-01T00:00:00.000000Z");
        // 2024-02-29T23:59:59.123456Z, a leap day.
        assert_eq!(
            utc_time(1_709_251_199_123_456),
            "2024-02-29T23:59:59.123456Z"
        );
        assert_eq!(
            utc_time(1_795_850_521_000_007),
            "2026-11-28T07:22:01.000007Z"
        );
        assert_eq!(level_name(tracing::Level::WARN), "warn");
    }
}
