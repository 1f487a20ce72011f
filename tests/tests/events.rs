//! Subscribers (spec/004 notification scope): `backstop events` delivers what happens to a VM in
//! journal order, live with `--follow`, and a subscriber that reconnects with the last seq it
//! saw gets exactly what it missed, once.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use backstop_e2e::{bin, skip_unless_ready, Daemon};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

fn lines_of(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_subscriber_disconnected_across_two_rollbacks_receives_both_once_in_order() {
    if skip_unless_ready(
        "a_subscriber_disconnected_across_two_rollbacks_receives_both_once_in_order",
    ) {
        return;
    }
    let d = Daemon::start("events");
    d.wait_journal(BOOT, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });

    // A live follower hears a snapshot as it is published.
    let mut follower = Command::new(bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["--json", "events", "--follow"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<Value>();
    let stdout = follower.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                return;
            }
        }
    });
    // The subscription is open once the daemon has read it: give it a moment, then act.
    std::thread::sleep(Duration::from_millis(500));
    let s1 = d.ok(&["snapshot", "create", "--reason", "told"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let seen = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("no live notification");
    assert_eq!(seen["event"], "snapshot_published");
    assert_eq!(seen["snapshot_id"], s1.as_str());
    assert_eq!(seen["vm"], "e2e");
    let last = seen["seq"].as_u64().unwrap();

    // The subscriber goes away; two rollbacks happen while it is gone.
    follower.kill().unwrap();
    let _ = follower.wait();
    // Its connection thread ends although nothing is written to it (it holds a client slot).
    let pid = d.pid().unwrap();
    let conn_threads = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).unwrap_or_default().trim() == "conn"
            })
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while conn_threads() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the follower's connection thread lingers"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for i in 0..2 {
        let r = d.ok(&[
            "trigger",
            "force_rollback",
            "--reason",
            "gone",
            "--action-id",
            &format!("ev-{i}"),
        ]);
        assert_eq!(r["snapshot_id"], s1.as_str());
    }

    // Back with its last seq: both rollbacks, in order, once, and nothing it already had.
    let out = d.cli(&["events", "--since", &last.to_string()]);
    assert!(
        out.status.success(),
        "{}\ndaemon log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        backstop_e2e::tail(&d.log(), 20)
    );
    let lines = lines_of(&out);
    let (summary, events) = lines.split_last().unwrap();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "rollback_started",
            "rollback_completed",
            "rollback_started",
            "rollback_completed"
        ],
        "{lines:?}"
    );
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]) && seqs[0] > last,
        "{seqs:?}"
    );
    // Each rollback is to a snapshot the subscriber was told about.
    assert!(events.iter().all(|e| e["snapshot_id"] == s1.as_str()));
    let epochs: Vec<u64> = events
        .iter()
        .filter(|e| e["event"] == "rollback_completed")
        .map(|e| e["details"]["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, [1, 2]);
    // Each rollback names the forensic snapshot of the disks it abandoned (not itself a
    // `snapshot_published`: it is never a rollback target).
    assert!(events
        .iter()
        .filter(|e| e["event"] == "rollback_completed")
        .all(|e| e["details"]["forensic_snapshot_id"].is_string()));
    assert_eq!(summary["delivered"], 4);
    let caught_up = summary["last_seq"]["e2e"].as_u64().unwrap();
    assert!(caught_up >= *seqs.last().unwrap());
    // Asking again from where it caught up: nothing new, nothing twice.
    let again = lines_of(&d.cli(&["events", "--since", &caught_up.to_string()]));
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0]["delivered"], 0);
    // Scope by type.
    let only = lines_of(&d.cli(&[
        "events",
        "--since",
        &last.to_string(),
        "--type",
        "rollback_completed",
    ]));
    assert_eq!(only.len(), 3, "{only:?}");

    // Bad input: a seq that does not exist yet, an unknown type; nothing changes.
    let ahead = d.cli(&["events", "--since", "999999"]);
    assert_eq!(ahead.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&ahead.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_BAD_REQUEST");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("nothing has that sequence number"));
    let bogus = d.cli(&["events", "--type", "rollback"]);
    assert_eq!(bogus.status.code(), Some(2));
    assert_eq!(d.status()["epoch"], 2);
}
