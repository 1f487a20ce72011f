//! The engine's durable records, beside the store in the state directory:
//!
//! * `vm-state.json`: the rollback epoch and each captured disk's layer chain (base first,
//!   the writable top layer last).
//! * `rollback-inflight.json`: written before a rollback touches the VM, removed after the
//!   restored VM runs. Finding it at start-up means a rollback never finished: HALTED.
//! * `halted.json`: the VM is HALTED, why, and since when. Only `halt clear` removes it.
//! * `clean-stop.json`: the daemon stopped cleanly and took this final snapshot of the paused
//!   guest; the next start resumes from exactly it, then removes the record.
//! * `reattach.json`: an adopted domain was left running by a clean stop; what it was then
//!   (UUID, QEMU pid and start time, block graph, epoch). The next start re-attaches to it
//!   as it runs when all of that still holds, then removes the record.
//! * `reserve.bin`: 1 MiB kept allocated so that on a full filesystem the HALT record and the
//!   journal entries around it can still be written: released when such a write fails (the
//!   write is then retried once), re-made when the VM starts or is cleared.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use backstop_common::durable;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    pub epoch: u64,
    /// Per captured disk: layer chain, base first, writable top last.
    pub chains: BTreeMap<String, Vec<PathBuf>>,
    /// Counter for new layer file names.
    pub next_layer: u64,
    /// Random per record (`layers::new_lineage`), part of every layer name it makes, so a new
    /// record (a state reset, a second daemon or host on the same layers directory) never
    /// names a file an older one made. Empty in records older than lineages: their layers
    /// keep the plain `NNNNNN.qcow2` names.
    #[serde(default)]
    pub lineage: String,
    /// Layer names a create found taken by a file backstop did not make: never swept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_layers: Vec<PathBuf>,
    /// The snapshot the running VM descends from (lineage): the last one published of it, or
    /// the one it was restored from; `None` after a cold boot.
    #[serde(default)]
    pub position: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaltRecord {
    pub reason: String,
    pub code: String,
    pub since: String,
    pub trace_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightRecord {
    pub snapshot_id: String,
    pub trace_id: String,
    pub started_at: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanStopRecord {
    pub snapshot_id: String,
    pub trace_id: String,
    pub stopped_at: String,
}

/// An adopted domain left running by a clean stop, as it was then: the next start re-attaches
/// to it without a rollback only when the domain it finds is this one, unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReattachRecord {
    pub uuid: String,
    pub pid: u32,
    /// The QEMU process's start time (`/proc/PID/stat` field 22, clock ticks since boot): a
    /// reused pid is another process.
    pub pid_start: Option<u64>,
    /// Per captured disk, the layer the guest writes (the block graph's top).
    pub actives: BTreeMap<String, PathBuf>,
    pub epoch: u64,
    pub stopped_at: String,
}

impl ReattachRecord {
    /// What differs between the domain left (`self`) and the one found (`now`), one line each.
    pub fn differences(&self, now: &ReattachRecord) -> Vec<String> {
        let mut out = Vec::new();
        if self.uuid != now.uuid {
            out.push(format!("uuid: {} left, {} found", self.uuid, now.uuid));
        }
        if self.pid != now.pid {
            out.push(format!("QEMU pid: {} left, {} found", self.pid, now.pid));
        } else if self.pid_start.is_none() || self.pid_start != now.pid_start {
            out.push(format!(
                "QEMU process start: {:?} left, {:?} found (pid {} reused)",
                self.pid_start, now.pid_start, now.pid
            ));
        }
        if self.actives != now.actives {
            out.push(format!(
                "block graph: {:?} left, {:?} found",
                self.actives, now.actives
            ));
        }
        if self.epoch != now.epoch {
            out.push(format!("epoch: {} left, {} found", self.epoch, now.epoch));
        }
        out
    }
}

/// Left by `vm reset` in the new state directory: the VM's first journal entry names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetRecord {
    pub evidence: String,
    pub old_head_seq: Option<u64>,
    pub old_head_hash: Option<String>,
    pub reason: String,
    pub requested_by: String,
}

/// The whole entries among the last 1 MiB of the journal at `path`, newest first (read-only,
/// whatever the state of the rest of its chain).
fn journal_tail(path: &Path) -> Vec<serde_json::Value> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(len.saturating_sub(1 << 20)))
        .is_err()
        || f.read_to_end(&mut buf).is_err()
    {
        return Vec::new();
    }
    buf.split(|b| *b == b'\n')
        .rev()
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect()
}

/// The seq and hash of the last whole entry of the journal at `path`.
pub fn journal_head(path: &Path) -> (Option<u64>, Option<String>) {
    journal_tail(path)
        .iter()
        .find_map(|v| Some((v["seq"].as_u64()?, v["hash"].as_str()?.to_string())))
        .map_or((None, None), |(seq, hash)| (Some(seq), Some(hash)))
}

/// When the journal at `path` was last written under a `session_id` other than the given one
/// (the `ts` of its last such entry): how long a VM ran unwatched before the running daemon
/// took it over.
pub fn last_written_before(path: &Path, session_id: &str) -> Option<String> {
    journal_tail(path).iter().find_map(|v| {
        (v["fields"]["session_id"] != session_id)
            .then(|| v["ts"].as_str().map(str::to_string))
            .flatten()
    })
}

pub struct Records {
    dir: PathBuf,
}

impl Records {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.to_path_buf(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn read<T: for<'de> Deserialize<'de>>(&self, name: &str) -> std::io::Result<Option<T>> {
        let p = self.path(name);
        match std::fs::read(&p) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: {e}", p.display()),
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn write<T: Serialize>(&self, name: &str, value: &T) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
        durable::write_atomic(&self.path(name), &bytes)
    }

    pub fn load_vm(&self) -> std::io::Result<Option<VmRecord>> {
        self.read("vm-state.json")
    }
    pub fn save_vm(&self, r: &VmRecord) -> std::io::Result<()> {
        self.write("vm-state.json", r)
    }
    pub fn halted(&self) -> std::io::Result<Option<HaltRecord>> {
        self.read("halted.json")
    }
    pub fn set_halted(&self, r: &HaltRecord) -> std::io::Result<()> {
        self.write("halted.json", r)
    }
    pub fn clear_halted(&self) -> std::io::Result<()> {
        durable::remove_durably(&self.path("halted.json"))
    }
    pub fn inflight(&self) -> std::io::Result<Option<InflightRecord>> {
        // A torn or unreadable marker still means "a rollback may have been in flight".
        match self.read("rollback-inflight.json") {
            Ok(r) => Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Ok(Some(InflightRecord {
                snapshot_id: "unknown".into(),
                trace_id: "unknown".into(),
                started_at: "unknown".into(),
            })),
            Err(e) => Err(e),
        }
    }
    pub fn set_inflight(&self, r: &InflightRecord) -> std::io::Result<()> {
        self.write("rollback-inflight.json", r)
    }
    pub fn clear_inflight(&self) -> std::io::Result<()> {
        durable::remove_durably(&self.path("rollback-inflight.json"))
    }
    pub fn clean_stop(&self) -> std::io::Result<Option<CleanStopRecord>> {
        self.read("clean-stop.json")
    }
    pub fn set_clean_stop(&self, r: &CleanStopRecord) -> std::io::Result<()> {
        self.write("clean-stop.json", r)
    }
    pub fn clear_clean_stop(&self) -> std::io::Result<()> {
        durable::remove_durably(&self.path("clean-stop.json"))
    }
    pub fn reset(&self) -> std::io::Result<Option<ResetRecord>> {
        self.read("reset.json")
    }
    pub fn set_reset(&self, r: &ResetRecord) -> std::io::Result<()> {
        self.write("reset.json", r)
    }
    pub fn clear_reset(&self) -> std::io::Result<()> {
        durable::remove_durably(&self.path("reset.json"))
    }
    pub fn reattach(&self) -> std::io::Result<Option<ReattachRecord>> {
        self.read("reattach.json")
    }
    pub fn set_reattach(&self, r: &ReattachRecord) -> std::io::Result<()> {
        self.write("reattach.json", r)
    }
    pub fn clear_reattach(&self) -> std::io::Result<()> {
        durable::remove_durably(&self.path("reattach.json"))
    }
    /// The adopted domain as it was last guarded (its UUID and QEMU process), rewritten at
    /// every boot, re-attach and rollback: what a start after a crash compares with.
    pub fn guarding(&self) -> std::io::Result<Option<ReattachRecord>> {
        self.read("guarding.json")
    }
    pub fn set_guarding(&self, r: &ReattachRecord) -> std::io::Result<()> {
        self.write("guarding.json", r)
    }

    /// Makes the space reserve if it is missing (best effort: on a full disk it stays missing
    /// and is tried again next time).
    pub fn ensure_reserve(&self) {
        let p = self.path(RESERVE);
        if std::fs::metadata(&p).is_ok_and(|m| m.len() == RESERVE_BYTES) {
            return;
        }
        let made = (|| {
            let tmp = self.path("reserve.bin.tmp");
            let f = std::fs::File::create(&tmp)?;
            // Written, not sparse: the blocks must really be taken.
            std::io::Write::write_all(&mut &f, &vec![0u8; RESERVE_BYTES as usize])?;
            f.sync_all()?;
            durable::rename_durably(&tmp, &p)
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_file(self.path("reserve.bin.tmp"));
            tracing::warn!(error = %e, "no space reserve for the HALT record");
        }
    }

    /// Frees the reserve; true if there was one to free.
    pub fn release_reserve(&self) -> bool {
        let released = std::fs::remove_file(self.path(RESERVE)).is_ok();
        if released {
            tracing::warn!("space reserve released to write the HALT record");
        }
        released
    }
}

const RESERVE: &str = "reserve.bin";
const RESERVE_BYTES: u64 = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_tail_names_its_head_and_the_last_entry_of_an_earlier_session() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("journal.jsonl");
        assert_eq!(journal_head(&p), (None, None));
        std::fs::write(
            &p,
            concat!(
                r#"{"seq":1,"hash":"h1","ts":"t1","fields":{"session_id":"old"}}"#,
                "\n",
                r#"{"seq":2,"hash":"h2","ts":"t2","fields":{"session_id":"old"}}"#,
                "\n",
                r#"{"seq":3,"hash":"h3","ts":"t3","fields":{"session_id":"new"}}"#,
                "\n",
                r#"{"seq":4,"ha"#,
            ),
        )
        .unwrap();
        // A torn last line is no entry: the head is the last whole one.
        assert_eq!(journal_head(&p), (Some(3), Some("h3".into())));
        assert_eq!(last_written_before(&p, "new").as_deref(), Some("t2"));
        assert_eq!(last_written_before(&p, "other").as_deref(), Some("t3"));
    }

    #[test]
    fn a_reattach_record_differs_in_each_thing_it_compares() {
        let left = ReattachRecord {
            uuid: "u".into(),
            pid: 10,
            pid_start: Some(99),
            actives: [("vda".to_string(), PathBuf::from("/l/a.qcow2"))].into(),
            epoch: 3,
            stopped_at: "t".into(),
        };
        assert!(left.differences(&left.clone()).is_empty());
        let changed = |f: &dyn Fn(&mut ReattachRecord)| {
            let mut now = left.clone();
            f(&mut now);
            left.differences(&now)
        };
        assert!(changed(&|n| n.uuid = "v".into())[0].starts_with("uuid"));
        assert!(changed(&|n| n.pid = 11)[0].starts_with("QEMU pid"));
        assert!(changed(&|n| n.pid_start = Some(100))[0].starts_with("QEMU process start"));
        assert!(changed(&|n| {
            n.actives.insert("vda".into(), "/elsewhere.qcow2".into());
        })[0]
            .starts_with("block graph"));
        assert!(changed(&|n| n.epoch = 4)[0].starts_with("epoch"));
        // A record without the process's start time never matches (a reused pid is possible).
        let unknown = ReattachRecord {
            pid_start: None,
            ..left.clone()
        };
        assert_eq!(unknown.differences(&unknown.clone()).len(), 1);
    }

    #[test]
    fn records_round_trip_and_a_torn_inflight_marker_still_counts() {
        let d = tempfile::tempdir().unwrap();
        let r = Records::new(d.path());
        assert!(r.halted().unwrap().is_none());
        let h = HaltRecord {
            reason: "x".into(),
            code: "C".into(),
            since: "t".into(),
            trace_id: "tr".into(),
        };
        r.set_halted(&h).unwrap();
        assert_eq!(r.halted().unwrap(), Some(h));
        r.clear_halted().unwrap();
        assert!(r.halted().unwrap().is_none());
        std::fs::write(d.path().join("rollback-inflight.json"), b"{\"snaps").unwrap();
        assert!(r.inflight().unwrap().is_some());
    }
}
