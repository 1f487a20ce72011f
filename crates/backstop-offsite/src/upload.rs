//! The per-daemon uploader: one thread that finds every published snapshot of this daemon's
//! VMs (a scan of each store's `snapshots/` once a second, so a snapshot published while the
//! daemon was down, or just before a crash, is found too), records it in the durable queue and
//! uploads it: chunks and disk layers first, content-addressed (an object already there is not
//! sent again: see `put_object`), on `max_concurrent_uploads` threads through one bandwidth
//! cap; then the indexes, the manifest and its ed25519 signature last. A failed attempt is retried
//! with backoff. It reads only published, immutable files: nothing local ever waits on it.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backstop_common::{AuditEvent, ErrorCode};
use backstop_integrity::{sha256_hex, HostKey};
use backstop_store::{
    check_signature, decode_manifest, is_snapshot_id, ChunkHash, ChunkIndex, ChunkRef, Manifest,
    VerifyOptions, MANIFEST_FILE, MANIFEST_MAX_BYTES, SIGNATURE_FILE,
};
use serde_json::{json, Value};

use crate::config::OffsiteConfig;
use crate::keys::HostSigningKey;
use crate::queue::{backoff_ms, Entry, EntryState, Queue};
use crate::retention::{self, GcError, GcReport};
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
            S3Error::Digest { .. } => ErrorCode::SnapshotIntegrityCheckFailed,
            _ => e.code(),
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
    /// Bytes of objects PUT because they looked new (not in the parent snapshot) but that the
    /// bucket had already (`If-None-Match` refused them): sent, not stored again.
    pub bytes_resent: u64,
}

/// What [`put_object`] did with one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Put {
    /// Sent and stored.
    Created,
    /// Already there (found by HEAD, or remembered): nothing sent.
    Present,
    /// Already there, found out by sending it (`If-None-Match: *` refused it).
    Resent,
}

/// A change of the replication lag worth a journal entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LagChange {
    /// The oldest queued snapshot has waited longer than `lag_threshold_s`.
    Lagging,
    /// No queued snapshot has waited that long any more (or the queue is empty).
    CaughtUp,
}

/// The lag decision: `oldest_wait_ms` is how long the oldest pending snapshot has waited
/// (`None`: nothing pending). Journaled once when the threshold is passed, once when it is not
/// any more.
pub fn lag_change(
    was_lagging: bool,
    oldest_wait_ms: Option<u64>,
    threshold_s: u64,
) -> Option<LagChange> {
    let over = oldest_wait_ms.is_some_and(|w| w > threshold_s.saturating_mul(1000));
    match (was_lagging, over) {
        (false, true) => Some(LagChange::Lagging),
        (true, false) => Some(LagChange::CaughtUp),
        _ => None,
    }
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
    /// How long the oldest pending snapshot has waited, seconds.
    pub oldest_pending_s: Option<u64>,
    /// It has waited longer than `lag_threshold_s` (journaled as
    /// `snapshot.replication.lagging`).
    pub lagging: bool,
    pub lag_threshold_s: u64,
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
    /// Since when (unix ms) the queue has lagged; 0: it does not.
    lagging_since_ms: AtomicU64,
    /// One remote GC pass at a time (the interval's and the console's).
    gc_lock: Mutex<()>,
    /// Chunks and layers this uploader sent or found in the bucket, with the object's
    /// `LastModified` then (unix s): one that is still young by the GC's measure is not asked
    /// about again (see [`put_object`]).
    known: Mutex<std::collections::HashMap<String, i64>>,
}

/// At most this many objects remembered in [`Inner::known`] (~100 bytes each); past it the
/// memory starts again empty (every object is then asked about once more).
const KNOWN_MAX: usize = 500_000;

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
            lagging_since_ms: AtomicU64::new(0),
            gc_lock: Mutex::new(()),
            known: Mutex::new(std::collections::HashMap::new()),
        });
        let run = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("offsite-upload".into())
            .spawn(move || run_loop(&run))
            .map_err(|e| format!("spawn the uploader: {e}"))?;
        if inner.cfg.retention.gc_interval_s > 0 {
            let run = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("offsite-gc".into())
                .spawn(move || gc_loop(&run))
                .map_err(|e| format!("spawn the remote GC: {e}"))?;
        }
        Ok(Uploader { inner })
    }

    /// One remote retention and GC pass now (`backstop offsite gc`); journaled unless dry.
    pub fn gc(&self, dry_run: bool) -> Result<GcReport, GcError> {
        gc_pass(&self.inner, dry_run, "console")
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
            oldest_pending_s: oldest_pending(&q, now_ms()).map(|(_, w)| w / 1000),
            lagging: self.inner.lagging_since_ms.load(Ordering::Relaxed) != 0,
            lag_threshold_s: self.inner.cfg.lag_threshold_s,
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

/// The oldest pending entry and how long it has waited (ms).
fn oldest_pending(q: &Queue, now_ms: u64) -> Option<(Entry, u64)> {
    q.entries()
        .filter(|e| e.state == EntryState::Pending)
        .filter_map(|e| {
            let t = backstop_common::time::parse_rfc3339(&e.enqueued_at)?;
            let ms = (t.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
            Some((e.clone(), now_ms.saturating_sub(ms)))
        })
        .max_by_key(|(_, w)| *w)
}

/// Journals the lag's changes (`snapshot.replication.lagging` / `.caught_up`).
fn check_lag(inner: &Inner) {
    let now = now_ms();
    let oldest = oldest_pending(&lock(&inner.queue), now);
    let since = inner.lagging_since_ms.load(Ordering::Relaxed);
    let threshold_s = inner.cfg.lag_threshold_s;
    match lag_change(since != 0, oldest.as_ref().map(|(_, w)| *w), threshold_s) {
        Some(LagChange::Lagging) => {
            let Some((e, wait)) = oldest else { return };
            inner.lagging_since_ms.store(now.max(1), Ordering::Relaxed);
            let pending = lock(&inner.queue)
                .entries()
                .filter(|e| e.state == EntryState::Pending)
                .count();
            tracing::warn!(vm = %e.vm, snapshot_id = %e.snapshot_id, wait_s = wait / 1000,
                threshold_s, pending, "off-host replication is lagging");
            (inner.journal)(
                AuditEvent::SnapshotReplicationLagging,
                &e.snapshot_id,
                "lagging",
                json!({"vm": e.vm, "oldest_wait_s": wait / 1000, "threshold_s": threshold_s,
                    "pending": pending, "last_error": e.last_error}),
            );
        }
        Some(LagChange::CaughtUp) => {
            inner.lagging_since_ms.store(0, Ordering::Relaxed);
            let lagged_s = now.saturating_sub(since) / 1000;
            tracing::info!(lagged_s, "off-host replication caught up");
            let id = oldest.map(|(e, _)| e.snapshot_id).unwrap_or_default();
            (inner.journal)(
                AuditEvent::SnapshotReplicationCaughtUp,
                &id,
                "ok",
                json!({"lagged_s": lagged_s, "threshold_s": threshold_s}),
            );
        }
        None => {}
    }
}

/// Runs a pass every `gc_interval_s` (the first one interval after the start).
fn gc_loop(inner: &Inner) {
    let interval_ms = inner.cfg.retention.gc_interval_s.saturating_mul(1000);
    let mut last = now_ms();
    while !inner.stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(500));
        if now_ms().saturating_sub(last) < interval_ms {
            continue;
        }
        if let Err(e) = gc_pass(inner, false, "interval") {
            tracing::warn!(code = %e.code, error = %e.message, "remote GC pass failed; next at the next interval");
        }
        last = now_ms();
    }
}

/// One pass, journaled: `offsite.retention.pruned` per snapshot deleted, `offsite.gc.swept`
/// for a pass that deleted anything or that a person asked for.
fn gc_pass(inner: &Inner, dry_run: bool, trigger: &str) -> Result<GcReport, GcError> {
    let _one = lock(&inner.gc_lock);
    let host = inner.cfg.host.clone();
    let journal = &inner.journal;
    let result = retention::run(&inner.cfg, &inner.client, dry_run, &mut |p| {
        journal(
            AuditEvent::OffsiteRetentionPruned,
            &p.snapshot_id,
            "ok",
            json!({"host": host, "reason": p.reason, "objects": p.objects, "bytes": p.bytes,
                "trigger": trigger}),
        );
    });
    match &result {
        Ok(r) => {
            tracing::info!(
                dry_run,
                trigger,
                pruned = r.snapshots_pruned.len(),
                swept = r.objects_swept,
                bytes = r.bytes_swept,
                in_grace = r.objects_in_grace,
                ms = r.total_ms,
                "remote GC pass"
            );
            let did = !r.snapshots_pruned.is_empty() || r.objects_swept > 0;
            if !dry_run && (did || trigger == "console") {
                journal(
                    AuditEvent::OffsiteGcSwept,
                    "",
                    "ok",
                    json!({"host": r.host, "objects_swept": r.objects_swept,
                        "bytes_swept": r.bytes_swept, "objects_referenced": r.objects_referenced,
                        "objects_in_grace": r.objects_in_grace,
                        "snapshots_pruned": r.snapshots_pruned.len(), "trigger": trigger,
                        "total_ms": r.total_ms}),
                );
            }
        }
        Err(e) if !dry_run => journal(
            AuditEvent::OffsiteGcSwept,
            "",
            "failed",
            json!({"host": inner.cfg.host, "objects_swept": 0, "bytes_swept": 0,
                "objects_referenced": 0, "objects_in_grace": 0, "snapshots_pruned": 0,
                "trigger": trigger, "code": e.code.as_str(), "error": e.message}),
        ),
        Err(_) => {}
    }
    result
}

fn run_loop(inner: &Inner) {
    let mut last_scan = 0u64;
    while !inner.stop.load(Ordering::SeqCst) {
        if now_ms().saturating_sub(last_scan) >= 1000 {
            scan(inner);
            check_lag(inner);
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
                    "objects_uploaded": stats.objects_uploaded, "objects_present": stats.objects_present, "bytes_resent": stats.bytes_resent,
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
    body: Body,
    /// Not referenced by the snapshot's parent: most likely not in the bucket yet, so it is
    /// PUT at once (`If-None-Match: *`) instead of HEAD first.
    likely_new: bool,
}

/// What an object holds, and what its bytes are checked against before they leave.
enum Body {
    /// A chunk (at most 4 MiB): its reference (length, digest under its hash, crc32).
    Chunk(ChunkRef),
    /// A disk layer: its sha256, which S3 also gets with the PUT and checks.
    Layer { sha256: String },
}

impl Body {
    /// The body's sha256 where it is known without reading it: a layer's, or the name of a
    /// chunk named by sha256. (S3 signs every body's sha256.)
    fn known_sha256(&self) -> Option<&str> {
        match self {
            Body::Layer { sha256 } => Some(sha256),
            Body::Chunk(c) if c.hash == ChunkHash::Sha256 => Some(&c.digest),
            Body::Chunk(_) => None,
        }
    }
}

/// What the parent snapshot of `manifest` references (chunks and layers by sha256), read from
/// this store without verification — only a hint of what the bucket has already. `None` if
/// there is no parent here or it cannot be read: then every object is asked about first.
fn parent_refs(store: &Path, manifest: &Manifest) -> Option<BTreeSet<String>> {
    let parent = manifest.lineage.as_ref()?.parent.as_deref()?;
    let dir = store.join("snapshots").join(parent);
    let bytes = std::fs::read(dir.join(MANIFEST_FILE)).ok()?;
    let m: Value = serde_json::from_slice(&bytes).ok()?;
    let mut refs = BTreeSet::new();
    for p in m["payload_refs"].as_array()? {
        if let Some(index) = p["index"].as_str() {
            let b = std::fs::read(dir.join(index)).ok()?;
            refs.extend(
                ChunkIndex::parse(&b)
                    .ok()?
                    .chunks
                    .into_iter()
                    .map(|c| c.digest),
            );
        }
        for l in p["layers"].as_array().into_iter().flatten() {
            refs.insert(l["sha256"].as_str()?.to_string());
        }
    }
    Some(refs)
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
    let parent = parent_refs(store, &manifest);
    let likely_new = |sha: &str| parent.as_ref().is_some_and(|p| !p.contains(sha));
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
                if seen.insert(c.digest.clone()) {
                    objects.push(Object {
                        key: cfg.key(&format!("chunks/{}", c.digest)),
                        path: store.join("chunks").join(&c.digest[..2]).join(&c.digest),
                        len: c.len,
                        body: Body::Chunk(c.clone()),
                        likely_new: likely_new(&c.digest),
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
                    body: Body::Layer {
                        sha256: l.sha256.clone(),
                    },
                    likely_new: likely_new(&l.sha256),
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
    let resent = AtomicU64::new(0);
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
                    Ok(Put::Created) => {
                        sent.fetch_add(1, Ordering::Relaxed);
                        bytes.fetch_add(o.len, Ordering::Relaxed);
                        inner.bytes_total.fetch_add(o.len, Ordering::Relaxed);
                    }
                    Ok(Put::Present) => {
                        present.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Put::Resent) => {
                        present.fetch_add(1, Ordering::Relaxed);
                        resent.fetch_add(o.len, Ordering::Relaxed);
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
        bytes_resent: resent.load(Ordering::Relaxed),
    }))
}

/// One PUT of `o`'s body: `If-None-Match: *` when it is likely new (false: it was there).
fn put(
    inner: &Inner,
    o: &Object,
    body: &mut dyn std::io::Read,
    sha256: &str,
) -> Result<bool, Failure> {
    if o.likely_new {
        Ok(inner
            .client
            .put_reader_if_absent(&o.key, body, o.len, sha256)?)
    } else {
        inner.client.put_reader(&o.key, body, o.len, sha256)?;
        Ok(true)
    }
}

/// Makes sure the object is in the bucket, asking it as little as possible: an object this run
/// sent or found and still young by the remote GC's measure is taken as there; one the
/// snapshot's parent references (or too large to send blind) is asked about first (HEAD); one
/// that looks new is PUT at once with `If-None-Match: *`, a 412 meaning it was there after all.
///
/// An object found there whose `LastModified` is older than half the remote GC's grace period
/// is renewed (a server-side copy, no bytes sent): the manifest about to name it must find it
/// (see `retention`).
fn put_object(inner: &Inner, o: &Object) -> Result<Put, Failure> {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    // Young by the GC's measure: no GC deletes it before the manifest is up (see README,
    // "Remote GC"), exactly as if a HEAD had just said so.
    let young = |modified: i64| now - modified <= (inner.cfg.retention.gc_grace_s / 2) as i64;
    let remember = |modified: i64| {
        let mut k = lock(&inner.known);
        if k.len() >= KNOWN_MAX {
            k.clear();
        }
        k.insert(o.key.clone(), modified);
    };
    if lock(&inner.known).get(&o.key).is_some_and(|m| young(*m)) {
        return Ok(Put::Present);
    }
    // In parts past the threshold (S3's single PUT stops at 5 GiB, and a failed part is sent
    // again alone); too large to send just to find it there, so asked about first even when it
    // looks new.
    let multipart = o.len > u64::from(inner.cfg.multipart_threshold_mib) * 1024 * 1024;
    if !o.likely_new || multipart {
        if let Some(present) = present_or_touched(inner, o, &young)? {
            remember(present);
            return Ok(Put::Present);
        }
    }
    let local =
        |e: std::io::Error| Failure::new(ErrorCode::StoreIo, format!("{}: {e}", o.path.display()));
    let created = if o.len <= u64::from(backstop_store::CHUNK_MAX_BYTES) {
        // A chunk (or a layer as small as one) is checked before it leaves: a damaged local
        // chunk is not replicated. A chunk named by BLAKE3 gets its sha256 here, for S3.
        let b = std::fs::read(&o.path).map_err(local)?;
        let ok = match &o.body {
            Body::Chunk(c) => c.matches(&b),
            Body::Layer { sha256 } => b.len() as u64 == o.len && sha256_hex(&b) == *sha256,
        };
        if !ok {
            return Err(Failure::new(
                ErrorCode::SnapshotIntegrityCheckFailed,
                format!(
                    "{}: does not match its digest; not uploaded",
                    o.path.display()
                ),
            ));
        }
        let sha256 = o
            .body
            .known_sha256()
            .map_or_else(|| sha256_hex(&b), str::to_string);
        put(inner, o, &mut std::io::Cursor::new(b), &sha256)?
    } else {
        // A layer's digest goes with the PUT; the gateway checks it. (Every chunk is at most
        // CHUNK_MAX_BYTES, and the multipart threshold is at least 5 MiB.)
        let sha256 = o.body.known_sha256().unwrap_or_default().to_string();
        let mut f = File::open(&o.path).map_err(local)?;
        if multipart {
            let part = u64::from(inner.cfg.multipart_part_mib) * 1024 * 1024;
            inner
                .client
                .put_multipart(&o.key, &mut f, o.len, &sha256, part)?;
            true
        } else {
            put(inner, o, &mut f, &sha256)?
        }
    };
    if created {
        remember(now);
        return Ok(Put::Created);
    }
    // There after all (another host sent it, or it outlived a local prune): renewed if old.
    match present_or_touched(inner, o, &young)? {
        Some(modified) => {
            remember(modified);
            Ok(Put::Resent)
        }
        None => Err(Failure::new(
            ErrorCode::OffsiteUnreachable,
            format!("{}: refused as present, then not found", o.key),
        )),
    }
}

/// HEAD: `Some(LastModified)` if an object of the right length is there — renewed first (a
/// server-side copy onto itself, no bytes sent) when it is older than half the GC grace, so a
/// GC pass cannot delete it before the manifest naming it is up; `None` if it must be sent.
fn present_or_touched(
    inner: &Inner,
    o: &Object,
    young: &dyn Fn(i64) -> bool,
) -> Result<Option<i64>, Failure> {
    let Some((len, modified)) = inner.client.head_meta(&o.key)? else {
        return Ok(None);
    };
    if len != o.len {
        return Ok(None);
    }
    let modified = modified.unix_timestamp();
    if young(modified) {
        return Ok(Some(modified));
    }
    inner.client.touch(&o.key)?;
    Ok(Some(time::OffsetDateTime::now_utc().unix_timestamp()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_journaled_once_when_passed_and_once_when_caught_up() {
        // 10 s threshold.
        assert_eq!(lag_change(false, None, 10), None);
        assert_eq!(lag_change(false, Some(10_000), 10), None);
        assert_eq!(
            lag_change(false, Some(10_001), 10),
            Some(LagChange::Lagging)
        );
        assert_eq!(lag_change(true, Some(50_000), 10), None);
        assert_eq!(lag_change(true, Some(2_000), 10), Some(LagChange::CaughtUp));
        assert_eq!(lag_change(true, None, 10), Some(LagChange::CaughtUp));
        assert_eq!(lag_change(false, Some(u64::MAX), u64::MAX), None);
    }
}
