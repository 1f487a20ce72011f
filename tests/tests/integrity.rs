//! A snapshot that fails verification is refused with the spec's code and a message naming the
//! part that failed, and the running VM is not touched. Each part is corrupted in a snapshot of
//! its own: a refusal marks its snapshot unusable, and a later case on the same snapshot would be
//! refused on that mark before its own byte was read.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use backstop_e2e::{flip_byte, review, skip_unless_ready, Daemon, Options};
use serde_json::Value;

/// One corruption: which file of a fresh snapshot, where, and what the refusal must say.
struct Case {
    what: &'static str,
    /// The file to damage, from the snapshot's directory and manifest.
    path: fn(&Daemon, &Path, &Value) -> (PathBuf, String),
    offset: i64,
    code: &'static str,
}

/// The largest chunk of the snapshot's RAM stream (the first is the stream's short preamble).
fn ram_chunk(d: &Daemon, snap_dir: &Path, _: &Value) -> (PathBuf, String) {
    let index: Value =
        serde_json::from_slice(&std::fs::read(snap_dir.join("vmstate.index")).unwrap()).unwrap();
    let largest = index["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|c| c["len"].as_u64().unwrap())
        .unwrap();
    assert!(largest["len"].as_u64().unwrap() > 8192, "{largest}");
    let sha = largest["sha256"].as_str().unwrap().to_string();
    (
        d.state_dir()
            .join(format!("store/chunks/{}/{}", &sha[..2], sha)),
        format!("checksum mismatch in chunk {sha}"),
    )
}

/// The disk layer this snapshot made immutable (the top of its chain).
fn disk_layer(_: &Daemon, _: &Path, manifest: &Value) -> (PathBuf, String) {
    let path = backstop_e2e::top_disk_layer(manifest);
    let said = format!("checksum mismatch in disk layer {}", path.display());
    (path, said)
}

const SIGNATURE: &str =
    "manifest signature does not match (tampered, corrupt or another host's key)";

#[test]
fn a_flipped_byte_anywhere_refuses_the_rollback_and_leaves_the_guest_running() {
    if skip_unless_ready(
        "a_flipped_byte_anywhere_refuses_the_rollback_and_leaves_the_guest_running",
    ) {
        return;
    }
    // A reviewer key: the last step restores an older snapshot than the newest.
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let d = Daemon::start_opts(
        "integrity",
        &Options {
            extra_toml: &review::restore_gate_toml(&key),
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    // The RAM chunk last: it may be shared with the other snapshots (chunks are deduplicated),
    // and a refusal quarantines a damaged chunk until it is put back.
    let cases = [
        Case {
            what: "manifest",
            // The signature is checked over the raw bytes before anything is decoded.
            path: |_, dir, _| (dir.join("manifest.json"), SIGNATURE.into()),
            offset: 40,
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        },
        Case {
            what: "signature",
            path: |_, dir, _| (dir.join("manifest.sig"), SIGNATURE.into()),
            offset: 3,
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        },
        Case {
            what: "chunk index",
            path: |_, dir, _| {
                (
                    dir.join("vmstate.index"),
                    "checksum mismatch in index file vmstate.index".into(),
                )
            },
            offset: 20,
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        },
        Case {
            what: "disk layer",
            path: disk_layer,
            offset: -100,
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        },
        Case {
            what: "RAM chunk",
            path: ram_chunk,
            offset: 4096,
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        },
    ];
    let pid = d.status()["pid"].as_u64().unwrap();
    let mut damaged = Vec::new();
    for case in &cases {
        let what = case.what;
        // A snapshot no earlier case touched.
        let v = d.ok(&[
            "snapshot",
            "create",
            "--reason",
            &format!("to corrupt its {what}"),
        ]);
        let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
        let snap_dir = d.state_dir().join(format!("store/snapshots/{id}"));
        let (path, said) = (case.path)(&d, &snap_dir, &v["manifest"]);
        let restore = flip_byte(&path, case.offset);
        let out = d.cli(&[
            "rollback",
            "--to",
            &id,
            "--reason",
            &format!("corrupt {what}"),
        ]);
        restore();
        assert_eq!(
            out.status.code(),
            Some(5),
            "{what}: exit code; stdout {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let err: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(err["error"]["code"], case.code, "{what}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("snapshot {id}: {said}")),
            "{what}: the refusal names the part that failed: {message}"
        );
        // Untouched: same QEMU process, still running, guest still counting.
        let st = d.status();
        assert_eq!(st["pid"].as_u64(), Some(pid), "{what}: the VM was replaced");
        assert_eq!(st["state"], "running");
        assert_eq!(st["epoch"], 0);
        let top = d.last_tick().unwrap().ram;
        d.wait_tick(0, top + 1, Duration::from_secs(30));
        damaged.push(id);
    }
    let journal = std::fs::read_to_string(d.journal_path()).unwrap();
    assert!(
        journal.contains("ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"),
        "refusals are journaled"
    );
    // With every byte back in place each snapshot verifies again, and one restores.
    for id in &damaged {
        d.ok(&["snapshot", "verify", id]);
    }
    let token = review::token(&key, &damaged[0]);
    d.ok(&[
        "rollback",
        "--to",
        &damaged[0],
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "every byte is back",
    ]);
    assert_eq!(d.status()["epoch"], 1);
}
