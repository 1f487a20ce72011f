//! The engine's durable records, beside the store in the state directory:
//!
//! * `vm-state.json`: the rollback epoch and each captured disk's layer chain (base first,
//!   the writable top layer last).
//! * `rollback-inflight.json`: written before a rollback touches the VM, removed after the
//!   restored VM runs. Finding it at start-up means a rollback never finished: HALTED.
//! * `halted.json`: the VM is HALTED, why, and since when. Only `halt clear` removes it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::durable;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    pub epoch: u64,
    /// Per captured disk: layer chain, base first, writable top last.
    pub chains: BTreeMap<String, Vec<PathBuf>>,
    /// Counter for new layer file names.
    pub next_layer: u64,
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
