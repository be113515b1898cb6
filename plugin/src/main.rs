//! `meshcap-cni`, run by the container runtime with `CNI_COMMAND` and friends in the
//! environment and the network configuration on stdin.
use std::{
    io::{Read as _, Write as _},
    process::ExitCode,
};

use meshcap_cni::{
    cni::{CniError, LATEST_VERSION, code},
    plugin,
};

/// Configurations are small; a bound keeps a broken runtime from feeding us forever.
const MAX_STDIN: u64 = 4 * 1024 * 1024;

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    let read = std::io::stdin().take(MAX_STDIN + 1).read_to_end(&mut stdin);
    let output = match read {
        Ok(n) if n as u64 > MAX_STDIN => plugin::Output {
            stdout: Some(
                CniError::new(
                    code::DECODE,
                    format!("the network configuration on stdin is larger than {MAX_STDIN} bytes"),
                )
                .to_json(LATEST_VERSION),
            ),
            success: false,
        },
        Ok(_) => plugin::run(|k| std::env::var(k).ok(), &stdin, &mut std::io::stderr()),
        Err(err) => plugin::Output {
            stdout: Some(
                CniError::new(code::IO, format!("reading stdin: {err}")).to_json(LATEST_VERSION),
            ),
            success: false,
        },
    };
    if let Some(json) = output.stdout {
        let mut stdout = std::io::stdout().lock();
        // Nothing better to do when stdout is gone: the exit status still tells.
        let _ = writeln!(stdout, "{json}");
    }
    if output.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
