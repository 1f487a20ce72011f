//! Incremental storage on a real guest: RAM is cut at QEMU's page records, so an idle guest's
//! second snapshot stores a small fraction of the first, dirtied RAM costs about what was dirtied,
//! and a rollback through chunks shared by several snapshots restores the guest.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);
const MIB: f64 = 1024.0 * 1024.0;
/// Random data the guest keeps resident (so the first snapshot has something to store).
const FILL_MIB: u64 = 128;
/// What the guest rewrites in one burst, every DIRTY_EVERY_S seconds.
const DIRTY_MIB: u64 = 16;
const DIRTY_EVERY_S: u64 = 40;

fn snapshot(d: &Daemon, reason: &str) -> Value {
    d.ok(&["snapshot", "create", "--reason", reason])
}

fn stored(v: &Value) -> f64 {
    v["summary"]["bytes_stored"].as_u64().unwrap() as f64
}

fn wait_serial(d: &Daemon, from: usize, needle: &str, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while !d.serial_since(from).contains(needle) {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {needle:?}; serial tail:\n{}",
            backstop_e2e::tail(&d.serial(), 10)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn idle_second_snapshot_stores_a_small_fraction_and_dirtied_ram_costs_its_size() {
    if skip_unless_ready(
        "idle_second_snapshot_stores_a_small_fraction_and_dirtied_ram_costs_its_size",
    ) {
        return;
    }
    let flags = format!(
        "backstop.fill_mib={FILL_MIB} backstop.dirty_mib={DIRTY_MIB} backstop.dirty_every={DIRTY_EVERY_S}"
    );
    let d = Daemon::start_opts(
        "incremental",
        &Options {
            guest_flags: &flags,
            ..Options::default()
        },
    );
    wait_serial(&d, 0, "BACKSTOP fill mib=", BOOT);
    let filled_at = d.serial_len();
    let first = snapshot(&d, "e2e: after the fill");
    let idle = snapshot(&d, "e2e: idle");
    assert!(
        !d.serial_since(filled_at).contains("BACKSTOP dirty begin"),
        "the guest dirtied its RAM between the first and the idle snapshot: the test's timing \
         assumption (bursts every {DIRTY_EVERY_S} s) does not hold on this machine"
    );

    for v in [&first, &idle] {
        let chunking = &v["manifest"]["capture"]["chunking"];
        assert_eq!(chunking["method"], "qemu-page-records", "{chunking}");
        assert_eq!(chunking["fallback"], Value::Null, "{chunking}");
        assert!(
            chunking["page_records"].as_u64().unwrap() > 60_000,
            "{chunking}"
        );
    }
    let (first_b, idle_b) = (stored(&first), stored(&idle));
    println!(
        "first {:.1} MiB, idle second {:.1} MiB ({:.1}%)",
        first_b / MIB,
        idle_b / MIB,
        100.0 * idle_b / first_b
    );
    assert!(
        first_b > FILL_MIB as f64 * MIB,
        "the first snapshot holds the guest's random data"
    );
    // The target, < 10%, is for an idle 1 GiB guest with 400 MiB resident
    // (scripts/bench-incremental.sh: 3.7%). This 256 MiB guest has 128 MiB resident, and its
    // init forks a few processes every tick, which scatters ~20-25 MiB of changed 64 KiB runs:
    // measured 14.6% here, where the store's blind FastCDC stored ~98% of the first again.
    assert!(
        idle_b < 0.25 * first_b,
        "idle second snapshot stored {:.1} MiB of the first's {:.1} MiB",
        idle_b / MIB,
        first_b / MIB
    );

    // The guest rewrites DIRTY_MIB of its data with fresh random bytes: that must be stored,
    // and not much more.
    let from = d.serial_len();
    wait_serial(
        &d,
        from,
        "BACKSTOP dirty end n=1",
        Duration::from_secs(DIRTY_EVERY_S * 3),
    );
    let dirty = snapshot(&d, "e2e: after 16 MiB dirtied");
    let at_snapshot = d.last_tick().unwrap();
    let dirty_b = stored(&dirty);
    println!("dirty {:.1} MiB", dirty_b / MIB);
    assert!(
        dirty_b > DIRTY_MIB as f64 * MIB,
        "fresh random data must be stored: {:.1} MiB",
        dirty_b / MIB
    );
    // What was dirtied, plus what an idle interval costs anyway, plus a little.
    assert!(
        dirty_b < 1.25 * DIRTY_MIB as f64 * MIB + 2.0 * idle_b,
        "dirtying {DIRTY_MIB} MiB stored {:.1} MiB (an idle interval: {:.1} MiB)",
        dirty_b / MIB,
        idle_b / MIB
    );

    // Every snapshot verifies through the shared chunks, and the guest comes back from the
    // newest one (its stream is ~thousands of chunks, most written by earlier snapshots).
    for v in [&first, &idle, &dirty] {
        let id = v["summary"]["snapshot_id"].as_str().unwrap();
        d.ok(&["snapshot", "verify", id]);
    }
    d.wait_tick(0, at_snapshot.ram + 4, Duration::from_secs(60));
    let before = d.serial_len();
    d.ok(&["rollback", "--reason", "e2e: back to the dirty snapshot"]);
    let ticks = d.wait_ticks_until(before, Duration::from_secs(60), "restored guest", |t| {
        t.iter().filter(|t| t.ram <= at_snapshot.ram + 2).count() >= 2
    });
    let restored: Vec<_> = ticks
        .iter()
        .filter(|t| t.ram <= at_snapshot.ram + 2)
        .collect();
    assert!(
        restored.iter().all(|t| t.ram == t.disk),
        "RAM and disk at the same instant: {restored:?}"
    );
}
