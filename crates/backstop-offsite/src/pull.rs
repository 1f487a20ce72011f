//! `snapshot pull`: another host's snapshot fetched from the bucket, checked and published into
//! this host's store. In this order: the ed25519 signature over the raw manifest bytes against
//! the fleet trust file (nothing is decoded before) → the manifest's fields and content id →
//! every index against the signed digests → every chunk and disk layer against its digests,
//! each staged in a private directory → only then, on the VM's actor thread, one publication by
//! the store's atomic rename ([`publish`]). Any failure leaves nothing published.
//!
//! The pulled snapshot is this host's own from then on: a new id (its layers live here, at
//! other paths), signed with this host's keys, its origin (`host`, `snapshot_id`) recorded in
//! the manifest's `capture.pulled_from`. It is a new root in this VM's lineage.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use backstop_common::ErrorCode;
use backstop_store::{
    decode_manifest, is_snapshot_id, ChunkHash, ChunkIndex, Lineage, Manifest, ManifestInput,
    Store, VerifyOptions, DISK_PAYLOAD_PREFIX, MANIFEST_FILE, MANIFEST_MAX_BYTES,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::{is_valid_host, OffsiteConfig};
use crate::keys::TrustFile;
use crate::s3::{Client, S3Error};
use crate::upload::SIGNATURE_OBJECT;

/// Why a pull was refused: a spec code and one line. Nothing was published.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct PullError {
    pub code: ErrorCode,
    pub message: String,
}

fn err(code: ErrorCode, message: impl Into<String>) -> PullError {
    PullError {
        code,
        message: message.into(),
    }
}

fn integrity(message: impl Into<String>) -> PullError {
    err(ErrorCode::SnapshotIntegrityCheckFailed, message)
}

fn s3(e: S3Error) -> PullError {
    err(ErrorCode::OffsiteUnreachable, e.to_string())
}

/// One payload, staged.
#[derive(Debug)]
pub enum StagedPayload {
    Chunked {
        name: String,
        kind: String,
        /// Staged chunk files in stream order (a chunk repeated in the stream repeats here).
        chunks: Vec<PathBuf>,
    },
    Disk {
        disk_id: String,
        /// Staged layer files, base first, each under its original file name.
        layers: Vec<PathBuf>,
    },
}

/// A verified snapshot waiting to be published; its staging directory goes with it.
#[derive(Debug)]
pub struct Staged {
    dir: PathBuf,
    pub from: String,
    pub manifest: Manifest,
    pub payloads: Vec<StagedPayload>,
    pub bytes_fetched: u64,
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Writes to a file while hashing.
struct Hashing {
    file: File,
    sha: Sha256,
    crc: crc32fast::Hasher,
}

impl Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.sha.update(&buf[..n]);
        self.crc.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Fetches and checks snapshot `id` of host `from` into a fresh directory under `staging_root`.
pub fn fetch(
    cfg: &OffsiteConfig,
    client: &Client,
    trust: &TrustFile,
    from: &str,
    id: &str,
    staging_root: &Path,
) -> Result<Staged, PullError> {
    if !is_valid_host(from) {
        return Err(err(
            ErrorCode::BadRequest,
            format!("--from {from:?}: not a host name"),
        ));
    }
    if !is_snapshot_id(id) {
        return Err(err(
            ErrorCode::BadRequest,
            format!("{id:?}: a pull names the full snapshot id (32 hex digits)"),
        ));
    }
    let prefix = cfg.key(&format!("hosts/{from}/snapshots/{id}"));
    let missing = |e: S3Error| {
        if e.is_not_found() {
            err(
                ErrorCode::MissingSnapshot,
                format!("{from} has no replicated snapshot {id} in the bucket"),
            )
        } else {
            s3(e)
        }
    };
    let sig = client
        .get(&format!("{prefix}/{SIGNATURE_OBJECT}"), 256)
        .map_err(missing)?;
    // The signature is there, so the snapshot is: its manifest gone means it is not whole.
    let manifest_bytes = client
        .get(&format!("{prefix}/{MANIFEST_FILE}"), MANIFEST_MAX_BYTES)
        .map_err(|e| {
            if e.is_not_found() {
                integrity(format!(
                    "{from}'s replicated snapshot {id} has a signature but no {MANIFEST_FILE} in the bucket"
                ))
            } else {
                s3(e)
            }
        })?;
    // Before a byte of it is decoded.
    trust
        .verify(from, &manifest_bytes, &sig)
        .map_err(|e| err(e.code(), e.to_string()))?;
    let opts = VerifyOptions {
        allow_newer_minor: false,
    };
    let manifest =
        decode_manifest(id, &manifest_bytes, &opts).map_err(|e| err(e.code(), e.to_string()))?;

    fs::create_dir_all(staging_root)
        .map_err(|e| err(ErrorCode::Io, format!("{}: {e}", staging_root.display())))?;
    let mut rnd = [0u8; 8];
    getrandom::fill(&mut rnd).map_err(|e| err(ErrorCode::Io, e.to_string()))?;
    let dir = staging_root.join(format!("pull-{}", hex::encode(rnd)));
    let io = |p: &Path, e: std::io::Error| err(ErrorCode::Io, format!("{}: {e}", p.display()));
    fs::create_dir(&dir).map_err(|e| io(&dir, e))?;
    let mut staged = Staged {
        dir: dir.clone(),
        from: from.into(),
        manifest,
        payloads: Vec::new(),
        bytes_fetched: 0,
    };
    let chunks_dir = dir.join("chunks");
    fs::create_dir(&chunks_dir).map_err(|e| io(&chunks_dir, e))?;
    let checksum = |reference: &str| {
        staged
            .manifest
            .checksums
            .iter()
            .find(|c| c.reference == reference)
            .cloned()
    };
    let mut payloads = Vec::new();
    let mut fetched = 0u64;
    for p in &staged.manifest.payload_refs {
        if let Some(index_name) = &p.index {
            let want = checksum(index_name)
                .ok_or_else(|| integrity(format!("{id}: no checksum for {index_name}")))?;
            let bytes = client
                .get(
                    &format!("{prefix}/{index_name}"),
                    backstop_store::INDEX_MAX_BYTES,
                )
                .map_err(s3)?;
            fetched += bytes.len() as u64;
            if hex::encode(Sha256::digest(&bytes)) != want.sha256
                || format!("{:08x}", crc32fast::hash(&bytes)) != want.crc32
            {
                return Err(integrity(format!(
                    "{from}/{id}: index {index_name} in the bucket does not match the signed manifest"
                )));
            }
            let index = ChunkIndex::parse(&bytes)
                .map_err(|e| integrity(format!("{from}/{id}: index {index_name}: {e}")))?;
            let mut chunks = Vec::with_capacity(index.chunks.len());
            let mut wanted = Vec::new();
            let mut seen = std::collections::HashSet::new();
            for c in &index.chunks {
                let path = chunks_dir.join(&c.digest);
                if !path.exists() && seen.insert(c.digest.as_str()) {
                    wanted.push(c);
                }
                chunks.push(path);
            }
            fetched += fetch_chunks(cfg, client, &chunks_dir, &wanted, from, id)?;
            payloads.push(StagedPayload::Chunked {
                name: p.name.clone(),
                kind: p.kind.clone(),
                chunks,
            });
        } else if let Some(disk_id) = p.name.strip_prefix(DISK_PAYLOAD_PREFIX) {
            let ddir = dir.join("disks").join(disk_id);
            fs::create_dir_all(&ddir).map_err(|e| io(&ddir, e))?;
            let mut layers = Vec::new();
            for l in &p.layers {
                let file_name = l
                    .path
                    .file_name()
                    .ok_or_else(|| integrity(format!("{id}: a layer path without a file name")))?;
                let path = ddir.join(file_name);
                let (len, sha, crc) = get_hashed(
                    client,
                    &cfg.key(&format!("layers/{}", l.sha256)),
                    l.bytes,
                    &path,
                )?;
                if len != l.bytes || sha != l.sha256 || crc != l.crc32 {
                    return Err(integrity(format!(
                        "{from}/{id}: disk layer {} in the bucket does not match the signed digest; nothing published",
                        l.sha256
                    )));
                }
                fetched += len;
                layers.push(path);
            }
            payloads.push(StagedPayload::Disk {
                disk_id: disk_id.into(),
                layers,
            });
        } else {
            return Err(integrity(format!(
                "{id}: payload {} has neither index nor disk",
                p.name
            )));
        }
    }
    staged.payloads = payloads;
    staged.bytes_fetched = fetched;
    Ok(staged)
}

/// How many chunk objects a pull fetches at once (each GET is a round trip; measured on a
/// local RGW, 202 MB took 84–107 s one at a time, 24 s on 4 threads — most of that was the
/// gateway's missing `tcp_nodelay`, see README: with it, 172 MB in 3.9 s).
const PULL_THREADS: usize = 4;

/// Fetches `wanted` chunks into `chunks_dir` on [`PULL_THREADS`] threads, each checked against
/// its signed digest before it gets its name; the first failure stops the others and is
/// returned. Returns the bytes fetched.
fn fetch_chunks(
    cfg: &OffsiteConfig,
    client: &Client,
    chunks_dir: &Path,
    wanted: &[&backstop_store::ChunkRef],
    from: &str,
    id: &str,
) -> Result<u64, PullError> {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let first_error = std::sync::Mutex::new(None);
    let one = |c: &backstop_store::ChunkRef| -> Result<u64, PullError> {
        let path = chunks_dir.join(&c.digest);
        let tmp = chunks_dir.join(format!("{}.part", c.digest));
        let (len, sha, crc) = get_hashed(
            client,
            &cfg.key(&format!("chunks/{}", c.digest)),
            c.len,
            &tmp,
        )?;
        let matches = match c.hash {
            ChunkHash::Sha256 => len == c.len && sha == c.digest && crc == c.crc32,
            // Hashed while it was written for sha256 only: a chunk named by BLAKE3 (at most
            // 4 MiB, still in the page cache) is read back and checked whole.
            ChunkHash::Blake3 => fs::read(&tmp).is_ok_and(|b| c.matches(&b)),
        };
        if !matches {
            return Err(integrity(format!(
                "{from}/{id}: chunk {} in the bucket does not match the signed digest (got sha256 {sha}, {len} bytes); nothing published",
                c.digest
            )));
        }
        fs::rename(&tmp, &path)
            .map_err(|e| err(ErrorCode::Io, format!("{}: {e}", path.display())))?;
        Ok(len)
    };
    std::thread::scope(|scope| {
        for _ in 0..PULL_THREADS.min(wanted.len()) {
            scope.spawn(|| {
                while !failed.load(Ordering::Acquire) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = wanted.get(i) else { break };
                    match one(c) {
                        Ok(n) => {
                            bytes.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Release);
                            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(bytes.into_inner()),
    }
}

/// GETs `key` (at most `limit` bytes) into `path`: (length, sha256, crc32).
fn get_hashed(
    client: &Client,
    key: &str,
    limit: u64,
    path: &Path,
) -> Result<(u64, String, String), PullError> {
    let file =
        File::create(path).map_err(|e| err(ErrorCode::Io, format!("{}: {e}", path.display())))?;
    let mut w = Hashing {
        file,
        sha: Sha256::new(),
        crc: crc32fast::Hasher::new(),
    };
    let len = match client.get_to(key, limit, &mut w) {
        Ok(n) => n,
        Err(S3Error::TooLarge { key, .. }) => {
            return Err(integrity(format!("{key} is longer than its signed length")))
        }
        Err(e) if e.is_not_found() => {
            return Err(integrity(format!("{key} is missing from the bucket")))
        }
        Err(e) => return Err(s3(e)),
    };
    // Not fsync'd: staging is thrown away after a crash, and the store makes what it publishes
    // durable itself.
    Ok((
        len,
        hex::encode(w.sha.finalize()),
        format!("{:08x}", w.crc.finalize()),
    ))
}

/// Publishes a staged snapshot into `store` as VM `vm`'s, its disk layers moved under
/// `layers_dir/pulled-<remote id>/<disk>/` and re-pointed at each other (`qemu-img rebase -u`).
/// Runs on the VM's actor thread (serialized with its captures and retention). On failure the
/// moved layers are removed and the build directory is swept: nothing is published.
pub fn publish(
    staged: &Staged,
    store: &Store,
    vm: &str,
    layers_dir: &Path,
    qemu_img: &Path,
) -> Result<Manifest, PullError> {
    let remote = &staged.manifest;
    let dest_root = layers_dir.join(format!("pulled-{}", remote.snapshot_id));
    if dest_root.exists() {
        return Err(err(
            ErrorCode::BadRequest,
            format!(
                "{} was already pulled here ({} exists)",
                remote.snapshot_id,
                dest_root.display()
            ),
        ));
    }
    let result = publish_into(staged, store, vm, &dest_root, qemu_img);
    if result.is_err() {
        let _ = fs::remove_dir_all(&dest_root);
    }
    result
}

fn publish_into(
    staged: &Staged,
    store: &Store,
    vm: &str,
    dest_root: &Path,
    qemu_img: &Path,
) -> Result<Manifest, PullError> {
    let remote = &staged.manifest;
    let store_err = |e: backstop_store::StoreError| err(e.code(), e.to_string());
    let io = |p: &Path, e: std::io::Error| err(ErrorCode::Io, format!("{}: {e}", p.display()));
    let mut b = store.begin().map_err(store_err)?;
    for p in &staged.payloads {
        match p {
            StagedPayload::Chunked { name, kind, chunks } => {
                let mut iter = chunks.iter().map(|path| {
                    let mut buf = Vec::new();
                    File::open(path)?.read_to_end(&mut buf)?;
                    Ok(buf)
                });
                b.write_chunks(name, kind, &mut iter, &mut |_| {})
                    .map_err(store_err)?;
            }
            StagedPayload::Disk { disk_id, layers } => {
                let ddir = dest_root.join(disk_id);
                fs::create_dir_all(&ddir).map_err(|e| io(&ddir, e))?;
                let mut placed: Vec<PathBuf> = Vec::new();
                for l in layers {
                    let to = ddir.join(l.file_name().unwrap_or_default());
                    if fs::rename(l, &to).is_err() {
                        fs::copy(l, &to).map_err(|e| io(&to, e))?;
                    }
                    if let Some(below) = placed.last() {
                        rebase(qemu_img, &to, below)?;
                    }
                    placed.push(to);
                }
                for p in &placed {
                    use std::os::unix::fs::PermissionsExt;
                    fs::set_permissions(p, fs::Permissions::from_mode(0o400))
                        .map_err(|e| io(p, e))?;
                }
                b.add_disk_chain(disk_id, &placed).map_err(store_err)?;
            }
        }
    }
    let mut capture = remote.capture.clone();
    let origin = json!({"host": staged.from, "snapshot_id": remote.snapshot_id,
        "created_at": remote.created_at});
    match &mut capture {
        Value::Object(m) => {
            m.insert("pulled_from".into(), origin);
        }
        other => *other = json!({"pulled_from": origin}),
    }
    b.publish(ManifestInput {
        created_by: remote.created_by.clone(),
        reason: remote.reason.clone(),
        scope: remote.scope.clone(),
        vm: vm.into(),
        trigger: remote.trigger.clone(),
        epoch: remote.epoch,
        config_fingerprint: remote.config_fingerprint.clone(),
        capture,
        lineage: Some(Lineage { parent: None }),
        name: None,
    })
    .map_err(store_err)
}

/// Points the overlay `layer` at `below` (its format read by `qemu-img info`); `-u`: only the
/// header changes, the data is the same.
fn rebase(qemu_img: &Path, layer: &Path, below: &Path) -> Result<(), PullError> {
    let run = |args: &[&std::ffi::OsStr]| -> Result<Vec<u8>, PullError> {
        let out = Command::new(qemu_img)
            .args(args)
            .output()
            .map_err(|e| err(ErrorCode::Io, format!("{}: {e}", qemu_img.display())))?;
        if !out.status.success() {
            return Err(err(
                ErrorCode::Io,
                format!(
                    "qemu-img {:?}: {}",
                    args.first(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(out.stdout)
    };
    let info = run(&[
        "info".as_ref(),
        "--output=json".as_ref(),
        "-U".as_ref(),
        below.as_os_str(),
    ])?;
    let fmt = serde_json::from_slice::<Value>(&info)
        .ok()
        .and_then(|v| v["format"].as_str().map(str::to_string))
        .ok_or_else(|| err(ErrorCode::Io, format!("{}: no format", below.display())))?;
    run(&[
        "rebase".as_ref(),
        "-u".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
        "-b".as_ref(),
        below.as_os_str(),
        "-F".as_ref(),
        fmt.as_ref(),
        layer.as_os_str(),
    ])?;
    Ok(())
}
