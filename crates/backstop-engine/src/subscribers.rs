//! Subscribers (spec/004's notification scope): host services that want to hear what happens
//! to the VMs — a snapshot published, a rollback started, completed or halted, a VM halted, a
//! halt cleared — in order, and without missing any across a reconnect.
//!
//! The journal is the source: a notification is a journal entry of one of those kinds, read
//! back from the VM's journal file (read-only, never through the actor, so a subscriber can
//! neither slow nor stall a VM). Its sequence number is the entry's `seq`, so a subscriber
//! that reconnects with the last one it saw gets exactly what came after, in journal order,
//! once: it can never hear of a rollback to a snapshot it was not told about, because the
//! snapshot's publication precedes the rollback in the same journal. Scope is per VM (the
//! envelope's `vm`, or all) and per type.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use backstop_common::ErrorCode;
use backstop_control::{Notification, NOTIFICATION_TYPES};

/// The notification a journal entry is, if it is one.
pub fn notification_of(vm: &str, entry: &Value) -> Option<Notification> {
    let f = entry.get("fields")?.as_object()?;
    let pick = |keys: &[&str]| -> Value {
        let mut m = Map::new();
        for k in keys {
            if let Some(v) = f.get(*k) {
                m.insert((*k).to_string(), v.clone());
            }
        }
        Value::Object(m)
    };
    let (event, details) = match entry.get("event")?.as_str()? {
        // A forensic snapshot (the disks a rollback abandoned) is no rollback target: the
        // rollback's own notification names it.
        "snapshot.create.completed"
            if f.get("result") == Some(&json!("ok"))
                && f.get("trigger") != Some(&json!(crate::forensic::FORENSIC)) =>
        {
            (
                "snapshot_published",
                pick(&["created_at", "bytes_stored", "trace_id"]),
            )
        }
        "rollback.initiated" => (
            "rollback_started",
            pick(&["rollback_type", "trigger", "action_ids", "trace_id"]),
        ),
        "rollback.completed" => (
            "rollback_completed",
            pick(&[
                "rollback_type",
                "trigger",
                "action_ids",
                "epoch",
                "total_ms",
                "trace_id",
                "forensic_snapshot_id",
            ]),
        ),
        "rollback.failed" => (
            "rollback_halted",
            pick(&["rollback_type", "trigger", "step", "trace_id"]),
        ),
        "vm.halted" => ("vm_halted", pick(&["code", "reason", "trace_id"])),
        "vm.halt_cleared" => ("halt_cleared", pick(&["cleared_by", "trace_id"])),
        _ => return None,
    };
    Some(Notification {
        vm: vm.to_string(),
        seq: entry.get("seq")?.as_u64()?,
        ts: entry.get("ts")?.as_str()?.to_string(),
        event: event.to_string(),
        snapshot_id: f
            .get("snapshot_id")
            .and_then(Value::as_str)
            .map(str::to_string),
        details,
    })
}

/// Checks a subscription's type filter: every name must be one of [`NOTIFICATION_TYPES`].
pub fn check_types(types: &[String]) -> Result<(), (ErrorCode, String)> {
    for t in types {
        if !NOTIFICATION_TYPES.contains(&t.as_str()) {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "unknown event type {t:?}; one of: {}",
                    NOTIFICATION_TYPES.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// Largest journal line read back (the journal's own bound).
const MAX_LINE: usize = backstop_journal::MAX_LINE_BYTES;

/// Follows one VM's journal from a byte offset, delivering complete lines only.
pub struct Follower {
    vm: String,
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    types: Vec<String>,
    /// The last seq read (whether delivered or not).
    pub last_seq: u64,
    since: u64,
}

impl Follower {
    /// A follower of `path` for `vm`: from after `since` (refused if this journal has not
    /// reached it yet), or from now.
    pub fn open(
        vm: &str,
        path: &Path,
        since: Option<u64>,
        types: Vec<String>,
    ) -> Result<Follower, (ErrorCode, String)> {
        let mut f = Follower {
            vm: vm.to_string(),
            path: path.to_path_buf(),
            offset: 0,
            partial: Vec::new(),
            types,
            last_seq: 0,
            since: 0,
        };
        // Read to the end once: the current last seq, and (from now) where to start.
        let io = |e: std::io::Error| {
            (
                ErrorCode::Io,
                format!("cannot read the journal {}: {e}", path.display()),
            )
        };
        f.read_new().map_err(io)?;
        let last = f.last_seq;
        match since {
            Some(s) if s > last => Err((
                ErrorCode::BadRequest,
                format!("--since {s}: the journal of {vm} ends at seq {last}; nothing has that sequence number yet"),
            )),
            Some(s) => {
                f.since = s;
                f.offset = 0;
                f.partial.clear();
                Ok(f)
            }
            None => {
                f.since = last;
                Ok(f)
            }
        }
    }

    /// The notifications journaled since the last call (after `since`), in order.
    pub fn poll(&mut self) -> std::io::Result<Vec<Notification>> {
        let entries = self.read_new()?;
        Ok(entries
            .iter()
            .filter_map(|e| notification_of(&self.vm, e))
            .filter(|n| n.seq > self.since)
            .filter(|n| self.types.is_empty() || self.types.contains(&n.event))
            .collect())
    }

    /// Complete lines appended since the last read, parsed (lines that do not parse are
    /// skipped: `audit verify` is where a bad line is reported).
    fn read_new(&mut self) -> std::io::Result<Vec<Value>> {
        let mut file = File::open(&self.path)?;
        let len = file.metadata()?.len();
        if len < self.offset {
            // Cut back (a torn tail recovered at a daemon start): read again from the start.
            self.offset = 0;
            self.partial.clear();
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        file.take(len - self.offset).read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.partial[start..].iter().position(|b| *b == b'\n') {
            let line = &self.partial[start..start + nl];
            start += nl + 1;
            if let Ok(v) = serde_json::from_slice::<Value>(line) {
                if let Some(seq) = v.get("seq").and_then(Value::as_u64) {
                    self.last_seq = self.last_seq.max(seq);
                }
                out.push(v);
            }
        }
        self.partial.drain(..start);
        if self.partial.len() > MAX_LINE {
            // No line is this long: drop it rather than grow without bound.
            self.partial.clear();
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn line(seq: u64, event: &str, fields: Value) -> String {
        format!(
            "{}\n",
            json!({"seq": seq, "ts": "2026-11-24T00:00:00.000Z", "event": event, "fields": fields})
        )
    }

    #[test]
    fn entries_map_to_notifications() {
        let e: Value = serde_json::from_str(&line(7, "rollback.completed", json!({"snapshot_id": "s", "epoch": 2, "trigger": "watchdog_timeout", "reason": "secret"}))).unwrap();
        let n = notification_of("web", &e).unwrap();
        assert_eq!(
            (n.event.as_str(), n.seq, n.snapshot_id.as_deref()),
            ("rollback_completed", 7, Some("s"))
        );
        assert_eq!(n.details["epoch"], 2);
        assert!(
            n.details.get("reason").is_none(),
            "reasons stay in the journal"
        );
        let failed: Value = serde_json::from_str(&line(
            8,
            "snapshot.create.completed",
            json!({"result": "failed"}),
        ))
        .unwrap();
        assert!(notification_of("web", &failed).is_none());
        assert!(check_types(&["rollback_started".into()]).is_ok());
        assert!(check_types(&["rollback".into()]).is_err());
    }

    #[test]
    fn a_follower_resumes_after_since_and_reads_complete_lines_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal.jsonl");
        let mut f = File::create(&p).unwrap();
        f.write_all(
            line(
                1,
                "snapshot.create.completed",
                json!({"result": "ok", "snapshot_id": "a"}),
            )
            .as_bytes(),
        )
        .unwrap();
        f.write_all(line(2, "rollback.initiated", json!({"snapshot_id": "a"})).as_bytes())
            .unwrap();
        f.write_all(
            line(
                3,
                "rollback.completed",
                json!({"snapshot_id": "a", "epoch": 1}),
            )
            .as_bytes(),
        )
        .unwrap();
        let mut from1 = Follower::open("vm", &p, Some(1), Vec::new()).unwrap();
        let got: Vec<u64> = from1.poll().unwrap().iter().map(|n| n.seq).collect();
        assert_eq!(got, vec![2, 3]);
        let mut now = Follower::open("vm", &p, None, vec!["rollback_completed".into()]).unwrap();
        assert!(now.poll().unwrap().is_empty());
        let half = line(
            4,
            "rollback.completed",
            json!({"snapshot_id": "a", "epoch": 2}),
        );
        f.write_all(&half.as_bytes()[..10]).unwrap();
        assert!(
            now.poll().unwrap().is_empty(),
            "a torn line is not delivered"
        );
        f.write_all(&half.as_bytes()[10..]).unwrap();
        f.write_all(line(5, "rollback.initiated", json!({})).as_bytes())
            .unwrap();
        let got: Vec<u64> = now.poll().unwrap().iter().map(|n| n.seq).collect();
        assert_eq!(got, vec![4], "only the asked type");
        assert!(Follower::open("vm", &p, Some(9), Vec::new()).is_err());
    }
}
