//! Moving a single-VM state directory into the many-VM layout, once.
//!
//! Every release before many-VM support kept its one VM's state in `state_dir` itself (`store/`,
//! `audit/`, `policy/`, the records, the serial log). A VM defined in the daemon file still does.
//! When an operator moves that VM into `vms_dir` (`vms.d/NAME.toml`), its state must follow it to
//! `state_dir/vms/NAME/` — else the VM would start with no snapshots, a fresh audit chain, and,
//! worst, a HALTED VM would run again. [`adopt_legacy_state`] does that move at the VM's first start
//! from `vms_dir`:
//!
//! * only when the legacy state is this VM's (its manifests, or failing those its serial log,
//!   name it) and `vms/NAME/` does not exist yet;
//! * crash-safe: every item is renamed into a hidden staging directory `vms/.NAME.migrating/`,
//!   a `migrated.json` record is written there, and one rename of the staging directory to
//!   `vms/NAME/` commits the whole move. A crash before that commit is finished by the next start
//!   (the staging directory alone says a migration is under way); one after it is done;
//! * disk layers stay where they are. Signed manifests, `vm-state.json` and the qcow2 overlays'
//!   own backing-file headers name them by absolute path, so moving them would break every chain.
//!   The record pins the VM's layers directory to the old `state_dir/disks` instead
//!   ([`pinned_layers_dir`]), so new layers join the old ones and retention prunes both.
//!
//! The host key (`keys/`) and the daemon journal (`daemon/`) are the daemon's and stay.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use backstop_common::durable;

/// What a VM's first start from `vms_dir` moved (journaled as `vm.state_migrated`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationRecord {
    /// The old state directory (the daemon's `state_dir`).
    pub from: PathBuf,
    /// The VM's state directory now.
    pub to: PathBuf,
    /// The items moved, by name.
    pub moved: Vec<String>,
    /// Where the VM's disk layers stay (`None`: the VM had none in the old layout).
    pub layers_dir: Option<PathBuf>,
    pub at: String,
}

/// The per-VM items of the single-VM layout (besides `NAME-serial.log`). An explicit list: any
/// other file an operator keeps in the state directory is not ours to move.
const LEGACY_ITEMS: [&str; 8] = [
    "store",
    "audit",
    "policy",
    "vm-state.json",
    "halted.json",
    "rollback-inflight.json",
    "clean-stop.json",
    "reserve.bin",
];

const RECORD: &str = "migrated.json";

fn staging_dir(root: &Path, name: &str) -> PathBuf {
    root.join("vms").join(format!(".{name}.migrating"))
}

fn legacy_items(name: &str) -> Vec<String> {
    let mut items: Vec<String> = LEGACY_ITEMS.iter().map(|s| s.to_string()).collect();
    items.push(format!("{name}-serial.log"));
    items
}

/// Whose state the single-VM layout in `root` holds: the VM its snapshot manifests name (all of
/// them must agree), or with no snapshot the one VM whose serial log is there. `None` when there
/// is no legacy state or it names no single VM.
pub fn legacy_owner(root: &Path) -> Option<String> {
    let mut names = std::collections::BTreeSet::new();
    if let Ok(snaps) = std::fs::read_dir(root.join("store/snapshots")) {
        for s in snaps.flatten() {
            let Ok(bytes) = std::fs::read(s.path().join("manifest.json")) else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                continue;
            };
            if let Some(vm) = v.get("vm").and_then(|v| v.as_str()) {
                names.insert(vm.to_string());
            }
        }
    }
    if names.is_empty() {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                let file = e.file_name().to_string_lossy().into_owned();
                if let Some(vm) = file.strip_suffix("-serial.log") {
                    names.insert(vm.to_string());
                }
            }
        }
    }
    let has_state = LEGACY_ITEMS.iter().any(|i| root.join(i).exists());
    match (has_state, names.len()) {
        (true, 1) => names.into_iter().next(),
        _ => None,
    }
}

/// Moves VM `name`'s single-VM state from `root` into `vm_dir` (= `root/vms/NAME`) if it is
/// there and has not been moved yet, or finishes a move a crash interrupted. `Ok(None)`: nothing
/// to move. An error leaves the staging directory for the next start to finish.
pub fn adopt_legacy_state(
    root: &Path,
    vm_dir: &Path,
    name: &str,
) -> std::io::Result<Option<MigrationRecord>> {
    let staging = staging_dir(root, name);
    let resuming = staging.is_dir();
    if !resuming {
        if vm_dir.exists() || legacy_owner(root).as_deref() != Some(name) {
            return Ok(None);
        }
        create_private(&root.join("vms"))?;
        create_private(&staging)?;
        durable::fsync_dir(&root.join("vms"))?;
    }
    let mut moved = Vec::new();
    for item in legacy_items(name) {
        let (old, new) = (root.join(&item), staging.join(&item));
        if std::fs::symlink_metadata(&old).is_ok() {
            std::fs::rename(&old, &new)?;
        }
        if std::fs::symlink_metadata(&new).is_ok() {
            moved.push(item);
        }
    }
    durable::fsync_dir(root)?;
    durable::fsync_dir(&staging)?;
    let disks = root.join("disks");
    let record = MigrationRecord {
        from: root.to_path_buf(),
        to: vm_dir.to_path_buf(),
        moved,
        layers_dir: disks.is_dir().then_some(disks),
        at: backstop_common::time::now_rfc3339(),
    };
    let bytes = serde_json::to_vec_pretty(&record).map_err(std::io::Error::other)?;
    durable::write_atomic(&staging.join(RECORD), &bytes)?;
    // The commit: one rename makes the whole move visible.
    durable::rename_durably(&staging, vm_dir)?;
    Ok(Some(record))
}

/// The layers directory a migrated VM keeps using (its old `state_dir/disks`), if any.
pub fn pinned_layers_dir(vm_dir: &Path) -> Option<PathBuf> {
    let bytes = std::fs::read(vm_dir.join(RECORD)).ok()?;
    serde_json::from_slice::<MigrationRecord>(&bytes)
        .ok()?
        .layers_dir
}

fn create_private(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A single-VM state dir of VM `name` with one snapshot manifest and the usual records.
    fn legacy(root: &Path, name: &str) {
        let snap = root.join("store/snapshots/snap-1");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(
            snap.join("manifest.json"),
            format!(r#"{{"vm":"{name}","snapshot_id":"snap-1"}}"#),
        )
        .unwrap();
        std::fs::create_dir_all(root.join("audit")).unwrap();
        std::fs::write(root.join("audit/journal.jsonl"), "line\n").unwrap();
        std::fs::write(root.join("vm-state.json"), "{}").unwrap();
        std::fs::write(root.join("halted.json"), "{}").unwrap();
        std::fs::write(root.join(format!("{name}-serial.log")), "HB 1\n").unwrap();
        std::fs::create_dir_all(root.join("disks")).unwrap();
        std::fs::write(root.join("disks/data-1.qcow2"), "layer").unwrap();
        std::fs::create_dir_all(root.join("keys")).unwrap();
        std::fs::write(root.join("keys/host.key"), "k").unwrap();
        std::fs::write(root.join("operator-notes.txt"), "mine").unwrap();
    }

    #[test]
    fn moves_the_vms_state_once_and_leaves_disks_keys_and_foreign_files() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        legacy(root, "web");
        let vm_dir = root.join("vms/web");
        let rec = adopt_legacy_state(root, &vm_dir, "web").unwrap().unwrap();
        assert_eq!(
            rec.moved,
            [
                "store",
                "audit",
                "vm-state.json",
                "halted.json",
                "web-serial.log"
            ]
        );
        assert_eq!(
            rec.layers_dir.as_deref(),
            Some(root.join("disks").as_path())
        );
        assert_eq!(
            std::fs::read_to_string(vm_dir.join("audit/journal.jsonl")).unwrap(),
            "line\n"
        );
        // A HALTED VM stays HALTED in its new home.
        assert!(vm_dir.join("halted.json").exists());
        assert!(!root.join("store").exists() && !root.join("vm-state.json").exists());
        for stays in ["disks/data-1.qcow2", "keys/host.key", "operator-notes.txt"] {
            assert!(root.join(stays).exists(), "{stays} was moved");
        }
        assert_eq!(pinned_layers_dir(&vm_dir), Some(root.join("disks")));
        // Once: a second start finds the VM's directory and moves nothing.
        assert_eq!(adopt_legacy_state(root, &vm_dir, "web").unwrap(), None);
    }

    #[test]
    fn another_vms_state_or_none_is_not_taken() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        assert_eq!(legacy_owner(root), None);
        assert_eq!(
            adopt_legacy_state(root, &root.join("vms/web"), "web").unwrap(),
            None
        );
        legacy(root, "db");
        assert_eq!(legacy_owner(root).as_deref(), Some("db"));
        assert_eq!(
            adopt_legacy_state(root, &root.join("vms/web"), "web").unwrap(),
            None
        );
        assert!(root.join("store").exists() && !root.join("vms/web").exists());
        // Manifests of two VMs: whose it is cannot be told, nothing is moved.
        let other = root.join("store/snapshots/snap-2");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("manifest.json"), r#"{"vm":"web"}"#).unwrap();
        assert_eq!(legacy_owner(root), None);
    }

    #[test]
    fn a_vm_with_no_snapshot_is_told_by_its_serial_log() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::write(root.join("halted.json"), "{}").unwrap();
        std::fs::write(root.join("web-serial.log"), "").unwrap();
        assert_eq!(legacy_owner(root).as_deref(), Some("web"));
        // A serial log alone is no state to move.
        std::fs::remove_file(root.join("halted.json")).unwrap();
        assert_eq!(legacy_owner(root), None);
    }

    #[test]
    fn a_move_cut_short_by_a_crash_is_finished_by_the_next_start() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        legacy(root, "web");
        // The crash: staging made, two items moved, no record, no commit.
        let staging = staging_dir(root, "web");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::rename(root.join("store"), staging.join("store")).unwrap();
        std::fs::rename(root.join("audit"), staging.join("audit")).unwrap();
        // The legacy owner can no longer be read from the manifests: the staging dir says it.
        let vm_dir = root.join("vms/web");
        let rec = adopt_legacy_state(root, &vm_dir, "web").unwrap().unwrap();
        assert_eq!(
            rec.moved,
            [
                "store",
                "audit",
                "vm-state.json",
                "halted.json",
                "web-serial.log"
            ]
        );
        assert!(!staging.exists());
        assert!(vm_dir.join("store/snapshots/snap-1/manifest.json").exists());
        assert!(vm_dir.join(RECORD).exists());
    }
}
