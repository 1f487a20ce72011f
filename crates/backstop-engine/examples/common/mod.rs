//! What the store examples share: their `[DIR] [REPS]` arguments, and storing a recorded state
//! stream the way a capture does.
// Each example is its own crate and uses a part of this: what one leaves unused is not dead.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use backstop_hypervisor::StreamCutter;
use backstop_integrity::HostKey;
use backstop_qemu::stream_chunks::MigrationCutter;
use backstop_store::{ChunkHash, ManifestInput, Store};

/// `[DIR] [REPS]` after the stream: DIR defaults to /var/tmp, REPS to 3 and must be positive.
pub fn dir_and_reps(args: &[String]) -> Result<(PathBuf, usize), String> {
    let parent = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"));
    let reps = match args.get(1) {
        Some(n) => n
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or(format!("REPS {n:?}: a positive number"))?,
        None => 3,
    };
    Ok((parent, reps))
}

/// A stream stored into a fresh store: the store, the snapshot's id, and how long cutting,
/// hashing and writing took, then publishing (syncfs, renames, directory fsyncs).
pub struct Stored {
    pub store: Store,
    pub id: String,
    pub written: Duration,
    pub published: Duration,
}

/// Cuts `stream` at its page records (as a capture does), its chunks named by `hash`, into a
/// fresh store at `root`, and publishes it.
pub fn store_stream(stream: &Path, root: &Path, hash: ChunkHash) -> Result<Stored, String> {
    let (store, _) = Store::open(root, HostKey::from_bytes([7; 32])).map_err(|e| e.to_string())?;
    let store = store.with_chunk_hash(hash);
    let mut builder = store.begin().map_err(|e| e.to_string())?;
    let file = std::fs::File::open(stream).map_err(|e| format!("{}: {e}", stream.display()))?;
    let mut cut = MigrationCutter { page_size: 4096 }.cut(Box::new(file));
    let t = Instant::now();
    builder
        .write_chunks("vmstate", "ram+device", &mut cut, &mut |_| {})
        .map_err(|e| e.to_string())?;
    let written = t.elapsed();
    let t = Instant::now();
    let manifest = builder
        .publish(ManifestInput {
            created_by: "operator:bench".into(),
            reason: "store benchmark".into(),
            scope: "full".into(),
            vm: "bench".into(),
            trigger: "console".into(),
            epoch: 1,
            config_fingerprint: "bench".into(),
            capture: serde_json::json!({}),
            lineage: None,
            name: None,
        })
        .map_err(|e| e.to_string())?;
    Ok(Stored {
        store,
        id: manifest.snapshot_id,
        written,
        published: t.elapsed(),
    })
}
