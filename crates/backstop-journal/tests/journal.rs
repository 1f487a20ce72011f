//! Append, reopen, tamper detection, torn tail recovery and tail reads, through the public API.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;

use backstop_common::AuditEvent;
use backstop_integrity::{canonical, sha256_hex, HostKey, KEY_LEN};
use backstop_journal::{
    head_path, tail, verify, Fault, Journal, JournalError, ERR_AUDIT_CHAIN_BROKEN,
    ERR_AUDIT_INVALID_ENTRY, ERR_AUDIT_LOCKED, GENESIS_PREV, MAX_LINE_BYTES,
};
use common::{fields, journal_with, key, lines, write_lines};
use serde_json::{json, Value};

fn fault(line: u64, seq: Option<u64>, reason: &str) -> Option<Fault> {
    Some(Fault {
        line,
        seq,
        reason: reason.into(),
    })
}

fn mode(path: &std::path::Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn append_and_reopen_continue_one_contiguous_chain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit/journal.jsonl");
    let mut j = Journal::open(&path, key()).unwrap();
    assert_eq!((j.last_seq(), j.last_hash()), (0, GENESIS_PREV));
    let e1 = j
        .append(
            AuditEvent::DaemonStarted.as_str(),
            fields(json!({"pid": 1})),
        )
        .unwrap();
    let e2 = j
        .append(AuditEvent::VmStarted.as_str(), fields(json!({"vm": "a"})))
        .unwrap();
    assert_eq!((e1.seq, e2.seq), (1, 2));
    assert_eq!(e1.prev, GENESIS_PREV);
    assert_eq!(e2.prev, e1.hash);
    drop(j);

    let mut j = Journal::open(&path, key()).unwrap();
    assert_eq!((j.last_seq(), j.last_hash()), (2, e2.hash.as_str()));
    let e3 = j
        .append(AuditEvent::VmHalted.as_str(), fields(json!({"vm": "a"})))
        .unwrap();
    assert_eq!((e3.seq, e3.prev.as_str()), (3, e2.hash.as_str()));
    drop(j);

    let on_disk: Vec<Value> = lines(&path)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seqs: Vec<u64> = on_disk.iter().map(|v| v["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(on_disk[2], serde_json::to_value(&e3).unwrap());
    for (line, value) in lines(&path).iter().zip(&on_disk) {
        assert_eq!(
            line,
            &canonical::to_string(value).unwrap(),
            "lines are canonical JSON"
        );
    }
    assert_eq!(verify(&path, &key()).unwrap().entries, 3);
    assert!(verify(&path, &key()).unwrap().is_ok());
}

#[test]
fn files_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new/journal.jsonl");
    let mut j = Journal::open(&path, key()).unwrap();
    j.append(AuditEvent::DaemonStarted.as_str(), fields(json!({})))
        .unwrap();
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&head_path(&path)), 0o600);
    assert_eq!(mode(path.parent().unwrap()), 0o700);
    drop(j);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    drop(Journal::open(&path, key()).unwrap());
    assert_eq!(
        mode(&path),
        0o600,
        "a loosened journal is tightened on open"
    );
}

#[test]
fn head_file_is_sealed_canonical_json_of_the_last_entry() {
    let (_dir, path) = journal_with(3);
    let head: Value = serde_json::from_str(&fs::read_to_string(head_path(&path)).unwrap()).unwrap();
    let last: Value = serde_json::from_str(&lines(&path)[2]).unwrap();
    assert_eq!(head["seq"], 3);
    assert_eq!(head["hash"], last["hash"]);
    assert_ne!(
        head["mac"], last["mac"],
        "the head mac is domain-separated from entry macs"
    );
}

#[test]
fn a_second_writer_is_locked_out() {
    let (_dir, path) = journal_with(1);
    let _first = Journal::open(&path, key()).unwrap();
    let err = Journal::open(&path, key()).unwrap_err();
    assert_eq!(err.code(), ERR_AUDIT_LOCKED);
}

#[test]
fn invalid_input_is_refused_and_changes_nothing() {
    let (_dir, path) = journal_with(2);
    let before = fs::read(&path).unwrap();
    let mut j = Journal::open(&path, key()).unwrap();
    let err = j.append("Not An Event", fields(json!({}))).unwrap_err();
    assert!(matches!(err, JournalError::InvalidEvent { .. }));
    assert_eq!(err.code(), ERR_AUDIT_INVALID_ENTRY);
    let huge = "x".repeat(MAX_LINE_BYTES);
    let err = j
        .append(
            AuditEvent::VmStarted.as_str(),
            fields(json!({"blob": huge})),
        )
        .unwrap_err();
    assert!(matches!(err, JournalError::EntryTooLarge { .. }));
    assert_eq!(err.code(), ERR_AUDIT_INVALID_ENTRY);
    assert_eq!(j.last_seq(), 2);
    assert_eq!(fs::read(&path).unwrap(), before);
    assert_eq!(
        j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
            .unwrap()
            .seq,
        3
    );
}

#[test]
fn verify_passes_a_clean_journal_and_an_empty_one() {
    let (_dir, path) = journal_with(5);
    assert_eq!(
        verify(&path, &key()).unwrap(),
        backstop_journal::VerifyOutcome {
            entries: 5,
            first_bad: None
        }
    );
    let (_dir, empty) = journal_with(0);
    assert_eq!(verify(&empty, &key()).unwrap().entries, 0);
    assert!(verify(&empty, &key()).unwrap().is_ok());
}

#[test]
fn verify_of_a_missing_journal_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = verify(&dir.path().join("nope.jsonl"), &key()).unwrap_err();
    assert!(matches!(err, JournalError::Open { .. }));
    assert_eq!(err.code(), "ERR_AUDIT_IO");
}

#[test]
fn verify_names_the_exact_line_of_an_edited_field() {
    let (_dir, path) = journal_with(6);
    let mut l = lines(&path);
    l[3] = l[3].replace("\"vm\":\"vm-4\"", "\"vm\":\"vm-X\"");
    write_lines(&path, &l);
    let out = verify(&path, &key()).unwrap();
    assert_eq!(
        out.first_bad,
        fault(4, Some(4), "hash mismatch (entry edited)")
    );
    assert_eq!(out.entries, 3);
}

#[test]
fn verify_catches_a_deleted_middle_entry() {
    let (_dir, path) = journal_with(6);
    let mut l = lines(&path);
    l.remove(2);
    write_lines(&path, &l);
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(3, Some(4), "seq 4 follows 2 (entry deleted or reordered)")
    );
}

#[test]
fn verify_catches_two_swapped_entries() {
    let (_dir, path) = journal_with(6);
    let mut l = lines(&path);
    l.swap(1, 2);
    write_lines(&path, &l);
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(2, Some(3), "seq 3 follows 1 (entry deleted or reordered)")
    );
}

#[test]
fn verify_catches_a_truncated_tail_through_the_head() {
    let (_dir, path) = journal_with(12);
    let mut l = lines(&path);
    l.truncate(9);
    write_lines(&path, &l);
    let out = verify(&path, &key()).unwrap();
    assert_eq!(out.entries, 9);
    assert_eq!(
        out.first_bad,
        fault(
            10,
            Some(10),
            "journal ends at seq 9 but head says 12 (tail truncated)"
        )
    );
}

#[test]
fn verify_catches_a_missing_or_forged_head() {
    let (_dir, path) = journal_with(3);
    let head = head_path(&path);
    let saved = fs::read_to_string(&head).unwrap();
    fs::remove_file(&head).unwrap();
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(4, None, "head file missing")
    );

    // Truncate to 2 entries and forge a head out of entry 2's own seal.
    let mut l = lines(&path);
    l.truncate(2);
    write_lines(&path, &l);
    let e2: Value = serde_json::from_str(&l[1]).unwrap();
    let forged = json!({"seq": 2, "hash": e2["hash"], "mac": e2["mac"]});
    fs::write(&head, canonical::to_vec(&forged).unwrap()).unwrap();
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(3, None, "head mac mismatch")
    );
    fs::write(&head, saved).unwrap();
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad.unwrap().reason,
        "journal ends at seq 2 but head says 3 (tail truncated)"
    );
}

#[test]
fn verify_catches_a_recomputed_hash_without_the_key() {
    let (_dir, path) = journal_with(4);
    let mut l = lines(&path);
    let mut v: Value = serde_json::from_str(&l[1]).unwrap();
    v["fields"]["vm"] = json!("evil");
    let hashed = json!({"event": v["event"], "fields": v["fields"], "prev": v["prev"], "seq": v["seq"], "ts": v["ts"]});
    v["hash"] = json!(sha256_hex(&canonical::to_vec(&hashed).unwrap()));
    v["mac"] =
        json!(HostKey::from_bytes([0; KEY_LEN]).sign_hex(v["hash"].as_str().unwrap().as_bytes()));
    l[1] = canonical::to_string(&v).unwrap();
    write_lines(&path, &l);
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(2, Some(2), "mac mismatch")
    );
}

#[test]
fn verify_with_the_wrong_key_fails_at_line_one() {
    let (_dir, path) = journal_with(2);
    let other = HostKey::from_bytes([1; KEY_LEN]);
    // The head is checked after the walk; the first entry already fails.
    assert_eq!(
        verify(&path, &other).unwrap().first_bad,
        fault(1, Some(1), "mac mismatch")
    );
}

#[test]
fn verify_catches_garbage_a_relinked_entry_and_reformatting() {
    let (_dir, path) = journal_with(4);
    let original = lines(&path);

    let mut l = original.clone();
    l.insert(2, "this is not json".into());
    write_lines(&path, &l);
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(3, None, "not valid JSON")
    );

    let mut l = original.clone();
    l[2] = l[2].replacen("{\"event\"", "{ \"event\"", 1);
    write_lines(&path, &l);
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(3, Some(3), "line is not in canonical form")
    );

    // A correctly sealed entry that points at the wrong predecessor (sealed with the key, so
    // only its linkage is wrong).
    let j_dir = journal_with(0);
    let mut j = Journal::open(&j_dir.1, key()).unwrap();
    j.append("vm.started", fields(json!({"i": 1}))).unwrap();
    drop(j);
    let foreign = lines(&j_dir.1)[0].clone();
    let mut l = original.clone();
    l[0] = foreign.clone();
    write_lines(&path, &l);
    // Line 1 of another chain verifies on its own; line 2's prev no longer matches.
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(2, Some(2), "prev does not match entry before")
    );
    j_dir.0.close().unwrap();
}

#[test]
fn verify_reports_a_torn_last_line() {
    let (_dir, path) = journal_with(3);
    let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"{\"event\":\"vm.sta").unwrap();
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(4, None, "last line has no trailing newline (torn write)")
    );
}

#[test]
fn open_recovers_a_torn_tail_and_records_it() {
    let (dir, path) = journal_with(3);
    let torn = b"{\"event\":\"vm.halted\",\"fie".to_vec();
    fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(&torn)
        .unwrap();

    let mut j = Journal::open(&path, key()).unwrap();
    assert_eq!(j.last_seq(), 4);
    let saved: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("journal.jsonl.torn-")
        })
        .collect();
    assert_eq!(saved.len(), 1);
    assert_eq!(fs::read(&saved[0]).unwrap(), torn);
    assert_eq!(mode(&saved[0]), 0o600);

    let rec: Value = serde_json::from_str(&lines(&path)[3]).unwrap();
    assert_eq!(rec["event"], AuditEvent::JournalTornTailRecovered.as_str());
    assert_eq!(rec["fields"]["bytes"], torn.len());
    assert_eq!(rec["fields"]["sha256"], sha256_hex(&torn));
    assert_eq!(
        rec["fields"]["saved_to"],
        saved[0].to_string_lossy().as_ref()
    );
    j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
        .unwrap();
    let out = verify(&path, &key()).unwrap();
    assert_eq!((out.entries, out.first_bad), (5, None));
}

#[test]
fn open_recovers_a_journal_whose_only_line_is_torn() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    drop(Journal::open(&path, key()).unwrap());
    fs::write(&path, b"{\"ev").unwrap();
    let j = Journal::open(&path, key()).unwrap();
    assert_eq!(j.last_seq(), 1);
    assert!(verify(&path, &key()).unwrap().is_ok());
}

#[test]
fn open_refuses_a_tampered_last_line_and_changes_nothing() {
    let (_dir, path) = journal_with(3);
    let mut l = lines(&path);
    l[2] = l[2].replace("vm-3", "vm-Z");
    write_lines(&path, &l);
    let mut bytes = fs::read(&path).unwrap();
    bytes.extend_from_slice(b"{\"torn");
    fs::write(&path, &bytes).unwrap();
    let err = Journal::open(&path, key()).unwrap_err();
    assert_eq!(err.code(), ERR_AUDIT_CHAIN_BROKEN);
    assert!(err.to_string().contains("hash mismatch"), "{err}");
    assert_eq!(
        fs::read(&path).unwrap(),
        bytes,
        "the torn tail is left alone too"
    );
}

#[test]
fn open_refuses_the_wrong_key() {
    let (_dir, path) = journal_with(2);
    let err = Journal::open(&path, HostKey::from_bytes([1; KEY_LEN])).unwrap_err();
    assert!(matches!(err, JournalError::TamperedTail { .. }), "{err}");
}

#[test]
fn open_refuses_a_truncated_tail_and_a_missing_head() {
    let (_dir, path) = journal_with(5);
    let mut l = lines(&path);
    l.truncate(3);
    write_lines(&path, &l);
    let err = Journal::open(&path, key()).unwrap_err();
    assert_eq!(err.code(), ERR_AUDIT_CHAIN_BROKEN);
    assert!(
        err.to_string()
            .contains("journal ends at seq 3 but head says 5"),
        "{err}"
    );
    fs::remove_file(head_path(&path)).unwrap();
    let err = Journal::open(&path, key()).unwrap_err();
    assert!(err.to_string().contains("head file missing"), "{err}");
}

#[test]
fn open_accepts_a_head_lagging_after_a_crash_and_reseals_it() {
    let (_dir, path) = journal_with(3);
    let head = head_path(&path);
    let old_head = fs::read(&head).unwrap();
    let mut j = Journal::open(&path, key()).unwrap();
    j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
        .unwrap();
    j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
        .unwrap();
    drop(j);
    // Head written for seq 3, journal at 5: lags by more than one, so open walks the chain.
    fs::write(&head, &old_head).unwrap();
    assert!(
        verify(&path, &key()).unwrap().is_ok(),
        "a lagging head is not a fault"
    );
    let j = Journal::open(&path, key()).unwrap();
    assert_eq!(j.last_seq(), 5);
    let resealed: Value = serde_json::from_slice(&fs::read(&head).unwrap()).unwrap();
    assert_eq!(resealed["seq"], 5);

    drop(j);

    // Lagging by one entry (a crash between the journal write and the head write) is accepted:
    // that entry was never sealed into the head, so losing it cannot be told from the crash.
    let mut l = lines(&path);
    l.truncate(4);
    write_lines(&path, &l);
    fs::write(&head, &old_head).unwrap();
    assert_eq!(Journal::open(&path, key()).unwrap().last_seq(), 4);
}

#[test]
fn open_refuses_a_lagging_head_that_belongs_to_another_chain_or_hides_an_edit() {
    let (_dir, path) = journal_with(4);
    let (_other_dir, other) = journal_with(3);
    let head = head_path(&path);
    let good_head = fs::read(&head).unwrap();
    // Same key, seq 3, but another journal's hash: lag by one, checked against entry 4's prev.
    fs::copy(head_path(&other), &head).unwrap();
    let err = Journal::open(&path, key()).unwrap_err();
    assert!(
        err.to_string()
            .contains("head does not match entry at seq 3"),
        "{err}"
    );
    assert_eq!(
        verify(&path, &key()).unwrap().first_bad,
        fault(3, Some(3), "head does not match entry at seq 3")
    );

    // Lag by more than one: open walks the chain and finds an edit in the middle.
    fs::write(&head, &good_head).unwrap();
    let mut j = Journal::open(&path, key()).unwrap();
    j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
        .unwrap();
    j.append(AuditEvent::VmStarted.as_str(), fields(json!({})))
        .unwrap();
    drop(j);
    fs::write(&head, &good_head).unwrap();
    let mut l = lines(&path);
    l[1] = l[1].replace("vm-2", "vm-Q");
    write_lines(&path, &l);
    let err = Journal::open(&path, key()).unwrap_err();
    assert!(err.to_string().contains("line 2: hash mismatch"), "{err}");
}

#[test]
fn tail_returns_the_newest_entries_oldest_first() {
    let (_dir, path) = journal_with(7);
    let t = tail(&path, 3).unwrap();
    let seqs: Vec<u64> = t.iter().map(|v| v["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [5, 6, 7]);
    assert_eq!(tail(&path, 100).unwrap().len(), 7);
    assert!(tail(&path, 0).unwrap().is_empty());
    fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"{\"torn")
        .unwrap();
    assert_eq!(
        tail(&path, 1).unwrap()[0]["seq"],
        7,
        "a torn line is not an entry"
    );
    let (_dir, empty) = journal_with(0);
    assert!(tail(&empty, 5).unwrap().is_empty());
}

#[test]
fn tail_reports_over_long_and_garbage_lines() {
    let (_dir, path) = journal_with(2);
    let mut l = lines(&path);
    l.push("x".repeat(MAX_LINE_BYTES + 1));
    write_lines(&path, &l);
    let err = tail(&path, 1).unwrap_err();
    assert!(matches!(err, JournalError::Malformed { .. }), "{err}");
    assert_eq!(err.code(), ERR_AUDIT_CHAIN_BROKEN);
    assert_eq!(verify(&path, &key()).unwrap().first_bad.unwrap().line, 3);

    let mut l = lines(&path);
    l.pop();
    l.push("nope".into());
    write_lines(&path, &l);
    assert!(matches!(
        tail(&path, 1).unwrap_err(),
        JournalError::Malformed { .. }
    ));
}

#[test]
fn a_writer_sees_its_head_file_or_journal_changed_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit/journal.jsonl");
    let mut j = Journal::open(&path, key()).unwrap();
    // An empty journal has no head yet, and that is as it should be.
    assert_eq!(j.check_sealed_head().unwrap(), None);
    for i in 0..3 {
        j.append(AuditEvent::VmStarted.as_str(), fields(json!({ "i": i })))
            .unwrap();
    }
    assert_eq!(j.check_sealed_head().unwrap(), None);
    let head = head_path(&path);
    let saved = fs::read(&head).unwrap();
    fs::remove_file(&head).unwrap();
    assert_eq!(
        j.check_sealed_head().unwrap().as_deref(),
        Some("head file is missing")
    );
    fs::write(&head, b"{}").unwrap();
    assert!(j.check_sealed_head().unwrap().is_some());
    fs::write(&head, &saved).unwrap();
    assert_eq!(j.check_sealed_head().unwrap(), None);
    // An entry cut off the end behind the writer.
    let mut l = lines(&path);
    l.truncate(2);
    write_lines(&path, &l);
    let why = j.check_sealed_head().unwrap().unwrap();
    assert!(why.contains("bytes on disk"), "{why}");
}
