//! Crash consistency: `kill -9` of backstopd, and separately of QEMU, at seeded random points
//! during snapshot, rollback, prune, halt clear and daemon start. After each crash the daemon is
//! restarted (a QEMU crash it handles itself) and the promise is checked:
//!
//! * no half-published snapshot: the store's build directory is empty and every listed
//!   snapshot verifies completely;
//! * `audit verify` passes;
//! * the guest is at a snapshot point (every tick after recovery has RAM = disk sequence), or the
//!   VM is HALTED with a record and no QEMU;
//! * never running unsupervised: a QEMU whose backstopd was killed is dead.
//!
//! `BACKSTOP_CRASH_ITERATIONS` (default 20, what CI runs) and `BACKSTOP_CRASH_SEED` (default:
//! from the clock; printed, so a failing run can be replayed). `scripts/crash-loop.sh
//! --iterations N` runs the full loop and prints the outcome table.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backstop_e2e::{parse_ticks, skip_unless_ready, Daemon};

/// xorshift64*: a seeded sequence, enough to pick crash points reproducibly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Snapshot,
    Rollback,
    Prune,
    HaltClear,
    Start,
}

impl Op {
    /// The console command of the operation (none for a daemon start).
    fn args(self) -> &'static [&'static str] {
        match self {
            Op::Snapshot => &["snapshot", "create", "--reason", "crash loop"],
            Op::Rollback => &["rollback", "--reason", "crash loop"],
            Op::Prune => &["snapshot", "prune"],
            Op::HaltClear => &["halt", "clear", "--reason", "crash loop"],
            Op::Start => &[],
        }
    }
    /// How long the operation takes here, roughly: crash points are drawn within it.
    fn window_ms(self) -> u64 {
        match self {
            Op::Snapshot => 4000,
            Op::Rollback | Op::HaltClear | Op::Start => 3000,
            Op::Prune => 800,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Victim {
    Backstopd,
    Qemu,
}

#[derive(Default)]
struct Outcomes {
    consistent: u32,
    halted: u32,
    violations: u32,
}

/// Whether `pid` still executes (a zombie does not count: PID 1 here may never reap it).
fn pid_alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .map(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

fn console(d: &Daemon, args: &[&str]) -> Child {
    Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .arg("--json")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until the VM is settled (running or halted, twice in a row).
fn settle(d: &Daemon) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last = String::new();
    loop {
        let out = d.cli(&["status"]);
        if let Ok(st) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            let state = st["state"].as_str().unwrap_or_default().to_string();
            if (state == "running" || state == "halted") && state == last {
                return st;
            }
            last = state;
        }
        assert!(
            Instant::now() < deadline,
            "the VM never settled (last state {last:?}); log:\n{}",
            backstop_e2e::tail(&d.log(), 40)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn kill_9_at_random_points_never_breaks_the_promise() {
    if skip_unless_ready("kill_9_at_random_points_never_breaks_the_promise") {
        return;
    }
    let iterations: u32 = std::env::var("BACKSTOP_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("BACKSTOP_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!(
        "crash loop: {iterations} iterations, seed {seed} (BACKSTOP_CRASH_SEED={seed} replays it)"
    );
    let mut rng = Rng(seed);
    let mut d = Daemon::start("crashloop");
    d.wait_tick(0, 2, Duration::from_secs(120));
    let mut verified: BTreeSet<String> = BTreeSet::new();
    let mut table: BTreeMap<(Op, Victim), Outcomes> = BTreeMap::new();
    let mut violations: Vec<String> = Vec::new();

    for i in 0..iterations {
        let before = settle(&d);
        let op = if before["state"] == "halted" {
            Op::HaltClear
        } else {
            [Op::Snapshot, Op::Rollback, Op::Prune, Op::Start][rng.below(4) as usize]
        };
        let victim = match (op, rng.below(2)) {
            (Op::Start, _) | (_, 0) => Victim::Backstopd,
            _ => Victim::Qemu,
        };
        let delay = Duration::from_millis(rng.below(op.window_ms()));
        let mut qemu_pids: BTreeSet<u64> = before["pid"].as_u64().into_iter().collect();
        let mut client = None;
        if op == Op::Start {
            d.kill9();
            d.spawn();
        } else {
            client = Some(console(&d, op.args()));
        }
        std::thread::sleep(delay);
        let mut problems = Vec::new();
        match victim {
            Victim::Backstopd => {
                // The QEMU of this moment too (a rollback may have replaced it).
                let now: serde_json::Value =
                    serde_json::from_slice(&d.cli(&["status"]).stdout).unwrap_or_default();
                qemu_pids.extend(now["pid"].as_u64());
                d.kill9();
                std::thread::sleep(Duration::from_millis(500));
                for pid in &qemu_pids {
                    if pid_alive(*pid) {
                        problems.push(format!("QEMU {pid} runs on without its backstopd"));
                    }
                }
                d.launch();
            }
            Victim::Qemu => {
                let st: serde_json::Value =
                    serde_json::from_slice(&d.cli(&["status"]).stdout).unwrap_or_default();
                if let Some(pid) = st["pid"].as_u64() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        if let Some(mut c) = client {
            let _ = c.wait();
        }
        let after = settle(&d);

        // No half-built or half-published snapshot.
        let tmp = d.state_dir().join("store/tmp");
        let leftovers = std::fs::read_dir(&tmp).map(|r| r.count()).unwrap_or(0);
        if leftovers > 0 && after["state"] == "running" {
            problems.push(format!(
                "{leftovers} build leftover(s) in {}",
                tmp.display()
            ));
        }
        if after["state"] == "running" {
            let list = d.ok(&["snapshot", "list"]);
            for s in list["snapshots"].as_array().unwrap() {
                let id = s["snapshot_id"].as_str().unwrap().to_string();
                if verified.contains(&id) {
                    continue;
                }
                let out = d.cli(&["snapshot", "verify", &id]);
                if out.status.success() {
                    verified.insert(id);
                } else {
                    problems.push(format!(
                        "snapshot {id} does not verify: {}",
                        String::from_utf8_lossy(&out.stdout)
                    ));
                }
            }
        }
        let audit = d.cli(&["audit", "verify"]);
        if !audit.status.success() {
            problems.push(format!(
                "audit verify failed: {}",
                String::from_utf8_lossy(&audit.stdout)
            ));
        }
        // At a snapshot point, or HALTED with a record and no guest.
        let halted = after["state"] == "halted";
        if halted {
            if after["halted"]["code"]
                .as_str()
                .unwrap_or_default()
                .is_empty()
            {
                problems.push(format!("HALTED without a record: {after}"));
            }
            if !after["pid"].is_null() {
                problems.push(format!("a QEMU runs while HALTED: {after}"));
            }
        } else {
            let from = d.serial_len();
            let deadline = Instant::now() + Duration::from_secs(60);
            let ticks = loop {
                let t = parse_ticks(&d.serial_since(from));
                if t.len() >= 2 || Instant::now() > deadline {
                    break t;
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            if ticks.is_empty() {
                problems.push("the guest does not run".into());
            }
            for t in &ticks {
                if t.ram != t.disk {
                    problems.push(format!("RAM and disk disagree: {t:?}"));
                }
            }
        }
        let row = table.entry((op, victim)).or_default();
        let verdict = if !problems.is_empty() {
            row.violations += 1;
            violations.push(format!(
                "iteration {i} ({op:?}, kill {victim:?} after {delay:?}): {}",
                problems.join("; ")
            ));
            "VIOLATION"
        } else if halted {
            row.halted += 1;
            "halted"
        } else {
            row.consistent += 1;
            "consistent"
        };
        eprintln!(
            "crash loop {i:>3}: {op:?} killing {victim:?} after {:>4} ms -> {verdict}",
            delay.as_millis()
        );
    }

    eprintln!("\ncrash loop outcome (seed {seed}, {iterations} iterations):");
    eprintln!("| operation | killed | consistent | HALTED | violations |\n|---|---|---|---|---|");
    for ((op, victim), o) in &table {
        eprintln!(
            "| {op:?} | {victim:?} | {} | {} | {} |",
            o.consistent, o.halted, o.violations
        );
    }
    d.stop();
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violation(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}
