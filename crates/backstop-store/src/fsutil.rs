//! Small file-system helpers: private directories, durable writes, capped reads, hashing.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::StoreError;

/// Creates `path` (and missing parents) with mode 0700, and tightens it to 0700 if it existed.
pub(crate) fn create_private_dir(path: &Path) -> Result<(), StoreError> {
    let err = |source| StoreError::CreateDir {
        path: path.into(),
        source,
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(err)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o700)).map_err(err)
}

/// Creates one directory level with mode 0700. Returns whether it was created now.
pub(crate) fn create_private_subdir(path: &Path) -> Result<bool, StoreError> {
    match DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(source) => Err(StoreError::CreateDir {
            path: path.into(),
            source,
        }),
    }
}

/// `FS_TOPDIR_FL` (linux/fs.h): "top of directory hierarchies" for ext2/3/4's Orlov allocator.
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// Asks the file system to place each new subdirectory of `path` (and so the files created in
/// it) in a block group of its own, as it does for top-level directories: `chattr +T`.
///
/// Why: ext4 without a journal skips inodes freed in the last ~30 s when it allocates one
/// (`recently_deleted`), scanning the parent directory's group from its start for each new file;
/// after a prune or a swept build freed thousands of chunk inodes there, each of the thousands
/// of chunk files a build creates next pays for a walk over all of them (measured: 8,000 chunk
/// files went from ~1 s to ~11 s). A build directory in a group of its own does not meet them.
/// Only a placement hint: it changes no byte, name or durability step, and where the file system
/// does not know the flag (or refuses it) nothing changes. Returns whether the flag is set.
pub(crate) fn spread_subdirs(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(dir) = File::open(path) else {
        return false;
    };
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int through the pointer, which points at `flags`
    // (alive for the call); `dir` keeps the descriptor open for the call.
    if unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return false;
    }
    if flags & FS_TOPDIR_FL != 0 {
        return true;
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one int through the pointer, which points at `flags`
    // (alive for the call); `dir` keeps the descriptor open for the call.
    unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) == 0 }
}

/// fsyncs a directory so that the entries created or renamed in it are durable.
pub(crate) fn fsync_dir(path: &Path) -> Result<(), StoreError> {
    backstop_common::durable::fsync_dir(path).map_err(|source| StoreError::Fsync {
        path: path.into(),
        source,
    })
}

/// Writes a new file (mode 0600, must not exist yet) and fsyncs it.
pub(crate) fn write_new_synced(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| StoreError::Write {
            path: path.into(),
            source,
        })?;
    file.write_all(bytes).map_err(|source| StoreError::Write {
        path: path.into(),
        source,
    })?;
    file.sync_all().map_err(|source| StoreError::Fsync {
        path: path.into(),
        source,
    })
}

/// `n` random bytes as lower-case hex, for temporary names.
pub(crate) fn random_hex(n: usize) -> Result<String, StoreError> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| StoreError::Random(e.to_string()))?;
    Ok(hex::encode(bytes))
}

/// The outcome of a capped read.
pub(crate) enum Capped {
    Bytes(Vec<u8>),
    TooLarge,
}

/// Reads at most `cap` bytes of the file at `path`; a longer file is [`Capped::TooLarge`]
/// (only `cap + 1` bytes are ever read).
pub(crate) fn read_capped(path: &Path, cap: u64) -> io::Result<Capped> {
    let file = File::open(path)?;
    read_capped_from(file, cap)
}

pub(crate) fn read_capped_from(file: File, cap: u64) -> io::Result<Capped> {
    let mut buf = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut buf)?;
    if buf.len() as u64 > cap {
        Ok(Capped::TooLarge)
    } else {
        Ok(Capped::Bytes(buf))
    }
}

/// Digests of a byte stream: lower-case hex sha256, crc32 as 8 lower-case hex digits, length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Digests {
    pub sha256: String,
    pub crc32: String,
    pub len: u64,
}

pub(crate) fn crc32_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

pub(crate) fn digests_of(bytes: &[u8]) -> Digests {
    Digests {
        sha256: backstop_integrity::sha256_hex(bytes),
        crc32: crc32_hex(bytes),
        len: bytes.len() as u64,
    }
}

/// Streams `reader` to EOF computing its digests.
/// `keepalive` is called after every MiB read: hashing a disk layer of tens of GiB is long work
/// whose caller must still look alive (see [`crate::Keepalive`]).
/// A reader that fails (`Interrupted` is not used: it would be retried) once `stopped` says so.
pub(crate) struct Stoppable<'a, R: Read> {
    pub inner: R,
    pub stopped: &'a dyn Fn() -> bool,
}

impl<R: Read> Read for Stoppable<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if (self.stopped)() {
            return Err(io::Error::other("stopped: a rollback is waiting"));
        }
        self.inner.read(buf)
    }
}

pub(crate) fn digests_of_reader(
    reader: &mut dyn Read,
    keepalive: &dyn Fn(),
) -> io::Result<Digests> {
    let mut sha = Sha256::new();
    let mut crc = crc32fast::Hasher::new();
    let mut len = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let data = &buf[..n];
        sha.update(data);
        crc.update(data);
        len += n as u64;
        keepalive();
    }
    Ok(Digests {
        sha256: hex::encode(sha.finalize()),
        crc32: format!("{:08x}", crc.finalize()),
        len,
    })
}

/// `s` is exactly `len` lower-case hex digits.
pub(crate) fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && backstop_integrity::is_lower_hex(s)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn flags(path: &Path) -> Option<libc::c_int> {
        let dir = File::open(path).unwrap();
        let mut flags: libc::c_int = 0;
        // SAFETY: FS_IOC_GETFLAGS writes one int through the pointer, which points at `flags`;
        // `dir` keeps the descriptor open for the call.
        let rc = unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
        (rc == 0).then_some(flags)
    }

    /// Where the file system takes the hint, the flag is set (once: a second call changes
    /// nothing) and no other flag moves; where it does not, nothing changes and it says so.
    #[test]
    fn spread_subdirs_sets_the_top_directory_flag_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let before = flags(dir.path());
        let set = spread_subdirs(dir.path());
        let after = flags(dir.path());
        if set {
            let (before, after) = (before.unwrap(), after.unwrap());
            assert_eq!(after, before | FS_TOPDIR_FL);
            assert!(spread_subdirs(dir.path()));
            assert_eq!(flags(dir.path()), Some(after));
        } else {
            eprintln!("this file system does not take FS_TOPDIR_FL: nothing to check");
            assert_eq!(after, before);
        }
        assert!(!spread_subdirs(&dir.path().join("absent")));
    }
}
