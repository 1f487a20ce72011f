//! Weeks of uptime in minutes: `BACKSTOP_SOAK_SNAPSHOTS` snapshots of the tiny guest (default
//! 100, what CI runs; `scripts/soak.sh --snapshots 1000` runs the long one), retention applied
//! every 10. After every snapshot four series are sampled — the running disk chain's depth, the
//! daemon's open descriptors, the state directory's size and the daemon's RSS — and printed as
//! `soak,<n>,<depth>,<fds>,<state_kib>,<rss_kib>` lines; each must stay flat after a warm-up.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};

/// Bytes of every file under `dir`.
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        match e.file_type() {
            Ok(t) if t.is_dir() => total += tree_bytes(&e.path()),
            Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => {}
        }
    }
    total
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    depth: u64,
    fds: u64,
    state_kib: u64,
    rss_kib: u64,
}

#[test]
fn a_long_run_of_snapshots_keeps_chain_descriptors_space_and_memory_flat() {
    if skip_unless_ready("a_long_run_of_snapshots_keeps_chain_descriptors_space_and_memory_flat") {
        return;
    }
    let n: usize = std::env::var("BACKSTOP_SOAK_SNAPSHOTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mut d = Daemon::start("soak");
    d.wait_tick(0, 2, Duration::from_secs(120));
    let pid = d.pid().unwrap();
    let state = d.state_dir();
    let mut samples: Vec<Sample> = Vec::new();
    eprintln!("soak,n,depth,fds,state_kib,rss_kib");
    for i in 1..=n {
        d.ok(&["snapshot", "create", "--reason", "soak"]);
        if i % 10 == 0 {
            d.ok(&["snapshot", "prune"]);
        }
        let vm: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state.join("vm-state.json")).unwrap()).unwrap();
        let s = Sample {
            depth: vm["chains"]["data"].as_array().unwrap().len() as u64,
            fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
                .unwrap()
                .count() as u64,
            state_kib: tree_bytes(&state) >> 10,
            rss_kib: rss_kib(pid),
        };
        eprintln!(
            "soak,{i},{},{},{},{}",
            s.depth, s.fds, s.state_kib, s.rss_kib
        );
        samples.push(s);
    }
    assert_eq!(d.status()["state"], "running");
    // The guest is intact after all of it: it ticks, RAM and disk agree.
    let from = d.serial_len();
    let t = d.wait_tick(from, 0, Duration::from_secs(60));
    assert_eq!(t[0].ram, t[0].disk, "{t:?}");
    // And a rollback lands on the newest snapshot, taken on a merged chain.
    d.ok(&["rollback", "--reason", "after the soak"]);
    let from = d.serial_len();
    let t = d.wait_tick(from, 0, Duration::from_secs(60));
    assert_eq!(t[0].ram, t[0].disk, "after the rollback: {t:?}");
    if n > 16 {
        assert!(
            d.journal()
                .iter()
                .any(|e| e["event"] == "disk.chain_flattened"),
            "{n} snapshots and the chain was never merged"
        );
    }
    d.ok(&["audit", "verify"]);
    d.stop();

    let depth_max = samples.iter().map(|s| s.depth).max().unwrap();
    assert!(
        depth_max <= 17,
        "the running chain grew to {depth_max} layers"
    );
    if n >= 20 {
        // Warm-up: the first 20 snapshots (retention and the first merge set in by then).
        let warm = &samples[..20];
        let last = samples.last().unwrap();
        let fds_max = warm.iter().map(|s| s.fds).max().unwrap();
        let state_max = warm.iter().map(|s| s.state_kib).max().unwrap();
        let rss_max = warm.iter().map(|s| s.rss_kib).max().unwrap();
        assert!(
            last.fds <= fds_max + 4,
            "descriptors grew: {fds_max} in the warm-up, {} at the end",
            last.fds
        );
        assert!(
            last.state_kib <= state_max * 2,
            "the state directory grew: {state_max} KiB in the warm-up, {} KiB at the end",
            last.state_kib
        );
        assert!(
            last.rss_kib <= rss_max * 3 / 2 + 16 * 1024,
            "the daemon's RSS grew: {rss_max} KiB in the warm-up, {} KiB at the end",
            last.rss_kib
        );
    }
}
