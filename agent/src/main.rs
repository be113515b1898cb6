//! `meshcap-agent`: the node daemon. Subcommands are the agent's user interface.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use meshcap_agent::{bpf, logging};

#[derive(Parser)]
#[command(name = "meshcap-agent", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t, global = true)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load every embedded kernel program (the verifier checks each) and report.
    Verify,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = logging::init(cli.log_format, "info") {
        eprintln!("meshcap-agent: {err:#}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Verify => verify(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

fn verify() -> anyhow::Result<()> {
    let mut ebpf = bpf::open()?;
    for name in bpf::load_all(&mut ebpf)? {
        println!("verified {name}");
    }
    Ok(())
}
