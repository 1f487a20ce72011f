// Shared by the integration tests; each test binary uses a different part.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

use backstop_integrity::{HostKey, KEY_LEN};
use backstop_journal::Journal;
use serde_json::{json, Map, Value};

pub fn key() -> HostKey {
    HostKey::from_bytes([9; KEY_LEN])
}

pub fn fields(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// A journal with `n` entries `e1..en` (field `i` = index) in a fresh directory.
pub fn journal_with(n: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let mut j = Journal::open(&path, key()).unwrap();
    for i in 1..=n {
        j.append(
            "vm.started",
            fields(json!({"i": i, "vm": format!("vm-{i}")})),
        )
        .unwrap();
    }
    (dir, path)
}

pub fn lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

pub fn write_lines(path: &Path, lines: &[String]) {
    let mut s = lines.join("\n");
    if !lines.is_empty() {
        s.push('\n');
    }
    fs::write(path, s).unwrap();
}
