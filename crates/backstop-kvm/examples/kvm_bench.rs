//! Benchmark of the embedded KVM backend (run by `scripts/bench-kvm.sh`; prints figures, asserts
//! nothing about time):
//!
//! 1. memcpy and SHA-256 bandwidth on this machine, measured in this run;
//! 2. per guest size: full-capture time and throughput (guest memory filled with non-zero,
//!    non-repeating data), then restore time, repeated, with its breakdown;
//! 3. diff snapshot size and pause against the pages the guest dirtied, and the restore time of
//!    full + diff.
//!
//! Usage: `kvm_bench [--sizes-mib 256,1024,4096] [--restores 5] [--work-dir DIR]`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use backstop_integrity::HostKey;
use backstop_kvm::guest::GuestProgramConfig;
use backstop_kvm::{KvmVm, KvmVmConfig, RestoreOptions, SnapshotKind};
use sha2::Digest;

struct Args {
    sizes_mib: Vec<u64>,
    restores: usize,
    work_dir: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sizes_mib: vec![256, 1024, 4096],
        restores: 5,
        work_dir: std::env::temp_dir().join(format!("backstop-kvm-bench-{}", std::process::id())),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--sizes-mib" => {
                args.sizes_mib = value()?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|e| format!("--sizes-mib: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--restores" => {
                args.restores = value()?.parse().map_err(|e| format!("--restores: {e}"))?
            }
            "--work-dir" => args.work_dir = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn gib_per_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1u64 << 30) as f64
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// Best of five copies of a 256 MiB buffer (both sides faulted in first).
fn memcpy_bandwidth() -> f64 {
    let len = 256 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    let mut dst = vec![1u8; len];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed());
        std::hint::black_box(&dst);
    }
    gib_per_s(len as u64, best)
}

fn sha256_bandwidth() -> f64 {
    let buf = vec![0x5au8; 64 << 20];
    let t = Instant::now();
    std::hint::black_box(sha2::Sha256::digest(&buf));
    gib_per_s(buf.len() as u64, t.elapsed())
}

fn program(pages_per_tick: u32, span_pages: u32, delay: u32) -> GuestProgramConfig {
    GuestProgramConfig {
        dirty_pages_per_tick: pages_per_tick,
        dirty_span_pages: span_pages,
        tick_delay_loops: delay,
        ..GuestProgramConfig::default()
    }
}

/// Fills guest RAM from 16 MiB up with data no page of which repeats or is zero.
fn fill(vm: &KvmVm) -> Result<(), String> {
    let chunk = 1 << 20;
    let mut buf = vec![0u8; chunk];
    let layout = vm.layout().clone();
    for region in &layout.regions {
        let start = if region.gpa == 0 {
            16 << 20
        } else {
            region.gpa
        };
        let end = region.gpa + region.size;
        let mut gpa = start;
        while gpa < end {
            for (i, word) in buf.chunks_exact_mut(8).enumerate() {
                let x = (gpa + i as u64 * 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                word.copy_from_slice(&x.to_le_bytes());
            }
            vm.write_guest(gpa, &buf).map_err(|e| e.to_string())?;
            gpa += chunk as u64;
        }
    }
    Ok(())
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    if !backstop_kvm::kvm_available() {
        return Err("/dev/kvm is not available".into());
    }
    std::fs::create_dir_all(&args.work_dir).map_err(|e| e.to_string())?;
    let key = HostKey::from_bytes([0x42; 32]);
    let cleanup = |p: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(entries) = std::fs::read_dir(p) {
            for e in entries.flatten() {
                let _ = std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o600));
            }
        }
        let _ = std::fs::remove_dir_all(p);
    };

    println!("== bandwidth on this machine (same run)");
    let memcpy = memcpy_bandwidth();
    println!("memcpy          {memcpy:6.2} GiB/s (256 MiB buffer, best of 5)");
    println!("sha256          {:6.2} GiB/s (64 MiB)", sha256_bandwidth());

    println!();
    println!("== full capture and restore, by guest memory size");
    println!(
        "{:>7} {:>9} {:>8} {:>7} {:>9} {:>8} | {:>10} {:>7} {:>9} {:>7} {:>7}",
        "mem_mib",
        "pause_ms",
        "GiB/s",
        "memcpy%",
        "sync_ms",
        "file_MiB",
        "restore_ms",
        "min_ms",
        "verify_ms",
        "map_ms",
        "vm_ms"
    );
    for &mib in &args.sizes_mib {
        let config = KvmVmConfig {
            mem_size_mib: mib,
            vcpus: 1,
            irqchip: true,
            program: program(16, 256, 20_000),
        };
        let mut vm = KvmVm::create(config).map_err(|e| e.to_string())?;
        fill(&vm)?;
        vm.resume();
        vm.wait_for_ticks(Duration::from_secs(30), |r| r.len() >= 3)
            .ok_or("guest did not tick")?;
        let dir = args.work_dir.join(format!("full-{mib}"));
        cleanup(&dir);
        let cap = vm
            .capture(&dir, SnapshotKind::Full, &key)
            .map_err(|e| e.to_string())?;
        drop(vm);
        let throughput = gib_per_s(cap.memory_bytes, Duration::from_micros(cap.memory_us));
        let mut totals = Vec::new();
        let mut last = None;
        for _ in 0..args.restores.max(1) {
            let (mut restored, summary) = KvmVm::restore(&[&dir], &key, RestoreOptions::default())
                .map_err(|e| e.to_string())?;
            totals.push(summary.total_us);
            restored.resume();
            restored
                .wait_for_ticks(Duration::from_secs(30), |r| !r.is_empty())
                .ok_or("restored guest did not tick")?;
            last = Some(summary);
        }
        totals.sort_unstable();
        let s = last.ok_or("no restore")?;
        let median = totals[totals.len() / 2];
        println!(
            "{mib:>7} {:>9.1} {:>8.2} {:>6.0}% {:>9.1} {:>8.0} | {:>10.2} {:>7.2} {:>9.2} {:>7.2} {:>7.2}",
            ms(cap.pause_us),
            throughput,
            throughput / memcpy * 100.0,
            ms(cap.sync_us),
            cap.memory_file_len as f64 / (1u64 << 20) as f64,
            ms(median),
            ms(totals[0]),
            ms(s.verify_us),
            ms(s.map_us),
            ms(s.vm_us),
        );
        cleanup(&dir);
    }
    println!(
        "(pause_ms: guest stopped while state and memory are copied out; GiB/s: that copy \
         (read guest memory, skip zero pages, write into the page cache) over guest memory size, \
         and as a share of memcpy; sync_ms: SHA-256 of the file + fsync + signed state + \
         publish, guest running again; \
         restore_ms: median of {} restores of the same snapshot to a paused VM, each then \
         resumed and seen to tick)",
        args.restores.max(1)
    );

    println!();
    println!("== diff snapshots: size and pause against pages the guest dirtied (256 MiB guest)");
    println!(
        "{:>10} {:>12} {:>12} {:>10} {:>10} {:>14}",
        "requested", "dirty_pages", "diff_KiB", "pause_ms", "restore_ms", "overlay_runs"
    );
    let span = 60_000u32;
    let config = KvmVmConfig {
        mem_size_mib: 256,
        vcpus: 1,
        irqchip: true,
        program: program(0, span, 300_000),
    };
    let mut vm = KvmVm::create(config).map_err(|e| e.to_string())?;
    fill(&vm)?;
    let base = args.work_dir.join("diff-base");
    cleanup(&base);
    vm.capture(&base, SnapshotKind::Full, &key)
        .map_err(|e| e.to_string())?;
    drop(vm);
    for (i, &pages) in [0u32, 16, 256, 4096, 16384, 60000].iter().enumerate() {
        // Restart from the base each time: restore it, let the guest dirty `pages` pages in one
        // tick, diff. (The parameter block rewrite is a VMM write: one page of the diff.)
        let (mut fresh, _) =
            KvmVm::restore(&[&base], &key, RestoreOptions::default()).map_err(|e| e.to_string())?;
        fresh
            .set_program_config(program(pages, span, 300_000))
            .map_err(|e| e.to_string())?;
        let have = fresh.tick_reports().len();
        fresh.resume();
        fresh
            .wait_for_ticks(Duration::from_secs(60), |r| r.len() > have)
            .ok_or("guest did not tick")?;
        fresh.pause().map_err(|e| e.to_string())?;
        let d = args.work_dir.join(format!("diff-{i}"));
        cleanup(&d);
        let cap = fresh
            .capture(&d, SnapshotKind::Diff, &key)
            .map_err(|e| e.to_string())?;
        let (_, summary) = KvmVm::restore(&[&base, &d], &key, RestoreOptions::default())
            .map_err(|e| e.to_string())?;
        println!(
            "{pages:>10} {:>12} {:>12.0} {:>10.2} {:>10.2} {:>14}",
            cap.dirty_pages,
            cap.memory_file_len as f64 / 1024.0,
            ms(cap.pause_us),
            ms(summary.total_us),
            summary.overlay_runs
        );
        cleanup(&d);
    }
    println!(
        "(dirty_pages includes the guest's counter and stack pages and the parameter page \
              the VMM rewrote; a full image of this guest is 262144 pages)"
    );
    cleanup(&base);
    let _ = std::fs::remove_dir(&args.work_dir);
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kvm_bench: {e}");
        std::process::exit(1);
    }
}
