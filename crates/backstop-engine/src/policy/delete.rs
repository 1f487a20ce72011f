//! `snapshot delete`: a person removes one snapshot, the way retention removes one.
//!
//! The decision is pure ([`refusal`]): a snapshot is kept, and the request refused with the
//! reason named, when
//!
//! 1. the VM stands on it (the lineage position `snapshot list` marks current);
//! 2. another snapshot or the running VM has one of its own disk layers in its chain (the layer
//!    it froze at capture: the top of each of its disk chains) — deleting it would leave a
//!    snapshot whose chain runs through a layer no longer owned by a snapshot; also when some
//!    other manifest cannot be read (its layers are unknown: prune's rule);
//! 3. the retention plan keeps it ([`super::retention`]): one of the last N, the newest of its
//!    hour or day, rolled back within the grace period, the newest verified snapshot (so never
//!    the only one a rollback could use), an open action's pre-action snapshot, a forensic
//!    snapshot younger than `keep_forensic_hours`, a manifest that cannot be trusted.
//!
//! Otherwise it goes through [`VmActor::remove_snapshots`] (prune's path: atomic removal, chunk
//! and layer collection) and is journaled `snapshot.deleted` with the reason and who asked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::json;

use backstop_common::{AuditEvent, ErrorCode, Role};
use backstop_control::{DeleteView, Response};
use backstop_store::{ListEntry, Manifest, KIND_DISK_LAYER_CHAIN};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;

/// Who else uses a snapshot's own layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LayerUser {
    /// Another snapshot's chain runs through it.
    Snapshot(String),
    /// The running VM's chain of this disk runs through it.
    RunningVm(String),
    /// A manifest that cannot be read: its layers are unknown.
    Unreadable(String),
}

/// What the decision rests on.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeleteFacts {
    /// The VM stands on it.
    pub current: bool,
    pub layer_users: Vec<LayerUser>,
    /// The retention plan's reasons for keeping it (`None`: the plan removes it).
    pub kept_by: Option<Vec<String>>,
}

/// Why the snapshot may not be deleted (`None`: it may). One line.
pub(crate) fn refusal(facts: &DeleteFacts) -> Option<String> {
    if facts.current {
        return Some(
            "the VM stands on it (it is the current snapshot: the one the running VM descends from)"
                .into(),
        );
    }
    if let Some(user) = facts.layer_users.first() {
        return Some(match user {
            LayerUser::Snapshot(id) => {
                format!("its disk layer is a backing layer of snapshot {id}, which still needs it")
            }
            LayerUser::RunningVm(disk) => {
                format!("its disk layer is a backing layer of the running VM's disk {disk}")
            }
            LayerUser::Unreadable(id) => format!(
                "snapshot {id}'s manifest cannot be read, so which layers it needs is unknown"
            ),
        });
    }
    if let Some(reasons) = &facts.kept_by {
        return Some(format!("retention keeps it: {}", reasons.join("; ")));
    }
    None
}

/// The layers a snapshot added: the top of each of its disk chains (base images excluded).
pub(crate) fn own_layers(m: &Manifest, base_images: &BTreeSet<PathBuf>) -> BTreeSet<PathBuf> {
    m.payload_refs
        .iter()
        .filter(|p| p.kind == KIND_DISK_LAYER_CHAIN)
        .filter_map(|p| p.layers.last())
        .map(|l| l.path.clone())
        .filter(|p| !base_images.contains(p))
        .collect()
}

/// Who, of `others` (id, chain; `None`: unreadable) and the running VM's `running` chains
/// (disk, chain), has one of `own` in a chain. Paths are compared as given: callers pass them
/// canonical.
pub(crate) fn layer_users(
    own: &BTreeSet<PathBuf>,
    others: &[(String, Option<Vec<PathBuf>>)],
    running: &[(String, Vec<PathBuf>)],
) -> Vec<LayerUser> {
    let mut users = Vec::new();
    if own.is_empty() {
        return users;
    }
    for (disk, chain) in running {
        if chain.iter().any(|p| own.contains(p)) {
            users.push(LayerUser::RunningVm(disk.clone()));
        }
    }
    for (id, chain) in others {
        match chain {
            None => users.push(LayerUser::Unreadable(id.clone())),
            Some(chain) if chain.iter().any(|p| own.contains(p)) => {
                users.push(LayerUser::Snapshot(id.clone()))
            }
            Some(_) => {}
        }
    }
    users
}

/// A path as the file system resolves it (a state directory reached through a symlink must
/// never make a needed layer look unused); the path itself when it cannot be resolved.
fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

fn chain_of(m: &Manifest) -> Vec<PathBuf> {
    m.payload_refs
        .iter()
        .filter(|p| p.kind == KIND_DISK_LAYER_CHAIN)
        .flat_map(|p| p.layers.iter().map(|l| canonical(&l.path)))
        .collect()
}

impl VmActor {
    /// `snapshot delete ID|NAME --reason TEXT`. Console only; refused with nothing changed
    /// (and nothing journaled) when [`refusal`] says so.
    pub(crate) fn delete_request(
        &mut self,
        ctx: &mut Ctx,
        given: &str,
        reason: &str,
    ) -> Result<Response, EngineError> {
        if ctx.caller.role != Role::Console {
            return Err(EngineError::NotPermitted(
                "only a person at the console can delete a snapshot".into(),
            ));
        }
        let id = self.store.resolve(given).map_err(EngineError::Store)?;
        let refuse = |why: String| EngineError::Refused {
            code: ErrorCode::SnapshotDeleteRefused,
            message: format!("snapshot {id} is not deleted: {why}"),
        };
        let entries = self.store.list().map_err(EngineError::Store)?;
        let target = entries.iter().find_map(|e| match e {
            ListEntry::Valid(m) if m.snapshot_id == id => Some(m.clone()),
            _ => None,
        });
        let mut facts = DeleteFacts {
            current: self.vm.position.as_deref() == Some(id.as_str()),
            ..DeleteFacts::default()
        };
        if let Some(m) = &target {
            let bases: BTreeSet<PathBuf> = self
                .cfg
                .vm
                .disks
                .iter()
                .map(|d| canonical(&d.path))
                .collect();
            let own: BTreeSet<PathBuf> = own_layers(m, &BTreeSet::new())
                .iter()
                .map(|p| canonical(p))
                .filter(|p| !bases.contains(p))
                .collect();
            let others: Vec<(String, Option<Vec<PathBuf>>)> = entries
                .iter()
                .filter(|e| e.snapshot_id() != id)
                .map(|e| match e {
                    ListEntry::Valid(o) => (o.snapshot_id.clone(), Some(chain_of(o))),
                    ListEntry::Corrupt { snapshot_id, .. } => (snapshot_id.clone(), None),
                })
                .collect();
            let running: Vec<(String, Vec<PathBuf>)> = self
                .vm
                .chains
                .iter()
                .map(|(disk, chain)| (disk.clone(), chain.iter().map(|p| canonical(p)).collect()))
                .collect();
            facts.layer_users = layer_users(&own, &others, &running);
        }
        if let Some(why) = refusal(&facts) {
            return Err(refuse(why));
        }
        // The retention plan verifies the newest snapshot of the current line (the same walk
        // as prune); without one that verifies nothing is judged safe to remove.
        let plan = match self.retention_plan(ctx) {
            Ok(plan) => plan,
            Err(EngineError::NoVerifiedSnapshot { .. }) => {
                return Err(refuse(
                    "no snapshot of the current line verifies: nothing is deleted while the VM may have no other rollback target"
                        .into(),
                ))
            }
            Err(e) => return Err(e),
        };
        facts.kept_by = plan
            .keep
            .iter()
            .find(|(k, _)| *k == id)
            .map(|(_, reasons)| reasons.clone());
        if let Some(why) = refusal(&facts) {
            return Err(refuse(why));
        }
        ctx.step("delete", format!("deleting {id}"), None);
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();
        let by = ctx.caller.label();
        let name = target.as_ref().and_then(|m| m.name.clone());
        let removed = self.remove_snapshots(
            &[(id.clone(), reason.to_string())],
            &|id, reason, rolled_back, layers| {
                (
                    AuditEvent::SnapshotDeleted,
                    json!({
                        "snapshot_id": id, "session_id": sid, "trace_id": trace, "result": "ok",
                        "reason": reason, "requested_by": by, "name": name,
                        "rolled_back": rolled_back, "chain": layers,
                    }),
                )
            },
        )?;
        tracing::info!(snapshot_id = %id, chunks = removed.chunks_removed, layers = removed.layers.len(), "snapshot deleted");
        Ok(Response::SnapshotDeleted(DeleteView {
            snapshot_id: id,
            name,
            reason: reason.to_string(),
            chunks_removed: removed.chunks_removed,
            layers_removed: removed.layers.len() as u64,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn the_first_reason_that_holds_is_named() {
        assert_eq!(refusal(&DeleteFacts::default()), None);
        let all = DeleteFacts {
            current: true,
            layer_users: vec![LayerUser::Snapshot("b".into())],
            kept_by: Some(vec!["one of the last 10".into()]),
        };
        assert!(refusal(&all).unwrap().contains("stands on it"));
        let layered = DeleteFacts {
            current: false,
            ..all.clone()
        };
        assert!(refusal(&layered)
            .unwrap()
            .contains("backing layer of snapshot b"));
        let kept = DeleteFacts {
            current: false,
            layer_users: vec![],
            ..all
        };
        assert_eq!(
            refusal(&kept).unwrap(),
            "retention keeps it: one of the last 10"
        );
        for user in [
            LayerUser::RunningVm("data".into()),
            LayerUser::Unreadable("c".into()),
        ] {
            let why = refusal(&DeleteFacts {
                layer_users: vec![user],
                ..DeleteFacts::default()
            })
            .unwrap();
            assert!(!why.contains('\n'), "{why}");
            assert!(
                why.contains("data") || why.contains("c's manifest"),
                "{why}"
            );
        }
    }

    #[test]
    fn only_chains_through_an_own_layer_count() {
        let own: BTreeSet<PathBuf> = [p("/l/data/000003.qcow2")].into();
        let others = vec![
            // Its parent: shares the base and the parent's layer, not ours.
            (
                "parent".to_string(),
                Some(vec![p("/base.qcow2"), p("/l/data/000002.qcow2")]),
            ),
            // Its child: runs through ours.
            (
                "child".to_string(),
                Some(vec![
                    p("/base.qcow2"),
                    p("/l/data/000002.qcow2"),
                    p("/l/data/000003.qcow2"),
                    p("/l/data/000004.qcow2"),
                ]),
            ),
            ("broken".to_string(), None),
        ];
        let running = vec![(
            "data".to_string(),
            vec![p("/base.qcow2"), p("/l/data/000009.qcow2")],
        )];
        assert_eq!(
            layer_users(&own, &others, &running),
            vec![
                LayerUser::Snapshot("child".into()),
                LayerUser::Unreadable("broken".into())
            ]
        );
        let running_on_it = vec![(
            "data".to_string(),
            vec![p("/base.qcow2"), p("/l/data/000003.qcow2"), p("/l/x.qcow2")],
        )];
        assert_eq!(
            layer_users(&own, &[], &running_on_it),
            vec![LayerUser::RunningVm("data".into())]
        );
        // Nothing of its own (a chain of base images only): nobody depends on it.
        assert!(layer_users(&BTreeSet::new(), &others, &running_on_it).is_empty());
    }

    #[test]
    fn own_layers_are_the_tops_of_its_disk_chains_without_base_images() {
        use backstop_store::{DiskLayer, PayloadRef};
        let layer = |path: &str| DiskLayer {
            path: p(path),
            bytes: 1,
            sha256: "0".repeat(64),
            crc32: "00000000".into(),
        };
        let chain = |name: &str, layers: Vec<DiskLayer>| PayloadRef {
            name: name.into(),
            kind: KIND_DISK_LAYER_CHAIN.into(),
            index: None,
            layers,
            total_bytes: 0,
            new_bytes: 0,
            chunks: 0,
        };
        let m: Manifest = serde_json::from_value(json!({
            "snapshot_id": "x", "created_at": "t", "created_by": "c", "schema_version": "1.0",
            "index_version": "1.0", "scope": "full", "reason": "r", "checksums": [],
            "payload_refs": [
                chain("disk:data", vec![layer("/base.qcow2"), layer("/l/1.qcow2"), layer("/l/2.qcow2")]),
                chain("disk:boot", vec![layer("/boot.qcow2")]),
            ],
            "vm": "v", "trigger": "console", "epoch": 0, "config_fingerprint": "f",
            "capture": {}, "bytes_stored": 0,
        }))
        .unwrap();
        let bases: BTreeSet<PathBuf> = [p("/base.qcow2"), p("/boot.qcow2")].into();
        assert_eq!(own_layers(&m, &bases), [p("/l/2.qcow2")].into());
    }
}
