//! A VM whose state directory is on a small filesystem (a 32 MiB tmpfs, below the daemon's
//! `min_free_mib`) is not started, since its baseline snapshot has no room (`ERR_SNAPSHOT_NO_SPACE`),
//! and starts by itself once there is room; a VM of the same daemon on a roomy filesystem
//! snapshots as usual. A guest flooding its console cannot
//! grow its serial log past `serial_log_max_kib` (twice that with the rotated file). The disk
//! layers rollbacks and crashes abandon are collected by `snapshot prune`, and only those.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use backstop_e2e::{parse_ticks, skip_unless_ready, Daemon, Options};

/// Lazily unmounts on drop (the daemon may still hold files there).
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn wait_ticks(d: &Daemon, vm: &str, more_than: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while parse_ticks(&d.vm_serial(vm)).len() <= more_than {
        assert!(
            Instant::now() < deadline,
            "{vm} does not run; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_full_state_dir_refuses_that_vms_snapshots_and_nothing_else() {
    if skip_unless_ready("a_full_state_dir_refuses_that_vms_snapshots_and_nothing_else") {
        return;
    }
    let mut d = Daemon::prepare_many(
        "fulldisk",
        &["small", "roomy"],
        "min_free_mib = 48",
        &[],
        &[],
    );
    let small = d.vm_state_dir("small");
    let Some(_mount) = mount_tmpfs(
        &small,
        "32m",
        "a_full_state_dir_refuses_that_vms_snapshots_and_nothing_else",
    ) else {
        return;
    };
    d.launch();
    // No room for its baseline: the VM is not started (it would run with nothing to roll back
    // to), and says why.
    let deadline = Instant::now() + Duration::from_secs(120);
    let st = loop {
        let st = d.ok_vm("small", &["status"]);
        if !st["waiting_for_baseline"].is_null() {
            break st;
        }
        assert!(Instant::now() < deadline, "small never said it waits: {st}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(st["state"], "stopped", "{st}");
    assert_eq!(
        st["waiting_for_baseline"]["code"], "ERR_SNAPSHOT_NO_SPACE",
        "{st}"
    );
    assert!(d.vm_journal("small").iter().any(
        |e| e["event"] == "vm.start_deferred" && e["fields"]["code"] == "ERR_SNAPSHOT_NO_SPACE"
    ));

    let out = d.cli_vm("small", &["snapshot", "create", "--reason", "no room"]);
    assert_eq!(out.status.code(), Some(1));
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_NO_SPACE", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("min_free_mib = 48"),
        "{err}"
    );
    // The refusal changed nothing: the VM is still not started, its store holds no snapshot,
    // and no guest code ran.
    let st = d.ok_vm("small", &["status"]);
    assert_eq!(st["state"], "stopped", "{st}");
    assert_eq!(st["snapshots"], 0, "{st}");
    assert_eq!(parse_ticks(&d.vm_serial("small")).len(), 0);
    assert!(d
        .vm_journal("small")
        .iter()
        .any(|e| e["event"] == "snapshot.create.failed"
            && e["fields"]["code"] == "ERR_SNAPSHOT_NO_SPACE"));

    // Room is made: the VM starts by itself, with its baseline taken first.
    let grown = Command::new("mount")
        .args(["-o", "remount,size=512m"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(grown.success());
    wait_ticks(&d, "small", 2);
    let st = d.ok_vm("small", &["status"]);
    assert_eq!(st["state"], "running", "{st}");
    assert!(st["snapshots"].as_u64().unwrap() >= 1, "{st}");
    assert!(st["waiting_for_baseline"].is_null(), "{st}");

    // The other VM is not affected.
    wait_ticks(&d, "roomy", 2);
    let snap = d.ok_vm("roomy", &["snapshot", "create", "--reason", "room"]);
    assert!(snap["summary"]["snapshot_id"].is_string(), "{snap}");
    d.stop();
}

#[test]
fn a_guest_flooding_its_console_cannot_grow_its_log_past_the_bound() {
    if skip_unless_ready("a_guest_flooding_its_console_cannot_grow_its_log_past_the_bound") {
        return;
    }
    let mut d = Daemon::start_opts(
        "flood",
        &Options {
            extra_daemon: "serial_log_max_kib = 64",
            guest_flags: "backstop.serial_flood=1",
            ..Options::default()
        },
    );
    let log = d.serial_path();
    let older = log.with_file_name("e2e-serial.log.1");
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    // The guest prints hundreds of KiB a second: the log is rotated within seconds.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !older.exists() {
        assert!(
            Instant::now() < deadline,
            "the log was never rotated ({} bytes); log:\n{}",
            size(&log),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let first_rotated = std::fs::read(&older).unwrap();
    // For a while the bound holds at every look, and the log keeps rotating (the guest is
    // still printing, so the output is dropped on purpose, not because the guest stopped).
    let mut rotated_again = false;
    for _ in 0..25 {
        let (now, old) = (size(&log), size(&older));
        assert!(
            now <= 64 << 10 && old <= 64 << 10,
            "serial log {now} bytes, rotated {old} bytes: bound 64 KiB"
        );
        rotated_again |= std::fs::read(&older)
            .map(|b| b != first_rotated)
            .unwrap_or(false);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        rotated_again,
        "the guest stopped printing? log:\n{}",
        d.log()
    );
    assert!(
        std::fs::read_to_string(&older).unwrap().contains("FLOOD"),
        "the rotated file holds the guest's output"
    );
    // The flood costs the VM nothing: it runs, and a snapshot is taken as usual.
    assert_eq!(d.status()["state"], "running");
    let snap = d.ok(&["snapshot", "create", "--reason", "during a flood"]);
    assert!(snap["summary"]["snapshot_id"].is_string(), "{snap}");
    d.stop();
}

/// The `disks/data/NNNNNN.qcow2` layer files of the test VM.
fn layer_files(d: &Daemon) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(d.state_dir().join("disks/data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .collect();
    v.sort();
    v
}

#[test]
fn prune_collects_the_layers_rollbacks_and_crashes_abandon_and_nothing_needed() {
    if skip_unless_ready(
        "prune_collects_the_layers_rollbacks_and_crashes_abandon_and_nothing_needed",
    ) {
        return;
    }
    // Forensic snapshots kept only until this prune, so that it collects the overlays the
    // rollbacks abandoned (kept three days by default, they would still be needed).
    let mut d = Daemon::start_opts(
        "orphans",
        &Options {
            extra_toml: "[retention]\nkeep_forensic_hours = 0\n",
            ..Options::default()
        },
    );
    d.wait_tick(0, 2, Duration::from_secs(120));
    let a = d.ok(&["snapshot", "create", "--reason", "point a"])["summary"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let a_ram = parse_ticks(&d.serial()).last().unwrap().ram;
    // Each rollback puts the guest on a fresh overlay; the line it left is referenced by nothing.
    for why in ["one", "two"] {
        d.ok(&["rollback", "--to", &a, "--reason", why]);
    }
    // So does a crash: the restarted daemon restores the newest snapshot on a fresh overlay.
    d.kill9();
    d.launch();
    let before = layer_files(&d);
    let pruned = d.ok(&["snapshot", "prune"]);
    let removed = pruned["layers_removed"].as_u64().unwrap();
    let after = layer_files(&d);
    assert!(
        removed >= 3,
        "two rollbacks and a crash abandoned at least three overlays; removed {removed}: {pruned}"
    );
    assert_eq!(
        after.len() as u64,
        before.len() as u64 - removed,
        "{before:?} -> {after:?}"
    );
    assert!(d
        .journal()
        .iter()
        .any(|e| e["event"] == "snapshot.prune.completed"
            && e["fields"]["layers_removed"]
                .as_array()
                .is_some_and(|l| !l.is_empty())));
    // Nothing needed went: every snapshot verifies, the guest runs on its chain, a second prune
    // finds nothing more.
    let list = d.ok(&["snapshot", "list"]);
    for s in list["snapshots"].as_array().unwrap() {
        let id = s["snapshot_id"].as_str().unwrap();
        d.ok(&["snapshot", "verify", id]);
    }
    assert_eq!(d.ok(&["snapshot", "prune"])["layers_removed"], 0);
    let from = d.serial_len();
    d.wait_tick(from, 0, Duration::from_secs(60));
    // The guest gets past point a before the stop, so that the final snapshot can be told from
    // it below (a restore, prune and verify that are quick leave it no time otherwise).
    d.wait_tick(from, a_ram + 2, Duration::from_secs(60));
    // A clean restart reopens the running chain (the final snapshot is taken of it), and a
    // rollback restores that snapshot, whose chain is the one the guest ran on during the prune.
    let ram_before_stop = parse_ticks(&d.serial()).last().unwrap().ram;
    d.stop();
    d.launch();
    assert_eq!(d.status()["state"], "running");
    for s in d.ok(&["snapshot", "list"])["snapshots"].as_array().unwrap() {
        d.ok(&["snapshot", "verify", s["snapshot_id"].as_str().unwrap()]);
    }
    d.ok(&["rollback", "--reason", "back to the final snapshot"]);
    let from = d.serial_len();
    let t = d.wait_tick(from, 0, Duration::from_secs(60));
    assert!(
        t[0].ram > a_ram && t[0].ram <= ram_before_stop + 3,
        "after the rollback the guest counts from {} (point a ~{a_ram}, stopped at ~{ram_before_stop})",
        t[0].ram
    );
    assert_eq!(
        t[0].ram, t[0].disk,
        "RAM and disk at one instant: {:?}",
        t[0]
    );
    d.stop();
}

/// Takes all free space of `dir`'s filesystem but `leave` bytes with one file (`dir/filler`).
fn fill_leaving(dir: &std::path::Path, leave: u64) -> PathBuf {
    let free = nix::sys::statvfs::statvfs(dir).unwrap();
    let avail = free.blocks_available() * free.fragment_size();
    let filler = dir.join("filler");
    let ok = Command::new("fallocate")
        .args(["-l", &(avail - leave).to_string()])
        .arg(&filler)
        .status()
        .unwrap()
        .success();
    assert!(ok, "fallocate failed");
    filler
}

/// Mounts a tmpfs of `size` over `dir` (created), or says why the test must skip.
fn mount_tmpfs(dir: &std::path::Path, size: &str, test: &str) -> Option<Mount> {
    std::fs::create_dir_all(dir).unwrap();
    let mounted = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size},mode=0700"),
            "tmpfs",
        ])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if mounted {
        return Some(Mount(dir.to_path_buf()));
    }
    let why = "cannot mount a tmpfs (needs root)";
    if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") {
        panic!("BACKSTOP_REQUIRE_E2E=1 but {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
    None
}

/// A snapshot that runs out of space mid-capture (the free-space floor passed, the store filled up
/// while the state streamed) costs the guest nothing: the capture ends in QEMU, the write
/// protection is lifted, the guest runs on the same QEMU at full speed, nothing is published; with
/// space back the next snapshot works.
#[test]
fn a_snapshot_that_runs_out_of_space_midway_costs_the_guest_nothing() {
    const TEST: &str = "a_snapshot_that_runs_out_of_space_midway_costs_the_guest_nothing";
    if skip_unless_ready(TEST) {
        return;
    }
    let mut d = Daemon::prepare_many("midway", &["tight"], "min_free_mib = 1", &[], &[]);
    let dir = d.vm_state_dir("tight");
    let Some(_mount) = mount_tmpfs(&dir, "160m", TEST) else {
        return;
    };
    d.launch();
    wait_ticks(&d, "tight", 2);
    let st = d.ok_vm("tight", &["status"]);
    assert!(st["snapshots"].as_u64().unwrap() >= 1, "no baseline: {st}");
    let (pid, snapshots) = (st["pid"].as_u64().unwrap(), st["snapshots"].clone());
    // Leave 4 MiB: above the floor, far below what a capture of the guest's RAM needs.
    let filler = fill_leaving(&dir, 4 << 20);

    let out = d.cli_vm(
        "tight",
        &["snapshot", "create", "--reason", "runs out midway"],
    );
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    let msg = err["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("No space left") || msg.contains("no space"),
        "the failure names the cause: {err}"
    );
    // The guest is not frozen: it keeps ticking at its pace (~2 a second) on the same QEMU.
    let n = parse_ticks(&d.vm_serial("tight")).len();
    std::thread::sleep(Duration::from_secs(4));
    let ticked = parse_ticks(&d.vm_serial("tight")).len() - n;
    assert!(
        ticked >= 3,
        "only {ticked} ticks in 4 s after the failed capture"
    );
    let st = d.ok_vm("tight", &["status"]);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(
        st["pid"].as_u64(),
        Some(pid),
        "the guest's QEMU was replaced"
    );
    assert_eq!(
        st["snapshots"], snapshots,
        "a failed snapshot was published"
    );
    // With space back, snapshots work again and verify.
    std::fs::remove_file(&filler).unwrap();
    let snap = d.ok_vm("tight", &["snapshot", "create", "--reason", "room again"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    d.ok_vm("tight", &["snapshot", "verify", &id]);
    let shown = d.ok_vm("tight", &["snapshot", "show", &id]);
    assert!(
        shown["manifest"]["capture"]["store_stall_max_ms"].is_u64(),
        "the stall the store caused the guest is reported: {shown}"
    );
    d.stop();
}

/// A store that stalls mid-capture (fault `capture.stall`: the store takes no state for 10 s)
/// cannot keep the guest stalled: past `max_capture_stall_ms` the capture is abandoned and its
/// stream drained, the guest ticks on during the stall on the same QEMU, and the snapshot fails
/// with `ERR_SNAPSHOT_STALLED`, publishing nothing. The guest holds 96 MiB of random data so the
/// stream is far larger than backstop's 32 MiB buffer.
#[test]
fn a_stalled_store_cannot_stall_the_guest_past_the_bound() {
    if skip_unless_ready("a_stalled_store_cannot_stall_the_guest_past_the_bound") {
        return;
    }
    let mut d = Daemon::start_opts(
        "slowstore",
        &Options {
            extra_daemon: "max_capture_stall_ms = 1000",
            guest_flags: "backstop.fill_mib=96",
            env: &[("BACKSTOP_FAULT_INJECT", "capture.stall=10")],
            ..Options::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(180);
    while !d.serial().contains("BACKSTOP fill mib=96") {
        assert!(Instant::now() < deadline, "the guest never filled its RAM");
        std::thread::sleep(Duration::from_millis(200));
    }
    let st = d.status();
    let (pid, snapshots) = (st["pid"].as_u64().unwrap(), st["snapshots"].clone());
    let create = Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args([
            "--json",
            "snapshot",
            "create",
            "--reason",
            "onto a stalled store",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The capture starts, its buffer fills, the bound passes; then the guest must run for the
    // rest of the store's 10 s stall. The window opens when backstop says it abandoned the
    // capture (not after a fixed sleep: on a loaded host the capture's start can take seconds)
    // and closes when the request returns at the stall's end. The guest ticks every ~0.5 s; a
    // guest still stalled on its write-protected pages ticks at most once.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !d.log().contains("the store stalls the capture: abandoned") {
        assert!(
            Instant::now() < deadline,
            "the capture was never abandoned; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let from = d.serial_len();
    let window = Instant::now();
    let out = create.wait_with_output().unwrap();
    let window = window.elapsed();
    let ticks = parse_ticks(&d.serial_since(from)).len();
    assert!(
        ticks >= 3,
        "the guest ticked {ticks} times in {window:?} while the store stalled; log:\n{}",
        d.log()
    );
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err["error"]["code"], "ERR_SNAPSHOT_STALLED", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_capture_stall_ms = 1000"),
        "{err}"
    );
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(
        st["pid"].as_u64(),
        Some(pid),
        "the guest's QEMU was replaced"
    );
    assert_eq!(
        st["snapshots"], snapshots,
        "an abandoned snapshot was published"
    );
    assert_eq!(
        std::fs::read_dir(d.state_dir().join("store/tmp"))
            .unwrap()
            .count(),
        0,
        "build leftovers"
    );
    d.stop();
}

/// On a completely full filesystem the HALT record and its journal entry are still written: the
/// VM's 1 MiB `reserve.bin` is released for them. Here a daemon starts on a full state directory
/// holding a rollback marker (a crash mid-rollback), so it must HALT.
#[test]
fn a_full_filesystem_still_gets_its_halt_record() {
    const TEST: &str = "a_full_filesystem_still_gets_its_halt_record";
    if skip_unless_ready(TEST) {
        return;
    }
    let mut d = Daemon::prepare_many("haltfull", &["full"], "min_free_mib = 1", &[], &[]);
    let dir = d.vm_state_dir("full");
    let Some(_mount) = mount_tmpfs(&dir, "160m", TEST) else {
        return;
    };
    d.launch();
    wait_ticks(&d, "full", 1);
    assert!(dir.join("reserve.bin").exists(), "no space reserve made");
    d.kill9();
    std::fs::write(
        dir.join("rollback-inflight.json"),
        br#"{"snapshot_id":"x","trace_id":"t","started_at":"s"}"#,
    )
    .unwrap();
    // Fill the filesystem to the last byte.
    let filler = fill_leaving(&dir, 0);
    assert!(
        std::fs::write(dir.join("probe"), vec![0u8; 8192]).is_err(),
        "not full"
    );

    d.launch();
    let st = d.ok_vm("full", &["status"]);
    assert_eq!(st["state"], "halted", "{st}");
    assert_eq!(st["halted"]["code"], "ERR_ROLLBACK_INTERRUPTED", "{st}");
    assert!(
        dir.join("halted.json").exists(),
        "the HALT record was not written"
    );
    assert!(
        !dir.join("reserve.bin").exists(),
        "the reserve was not used"
    );
    assert!(
        d.vm_journal("full")
            .iter()
            .any(|e| e["event"] == "vm.halted" && e["fields"]["code"] == "ERR_ROLLBACK_INTERRUPTED"),
        "the halt was not journaled"
    );
    d.ok_vm("full", &["audit", "verify"]);
    // With space back, a person clears it and the reserve is made again.
    std::fs::remove_file(&filler).unwrap();
    d.ok_vm("full", &["halt", "clear", "--reason", "space freed"]);
    assert_eq!(d.ok_vm("full", &["status"])["state"], "running");
    assert!(
        dir.join("reserve.bin").exists(),
        "the reserve was not made again"
    );
    d.stop();
}

/// The publish phase: the state filesystem fills up after the chunks were stored and before the
/// manifest is published (fault `publish.fill-disk`). Nothing is published, the build directory is
/// gone, the guest runs on the same QEMU; with space back snapshots work.
#[test]
fn a_disk_that_fills_up_right_before_publish_publishes_nothing_and_costs_the_guest_nothing() {
    const TEST: &str =
        "a_disk_that_fills_up_right_before_publish_publishes_nothing_and_costs_the_guest_nothing";
    if skip_unless_ready(TEST) {
        return;
    }
    let mut d = Daemon::prepare_many(
        "publishfull",
        &["pub"],
        "min_free_mib = 1",
        &[],
        &[("BACKSTOP_FAULT_INJECT", "publish.fill-disk")],
    );
    let dir = d.vm_state_dir("pub");
    let Some(_mount) = mount_tmpfs(&dir, "160m", TEST) else {
        return;
    };
    d.launch();
    wait_ticks(&d, "pub", 2);
    let st = d.ok_vm("pub", &["status"]);
    let (pid, snapshots) = (st["pid"].as_u64().unwrap(), st["snapshots"].clone());
    let out = d.cli_vm(
        "pub",
        &["snapshot", "create", "--reason", "fills up at publish"],
    );
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    let msg = err["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("No space left"),
        "the failure names the cause: {err}"
    );
    assert!(dir.join("fault-filler").exists(), "the fault did not fire");
    let st = d.ok_vm("pub", &["status"]);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(
        st["pid"].as_u64(),
        Some(pid),
        "the guest's QEMU was replaced"
    );
    assert_eq!(
        st["snapshots"], snapshots,
        "a snapshot was published on a full disk"
    );
    assert_eq!(
        std::fs::read_dir(dir.join("store/tmp")).unwrap().count(),
        0,
        "build leftovers"
    );
    let n = parse_ticks(&d.vm_serial("pub")).len();
    wait_ticks(&d, "pub", n + 2);
    std::fs::remove_file(dir.join("fault-filler")).unwrap();
    d.ok_vm("pub", &["audit", "verify"]);
    for s in d.ok_vm("pub", &["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
    {
        d.ok_vm(
            "pub",
            &["snapshot", "verify", s["snapshot_id"].as_str().unwrap()],
        );
    }
    d.stop();
}
