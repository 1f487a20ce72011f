//! The console's snapshot views: `snapshot list` marks the snapshot the running VM descends from
//! (the newest taken since the last rollback, or that rollback's target), and `snapshot show`
//! prints a summary unless asked for `--full` (JSON is always whole).
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use backstop_e2e::{review, skip_unless_ready, Daemon, Options};
use serde_json::Value;

/// The ids marked current in `snapshot list --json`.
fn current(d: &Daemon) -> Vec<String> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["current"] == true)
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect()
}

fn created(d: &Daemon, reason: &str) -> String {
    d.ok(&["snapshot", "create", "--reason", reason])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The console without `--json`: its stdout, which must be a success.
fn human(d: &Daemon, args: &[&str]) -> String {
    let out = Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "backstop {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_list_marks_where_the_vm_is_and_show_is_a_summary_unless_full() {
    if skip_unless_ready("the_list_marks_where_the_vm_is_and_show_is_a_summary_unless_full") {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(files.path());
    let gate = review::restore_gate_toml(&key);
    let d = Daemon::start_opts(
        "snapview",
        &Options {
            extra_toml: &gate,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    let first: Vec<String> = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect();
    // After a cold boot: the baseline, the only snapshot.
    assert_eq!(current(&d), vec![first.last().unwrap().clone()]);
    let a = created(&d, "point a");
    assert_eq!(current(&d), vec![a.clone()]);
    let b = created(&d, "point b");
    assert_eq!(current(&d), vec![b.clone()]);

    // Back to a (older than b): a is where the VM is now, though b is newer.
    let token = review::token(&key, &a);
    let rb = d.ok(&[
        "rollback",
        "--to",
        &a,
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "e2e: back to a",
    ]);
    assert_eq!(rb["snapshot_id"], Value::from(a.clone()));
    assert_eq!(current(&d), vec![a.clone()]);
    let table = human(&d, &["snapshot", "list"]);
    let starred: Vec<&str> = table.lines().filter(|l| l.starts_with("* ")).collect();
    assert_eq!(starred.len(), 1, "{table}");
    assert!(
        starred[0].starts_with(&format!("* {}", &a[..12])),
        "{table}"
    );
    assert!(table.starts_with("  ID "), "{table}");
    // A snapshot taken from there is the VM's newest point again.
    let c = created(&d, "point c");
    assert_eq!(current(&d), vec![c.clone()]);

    // `snapshot show`: a summary by default, the manifest with --full, JSON unchanged.
    let brief = human(&d, &["snapshot", "show", &c[..10]]);
    assert!(brief.starts_with(&format!("snapshot:  {c}\n")), "{brief}");
    assert!(brief.contains("(--full prints it whole)"), "{brief}");
    assert!(!brief.contains("\"payload_refs\""), "{brief}");
    let full = human(&d, &["snapshot", "show", "--full", &c[..10]]);
    assert!(full.starts_with(&format!("snapshot:  {c}\n")), "{full}");
    assert!(full.contains("\"payload_refs\""), "{full}");
    let json = d.ok(&["snapshot", "show", &c[..10]]);
    assert_eq!(json["manifest"]["snapshot_id"], Value::from(c.clone()));
    assert!(json["manifest"]["payload_refs"].is_array(), "{json}");
    assert_eq!(json["summary"]["current"], true, "{json}");
    assert!(brief.contains("current:   yes"), "{brief}");
    // An older snapshot is not where the VM is.
    assert!(d.ok(&["snapshot", "show", &b])["summary"]
        .get("current")
        .is_none());
}
