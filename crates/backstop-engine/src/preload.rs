//! `[rollback] preload`: the snapshot a rollback would choose now, kept loaded in the standby
//! (`docs/standby.md`, "Preloaded"). A rollback whose verified target is that snapshot — same
//! id, same manifest bytes — launches on it and skips the load; any other target, or a preload
//! that failed, restores as without one.
//!
//! Verification is not given up: the preload is the rollback's own load moved earlier — the
//! target verified first, every chunk re-checked as it streams — and at the rollback the target
//! is verified again as always and must be the manifest that was preloaded, byte for byte.
//! The preload's fresh top layers (one empty overlay per disk over the snapshot's chain) are
//! created here and kept by the layer sweep while the preload lives.

use std::collections::BTreeMap;
use std::path::PathBuf;

use backstop_hypervisor::{DiskAttachment, PreloadState};
use backstop_store::{ListEntry, VerifiedSnapshot, VerifyOptions};

use crate::actor::VmActor;
use crate::lifecycle::VmState;
use crate::rollback::manifest_chains;

/// What the standby was given: which snapshot (and the digest of its manifest then), and the
/// fresh top layer of each disk it runs on.
#[derive(Debug, Clone)]
pub(crate) struct Preloaded {
    pub snapshot_id: String,
    pub manifest_sha256: String,
    pub tops: BTreeMap<String, PathBuf>,
}

impl VmActor {
    /// Keeps the standby loaded with the snapshot a rollback to the newest would choose: does
    /// nothing when it already is (or is loading it), else replaces the preload. `Err`: why
    /// there is none now (the caller keeps a plain standby instead).
    pub(crate) fn refresh_preload(&mut self) -> Result<(), String> {
        let Some(id) = self.preload_target()? else {
            self.drop_preload();
            return Err("no snapshot to preload".into());
        };
        let digest = crate::replay::manifest_sha256(self.store.root(), &id)
            .map_err(|e| format!("{id}: {e}"))?;
        if self.preload_holds(&id, &digest) {
            return Ok(());
        }
        self.drop_preload();
        let v = self
            .store
            .verify_trusting_checked(&id, &VerifyOptions::default())
            .map_err(|e| format!("{id}: {e}"))?;
        if v.manifest.config_fingerprint != self.backend.config_fingerprint() {
            return Err(format!("{id} was taken of another VM shape"));
        }
        // Each layer is recorded as soon as it is made, so a failure below removes exactly
        // the ones made.
        let mut record = Preloaded {
            snapshot_id: id.clone(),
            manifest_sha256: digest,
            tops: BTreeMap::new(),
        };
        for (disk, chain) in manifest_chains(&v) {
            let Some(top) = chain.last() else {
                return Err(format!("{id}: disk {disk} has an empty chain"));
            };
            let fmt = self.layer_format(&disk, &chain);
            let new_top = self.next_layer(&disk).map_err(|e| e.to_string())?;
            if let Err(e) = self.layers.create_overlay(&new_top, top, &fmt) {
                // Only the overlays this preload made are removed, never one that was in the way.
                self.drop_preload();
                return Err(format!("overlay for {disk}: {e}"));
            }
            record.tops.insert(disk.clone(), new_top.clone());
            self.preloaded = Some(record.clone());
        }
        let Some(disks) = preload_disks(&self.cfg, &record.tops) else {
            self.drop_preload();
            return Err(format!("{id} does not hold every disk of this VM"));
        };
        let started = self
            .store
            .open_payload(&v, "vmstate")
            .map_err(|e| format!("{id}: {e}"))
            .and_then(|state| {
                self.backend
                    .preload_standby(&id, &disks, Box::new(state))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = started {
            self.drop_preload();
            return Err(e);
        }
        self.preloaded = Some(record);
        tracing::info!(snapshot_id = %id, "preloading the standby");
        Ok(())
    }

    /// The preload for a rollback to `target`, if there is one of exactly it (same manifest
    /// bytes) that has not failed; taken out of the actor (its layers become the VM's). `None`
    /// leaves it in place.
    pub(crate) fn take_preload(&mut self, target: &VerifiedSnapshot) -> Option<Preloaded> {
        let id = &target.manifest.snapshot_id;
        let digest = crate::replay::manifest_sha256(self.store.root(), id).ok()?;
        if self.preload_holds(id, &digest) {
            self.preloaded.take()
        } else {
            None
        }
    }

    /// Whether the standby holds (or is loading) snapshot `id` with manifest digest `digest`,
    /// its load not failed.
    fn preload_holds(&self, id: &str, digest: &str) -> bool {
        self.preloaded
            .as_ref()
            .is_some_and(|p| p.snapshot_id == id && p.manifest_sha256 == digest)
            && matches!(self.backend.preloaded_standby(),
                Some((tag, state)) if tag == id && state != PreloadState::Failed)
    }

    /// Ends the preload, if any: its standby, and its layers (no chain uses them).
    pub(crate) fn drop_preload(&mut self) {
        let Some(p) = self.preloaded.take() else {
            return;
        };
        if self.backend.preloaded_standby().is_some() {
            self.backend.discard_standby();
        }
        for top in p.tops.values() {
            match std::fs::remove_file(top) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(layer = %top.display(), error = %e, "a preload's layer was not removed");
                }
                _ => {}
            }
        }
    }

    /// The layers the preload runs on (the layer sweep keeps them).
    pub(crate) fn preload_layers(&self) -> Vec<PathBuf> {
        self.preloaded
            .iter()
            .flat_map(|p| p.tops.values().cloned())
            .collect()
    }

    /// The snapshot an emergency rollback would try first now: the newest candidate of the
    /// current line taken of a healthy guest (`rollback.rs`, `choose_target`).
    fn preload_target(&self) -> Result<Option<String>, String> {
        if self.life.state() != VmState::Running {
            return Ok(None);
        }
        let entries = self.rollback_candidates(None).map_err(|e| e.to_string())?;
        Ok(entries.into_iter().find_map(|e| match e {
            ListEntry::Valid(m) if crate::snapshot::manifest_healthy(&m) => Some(m.snapshot_id),
            _ => None,
        }))
    }
}

/// The VM's disks, in its configuration's order (the standby's), on the preload's fresh top
/// layers; `None` if one has none (a standby's disks are all captured).
fn preload_disks(
    cfg: &crate::config::Config,
    tops: &BTreeMap<String, PathBuf>,
) -> Option<Vec<DiskAttachment>> {
    cfg.vm
        .disks
        .iter()
        .map(|d| {
            tops.get(&d.id).map(|top| DiskAttachment {
                id: d.id.clone(),
                active: top.clone(),
                captured: true,
            })
        })
        .collect()
}
