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
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
