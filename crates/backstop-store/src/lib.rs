//! The snapshot store: content-addressed, checksummed chunks shared by all snapshots, one signed
//! manifest per snapshot, atomic publication by a single directory rename, and verification
//! before anything is trusted (a rollback's may skip files this process already checked and
//! that are unchanged since: `checked.rs`). It knows nothing of hypervisors: a snapshot is a set of named
//! payloads (a chunked RAM/device stream, disk layer chains living outside the store) plus the
//! caller's metadata.
//!
//! It must never modify a published snapshot (a published directory is only ever read, and chunk
//! files are immutable once renamed into place), and never trust bytes before checking them: a
//! manifest is not decoded before its HMAC matches, an index is not parsed before its checksums
//! match the signed manifest, and every chunk is checked again as it is streamed out.
//!
//! Layout under the root (directories 0700, files 0600):
//!
//! ```text
//! chunks/<first 2 hex>/<digest hex>               chunk files, shared by all snapshots (sha256 or BLAKE3)
//! tmp/<random>/                                   snapshots being built; swept at open
//! snapshots/<snapshot_id>/manifest.json           canonical JSON
//! snapshots/<snapshot_id>/manifest.sig            HMAC-SHA256 of manifest.json, hex + "\n"
//! snapshots/<snapshot_id>/<payload>.index         chunk index of each chunked payload
//! ```
//!
//! One process owns a store at a time: [`Store::open`] sweeps `tmp/` and collects unreferenced
//! chunks, which would break a build running in another process.

mod builder;
mod checked;
mod error;
mod fsutil;
mod index;
mod manifest;
pub mod prune;
mod reader;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use backstop_integrity::HostKey;

pub use crate::builder::SnapshotBuilder;
pub use crate::error::{codes, StoreError};
use crate::fsutil::{
    create_private_dir, digests_of, digests_of_reader, fsync_dir, random_hex, read_capped,
    read_capped_from, Capped,
};
pub use crate::index::{
    ChunkHash, ChunkIndex, ChunkRef, CHUNK_AVG_BYTES, CHUNK_MAX_BYTES, CHUNK_MIN_BYTES,
};
use crate::manifest::parse_created_at;
pub use crate::manifest::{
    check_signature, decode_manifest, is_snapshot_id, parse_version, Checksum, DiskLayer, Lineage,
    Manifest, ManifestInput, PayloadRef, VerifyOptions, DISK_PAYLOAD_PREFIX, INDEX_VERSION,
    KIND_DISK_LAYER_CHAIN, KIND_RAM_DEVICE, MANIFEST_MAX_BYTES, SCHEMA_VERSION, SCOPE_FULL,
    SUPPORTED_INDEX, SUPPORTED_SCHEMA,
};
pub use crate::prune::{
    plan_retention, remove_layers, Candidate, RemoveReport, RetentionPlan, RetentionPolicy,
};
pub use crate::reader::PayloadReader;

/// Name of the manifest file in a snapshot directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Name of the signature file in a snapshot directory.
pub const SIGNATURE_FILE: &str = "manifest.sig";
/// Largest index file read (≈ 2.5 million chunks).
pub const INDEX_MAX_BYTES: u64 = 256 * 1024 * 1024;
const SIGNATURE_MAX_BYTES: u64 = 256;

/// Whether a verification may rely on what this process already checked (`checked.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// Hash every byte (and refresh the record).
    Nothing,
    /// Skip files unchanged since they were checked against the same digests.
    Checked,
    /// Skip files unchanged since they were checked against the same digests no longer than
    /// this ago (routine re-verification: each file is hashed again once per period).
    CheckedWithin(std::time::Duration),
}

impl Trust {
    /// How recent a record must be to be trusted (`None`: any; not consulted for `Nothing`).
    fn within(self) -> Option<Option<std::time::Duration>> {
        match self {
            Trust::Nothing => None,
            Trust::Checked => Some(None),
            Trust::CheckedWithin(d) => Some(Some(d)),
        }
    }
}

/// How one file's check went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    /// Its bytes were read and matched.
    Read,
    /// Unchanged since this process checked it: not read again.
    Trusted,
}

/// The store's directories and key, shared with its builders.
pub(crate) struct Paths {
    root: PathBuf,
    chunks: PathBuf,
    tmp: PathBuf,
    snapshots: PathBuf,
    key: HostKey,
    /// Files this process checked byte for byte (chunks, disk layers): see `checked.rs`.
    checked: checked::CheckedFiles,
}

/// What [`Store::open`] cleaned up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries removed from `tmp/` (builds interrupted by a crash).
    pub tmp_removed: u64,
    /// Chunk files no published snapshot refers to (left by abandoned builds).
    pub chunks_removed: u64,
}

/// One row of [`Store::list`].
// Rows are few and short-lived; boxing the manifest would only make matching on them clumsier.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ListEntry {
    /// Signature and manifest fields check out (payloads were not read).
    Valid(Manifest),
    /// The manifest could not be trusted or read; `code` is the [`StoreError::code`].
    Corrupt {
        snapshot_id: String,
        code: backstop_common::ErrorCode,
        message: String,
    },
}

impl ListEntry {
    pub fn snapshot_id(&self) -> &str {
        match self {
            ListEntry::Valid(m) => &m.snapshot_id,
            ListEntry::Corrupt { snapshot_id, .. } => snapshot_id,
        }
    }
}

/// What a full verification read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Distinct chunk files read and checked (a chunk repeated in a stream is read once).
    pub chunks_checked: u64,
    /// Bytes read and checked: chunks and disk layers.
    pub bytes_checked: u64,
    pub disk_layers_checked: u64,
    /// Bytes not read again because this process checked them before and their files are
    /// unchanged since ([`Store::verify_trusting_checked`] only; 0 for [`Store::verify`]).
    pub bytes_trusted: u64,
}

/// A snapshot that passed [`Store::verify`]. Only `verify` makes one; it carries the checked
/// chunk indexes that [`Store::open_payload`] streams from.
#[derive(Debug, Clone)]
pub struct VerifiedSnapshot {
    pub manifest: Manifest,
    pub report: VerifyReport,
    indexes: BTreeMap<String, ChunkIndex>,
}

/// Called while the store does long work (hashing a disk layer, verifying chunks): a sign of
/// life for whoever owns the calling operation, from any thread. It must be cheap.
pub type Keepalive = Arc<dyn Fn() + Send + Sync>;

/// The snapshot store rooted at one directory.
#[derive(Clone)]
pub struct Store {
    paths: Arc<Paths>,
    /// Called during long work (a no-op unless [`Store::with_keepalive`] set one).
    keepalive: Keepalive,
    /// The hash naming the chunks new snapshots write (sha256 unless
    /// [`Store::with_chunk_hash`] chose another); chunks of either are read.
    chunk_hash: ChunkHash,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("root", &self.paths.root)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Creates the directories (0700), removes every leftover under `tmp/` (a crash mid-build),
    /// then deletes chunk files that no published snapshot's index refers to. If any published
    /// index cannot be read or parsed, no chunk is deleted (its chunks are unknown).
    pub fn open(root: &Path, key: HostKey) -> Result<(Store, SweepReport), StoreError> {
        let paths = Paths {
            root: root.into(),
            chunks: root.join("chunks"),
            tmp: root.join("tmp"),
            snapshots: root.join("snapshots"),
            key,
            checked: checked::CheckedFiles::default(),
        };
        for dir in [&paths.root, &paths.chunks, &paths.tmp, &paths.snapshots] {
            create_private_dir(dir)?;
        }
        // Each build directory (and the chunk files it creates) in a block group of its own,
        // away from the inodes the last prune or sweep freed (see `spread_subdirs`).
        if !fsutil::spread_subdirs(&paths.tmp) {
            tracing::debug!(path = %paths.tmp.display(), "file system ignores the top-directory hint");
        }
        let store = Store {
            paths: Arc::new(paths),
            keepalive: Arc::new(|| {}),
            chunk_hash: ChunkHash::default(),
        };
        let tmp_removed = store.sweep_tmp()?;
        let chunks_removed = store.collect_chunks()?;
        let report = SweepReport {
            tmp_removed,
            chunks_removed,
        };
        if tmp_removed > 0 || chunks_removed > 0 {
            tracing::info!(
                tmp_removed,
                chunks_removed,
                "swept leftovers of interrupted builds"
            );
        }
        Ok((store, report))
    }

    /// Calls `keepalive` during long work from now on (every MiB hashed, every chunk checked),
    /// in verification and in the builders this store begins.
    pub fn with_keepalive(mut self, keepalive: Keepalive) -> Store {
        self.keepalive = keepalive;
        self
    }

    /// Names the chunks of the snapshots this store's builders write from now on by `hash`
    /// (`[daemon] chunk_hash`). Snapshots already written keep theirs and are verified with it.
    pub fn with_chunk_hash(mut self, hash: ChunkHash) -> Store {
        self.chunk_hash = hash;
        self
    }

    /// The hash naming the chunks new snapshots write.
    pub fn chunk_hash(&self) -> ChunkHash {
        self.chunk_hash
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.paths.root
    }

    /// Starts a new snapshot in a fresh `tmp/<random>/` directory.
    pub fn begin(&self) -> Result<SnapshotBuilder, StoreError> {
        let dir = self.paths.tmp.join(random_hex(16)?);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| StoreError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        Ok(SnapshotBuilder::new(
            Arc::clone(&self.paths),
            dir,
            self.keepalive.clone(),
            self.chunk_hash,
        ))
    }

    /// Every published snapshot, oldest first by `created_at` (ties by id); entries whose
    /// manifest does not check out come last, by id. Only manifests and signatures are read.
    /// Newer minor versions are listed as valid; [`Store::verify`] decides whether to use them.
    pub fn list(&self) -> Result<Vec<ListEntry>, StoreError> {
        let mut valid = Vec::new();
        let mut corrupt = Vec::new();
        let lenient = VerifyOptions {
            allow_newer_minor: true,
        };
        for name in self.snapshot_dirs()? {
            if !is_snapshot_id(&name) {
                corrupt.push(ListEntry::Corrupt {
                    snapshot_id: name,
                    code: codes::INTEGRITY_CHECK_FAILED,
                    message: "directory name is not a snapshot id".into(),
                });
                continue;
            }
            match self.load_manifest(&name, &lenient) {
                Ok(m) => valid.push(m),
                Err(e) => corrupt.push(ListEntry::Corrupt {
                    snapshot_id: name,
                    code: e.code(),
                    message: e.to_string(),
                }),
            }
        }
        valid.sort_by(|a, b| {
            let key = |m: &Manifest| (parse_created_at(&m.created_at), m.snapshot_id.clone());
            key(a).cmp(&key(b))
        });
        corrupt.sort_by(|a, b| a.snapshot_id().cmp(b.snapshot_id()));
        Ok(valid
            .into_iter()
            .map(ListEntry::Valid)
            .chain(corrupt)
            .collect())
    }

    /// The full id of the one snapshot `id_or_prefix` names, by [`backstop_decide::resolve`]
    /// (the rule audit replay applies too): its exact id, its exact name (`Manifest::name`),
    /// the one id that starts with it. None → `MISSING_SNAPSHOT`; several →
    /// `AmbiguousPrefix` listing them (also `MISSING_SNAPSHOT`).
    pub fn resolve(&self, id_or_prefix: &str) -> Result<String, StoreError> {
        use backstop_decide::{LiveSnapshot, Resolved, ResolvedBy};
        if is_snapshot_id(id_or_prefix) && self.paths.snapshots.join(id_or_prefix).is_dir() {
            return Ok(id_or_prefix.to_string());
        }
        // Names are read (every manifest) only when `id_or_prefix` could be one: the naming
        // rule keeps a name from ever reading as an id or prefix, and every stored name keeps
        // it, so for anything else the directory names alone give the same answer.
        let listed: Vec<(String, Option<String>)> =
            if backstop_common::names::check_snapshot_name(id_or_prefix).is_ok() {
                self.list()?
                    .into_iter()
                    .filter(|e| is_snapshot_id(e.snapshot_id()))
                    .map(|e| match e {
                        ListEntry::Valid(m) => (m.snapshot_id, m.name),
                        ListEntry::Corrupt { snapshot_id, .. } => (snapshot_id, None),
                    })
                    .collect()
            } else {
                self.snapshot_dirs()?
                    .into_iter()
                    .filter(|n| is_snapshot_id(n))
                    .map(|n| (n, None))
                    .collect()
            };
        let live: Vec<LiveSnapshot<'_>> = listed
            .iter()
            .map(|(id, name)| LiveSnapshot {
                id,
                name: name.as_deref(),
            })
            .collect();
        match backstop_decide::resolve(id_or_prefix, &live) {
            Resolved::Found { id, .. } => Ok(id),
            Resolved::NotFound => Err(StoreError::MissingSnapshot {
                given: id_or_prefix.into(),
            }),
            // Names are unique among live snapshots; two only if a caller skipped the check.
            Resolved::Ambiguous { by, mut matches } => {
                if by == ResolvedBy::Prefix {
                    matches.sort();
                }
                Err(StoreError::AmbiguousPrefix {
                    given: id_or_prefix.into(),
                    matches,
                })
            }
        }
    }

    /// Verifies snapshot `id` completely, in this order: manifest size cap → signature over the
    /// raw bytes → required fields → versions → id (directory name and content hash) →
    /// consistency → every index file's sha256 and crc32 → every chunk (presence, length,
    /// digest under the index's hash, crc32) → every disk layer (size, sha256, crc32).
    pub fn verify(&self, id: &str, opts: &VerifyOptions) -> Result<VerifiedSnapshot, StoreError> {
        self.verify_with(id, opts, Trust::Nothing, None)
    }

    /// [`Store::verify`] for choosing a rollback target: the manifest's signature and every
    /// index are checked as always, and every chunk and disk layer is present with its length,
    /// but a file this process already checked against the same digests and that is unchanged
    /// since (same inode, length, mtime and ctime; `checked.rs`) is not hashed again. The chunks
    /// are re-checked as they stream out ([`Store::open_payload`]), so a changed chunk still
    /// stops the load before the guest resumes.
    pub fn verify_trusting_checked(
        &self,
        id: &str,
        opts: &VerifyOptions,
    ) -> Result<VerifiedSnapshot, StoreError> {
        self.verify_with(id, opts, Trust::Checked, None)
    }

    /// [`Store::verify`] that stops with [`StoreError::Preempted`] as soon as `stop` is set.
    pub fn verify_stoppable(
        &self,
        id: &str,
        opts: &VerifyOptions,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<VerifiedSnapshot, StoreError> {
        self.verify_with(id, opts, Trust::Nothing, Some(stop))
    }

    /// Routine re-verification (drift detection): as [`Store::verify`], except that a file this
    /// process hashed against the same digests less than `recheck_after` ago and unchanged
    /// since is not hashed again (an unchanged base image is not re-read every pass, only once
    /// per period), and the work stops with [`StoreError::Preempted`] as soon as `stop` is set
    /// (a rollback is waiting: it must not queue behind routine work).
    pub fn verify_routine(
        &self,
        id: &str,
        opts: &VerifyOptions,
        recheck_after: std::time::Duration,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<VerifiedSnapshot, StoreError> {
        self.verify_with(id, opts, Trust::CheckedWithin(recheck_after), Some(stop))
    }

    fn verify_with(
        &self,
        id: &str,
        opts: &VerifyOptions,
        trust: Trust,
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<VerifiedSnapshot, StoreError> {
        let stopped = || stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst));
        let preempted = || StoreError::Preempted { id: id.into() };
        let manifest = self.load_manifest(id, opts)?;
        let mut report = VerifyReport::default();
        let mut indexes = BTreeMap::new();
        let mut seen_chunks: HashSet<String> = HashSet::new();

        for payload in &manifest.payload_refs {
            let Some(file) = &payload.index else { continue };
            let index = self.verify_index(&manifest, file)?;
            if index.total_bytes != payload.total_bytes
                || index.chunks.len() as u64 != payload.chunks
            {
                return Err(StoreError::IndexInvalid {
                    id: id.into(),
                    file: file.clone(),
                    reason: "chunk count or total bytes differ from the manifest".into(),
                });
            }
            let unique: Vec<&ChunkRef> = index
                .chunks
                .iter()
                .filter(|c| seen_chunks.insert(c.digest.clone()))
                .collect();
            let trusted = self.verify_chunks(id, &unique, trust, stop)?;
            report.chunks_checked += unique.len() as u64;
            report.bytes_checked += unique.iter().map(|c| c.len).sum::<u64>() - trusted;
            report.bytes_trusted += trusted;
            indexes.insert(payload.name.clone(), index);
        }
        for payload in &manifest.payload_refs {
            for layer in &payload.layers {
                if stopped() {
                    return Err(preempted());
                }
                report.disk_layers_checked += 1;
                match self.verify_layer(id, layer, trust, stop)? {
                    Checked::Read => report.bytes_checked += layer.bytes,
                    Checked::Trusted => report.bytes_trusted += layer.bytes,
                }
            }
        }
        Ok(VerifiedSnapshot {
            manifest,
            report,
            indexes,
        })
    }

    /// Streams the chunked payload `name` of a verified snapshot.
    pub fn open_payload(
        &self,
        snap: &VerifiedSnapshot,
        name: &str,
    ) -> Result<PayloadReader, StoreError> {
        let id = &snap.manifest.snapshot_id;
        if !snap.manifest.payload_refs.iter().any(|p| p.name == name) {
            return Err(StoreError::NoSuchPayload {
                id: id.clone(),
                name: name.into(),
            });
        }
        let Some(index) = snap.indexes.get(name) else {
            return Err(StoreError::NotChunked {
                id: id.clone(),
                name: name.into(),
            });
        };
        Ok(PayloadReader::new(
            self.paths.chunks.clone(),
            index.chunks.clone(),
            index.total_bytes,
        ))
    }

    /// The distinct chunks of snapshot `id`, in first-use order, from its indexes after the
    /// manifest's signature and each index file's checksums were checked (the chunks themselves
    /// are not read). For re-verifying a snapshot a few chunks at a time with
    /// [`Store::check_chunk`], instead of all at once with [`Store::verify`].
    pub fn snapshot_chunks(&self, id: &str) -> Result<Vec<ChunkRef>, StoreError> {
        let manifest = self.load_manifest(
            id,
            &VerifyOptions {
                allow_newer_minor: true,
            },
        )?;
        let mut seen: HashSet<String> = HashSet::new();
        let mut out = Vec::new();
        for payload in &manifest.payload_refs {
            let Some(file) = &payload.index else { continue };
            let index = self.verify_index(&manifest, file)?;
            out.extend(
                index
                    .chunks
                    .into_iter()
                    .filter(|c| seen.insert(c.digest.clone())),
            );
        }
        Ok(out)
    }

    /// Checks one chunk of snapshot `id` (presence, length, digest, crc32), as [`Store::verify`]
    /// does for each.
    pub fn check_chunk(&self, id: &str, chunk: &ChunkRef) -> Result<(), StoreError> {
        self.verify_chunk(id, chunk, Trust::Nothing).map(|_| ())
    }

    /// Moves a chunk that failed its check out of `chunks/` into `quarantine/` (kept for a
    /// person to look at, never swept). Without this a damaged chunk would poison every later
    /// snapshot: the builders dedup by the chunk's name and length, so a fresh capture of the
    /// same bytes would refer to the damaged file instead of writing a good one. Snapshots that
    /// name it then fail with `ChunkMissing` rather than a mismatch: they were unusable anyway.
    pub fn quarantine_chunk(&self, name: &str) -> Result<PathBuf, StoreError> {
        if !fsutil::is_lower_hex(name, 64) {
            return Err(StoreError::Chunker {
                name: name.into(),
                message: "not a chunk name".into(),
            });
        }
        let dir = self.paths.root.join("quarantine");
        create_private_dir(&dir)?;
        let from = chunk_path(&self.paths.chunks, name);
        let to = dir.join(name);
        fs::rename(&from, &to).map_err(|source| StoreError::Rename {
            from: from.clone(),
            to: to.clone(),
            source,
        })?;
        if let Some(parent) = from.parent() {
            fsync_dir(parent)?;
        }
        fsync_dir(&dir)?;
        Ok(to)
    }

    // --- internals ---

    /// Reads, authenticates and decodes `snapshots/<id>/manifest.json`.
    fn load_manifest(&self, id: &str, opts: &VerifyOptions) -> Result<Manifest, StoreError> {
        if !is_snapshot_id(id) {
            return Err(StoreError::MissingSnapshot { given: id.into() });
        }
        let dir = self.paths.snapshots.join(id);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(StoreError::MissingSnapshot { given: id.into() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::MissingSnapshot { given: id.into() })
            }
            Err(source) => return Err(StoreError::ReadDir { path: dir, source }),
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        let bytes = match read_capped(&manifest_path, MANIFEST_MAX_BYTES) {
            Ok(Capped::Bytes(b)) => b,
            Ok(Capped::TooLarge) => {
                return Err(StoreError::TooLarge {
                    id: id.into(),
                    file: MANIFEST_FILE.into(),
                    limit: MANIFEST_MAX_BYTES,
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::ManifestMissing { id: id.into() })
            }
            Err(source) => {
                return Err(StoreError::ReadManifest {
                    path: manifest_path,
                    source,
                })
            }
        };
        let sig_path = dir.join(SIGNATURE_FILE);
        let sig = match read_capped(&sig_path, SIGNATURE_MAX_BYTES) {
            Ok(Capped::Bytes(b)) => b,
            Ok(Capped::TooLarge) => return Err(StoreError::SignatureMismatch { id: id.into() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::SignatureMissing { id: id.into() })
            }
            Err(source) => {
                return Err(StoreError::ReadManifest {
                    path: sig_path,
                    source,
                })
            }
        };
        check_signature(&self.paths.key, id, &bytes, &sig)?;
        decode_manifest(id, &bytes, opts)
    }

    /// Reads the index file `file` of `manifest`'s snapshot, checks it against the manifest's
    /// checksum of it, parses it, and checks its chunks' hash is one the index version names.
    fn verify_index(&self, manifest: &Manifest, file: &str) -> Result<ChunkIndex, StoreError> {
        let id = manifest.snapshot_id.as_str();
        let index_version = manifest.index_version.as_str();
        let expected = manifest.checksums.iter().find(|c| c.reference == file);
        let path = self.paths.snapshots.join(id).join(file);
        let bytes = match read_capped(&path, INDEX_MAX_BYTES) {
            Ok(Capped::Bytes(b)) => b,
            Ok(Capped::TooLarge) => {
                return Err(StoreError::TooLarge {
                    id: id.into(),
                    file: file.into(),
                    limit: INDEX_MAX_BYTES,
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::IndexMissing {
                    id: id.into(),
                    file: file.into(),
                })
            }
            Err(source) => return Err(StoreError::ReadIndex { path, source }),
        };
        let digests = digests_of(&bytes);
        match expected {
            Some(c) if c.sha256 == digests.sha256 && c.crc32 == digests.crc32 => {}
            _ => {
                return Err(StoreError::ChecksumMismatch {
                    id: id.into(),
                    what: format!("index file {file}"),
                })
            }
        }
        let index = ChunkIndex::parse(&bytes).map_err(|reason| StoreError::IndexInvalid {
            id: id.into(),
            file: file.into(),
            reason,
        })?;
        // Index 1.0 names chunks by sha256 only (see `ChunkHash`).
        match index.hash() {
            Some(hash) if !hash.allowed_in(index_version) => Err(StoreError::IndexInvalid {
                id: id.into(),
                file: file.into(),
                reason: format!("{hash} chunks in a manifest of index version {index_version}"),
            }),
            _ => Ok(index),
        }
    }

    /// Checks `chunks` on up to 4 threads (hashing dominates; a QEMU stream is ~8,000 chunks per
    /// GiB). On failure, the error of the first failing chunk in index order is returned, so the
    /// result does not depend on scheduling. On success, the bytes trusted rather than read.
    fn verify_chunks(
        &self,
        id: &str,
        chunks: &[&ChunkRef],
        trust: Trust,
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<u64, StoreError> {
        use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
        let trusted = AtomicU64::new(0);
        // A full check reads every chunk, and a chunk is a file of its own: the kernel's
        // readahead stops at its end. So each chunk is asked for (`reader::will_need`) a window
        // ahead of its turn, and a store out of the page cache is read with that many reads in
        // flight instead of one per worker. The hint opens each file once more than the check
        // does (measured: ~6% on a cached 504 MB stream, against 4x faster from the disk). A
        // check that trusts what it checked before reads almost nothing: no hints.
        let hint = |i: usize| {
            if let (Trust::Nothing, Some(c)) = (trust, chunks.get(i)) {
                if let Ok(f) = reader::open_chunk(&chunk_path(&self.paths.chunks, &c.digest)) {
                    reader::will_need(&f);
                }
            }
        };
        (0..reader::AHEAD_FILES).for_each(hint);
        let one = |i: usize| -> Result<(), StoreError> {
            if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                return Err(StoreError::Preempted { id: id.into() });
            }
            hint(i + reader::AHEAD_FILES);
            let c = chunks[i];
            if self.verify_chunk(id, c, trust)? == Checked::Trusted {
                trusted.fetch_add(c.len, Ordering::Relaxed);
            }
            Ok(())
        };
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 4)
            .min(chunks.len().max(1));
        if workers == 1 {
            (0..chunks.len()).try_for_each(one)?;
            return Ok(trusted.into_inner());
        }
        let next = AtomicUsize::new(0);
        // Index of the first failure found so far: workers skip chunks after it.
        let first_bad = AtomicUsize::new(usize::MAX);
        let failures = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= chunks.len() || i > first_bad.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Err(e) = one(i) {
                        first_bad.fetch_min(i, Ordering::Relaxed);
                        if let Ok(mut f) = failures.lock() {
                            f.push((i, e));
                        }
                    }
                });
            }
        });
        let mut failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
        failures.sort_by_key(|(i, _)| *i);
        match failures.into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(trusted.into_inner()),
        }
    }

    fn verify_chunk(
        &self,
        id: &str,
        chunk: &ChunkRef,
        trust: Trust,
    ) -> Result<Checked, StoreError> {
        (self.keepalive)();
        let path = chunk_path(&self.paths.chunks, &chunk.digest);
        // A chunk checked before and unchanged since costs one stat (not an open, a stat and a
        // close: a rollback's target has thousands of chunks). The file's own identity, not a
        // symlink's target: anything but the file that was checked is read again below.
        if let Some(within) = trust.within() {
            let unchanged = fs::symlink_metadata(&path).is_ok_and(|meta| {
                self.paths.checked.unchanged_within(
                    &path,
                    &meta,
                    &chunk.digest,
                    &chunk.crc32,
                    within,
                )
            });
            if unchanged {
                return Ok(Checked::Trusted);
            }
        }
        let file = match reader::open_chunk(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.paths.checked.forget(&path);
                return Err(StoreError::ChunkMissing {
                    id: id.into(),
                    chunk: chunk.digest.clone(),
                });
            }
            Err(source) => return Err(StoreError::ReadChunk { path, source }),
        };
        let meta = file.metadata().map_err(|source| StoreError::ReadChunk {
            path: path.clone(),
            source,
        })?;
        self.paths.checked.forget(&path);
        let size_err = |found: u64| StoreError::ChunkSizeMismatch {
            id: id.into(),
            chunk: chunk.digest.clone(),
            expected: chunk.len,
            found,
        };
        let bytes = match read_capped_from(file, chunk.len) {
            Ok(Capped::Bytes(b)) if b.len() as u64 == chunk.len => b,
            Ok(Capped::Bytes(b)) => return Err(size_err(b.len() as u64)),
            Ok(Capped::TooLarge) => {
                let found = fs::metadata(&path)
                    .map(|m| m.len())
                    .unwrap_or(chunk.len + 1);
                return Err(size_err(found));
            }
            Err(source) => return Err(StoreError::ReadChunk { path, source }),
        };
        if !chunk.matches(&bytes) {
            return Err(StoreError::ChecksumMismatch {
                id: id.into(),
                what: format!("chunk {}", chunk.digest),
            });
        }
        self.paths
            .checked
            .record(&path, &meta, &chunk.digest, &chunk.crc32);
        Ok(Checked::Read)
    }

    /// Checks one disk layer (presence, length, sha256, crc32); with [`Trust::Checked`] a layer
    /// unchanged since this process last checked it against the same digests is not re-read.
    fn verify_layer(
        &self,
        id: &str,
        layer: &DiskLayer,
        trust: Trust,
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Checked, StoreError> {
        let checked = &self.paths.checked;
        if let Some(within) = trust.within() {
            let unchanged = fs::metadata(&layer.path).is_ok_and(|m| {
                checked.unchanged_within(&layer.path, &m, &layer.sha256, &layer.crc32, within)
            });
            if unchanged {
                return Ok(Checked::Trusted);
            }
        }
        checked.forget(&layer.path);
        let meta = verify_layer(id, layer, &*self.keepalive, stop)?;
        checked.record(&layer.path, &meta, &layer.sha256, &layer.crc32);
        Ok(Checked::Read)
    }

    /// Names of the entries of `snapshots/` that are directories.
    fn snapshot_dirs(&self) -> Result<Vec<String>, StoreError> {
        let dir = &self.paths.snapshots;
        let err = |source| StoreError::ReadDir {
            path: dir.clone(),
            source,
        };
        let mut names = Vec::new();
        for entry in fs::read_dir(dir).map_err(err)? {
            let entry = entry.map_err(err)?;
            if !entry.file_type().map_err(err)?.is_dir() {
                continue;
            }
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn sweep_tmp(&self) -> Result<u64, StoreError> {
        let dir = &self.paths.tmp;
        let err = |source| StoreError::ReadDir {
            path: dir.clone(),
            source,
        };
        let mut removed = 0;
        for entry in fs::read_dir(dir).map_err(err)? {
            let entry = entry.map_err(err)?;
            let path = entry.path();
            let result = if entry.file_type().map_err(err)?.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            result.map_err(|source| StoreError::Remove { path, source })?;
            removed += 1;
        }
        if removed > 0 {
            fsync_dir(dir)?;
        }
        Ok(removed)
    }

    /// Deletes chunk files (and temporary chunk files) that no published index refers to.
    fn collect_chunks(&self) -> Result<u64, StoreError> {
        let Some(live) = self.referenced_chunks()? else {
            return Ok(0);
        };
        let chunks = &self.paths.chunks;
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::ReadDir { path, source }
        };
        let mut removed = 0;
        for sub in fs::read_dir(chunks).map_err(err(chunks))? {
            let sub = sub.map_err(err(chunks))?;
            let prefix = sub.file_name().to_string_lossy().into_owned();
            if !sub.file_type().map_err(err(chunks))?.is_dir() || !fsutil::is_lower_hex(&prefix, 2)
            {
                continue; // not ours: leave it alone
            }
            let sub_path = sub.path();
            let mut removed_here = 0;
            for entry in fs::read_dir(&sub_path).map_err(err(&sub_path))? {
                let entry = entry.map_err(err(&sub_path))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let ours = fsutil::is_lower_hex(&name, 64) || name.starts_with(".tmp-");
                let is_file = entry.file_type().map_err(err(&sub_path))?.is_file();
                if !ours || !is_file || (live.contains(&name) && name.starts_with(&prefix)) {
                    continue;
                }
                let path = entry.path();
                fs::remove_file(&path).map_err(|source| StoreError::Remove { path, source })?;
                removed_here += 1;
            }
            if removed_here > 0 {
                fsync_dir(&sub_path)?;
            }
            removed += removed_here;
        }
        Ok(removed)
    }

    /// The chunks named by every published index, or `None` if some index cannot be read or
    /// parsed (then nothing may be collected).
    fn referenced_chunks(&self) -> Result<Option<BTreeSet<String>>, StoreError> {
        let mut live = BTreeSet::new();
        for name in self.snapshot_dirs()? {
            let dir = self.paths.snapshots.join(&name);
            let err = |source| StoreError::ReadDir {
                path: dir.clone(),
                source,
            };
            for entry in fs::read_dir(&dir).map_err(err)? {
                let entry = entry.map_err(err)?;
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("index") {
                    continue;
                }
                let parsed = match read_capped(&path, INDEX_MAX_BYTES) {
                    Ok(Capped::Bytes(b)) => ChunkIndex::parse(&b).ok(),
                    _ => None,
                };
                let Some(index) = parsed else {
                    tracing::warn!(
                        path = %path.display(),
                        "unreadable chunk index in a published snapshot; keeping every chunk"
                    );
                    return Ok(None);
                };
                live.extend(index.chunks.into_iter().map(|c| c.digest));
            }
        }
        Ok(Some(live))
    }
}

/// `chunks/<first 2 hex>/<digest>`.
pub(crate) fn chunk_path(chunks: &Path, digest: &str) -> PathBuf {
    chunks.join(digest.get(..2).unwrap_or("xx")).join(digest)
}

/// Checks a disk layer's length and digests; the file's metadata as it was when it was read.
fn verify_layer(
    id: &str,
    layer: &DiskLayer,
    keepalive: &dyn Fn(),
    stop: Option<&std::sync::atomic::AtomicBool>,
) -> Result<fs::Metadata, StoreError> {
    let path = &layer.path;
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(StoreError::LayerMissing {
                id: id.into(),
                path: path.clone(),
            })
        }
        Err(source) => {
            return Err(StoreError::ReadLayer {
                path: path.clone(),
                source,
            })
        }
    };
    let size_err = |found| StoreError::LayerSizeMismatch {
        id: id.into(),
        path: path.clone(),
        expected: layer.bytes,
        found,
    };
    // Taken before the bytes are read: a change while they are read moves ctime past it.
    let meta = file.metadata().map_err(|source| StoreError::ReadLayer {
        path: path.clone(),
        source,
    })?;
    let len = meta.len();
    if len != layer.bytes {
        return Err(size_err(len));
    }
    // A layer is one file of up to the disk's size: the stop is looked at every MiB read.
    let stopped = || stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst));
    let mut reader = fsutil::Stoppable {
        inner: &mut file,
        stopped: &stopped,
    };
    let digests = digests_of_reader(&mut reader, keepalive).map_err(|source| {
        if stopped() {
            StoreError::Preempted { id: id.into() }
        } else {
            StoreError::ReadLayer {
                path: path.clone(),
                source,
            }
        }
    })?;
    if digests.len != layer.bytes {
        return Err(size_err(digests.len));
    }
    if digests.sha256 != layer.sha256 || digests.crc32 != layer.crc32 {
        return Err(StoreError::ChecksumMismatch {
            id: id.into(),
            what: format!("disk layer {}", path.display()),
        });
    }
    Ok(meta)
}

#[cfg(test)]
mod tests;

/// The kept inputs of a fuzz target, replayed by stable `cargo test`.
#[cfg(test)]
pub(crate) use backstop_common::fuzz_corpus::inputs as fuzz_inputs;
