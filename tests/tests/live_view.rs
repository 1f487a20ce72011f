//! Seeing it live: `backstop vms` (and `vms --watch`) shows every VM's last rollback and how long
//! it took, the guest's NIC links and its granted devices, beside state, epoch, snapshot age and
//! heartbeat age.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use backstop_e2e::{bin, skip_unless_ready, Daemon};

#[test]
fn vms_shows_the_last_rollback_and_the_links_it_took_down() {
    if skip_unless_ready("vms_shows_the_last_rollback_and_the_links_it_took_down") {
        return;
    }
    let d = Daemon::start("live-view");
    d.wait_tick(0, 2, Duration::from_secs(90));
    let before = d.ok(&["vms"]);
    let row = &before["vms"][0];
    assert!(row["last_rollback"].is_null(), "no rollback yet: {row}");

    let rb = d.ok(&["rollback", "--reason", "test: live view"]);
    let vms = d.ok(&["vms"]);
    let row = &vms["vms"][0];
    let last = &row["last_rollback"];
    assert_eq!(last["snapshot_id"], rb["snapshot_id"], "{row}");
    assert_eq!(last["duration_ms"], rb["total_ms"], "{row}");
    assert_eq!(last["trigger"], "console", "{row}");
    // Every rollback takes the network away: the configured NIC reads down in the guest.
    let links = row["links"].as_array().unwrap();
    assert_eq!(links.len(), 1, "{row}");
    assert_eq!(links[0]["nic"], "net0");
    assert_eq!(links[0]["up"], false, "{row}");
    assert_eq!(row["epoch"], 1);

    // The text view has the same on one line per VM.
    let out = Command::new(bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .arg("vms")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].contains("LAST ROLLBACK"), "{text}");
    let secs = rb["total_ms"].as_u64().unwrap() as f64 / 1000.0;
    assert!(
        lines[1].contains(&format!("in {secs:.1}s")) && lines[1].contains("net0:down"),
        "{text}"
    );
}
