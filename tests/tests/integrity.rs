//! A snapshot that fails verification is refused with the spec's code, and the running VM is
//! not touched.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use backstop_e2e::{flip_byte, skip_unless_ready, Daemon};

#[test]
fn a_flipped_byte_anywhere_refuses_the_rollback_and_leaves_the_guest_running() {
    if skip_unless_ready(
        "a_flipped_byte_anywhere_refuses_the_rollback_and_leaves_the_guest_running",
    ) {
        return;
    }
    let d = Daemon::start("integrity");
    d.wait_tick(0, 2, Duration::from_secs(90));
    let v = d.ok(&["snapshot", "create", "--reason", "to corrupt"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let manifest = &v["manifest"];
    let snap_dir = d.state_dir().join(format!("store/snapshots/{id}"));
    let chunk = {
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(snap_dir.join("vmstate.index")).unwrap())
                .unwrap();
        // The largest chunk: RAM pages (the first is the stream's short preamble).
        let largest = index["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .max_by_key(|c| c["len"].as_u64().unwrap())
            .unwrap();
        assert!(largest["len"].as_u64().unwrap() > 8192, "{largest}");
        let sha = largest["sha256"].as_str().unwrap().to_string();
        d.state_dir()
            .join(format!("store/chunks/{}/{}", &sha[..2], sha))
    };
    let disk_layer: PathBuf = manifest["payload_refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain")
        .and_then(|p| p["layers"].as_array().unwrap().last().cloned())
        .unwrap()["path"]
        .as_str()
        .unwrap()
        .into();
    let targets: Vec<(&str, PathBuf, i64)> = vec![
        ("manifest", snap_dir.join("manifest.json"), 40),
        ("signature", snap_dir.join("manifest.sig"), 3),
        ("chunk index", snap_dir.join("vmstate.index"), 20),
        ("RAM chunk", chunk, 4096),
        ("disk layer", disk_layer, -100),
    ];
    let pid = d.status()["pid"].as_u64().unwrap();
    for (what, path, offset) in targets {
        let restore = flip_byte(&path, offset);
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
        let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let code = err["error"]["code"].as_str().unwrap();
        assert!(
            code == "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"
                || code == "ERR_SNAPSHOT_MANIFEST_INVALID",
            "{what}: code {code}"
        );
        // Untouched: same QEMU process, still running, guest still counting.
        let st = d.status();
        assert_eq!(st["pid"].as_u64(), Some(pid), "{what}: the VM was replaced");
        assert_eq!(st["state"], "running");
        assert_eq!(st["epoch"], 0);
        let top = d.last_tick().unwrap().ram;
        d.wait_tick(0, top + 1, Duration::from_secs(30));
    }
    // With every byte back in place the same snapshot verifies and restores.
    d.ok(&["snapshot", "verify", &id]);
    let journal = std::fs::read_to_string(d.journal_path()).unwrap();
    assert!(
        journal.contains("ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"),
        "refusals are journaled"
    );
}
