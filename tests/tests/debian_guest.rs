//! A stock distribution guest: Debian 12 built from Debian's own packages
//! (scripts/build-debian-guest.sh), booted by SeaBIOS from its own disk — no kernel given to
//! QEMU — and guarded through the qemu-guest-agent it runs like any Debian install. It is
//! snapshotted, writes a file, is rolled back: the file is gone, its agent answers again and its
//! clock was set through the agent.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use backstop_e2e::{qemu_binary, review, skip_unless_ready, Daemon};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);

fn debian_image() -> PathBuf {
    let dir = std::env::var_os("BACKSTOP_DEBIAN_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/backstop/debian-guest")
        });
    dir.join("disk.qcow2")
}

fn fresh_heartbeat(st: &Value) -> bool {
    st["heartbeat_age_ms"].as_u64().is_some_and(|a| a < 4000)
}

#[test]
fn a_disk_booted_debian_guest_with_qemu_ga_is_guarded_and_rolled_back() {
    if skip_unless_ready("a_disk_booted_debian_guest_with_qemu_ga_is_guarded_and_rolled_back") {
        return;
    }
    let image = debian_image();
    if !image.exists() {
        backstop_e2e::skip_for(
            "a_disk_booted_debian_guest_with_qemu_ga_is_guarded_and_rolled_back",
            &format!(
                "no {} (run scripts/build-debian-guest.sh as root; scripts/setup.sh does)",
                image.display()
            ),
        );
        return;
    }
    // The rollback goes past the newest snapshot (the network grant's pre-action one) to the
    // test's own: that takes reviewer evidence.
    let keys = tempfile::tempdir().unwrap();
    let key = review::reviewer_key(keys.path());
    let gate = review::restore_gate_toml(&key);
    let mut d = Daemon::prepare_custom(
        "debian",
        &|state, run| {
            format!(
                r#"[daemon]
state_dir = "{state}"
run_dir = "{run}"

[vm]
name = "e2e"
qemu_binary = "{qemu}"
accel = "auto"
memory_mib = 512
heartbeat = "qemu-ga"
watchdog_device = true
nics = ["net0"]

[[vm.disks]]
id = "root"
path = "{image}"
snapshot = "capture"

[[devices]]
id = "net"
class = "network"
nic = "net0"
max_lease_s = 600

[watchdog]
heartbeat_timeout_s = 10
boot_grace_s = 300

{gate}"#,
                state = state.display(),
                run = run.display(),
                qemu = qemu_binary(),
                image = image.display(),
            )
        },
        &[],
    );
    d.launch();
    // Booted from its disk by SeaBIOS (no kernel on QEMU's command line), guarded by pongs.
    d.wait_serial(0, "BACKSTOP debian up", BOOT);
    let st = d.wait_status("the first pong", Duration::from_secs(60), fresh_heartbeat);
    assert_eq!(st["backend_details"]["heartbeat_source"], "qemu-ga", "{st}");
    let cmdline = std::fs::read_to_string(format!("/proc/{}/cmdline", st["pid"])).unwrap();
    assert!(
        !cmdline.contains("-kernel"),
        "booted a kernel, not the disk"
    );

    // A snapshot while the workload's file does not exist yet.
    d.wait_serial(0, "BACKSTOP debian marker absent", Duration::from_secs(60));
    let snap = d.ok(&["snapshot", "create", "--reason", "before the file"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    assert!(
        !d.serial().contains("BACKSTOP debian marker written"),
        "the guest wrote its file before the snapshot (boot too slow?): the test proves nothing"
    );
    // The guest writes the file (synced to its disk) when its NIC's link comes up
    // (scripts/debian-guest/overlay/usr/local/sbin/backstop-marker): granting the network
    // raises it.
    d.ok(&[
        "device",
        "grant",
        "net",
        "--reason",
        "test: let the guest write its file",
    ]);
    let written = d.wait_serial(0, "BACKSTOP debian marker written", Duration::from_secs(60));
    d.wait_serial(
        written,
        "BACKSTOP debian marker present",
        Duration::from_secs(10),
    );

    let from = d.serial_len();
    let tok = review::token(&key, &id);
    let rb = d.ok(&[
        "rollback",
        "--to",
        &id,
        "--reason",
        "test: undo the file",
        "--reviewer-token",
        tok.to_str().unwrap(),
    ]);
    assert_eq!(rb["epoch"], 1);
    // The restored guest looks and finds no file (the old guest only ever said `present`).
    d.wait_serial(
        from,
        "BACKSTOP debian marker absent",
        Duration::from_secs(60),
    );
    // Its agent answers again, and set the guest's clock after the restore.
    let st = d.wait_status(
        "pongs and the clock after the rollback",
        Duration::from_secs(60),
        |s| fresh_heartbeat(s) && s["backend_details"]["clock_resynced"] == true,
    );
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["epoch"], 1);
    d.ok(&["audit", "verify"]);
}
