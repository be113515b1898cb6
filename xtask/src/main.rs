//! meshcap's developer tasks: `cargo xtask <task>`.
use clap::{Parser, Subcommand};

mod integration;

#[derive(Parser)]
#[command(name = "xtask", about = "meshcap's developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run the end-to-end tests inside QEMU on Debian's 6.1 and 6.12 cloud kernels.
    Integration(integration::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Integration(args) => integration::run(&args),
    }
}
