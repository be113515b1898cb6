//! The kernel programs, built by `build.rs` and embedded in the agent binary.
use aya::{Ebpf, EbpfError, EbpfLoader};

/// The compiled object (ELF), 8-byte aligned as aya requires.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/meshcap"));

/// Errors loading the embedded object.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// Built with `AYA_BUILD_SKIP=1`: no programs inside.
    #[error(
        "this meshcap-agent was built without its eBPF programs (AYA_BUILD_SKIP=1); rebuild without it"
    )]
    NotEmbedded,
    /// The kernel or aya refused the object.
    #[error("loading the eBPF object: {0}")]
    Ebpf(#[from] EbpfError),
}

/// The embedded object's bytes.
#[must_use]
pub fn object() -> &'static [u8] {
    OBJECT
}

/// Parses the embedded object and creates its maps. Programs are loaded by the caller, one by
/// one, so that a refusal names the program.
///
/// # Errors
/// When the object is missing or the kernel refuses a map.
pub fn open() -> Result<Ebpf, ObjectError> {
    if OBJECT.is_empty() {
        return Err(ObjectError::NotEmbedded);
    }
    Ok(EbpfLoader::new().load(OBJECT)?)
}

/// A program the kernel refused, with the verifier's reason.
#[derive(Debug, thiserror::Error)]
#[error("the kernel refused program {name}: {source}")]
pub struct ProgramLoadError {
    /// The program's name in the object.
    pub name: String,
    /// aya's error, which carries the verifier log.
    #[source]
    pub source: aya::programs::ProgramError,
}

/// Loads every program of the object into the kernel (the verifier checks each) and returns
/// their names, in the object's order.
///
/// # Errors
/// The first program the kernel refuses, by name.
pub fn load_all(ebpf: &mut Ebpf) -> Result<Vec<String>, ProgramLoadError> {
    use aya::programs::Program;
    let mut names = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let loaded = match program {
            Program::CgroupSockAddr(p) => p.load(),
            Program::CgroupSockopt(p) => p.load(),
            Program::SockOps(p) => p.load(),
            Program::SchedClassifier(p) => p.load(),
            Program::CgroupSock(p) => p.load(),
            Program::CgroupSkb(p) => p.load(),
            Program::SkLookup(p) => p.load(),
            _ => Err(aya::programs::ProgramError::UnexpectedProgramType),
        };
        loaded.map_err(|source| ProgramLoadError {
            name: name.to_owned(),
            source,
        })?;
        names.push(name.to_owned());
    }
    Ok(names)
}
