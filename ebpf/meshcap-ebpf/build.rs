//! Rebuild the programs when the linker changes: aya-build cannot see it otherwise.
use which::which;

fn main() {
    if let Ok(linker) = which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
