//! Whether NIC links come back after a rollback is a per-VM choice. By default every rollback
//! leaves them down (`rollback.rs`, `devices.rs`); with `vm.links_after_rollback = "up"` the
//! restored guest reads its link up at once and the rollback's record says so.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{skip_unless_ready, Daemon, Options};

#[test]
fn with_links_after_rollback_up_the_guest_has_its_network_back_at_once() {
    if skip_unless_ready("with_links_after_rollback_up_the_guest_has_its_network_back_at_once") {
        return;
    }
    let d = Daemon::start_opts(
        "links-up",
        &Options {
            extra_vm: "links_after_rollback = \"up\"",
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, Duration::from_secs(90));
    let rb = d.ok(&["rollback", "--reason", "test: links come back"]);
    assert_eq!(rb["epoch"], 1);
    let revoked: Vec<String> = rb["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    // Taken down like every rollback's, then raised again — both on the record.
    assert!(
        revoked.iter().any(|r| r.contains("network links down")),
        "{revoked:?}"
    );
    assert!(
        revoked
            .iter()
            .any(|r| r == "net0: link up again (vm.links_after_rollback = \"up\")"),
        "{revoked:?}"
    );
    let completed = d
        .journal()
        .into_iter()
        .rev()
        .find(|e| e["event"] == "rollback.completed")
        .unwrap();
    assert!(
        completed["fields"]["revoked"]
            .to_string()
            .contains("link up again"),
        "{completed}"
    );
    // The guest reads its link up (status reads it from the device the guest sees).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = d.status();
        let up = st["links"]
            .as_array()
            .and_then(|l| l.iter().find(|l| l["nic"] == "net0"))
            .map(|l| l["up"].clone());
        if up == Some(serde_json::Value::Bool(true)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "net0 not up after the rollback: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Not a grant: nothing to revoke, and snapshots are not deferred.
    assert!(d.status()["granted_devices"]
        .as_array()
        .is_none_or(|g| g.is_empty()));
    d.ok(&[
        "snapshot",
        "create",
        "--reason",
        "test: network up, not deferred",
    ]);
}
