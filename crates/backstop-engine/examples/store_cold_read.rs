//! How fast a stored state stream comes back out of the store, from the page cache and from the
//! disk. A rollback's target is often a snapshot taken long ago, whose chunks the page cache has
//! dropped; a chunk is a file of its own, so the kernel's readahead stops at each one.
//!
//!     cargo run --release -p backstop-engine --example store_cold_read -- STREAM [DIR] [REPS]
//!
//! STREAM (a recorded state stream, e.g. `bench/run.py`'s `recorded-<qemu>.vmstate`) is cut and
//! stored once into a fresh store under DIR (default /var/tmp). Each repetition then times, with
//! the page cache warm and again after `sync; echo 1 > /proc/sys/vm/drop_caches`:
//!
//! - a full verification (`Store::verify`: every chunk read and hashed),
//! - reading the payload back as a rollback does (`open_payload`: every chunk read and its crc32
//!   re-checked),
//! - reading STREAM itself, one file in order: what QEMU does with its own state file.
//!
//! Dropping the page cache needs root; without it the cold rows are left out, and say so.

use std::io::{self, Read};
use std::path::PathBuf;
use std::time::Instant;

use backstop_store::{ChunkHash, VerifyOptions};

mod common;

fn main() {
    if let Err(e) = run() {
        eprintln!("store_cold_read: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(stream) = args.first().map(PathBuf::from) else {
        return Err("usage: store_cold_read STREAM [DIR] [REPS]".into());
    };
    let (parent, reps) = common::dir_and_reps(&args[1..])?;
    let work = tempfile::Builder::new()
        .prefix("store-cold-read-")
        .tempdir_in(&parent)
        .map_err(|e| format!("{}: {e}", parent.display()))?;
    let common::Stored { store, id, .. } =
        common::store_stream(&stream, &work.path().join("store"), ChunkHash::Blake3)?;

    let verify = || -> Result<(), String> {
        store
            .verify(&id, &VerifyOptions::default())
            .map(drop)
            .map_err(|e| e.to_string())
    };
    let read_back = || -> Result<(), String> {
        let v = store
            .verify_trusting_checked(&id, &VerifyOptions::default())
            .map_err(|e| e.to_string())?;
        let mut payload = store
            .open_payload(&v, "vmstate")
            .map_err(|e| e.to_string())?;
        drain(&mut payload)
    };
    let read_file = || -> Result<(), String> {
        let mut f = std::fs::File::open(&stream).map_err(|e| e.to_string())?;
        drain(&mut f)
    };
    // (what, whether a full verification runs first, the step timed)
    type Step<'a> = (&'a str, bool, &'a dyn Fn() -> Result<(), String>);
    let steps: [Step; 3] = [
        ("full verification (every chunk hashed)", false, &verify),
        ("payload read back as a rollback does", true, &read_back),
        ("the stream as one file, read in order", false, &read_file),
    ];
    let bytes = std::fs::metadata(&stream).map_err(|e| e.to_string())?.len();
    println!(
        "stream {} ({:.0} MB), {reps} repetition(s), ms median [min..max]:",
        stream.display(),
        bytes as f64 / 1e6
    );
    for cold in [false, true] {
        for (name, verify_first, step) in &steps {
            let mut ms = Vec::new();
            for _ in 0..reps {
                // The read back trusts a verification (as a rollback's `choose` does), which must
                // not warm the cache the read is timed on: it runs first, then the cache goes.
                if *verify_first {
                    verify()?;
                }
                if cold {
                    if let Err(e) = drop_page_cache() {
                        println!("  (cold rows left out: {e})");
                        return Ok(());
                    }
                }
                let t = Instant::now();
                step()?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            ms.sort_by(f64::total_cmp);
            println!(
                "  {:<7} {name:<42} {:7.0} [{:.0}..{:.0}]",
                if cold { "cold" } else { "cached" },
                ms[ms.len() / 2],
                ms[0],
                ms[ms.len() - 1]
            );
        }
    }
    Ok(())
}

fn drain(r: &mut dyn Read) -> Result<(), String> {
    io::copy(r, &mut io::sink())
        .map(drop)
        .map_err(|e| e.to_string())
}

/// `sync`, then drop the clean page cache (root only).
fn drop_page_cache() -> Result<(), String> {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "1\n")
        .map_err(|e| format!("cannot drop the page cache: {e}"))
}
