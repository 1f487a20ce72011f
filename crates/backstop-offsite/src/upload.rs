//! The per-daemon uploader: one thread that finds every published snapshot of this daemon's
//! VMs (a scan of each store's `snapshots/` once a second, so a snapshot published while the
//! daemon was down, or just before a crash, is found too), records it in the durable queue and
//! uploads it: chunks and disk layers first, content-addressed (HEAD before PUT: an object
//! already there is not sent), on `max_concurrent_uploads` threads through one bandwidth cap;
//! then the indexes, the manifest and its ed25519 signature last. A failed attempt is retried
//! with backoff. It reads only published, immutable files: nothing local ever waits on it.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backstop_common::{AuditEvent, ErrorCode};
use backstop_integrity::HostKey;
use backstop_store::{
    check_signature, decode_manifest, is_snapshot_id, ChunkIndex, Manifest, VerifyOptions,
    MANIFEST_FILE, MANIFEST_MAX_BYTES, SIGNATURE_FILE,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::OffsiteConfig;
use crate::keys::HostSigningKey;
use crate::queue::{backoff_ms, Entry, EntryState, Queue};
use crate::s3::{Client, S3Error};

/// The ed25519 signature object's name beside `manifest.json`.
pub const SIGNATURE_OBJECT: &str = "manifest.ed25519";

/// One VM's store, as the uploader sees it.
#[derive(Debug, Clone)]
pub struct VmStore {
    pub vm: String,
    /// The store's root (`<vm state dir>/store`).
    pub store: PathBuf,
}

/// Journals an event (the daemon journal): event, snapshot id, result, fields.
pub type JournalFn = Box<dyn Fn(AuditEvent, &str, &str, Value) + Send + Sync>;
/// The VMs' stores right now (VMs come and go with reloads).
pub type StoresFn = Box<dyn Fn() -> Vec<VmStore> + Send + Sync>;

/// A failed attempt: a code from the spec's list and one line.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    fn new(code: ErrorCode, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<S3Error> for Failure {
    fn from(e: S3Error) -> Failure {
        let code = match e {
            S3Error::Local { .. } => ErrorCode::StoreIo,
            S3Error::Digest { .. } => ErrorCode::SnapshotIntegrityCheckFailed,
            _ => ErrorCode::OffsiteUnreachable,
        };
        Failure::new(code, e.to_string())
    }
}

/// What one upload did.
#[derive(Debug, Default, Clone, Copy)]
pub struct UploadStats {
    pub bytes_uploaded: u64,
    pub objects_uploaded: u64,
    pub objects_present: u64,
}

/// The queue as `status` shows it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct QueueView {
    pub host: String,
    pub endpoint: String,
    pub bucket: String,
    pub pending: u64,
    pub uploaded: u64,
    /// `vm/snapshot_id` being uploaded now.
    pub uploading: Option<String>,
    pub last_error: Option<String>,
    pub bytes_uploaded_total: u64,
}

struct Inner {
    cfg: OffsiteConfig,
    client: Client,
    queue: Mutex<Queue>,
    hmac: HostKey,
    signer: HostSigningKey,
    stores: StoresFn,
    journal: JournalFn,
    current: Mutex<Option<String>>,
    bytes_total: AtomicU64,
    stop: AtomicBool,
}

/// The running uploader (cheap to clone).
#[derive(Clone)]
pub struct Uploader {
    inner: Arc<Inner>,
}

impl Uploader {
    /// Opens the queue at `queue_path` and starts the uploader thread.
    pub fn start(
        cfg: OffsiteConfig,
        queue_path: &Path,
        hmac: HostKey,
        signer: HostSigningKey,
        stores: StoresFn,
        journal: JournalFn,
    ) -> Result<Uploader, String> {
        let queue = Queue::open(queue_path).map_err(|e| e.to_string())?;
        crate::tls::warn_if_cleartext(&cfg.endpoint);
        let client = Client::new(&cfg, Duration::from_secs(300));
        let inner = Arc::new(Inner {
            cfg,
            client,
            queue: Mutex::new(queue),
            hmac,
            signer,
            stores,
            journal,
            current: Mutex::new(None),
            bytes_total: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let run = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("offsite-upload".into())
            .spawn(move || run_loop(&run))
            .map_err(|e| format!("spawn the uploader: {e}"))?;
        Ok(Uploader { inner })
    }

    /// This snapshot's queue entry, if any.
    pub fn entry(&self, vm: &str, snapshot_id: &str) -> Option<Entry> {
        lock(&self.inner.queue).get(vm, snapshot_id).cloned()
    }

    pub fn is_uploading(&self, vm: &str, snapshot_id: &str) -> bool {
        lock(&self.inner.current).as_deref() == Some(&format!("{vm}/{snapshot_id}"))
    }

    pub fn view(&self) -> QueueView {
        let q = lock(&self.inner.queue);
        let mut v = QueueView {
            host: self.inner.cfg.host.clone(),
            endpoint: self.inner.cfg.endpoint.clone(),
            bucket: self.inner.cfg.bucket.clone(),
            uploading: lock(&self.inner.current).clone(),
            bytes_uploaded_total: self.inner.bytes_total.load(Ordering::Relaxed),
            ..QueueView::default()
        };
        for e in q.entries() {
            match e.state {
                EntryState::Pending => {
                    v.pending += 1;
                    if e.last_error.is_some() {
                        v.last_error.clone_from(&e.last_error);
                    }
                }
                EntryState::Uploaded => v.uploaded += 1,
            }
        }
        v
    }

    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn run_loop(inner: &Inner) {
    let mut last_scan = 0u64;
    while !inner.stop.load(Ordering::SeqCst) {
        if now_ms().saturating_sub(last_scan) >= 1000 {
            scan(inner);
            last_scan = now_ms();
        }
        let due = lock(&inner.queue).next_due(now_ms());
        match due {
            Some(e) => attempt(inner, e),
            None => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Published snapshot ids of one store (directories of `snapshots/` named like an id).
fn published(store: &Path) -> BTreeSet<String> {
    let Ok(rd) = std::fs::read_dir(store.join("snapshots")) else {
        return BTreeSet::new();
    };
    rd.filter_map(Result::ok)
        .filter_map(|d| d.file_name().into_string().ok())
        .filter(|n| is_snapshot_id(n))
        .collect()
}

fn scan(inner: &Inner) {
    let stores = (inner.stores)();
    let now = backstop_common::time::now_rfc3339();
    let mut changed = false;
    let mut q = lock(&inner.queue);
    for s in &stores {
        let ids = published(&s.store);
        // Oldest first by creation time, so the queue uploads in the order they were taken.
        let mut fresh: Vec<(String, String)> = ids
            .iter()
            .filter(|id| q.get(&s.vm, id).is_none())
            .map(|id| (created_at(&s.store, id), id.clone()))
            .collect();
        fresh.sort();
        for (_, id) in fresh {
            changed |= q.enqueue(&s.vm, &id, &now);
        }
        changed |= q.retain_published(&s.vm, &|id| ids.contains(id));
    }
    if changed {
        if let Err(e) = q.save() {
            tracing::error!(error = %e, "offsite queue not saved");
        }
    }
}

/// `created_at` of a published manifest (unverified: only for ordering the queue).
fn created_at(store: &Path, id: &str) -> String {
    std::fs::read(store.join("snapshots").join(id).join(MANIFEST_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v["created_at"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn attempt(inner: &Inner, mut e: Entry) {
    let Some(store) = (inner.stores)().into_iter().find(|s| s.vm == e.vm) else {
        // The VM is gone (removed at a reload): nothing to upload from.
        return drop_entry(inner, &e);
    };
    *lock(&inner.current) = Some(format!("{}/{}", e.vm, e.snapshot_id));
    e.attempts += 1;
    let started = std::time::Instant::now();
    let result = upload_snapshot(inner, &store.store, &e.snapshot_id);
    *lock(&inner.current) = None;
    match result {
        Ok(None) => drop_entry(inner, &e),
        Ok(Some(stats)) => {
            let ms = started.elapsed().as_millis() as u64;
            tracing::info!(vm = %e.vm, snapshot_id = %e.snapshot_id, bytes = stats.bytes_uploaded,
                objects = stats.objects_uploaded, present = stats.objects_present, ms,
                "snapshot replicated");
            e.state = EntryState::Uploaded;
            e.bytes_uploaded = stats.bytes_uploaded;
            e.objects_uploaded = stats.objects_uploaded;
            e.objects_present = stats.objects_present;
            e.last_error = None;
            e.uploaded_at = Some(backstop_common::time::now_rfc3339());
            (inner.journal)(
                AuditEvent::SnapshotReplicated,
                &e.snapshot_id,
                "ok",
                json!({"vm": e.vm, "host": inner.cfg.host, "bytes_uploaded": stats.bytes_uploaded,
                    "objects_uploaded": stats.objects_uploaded, "objects_present": stats.objects_present,
                    "attempts": e.attempts, "upload_ms": ms}),
            );
            save_entry(inner, e);
        }
        Err(f) => {
            let wait = backoff_ms(e.attempts, inner.cfg.retry_max_s);
            tracing::warn!(vm = %e.vm, snapshot_id = %e.snapshot_id, code = %f.code,
                error = %f.message, attempts = e.attempts, retry_in_ms = wait, "snapshot upload failed");
            e.last_error = Some(format!("{}: {}", f.code, f.message));
            e.not_before_ms = now_ms() + wait;
            // Journaled at the first failure and then at every power of two: a gateway down for
            // a day is a few dozen entries, not thousands.
            if e.attempts.is_power_of_two() {
                (inner.journal)(
                    AuditEvent::SnapshotReplicationFailed,
                    &e.snapshot_id,
                    "failed",
                    json!({"vm": e.vm, "code": f.code.as_str(), "error": f.message,
                        "attempts": e.attempts, "retry_in_ms": wait}),
                );
            }
            save_entry(inner, e);
        }
    }
}

fn save_entry(inner: &Inner, e: Entry) {
    let mut q = lock(&inner.queue);
    q.update(e);
    if let Err(err) = q.save() {
        tracing::error!(error = %err, "offsite queue not saved");
    }
}

fn drop_entry(inner: &Inner, e: &Entry) {
    let mut q = lock(&inner.queue);
    q.retain_published(&e.vm, &|id| id != e.snapshot_id);
    if let Err(err) = q.save() {
        tracing::error!(error = %err, "offsite queue not saved");
    }
}

/// One object to make sure of in the bucket.
struct Object {
    key: String,
    path: PathBuf,
    len: u64,
    sha256: String,
}

/// Uploads one snapshot; `Ok(None)` if it is no longer published here.
fn upload_snapshot(inner: &Inner, store: &Path, id: &str) -> Result<Option<UploadStats>, Failure> {
    let dir = store.join("snapshots").join(id);
    let read = |name: &str, limit: u64| -> Result<Option<Vec<u8>>, Failure> {
        match std::fs::read(dir.join(name)) {
            Ok(b) if b.len() as u64 <= limit => Ok(Some(b)),
            Ok(_) => Err(Failure::new(
                ErrorCode::SnapshotIntegrityCheckFailed,
                format!("{id}/{name}: larger than {limit} bytes"),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Failure::new(
                ErrorCode::StoreIo,
                format!("{id}/{name}: {e}"),
            )),
        }
    };
    let (Some(manifest_bytes), Some(sig)) = (
        read(MANIFEST_FILE, MANIFEST_MAX_BYTES)?,
        read(SIGNATURE_FILE, 256)?,
    ) else {
        return Ok(None);
    };
    // Only what this host signed leaves it, and it leaves with the ed25519 signature too.
    let integrity = |e: backstop_store::StoreError| Failure::new(e.code(), e.to_string());
    check_signature(&inner.hmac, id, &manifest_bytes, &sig).map_err(integrity)?;
    let opts = VerifyOptions {
        allow_newer_minor: true,
    };
    let manifest: Manifest = decode_manifest(id, &manifest_bytes, &opts).map_err(integrity)?;

    let cfg = &inner.cfg;
    let snap_prefix = cfg.key(&format!("hosts/{}/snapshots/{id}", cfg.host));
    let mut objects = Vec::new();
    let mut seen = BTreeSet::new();
    let mut indexes = Vec::new();
    for p in &manifest.payload_refs {
        if let Some(index_name) = &p.index {
            let Some(bytes) = read(index_name, backstop_store::INDEX_MAX_BYTES)? else {
                return Ok(None);
            };
            let index = ChunkIndex::parse(&bytes).map_err(|e| {
                Failure::new(
                    ErrorCode::SnapshotIntegrityCheckFailed,
                    format!("{id}/{index_name}: {e}"),
                )
            })?;
            for c in &index.chunks {
                if seen.insert(c.sha256.clone()) {
                    objects.push(Object {
                        key: cfg.key(&format!("chunks/{}", c.sha256)),
                        path: store.join("chunks").join(&c.sha256[..2]).join(&c.sha256),
                        len: c.len,
                        sha256: c.sha256.clone(),
                    });
                }
            }
            indexes.push((index_name.clone(), bytes));
        }
        for l in &p.layers {
            if seen.insert(l.sha256.clone()) {
                objects.push(Object {
                    key: cfg.key(&format!("layers/{}", l.sha256)),
                    path: l.path.clone(),
                    len: l.bytes,
                    sha256: l.sha256.clone(),
                });
            }
        }
    }
    inner.client.ensure_bucket()?;

    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<Failure>> = Mutex::new(None);
    let bytes = AtomicU64::new(0);
    let sent = AtomicU64::new(0);
    let present = AtomicU64::new(0);
    let threads = (cfg.max_concurrent_uploads as usize)
        .min(objects.len())
        .max(1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                if lock(&failed).is_some() || inner.stop.load(Ordering::SeqCst) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(o) = objects.get(i) else { return };
                match put_object(inner, o) {
                    Ok(true) => {
                        sent.fetch_add(1, Ordering::Relaxed);
                        bytes.fetch_add(o.len, Ordering::Relaxed);
                        inner.bytes_total.fetch_add(o.len, Ordering::Relaxed);
                    }
                    Ok(false) => {
                        present.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(f) => {
                        lock(&failed).get_or_insert(f);
                        return;
                    }
                }
            });
        }
    });
    if let Some(f) = lock(&failed).take() {
        return Err(f);
    }
    if inner.stop.load(Ordering::SeqCst) {
        return Err(Failure::new(
            ErrorCode::ShuttingDown,
            "the daemon is stopping",
        ));
    }
    // Then what points at them; the manifest and its signature last.
    for (name, b) in &indexes {
        inner.client.put(&format!("{snap_prefix}/{name}"), b)?;
    }
    inner
        .client
        .put(&format!("{snap_prefix}/{MANIFEST_FILE}"), &manifest_bytes)?;
    let signature = inner.signer.sign_manifest(&manifest_bytes);
    inner.client.put(
        &format!("{snap_prefix}/{SIGNATURE_OBJECT}"),
        signature.as_bytes(),
    )?;
    let small: u64 = indexes.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
        + manifest_bytes.len() as u64
        + signature.len() as u64;
    Ok(Some(UploadStats {
        bytes_uploaded: bytes.load(Ordering::Relaxed) + small,
        objects_uploaded: sent.load(Ordering::Relaxed) + indexes.len() as u64 + 2,
        objects_present: present.load(Ordering::Relaxed),
    }))
}

/// HEAD, then PUT unless an object of the right length is there; true if sent. A chunk is
/// checked against its name before it leaves (a damaged local chunk is not replicated); a
/// layer's digest goes with the PUT and the gateway refuses bytes that do not match it.
fn put_object(inner: &Inner, o: &Object) -> Result<bool, Failure> {
    if inner.client.head(&o.key)? == Some(o.len) {
        return Ok(false);
    }
    let local =
        |e: std::io::Error| Failure::new(ErrorCode::StoreIo, format!("{}: {e}", o.path.display()));
    if o.len <= u64::from(backstop_store::CHUNK_MAX_BYTES) {
        let b = std::fs::read(&o.path).map_err(local)?;
        if b.len() as u64 != o.len || hex::encode(Sha256::digest(&b)) != o.sha256 {
            return Err(Failure::new(
                ErrorCode::SnapshotIntegrityCheckFailed,
                format!(
                    "{}: does not match its digest; not uploaded",
                    o.path.display()
                ),
            ));
        }
        inner.client.throttle.take(0);
        inner
            .client
            .put_reader(&o.key, &mut &b[..], o.len, &o.sha256)?;
    } else if o.len > u64::from(inner.cfg.multipart_threshold_mib) * 1024 * 1024 {
        // In parts: past S3's 5 GiB single PUT, and a failed part is sent again alone.
        let mut f = File::open(&o.path).map_err(local)?;
        let part = u64::from(inner.cfg.multipart_part_mib) * 1024 * 1024;
        inner
            .client
            .put_multipart(&o.key, &mut f, o.len, &o.sha256, part)?;
    } else {
        let mut f = File::open(&o.path).map_err(local)?;
        inner.client.put_reader(&o.key, &mut f, o.len, &o.sha256)?;
    }
    Ok(true)
}
