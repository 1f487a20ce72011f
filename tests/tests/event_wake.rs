//! QEMU's own reports wake the VM's actor at once (watchdog expiry → running ≤ 0.3 s): a QEMU that
//! dies and an i6300esb that fires are acted on through QEMU's listen-only events monitor, not at
//! the actor's next idle look.
//!
//! The daemon runs with the test-only fault `tick.slow` (the idle look every 60 s instead of
//! every 250 ms) and a heartbeat timeout far off, so nothing but a wake can make the actor look
//! within the bounds asserted here (20-25 s, well under the 60 s tick).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);

/// No heartbeat deadline comes near the test: only a wake makes the idle actor look.
const FAR_WATCHDOG: &str = "[watchdog]\nheartbeat_timeout_s = 300\nboot_grace_s = 600";

fn slow_tick<'a>(guest_flags: &'a str) -> Options<'a> {
    Options {
        guest_flags,
        extra_toml: FAR_WATCHDOG,
        env: &[("BACKSTOP_FAULT_INJECT", "tick.slow")],
        ..Options::default()
    }
}

fn triggered(e: &Value, trigger: &str) -> bool {
    e["event"] == "rollback.triggered" && e["fields"]["trigger"] == trigger
}

#[test]
fn a_qemu_that_dies_is_rolled_back_without_waiting_for_the_idle_tick() {
    if skip_unless_ready("a_qemu_that_dies_is_rolled_back_without_waiting_for_the_idle_tick") {
        return;
    }
    let d = Daemon::start_opts("evcrash", &slow_tick(""));
    d.wait_tick(0, 2, BOOT);
    let snap = d.ok(&["snapshot", "create", "--reason", "before the crash"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let pid = d.status()["pid"].as_u64().unwrap();
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let e = d.wait_journal(Duration::from_secs(20), "crash rollback triggered", |e| {
        triggered(e, "vm_crash")
    });
    let noticed = killed.elapsed();
    assert!(
        e["fields"]["reason"]
            .as_str()
            .unwrap()
            .contains("hypervisor ended"),
        "{e}"
    );
    let done = d.wait_journal(Duration::from_secs(60), "crash rollback completed", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "vm_crash"
    });
    assert_eq!(done["fields"]["snapshot_id"], id.as_str());
    let now = d.status();
    assert_eq!(now["state"], "running");
    assert_ne!(now["pid"].as_u64(), Some(pid), "a fresh QEMU runs");
    eprintln!(
        "QEMU killed -> rollback triggered: {} ms",
        noticed.as_millis()
    );
}

#[test]
fn an_i6300esb_that_fires_is_rolled_back_without_waiting_for_the_idle_tick() {
    if skip_unless_ready("an_i6300esb_that_fires_is_rolled_back_without_waiting_for_the_idle_tick")
    {
        return;
    }
    let d = Daemon::start_opts(
        "evhwwd",
        &slow_tick("backstop.watchdog=1 backstop.wd_timeout=3 backstop.wd_stop_at=14"),
    );
    d.wait_tick(0, 2, BOOT);
    assert!(d.serial().contains("BACKSTOP watchdog armed"));
    let snap = d.ok(&["snapshot", "create", "--reason", "kicked"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    // The guest stops kicking at uptime 14 s; the device fires a few seconds later.
    let stopped_at = d.wait_serial(0, "BACKSTOP watchdog stopped", Duration::from_secs(60));
    let stopped = Instant::now();
    let e = d.wait_journal(Duration::from_secs(25), "device watchdog rollback", |e| {
        triggered(e, "watchdog_device")
    });
    eprintln!(
        "kicker stopped -> rollback triggered: {} ms",
        stopped.elapsed().as_millis()
    );
    assert!(
        e["fields"]["reason"]
            .as_str()
            .unwrap()
            .contains("hardware watchdog expired"),
        "{e}"
    );
    let done = d.wait_journal(
        Duration::from_secs(60),
        "device watchdog rollback done",
        |e| e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_device",
    );
    assert_eq!(done["fields"]["snapshot_id"], id.as_str());
    d.wait_serial(stopped_at, "BACKSTOP epoch=1", Duration::from_secs(30));
    assert_eq!(d.status()["state"], "running");
}
