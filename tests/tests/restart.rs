//! Daemon stop and start: a clean stop (SIGTERM) loses no guest work — the guest is paused, a
//! final snapshot taken, and the next start resumes from exactly it (journaled as a resume, the
//! epoch unchanged). A crash (kill -9) stays fail-closed: the next start rolls back to the newest
//! verified snapshot as an emergency, and a consumed clean stop is never resumed twice.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};
use serde_json::Value;

fn events(d: &Daemon, name: &str) -> Vec<Value> {
    d.journal()
        .into_iter()
        .filter(|e| e["event"] == name)
        .collect()
}

#[test]
fn a_clean_stop_resumes_where_the_guest_was_and_a_crash_stays_fail_closed() {
    if skip_unless_ready("a_clean_stop_resumes_where_the_guest_was_and_a_crash_stays_fail_closed") {
        return;
    }
    let mut d = Daemon::start("restart");
    d.wait_tick(0, 4, Duration::from_secs(90));
    let epoch = d.status()["epoch"].as_u64().unwrap();

    // Clean stop: daemon.stopped names the final snapshot.
    d.stop();
    let last = d.last_tick().unwrap();
    let stopped = events(&d, "daemon.stopped");
    let stopped = stopped.last().expect("daemon.stopped journaled on SIGTERM");
    let final_id = stopped["fields"]["snapshot_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no final snapshot: {stopped}"))
        .to_string();
    assert_eq!(stopped["fields"]["clean"], true, "{stopped}");

    // Start: resumed from exactly that snapshot, as a resume (no epoch change, no rollback
    // trigger of an emergency).
    let from = d.serial_len();
    d.launch();
    let resumed = d.wait_journal(Duration::from_secs(60), "vm.resumed", |e| {
        e["event"] == "vm.resumed"
    });
    assert_eq!(
        resumed["fields"]["snapshot_id"],
        final_id.as_str(),
        "{resumed}"
    );
    let restore = events(&d, "snapshot.restore.completed");
    assert_eq!(
        restore.last().unwrap()["fields"]["snapshot_id"],
        final_id.as_str()
    );
    assert!(
        !events(&d, "rollback.completed")
            .iter()
            .any(|e| e["fields"]["trigger"] == "supervisor_restart"),
        "a clean stop must not come back as an emergency rollback"
    );
    assert_eq!(
        d.status()["epoch"].as_u64().unwrap(),
        epoch,
        "a resume is not a rollback"
    );
    let ticks = d.wait_ticks_until(
        from,
        Duration::from_secs(60),
        "guest runs after the resume",
        |t| t.len() >= 2,
    );
    // The guest continues from its last tick before the stop: nothing it did was lost, nothing
    // repeated; RAM and disk agree (one instant).
    assert_eq!(
        ticks[0].ram,
        last.ram + 1,
        "last tick before the stop {last:?}, after the start {ticks:?}"
    );
    assert_eq!(ticks[0].ram, ticks[0].disk, "{ticks:?}");
    assert!(
        !d.serial_since(from).contains("BACKSTOP epoch="),
        "the guest was told of a rollback that did not happen"
    );

    // Crash: fail-closed — the next start is an emergency rollback to the newest verified snapshot,
    // never a second resume of the consumed clean stop.
    d.kill9();
    d.launch();
    let rolled = d.wait_journal(Duration::from_secs(90), "start-up rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "supervisor_restart"
    });
    assert_eq!(rolled["fields"]["rollback_type"], "emergency", "{rolled}");
    assert_eq!(
        events(&d, "vm.resumed").len(),
        1,
        "a clean stop is resumed once"
    );
    assert!(d.status()["epoch"].as_u64().unwrap() > epoch);
    d.ok(&["audit", "verify"]);
}
