//! The plugin binary in the CNI bin dir: copied atomically, so the runtime never executes a
//! half-written file, and left alone when it is already the same.
use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::Path,
};

use super::{InstallError, PLUGIN_BINARY, TMP_MARKER};

/// Whether the copy in the bin dir was written or already identical.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copied {
    /// A new binary was written.
    Written,
    /// The bin dir already held the same bytes.
    Unchanged,
}

/// Copies `source` to `<bin_dir>/meshcap-cni` (mode 0755) through a temporary file and a
/// rename, after removing temporary files that an interrupted copy left behind.
///
/// # Errors
/// When the source cannot be read or the bin dir cannot be written.
pub fn install(source: &Path, bin_dir: &Path) -> Result<Copied, InstallError> {
    remove_stale_temporaries(bin_dir)?;
    let bytes = fs::read(source).map_err(|e| InstallError::io("reading", source, e))?;
    let target = bin_dir.join(PLUGIN_BINARY);
    if fs::read(&target).is_ok_and(|old| old == bytes) {
        return Ok(Copied::Unchanged);
    }
    fs::create_dir_all(bin_dir).map_err(|e| InstallError::io("creating", bin_dir, e))?;
    let tmp = bin_dir.join(format!(
        ".{PLUGIN_BINARY}{TMP_MARKER}{}",
        std::process::id()
    ));
    let result = (|| {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.set_permissions(fs::Permissions::from_mode(0o755))?;
        file.sync_all()?;
        fs::rename(&tmp, &target)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        InstallError::io("writing", &target, e)
    })?;
    Ok(Copied::Written)
}

/// Removes the plugin binary (a real uninstall only).
///
/// # Errors
/// When it exists and cannot be removed.
pub fn remove(bin_dir: &Path) -> Result<(), InstallError> {
    let target = bin_dir.join(PLUGIN_BINARY);
    match fs::remove_file(&target) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(InstallError::io("removing", &target, e))
        }
        _ => Ok(()),
    }
}

/// Removes `.meshcap-cni.meshcap-tmp.*` files: what a copy killed halfway leaves.
fn remove_stale_temporaries(bin_dir: &Path) -> Result<(), InstallError> {
    let prefix = format!(".{PLUGIN_BINARY}{TMP_MARKER}");
    let entries = match fs::read_dir(bin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(InstallError::io("listing", bin_dir, e)),
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let path = entry.path();
            match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(InstallError::io("removing", &path, e));
                }
                _ => {
                    tracing::info!(path = %path.display(), "removed a stale temporary plugin copy")
                }
            }
        }
    }
    Ok(())
}
