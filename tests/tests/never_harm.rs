//! Never harm what is there (QEMU backend, real guest): a file already at the name of the next
//! disk layer is refused with `ERR_LAYER_EXISTS` and left byte for byte as it was, through
//! the refused snapshot, the next snapshots, a rollback, a prune and a daemon restart; the
//! VM's snapshots and rollbacks go on around it.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};
use serde_json::Value;

const STEP: Duration = Duration::from_secs(120);

/// Identity and content of a file: inode, size, mtime, bytes.
fn fingerprint(p: &Path) -> (u64, u64, i64, i64, Vec<u8>) {
    let m = std::fs::metadata(p).unwrap();
    (
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        std::fs::read(p).unwrap(),
    )
}

/// The name of the next layer the VM record will make for `disk`.
fn next_layer_path(d: &Daemon, disk: &str) -> PathBuf {
    let rec: Value =
        serde_json::from_slice(&std::fs::read(d.state_dir().join("vm-state.json")).unwrap())
            .unwrap();
    let lineage = rec["lineage"].as_str().unwrap();
    assert_eq!(lineage.len(), 12, "a fresh record has a lineage: {rec}");
    let n = rec["next_layer"].as_u64().unwrap() + 1;
    d.state_dir()
        .join("disks")
        .join(disk)
        .join(format!("{lineage}-{n:06}.qcow2"))
}

fn snapshot(d: &Daemon, reason: &str) -> String {
    let v = d.ok(&["snapshot", "create", "--reason", reason]);
    v["summary"]["snapshot_id"].as_str().unwrap().to_string()
}

#[test]
fn a_file_at_the_next_layers_name_is_refused_and_never_touched() {
    let test = "a_file_at_the_next_layers_name_is_refused_and_never_touched";
    if skip_unless_ready(test) {
        return;
    }
    let mut d = Daemon::start("never-harm");
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    // Every layer name carries the record's lineage.
    let chain: Value =
        serde_json::from_slice(&std::fs::read(d.state_dir().join("vm-state.json")).unwrap())
            .unwrap();
    let lineage = chain["lineage"].as_str().unwrap().to_string();
    let top = chain["chains"]["data"].as_array().unwrap().last().unwrap();
    let top_name = Path::new(top.as_str().unwrap())
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(top_name.starts_with(&format!("{lineage}-")), "{top_name}");

    // Someone else's file where the next overlay would go.
    let planted = next_layer_path(&d, "data");
    std::fs::write(&planted, b"not backstop's: an operator's file\n").unwrap();
    let before = fingerprint(&planted);
    let snapshots_before = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .len();

    let out = d.cli(&["snapshot", "create", "--reason", "e2e: name taken"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "refused: {stderr}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("refused: {doc}");
    assert_eq!(doc["error"]["code"], "ERR_LAYER_EXISTS", "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains(planted.to_str().unwrap()),
        "the refusal names the file: {doc}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert_eq!(
        fingerprint(&planted),
        before,
        "the file in the way is untouched"
    );
    assert_eq!(
        d.ok(&["snapshot", "list"])["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        snapshots_before,
        "nothing was published"
    );

    // The VM goes on: snapshots, a rollback, a prune; the file stays as it was.
    let _a = snapshot(&d, "e2e: after the refusal");
    let b = snapshot(&d, "e2e: another");
    let rb = d.ok(&["rollback", "--to", &b, "--reason", "e2e: back"]);
    assert_eq!(rb["snapshot_id"], b.as_str());
    d.ok(&["snapshot", "prune"]);
    assert_eq!(
        fingerprint(&planted),
        before,
        "kept through rollback and prune"
    );

    // A restart (the record keeps the refused name): the sweep still never takes it.
    d.stop();
    d.launch();
    d.wait_journal(STEP, "resumed after the clean stop", |e| {
        e["event"] == "vm.resumed"
    });
    let c = snapshot(&d, "e2e: after the restart");
    d.ok(&["rollback", "--to", &c, "--reason", "e2e: back again"]);
    d.ok(&["snapshot", "prune"]);
    assert_eq!(fingerprint(&planted), before, "kept across a restart");
    let rec: Value =
        serde_json::from_slice(&std::fs::read(d.state_dir().join("vm-state.json")).unwrap())
            .unwrap();
    assert!(
        rec["refused_layers"]
            .as_array()
            .is_some_and(|r| r.iter().any(|p| p == planted.to_str().unwrap())),
        "the record keeps the refused name: {rec}"
    );
    d.ok(&["audit", "verify"]);
}

/// `vm reset` after a broken journal: the VM that cannot start names the verb; the reset keeps
/// the damaged state byte for byte as evidence, the new chain opens with `vm.reset` naming the
/// old head, a fresh baseline is taken and the VM runs; a running VM is never reset.
#[test]
fn vm_reset_keeps_the_damaged_state_as_evidence_and_starts_a_new_chain() {
    let test = "vm_reset_keeps_the_damaged_state_as_evidence_and_starts_a_new_chain";
    if skip_unless_ready(test) {
        return;
    }
    let mut d = Daemon::start_many("vm-reset", &["r1"], "", &[], &[]);
    let baseline = |d: &Daemon| {
        let deadline = std::time::Instant::now() + STEP;
        while !d
            .vm_journal("r1")
            .iter()
            .any(|e| e["event"] == "snapshot.create.completed")
        {
            assert!(
                std::time::Instant::now() < deadline,
                "no baseline:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    baseline(&d);
    d.stop();
    // An edited last line: the chain's head no longer verifies.
    let journal = d.vm_state_dir("r1").join("audit/journal.jsonl");
    let text = std::fs::read_to_string(&journal).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let n = lines.len() - 1;
    lines[n] = lines[n].replacen("\"result\":\"ok\"", "\"result\":\"no\"", 1);
    assert_ne!(lines[n], text.lines().nth(n).unwrap(), "the edit took");
    std::fs::write(&journal, lines.join("\n") + "\n").unwrap();
    let damaged = std::fs::read(&journal).unwrap();
    let last: Value = serde_json::from_str(lines.last().unwrap()).unwrap();

    d.launch_answering();
    let vms = d.ok(&["vms"]);
    let r1 = vms["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "r1")
        .unwrap()
        .clone();
    eprintln!("broken: {r1}");
    assert_eq!(r1["state"], "start_failed", "{r1}");
    let why = r1["reason"].as_str().unwrap();
    assert!(why.starts_with("ERR_AUDIT_CHAIN_BROKEN"), "{why}");
    assert!(
        why.contains("backstop vm reset r1 --reason"),
        "the refusal names the way back: {why}"
    );

    let out = d.cli(&["vm", "reset", "r1", "--reason", "e2e: edited journal"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("reset: {r}");
    let evidence = PathBuf::from(r["evidence"].as_str().unwrap());
    assert_eq!(r["old_head_seq"], last["seq"]);
    assert_eq!(r["old_head_hash"], last["hash"]);
    assert_eq!(
        std::fs::read(evidence.join("audit/journal.jsonl")).unwrap(),
        damaged,
        "the damaged journal is kept byte for byte"
    );
    assert!(
        evidence.join("vm-state.json").exists(),
        "the records are kept"
    );
    baseline(&d);
    let j = d.vm_journal("r1");
    assert_eq!(
        j[0]["event"], "vm.reset",
        "the new chain opens with the reset"
    );
    assert_eq!(j[0]["fields"]["old_head_seq"], last["seq"]);
    assert_eq!(j[0]["fields"]["old_head_hash"], last["hash"]);
    assert_eq!(j[0]["fields"]["evidence"], evidence.to_str().unwrap());
    assert_eq!(j[0]["fields"]["reason"], "e2e: edited journal");
    d.ok_vm("r1", &["audit", "verify"]);
    assert_eq!(d.ok_vm("r1", &["status"])["state"], "running");

    // A running VM is not reset: refused, nothing moved.
    let out = d.cli(&["vm", "reset", "r1", "--reason", "again"]);
    assert!(!out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["error"]["code"], "ERR_VM_BUSY", "{doc}");
    assert_eq!(
        std::fs::read_dir(evidence.parent().unwrap())
            .unwrap()
            .count(),
        1,
        "no second evidence directory"
    );
    assert_eq!(d.vm_journal("r1")[0]["event"], "vm.reset");
}

/// The `vms` entry of VM `vm`, waiting until it is no longer starting.
fn vm_entry(d: &Daemon, vm: &str) -> Value {
    let deadline = std::time::Instant::now() + STEP;
    loop {
        let vms = d.ok(&["vms"]);
        if let Some(v) = vms["vms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == vm && v["state"] != "starting" && v["state"] != "booting")
        {
            return v.clone();
        }
        assert!(std::time::Instant::now() < deadline, "{vm}: {vms}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One guardian per disk image, host-wide (QEMU backend): two VM files writing one disk in
/// place — in one daemon, or in two daemons with their own state dirs — are refused with
/// `ERR_VM_ALREADY_GUARDED` naming the first guardian, and the refused one writes nothing; a
/// base image that VMs only read is shared by all of them; the claim of a daemon that died is
/// taken over and journaled with who held it.
#[test]
fn a_disk_written_in_place_has_one_guardian_and_a_base_is_shared() {
    let test = "a_disk_written_in_place_has_one_guardian_and_a_base_is_shared";
    if skip_unless_ready(test) {
        return;
    }
    let shared = tempfile::tempdir().unwrap();
    let data = shared.path().join("shared-data.qcow2");
    let with_data = |d: &Daemon, vm: &str| {
        let file = d.dir.path().join(format!("vms.d/{vm}.toml"));
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(
            &file,
            format!(
                "{text}\n[[vm.disks]]\nid = \"shared\"\npath = \"{}\"\nsnapshot = \"exclude\"\ncreate_size_mib = 16\n",
                data.display()
            ),
        )
        .unwrap();
    };
    // One daemon: "a" and "b" share the base image (captured) and name one in-place disk;
    // "c" only shares the base.
    let mut d = Daemon::prepare_many("disk-claim", &["a", "b", "c"], "", &[], &[]);
    with_data(&d, "a");
    with_data(&d, "b");
    d.launch_answering();
    let (a, b) = (vm_entry(&d, "a"), vm_entry(&d, "b"));
    let (winner, refused) = if a["state"] == "running" {
        (a, b)
    } else {
        (b, a)
    };
    eprintln!("guardian: {winner}\nrefused: {refused}");
    assert_eq!(winner["state"], "running", "{winner}");
    let why = refused["reason"].as_str().unwrap_or_default();
    assert!(why.starts_with("ERR_VM_ALREADY_GUARDED"), "{refused}");
    let first = winner["name"].as_str().unwrap().to_string();
    assert!(
        why.contains(&format!(
            "vm '{first}' of backstopd pid {}",
            d.pid().unwrap()
        )),
        "the refusal names the first guardian: {why}"
    );
    assert!(why.contains("written in place"), "{why}");
    let loser = refused["name"].as_str().unwrap();
    assert!(
        !d.vm_state_dir(loser).join("audit").exists(),
        "the refused VM journaled"
    );
    assert_eq!(vm_entry(&d, "c")["state"], "running", "a shared base");
    // The guardian works on.
    d.ok_vm(&first, &["snapshot", "create", "--reason", "e2e: guarded"]);

    // A second daemon, its own state dir, the same in-place disk: refused, nothing written.
    let mut other = Daemon::prepare_many("disk-claim2", &["e"], "", &[], &[]);
    with_data(&other, "e");
    other.launch_answering();
    let e = vm_entry(&other, "e");
    eprintln!("second daemon: {e}");
    let why = e["reason"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("ERR_VM_ALREADY_GUARDED") && why.contains(&format!("vm '{first}'")),
        "{e}"
    );
    assert!(
        !other.vm_state_dir("e").exists(),
        "the refused VM made its state dir"
    );

    // The first daemon dies: its claim's lock is free, and the second takes it over, saying
    // from whom.
    d.kill9();
    other.stop();
    other.launch();
    let deadline = std::time::Instant::now() + STEP;
    let taken = loop {
        if let Some(t) = other
            .vm_journal("e")
            .into_iter()
            .find(|e| e["event"] == "vm.claim_taken_over")
        {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no take-over:\n{}",
            other.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("taken over: {}", taken["fields"]);
    assert_eq!(taken["fields"]["previous"]["vm"], first.as_str(), "{taken}");
    assert_eq!(vm_entry(&other, "e")["state"], "running");
}
