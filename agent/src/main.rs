//! `meshcap-agent`: the node daemon. Subcommands are the agent's user interface.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use meshcap_agent::{bpf, install, logging, settings};

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
    /// Remove meshcap's plugin entry and binary from this node's CNI set-up (a real uninstall:
    /// restarts and upgrades never do this). Reads the same MESHCAP_* settings as `run`.
    Uninstall,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = logging::init(cli.log_format, "info") {
        eprintln!("meshcap-agent: {err:#}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Verify => verify(),
        Command::Uninstall => uninstall(),
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

fn uninstall() -> anyhow::Result<()> {
    let config = settings::install_config(
        |name| std::env::var(name).ok(),
        settings::PLUGIN_SOURCE.into(),
    )?;
    install::uninstall(&config)?;
    println!(
        "removed meshcap-cni from {} and {}",
        config.cni_conf_dir.display(),
        config.cni_bin_dir.display()
    );
    Ok(())
}
