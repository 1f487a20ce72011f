//! Remote retention and garbage collection. The bucket keeps what its own rule
//! (`[offsite.retention]`) says, independently of the local store: by default everything.
//!
//! One pass, in this order:
//! 1. **Retention**, applied by this host to its own `hosts/<host>/snapshots/*` only (never to
//!    another host's): the snapshots the rule drops are deleted signature first (from then on
//!    the snapshot is not "there" for a pull), then the manifest, then the indexes. A snapshot
//!    without a signature (an upload in progress, or a deletion that was interrupted) is left
//!    alone until its newest object is older than the grace period, then its rest is deleted.
//! 2. **Candidates**: every object of the shared `chunks/` and `layers/` is listed, with its
//!    `LastModified`, *before* the mark, so an object uploaded after this listing is never one.
//! 3. **Mark**: every chunk named by any index and every layer named by any manifest of any
//!    host under the prefix (an index without its manifest yet counts too).
//! 4. **Sweep**: an unreferenced candidate older than `gc_grace_s` is deleted, after one more
//!    HEAD shows it still is that old. An upload that finds a chunk already there renews its
//!    `LastModified` (a server-side copy, [`crate::s3::Client::touch`]) when it is older than half
//!    the grace, so a chunk a manifest uploaded meanwhile needs is never old enough to sweep —
//!    as long as an upload takes less than half the grace period.
//!
//! The decisions ([`snapshots_to_drop`], [`objects_to_sweep`]) are pure functions of the listing,
//! the rule and the time; the rest carries them out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use backstop_common::ErrorCode;
use backstop_store::{ChunkIndex, MANIFEST_FILE, MANIFEST_MAX_BYTES};
use serde::Serialize;
use serde_json::Value;
use time::OffsetDateTime;

use crate::config::{OffsiteConfig, RemoteRetention};
use crate::s3::{Client, ListedObject, S3Error};
use crate::upload::SIGNATURE_OBJECT;

/// One of this host's snapshots in the bucket, as retention sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSnapshot {
    pub id: String,
    /// The manifest's `created_at` (unix seconds); `None` if it cannot be read.
    pub created_at_s: Option<i64>,
    /// Its signature is there: a pull would find it.
    pub complete: bool,
    /// The newest `LastModified` among its objects (unix seconds).
    pub newest_object_s: i64,
}

/// Why a snapshot is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The rule does not keep it.
    Retention,
    /// No signature and nothing written for longer than the grace period: an upload that never
    /// finished, or a deletion that was interrupted.
    Abandoned,
}

/// Which snapshots to delete. A complete snapshot is kept if it is one of the newest
/// `keep_last`, or was created within `keep_within_s` of `now_s`; with neither rule, all are
/// kept. The newest complete snapshot is always kept, and one whose creation time cannot be read
/// is never dropped (nor counted). An incomplete one is dropped only once abandoned.
pub fn snapshots_to_drop(
    snaps: &[RemoteSnapshot],
    rule: &RemoteRetention,
    now_s: i64,
) -> Vec<(String, DropReason)> {
    let mut out = Vec::new();
    let grace = rule.gc_grace_s as i64;
    for s in snaps.iter().filter(|s| !s.complete) {
        if now_s.saturating_sub(s.newest_object_s) > grace {
            out.push((s.id.clone(), DropReason::Abandoned));
        }
    }
    if rule.keep_last.is_none() && rule.keep_within_s.is_none() {
        return out;
    }
    // Newest first. One whose time cannot be read is kept and counts for nothing.
    let mut complete: Vec<(i64, &RemoteSnapshot)> = snaps
        .iter()
        .filter(|s| s.complete)
        .filter_map(|s| Some((s.created_at_s?, s)))
        .collect();
    complete.sort_by_key(|(t, s)| std::cmp::Reverse((*t, s.id.clone())));
    for (i, (t, s)) in complete.iter().enumerate() {
        let by_count = rule.keep_last.is_some_and(|n| i < n as usize);
        let by_age = rule
            .keep_within_s
            .is_some_and(|w| now_s.saturating_sub(*t) <= w as i64);
        if i == 0 || by_count || by_age {
            continue;
        }
        out.push((s.id.clone(), DropReason::Retention));
    }
    out
}

/// The candidates to delete: objects whose digest (the key's last segment) is not referenced
/// and whose `LastModified` is more than `grace_s` before `now`.
pub fn objects_to_sweep<'a>(
    candidates: &'a [ListedObject],
    referenced: &BTreeSet<String>,
    now: OffsetDateTime,
    grace_s: u64,
) -> Vec<&'a ListedObject> {
    candidates
        .iter()
        .filter(|o| !referenced.contains(digest_of(&o.key)))
        .filter(|o| is_older_than(o.last_modified, now, grace_s))
        .collect()
}

fn is_older_than(t: OffsetDateTime, now: OffsetDateTime, grace_s: u64) -> bool {
    (now - t).whole_seconds() > grace_s as i64
}

fn digest_of(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// What one pass did (or, dry, would do).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct GcReport {
    pub host: String,
    pub dry_run: bool,
    /// This host's snapshots deleted (would be) by retention, with why.
    pub snapshots_pruned: Vec<PrunedSnapshot>,
    /// This host's complete snapshots the bucket keeps.
    pub snapshots_kept: u64,
    /// Chunks and layers that a manifest or index of some host needs.
    pub objects_referenced: u64,
    /// Unreferenced, but younger than the grace period (an upload in progress, perhaps): kept.
    pub objects_in_grace: u64,
    /// Chunks and layers deleted (would be), and their bytes.
    pub objects_swept: u64,
    pub bytes_swept: u64,
    pub total_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PrunedSnapshot {
    pub snapshot_id: String,
    pub reason: DropReason,
    pub objects: u64,
    pub bytes: u64,
}

/// A pass that stopped; nothing after the failing step was deleted.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct GcError {
    pub code: ErrorCode,
    pub message: String,
}

impl From<S3Error> for GcError {
    fn from(e: S3Error) -> GcError {
        GcError {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// Runs one pass (see the module text). `on_pruned` is called for each snapshot deleted (not in
/// a dry run), after its signature, manifest and indexes are gone.
pub fn run(
    cfg: &OffsiteConfig,
    client: &Client,
    dry_run: bool,
    on_pruned: &mut dyn FnMut(&PrunedSnapshot),
) -> Result<GcReport, GcError> {
    let started = Instant::now();
    let rule = &cfg.retention;
    let mut report = GcReport {
        host: cfg.host.clone(),
        dry_run,
        ..GcReport::default()
    };
    let hosts_prefix = cfg.key("hosts/");
    let own_prefix = cfg.key(&format!("hosts/{}/snapshots/", cfg.host));

    // 1. Retention over this host's snapshots.
    let own = client.list(&own_prefix)?;
    let mut by_id: BTreeMap<String, Vec<&ListedObject>> = BTreeMap::new();
    for o in &own {
        let rest = o.key.strip_prefix(own_prefix.as_str()).unwrap_or_default();
        if let Some((id, _)) = rest.split_once('/') {
            by_id.entry(id.to_string()).or_default().push(o);
        }
    }
    let now = OffsetDateTime::now_utc();
    let mut snaps = Vec::new();
    for (id, objects) in &by_id {
        let complete = objects
            .iter()
            .any(|o| o.key.ends_with(&format!("/{SIGNATURE_OBJECT}")));
        let created_at_s = if complete {
            created_at(client, &format!("{own_prefix}{id}/{MANIFEST_FILE}"))?
        } else {
            None
        };
        let newest_object_s = objects
            .iter()
            .map(|o| o.last_modified.unix_timestamp())
            .max()
            .unwrap_or(0);
        snaps.push(RemoteSnapshot {
            id: id.clone(),
            created_at_s,
            complete,
            newest_object_s,
        });
    }
    let drop = snapshots_to_drop(&snaps, rule, now.unix_timestamp());
    let dropped: BTreeSet<&str> = drop.iter().map(|(id, _)| id.as_str()).collect();
    report.snapshots_kept = snaps
        .iter()
        .filter(|s| s.complete && !dropped.contains(s.id.as_str()))
        .count() as u64;
    for (id, reason) in &drop {
        let objects = by_id.get(id).map(Vec::as_slice).unwrap_or_default();
        let p = PrunedSnapshot {
            snapshot_id: id.clone(),
            reason: *reason,
            objects: objects.len() as u64,
            bytes: objects.iter().map(|o| o.size).sum(),
        };
        if !dry_run {
            // The signature first: from then on the snapshot is not there for a pull, and a
            // pass interrupted here finishes it later as abandoned.
            let mut ordered: Vec<&&ListedObject> = objects.iter().collect();
            ordered.sort_by_key(|o| {
                if o.key.ends_with(&format!("/{SIGNATURE_OBJECT}")) {
                    0
                } else if o.key.ends_with(&format!("/{MANIFEST_FILE}")) {
                    1
                } else {
                    2
                }
            });
            for o in ordered {
                client.delete(&o.key)?;
            }
            on_pruned(&p);
        }
        report.snapshots_pruned.push(p);
    }

    // 2. Candidates, listed before the mark.
    let mut candidates = client.list(&cfg.key("chunks/"))?;
    candidates.extend(client.list(&cfg.key("layers/"))?);

    // 3. Mark: every host's manifests and indexes (a dry run leaves out what it would drop).
    let skip: BTreeSet<String> = if dry_run {
        dropped
            .iter()
            .map(|id| format!("{own_prefix}{id}/"))
            .collect()
    } else {
        BTreeSet::new()
    };
    let mut referenced = BTreeSet::new();
    for o in client.list(&hosts_prefix)? {
        if skip.iter().any(|p| o.key.starts_with(p.as_str())) {
            continue;
        }
        if o.key.ends_with(&format!("/{MANIFEST_FILE}")) {
            let Some(bytes) = get_if_there(client, &o.key, MANIFEST_MAX_BYTES)? else {
                continue;
            };
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| GcError {
                code: ErrorCode::SnapshotIntegrityCheckFailed,
                message: format!("{}: not JSON ({e}); nothing swept", o.key),
            })?;
            for p in v["payload_refs"].as_array().into_iter().flatten() {
                for l in p["layers"].as_array().into_iter().flatten() {
                    if let Some(sha) = l["sha256"].as_str() {
                        referenced.insert(sha.to_string());
                    }
                }
            }
        } else if o.key.ends_with(".index") {
            let Some(bytes) = get_if_there(client, &o.key, backstop_store::INDEX_MAX_BYTES)? else {
                continue;
            };
            let index = ChunkIndex::parse(&bytes).map_err(|e| GcError {
                code: ErrorCode::SnapshotIntegrityCheckFailed,
                message: format!("{}: {e}; nothing swept", o.key),
            })?;
            referenced.extend(index.chunks.into_iter().map(|c| c.digest));
        }
    }
    report.objects_referenced = candidates
        .iter()
        .filter(|o| referenced.contains(digest_of(&o.key)))
        .count() as u64;

    // 4. Sweep.
    let now = OffsetDateTime::now_utc();
    let sweep = objects_to_sweep(&candidates, &referenced, now, rule.gc_grace_s);
    let unreferenced = candidates.len() as u64 - report.objects_referenced;
    report.objects_in_grace = unreferenced - sweep.len() as u64;
    if dry_run {
        report.objects_swept = sweep.len() as u64;
        report.bytes_swept = sweep.iter().map(|o| o.size).sum();
    } else {
        let swept = sweep_objects(
            client,
            &sweep,
            rule.gc_grace_s,
            cfg.max_concurrent_uploads as usize,
        )?;
        report.objects_in_grace += sweep.len() as u64 - swept.0 - swept.2;
        report.objects_swept = swept.0;
        report.bytes_swept = swept.1;
    }
    report.total_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

/// Deletes `objects` on up to `threads` threads, each after a HEAD showing it is still older
/// than the grace (one renewed since the listing, because an upload found it there and needs
/// it, is kept). The first failure stops the others. Returns (deleted, their bytes, already
/// gone).
fn sweep_objects(
    client: &Client,
    objects: &[&ListedObject],
    grace_s: u64,
    threads: usize,
) -> Result<(u64, u64, u64), GcError> {
    let next = AtomicUsize::new(0);
    let deleted = AtomicU64::new(0);
    let bytes = AtomicU64::new(0);
    let gone = AtomicU64::new(0);
    let failed: Mutex<Option<GcError>> = Mutex::new(None);
    let one = |o: &ListedObject| -> Result<(), GcError> {
        match client.head_meta(&o.key)? {
            Some((_, t)) if is_older_than(t, OffsetDateTime::now_utc(), grace_s) => {
                client.delete(&o.key)?;
                deleted.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(o.size, Ordering::Relaxed);
            }
            Some(_) => {}
            None => {
                gone.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    };
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, 16).min(objects.len().max(1)) {
            s.spawn(|| loop {
                if failed.lock().map_or(true, |f| f.is_some()) {
                    return;
                }
                let Some(o) = objects.get(next.fetch_add(1, Ordering::SeqCst)) else {
                    return;
                };
                if let Err(e) = one(o) {
                    if let Ok(mut f) = failed.lock() {
                        f.get_or_insert(e);
                    }
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok((deleted.into_inner(), bytes.into_inner(), gone.into_inner()))
}

/// The object's bytes, or `None` if it went away meanwhile (another pass deleted it).
fn get_if_there(client: &Client, key: &str, limit: u64) -> Result<Option<Vec<u8>>, GcError> {
    match client.get(key, limit) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A manifest's `created_at` (unverified: it only orders this host's own snapshots).
fn created_at(client: &Client, key: &str) -> Result<Option<i64>, GcError> {
    let Some(bytes) = get_if_there(client, key, MANIFEST_MAX_BYTES)? else {
        return Ok(None);
    };
    Ok(serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["created_at"].as_str().map(str::to_string))
        .and_then(|t| backstop_common::time::parse_rfc3339(&t))
        .map(OffsetDateTime::unix_timestamp))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rule(keep_last: Option<u32>, keep_within_s: Option<u64>) -> RemoteRetention {
        RemoteRetention {
            keep_last,
            keep_within_s,
            gc_grace_s: 100,
            gc_interval_s: 0,
        }
    }

    fn snap(id: &str, created: Option<i64>, complete: bool, newest: i64) -> RemoteSnapshot {
        RemoteSnapshot {
            id: id.into(),
            created_at_s: created,
            complete,
            newest_object_s: newest,
        }
    }

    fn ids(v: &[(String, DropReason)]) -> Vec<&str> {
        v.iter().map(|(id, _)| id.as_str()).collect()
    }

    #[test]
    fn without_a_rule_nothing_complete_is_dropped() {
        let s = vec![snap("a", Some(0), true, 0), snap("b", Some(10), true, 10)];
        assert!(snapshots_to_drop(&s, &rule(None, None), 1_000_000).is_empty());
    }

    #[test]
    fn keep_last_keeps_the_newest_n_by_creation_time() {
        // Ids do not sort by time: the manifest's created_at does.
        let s = vec![
            snap("z", Some(100), true, 100),
            snap("y", Some(300), true, 300),
            snap("x", Some(200), true, 200),
        ];
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(Some(2), None), 400)),
            ["z"]
        );
        assert!(snapshots_to_drop(&s, &rule(Some(3), None), 400).is_empty());
    }

    #[test]
    fn keep_within_keeps_the_young_and_always_the_newest() {
        let s = vec![
            snap("old", Some(0), true, 0),
            snap("mid", Some(500), true, 500),
            snap("new", Some(900), true, 900),
        ];
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(None, Some(500)), 1000)),
            ["old"]
        );
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(None, Some(499)), 1000)),
            ["mid", "old"]
        );
        // Everything is older than the rule: the newest stays all the same.
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(None, Some(10)), 10_000)),
            ["mid", "old"]
        );
        // Both rules: kept if either keeps it.
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(Some(2), Some(2000)), 1000)),
            Vec::<&str>::new()
        );
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(Some(1), Some(500)), 1000)),
            ["old"]
        );
    }

    #[test]
    fn an_unreadable_creation_time_is_kept() {
        let s = vec![
            snap("a", None, true, 0),
            snap("b", Some(5), true, 5),
            snap("c", Some(6), true, 6),
        ];
        assert_eq!(
            ids(&snapshots_to_drop(&s, &rule(None, Some(1)), 1000)),
            ["b"]
        );
    }

    #[test]
    fn an_incomplete_snapshot_is_dropped_only_once_abandoned() {
        let s = vec![
            snap("up", None, false, 950),
            snap("dead", None, false, 800),
            snap("c", Some(0), true, 0),
        ];
        let d = snapshots_to_drop(&s, &rule(None, None), 1000);
        assert_eq!(d, vec![("dead".to_string(), DropReason::Abandoned)]);
    }

    fn obj(key: &str, age_s: i64, now: OffsetDateTime) -> ListedObject {
        ListedObject {
            key: key.into(),
            size: 10,
            last_modified: now - time::Duration::seconds(age_s),
        }
    }

    #[test]
    fn only_unreferenced_objects_older_than_the_grace_are_swept() {
        let now = OffsetDateTime::now_utc();
        let c = vec![
            obj("p/chunks/aa", 1000, now), // referenced
            obj("p/chunks/bb", 1000, now), // unreferenced, old: swept
            obj("p/chunks/cc", 50, now),   // unreferenced, young: an upload in progress
            obj("p/layers/dd", 101, now),  // unreferenced layer, just past the grace
            obj("p/layers/ee", 100, now),  // exactly the grace: kept
        ];
        let referenced: BTreeSet<String> = ["aa".to_string()].into();
        let s: Vec<&str> = objects_to_sweep(&c, &referenced, now, 100)
            .into_iter()
            .map(|o| o.key.as_str())
            .collect();
        assert_eq!(s, ["p/chunks/bb", "p/layers/dd"]);
        let all: BTreeSet<String> = ["aa", "bb", "cc", "dd", "ee"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(objects_to_sweep(&c, &all, now, 100).is_empty());
    }
}
