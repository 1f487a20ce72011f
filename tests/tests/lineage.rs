//! Lineage (spec/004): every manifest names its parent and epoch; a rollback marks only what
//! descends from its target on the line it abandons, never another line; `snapshot tree` shows the
//! tree and the current position (also while HALTED); and the temporal bound asks for reviewer
//! evidence for an old target, even for `--emergency`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use backstop_e2e::{review, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

fn id(v: &Value) -> String {
    v["summary"]["snapshot_id"].as_str().unwrap().to_string()
}

fn node<'a>(tree: &'a Value, id: &str) -> &'a Value {
    tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["snapshot_id"] == id)
        .unwrap_or_else(|| panic!("{id} not in the tree: {tree}"))
}

fn marked(d: &Daemon) -> Vec<String> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s.get("rolled_back").is_some())
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_rollback_marks_only_its_targets_descendants_and_the_tree_shows_both_lines() {
    if skip_unless_ready(
        "a_rollback_marks_only_its_targets_descendants_and_the_tree_shows_both_lines",
    ) {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(keys.path());
    let gate = format!(
        "{}max_target_age_seconds = 25\n",
        review::restore_gate_toml(&key)
    );
    let mut d = Daemon::start_opts(
        "lineage",
        &Options {
            extra_toml: &gate,
            ..Options::default()
        },
    );
    let base = d.wait_journal(BOOT, "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    })["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let a = id(&d.ok(&["snapshot", "create", "--reason", "a"]));
    let c = id(&d.ok(&["snapshot", "create", "--reason", "c"]));
    // Back to a: c (its descendant) is left behind.
    let tok = review::token(&key, &a);
    d.ok(&[
        "rollback",
        "--to",
        &a,
        "--reason",
        "to a",
        "--reviewer-token",
        tok.to_str().unwrap(),
    ]);
    assert_eq!(marked(&d), vec![c.clone()]);
    // A new line from a.
    let dd = id(&d.ok(&["snapshot", "create", "--reason", "d"]));
    // Back to c (rolled back: needs evidence): c is on the line again; d, listed after c but
    // on another line, is not touched (creation order alone would have marked it).
    let tok = review::token(&key, &c);
    d.ok(&[
        "rollback",
        "--to",
        &c,
        "--reason",
        "to c",
        "--reviewer-token",
        tok.to_str().unwrap(),
    ]);
    assert_eq!(
        marked(&d),
        Vec::<String>::new(),
        "only c's descendants (none) are marked"
    );

    // Manifests name parent and epoch.
    let show = |s: &str| d.ok(&["snapshot", "show", s])["manifest"].clone();
    assert_eq!(show(&base)["lineage"]["parent"], Value::Null);
    assert_eq!(show(&a)["lineage"]["parent"], base.as_str());
    assert_eq!(show(&c)["lineage"]["parent"], a.as_str());
    assert_eq!(show(&dd)["lineage"]["parent"], a.as_str());
    assert_eq!(show(&dd)["epoch"], 1);

    // The tree: base ─ a ─ {c, d}; the VM is at c.
    let tree = d.ok(&["snapshot", "tree"]);
    assert_eq!(tree["current"], c.as_str());
    assert_eq!(node(&tree, &c)["parent"], a.as_str());
    assert_eq!(node(&tree, &dd)["parent"], a.as_str());
    assert_eq!(node(&tree, &a)["parent"], base.as_str());
    let text = std::process::Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["snapshot", "tree"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(
        text.lines()
            .any(|l| l.contains(&c) && l.contains("current")),
        "{text}"
    );
    // A new snapshot descends from c.
    let e = id(&d.ok(&["snapshot", "create", "--reason", "e"]));
    assert_eq!(show(&e)["lineage"]["parent"], c.as_str());

    // The temporal bound (25 s here): the baseline is older now.
    std::thread::sleep(Duration::from_secs(26));
    let out = d.cli(&[
        "rollback",
        "--to",
        &base,
        "--reason",
        "too old",
        "--reviewer-token",
        review::token(&key, &e).to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("temporal bound"),
        "{err}"
    );
    // A person's emergency rollback to the newest verified snapshot (e, now over 25 s old) is
    // never blocked by the bound: it goes through, journaled as an override with the bound.
    let epoch = d.status()["epoch"].as_u64().unwrap();
    let r = d.ok(&["rollback", "--emergency", "--reason", "old newest"]);
    assert_eq!(r["snapshot_id"], e.as_str());
    assert_eq!(r["epoch"], epoch + 1);
    let decision = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.restore.policy_decision")
        .unwrap();
    assert_eq!(decision["fields"]["decision"], "override");
    assert_eq!(decision["fields"]["beyond_bound"], true);
    assert_eq!(decision["fields"]["temporal_bound_s"], 25);
    let epoch = d.status()["epoch"].as_u64().unwrap();
    // With evidence for it, a session rollback beyond the bound goes through.
    let tok = review::token(&key, &e);
    let r = d.ok(&[
        "rollback",
        "--to",
        &e,
        "--reason",
        "reviewed",
        "--reviewer-token",
        tok.to_str().unwrap(),
    ]);
    assert_eq!(r["snapshot_id"], e.as_str());
    assert_eq!(r["epoch"], epoch + 1);
    let decision = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.restore.policy_decision")
        .unwrap();
    assert_eq!(decision["fields"]["beyond_bound"], true);
    assert_eq!(decision["fields"]["temporal_bound_s"], 25);
    assert_eq!(decision["fields"]["reviewer"], "e2e-reviewer");
    // An unattended rollback is never blocked: the bound is journaled all the same.
    let r = d.ok(&["trigger", "force_rollback", "--reason", "host says"]);
    assert_eq!(r["snapshot_id"], e.as_str());
    let decision = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "snapshot.restore.policy_decision")
        .unwrap();
    assert_eq!(decision["fields"]["decision"], "override");
    assert_eq!(decision["fields"]["beyond_bound"], true);

    // Replay reproduces every decision, the lineage marks included.
    let replay = d.ok(&["audit", "replay", "--mode", "production"]);
    assert_eq!(replay["code"], Value::Null, "{replay}");

    // `snapshot tree` is read-only: it works while HALTED.
    d.stop();
    std::fs::write(
        d.state_dir().join("halted.json"),
        r#"{"reason":"e2e: halted by hand","code":"ERR_VM_HALTED","since":"2026-01-01T00:00:00Z","trace_id":"t"}"#,
    )
    .unwrap();
    d.launch();
    assert_eq!(d.status()["state"], "halted");
    let tree = d.ok(&["snapshot", "tree"]);
    assert!(tree["nodes"].as_array().unwrap().len() >= 5);
}
