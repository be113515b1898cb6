//! What a 64-bit ELF file asks of the system that loads it: its machine, its interpreter (the
//! dynamic loader) and the shared libraries it names. Read from the file itself, so that
//! executables of another architecture (which `ldd` cannot run here) resolve as well.
use anyhow::Context as _;
use object::{
    LittleEndian,
    elf::{DT_NEEDED, FileHeader64},
    read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _},
};

/// The `e_machine` of a 64-bit little-endian ELF file; `None` for anything else.
pub fn machine(bytes: &[u8]) -> Option<u16> {
    let header = FileHeader64::<LittleEndian>::parse(bytes).ok()?;
    let endian = header.endian().ok()?;
    Some(header.e_machine.get(endian))
}

/// What loading an ELF file needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// `PT_INTERP`: the loader's absolute path (none for a static executable or a library).
    pub interpreter: Option<String>,
    /// `DT_NEEDED`: library names (`libc.so.6`), in the file's order.
    pub libraries: Vec<String>,
}

/// Reads [`Needs`] off `bytes`, a 64-bit little-endian ELF file.
pub fn needs(bytes: &[u8]) -> anyhow::Result<Needs> {
    let file = ElfFile64::<LittleEndian>::parse(bytes).context("not a 64-bit little-endian ELF")?;
    let endian = file.endian();
    let text = |raw: &[u8]| String::from_utf8_lossy(raw).into_owned();
    let mut needs = Needs::default();
    for header in file.elf_program_headers() {
        if let Some(path) = header.interpreter(endian, bytes)? {
            needs.interpreter = Some(text(path));
        }
    }
    let dynamic = file.elf_section_table().dynamic_table(endian, bytes)?;
    for entry in dynamic.iter() {
        if entry.tag == DT_NEEDED {
            needs.libraries.push(text(dynamic.string(entry)?));
        }
    }
    Ok(needs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_needs_glibc_and_its_loader() {
        let exe = std::fs::read(std::env::current_exe().expect("the test binary"))
            .expect("reading the test binary");
        let needs = needs(&exe).expect("an ELF");
        let loader = needs
            .interpreter
            .expect("a dynamic executable has a loader");
        assert!(
            loader.starts_with('/') && loader.contains("ld-linux"),
            "{loader}"
        );
        assert!(
            needs.libraries.iter().any(|l| l == "libc.so.6"),
            "{:?}",
            needs.libraries
        );
    }

    #[test]
    fn anything_else_is_refused() {
        assert_eq!(machine(b"#!/bin/sh\n"), None);
        assert!(needs(b"\x7fELF").is_err());
    }
}
