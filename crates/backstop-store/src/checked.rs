//! What this process has already checked byte for byte, so a rollback need not hash it again
//! (verify once and keep a record of it).
//!
//! A file's bytes were checked (hashed by a full verification, or hashed in memory by the builder
//! that wrote them) and found to match given digests; the record keeps those digests with the
//! file's identity as the kernel reports it right after (device, inode, length, mtime and ctime
//! to the nanosecond). Any write, truncation, chmod, rename over or replacement changes ctime or
//! the inode, so a file whose identity is unchanged still holds the bytes that were checked.
//! (The kernel stamps ctime from a clock that may be coarse: on kernels without fine-grained
//! timestamps a change within a few milliseconds of the recording can keep the same ctime. The
//! streaming re-check still catches it for chunks.)
//! The record lives in the daemon's memory only (its own trust root; it is gone with a restart,
//! after which the first rollback verifies in full again) and is never written anywhere.
//!
//! Who may use it: choosing a rollback target ([`crate::Store::verify_trusting_checked`]), and
//! a builder recording a disk chain whose lower layers it has seen before (every snapshot's
//! chain repeats the previous one's layers, base image included).
//! Chunks are still re-checked (crc32) as they stream into QEMU, so a chunk that changed on
//! the media without the kernel knowing aborts the load before the guest resumes. Drift
//! detection's routine pass ([`crate::Store::verify_routine`]) trusts a record only while it is
//! younger than the re-verification period, so every file is hashed again once per period. A
//! full [`crate::Store::verify`] (`snapshot verify`, retention) never trusts the record: it
//! hashes everything and refreshes the record.

use std::collections::HashMap;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Upper bound on remembered files (chunks of many snapshots); past it the record starts over.
const MAX_ENTRIES: usize = 1 << 20;

/// A file's identity as the kernel reports it; any change to the file changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Identity {
    fn of(meta: &Metadata) -> Identity {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    identity: Identity,
    digest: String,
    crc32: String,
    /// When its bytes were last hashed (or written from bytes hashed in memory).
    at: std::time::Instant,
}

/// Files whose bytes were checked against digests, by path.
#[derive(Debug, Default)]
pub(crate) struct CheckedFiles {
    files: Mutex<HashMap<PathBuf, Entry>>,
}

impl CheckedFiles {
    /// Records that `path`, as `meta` describes it now, holds bytes with these digests.
    pub(crate) fn record(&self, path: &Path, meta: &Metadata, digest: &str, crc32: &str) {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if files.len() >= MAX_ENTRIES {
            files.clear();
        }
        files.insert(
            path.to_path_buf(),
            Entry {
                identity: Identity::of(meta),
                digest: digest.to_string(),
                crc32: crc32.to_string(),
                at: std::time::Instant::now(),
            },
        );
    }

    /// Stats `path` and records it (for a file just written from bytes hashed in memory).
    pub(crate) fn record_path(&self, path: &Path, digest: &str, crc32: &str) {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.is_file() {
                self.record(path, &meta, digest, crc32);
            }
        }
    }

    /// Forgets `path` (it failed a check, or was removed).
    pub(crate) fn forget(&self, path: &Path) {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files.remove(path);
    }

    /// Whether `path`, as `meta` describes it now, is unchanged since it was checked against
    /// exactly these digests.
    #[cfg(test)]
    pub(crate) fn unchanged(
        &self,
        path: &Path,
        meta: &Metadata,
        digest: &str,
        crc32: &str,
    ) -> bool {
        self.unchanged_within(path, meta, digest, crc32, None)
    }

    /// [`Self::unchanged`], and hashed no longer than `within` ago (`None`: whenever).
    pub(crate) fn unchanged_within(
        &self,
        path: &Path,
        meta: &Metadata,
        digest: &str,
        crc32: &str,
        within: Option<std::time::Duration>,
    ) -> bool {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files.get(path).is_some_and(|e| {
            e.identity == Identity::of(meta)
                && e.digest == digest
                && e.crc32 == crc32
                && within.is_none_or(|w| e.at.elapsed() <= w)
        })
    }

    /// The digests `path` was checked against, if it is unchanged since (as `meta` describes
    /// it now): what a builder records for a layer it already knows instead of reading it again.
    pub(crate) fn digests_if_unchanged(
        &self,
        path: &Path,
        meta: &Metadata,
    ) -> Option<(String, String)> {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files
            .get(path)
            .filter(|e| e.identity == Identity::of(meta))
            .map(|e| (e.digest.clone(), e.crc32.clone()))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.files.lock().map(|f| f.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn meta(p: &Path) -> Metadata {
        std::fs::metadata(p).unwrap()
    }

    #[test]
    fn a_recorded_file_is_unchanged_until_it_is_touched_in_any_way() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello").unwrap();
        let c = CheckedFiles::default();
        assert!(
            !c.unchanged(&p, &meta(&p), "s", "c"),
            "nothing recorded yet"
        );
        c.record(&p, &meta(&p), "s", "c");
        assert!(c.unchanged(&p, &meta(&p), "s", "c"));
        // Other digests than the ones checked: not vouched for.
        assert!(!c.unchanged(&p, &meta(&p), "s2", "c"));
        assert!(!c.unchanged(&p, &meta(&p), "s", "c2"));
        // Same length, different bytes: ctime (and mtime) move.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .write_all(b"jello")
            .unwrap();
        assert!(!c.unchanged(&p, &meta(&p), "s", "c"), "rewritten in place");
        // A chmod alone moves ctime too.
        c.record(&p, &meta(&p), "s", "c");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut perm = meta(&p).permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o400);
        std::fs::set_permissions(&p, perm).unwrap();
        assert!(!c.unchanged(&p, &meta(&p), "s", "c"), "chmod");
        // Replaced by another file under the same name: another inode.
        c.record(&p, &meta(&p), "s", "c");
        let q = dir.path().join("g");
        std::fs::write(&q, b"jello").unwrap();
        std::fs::rename(&q, &p).unwrap();
        assert!(!c.unchanged(&p, &meta(&p), "s", "c"), "replaced");
        c.forget(&p);
        assert_eq!(c.len(), 0);
    }
}
