//! A guest guarded by the stock QEMU guest agent (`vm.heartbeat = "qemu-ga"`): the real `qemu-ga`
//! of Debian's package runs in the test guest on `org.qemu.guest_agent.0`, and backstop's own agent
//! does not run at all (`backstop.hb=off`). Its pongs keep the VM alive; a rollback brings the
//! agent back and sets the restored guest's clock through it; an agent that stops answering is an
//! emergency rollback like a silent backstop agent.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);

fn fresh_heartbeat(st: &Value) -> bool {
    st["heartbeat_age_ms"].as_u64().is_some_and(|a| a < 3000)
}

#[test]
fn qemu_ga_pongs_keep_the_vm_alive_and_a_restore_gets_its_clock_set() {
    if skip_unless_ready("qemu_ga_pongs_keep_the_vm_alive_and_a_restore_gets_its_clock_set") {
        return;
    }
    let d = Daemon::start_opts(
        "qga",
        &Options {
            guest_flags: "backstop.qga=1 backstop.hb=off",
            extra_vm: "heartbeat = \"qemu-ga\"",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 5\nboot_grace_s = 60",
            ..Options::default()
        },
    );
    d.wait_serial(0, "BACKSTOP qemu-ga started", BOOT);
    let st = d.wait_status("a pong credited", BOOT, fresh_heartbeat);
    assert_eq!(st["backend_details"]["heartbeat_source"], "qemu-ga", "{st}");
    assert_eq!(st["backend_details"]["clock_resynced"], false, "{st}");
    d.wait_tick(0, 3, BOOT);
    let snap = d.ok(&["snapshot", "create", "--reason", "agent alive"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();

    // Well past the timeout with no backstop agent at all: the pongs alone keep it running,
    // each sample a heartbeat younger than the timeout.
    for _ in 0..8 {
        std::thread::sleep(Duration::from_secs(1));
        let st = d.status();
        assert!(fresh_heartbeat(&st), "no fresh pong: {st}");
    }
    assert!(
        !d.journal()
            .iter()
            .any(|e| e["event"] == "rollback.completed"),
        "rolled back although qemu-ga answered"
    );

    // A rollback: the restored guest's agent answers again, and its clock is set through it.
    let from = d.serial_len();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: qga restore"]);
    assert_eq!(rb["epoch"], 1);
    d.wait_serial(from, "BACKSTOP epoch=1", Duration::from_secs(30));
    let st = d.wait_status(
        "clock set after the restore",
        Duration::from_secs(30),
        |s| s["backend_details"]["clock_resynced"] == true && fresh_heartbeat(s),
    );
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["epoch"], 1);
    d.ok(&["audit", "verify"]);
}

#[test]
fn a_qemu_ga_that_stops_answering_is_rolled_back_by_the_watchdog() {
    if skip_unless_ready("a_qemu_ga_that_stops_answering_is_rolled_back_by_the_watchdog") {
        return;
    }
    let d = Daemon::start_opts(
        "qgastop",
        &Options {
            guest_flags: "backstop.qga=1 backstop.hb=off backstop.qga_stop_at=30",
            extra_vm: "heartbeat = \"qemu-ga\"",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 4\nboot_grace_s = 60",
            ..Options::default()
        },
    );
    d.wait_status("a pong credited", BOOT, fresh_heartbeat);
    d.wait_tick(0, 3, BOOT);
    let snap = d.ok(&["snapshot", "create", "--reason", "agent alive"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    // qemu-ga is killed at uptime 30 s; the watchdog rolls the VM back to the snapshot.
    let e = d.wait_journal(Duration::from_secs(90), "watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout"
    });
    assert_eq!(e["fields"]["snapshot_id"], id.as_str());
    assert_eq!(e["fields"]["rollback_type"], "emergency");
    let stopped = d
        .serial()
        .find("BACKSTOP qemu-ga stopped")
        .expect("the guest says it killed qemu-ga");
    d.wait_serial(stopped, "BACKSTOP epoch=1", Duration::from_secs(30));
    // The restored guest's agent (running at the snapshot point, before uptime 30 s) answers
    // again.
    d.wait_status(
        "pongs after the rollback",
        Duration::from_secs(30),
        fresh_heartbeat,
    );
}

#[test]
fn a_guest_agent_port_full_of_junk_is_silence() {
    if skip_unless_ready("a_guest_agent_port_full_of_junk_is_silence") {
        return;
    }
    let d = Daemon::start_opts(
        "qgajunk",
        &Options {
            guest_flags: "backstop.qga=junk backstop.hb=off",
            extra_vm: "heartbeat = \"qemu-ga\"",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 4\nboot_grace_s = 20",
            ..Options::default()
        },
    );
    d.wait_serial(0, "BACKSTOP qemu-ga junk", BOOT);
    // Foreign ids, no ids, extra keys, errors, garbage and floods: never a heartbeat, so the
    // boot grace runs out and the watchdog rolls the VM back to its baseline.
    let e = d.wait_journal(Duration::from_secs(90), "watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout"
    });
    assert_eq!(e["fields"]["rollback_type"], "emergency");
    let st = d.status();
    assert!(st["heartbeat_age_ms"].is_null(), "junk was credited: {st}");
    // The daemon took it all in its stride: bounded, still answering.
    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", d.pid().unwrap()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap();
    assert!(rss_kib < 256 * 1024, "backstopd grew to {rss_kib} KiB");
}
