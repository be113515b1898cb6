//! The node's CNI conf dir: its files read, and written atomically. What they hold and how
//! meshcap's entry goes into them is the plugin crate's ([`meshcap_cni::cni::conflist`], pure),
//! re-exported here.
use std::{
    fs, io,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

pub use meshcap_cni::cni::conflist::{
    ConfFile, ISTIO_PLUGIN_TYPE, has_cni_extension, invalid_reason, is_istio_entry,
    is_meshcap_entry, list_name, primary, render, with_entry, without_entry,
};
use serde_json::Value;

use super::InstallError;

/// The CNI files of `dir` (by extension, valid or not), sorted by name as libcni sorts them.
///
/// # Errors
/// When the directory cannot be listed or a file cannot be read. A missing directory is empty.
pub fn read_dir(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, InstallError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(InstallError::io("listing", dir, source)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| InstallError::io("listing", dir, source))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let path = entry.path();
        if !has_cni_extension(&name) || !path.is_file() {
            continue;
        }
        match fs::read(&path) {
            Ok(bytes) => files.push((name, bytes)),
            // Deleted between listing and reading: the runtime would not see it either.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(InstallError::io("reading", &path, source)),
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// meshcap's standalone configuration (`chained: false`, for Multus and the like): a
/// single-plugin config of its own, under Istio's network name
/// ([`super::STANDALONE_NETWORK_NAME`]).
#[must_use]
pub fn standalone(entry: &Value, cni_version: &str) -> Value {
    let mut conf = entry.as_object().cloned().unwrap_or_default();
    conf.insert("cniVersion".to_owned(), cni_version.into());
    conf.insert("name".to_owned(), super::STANDALONE_NETWORK_NAME.into());
    Value::Object(conf)
}

/// Writes `bytes` to `path` atomically: a hidden temporary file in the same directory (an
/// extension libcni ignores), created with `mode` (never readable by more than `mode` allows,
/// not even while it is written: the kubeconfig holds a token), synced, then renamed over
/// `path`. The runtime sees either the old file or the new one, never a partial write.
///
/// # Errors
/// When any step fails; the temporary file is removed then.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    use std::{io::Write as _, os::unix::fs::OpenOptionsExt as _};

    let tmp = temporary_path(path);
    let result = (|| {
        // A temporary file left by a crash of an agent with this pid goes first, so that the
        // new one is created with `mode`.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(bytes)?;
        // The umask may have taken bits `mode` asks for (0640 under umask 077).
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    result.map_err(|source| {
        let _ = fs::remove_file(&tmp);
        InstallError::io("writing", path, source)
    })
}

/// `<dir>/.<name>.meshcap-tmp.<pid>`: hidden, and with an extension no CNI loader reads.
fn temporary_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("meshcap");
    path.with_file_name(format!(
        ".{name}{}{}",
        super::TMP_MARKER,
        std::process::id()
    ))
}
