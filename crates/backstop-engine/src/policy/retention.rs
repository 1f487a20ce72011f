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
use backstop_store::{plan_retention, remove_layers, Candidate, ListEntry, VerifyOptions};

use crate::engine::{Ctx, Engine};
use crate::error::EngineError;
use crate::policy::{parse_time, EV_PRUNED, EV_PRUNE_COMPLETED};

impl Engine {
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
            if self.policy.is_rolled_back(&m.snapshot_id) {
                continue;
            }
            ctx.step("verify", format!("verifying {}", m.snapshot_id), None);
            match self.store.verify(&m.snapshot_id, &VerifyOptions::default()) {
                Ok(v) if v.manifest.config_fingerprint == fingerprint => {
                    return Ok(Some(m.snapshot_id.clone()))
                }
                _ => continue,
            }
        }
        Ok(None)
    }

    /// Applies `[retention]`: plans, removes (atomically, journaled per snapshot), collects
    /// unreferenced chunks and layers.
    pub(crate) fn prune(&mut self, ctx: &mut Ctx, why: &str) -> Result<PruneView, EngineError> {
        self.policy.check_records()?;
        let now = OffsetDateTime::now_utc();
        let newest = self.newest_verified_live(ctx)?;
        let Some(newest) = newest else {
            // Without a verified snapshot nobody can say what is safe to delete.
            return Err(EngineError::NoVerifiedSnapshot);
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
        let candidates: Vec<Candidate> = entries
            .iter()
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
        let plan = plan_retention(&self.cfg.retention.policy(), &candidates, now);
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
            return Ok(view);
        }
        ctx.step(
            "prune",
            format!("removing {} snapshot(s)", plan.remove.len()),
            None,
        );
        let report = self
            .store
            .remove_snapshots(&plan.remove_ids())
            .map_err(EngineError::Store)?;
        let reasons: BTreeMap<&str, &str> = plan
            .remove
            .iter()
            .map(|(id, r)| (id.as_str(), r.as_str()))
            .collect();
        let sid = self.session_id.clone();
        for (id, layers) in &report.removed {
            let reason = reasons.get(id.as_str()).copied().unwrap_or("retention");
            let mark = self.policy.marks.remove(id);
            self.journal(
                EV_PRUNED,
                json!({
                    "snapshot_id": id, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
                    "reason": reason, "why": why, "rolled_back": mark.is_some(), "chain": layers,
                }),
            )?;
            view.removed.push(PrunedSnapshot {
                snapshot_id: id.clone(),
                reason: reason.to_string(),
            });
        }
        self.policy.save_marks()?;
        // Layers: only what no remaining snapshot lists, the running VM does not use, and the
        // engine itself created.
        let mut keep: BTreeSet<PathBuf> = self.vm.chains.values().flatten().cloned().collect();
        keep.extend(self.cfg.vm.disks.iter().map(|d| d.path.clone()));
        let layers = remove_layers(&report.unreferenced_layers, &keep, &self.layers.dir)
            .map_err(EngineError::Store)?;
        view.chunks_removed = report.chunks_removed;
        view.layers_removed = layers.len() as u64;
        self.journal(EV_PRUNE_COMPLETED, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
            "removed": view.removed.len(), "kept": view.kept.len(), "chunks_removed": report.chunks_removed,
            "layers_removed": layers, "why": why,
        }))?;
        info!(
            removed = view.removed.len(),
            chunks = report.chunks_removed,
            layers = view.layers_removed,
            "retention applied"
        );
        Ok(view)
    }
}
