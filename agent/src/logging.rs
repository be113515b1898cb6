//! Logging: `tracing` everywhere. `try_init` also installs tracing-subscriber's `log` bridge, so
//! `log` records (aya, aya-log's kernel-side messages) reach the same subscriber.
use std::io::IsTerminal as _;

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Output format of the agent's logs.
#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
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
                fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init()?,
        LogFormat::Json => registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init()?,
    }
    Ok(())
}
