//! `[daemon] chunk_hash = "blake3"` on a real guest. Snapshots name their chunks by BLAKE3 (index
//! version 1.1), a rollback brings RAM and disk back to the snapshot point from them, a full
//! verification reads them all, and a chunk changed behind the daemon's back is caught. With no
//! forensic RAM to keep, the abandoned QEMU is killed and reaped beside the restore: gone by the
//! time the rollback answers.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{disk_sector0, flip_byte, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);

#[test]
fn a_blake3_store_rolls_back_verifies_and_catches_a_changed_chunk() {
    if skip_unless_ready("a_blake3_store_rolls_back_verifies_and_catches_a_changed_chunk") {
        return;
    }
    let d = Daemon::start_opts(
        "blake3",
        &Options {
            extra_daemon: "chunk_hash = \"blake3\"\n",
            extra_toml: "[rollback]\nforensic_ram_for = []\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    let v = d.ok(&["snapshot", "create", "--reason", "blake3 chunks"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let show = d.ok(&["snapshot", "show", &id]);
    assert_eq!(show["manifest"]["index_version"], "1.1", "{show}");

    // Every chunk is named by BLAKE3 in the index, and its file holds bytes of that digest.
    let store = d.state_dir().join("store");
    let index: Value = serde_json::from_slice(
        &std::fs::read(store.join(format!("snapshots/{id}/vmstate.index"))).unwrap(),
    )
    .unwrap();
    let chunks = index["chunks"].as_array().unwrap();
    assert!(chunks.len() > 10, "{index}");
    let path_of = |c: &Value| {
        let name = c["blake3"]
            .as_str()
            .unwrap_or_else(|| panic!("not named by blake3: {c}"));
        assert!(c.get("sha256").is_none(), "{c}");
        store.join(format!("chunks/{}/{name}", &name[..2]))
    };
    for c in chunks {
        let bytes = std::fs::read(path_of(c)).unwrap();
        assert_eq!(bytes.len() as u64, c["len"].as_u64().unwrap());
        assert_eq!(
            blake3::hash(&bytes).to_hex().as_str(),
            c["blake3"].as_str().unwrap()
        );
    }

    // The guest moves on; the rollback brings RAM and disk back from the BLAKE3 chunks.
    let snap_disk = {
        let refs = show["manifest"]["payload_refs"].as_array().unwrap();
        let disk = refs.iter().find(|p| p["name"] == "disk:data").unwrap();
        let top = disk["layers"].as_array().unwrap().last().unwrap()["path"]
            .as_str()
            .unwrap()
            .to_string();
        disk_sector0(std::path::Path::new(&top))
    };
    d.wait_tick(0, snap_disk + 4, STEP);
    let old_pid = d.status()["pid"].as_i64().unwrap();
    let before = d.serial_len();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: back to blake3"]);
    let revoked: Vec<&str> = rb["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(
        revoked
            .iter()
            .any(|r| r.starts_with("hypervisor process ended (killed while paused")),
        "{revoked:?}"
    );
    // Killed and reaped before the rollback answered: not even a zombie is left.
    let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(old_pid as i32), None);
    assert_eq!(gone, Err(nix::errno::Errno::ESRCH), "old QEMU {old_pid}");
    assert_ne!(d.status()["pid"].as_i64().unwrap(), old_pid);
    let ticks = d.wait_ticks_until(before, STEP, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<_> = ticks
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    assert!(
        restored[0].ram == snap_disk || restored[0].ram == snap_disk + 1,
        "{:?} vs {snap_disk}",
        restored[0]
    );
    for t in &restored {
        assert_eq!(t.ram, t.disk, "RAM and disk disagree after rollback: {t:?}");
    }

    // `snapshot verify` reads every chunk again under BLAKE3; one changed byte is caught.
    let full = d.ok(&["snapshot", "verify", &id]);
    assert!(full["bytes_checked"].as_u64().unwrap() > 1 << 20, "{full}");
    let largest = chunks
        .iter()
        .max_by_key(|c| c["len"].as_u64().unwrap())
        .unwrap();
    let _restore = flip_byte(&path_of(largest), 100);
    let out = d.cli(&["snapshot", "verify", &id]);
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        err["error"]["code"], "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED",
        "{err}"
    );
    assert_eq!(d.status()["state"], "running");
}
