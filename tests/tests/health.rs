//! A snapshot records the guest's health: a scheduled snapshot of a guest whose agent went silent
//! is deferred and journaled; one taken anyway (console) is marked unhealthy; the watchdog rollback
//! passes it over for the newest snapshot of a healthy guest.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

#[test]
fn a_hung_guest_is_not_snapshotted_as_healthy_and_the_watchdog_lands_before_the_hang() {
    if skip_unless_ready(
        "a_hung_guest_is_not_snapshotted_as_healthy_and_the_watchdog_lands_before_the_hang",
    ) {
        return;
    }
    let d = Daemon::start_opts(
        "health",
        &Options {
            guest_flags: "backstop.hb_stop_at=25",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 14\nboot_grace_s = 60\nhealthy_within_s = 2\n\n[snapshots]\nschedule_seconds = 5\n",
            ..Options::default()
        },
    );
    d.wait_journal(BOOT, "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    });
    // Scheduled snapshots of the healthy guest are taken and marked healthy.
    let healthy = d.wait_journal(BOOT, "a healthy scheduled snapshot", |e| {
        e["event"] == "snapshot.create.completed" && e["fields"]["healthy"] == true && {
            let id = e["fields"]["snapshot_id"].as_str().unwrap_or_default();
            !id.is_empty()
        }
    });
    assert_eq!(healthy["fields"]["healthy"], true);
    // The agent goes quiet at uptime 25 s.
    let from = 0;
    d.wait_serial(
        from,
        "BACKSTOP agent heartbeats stopped",
        Duration::from_secs(90),
    );
    std::thread::sleep(Duration::from_secs(3));
    // A snapshot asked for now is taken, and marked as what it is.
    let hung = d.ok(&["snapshot", "create", "--reason", "while hung"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let m = d.ok(&["snapshot", "show", &hung])["manifest"].clone();
    assert_eq!(m["capture"]["guest_health"]["healthy"], false, "{m}");
    assert!(
        m["capture"]["guest_health"]["heartbeat_age_ms"]
            .as_u64()
            .unwrap()
            > 2000
    );
    // A scheduled slot meanwhile is deferred, not taken.
    let deferred = d.wait_journal(
        Duration::from_secs(20),
        "a deferred scheduled snapshot",
        |e| e["event"] == "snapshot.create.deferred" && e["fields"]["trigger"] == "schedule",
    );
    assert_eq!(deferred["fields"]["code"], "ERR_SNAPSHOT_DEFERRED");
    assert_eq!(deferred["fields"]["guest_health"]["healthy"], false);
    let missed = d.wait_journal(
        Duration::from_secs(20),
        "the slot journaled as missed",
        |e| e["event"] == "snapshot.schedule.missed" && e["fields"]["why"] == "snapshot_deferred",
    );
    let _ = missed;
    // No snapshot taken after the hang was seen is marked healthy.
    let journal = d.journal();
    let hang_seq = journal
        .iter()
        .find(|e| {
            e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == hung.as_str()
        })
        .unwrap()["seq"]
        .as_u64()
        .unwrap();
    assert!(journal
        .iter()
        .filter(
            |e| e["event"] == "snapshot.create.completed" && e["seq"].as_u64().unwrap() > hang_seq
        )
        .all(|e| e["fields"]["healthy"] == false));

    // The watchdog fires and passes the hung snapshot over.
    let done = d.wait_journal(Duration::from_secs(60), "watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout"
    });
    let target = done["fields"]["snapshot_id"].as_str().unwrap().to_string();
    assert_ne!(target, hung);
    let target_m = d.ok(&["snapshot", "show", &target])["manifest"].clone();
    assert_ne!(
        target_m["capture"]["guest_health"]["healthy"], false,
        "{target_m}"
    );
    let trace = done["fields"]["trace_id"].as_str().unwrap();
    let skipped_hung = d.journal().into_iter().any(|e| {
        e["event"] == "snapshot.verify.skipped"
            && e["fields"]["trace_id"] == trace
            && e["fields"]["snapshot_id"] == hung.as_str()
            && e["fields"]["code"] == "ERR_SNAPSHOT_GUEST_UNHEALTHY"
    });
    assert!(
        skipped_hung,
        "the hung snapshot was not passed over for its health"
    );
    let initiated: Value = d
        .journal()
        .into_iter()
        .find(|e| e["event"] == "rollback.initiated" && e["fields"]["trace_id"] == trace)
        .unwrap();
    assert_eq!(initiated["fields"]["target_healthy"], true);
    // And replay reproduces the choice from the recorded health.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");
}

/// A guest that goes quiet for good cannot keep its VM without fresh rollback targets: each
/// scheduled slot is put off for a moment (retried meanwhile), then taken anyway and marked
/// unhealthy, so scheduled snapshots keep coming at the configured interval plus a stated bound.
#[test]
fn a_silent_guest_cannot_starve_the_schedule() {
    if skip_unless_ready("a_silent_guest_cannot_starve_the_schedule") {
        return;
    }
    // The watchdog is far off (this test is about the schedule); 10 s slots, so an unhealthy
    // slot waits at most 5 s (half the interval) before it is taken anyway.
    let d = Daemon::start_opts(
        "health-starve",
        &Options {
            guest_flags: "backstop.hb_stop_at=20",
            extra_toml: "[watchdog]\nheartbeat_timeout_s = 300\nboot_grace_s = 300\nhealthy_within_s = 2\n\n[snapshots]\nschedule_seconds = 10\nunhealthy_defer_max_s = 120\n",
            ..Options::default()
        },
    );
    d.wait_journal(BOOT, "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    });
    d.wait_serial(
        0,
        "BACKSTOP agent heartbeats stopped",
        Duration::from_secs(120),
    );
    let unhealthy_scheduled = |d: &Daemon| -> Vec<Value> {
        d.journal()
            .into_iter()
            .filter(|e| {
                e["event"] == "snapshot.create.completed"
                    && e["fields"]["trigger"] == "schedule"
                    && e["fields"]["healthy"] == false
            })
            .collect()
    };
    // Two slots in a row, each put off and then taken: not one deferral, then silence.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while unhealthy_scheduled(&d).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "scheduled snapshots of the silent guest stopped: {:?}",
            d.journal()
                .iter()
                .filter(|e| e["event"].as_str().unwrap_or("").starts_with("snapshot."))
                .map(|e| format!("{} {}", e["event"], e["fields"]["trigger"]))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let journal = d.journal();
    let deferred: Vec<&Value> = journal
        .iter()
        .filter(|e| {
            e["event"] == "snapshot.create.deferred" && e["fields"]["trigger"] == "schedule"
        })
        .collect();
    assert!(
        !deferred.is_empty(),
        "no slot was put off for the silent guest"
    );
    for e in &deferred {
        assert_eq!(e["fields"]["guest_health"]["healthy"], false, "{e}");
        let left = e["fields"]["taken_anyway_in_ms"].as_u64().unwrap();
        assert!(
            left <= 5000,
            "a slot may wait at most half the interval: {e}"
        );
    }
    // Each taken-anyway snapshot is what it is, in the manifest too.
    for e in unhealthy_scheduled(&d).iter().take(2) {
        let id = e["fields"]["snapshot_id"].as_str().unwrap();
        let m = d.ok(&["snapshot", "show", id])["manifest"].clone();
        assert_eq!(m["capture"]["guest_health"]["healthy"], false, "{m}");
    }
    // The gap between the two: one interval, plus the bound, plus the capture's own time.
    let at = |e: &Value| {
        time::OffsetDateTime::parse(
            e["fields"]["created_at"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
    };
    let two = unhealthy_scheduled(&d);
    let gap = (at(&two[1]) - at(&two[0])).as_seconds_f64();
    assert!(
        gap <= 10.0 + 5.0 + 5.0,
        "scheduled snapshots {gap} s apart (interval 10 s)"
    );
}
