//! Building a snapshot in `tmp/<random>/` and publishing it with one rename.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fastcdc::v2020::{Error as CdcError, StreamCDC};

use crate::error::StoreError;
use crate::fsutil::{
    crc32_hex, create_private_subdir, digests_of, digests_of_reader, fsync_dir, write_new_synced,
    Digests,
};
use crate::index::{
    ChunkHash, ChunkIndex, ChunkRef, CHUNK_AVG_BYTES, CHUNK_MAX_BYTES, CHUNK_MIN_BYTES,
};
use crate::manifest::{
    decode_manifest, index_file_name, is_valid_kind, is_valid_name, layer_ref, now_rfc3339_ms,
    seal, signature_file, Checksum, DiskLayer, Manifest, ManifestInput, PayloadRef, VerifyOptions,
    DISK_PAYLOAD_PREFIX, INDEX_VERSION, KIND_DISK_LAYER_CHAIN, SCHEMA_VERSION, SCOPE_FULL,
};
use crate::{chunk_path, Paths, MANIFEST_FILE, SIGNATURE_FILE};

/// A snapshot being built. Nothing it writes is visible as a snapshot until [`publish`]
/// renames its directory into `snapshots/`; dropping it unpublished removes the directory.
///
/// [`publish`]: SnapshotBuilder::publish
pub struct SnapshotBuilder {
    paths: Arc<Paths>,
    dir: PathBuf,
    payloads: Vec<PayloadRef>,
    checksums: Vec<Checksum>,
    /// Chunks written by this builder, not yet under their final names: `pending/<sha256>` in
    /// the build directory, moved into `chunks/` by [`publish`](SnapshotBuilder::publish) after
    /// one `syncfs`. A file under its final name in `chunks/` is therefore always complete and
    /// durable, which is what makes a length check enough for a dedup hit.
    pending: BTreeMap<String, String>,
    published: bool,
    keepalive: crate::Keepalive,
    /// The hash that names the chunks this builder writes (the store's, see [`ChunkHash`]).
    chunk_hash: ChunkHash,
}

impl std::fmt::Debug for SnapshotBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotBuilder")
            .field("dir", &self.dir)
            .field("payloads", &self.payloads.len())
            .finish_non_exhaustive()
    }
}

impl SnapshotBuilder {
    pub(crate) fn new(
        paths: Arc<Paths>,
        dir: PathBuf,
        keepalive: crate::Keepalive,
        chunk_hash: ChunkHash,
    ) -> Self {
        Self {
            paths,
            dir,
            payloads: Vec::new(),
            checksums: Vec::new(),
            pending: BTreeMap::new(),
            published: false,
            keepalive,
            chunk_hash,
        }
    }

    /// The build directory (`tmp/<random>/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads `reader` to EOF, cuts it with FastCDC (min 256 KiB / avg 1 MiB / max 4 MiB), stores
    /// each chunk under `chunks/` unless already present (dedup), and writes `<name>.index` into
    /// the build directory. `progress(bytes_so_far)` is called after every chunk.
    pub fn write_chunked(
        &mut self,
        name: &str,
        kind: &str,
        reader: &mut dyn Read,
        progress: &mut dyn FnMut(u64),
    ) -> Result<PayloadRef, StoreError> {
        self.check_payload(name, kind)?;
        let reader = RetryInterrupted(reader);
        let cdc = StreamCDC::new(
            reader,
            CHUNK_MIN_BYTES as usize,
            CHUNK_AVG_BYTES as usize,
            CHUNK_MAX_BYTES as usize,
        );
        let mut chunks = cdc.map(|item| {
            item.map(|c| c.data).map_err(|e| match e {
                CdcError::IoError(source) => StoreError::ReadSource {
                    name: name.into(),
                    source,
                },
                other => StoreError::Chunker {
                    name: name.into(),
                    message: other.to_string(),
                },
            })
        });
        self.store_payload(name, kind, &mut chunks, progress)
    }

    /// Like [`write_chunked`](SnapshotBuilder::write_chunked), but the caller cuts: each item is
    /// one chunk, in stream order. For producers that know their stream's structure (a QEMU
    /// migration stream cut at page-record boundaries dedups far better than blind FastCDC).
    /// A chunk must be 1 ..= [`CHUNK_MAX_BYTES`] long; a read error ends the payload.
    pub fn write_chunks(
        &mut self,
        name: &str,
        kind: &str,
        chunks: &mut dyn Iterator<Item = io::Result<Vec<u8>>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<PayloadRef, StoreError> {
        self.check_payload(name, kind)?;
        let mut chunks = chunks.map(|item| {
            let data = item.map_err(|source| StoreError::ReadSource {
                name: name.into(),
                source,
            })?;
            if data.is_empty() || data.len() > CHUNK_MAX_BYTES as usize {
                return Err(StoreError::InvalidInput {
                    what: "chunk length",
                    value: data.len().to_string(),
                    reason: "a chunk is 1 byte to 4 MiB long",
                });
            }
            Ok(data)
        });
        self.store_payload(name, kind, &mut chunks, progress)
    }

    fn check_payload(&self, name: &str, kind: &str) -> Result<(), StoreError> {
        if !is_valid_name(name) {
            return Err(StoreError::InvalidInput {
                what: "payload name",
                value: name.into(),
                reason: "use 1-128 of [A-Za-z0-9._-], not starting with a dot",
            });
        }
        if !is_valid_kind(kind) || kind == KIND_DISK_LAYER_CHAIN {
            return Err(StoreError::InvalidInput {
                what: "payload kind",
                value: kind.into(),
                reason: "use 1-64 of [a-z0-9+._-], and not the disk chain kind",
            });
        }
        self.claim_name(name)
    }

    /// Stores every chunk (dedup by content address) and writes the payload's index.
    ///
    /// Two stages on two threads: this one reads, cuts and hashes and decides what is new; a
    /// writer thread creates and fills the new chunks' files in `pending/` (mostly kernel time:
    /// inode allocation and the copy into the page cache), at most [`WRITE_QUEUE_CHUNKS`]
    /// chunks behind, and has their disk writes started by a flusher ([`start_writeback`]). Every write has finished (or the first failure is returned) before the
    /// index is written; durability is still [`publish`](SnapshotBuilder::publish)'s syncfs.
    fn store_payload(
        &mut self,
        name: &str,
        kind: &str,
        chunks: &mut dyn Iterator<Item = Result<Vec<u8>, StoreError>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<PayloadRef, StoreError> {
        let pending_dir = self.dir.join(PENDING_DIR);
        let (queue, queued) = std::sync::mpsc::sync_channel(WRITE_QUEUE_CHUNKS);
        let (hashed, written) = std::thread::scope(|scope| {
            let writer = scope.spawn(|| write_pending(&pending_dir, queued));
            let hashed = self.hash_chunks(chunks, progress, queue);
            let written = writer.join().unwrap_or_else(|_| {
                Err(StoreError::Write {
                    path: pending_dir.clone(),
                    source: io::Error::other("the chunk writer thread panicked"),
                })
            });
            (hashed, written)
        });
        // A failed write is the cause when both failed: the hashing stage stops when the
        // writer is gone.
        written?;
        let (refs, total_bytes, new_bytes) = hashed?;

        let index = ChunkIndex {
            chunks: refs,
            total_bytes,
        };
        let bytes = index
            .to_canonical()
            .map_err(|e| StoreError::Encode(e.to_string()))?;
        let file = index_file_name(name);
        write_new_synced(&self.dir.join(&file), &bytes)?;
        let digests = digests_of(&bytes);
        self.checksums.push(Checksum {
            reference: file.clone(),
            sha256: digests.sha256,
            crc32: digests.crc32,
        });
        let payload = PayloadRef {
            name: name.into(),
            kind: kind.into(),
            index: Some(file),
            layers: Vec::new(),
            total_bytes,
            new_bytes,
            chunks: index.chunks.len() as u64,
        };
        self.payloads.push(payload.clone());
        Ok(payload)
    }

    /// Records a disk's layer chain (base first): files outside the store that are already
    /// immutable. Each layer is streamed once for its sha256, crc32 and size. The payload is
    /// named `disk:<disk_id>`.
    pub fn add_disk_chain(
        &mut self,
        disk_id: &str,
        layers: &[PathBuf],
    ) -> Result<PayloadRef, StoreError> {
        if !is_valid_name(disk_id) {
            return Err(StoreError::InvalidInput {
                what: "disk id",
                value: disk_id.into(),
                reason: "use 1-128 of [A-Za-z0-9._-], not starting with a dot",
            });
        }
        if layers.is_empty() {
            return Err(StoreError::InvalidInput {
                what: "disk chain",
                value: disk_id.into(),
                reason: "a chain has at least one layer",
            });
        }
        let name = format!("{DISK_PAYLOAD_PREFIX}{disk_id}");
        let mut entries = Vec::with_capacity(layers.len());
        let mut refs = BTreeSet::new();
        let mut total_bytes = 0u64;
        for path in layers {
            let shown = path.display().to_string();
            if !path.is_absolute() {
                return Err(StoreError::InvalidInput {
                    what: "layer path",
                    value: shown,
                    reason: "must be absolute",
                });
            }
            let probe = DiskLayer {
                path: path.clone(),
                bytes: 0,
                sha256: String::new(),
                crc32: String::new(),
            };
            let Some(reference) = layer_ref(&name, &probe) else {
                return Err(StoreError::InvalidInput {
                    what: "layer path",
                    value: shown,
                    reason: "must be valid UTF-8 and end in a file name",
                });
            };
            if !refs.insert(reference.clone()) {
                return Err(StoreError::InvalidInput {
                    what: "layer path",
                    value: shown,
                    reason: "two layers of one chain share a file name",
                });
            }
            let read_err = |source| StoreError::ReadLayer {
                path: path.clone(),
                source,
            };
            let mut file = File::open(path).map_err(read_err)?;
            // Taken before the bytes are read: a change while they are read moves ctime past it.
            let meta = file.metadata().map_err(read_err)?;
            // A layer already checked by this process and unchanged since is not read again
            // (each snapshot's chain repeats the previous one's frozen layers and the base).
            let digests = match self.paths.checked.digests_if_unchanged(path, &meta) {
                Some((sha256, crc32)) => Digests {
                    sha256,
                    crc32,
                    len: meta.len(),
                },
                None => {
                    let d = digests_of_reader(&mut file, &*self.keepalive).map_err(read_err)?;
                    self.paths.checked.record(path, &meta, &d.sha256, &d.crc32);
                    d
                }
            };
            total_bytes += digests.len;
            entries.push((
                reference,
                DiskLayer {
                    bytes: digests.len,
                    ..probe
                },
                digests,
            ));
        }
        self.claim_name(&name)?;
        let mut layers_out = Vec::with_capacity(entries.len());
        for (reference, mut layer, digests) in entries {
            layer.sha256 = digests.sha256.clone();
            layer.crc32 = digests.crc32.clone();
            self.checksums.push(Checksum {
                reference,
                sha256: digests.sha256,
                crc32: digests.crc32,
            });
            layers_out.push(layer);
        }
        let payload = PayloadRef {
            name,
            kind: KIND_DISK_LAYER_CHAIN.into(),
            index: None,
            layers: layers_out,
            total_bytes,
            new_bytes: 0,
            chunks: 0,
        };
        self.payloads.push(payload.clone());
        Ok(payload)
    }

    /// Builds and signs the manifest, makes every file durable, and renames the build directory
    /// to `snapshots/<snapshot_id>/`. Only after the rename does the snapshot exist.
    pub fn publish(mut self, input: ManifestInput) -> Result<Manifest, StoreError> {
        for (what, value) in [
            ("created_by", &input.created_by),
            ("reason", &input.reason),
            ("vm", &input.vm),
            ("trigger", &input.trigger),
        ] {
            if value.is_empty() {
                return Err(StoreError::InvalidInput {
                    what,
                    value: String::new(),
                    reason: "must not be empty",
                });
            }
        }
        if input.scope != SCOPE_FULL {
            return Err(StoreError::InvalidInput {
                what: "scope",
                value: input.scope,
                reason: "only \"full\" is supported",
            });
        }
        if self.payloads.is_empty() {
            return Err(StoreError::EmptySnapshot);
        }
        let bytes_stored = self.payloads.iter().map(|p| p.new_bytes).sum();
        let draft = Manifest {
            snapshot_id: String::new(),
            created_at: now_rfc3339_ms()?,
            created_by: input.created_by,
            schema_version: SCHEMA_VERSION.into(),
            // Index 1.1 only where it names BLAKE3 chunks: a snapshot of sha256 chunks (or of
            // disks alone) stays readable by a build that knows 1.0 only.
            index_version: if self.payloads.iter().any(|p| p.index.is_some()) {
                self.chunk_hash.index_version().into()
            } else {
                INDEX_VERSION.into()
            },
            scope: input.scope,
            reason: input.reason,
            checksums: std::mem::take(&mut self.checksums),
            payload_refs: std::mem::take(&mut self.payloads),
            vm: input.vm,
            trigger: input.trigger,
            epoch: input.epoch,
            config_fingerprint: input.config_fingerprint,
            capture: input.capture,
            bytes_stored,
            lineage: input.lineage,
            name: input.name,
        };
        let (manifest, bytes) = seal(&draft)?;
        // What we publish must pass the same checks a reader applies.
        decode_manifest(&manifest.snapshot_id, &bytes, &VerifyOptions::default())?;

        write_new_synced(&self.dir.join(MANIFEST_FILE), &bytes)?;
        let sig = signature_file(&self.paths.key, &bytes);
        write_new_synced(&self.dir.join(SIGNATURE_FILE), sig.as_bytes())?;

        // New chunks: one syncfs makes their bytes durable, then they move to their final names
        // (and the chunk directories are fsynced), so no final name ever points at lost bytes.
        self.commit_pending_chunks()?;

        // Every file in the build directory was fsynced as it was written (indexes, manifest,
        // signature); now the directory holding their names.
        fsync_dir(&self.dir)?;

        let target = self.paths.snapshots.join(&manifest.snapshot_id);
        fs::rename(&self.dir, &target).map_err(|source| StoreError::Rename {
            from: self.dir.clone(),
            to: target.clone(),
            source,
        })?;
        self.published = true;
        fsync_dir(&self.paths.snapshots)?;
        fsync_dir(&self.paths.tmp)?;
        tracing::debug!(
            snapshot_id = %manifest.snapshot_id,
            bytes_stored = manifest.bytes_stored,
            "snapshot published"
        );
        Ok(manifest)
    }

    fn claim_name(&self, name: &str) -> Result<(), StoreError> {
        if self.payloads.iter().any(|p| p.name == name) {
            return Err(StoreError::DuplicatePayload { name: name.into() });
        }
        Ok(())
    }

    /// Hashes every chunk, in order, and queues the new ones for the writer. Returns the
    /// chunk refs, the total bytes and the new bytes.
    fn hash_chunks(
        &mut self,
        chunks: &mut dyn Iterator<Item = Result<Vec<u8>, StoreError>>,
        progress: &mut dyn FnMut(u64),
        queue: std::sync::mpsc::SyncSender<(String, Vec<u8>)>,
    ) -> Result<(Vec<ChunkRef>, u64, u64), StoreError> {
        let mut refs = Vec::new();
        let mut total_bytes = 0u64;
        let mut new_bytes = 0u64;
        let hash = self.chunk_hash;
        for data in chunks {
            let data = data?;
            let chunk = ChunkRef {
                hash,
                digest: hash.hex(&data),
                crc32: crc32_hex(&data),
                len: data.len() as u64,
            };
            if self.is_new_chunk(&chunk.digest, &chunk.crc32, chunk.len)? {
                new_bytes += chunk.len;
                if queue.send((chunk.digest.clone(), data)).is_err() {
                    // The writer stopped on an error, which store_payload returns.
                    break;
                }
            }
            total_bytes += chunk.len;
            refs.push(chunk);
            progress(total_bytes);
        }
        Ok((refs, total_bytes, new_bytes))
    }

    /// Whether a chunk must be written: not already in the store (right length under its
    /// final name: only complete, durable chunks ever get that name) nor pending in this build.
    /// A new chunk is recorded as pending (its bytes go to `pending/<sha256>` without an fsync
    /// of their own; [`publish`] makes them durable in one `syncfs`).
    ///
    /// [`publish`]: SnapshotBuilder::publish
    fn is_new_chunk(&mut self, name: &str, crc32: &str, len: u64) -> Result<bool, StoreError> {
        if self.pending.contains_key(name) {
            return Ok(false);
        }
        let path = chunk_path(&self.paths.chunks, name);
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_file() && meta.len() == len => return Ok(false),
            // A chunk of the wrong length is damaged: publishing replaces it with the right bytes.
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(StoreError::ReadChunk { path, source }),
        }
        if self.pending.is_empty() {
            create_private_subdir(&self.dir.join(PENDING_DIR))?;
        }
        self.pending.insert(name.to_string(), crc32.to_string());
        Ok(true)
    }

    /// `syncfs` on the store's file system, then every pending chunk renamed to its final name,
    /// then the chunk directories that changed fsynced.
    fn commit_pending_chunks(&mut self) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending_dir = self.dir.join(PENDING_DIR);
        syncfs(&pending_dir)?;
        // Thousands of renames (one per new chunk) are most of a publish: two threads share
        // them, each over its own part of the sorted list (so mostly its own directories).
        let pending: Vec<(String, String)> =
            std::mem::take(&mut self.pending).into_iter().collect();
        let per = pending.len().div_ceil(RENAME_THREADS).max(1);
        let (paths, pending_dir) = (&*self.paths, &pending_dir);
        let touched = std::thread::scope(|scope| {
            let workers: Vec<_> = pending
                .chunks(per)
                .map(|part| scope.spawn(move || move_chunks(paths, pending_dir, part)))
                .collect();
            let mut touched = BTreeSet::new();
            for w in workers {
                let dirs = w.join().unwrap_or_else(|_| {
                    Err(StoreError::Write {
                        path: pending_dir.clone(),
                        source: io::Error::other("a chunk rename thread panicked"),
                    })
                })?;
                touched.extend(dirs);
            }
            Ok::<_, StoreError>(touched)
        })?;
        fs::remove_dir(pending_dir).map_err(|source| StoreError::Write {
            path: pending_dir.clone(),
            source,
        })?;
        for dir in &touched {
            fsync_dir(dir)?;
        }
        Ok(())
    }
}

/// Threads sharing a publish's chunk renames (435 MB stream, ~6,600 new chunks: 155 → 95 ms;
/// ext4 serialises renames across directories, so more threads add little).
pub(crate) const RENAME_THREADS: usize = 2;

/// Moves each `(sha256, crc32)` chunk from `pending_dir` to its final name (creating its
/// directory when missing) and records it as checked. Returns the directories whose entries
/// changed (the chunks root too, when a chunk directory was created).
fn move_chunks(
    paths: &Paths,
    pending_dir: &Path,
    part: &[(String, String)],
) -> Result<BTreeSet<PathBuf>, StoreError> {
    let mut touched = BTreeSet::new();
    for (sha256, crc32) in part {
        let from = pending_dir.join(sha256);
        let to = chunk_path(&paths.chunks, sha256);
        let dir = to.parent().map(Path::to_path_buf).unwrap_or_default();
        if !touched.contains(&dir) && create_private_subdir(&dir)? {
            touched.insert(paths.chunks.clone());
        }
        fs::rename(&from, &to).map_err(|source| StoreError::Rename {
            from,
            to: to.clone(),
            source,
        })?;
        // Written from bytes hashed in memory, made durable by the syncfs before: checked
        // (recorded after the rename, which moves ctime).
        paths.checked.record_path(&to, sha256, crc32);
        touched.insert(dir);
    }
    Ok(touched)
}

/// Subdirectory of a build directory holding the chunks written by that build.
const PENDING_DIR: &str = "pending";

/// Most new chunks hashed but not yet written (≤ 4 MiB each; QEMU streams cut ~64 KiB).
const WRITE_QUEUE_CHUNKS: usize = 8;

/// The writer stage: each queued chunk into a new file `dir/<sha256>` (mode 0600), no fsync.
/// Stops at the first failure (dropping the queue, which stops the hashing stage).
fn write_pending(
    dir: &Path,
    queued: std::sync::mpsc::Receiver<(String, Vec<u8>)>,
) -> Result<(), StoreError> {
    let (written, to_flush) = std::sync::mpsc::sync_channel::<File>(FLUSH_QUEUE_FILES);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for file in to_flush {
                start_writeback(&file);
            }
        });
        for (sha256, data) in queued {
            let path = dir.join(&sha256);
            let err = |source| StoreError::Write {
                path: path.clone(),
                source,
            };
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(err)?;
            file.write_all(&data).map_err(err)?;
            let _ = written.send(file);
        }
        // The flusher ends when its queue does; the scope waits for it.
        drop(written);
        Ok(())
    })
}

/// Files written but not yet handed to the disk, at most (each holds a descriptor).
const FLUSH_QUEUE_FILES: usize = 64;

/// Starts the disk write of a chunk file just written, without waiting for it
/// (`sync_file_range` with `SYNC_FILE_RANGE_WRITE` only), on the writer's flusher thread: the
/// bytes go out while the next chunks are hashed and written, so `publish`'s syncfs finds little
/// left to do (measured on a 435 MB stream: syncfs 220 ms → 10 ms). Not a durability step —
/// that is still the syncfs — so a file system that refuses it loses only the overlap.
fn start_writeback(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: sync_file_range only reads the descriptor, which `file` keeps open for the call.
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
}

/// Flushes the whole file system holding `dir` (data and metadata) and waits for it: one call
/// instead of an fsync per chunk. Linux reports writeback errors through it since 5.8.
fn syncfs(dir: &Path) -> Result<(), StoreError> {
    use std::os::fd::AsRawFd;
    let err = |source| StoreError::Fsync {
        path: dir.into(),
        source,
    };
    let file = File::open(dir).map_err(err)?;
    // SAFETY: syncfs only reads the descriptor, which `file` keeps open for the call.
    if unsafe { libc::syncfs(file.as_raw_fd()) } != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

impl Drop for SnapshotBuilder {
    fn drop(&mut self) {
        if !self.published {
            // Best effort: whatever is left is swept at the next open.
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A reader that retries a read interrupted by a signal (`EINTR`), as `Read::read_exact` does.
///
/// FastCDC's `StreamCDC` passes `ErrorKind::Interrupted` up as a failure, which would fail a whole
/// payload over a signal that arrived during a read. (The same bug the `stream_cutter` fuzz target
/// found in the QEMU backend's cutter, which feeds FastCDC the same way.)
struct RetryInterrupted<R>(R);

impl<R: Read> Read for RetryInterrupted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.0.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
}
