//! Binaries in the CNI bin dir (the plugin, and the agent the plugin asks for a decision when
//! the agent is down): copied atomically, so the runtime never executes a half-written file,
//! and left alone when they are already the same.
use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use super::{InstallError, TMP_MARKER};

/// Size and modification time of each copy this process wrote or found identical.
type Stamp = (u64, Option<std::time::SystemTime>);
static VERIFIED: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<PathBuf, Stamp>>> =
    std::sync::LazyLock::new(Default::default);

/// Whether the copy in the bin dir was written or already identical.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copied {
    /// A new binary was written.
    Written,
    /// The bin dir already held the same bytes.
    Unchanged,
}

/// Copies `source` to `<bin_dir>/<name>` (mode 0755) through a temporary file and a rename,
/// after removing temporary files that an interrupted copy of it left behind.
///
/// # Errors
/// When the source cannot be read or the bin dir cannot be written.
pub fn install(source: &Path, bin_dir: &Path, name: &str) -> Result<Copied, InstallError> {
    let target = bin_dir.join(name);
    // Checked on every change in the CNI dirs and every resync: once this process has seen the
    // copy right, its size and mtime say it still is, without reading both binaries again.
    let stamp = |path: &Path| {
        fs::metadata(path)
            .ok()
            .map(|m| (m.len(), m.modified().ok()))
    };
    let verified = VERIFIED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&target)
        .copied();
    if verified.is_some() && verified == stamp(&target) {
        return Ok(Copied::Unchanged);
    }
    remove_stale_temporaries(bin_dir, name)?;
    let bytes = fs::read(source).map_err(|e| InstallError::io("reading", source, e))?;
    let remember = |target: &Path| {
        if let Some(now) = stamp(target) {
            VERIFIED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(target.to_owned(), now);
        }
    };
    if fs::read(&target).is_ok_and(|old| old == bytes) {
        remember(&target);
        return Ok(Copied::Unchanged);
    }
    fs::create_dir_all(bin_dir).map_err(|e| InstallError::io("creating", bin_dir, e))?;
    let tmp = bin_dir.join(format!(".{name}{TMP_MARKER}{}", std::process::id()));
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
    remember(&target);
    Ok(Copied::Written)
}

/// Removes `<bin_dir>/<name>` (a real uninstall only).
///
/// # Errors
/// When it exists and cannot be removed.
pub fn remove(bin_dir: &Path, name: &str) -> Result<(), InstallError> {
    let target = bin_dir.join(name);
    match fs::remove_file(&target) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(InstallError::io("removing", &target, e))
        }
        _ => Ok(()),
    }
}

/// Removes `.<name>.meshcap-tmp.*` files: what a copy killed halfway leaves.
fn remove_stale_temporaries(bin_dir: &Path, name: &str) -> Result<(), InstallError> {
    let prefix = format!(".{name}{TMP_MARKER}");
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
                    tracing::info!(path = %path.display(), "removed a stale temporary copy")
                }
            }
        }
    }
    Ok(())
}
