//! A guest on a real network: its NIC sits on a host tap device attached to a bridge — made here in
//! a private network namespace, as an operator's would be on the host — and backstopd (with its
//! QEMU) runs in that namespace. Before a rollback the guest and a host-side peer on the bridge
//! reach each other; after it the NIC's link is down (spec/000 §8: network access is revoked on
//! every rollback) and they no longer do.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use backstop_e2e::{skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);

/// A network namespace with a bridge (the host-side peer, 10.77.0.1) and a tap on it; removed
/// on drop.
struct Netns(String);

impl Netns {
    fn make(tag: &str) -> Option<Netns> {
        let ns = Netns(format!("bs-{}-{tag}", std::process::id()));
        let run = |args: &[&str]| {
            Command::new("ip")
                .args(["netns", "exec", &ns.0, "ip"])
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        let made = Command::new("ip")
            .args(["netns", "add", &ns.0])
            .status()
            .is_ok_and(|s| s.success());
        let ok = made
            && run(&["link", "set", "lo", "up"])
            && run(&["link", "add", "br0", "type", "bridge"])
            && run(&["addr", "add", "10.77.0.1/24", "dev", "br0"])
            && run(&["tuntap", "add", "dev", "bstap0", "mode", "tap"])
            && run(&["link", "set", "bstap0", "master", "br0"])
            && run(&["link", "set", "bstap0", "up"])
            && run(&["link", "set", "br0", "up"]);
        ok.then_some(ns)
    }

    /// One ping from the host-side peer to the guest.
    fn ping_guest(&self) -> bool {
        Command::new("ip")
            // busybox's ping: scripts/setup.sh installs busybox-static, not iputils.
            .args([
                "netns",
                "exec",
                &self.0,
                "busybox",
                "ping",
                "-c1",
                "-W1",
                "10.77.0.2",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn wait_for(what: &str, within: Duration, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !pred() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn link_up(d: &Daemon, nic: &str) -> Value {
    let v = d.ok(&["device", "list"]);
    v["hypervisor"]["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["nic"] == nic)
        .map(|l| l["up"].clone())
        .unwrap_or(Value::Null)
}

#[test]
fn a_guest_on_a_tap_reaches_its_peer_until_a_rollback_takes_the_link_down() {
    if skip_unless_ready("a_guest_on_a_tap_reaches_its_peer_until_a_rollback_takes_the_link_down") {
        return;
    }
    let Some(ns) = Netns::make("tap") else {
        backstop_e2e::skip_for(
            "a_guest_on_a_tap_reaches_its_peer_until_a_rollback_takes_the_link_down",
            "cannot make a network namespace with a bridge and a tap (needs root and iproute2)",
        );
        return;
    };
    let d = Daemon::start_opts(
        "tapnic",
        &Options {
            netns: Some(&ns.0),
            extra_vm: "tap_nics = [{ id = \"lan\", ifname = \"bstap0\" }]",
            guest_flags: "backstop.ip=10.77.0.2/24 backstop.ping=10.77.0.1",
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    // Both ways: the guest reaches the peer, the peer reaches the guest.
    let since = 0;
    wait_for("the guest pings its peer", BOOT, || {
        d.serial_since(since).contains("BACKSTOP ping ok")
    });
    wait_for("the peer pings the guest", Duration::from_secs(30), || {
        ns.ping_guest()
    });
    assert_eq!(link_up(&d, "lan"), Value::Bool(true));
    let snap = d.ok(&["snapshot", "create", "--reason", "on the network"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();

    let from = d.serial_len();
    let rb = d.ok(&[
        "rollback",
        "--to",
        &id,
        "--reason",
        "test: revoke the network",
    ]);
    assert_eq!(rb["epoch"], 1);
    // The restored guest finds its link down: neither side gets through any more.
    assert_eq!(link_up(&d, "lan"), Value::Bool(false));
    wait_for("the guest loses its peer", Duration::from_secs(60), || {
        d.serial_since(from).contains("BACKSTOP ping failed")
    });
    assert!(!ns.ping_guest(), "the peer still reaches the guest");
    assert!(
        !d.serial_since(from).contains("BACKSTOP ping ok"),
        "the guest reached its peer after the rollback"
    );

    // A person grants the network again (a tap NIC is grantable like any NIC): both ways again.
    let again = d.serial_len();
    d.ok(&["device", "grant", "lan", "--reason", "test: network back"]);
    assert_eq!(link_up(&d, "lan"), Value::Bool(true));
    wait_for(
        "the guest reaches its peer again",
        Duration::from_secs(60),
        || d.serial_since(again).contains("BACKSTOP ping ok"),
    );
    assert!(
        ns.ping_guest(),
        "the peer does not reach the guest after the grant"
    );
}
