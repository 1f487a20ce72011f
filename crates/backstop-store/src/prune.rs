//! Removing snapshots safely: the retention plan (which snapshots a host-set policy keeps), the
//! atomic removal of snapshot directories, the collection of chunks no remaining snapshot refers
//! to, and the removal of disk layer files no remaining snapshot depends on.
//!
//! What this module guarantees, whatever it is asked to remove:
//!
//! * A snapshot disappears in one step: its directory is renamed into `tmp/` (which is swept at
//!   open) before anything in it is deleted, so a crash leaves it whole or gone, never half.
//! * A chunk is deleted only when no index of any remaining snapshot names it; if one remaining
//!   index cannot be read, no chunk is deleted at all (the same rule as at open).
//! * A disk layer is reported as removable only when no remaining snapshot's chain lists it; if
//!   a remaining manifest cannot be read even leniently, no layer is reported at all.
//! * [`remove_layers`] deletes only files under the directory it is given, never one in `keep`.
//!
//! The store knows nothing of VMs: which snapshots are protected (the newest verified one, the
//! pre-action snapshot of an open action) and which layers the running VM still uses is for the
//! caller to say. Must not run while a [`crate::SnapshotBuilder`] of this store is alive: the
//! chunk collection would take the chunks of its unpublished build for garbage.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde_json::Value;
use time::OffsetDateTime;

use crate::error::StoreError;
use crate::fsutil::{fsync_dir, random_hex, read_capped, Capped};
use crate::manifest::{is_snapshot_id, MANIFEST_MAX_BYTES};
use crate::{ListEntry, Store, MANIFEST_FILE};

/// How many snapshots a host keeps (spec/000 §4.1: "retention policy is host-defined").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// The newest `keep_last` snapshots of the current line are kept.
    pub keep_last: u32,
    /// The newest snapshot of each of the newest `hourly` hours (UTC) that have one is kept.
    pub hourly: u32,
    /// The newest snapshot of each of the newest `daily` days (UTC) that have one is kept.
    pub daily: u32,
    /// A rolled-back snapshot stays (soft rollback, spec/004) this long after it was rolled
    /// back; after that retention deletes it (hard rollback). Zero: at the next prune.
    pub keep_rolled_back_s: u64,
}

/// One snapshot as the retention plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub snapshot_id: String,
    /// `None`: the manifest cannot be trusted (its time is unknown); always kept, for a person.
    pub created_at: Option<OffsetDateTime>,
    /// When a rollback to an older snapshot left this one off the current line.
    pub rolled_back_at: Option<OffsetDateTime>,
    /// Why the caller forbids removing it (newest verified, an open action's snapshot, ...).
    pub protected: Option<String>,
}

/// The retention plan: every candidate is in exactly one of the two lists, with its reasons.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionPlan {
    pub keep: Vec<(String, Vec<String>)>,
    pub remove: Vec<(String, String)>,
}

impl RetentionPlan {
    /// Ids to remove, in plan order.
    pub fn remove_ids(&self) -> Vec<String> {
        self.remove.iter().map(|(id, _)| id.clone()).collect()
    }
}

/// Decides which candidates `policy` keeps at time `now`. Pure.
///
/// The current line (not rolled back, time known) is ordered newest first and kept by the three
/// rules (last N, newest per hour, newest per day); rolled-back snapshots are kept for the grace
/// period; protected and unreadable ones are always kept.
pub fn plan_retention(
    policy: &RetentionPolicy,
    candidates: &[Candidate],
    now: OffsetDateTime,
) -> RetentionPlan {
    let mut reasons: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut line: Vec<(&Candidate, OffsetDateTime)> = candidates
        .iter()
        .filter(|c| c.rolled_back_at.is_none())
        .filter_map(|c| c.created_at.map(|t| (c, t)))
        .collect();
    line.sort_by(|a, b| (b.1, &b.0.snapshot_id).cmp(&(a.1, &a.0.snapshot_id)));

    for (c, _) in line.iter().take(policy.keep_last as usize) {
        reasons
            .entry(&c.snapshot_id)
            .or_default()
            .push(format!("one of the last {}", policy.keep_last));
    }
    let hour = |t: OffsetDateTime| {
        let t = t.to_offset(time::UtcOffset::UTC);
        (t.year(), t.ordinal(), t.hour())
    };
    let day = |t: OffsetDateTime| {
        let t = t.to_offset(time::UtcOffset::UTC);
        (t.year(), t.ordinal(), 0u8)
    };
    type Bucket = dyn Fn(OffsetDateTime) -> (i32, u16, u8);
    for (count, bucket, unit, label) in [
        (policy.hourly, &hour as &Bucket, "hour", "hourly"),
        (policy.daily, &day as &Bucket, "day", "daily"),
    ] {
        let mut last = None;
        let mut kept = 0u32;
        for (c, t) in &line {
            let b = bucket(*t);
            if last == Some(b) {
                continue;
            }
            last = Some(b);
            if kept >= count {
                break;
            }
            kept += 1;
            reasons
                .entry(&c.snapshot_id)
                .or_default()
                .push(format!("newest of its {unit} ({label} {kept}/{count})"));
        }
    }

    let mut plan = RetentionPlan::default();
    for c in candidates {
        let mut why = reasons.remove(c.snapshot_id.as_str()).unwrap_or_default();
        if let Some(p) = &c.protected {
            why.insert(0, format!("protected: {p}"));
        }
        if c.created_at.is_none() {
            why.push("manifest cannot be trusted: kept for a person to inspect".into());
        }
        if let Some(at) = c.rolled_back_at {
            let age = (now - at).whole_seconds().max(0) as u64;
            if age < policy.keep_rolled_back_s {
                why.push(format!(
                    "rolled back {age} s ago (kept {} s)",
                    policy.keep_rolled_back_s
                ));
            } else if why.is_empty() {
                plan.remove.push((
                    c.snapshot_id.clone(),
                    format!("rolled back {age} s ago; the soft-rollback grace has passed"),
                ));
                continue;
            }
        }
        if why.is_empty() {
            plan.remove.push((
                c.snapshot_id.clone(),
                format!(
                    "beyond retention (last {}, {} hourly, {} daily)",
                    policy.keep_last, policy.hourly, policy.daily
                ),
            ));
        } else {
            plan.keep.push((c.snapshot_id.clone(), why));
        }
    }
    plan
}

/// What [`Store::remove_snapshots`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoveReport {
    /// Removed snapshots, with the disk layers their manifests listed (empty if unreadable).
    pub removed: Vec<(String, Vec<PathBuf>)>,
    /// Chunk files deleted because no remaining index names them.
    pub chunks_removed: u64,
    /// Layers of removed snapshots that no remaining snapshot lists: the caller may delete
    /// them (with [`remove_layers`]) once it has excluded what its running VM still uses.
    pub unreferenced_layers: Vec<PathBuf>,
}

impl Store {
    /// Removes the snapshots `ids` (each must exist), then collects unreferenced chunks. Each
    /// directory is renamed into `tmp/` first (one atomic step), then deleted.
    pub fn remove_snapshots(&self, ids: &[String]) -> Result<RemoveReport, StoreError> {
        let mut report = RemoveReport::default();
        let mut moved = Vec::new();
        for id in ids {
            if !is_snapshot_id(id) {
                return Err(StoreError::MissingSnapshot { given: id.clone() });
            }
            let dir = self.paths.snapshots.join(id);
            if !dir.is_dir() {
                return Err(StoreError::MissingSnapshot { given: id.clone() });
            }
            let layers = manifest_layers(&dir).unwrap_or_default();
            let to = self
                .paths
                .tmp
                .join(format!("pruned-{id}-{}", random_hex(4)?));
            fs::rename(&dir, &to).map_err(|source| StoreError::Rename {
                from: dir.clone(),
                to: to.clone(),
                source,
            })?;
            moved.push(to);
            report.removed.push((id.clone(), layers));
        }
        if moved.is_empty() {
            return Ok(report);
        }
        fsync_dir(&self.paths.snapshots)?;
        fsync_dir(&self.paths.tmp)?;
        for dir in &moved {
            fs::remove_dir_all(dir).map_err(|source| StoreError::Remove {
                path: dir.clone(),
                source,
            })?;
        }
        fsync_dir(&self.paths.tmp)?;
        report.chunks_removed = self.collect_chunks()?;
        if let Some(still_used) = self.referenced_layers()? {
            let mut seen = BTreeSet::new();
            for (_, layers) in &report.removed {
                for l in layers {
                    if !still_used.contains(l) && seen.insert(l.clone()) {
                        report.unreferenced_layers.push(l.clone());
                    }
                }
            }
        }
        Ok(report)
    }

    /// Every disk layer a published snapshot lists, or `None` if some manifest cannot be read
    /// even as plain JSON (then nothing may be called unreferenced).
    pub fn referenced_layers(&self) -> Result<Option<BTreeSet<PathBuf>>, StoreError> {
        let mut out = BTreeSet::new();
        for entry in self.list()? {
            match entry {
                ListEntry::Valid(m) => {
                    for p in &m.payload_refs {
                        out.extend(p.layers.iter().map(|l| l.path.clone()));
                    }
                }
                ListEntry::Corrupt { snapshot_id, .. } => {
                    // Its signature or fields do not check out, but its files may still be
                    // restorable by a person: what it names stays.
                    match manifest_layers(&self.paths.snapshots.join(&snapshot_id)) {
                        Some(layers) => out.extend(layers),
                        None => return Ok(None),
                    }
                }
            }
        }
        Ok(Some(out))
    }
}

/// The layer paths a manifest lists, read as plain JSON (no signature check): used only to
/// decide what must be *kept*. `None` when the manifest cannot be read or parsed.
fn manifest_layers(dir: &Path) -> Option<Vec<PathBuf>> {
    let bytes = match read_capped(&dir.join(MANIFEST_FILE), MANIFEST_MAX_BYTES) {
        Ok(Capped::Bytes(b)) => b,
        _ => return None,
    };
    let v: Value = serde_json::from_slice(&bytes).ok()?;
    let mut out = Vec::new();
    for p in v.get("payload_refs")?.as_array()? {
        for l in p
            .get("layers")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            out.push(PathBuf::from(l.get("path")?.as_str()?));
        }
    }
    Some(out)
}

/// Deletes the layer files in `candidates` that are not in `keep` and lie under `under` (a
/// plain path below it: no `..`), fsyncing each directory touched. Returns what was deleted.
/// A file already gone is not an error.
pub fn remove_layers(
    candidates: &[PathBuf],
    keep: &BTreeSet<PathBuf>,
    under: &Path,
) -> Result<Vec<PathBuf>, StoreError> {
    let mut removed = Vec::new();
    let mut dirs = BTreeSet::new();
    for path in candidates {
        let inside = path.is_absolute()
            && path.starts_with(under)
            && path != under
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if keep.contains(path) || !inside {
            continue;
        }
        match fs::symlink_metadata(path) {
            Ok(m) if m.is_file() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(StoreError::Remove {
                    path: path.clone(),
                    source,
                })
            }
        }
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(StoreError::Remove {
                    path: path.clone(),
                    source,
                })
            }
        }
        if let Some(d) = path.parent() {
            dirs.insert(d.to_path_buf());
        }
        removed.push(path.clone());
    }
    for d in dirs {
        fsync_dir(&d)?;
    }
    Ok(removed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use time::macros::datetime;
    use time::Duration;

    use super::*;

    fn cand(id: &str, t: OffsetDateTime) -> Candidate {
        Candidate {
            snapshot_id: id.into(),
            created_at: Some(t),
            rolled_back_at: None,
            protected: None,
        }
    }

    fn policy(keep_last: u32, hourly: u32, daily: u32) -> RetentionPolicy {
        RetentionPolicy {
            keep_last,
            hourly,
            daily,
            keep_rolled_back_s: 3600,
        }
    }

    fn kept(plan: &RetentionPlan) -> Vec<&str> {
        let mut k: Vec<&str> = plan.keep.iter().map(|(id, _)| id.as_str()).collect();
        k.sort();
        k
    }

    #[test]
    fn keep_last_hourly_and_daily_tiers() {
        let t0 = datetime!(2026-03-01 10:05 UTC);
        // Every 20 minutes for two days: a..
        let cands: Vec<Candidate> = (0..144)
            .map(|i| cand(&format!("s{i:03}"), t0 + Duration::minutes(20 * i)))
            .collect();
        let now = t0 + Duration::days(2);
        let p = plan_retention(&policy(3, 0, 0), &cands, now);
        assert_eq!(kept(&p), ["s141", "s142", "s143"]);
        assert_eq!(p.remove.len(), 141);
        // Hourly: the newest of each of the newest 4 hours. The last snapshot is at
        // 10:05 + 143*20 min = day 2 09:45; hours 09, 08, 07, 06 → s143, s140, s137, s134.
        let p = plan_retention(&policy(1, 4, 0), &cands, now);
        assert_eq!(kept(&p), ["s134", "s137", "s140", "s143"]);
        // Daily: newest of each day: 03-03 (s143), 03-02 (s113: 23:45), 03-01 (s041: 23:45).
        let p = plan_retention(&policy(1, 0, 3), &cands, now);
        assert_eq!(kept(&p), ["s041", "s113", "s143"]);
        let why = &p.keep.iter().find(|(id, _)| id == "s143").unwrap().1;
        assert!(
            why.iter().any(|w| w.starts_with("one of the last 1")),
            "{why:?}"
        );
        assert!(why.iter().any(|w| w.contains("daily 1/3")), "{why:?}");
    }

    #[test]
    fn protected_unreadable_and_rolled_back_snapshots() {
        let t0 = datetime!(2026-03-01 10:00 UTC);
        let now = t0 + Duration::hours(5);
        let mut cands: Vec<Candidate> = (0..5)
            .map(|i| cand(&format!("s{i}"), t0 + Duration::minutes(i)))
            .collect();
        cands[0].protected = Some("pre-action snapshot of open action a1".into());
        cands[1].created_at = None;
        // s3, s4 rolled back: s3 long ago, s4 just now. They are not the current line, so
        // keep_last = 1 keeps s2 (the newest that is).
        cands[3].rolled_back_at = Some(now - Duration::hours(2));
        cands[4].rolled_back_at = Some(now - Duration::minutes(1));
        let p = plan_retention(&policy(1, 0, 0), &cands, now);
        assert_eq!(kept(&p), ["s0", "s1", "s2", "s4"]);
        assert_eq!(p.remove_ids(), ["s3"]);
        assert!(p.remove[0].1.contains("grace has passed"), "{:?}", p.remove);
        // Grace zero: rolled back → removed at the next prune, unless protected.
        let mut zero = policy(1, 0, 0);
        zero.keep_rolled_back_s = 0;
        cands[4].protected = Some("newest verified".into());
        let p = plan_retention(&zero, &cands, now);
        assert_eq!(kept(&p), ["s0", "s1", "s2", "s4"]);
        assert_eq!(p.remove_ids(), ["s3"]);
        // Nothing is in both lists, nothing is lost.
        assert_eq!(p.keep.len() + p.remove.len(), cands.len());
    }

    #[test]
    fn remove_layers_stays_inside_its_directory_and_spares_keep() {
        let d = tempfile::tempdir().unwrap();
        let under = d.path().join("disks");
        fs::create_dir_all(under.join("data")).unwrap();
        let a = under.join("data/000001.qcow2");
        let b = under.join("data/000002.qcow2");
        let outside = d.path().join("base.qcow2");
        let sneaky = under.join("data/../../base.qcow2");
        for p in [&a, &b, &outside] {
            fs::write(p, b"x").unwrap();
        }
        let keep: BTreeSet<PathBuf> = [b.clone()].into();
        let gone = under.join("data/000003.qcow2");
        let removed = remove_layers(
            &[
                a.clone(),
                b.clone(),
                outside.clone(),
                sneaky,
                gone,
                under.clone(),
            ],
            &keep,
            &under,
        )
        .unwrap();
        assert_eq!(removed, vec![a.clone()]);
        assert!(!a.exists() && b.exists() && outside.exists());
    }
}
