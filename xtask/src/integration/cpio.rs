//! A newc ("070701") cpio archive, the format the kernel unpacks as an initramfs.
use std::{collections::BTreeSet, path::Path};

/// An archive being built in memory. Parent directories are added on demand, before anything
/// inside them, as the kernel's unpacker needs.
#[derive(Default)]
pub struct Archive {
    bytes: Vec<u8>,
    dirs: BTreeSet<String>,
    next_ino: u32,
    rdev: (u32, u32),
}

const DIR: u32 = 0o040_000;
const FILE: u32 = 0o100_000;
const SYMLINK: u32 = 0o120_000;
const CHAR_DEVICE: u32 = 0o020_000;

impl Archive {
    /// A directory (and its parents), mode 0755.
    pub fn dir(&mut self, path: &str) {
        let path = path.trim_matches('/');
        if path.is_empty() || self.dirs.contains(path) {
            return;
        }
        if let Some(parent) = Path::new(path).parent().and_then(Path::to_str) {
            self.dir(parent);
        }
        self.dirs.insert(path.to_owned());
        self.entry(path, DIR | 0o755, &[]);
    }

    /// A regular file with `mode` (permission bits).
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        let path = path.trim_matches('/');
        self.parent(path);
        self.entry(path, FILE | (mode & 0o7777), data);
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) {
        let path = path.trim_matches('/');
        self.parent(path);
        self.entry(path, SYMLINK | 0o777, target.as_bytes());
    }

    /// A character device node: `/dev/console` must exist before init runs, or init starts
    /// with no stdin, stdout or stderr.
    pub fn char_device(&mut self, path: &str, major: u32, minor: u32) {
        let path = path.trim_matches('/');
        self.parent(path);
        self.rdev = (major, minor);
        self.entry(path, CHAR_DEVICE | 0o600, &[]);
        self.rdev = (0, 0);
    }

    fn parent(&mut self, path: &str) {
        if let Some(parent) = Path::new(path).parent().and_then(Path::to_str) {
            self.dir(parent);
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.next_ino += 1;
        let name_size = u32::try_from(name.len() + 1).unwrap_or(u32::MAX);
        let file_size = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let nlink = if mode & DIR == DIR { 2 } else { 1 };
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            file_size,
            0, // devmajor
            0, // devminor
            self.rdev.0,
            self.rdev.1,
            name_size,
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    /// The archive's bytes, with the trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout() {
        let mut archive = Archive::default();
        archive.file("bin/init", 0o755, b"hello");
        let bytes = archive.finish();
        // "bin" (dir), "bin/init", trailer; every header at a 4-byte boundary.
        let text = String::from_utf8_lossy(&bytes);
        assert_eq!(text.matches("070701").count(), 3);
        assert!(bytes.starts_with(b"070701"));
        let init = text.find("bin/init").expect("file entry");
        let header = &text[init - 110..init];
        assert!(header.starts_with("070701"));
        // mode 0100755, size 5, name size 9.
        assert_eq!(&header[14..22], "000081ed");
        assert_eq!(&header[54..62], "00000005");
        assert_eq!(&header[94..102], "00000009");
        assert_eq!((init - 110) % 4, 0);
        assert!(text.contains("hello"));
        assert!(text.ends_with('\0'));
        assert_eq!(bytes.len() % 4, 0);
    }
}
