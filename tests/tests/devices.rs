//! Hardware revocation (spec/000 §8, §13): no device access survives a rollback.
//!
//! Real daemon, real QEMU 7.2 guest, real console. The devices are emulated stand-ins (there is
//! no passthrough hardware here): `usb-tablet` (input), `usb-audio` (microphone; QEMU 7.2 marks
//! it non-migratable, so it blocks migration exactly as a VFIO device does), `usb-storage`
//! (with a host image), `edu` in a PCIe hot-plug port (GPU stand-in), a NIC's link, and the VNC
//! display. Everything is checked from QEMU's own view — `qom-list /machine/peripheral`,
//! `query-pci`, `info usb`, `query-vnc`, the virtio-net status register the guest reads,
//! `query-migrate` blocked-reasons — which `backstop device list` reads live from QEMU.
//! VFIO's host side runs against a fake sysfs tree with a fake kernel behind it.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use backstop_e2e::{skip_unless_ready, tail, Daemon, Options};
use backstop_vfio::fake::FakeSysfs;
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);

fn devices_toml(stick: &Path) -> String {
    format!(
        r#"
[[devices]]
id = "tablet"
class = "usb"
qemu = {{ driver = "usb-tablet" }}
max_lease_s = 600

[[devices]]
id = "mic"
class = "audio"
qemu = {{ driver = "usb-audio" }}
max_lease_s = 600

[[devices]]
id = "stick"
class = "usb"
qemu = {{ driver = "usb-storage", removable = true }}
drive = {{ path = "{stick}" }}
max_lease_s = 600

[[devices]]
id = "gpu"
class = "gpu"
qemu = {{ driver = "edu" }}
max_lease_s = 600
release_timeout_s = 60

[[devices]]
id = "kbd"
class = "usb"
qemu = {{ driver = "usb-kbd" }}
max_lease_s = 600

[[devices]]
id = "net"
class = "network"
nic = "net0"
max_lease_s = 600

[[devices]]
id = "screen"
class = "display"
max_lease_s = 600
"#,
        stick = stick.display()
    )
}

fn start(name: &str, media: &tempfile::TempDir) -> Daemon {
    let stick = media.path().join("stick.img");
    std::fs::write(&stick, vec![0u8; 1 << 20]).unwrap();
    let toml = devices_toml(&stick);
    let d = Daemon::start_opts(
        name,
        &Options {
            extra_toml: &toml,
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    d
}

/// Runs the console and requires a failure with `code`.
fn fails_with(d: &Daemon, args: &[&str], code: &str) -> String {
    let out = d.cli(args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !out.status.success(),
        "backstop {args:?} should have failed with {code}: {stdout}"
    );
    let doc: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["error"]["code"], code, "{stdout}");
    doc["error"]["message"].as_str().unwrap_or("").to_string()
}

/// QEMU's own view, read live by the daemon (`device list`).
fn qemu_view(d: &Daemon) -> Value {
    let v = d.ok(&["device", "list"]);
    assert!(v["hypervisor"].is_object(), "no hypervisor view: {v}");
    v["hypervisor"].clone()
}

fn peripherals(h: &Value) -> Vec<(String, String)> {
    h["peripherals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_string(),
                p["device_type"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn pci_ids(h: &Value) -> Vec<String> {
    h["pci"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["qdev_id"].as_str().unwrap().to_string())
        .collect()
}

fn usb_ids(h: &Value) -> Vec<String> {
    h["usb"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["id"].as_str().unwrap().to_string())
        .collect()
}

fn link(h: &Value, nic: &str) -> Value {
    h["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["nic"] == nic)
        .map(|l| l["up"].clone())
        .unwrap_or(Value::Null)
}

/// Waits until QEMU reads the link of `nic` as `up` (the guest maps the NIC's BAR at boot).
fn wait_link(d: &Daemon, nic: &str, up: bool) -> Value {
    let deadline = std::time::Instant::now() + STEP;
    loop {
        let h = qemu_view(d);
        if link(&h, nic) == Value::Bool(up) {
            return h;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "link {nic} never read {up}: {h}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Nothing granted is in the VM, as QEMU reports it.
fn assert_nothing_granted(h: &Value) {
    let grantable: Vec<_> = h["peripherals"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["grantable"] == true || p["id"].as_str().unwrap().starts_with("grant-"))
        .collect();
    assert!(
        grantable.is_empty(),
        "granted devices present: {grantable:?}"
    );
    assert!(
        !pci_ids(h).iter().any(|id| id.starts_with("grant-")),
        "granted PCI function present: {h}"
    );
    assert!(usb_ids(h).is_empty(), "USB devices present: {h}");
    assert_eq!(h["migration_blockers"], serde_json::json!([]), "{h}");
    assert_eq!(h["display"]["clients"], 0, "{h}");
}

fn events<'a>(journal: &'a [Value], name: &str) -> Vec<&'a Value> {
    journal.iter().filter(|e| e["event"] == name).collect()
}

fn snapshot_ids(d: &Daemon) -> Vec<String> {
    d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn every_grant_is_gone_after_a_rollback_as_qemu_reports_it() {
    if skip_unless_ready("every_grant_is_gone_after_a_rollback_as_qemu_reports_it") {
        return;
    }
    let media = tempfile::tempdir().unwrap();
    let d = start("devgone", &media);

    // Before any grant: the base shape holds the controller and ports, no grant; network
    // access is granted, not given, so the link starts down.
    let h = wait_link(&d, "net0", false);
    assert_nothing_granted(&h);
    let types: Vec<String> = peripherals(&h).into_iter().map(|p| p.1).collect();
    assert!(types.contains(&"qemu-xhci".to_string()), "{types:?}");
    assert!(types.contains(&"pcie-root-port".to_string()), "{types:?}");
    assert_eq!(h["display"]["auth"], "vnc", "{h}");

    // Nothing outside the config can be granted.
    fails_with(
        &d,
        &["device", "grant", "webcam", "--reason", "t"],
        "ERR_DEVICE_NOT_CONFIGURED",
    );
    fails_with(
        &d,
        &[
            "device", "grant", "tablet", "--lease", "2h", "--reason", "t",
        ],
        "ERR_DEVICE_LEASE_TOO_LONG",
    );

    // Grant everything at once, after a pre-action snapshot.
    let before = snapshot_ids(&d);
    let g = d.ok(&[
        "device",
        "grant",
        "tablet",
        "mic",
        "stick",
        "gpu",
        "net",
        "screen",
        "--lease",
        "10m",
        "--reason",
        "e2e: all devices",
    ]);
    let after = snapshot_ids(&d);
    assert_eq!(after.len(), before.len() + 1, "one pre-action snapshot");
    let pre = after.last().unwrap().clone();
    for dev in g["devices"].as_array().unwrap() {
        if dev["id"] == "kbd" {
            assert!(dev["grant"].is_null());
            continue;
        }
        assert_eq!(dev["grant"]["state"], "granted", "{dev}");
        assert_eq!(dev["grant"]["pre_action_snapshot"], pre.as_str());
    }
    let access = &g["access"][0];
    assert_eq!(access["id"], "screen");
    assert_eq!(access["secret"].as_str().unwrap().len(), 8);
    let pre_manifest = d.ok(&["snapshot", "show", &pre]);
    assert_eq!(
        pre_manifest["manifest"]["trigger"], "pre_action",
        "{pre_manifest}"
    );

    // QEMU holds them all now.
    let h = wait_link(&d, "net0", true);
    let ids: Vec<String> = peripherals(&h).into_iter().map(|p| p.0).collect();
    for id in ["grant-tablet", "grant-mic", "grant-stick", "grant-gpu"] {
        assert!(ids.contains(&id.to_string()), "{id} missing: {ids:?}");
    }
    let mut usb = usb_ids(&h);
    usb.sort();
    assert_eq!(usb, vec!["grant-mic", "grant-stick", "grant-tablet"]);
    assert!(pci_ids(&h).contains(&"grant-gpu".to_string()), "{h}");
    let blockers = h["migration_blockers"].to_string();
    assert!(blockers.contains("usb-audio"), "{blockers}");

    // A VM holding a granted device is not snapshotted: deferred, journaled, and the rollback
    // target stays the pre-grant snapshot.
    fails_with(
        &d,
        &["snapshot", "create", "--reason", "while granted"],
        "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED",
    );
    assert_eq!(snapshot_ids(&d), after);
    let j = d.journal();
    let deferred = events(&j, "snapshot.create.deferred");
    assert_eq!(deferred.len(), 1, "{deferred:?}");
    assert_eq!(deferred[0]["fields"]["rollback_target"], pre.as_str());
    assert_eq!(
        deferred[0]["fields"]["code"],
        "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED"
    );

    // Another grant's pre-action snapshot fails the same way: the grant is refused, journaled,
    // and nothing reaches the VM.
    let msg = fails_with(
        &d,
        &["device", "grant", "kbd", "--reason", "one more"],
        "ERR_PRE_ACTION_SNAPSHOT_FAILED",
    );
    assert!(
        msg.contains("ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED"),
        "{msg}"
    );
    let j = d.journal();
    let refused = events(&j, "device.grant.refused");
    assert_eq!(refused.len(), 1);
    assert_eq!(
        refused[0]["fields"]["code"],
        "ERR_PRE_ACTION_SNAPSHOT_FAILED"
    );
    assert_eq!(
        refused[0]["fields"]["cause_code"],
        "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED"
    );
    assert_eq!(refused[0]["fields"]["devices"], serde_json::json!(["kbd"]));
    let ids: Vec<String> = peripherals(&qemu_view(&d))
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert!(!ids.contains(&"grant-kbd".to_string()), "{ids:?}");

    // Rollback (newest verified = the pre-grant snapshot): everything revoked first.
    let rb = d.ok(&["rollback", "--reason", "e2e: revoke everything"]);
    assert_eq!(rb["snapshot_id"], pre.as_str());
    let revoked: Vec<String> = rb["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let all = revoked.join("\n");
    for want in [
        "device_del usb-tablet grant-tablet",
        "device_del usb-audio grant-mic",
        "device_del usb-storage grant-stick",
        "link down net0",
        "vnc password revoked",
        "hypervisor process ended",
        "grant tablet (qemu usb-tablet) ended with the hypervisor process",
        "grant screen (vnc) ended with the hypervisor process",
        "grant net (nic net0) ended with the hypervisor process",
    ] {
        assert!(all.contains(want), "{want:?} not in revoked:\n{all}");
    }
    assert!(all.contains("grant-gpu"), "{all}");

    // After restore: nothing granted, as QEMU reports it; the link is down as the guest reads
    // it; the display has no password and no client; the ledger is empty.
    let list = d.ok(&["device", "list"]);
    assert!(
        list["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|dev| dev["grant"].is_null()),
        "{list}"
    );
    let h = list["hypervisor"].clone();
    assert_nothing_granted(&h);
    assert_eq!(link(&h, "net0"), Value::Bool(false), "{h}");
    // The restored guest runs on.
    let from = d.serial_len();
    let top = d.last_tick().unwrap().ram;
    d.wait_ticks_until(from, STEP, "restored guest ticking", |t| t.len() >= 2);
    assert!(top > 0);

    // The journal: the rollback lists what it revoked, and each grant ended with it.
    let j = d.journal();
    let done = events(&j, "rollback.completed");
    let last = done.last().unwrap();
    let logged = last["fields"]["revoked"].to_string();
    assert!(
        logged.contains("device_del usb-tablet grant-tablet"),
        "{logged}"
    );
    assert!(
        logged.contains("grant mic (qemu usb-audio) ended"),
        "{logged}"
    );
    let ended: Vec<&Value> = events(&j, "device.revoked")
        .into_iter()
        .filter(|e| e["fields"]["cause"] == "rollback")
        .collect();
    assert_eq!(ended.len(), 6, "{ended:?}");
    assert_eq!(events(&j, "device.granted").len(), 6);

    // Snapshots work again, and nothing comes back until a host grants it again.
    d.ok(&["snapshot", "create", "--reason", "after revocation"]);
    assert_nothing_granted(&qemu_view(&d));
    let v = d.ok(&["audit", "verify"]);
    assert!(v["first_bad"].is_null(), "{v}");
}

#[test]
fn access_granted_before_the_snapshot_does_not_come_back_with_it() {
    if skip_unless_ready("access_granted_before_the_snapshot_does_not_come_back_with_it") {
        return;
    }
    let media = tempfile::tempdir().unwrap();
    let d = start("devbefore", &media);
    wait_link(&d, "net0", false);
    // Network and display grants add no device: the VM can still be snapshotted while they
    // are held, so a snapshot can hold a raised link and a set VNC password.
    d.ok(&[
        "device",
        "grant",
        "net",
        "screen",
        "--reason",
        "e2e: access",
    ]);
    wait_link(&d, "net0", true);
    let with_access = d.ok(&["snapshot", "create", "--reason", "while access granted"]);
    let id = with_access["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "e2e: back"]);
    assert_eq!(rb["snapshot_id"], id.as_str());
    // Restored from a snapshot taken with the link up: QEMU serves the guest a link that is
    // down, the display is a fresh one without a password, and no grant is in the ledger.
    let list = d.ok(&["device", "list"]);
    assert!(list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .all(|dev| dev["grant"].is_null()));
    let h = list["hypervisor"].clone();
    assert_eq!(link(&h, "net0"), Value::Bool(false), "{h}");
    assert_nothing_granted(&h);
}

#[test]
fn leases_expire_and_revocation_from_the_console_takes_a_device_back() {
    if skip_unless_ready("leases_expire_and_revocation_from_the_console_takes_a_device_back") {
        return;
    }
    let media = tempfile::tempdir().unwrap();
    let d = start("devlease", &media);
    d.ok(&[
        "device",
        "grant",
        "tablet",
        "gpu",
        "--lease",
        "8",
        "--reason",
        "e2e: short lease",
    ]);
    let h = qemu_view(&d);
    let ids: Vec<String> = peripherals(&h).into_iter().map(|p| p.0).collect();
    assert!(ids.contains(&"grant-gpu".to_string()) && ids.contains(&"grant-tablet".to_string()));

    // The console takes the PCI stand-in back (the guest cooperates with the hot-unplug).
    let r = d.ok(&["device", "revoke", "gpu", "--reason", "e2e: done with it"]);
    let changed = r["changed"].to_string();
    assert!(changed.contains("gpu"), "{changed}");
    d.wait_journal(STEP, "gpu revoked", |e| {
        e["event"] == "device.revoked" && e["fields"]["device_id"] == "gpu"
    });
    let ids: Vec<String> = peripherals(&qemu_view(&d))
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert!(!ids.contains(&"grant-gpu".to_string()), "{ids:?}");
    assert!(!pci_ids(&qemu_view(&d)).contains(&"grant-gpu".to_string()));

    // The tablet's lease runs out: revoked by the daemon itself.
    let expired = d.wait_journal(STEP, "lease expiry", |e| {
        e["event"] == "device.lease_expired" && e["fields"]["device_id"] == "tablet"
    });
    assert_eq!(expired["fields"]["lease_s"], 8);
    let revoked = d.wait_journal(STEP, "expired grant revoked", |e| {
        e["event"] == "device.revoked" && e["fields"]["device_id"] == "tablet"
    });
    assert_eq!(revoked["fields"]["cause"], "lease_expired");
    assert_nothing_granted(&qemu_view(&d));
    // With nothing held, snapshots are taken again.
    d.ok(&["snapshot", "create", "--reason", "after the lease"]);
    fails_with(
        &d,
        &["device", "revoke", "tablet", "--reason", "again"],
        "ERR_DEVICE_NOT_GRANTED",
    );
}

const GPU: &str = "0000:01:00.0";

fn vfio_toml() -> String {
    r#"
[[devices]]
id = "passthrough"
class = "gpu"
host = "0000:01:00.0"
host_driver = "nvidia"
max_lease_s = 600
"#
    .to_string()
}

fn start_vfio(name: &str, sysfs: &Path) -> Daemon {
    let toml = vfio_toml();
    let root = sysfs.display().to_string();
    let env = [("BACKSTOP_SYSFS_ROOT", root.as_str())];
    let d = Daemon::start_opts(
        name,
        &Options {
            extra_toml: &toml,
            env: &env,
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    d
}

/// The host side of a VFIO grant and of every rollback, against a fake sysfs tree: a grant
/// binds the device to vfio-pci first (QEMU here has no IOMMU group for it, so the grant then
/// fails and is undone: the device goes back to its host driver); a device left on vfio-pci
/// is reset and rebound to its host driver by the next rollback, in the right order.
#[test]
fn vfio_devices_are_reset_and_rebound_to_their_host_driver_on_rollback() {
    if skip_unless_ready("vfio_devices_are_reset_and_rebound_to_their_host_driver_on_rollback") {
        return;
    }
    let tree = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::new(tree.path(), &["vfio-pci", "nvidia"]).unwrap();
    fake.add_device(GPU, Some("nvidia"), None).unwrap();
    let d = start_vfio("vfiook", tree.path());

    // A grant: bound to vfio-pci on the host, then QEMU cannot open it → refused and undone.
    let msg = fails_with(
        &d,
        &["device", "grant", "passthrough", "--reason", "e2e: vfio"],
        "ERR_DEVICE_GRANT_FAILED",
    );
    assert!(msg.contains("vfio"), "{msg}");
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
    let files: Vec<String> = fake
        .wait_events(7, Duration::from_secs(5))
        .into_iter()
        .map(|e| e.file.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(
        files,
        vec![
            "unbind",
            "driver_override",
            "drivers_probe", // to vfio-pci
            "unbind",
            "reset",
            "driver_override",
            "drivers_probe", // back to nvidia
        ]
    );
    let n = fake.events().len();

    // Left on vfio-pci (as a grant whose QEMU died would leave it): the rollback gives it back.
    let dev = tree.path().join(format!("bus/pci/devices/{GPU}"));
    std::fs::remove_file(dev.join("driver")).unwrap();
    std::os::unix::fs::symlink(
        tree.path().join("bus/pci/drivers/vfio-pci"),
        dev.join("driver"),
    )
    .unwrap();
    let rb = d.ok(&["rollback", "--reason", "e2e: rebind"]);
    let revoked = rb["revoked"].to_string();
    assert!(
        revoked.contains("vfio 0000:01:00.0: unbound from vfio-pci, reset, rebound to nvidia"),
        "{revoked}"
    );
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
    let ev = fake.wait_events(n + 4, Duration::from_secs(5));
    let tail_ev: Vec<(String, Option<String>)> = ev[n..]
        .iter()
        .map(|e| {
            (
                e.file.rsplit('/').next().unwrap().to_string(),
                e.bound_to.clone(),
            )
        })
        .collect();
    assert_eq!(
        tail_ev,
        vec![
            ("unbind".to_string(), Some("vfio-pci".to_string())),
            ("reset".to_string(), None),
            ("driver_override".to_string(), None),
            ("drivers_probe".to_string(), None),
        ],
        "the reset must come after the unbind, while no driver holds the device"
    );
    // Rolled back and running; the next rollback finds nothing to do.
    assert_eq!(d.status()["state"], "running");
    let rb = d.ok(&["rollback", "--reason", "e2e: again"]);
    assert!(
        rb["revoked"]
            .to_string()
            .contains("vfio 0000:01:00.0: on host driver nvidia"),
        "{}",
        rb["revoked"]
    );
    assert_eq!(
        fake.events().len(),
        n + 4,
        "nothing written the second time"
    );
}

#[test]
fn a_failed_host_release_halts_and_never_resumes_the_vm() {
    if skip_unless_ready("a_failed_host_release_halts_and_never_resumes_the_vm") {
        return;
    }
    let tree = tempfile::tempdir().unwrap();
    let fake = FakeSysfs::new(tree.path(), &["vfio-pci", "nvidia"]).unwrap();
    // Bound to vfio-pci, and without a reset method: it cannot be given back safely.
    fake.add_device(GPU, Some("vfio-pci"), Some("vfio-pci"))
        .unwrap();
    fake.remove_attribute(GPU, "reset").unwrap();
    let d = start_vfio("vfiohalt", tree.path());

    let msg = fails_with(
        &d,
        &["rollback", "--reason", "e2e: release fails"],
        "ERR_ROLLBACK_FAILED_HALTED",
    );
    assert!(msg.contains("release host devices"), "{msg}");
    let st = d.status();
    assert_eq!(st["state"], "halted", "{st}");
    assert!(st["pid"].is_null(), "no QEMU may run: {st}");
    let j = d.journal();
    let failed = events(&j, "rollback.failed");
    assert_eq!(
        failed.last().unwrap()["fields"]["step"],
        "release host devices"
    );
    assert_eq!(events(&j, "vm.halted").len(), 1);
    // Unbound, never reset, never probed: the device stays off every driver.
    assert_eq!(fake.driver(GPU), None);
    let files: Vec<String> = fake.events().into_iter().map(|e| e.file).collect();
    assert_eq!(
        files,
        vec!["bus/pci/drivers/vfio-pci/unbind".to_string()],
        "{files:?}"
    );

    // Still broken: clearing the halt tries again and halts again.
    fails_with(
        &d,
        &["halt", "clear", "--reason", "e2e: retry"],
        "ERR_ROLLBACK_FAILED_HALTED",
    );
    assert_eq!(d.status()["state"], "halted");

    // Fixed on the host: the next clear gives the device back and the VM runs.
    std::fs::write(tree.path().join(format!("bus/pci/devices/{GPU}/reset")), "").unwrap();
    let out = d.cli(&["halt", "clear", "--reason", "e2e: fixed"]);
    assert!(
        out.status.success(),
        "{}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        tail(&d.log(), 30)
    );
    assert_eq!(d.status()["state"], "running");
    assert_eq!(fake.driver(GPU).as_deref(), Some("nvidia"));
}

/// Every rollback takes each NIC's link down (spec/000 §8), so a NIC that no `[[devices]]` entry
/// controls must still be grantable — under its own name, journaled, with a lease — or the guest's
/// network stays down for good after the first rollback.
#[test]
fn a_configured_nic_can_be_granted_again_after_a_rollback() {
    if skip_unless_ready("a_configured_nic_can_be_granted_again_after_a_rollback") {
        return;
    }
    let mut d = Daemon::start("nicgrant");
    d.wait_tick(0, 2, BOOT);
    wait_link(&d, "net0", true);
    let list = d.ok(&["device", "list"]);
    let net0 = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == "net0")
        .unwrap_or_else(|| panic!("net0 not listed: {list}"))
        .clone();
    assert_eq!(net0["class"], "network", "{net0}");
    assert!(net0["grant"].is_null(), "{net0}");

    d.ok(&["rollback", "--reason", "e2e: rollback"]);
    wait_link(&d, "net0", false);

    d.ok(&[
        "device",
        "grant",
        "net0",
        "--lease",
        "10m",
        "--reason",
        "e2e: network back",
    ]);
    wait_link(&d, "net0", true);
    let granted: Vec<Value> = d
        .journal()
        .into_iter()
        .filter(|e| e["event"] == "device.granted")
        .collect();
    assert_eq!(granted.len(), 1, "{granted:?}");
    assert!(
        granted[0].to_string().contains("net0"),
        "the grant names the NIC: {}",
        granted[0]
    );
    d.ok(&["device", "revoke", "net0", "--reason", "e2e: done"]);
    wait_link(&d, "net0", false);
    d.stop();
}

#[test]
fn a_scheduled_slot_put_off_by_a_granted_device_is_journaled_as_deferred() {
    if skip_unless_ready("a_scheduled_slot_put_off_by_a_granted_device_is_journaled_as_deferred") {
        return;
    }
    let media = tempfile::tempdir().unwrap();
    let stick = media.path().join("stick.img");
    std::fs::write(&stick, vec![0u8; 1 << 20]).unwrap();
    let toml = format!(
        "{}\n[snapshots]\nschedule_seconds = 6\n",
        devices_toml(&stick)
    );
    let d = Daemon::start_opts(
        "devsched",
        &Options {
            extra_toml: &toml,
            ..Options::default()
        },
    );
    d.wait_tick(0, 3, BOOT);
    d.ok(&["device", "grant", "tablet", "--reason", "t"]);
    // The next slot cannot be taken while the tablet is in the VM: put off, not failed.
    let missed = d.wait_journal(Duration::from_secs(60), "a missed slot", |e| {
        e["event"] == "snapshot.schedule.missed"
    });
    assert_eq!(missed["fields"]["why"], "snapshot_deferred", "{missed}");
    assert_eq!(
        missed["fields"]["code"], "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED",
        "{missed}"
    );
}
