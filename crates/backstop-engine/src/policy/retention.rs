//! Retention on the engine's side: what is protected, and the disk layers the running VM uses.
//!
//! The plan itself and the safe removal are `backstop_store::prune`. Here: the newest snapshot
//! of the current line that verifies completely is protected (if none verifies, nothing is
//! pruned at all), and so is every open action's pre-action snapshot. (A device grant's
//! pre-action snapshot is the newest one while the grant lasts: snapshots are deferred while a
//! device is held.) Layers are deleted only when no remaining snapshot lists them, they are not
//! in the running VM's chains, and they live under the engine's layer directory; the configured
//! base images never do.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::{json, Value};
use time::OffsetDateTime;
use tracing::info;

use backstop_control::{KeptSnapshot, PruneView, PrunedSnapshot, Response};
use backstop_store::{
    plan_retention, remove_layers, Candidate, ListEntry, RetentionPlan, VerifyOptions,
};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;
use backstop_common::AuditEvent;

use crate::policy::parse_time;

/// The journal entry of one removed snapshot, from its id, the reason, whether it was marked
/// rolled back, and the disk layers its manifest listed.
pub(crate) type RemovalEntry<'a> = dyn Fn(&str, &str, bool, &[PathBuf]) -> (AuditEvent, Value) + 'a;

/// What [`VmActor::remove_snapshots`] removed.
#[derive(Debug, Default)]
pub(crate) struct Removed {
    /// (id, reason) of each snapshot removed, in order.
    pub snapshots: Vec<(String, String)>,
    pub chunks_removed: u64,
    /// Layer files deleted.
    pub layers: Vec<PathBuf>,
}

impl VmActor {
    /// `snapshot prune`.
    pub(crate) fn prune_request(&mut self, ctx: &mut Ctx) -> Result<Response, EngineError> {
        let view = self.prune(ctx, "requested at the console")?;
        Ok(Response::Pruned(view))
    }

    /// The newest snapshot of the current line (not rolled back) that verifies completely and
    /// was taken of this VM's shape: the emergency rollback target.
    pub(crate) fn newest_verified_live(
        &mut self,
        ctx: &mut Ctx,
    ) -> Result<Option<String>, EngineError> {
        let fingerprint = self.backend.config_fingerprint();
        let entries = self.store.list().map_err(EngineError::Store)?;
        for e in entries.iter().rev() {
            let ListEntry::Valid(m) = e else { continue };
            if self.policy.is_rolled_back(&m.snapshot_id) || crate::forensic::is_forensic(m) {
                continue;
            }
            ctx.step("verify", format!("verifying {}", m.snapshot_id), None);
            match self.store.verify(&m.snapshot_id, &VerifyOptions::default()) {
                Ok(v) if v.manifest.config_fingerprint == fingerprint => {
                    return Ok(Some(m.snapshot_id.clone()))
                }
                // Resource exhaustion is not a verdict on the snapshot (see `choose_target`).
                Err(e) if backstop_common::resources::exhaustion(&e).is_some() => {
                    return Err(EngineError::ResourceExhausted {
                        step: "verify",
                        detail: format!("{}: {e}", m.snapshot_id),
                    })
                }
                _ => continue,
            }
        }
        Ok(None)
    }

    /// Applies `[retention]`: plans, removes (atomically, journaled per snapshot), collects
    /// unreferenced chunks and layers.
    pub(crate) fn prune(&mut self, ctx: &mut Ctx, why: &str) -> Result<PruneView, EngineError> {
        let plan = self.retention_plan(ctx)?;
        let mut view = PruneView {
            removed: Vec::new(),
            kept: plan
                .keep
                .iter()
                .map(|(id, reasons)| KeptSnapshot {
                    snapshot_id: id.clone(),
                    reasons: reasons.clone(),
                })
                .collect(),
            chunks_removed: 0,
            layers_removed: 0,
        };
        if plan.remove.is_empty() {
            let orphans = self.collect_orphan_layers()?;
            if !orphans.is_empty() {
                view.layers_removed = orphans.len() as u64;
                self.journal(AuditEvent::SnapshotPruneCompleted, json!({
                    "snapshot_id": Value::Null, "session_id": self.session_id, "trace_id": ctx.trace_id,
                    "result": "ok", "removed": 0, "kept": view.kept.len(), "chunks_removed": 0,
                    "layers_removed": orphans, "why": why,
                }))?;
            }
            return Ok(view);
        }
        ctx.step(
            "prune",
            format!("removing {} snapshot(s)", plan.remove.len()),
            None,
        );
        let sid = self.session_id.clone();
        let removed = self.remove_snapshots(&plan.remove, &|id, reason, rolled_back, layers| {
            (
                AuditEvent::SnapshotPruned,
                json!({
                    "snapshot_id": id, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
                    "reason": reason, "why": why, "rolled_back": rolled_back, "chain": layers,
                }),
            )
        })?;
        view.removed = removed
            .snapshots
            .iter()
            .map(|(id, reason)| PrunedSnapshot {
                snapshot_id: id.clone(),
                reason: reason.clone(),
            })
            .collect();
        view.chunks_removed = removed.chunks_removed;
        view.layers_removed = removed.layers.len() as u64;
        self.journal(AuditEvent::SnapshotPruneCompleted, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
            "removed": view.removed.len(), "kept": view.kept.len(), "chunks_removed": removed.chunks_removed,
            "layers_removed": removed.layers, "why": why,
        }))?;
        info!(
            removed = view.removed.len(),
            chunks = removed.chunks_removed,
            layers = view.layers_removed,
            "retention applied"
        );
        Ok(view)
    }

    /// What `[retention]` keeps and removes now, with every reason: the newest verified
    /// snapshot of the current line and each open action's pre-action snapshot are protected,
    /// forensic snapshots follow `keep_forensic_hours` alone. Without a verified snapshot
    /// nothing can be judged safe to remove (`NoVerifiedSnapshot`, a refusal: the VM runs on,
    /// nothing is removed). Used by prune and by
    /// `snapshot delete` (which refuses what the plan keeps).
    pub(crate) fn retention_plan(&mut self, ctx: &mut Ctx) -> Result<RetentionPlan, EngineError> {
        self.policy.check_records()?;
        let now = OffsetDateTime::now_utc();
        let newest = self.newest_verified_live(ctx)?;
        let Some(newest) = newest else {
            // Without a verified snapshot nobody can say what is safe to delete.
            return Err(EngineError::NoVerifiedSnapshot {
                refused: "nothing can be judged safe to remove, so nothing was pruned",
            });
        };
        let mut protected: BTreeMap<String, String> = BTreeMap::new();
        protected.insert(newest.clone(), "the newest verified snapshot".into());
        for a in self.policy.actions.values() {
            if let Some(s) = &a.snapshot_id {
                protected.entry(s.clone()).or_insert_with(|| {
                    format!("pre-action snapshot of open action {}", a.action_id)
                });
            }
        }
        let entries = self.store.list().map_err(EngineError::Store)?;
        // Forensic snapshots follow their own rule: kept `keep_forensic_hours`, then removed.
        let forensic_keep = time::Duration::hours(self.cfg.retention.keep_forensic_hours as i64);
        let mut forensic_expired = Vec::new();
        let mut forensic_kept = Vec::new();
        for e in &entries {
            if let ListEntry::Valid(m) = e {
                if crate::forensic::is_forensic(m) {
                    match parse_time(&m.created_at) {
                        Some(t) if now - t > forensic_keep => {
                            forensic_expired.push(m.snapshot_id.clone())
                        }
                        _ => forensic_kept.push(m.snapshot_id.clone()),
                    }
                }
            }
        }
        let candidates: Vec<Candidate> = entries
            .iter()
            .filter(|e| !matches!(e, ListEntry::Valid(m) if crate::forensic::is_forensic(m)))
            .map(|e| {
                let id = e.snapshot_id().to_string();
                Candidate {
                    created_at: match e {
                        ListEntry::Valid(m) => parse_time(&m.created_at),
                        ListEntry::Corrupt { .. } => None,
                    },
                    rolled_back_at: self
                        .policy
                        .marks
                        .get(&id)
                        .map(|m| parse_time(&m.at).unwrap_or(now)),
                    protected: protected.get(&id).cloned(),
                    snapshot_id: id,
                }
            })
            .collect();
        let mut plan = plan_retention(&self.cfg.retention.policy(), &candidates, now);
        let hours = self.cfg.retention.keep_forensic_hours;
        for id in forensic_kept {
            plan.keep
                .push((id, vec![format!("forensic, younger than {hours} h")]));
        }
        for id in forensic_expired {
            plan.remove
                .push((id, format!("forensic, older than {hours} h")));
        }
        Ok(plan)
    }

    /// Removes `remove` (id, reason) from the store the one way snapshots are removed (prune
    /// and `snapshot delete`): each directory atomically, one journal entry per snapshot (made
    /// by `entry` from the id, the reason, whether it was marked rolled back, and the layers
    /// its manifest listed), its soft-rollback mark dropped, then the chunks no remaining index
    /// names and the layer files no remaining snapshot lists, the running VM does not use and
    /// the engine created.
    pub(crate) fn remove_snapshots(
        &mut self,
        remove: &[(String, String)],
        entry: &RemovalEntry<'_>,
    ) -> Result<Removed, EngineError> {
        let ids: Vec<String> = remove.iter().map(|(id, _)| id.clone()).collect();
        let report = self
            .store
            .remove_snapshots(&ids)
            .map_err(EngineError::Store)?;
        let reasons: BTreeMap<&str, &str> = remove
            .iter()
            .map(|(id, r)| (id.as_str(), r.as_str()))
            .collect();
        let mut out = Removed::default();
        for (id, layers) in &report.removed {
            let reason = reasons.get(id.as_str()).copied().unwrap_or("retention");
            let mark = self.policy.marks.remove(id);
            let (event, fields) = entry(id, reason, mark.is_some(), layers);
            self.journal(event, fields)?;
            out.snapshots.push((id.clone(), reason.to_string()));
        }
        self.policy.save_marks()?;
        // Layers: only what no remaining snapshot lists, the running VM does not use, and the
        // engine itself created.
        let mut keep: BTreeSet<PathBuf> = self.vm.chains.values().flatten().cloned().collect();
        keep.extend(self.cfg.vm.disks.iter().map(|d| d.path.clone()));
        keep.extend(self.preload_layers());
        let mut layers = self.remove_unused_layers(&report.unreferenced_layers, keep)?;
        layers.extend(self.collect_orphan_layers()?);
        out.chunks_removed = report.chunks_removed;
        out.layers = layers;
        Ok(out)
    }

    /// Deletes the layer files no published snapshot lists and the running VM does not use:
    /// the abandoned line's overlays after a rollback, a restart's, an interrupted capture's.
    /// Nothing is deleted when some manifest cannot be read (its layers are unknown), and only
    /// files named like a layer of this record's lineage (`<disk>/<lineage>-NNNNNN.qcow2`)
    /// are candidates.
    fn collect_orphan_layers(&mut self) -> Result<Vec<PathBuf>, EngineError> {
        let Some(mut keep) = self.store.referenced_layers().map_err(EngineError::Store)? else {
            tracing::warn!("a manifest cannot be read: unreferenced layers are kept");
            return Ok(Vec::new());
        };
        keep.extend(self.vm.chains.values().flatten().cloned());
        keep.extend(self.cfg.vm.disks.iter().map(|d| d.path.clone()));
        keep.extend(self.preload_layers());
        // Compared by file identity, not by path spelling: a state directory reached through
        // another path (a symlink, a moved mount) must never make a needed layer look unused.
        use std::os::unix::fs::MetadataExt;
        let identity = |p: &PathBuf| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let needed: BTreeSet<(u64, u64)> = keep.iter().filter_map(identity).collect();
        let candidates: Vec<PathBuf> = layer_files(&self.layers.dir, &self.vm.lineage)
            .into_iter()
            .filter(|p| identity(p).is_some_and(|id| !needed.contains(&id)))
            .collect();
        let removed = self.remove_unused_layers(&candidates, keep)?;
        if !removed.is_empty() {
            info!(layers = removed.len(), "unreferenced disk layers removed");
        }
        Ok(removed)
    }

    /// Deletes `candidates` except `keep` and any a process on this host holds open (a running
    /// QEMU's chain, whoever started it): that last check runs right before the unlink.
    fn remove_unused_layers(
        &self,
        candidates: &[PathBuf],
        mut keep: BTreeSet<PathBuf>,
    ) -> Result<Vec<PathBuf>, EngineError> {
        // Named like ours but found in the way of a create: not ours.
        keep.extend(self.layers.refused());
        let open = crate::in_use::held_open(candidates);
        if !open.is_empty() {
            tracing::warn!(
                layers = open.len(),
                "disk layers no record names are held open by a running process: kept"
            );
        }
        keep.extend(open);
        remove_layers(candidates, &keep, &self.layers.dir).map_err(EngineError::Store)
    }
}

/// Every file under `dir/<disk>/` named like a layer of `lineage` (see `Layers::layer_path`):
/// another lineage's files (a reset state's, another daemon's) are never candidates.
pub(crate) fn layer_files(dir: &std::path::Path, lineage: &str) -> Vec<PathBuf> {
    let is_layer = |name: &str| crate::layers::is_layer_of(name, lineage);
    let mut out = Vec::new();
    for disk in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !disk.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        for f in std::fs::read_dir(disk.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if f.file_type().is_ok_and(|t| t.is_file())
                && f.file_name().to_str().is_some_and(is_layer)
            {
                out.push(f.path());
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_files_named_like_layers_are_candidates() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("data")).unwrap();
        for name in [
            "000001.qcow2",
            "000002.qcow2",
            "notes.txt",
            "1.qcow2",
            "00000x.qcow2",
        ] {
            std::fs::write(d.path().join("data").join(name), b"").unwrap();
        }
        std::fs::write(d.path().join("000003.qcow2"), b"").unwrap(); // not in a disk dir
        let found = super::layer_files(d.path(), "");
        assert_eq!(
            found,
            vec![
                d.path().join("data/000001.qcow2"),
                d.path().join("data/000002.qcow2")
            ]
        );
    }

    #[test]
    fn another_lineages_layers_are_never_candidates() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("data")).unwrap();
        for name in [
            "000001.qcow2",
            "a1b2c3d4e5f6-000001.qcow2",
            "a1b2c3d4e5f6-000002.qcow2",
            "0f0f0f0f0f0f-000001.qcow2",
            "a1b2c3d4e5f6-00001.qcow2",
        ] {
            std::fs::write(d.path().join("data").join(name), b"").unwrap();
        }
        assert_eq!(
            super::layer_files(d.path(), "a1b2c3d4e5f6"),
            vec![
                d.path().join("data/a1b2c3d4e5f6-000001.qcow2"),
                d.path().join("data/a1b2c3d4e5f6-000002.qcow2")
            ]
        );
        assert_eq!(
            super::layer_files(d.path(), ""),
            vec![d.path().join("data/000001.qcow2")]
        );
    }
}
