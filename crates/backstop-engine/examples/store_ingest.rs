//! How fast the store ingests a recorded state stream, against writing the same bytes plainly
//! (the target: the store's ingest of a recorded stream ≥ 70% of `dd` with fsync, same disk).
//!
//! The stream (a file: QEMU's background snapshot or migration stream, e.g. one kept by
//! `bench/load_probe.py` or written by `migrate` to a file) goes the way a capture's does: cut at
//! its page records (`MigrationCutter`), every chunk hashed (sha256 + crc32) and written into a
//! fresh store under DIR, published (one syncfs, renames, directory fsyncs). Each repetition
//! also times the parts on their own, in the same run: reading and cutting only, the sha256 of
//! the cut chunks only, and writing the whole stream to one file with one fsync (`dd
//! conv=fsync`).
//!
//!     cargo run --release -p backstop-engine --example store_ingest -- STREAM [DIR] [REPS]
//!         [--chunk-hash sha256|blake3] [--json]
//!
//! `--chunk-hash` names the chunks as `[daemon] chunk_hash` would (default sha256); the
//! "hash only" figure is then that hash's. `--json` prints one JSON object instead of the table
//! (what `bench/run.py` reads: every repetition's rates and the medians, in bytes per second).
//!
//! DIR (default: a temporary directory under /var/tmp) must be on the disk whose rate matters.
//! The stream is read once first so every repetition reads it from the page cache.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use backstop_hypervisor::StreamCutter;
use backstop_qemu::stream_chunks::MigrationCutter;
use backstop_store::ChunkHash;

mod common;

fn main() {
    if let Err(e) = run() {
        eprintln!("store_ingest: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut hash = ChunkHash::Sha256;
    let json = match args.iter().position(|a| a == "--json") {
        Some(i) => {
            args.remove(i);
            true
        }
        None => false,
    };
    if let Some(i) = args.iter().position(|a| a == "--chunk-hash") {
        let value = args
            .get(i + 1)
            .ok_or("--chunk-hash needs a value (sha256 or blake3)")?;
        hash = value.parse()?;
        args.drain(i..=i + 1);
    }
    let Some(stream) = args.first().map(PathBuf::from) else {
        return Err(
            "usage: store_ingest STREAM [DIR] [REPS] [--chunk-hash sha256|blake3] [--json]".into(),
        );
    };
    let (parent, reps) = common::dir_and_reps(&args[1..])?;
    let bytes = std::fs::metadata(&stream)
        .map_err(|e| format!("{}: {e}", stream.display()))?
        .len();
    // Warm the page cache: every repetition then reads the stream from memory. A stream just
    // recorded (bench/run.py) may still be dirty in it: written out first, or the first
    // repetition's syncfs would write it too (seen: 0.47x against 0.8x for the next ones).
    let mut src = open(&stream)?;
    src.sync_all()
        .map_err(|e| format!("{}: fsync: {e}", stream.display()))?;
    io::copy(&mut src, &mut io::sink()).map_err(|e| e.to_string())?;

    let mut rows: Vec<[f64; 4]> = Vec::new();
    for rep in 1..=reps {
        let work = tempfile::Builder::new()
            .prefix("store-ingest-")
            .tempdir_in(&parent)
            .map_err(|e| format!("{}: {e}", parent.display()))?;
        let cut = time(|| cut_only(&stream))?;
        let hashed = hash_only(&stream, hash)?;
        let ingest = time(|| ingest(&stream, &work.path().join("store"), hash))?;
        let dd = time(|| write_synced(&stream, &work.path().join("dd.out")))?;
        let rate = |secs: f64| bytes as f64 / secs / 1e6;
        let row = [rate(ingest), rate(dd), rate(cut), rate(hashed)];
        eprintln!(
            "rep {rep}: store ingest {:.0} MB/s, write+fsync {:.0} MB/s, cut only {:.0} MB/s, hash only {:.0} MB/s",
            row[0], row[1], row[2], row[3]
        );
        rows.push(row);
    }
    let median = |i: usize| {
        let mut v: Vec<f64> = rows.iter().map(|r| r[i]).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    if json {
        let per_rep: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "ingest_bytes_per_s": r[0] * 1e6, "dd_bytes_per_s": r[1] * 1e6,
                    "cut_bytes_per_s": r[2] * 1e6, "hash_bytes_per_s": r[3] * 1e6,
                    "ratio": r[0] / r[1],
                })
            })
            .collect();
        let out = serde_json::json!({
            "stream": stream, "bytes": bytes, "chunk_hash": hash.name(), "reps": per_rep,
            "ingest_bytes_per_s": median(0) * 1e6, "dd_bytes_per_s": median(1) * 1e6,
            "cut_bytes_per_s": median(2) * 1e6, "hash_bytes_per_s": median(3) * 1e6,
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "stream {} ({:.0} MB), chunks named by {hash}, {reps} repetition(s), medians:",
        stream.display(),
        bytes as f64 / 1e6
    );
    println!(
        "  store ingest (cut, hash, write, publish)  {:8.0} MB/s",
        median(0)
    );
    println!(
        "  one file, written and fsynced (dd)        {:8.0} MB/s",
        median(1)
    );
    println!(
        "  read and cut only                         {:8.0} MB/s",
        median(2)
    );
    println!(
        "  {:<6} of the chunks only (one core)      {:8.0} MB/s",
        hash.name(),
        median(3)
    );
    println!(
        "  store / dd                                {:8.2} x   (goal >= 0.70)",
        median(0) / median(1)
    );
    Ok(())
}

fn open(path: &Path) -> Result<File, String> {
    File::open(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn time(f: impl FnOnce() -> Result<(), String>) -> Result<f64, String> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

fn chunks(stream: &Path) -> Result<Vec<Vec<u8>>, String> {
    let cutter = MigrationCutter { page_size: 4096 };
    let file = open(stream)?;
    let mut out = Vec::new();
    for chunk in cutter.cut(Box::new(file)) {
        out.push(chunk.map_err(|e| format!("cut: {e}"))?);
    }
    Ok(out)
}

fn cut_only(stream: &Path) -> Result<(), String> {
    let cutter = MigrationCutter { page_size: 4096 };
    let mut n = 0usize;
    for chunk in cutter.cut(Box::new(open(stream)?)) {
        n += chunk.map_err(|e| format!("cut: {e}"))?.len();
    }
    std::hint::black_box(n);
    Ok(())
}

/// Seconds spent on the chunks' digests alone under `hash` (the store's digest; its crc32 is a
/// few % more), the chunks cut beforehand and held in memory.
fn hash_only(stream: &Path, hash: ChunkHash) -> Result<f64, String> {
    let chunks = chunks(stream)?;
    let t = Instant::now();
    for c in &chunks {
        std::hint::black_box(hash.hex(c));
    }
    Ok(t.elapsed().as_secs_f64())
}

fn ingest(stream: &Path, root: &Path, hash: ChunkHash) -> Result<(), String> {
    let stored = common::store_stream(stream, root, hash)?;
    eprintln!(
        "  ingest: cut, hash and write {} ms, publish (syncfs, renames) {} ms",
        stored.written.as_millis(),
        stored.published.as_millis()
    );
    Ok(())
}

fn write_synced(stream: &Path, out: &Path) -> Result<(), String> {
    let mut src = open(stream)?;
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n]).map_err(|e| e.to_string())?;
    }
    dst.sync_all().map_err(|e| e.to_string())
}
