//! The durable upload queue: one JSON file under the daemon's state dir, replaced atomically
//! (written to a temporary file, fsync'd, renamed, directory fsync'd) at every change, so a
//! daemon killed at any point resumes from the last state it recorded. An upload that was in
//! flight is simply done again: objects already in the bucket are found by HEAD and not sent.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Waiting for its first (or next) attempt.
    Pending,
    /// Every object and the signed manifest are in the bucket.
    Uploaded,
}

/// One snapshot's replication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub vm: String,
    pub snapshot_id: String,
    pub state: EntryState,
    /// Attempts made so far (a successful one included).
    pub attempts: u32,
    /// Bytes and objects sent by the attempt that finished (objects already present are not).
    pub bytes_uploaded: u64,
    pub objects_uploaded: u64,
    pub objects_present: u64,
    /// The last failure (`CODE: message`), cleared when the upload completes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub enqueued_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_at: Option<String>,
    /// Wall-clock milliseconds (unix) before which no new attempt is made.
    #[serde(default)]
    pub not_before_ms: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File1 {
    version: u32,
    entries: Vec<Entry>,
}

#[derive(Debug, thiserror::Error)]
#[error("offsite queue {path}: {message}")]
pub struct QueueError {
    pub path: PathBuf,
    pub message: String,
}

/// The queue, in memory and on disk.
#[derive(Debug)]
pub struct Queue {
    path: PathBuf,
    entries: BTreeMap<(String, String), Entry>,
    /// Order of arrival (oldest first), for fairness.
    order: Vec<(String, String)>,
}

impl Queue {
    /// Opens (or starts) the queue at `path`. A file that does not parse is kept aside as
    /// `<path>.corrupt` and the queue starts empty: the next scan enqueues every published
    /// snapshot again, and the objects already uploaded are found by HEAD, not sent again.
    pub fn open(path: &Path) -> Result<Queue, QueueError> {
        let err = |message: String| QueueError {
            path: path.into(),
            message,
        };
        let mut q = Queue {
            path: path.into(),
            entries: BTreeMap::new(),
            order: Vec::new(),
        };
        match fs::read(path) {
            Ok(bytes) => match serde_json::from_slice::<File1>(&bytes) {
                Ok(f) if f.version == 1 => {
                    for e in f.entries {
                        q.insert(e);
                    }
                }
                other => {
                    let why = match other {
                        Ok(f) => format!("version {}", f.version),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(path = %path.display(), %why, "offsite queue unreadable: kept aside, starting afresh");
                    fs::rename(path, path.with_extension("corrupt"))
                        .map_err(|e| err(e.to_string()))?;
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e.to_string())),
        }
        Ok(q)
    }

    fn insert(&mut self, e: Entry) {
        let k = (e.vm.clone(), e.snapshot_id.clone());
        if self.entries.insert(k.clone(), e).is_none() {
            self.order.push(k);
        }
    }

    /// Adds `snapshot_id` of `vm` as pending unless it is known; true if added.
    pub fn enqueue(&mut self, vm: &str, snapshot_id: &str, now: &str) -> bool {
        if self.entries.contains_key(&(vm.into(), snapshot_id.into())) {
            return false;
        }
        self.insert(Entry {
            vm: vm.into(),
            snapshot_id: snapshot_id.into(),
            state: EntryState::Pending,
            attempts: 0,
            bytes_uploaded: 0,
            objects_uploaded: 0,
            objects_present: 0,
            last_error: None,
            enqueued_at: now.into(),
            uploaded_at: None,
            not_before_ms: 0,
        });
        true
    }

    /// Drops the entries of `vm` whose snapshot is no longer published locally (pruned or
    /// deleted); true if any was dropped.
    pub fn retain_published(&mut self, vm: &str, published: &dyn Fn(&str) -> bool) -> bool {
        let before = self.entries.len();
        self.entries.retain(|(v, id), _| v != vm || published(id));
        let entries = &self.entries;
        self.order.retain(|k| entries.contains_key(k));
        before != self.entries.len()
    }

    /// The oldest pending entry whose time has come.
    pub fn next_due(&self, now_ms: u64) -> Option<Entry> {
        self.order
            .iter()
            .filter_map(|k| self.entries.get(k))
            .find(|e| e.state == EntryState::Pending && e.not_before_ms <= now_ms)
            .cloned()
    }

    pub fn get(&self, vm: &str, snapshot_id: &str) -> Option<&Entry> {
        self.entries.get(&(vm.into(), snapshot_id.into()))
    }

    /// Replaces the entry (same vm and id).
    pub fn update(&mut self, e: Entry) {
        self.insert(e);
    }

    /// Every entry, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.order.iter().filter_map(|k| self.entries.get(k))
    }

    /// Writes the queue durably: temporary file, fsync, rename, fsync of the directory.
    pub fn save(&self) -> Result<(), QueueError> {
        let err = |e: std::io::Error| QueueError {
            path: self.path.clone(),
            message: e.to_string(),
        };
        let file = File1 {
            version: 1,
            entries: self.entries().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| QueueError {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(err)?;
        let tmp = self.path.with_extension("tmp");
        let mut f = File::create(&tmp).map_err(err)?;
        f.write_all(&bytes).map_err(err)?;
        f.sync_all().map_err(err)?;
        fs::rename(&tmp, &self.path).map_err(err)?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
        Ok(())
    }
}

/// The wait before attempt `attempts + 1`: 1 s doubling, capped at `max_s`.
pub fn backoff_ms(attempts: u32, max_s: u64) -> u64 {
    let exp = attempts.saturating_sub(1).min(20);
    (1000u64 << exp).min(max_s.saturating_mul(1000))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_queue_survives_a_restart_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queue.json");
        let mut q = Queue::open(&path).unwrap();
        assert!(q.enqueue("vm1", "b", "t1"));
        assert!(q.enqueue("vm1", "a", "t2"));
        assert!(!q.enqueue("vm1", "b", "t3"));
        let mut first = q.next_due(0).unwrap();
        assert_eq!(first.snapshot_id, "b");
        first.attempts = 1;
        first.last_error = Some("ERR_OFFSITE_UNREACHABLE: down".into());
        first.not_before_ms = 5_000;
        q.update(first);
        q.save().unwrap();
        // "Restart": the failed one waits for its backoff, the other one is due.
        let q = Queue::open(&path).unwrap();
        assert_eq!(q.next_due(1_000).unwrap().snapshot_id, "a");
        assert_eq!(q.next_due(5_000).unwrap().snapshot_id, "b");
        assert_eq!(q.get("vm1", "b").unwrap().attempts, 1);
        assert_eq!(q.entries().count(), 2);
    }

    #[test]
    fn uploaded_and_pruned_entries_leave_the_work() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = Queue::open(&dir.path().join("q.json")).unwrap();
        q.enqueue("vm1", "a", "t");
        q.enqueue("vm2", "a", "t");
        let mut e = q.next_due(0).unwrap();
        e.state = EntryState::Uploaded;
        q.update(e);
        assert_eq!(q.next_due(0).unwrap().vm, "vm2");
        assert!(q.retain_published("vm2", &|_| false));
        assert!(q.next_due(0).is_none());
        assert!(!q.retain_published("vm1", &|id| id == "a"));
    }

    #[test]
    fn a_corrupt_queue_file_is_kept_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.json");
        fs::write(&path, b"{not json").unwrap();
        let q = Queue::open(&path).unwrap();
        assert_eq!(q.entries().count(), 0);
        assert!(dir.path().join("q.corrupt").exists());
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        assert_eq!(backoff_ms(1, 60), 1000);
        assert_eq!(backoff_ms(2, 60), 2000);
        assert_eq!(backoff_ms(4, 60), 8000);
        assert_eq!(backoff_ms(30, 60), 60_000);
    }
}
