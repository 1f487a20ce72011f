//! The QEMU backend on a real QEMU and the real test guest (scripts/setup.sh builds it into
//! `~/.cache/backstop/guest`), driven through the `VmBackend` trait as the engine drives it:
//!
//! * a failure injected at each step of a capture leaves the guest running (QEMU says so, and
//!   the guest's own serial ticks go on), and the next snapshot works;
//! * a guest the operator paused before a snapshot is still paused after it;
//! * any number of snapshots on one QEMU instance.
//!
//! `BACKSTOP_QEMU` chooses the QEMU (default: `qemu-system-x86_64` on PATH). Skips loudly when
//! QEMU or the guest is missing; `BACKSTOP_REQUIRE_E2E=1` makes that a failure.
//!
//! Needs the test-only feature: `cargo test -p backstop-qemu --features fault-injection`
//! (without it this file compiles to nothing).
#![cfg(feature = "fault-injection")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use backstop_hypervisor::{
    BackendError, BootMode, CaptureReport, DiskAttachment, DiskSwitch, VmBackend,
};
use backstop_qemu::{Accel, FaultStep, QemuBackend, QemuConfig};

fn qemu() -> String {
    match std::env::var("BACKSTOP_QEMU") {
        Ok(q) if !q.is_empty() => q,
        _ => "qemu-system-x86_64".into(),
    }
}

fn guest_dir() -> PathBuf {
    match std::env::var("BACKSTOP_GUEST_DIR") {
        Ok(d) if !d.is_empty() => d.into(),
        _ => PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
            .join(".cache/backstop/guest"),
    }
}

fn runs(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn skip(test: &str) -> bool {
    let g = guest_dir();
    let why = if !["vmlinuz", "initrd.img", "disk-base.qcow2"]
        .iter()
        .all(|f| g.join(f).exists())
    {
        Some(format!(
            "test guest missing in {} (run scripts/setup.sh)",
            g.display()
        ))
    } else if !runs(&qemu()) || !runs("qemu-img") {
        Some(format!(
            "{} or qemu-img does not run (run scripts/setup.sh)",
            qemu()
        ))
    } else {
        None
    };
    match why {
        None => false,
        Some(why) if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") => {
            panic!("{test}: BACKSTOP_REQUIRE_E2E=1 but {why}")
        }
        Some(why) => {
            eprintln!("SKIPPED {test}: {why}");
            true
        }
    }
}

struct Vm {
    backend: QemuBackend,
    dir: tempfile::TempDir,
    serial: PathBuf,
    active: PathBuf,
    n: u32,
}

/// A new empty overlay on `backing` (which a running QEMU may hold: `-u`, size given).
fn overlay(backing: &Path, path: &Path) {
    let info = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(backing)
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let size = info["virtual-size"].as_u64().unwrap().to_string();
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b"])
        .arg(backing)
        .arg(path)
        .arg(size)
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img create {}", path.display());
}

impl Vm {
    fn boot(name: &str) -> Vm {
        Vm::boot_with(name, 256)
    }

    fn boot_with(name: &str, memory_mib: u64) -> Vm {
        let dir = tempfile::Builder::new()
            .prefix(&format!("bq-{name}-"))
            .tempdir()
            .unwrap();
        let g = guest_dir();
        let active = dir.path().join("data-0.qcow2");
        overlay(&g.join("disk-base.qcow2"), &active);
        let serial = dir.path().join("serial.log");
        let cfg = QemuConfig {
            vm_name: name.into(),
            binary: qemu().into(),
            machine: "q35".into(),
            accel: Accel::detect().0,
            memory_mib,
            vcpus: 1,
            kernel: g.join("vmlinuz"),
            initrd: Some(g.join("initrd.img")),
            append: "console=ttyS0 quiet panic=-1 no_timer_check".into(),
            run_dir: PathBuf::from(format!("/tmp/bq-{}-{name}", std::process::id())),
            serial_log: serial.clone(),
            serial_log_max_bytes: 1 << 20,
            nics: Vec::new(),
            watchdog: false,
            heartbeat: Default::default(),
            ovmf_code: None,
            cpu: None,
            tap_nics: Vec::new(),
            max_bandwidth: 16 << 30,
            qmp_timeout: Duration::from_secs(30),
            disk_shape: vec![("data".into(), true)],
            devices: Default::default(),
            huge_pages: Default::default(),
            capture_order: Default::default(),
        };
        let mut backend = QemuBackend::new(cfg);
        backend
            .launch(
                &[DiskAttachment {
                    id: "data".into(),
                    active: active.clone(),
                    captured: true,
                }],
                BootMode::Cold,
            )
            .unwrap();
        let vm = Vm {
            backend,
            dir,
            serial,
            active,
            n: 0,
        };
        vm.wait_ticks(2, Duration::from_secs(90));
        vm
    }

    /// The guest's `BACKSTOP tick ram=<n>` counters so far (complete lines only).
    fn ticks(&self) -> Vec<u64> {
        let text = std::fs::read_to_string(&self.serial).unwrap_or_default();
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete
            .lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("BACKSTOP tick ram=")?;
                rest.split_whitespace().next()?.parse().ok()
            })
            .collect()
    }

    fn last_tick(&self) -> u64 {
        self.ticks().last().copied().unwrap_or(0)
    }

    /// Waits for `more` new ticks: the guest really runs.
    fn wait_ticks(&self, more: u64, timeout: Duration) {
        let from = self.last_tick();
        let deadline = Instant::now() + timeout;
        while self.last_tick() < from + more {
            assert!(
                Instant::now() < deadline,
                "the guest did not tick on within {timeout:?} (last {})",
                self.last_tick()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn status(&mut self) -> String {
        let s = self.backend.qmp_execute("query-status", None).unwrap();
        s["status"].as_str().unwrap().to_string()
    }

    /// One capture as the engine drives it: new overlay, begin, read the stream to its end,
    /// finish; on any error after begin, abort. Returns the pause or the error.
    fn snapshot(&mut self) -> Result<(u64, u64), BackendError> {
        self.snapshot_report()
            .map(|(report, bytes)| (report.pause_us, bytes))
    }

    /// [`Vm::snapshot`], with the backend's whole report.
    fn snapshot_report(&mut self) -> Result<(CaptureReport, u64), BackendError> {
        self.n += 1;
        let next = self.dir.path().join(format!("data-{}.qcow2", self.n));
        overlay(&self.active, &next);
        let stream = match self.backend.begin_capture(&[DiskSwitch {
            id: "data".into(),
            new_active: next.clone(),
        }]) {
            Ok(s) => s,
            Err(BackendError::SwitchedAfterResume) => {
                // The disks switched, the capture was discarded: the guest writes `next` now.
                self.active = next;
                return Err(BackendError::SwitchedAfterResume);
            }
            Err(e) => {
                if let BackendError::CaptureAfterSwitch(_) = e {
                    self.active = next;
                }
                return Err(e);
            }
        };
        self.active = next;
        let mut reader = stream.reader;
        let mut bytes = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => bytes += n as u64,
                Err(e) => panic!("reading the capture stream: {e}"),
            }
        }
        match self.backend.finish_capture() {
            Ok(report) => Ok((report, bytes)),
            Err(e) => {
                drop(reader);
                self.backend.abort_capture();
                Err(e)
            }
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.backend.terminate();
        let _ = std::fs::remove_dir_all(&self.backend.config().run_dir);
    }
}

#[test]
fn a_failure_at_any_capture_step_leaves_the_guest_running_and_the_next_snapshot_works() {
    if skip("a_failure_at_any_capture_step_leaves_the_guest_running") {
        return;
    }
    let mut vm = Vm::boot("faults");
    eprintln!("qemu: {:?}", vm.backend.capture_plan());
    for step in FaultStep::ALL {
        vm.backend.inject_fault(step);
        let r = vm.snapshot();
        let e = r.expect_err(&format!("{step:?}: the injected failure must surface"));
        assert!(
            e.to_string().contains("injected failure"),
            "{step:?}: unexpected error {e}"
        );
        assert_eq!(
            vm.status(),
            "running",
            "{step:?}: guest left {}",
            vm.status()
        );
        vm.wait_ticks(2, Duration::from_secs(30));
        let (pause_us, bytes) = vm
            .snapshot()
            .unwrap_or_else(|e| panic!("{step:?}: the snapshot after the failure failed: {e}"));
        assert!(
            pause_us > 0 && bytes > 1 << 20,
            "{step:?}: pause {pause_us} us, {bytes} bytes"
        );
        assert_eq!(vm.status(), "running", "{step:?}: after the good snapshot");
        vm.wait_ticks(1, Duration::from_secs(30));
        eprintln!("{step:?}: guest runs after the failure; next snapshot paused it {pause_us} us");
    }
}

/// The image files QEMU's block devices write to (their top layers), from `query-block`.
fn top_layers(vm: &mut Vm) -> Vec<String> {
    let blocks = vm.backend.qmp_execute("query-block", None).unwrap();
    blocks
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["inserted"]["file"].as_str().map(str::to_owned))
        .collect()
}

/// A `stop`-first capture writes `stop`, the disk switch and `migrate` to QEMU in one go. When
/// QEMU refuses the switch, it has already started the RAM capture behind it: that capture is
/// read out and discarded, the guest runs on its old top layer (nothing switched), and the next
/// snapshot works. A guest the operator paused stays paused through the same failure.
#[test]
fn a_disk_switch_qemu_refuses_after_stop_leaves_the_guest_on_its_disks_and_running() {
    let name = "a_disk_switch_qemu_refuses_after_stop_leaves_the_guest_on_its_disks_and_running";
    if skip(name) {
        return;
    }
    let mut vm = Vm::boot("refused");
    vm.backend
        .set_capture_order(backstop_qemu::version::CaptureOrder::StopFirst);
    for paused in [false, true] {
        if paused {
            vm.backend.pause().unwrap();
        }
        let before = vm.active.to_string_lossy().into_owned();
        assert!(top_layers(&mut vm).contains(&before));
        vm.backend.inject_fault(FaultStep::SwitchRejected);
        let e = vm
            .snapshot()
            .expect_err("QEMU refused the disk switch: the capture must fail");
        assert!(
            !matches!(
                e,
                BackendError::CaptureAfterSwitch(_) | BackendError::SwitchedAfterResume
            ),
            "paused={paused}: nothing switched, yet the error says so: {e}"
        );
        assert!(
            e.to_string().contains("backstop-no-such-node"),
            "paused={paused}: not QEMU's refusal: {e}"
        );
        assert_eq!(
            top_layers(&mut vm),
            std::slice::from_ref(&before),
            "paused={paused}: the guest must still write its old top layer"
        );
        let expected = if paused { "paused" } else { "running" };
        assert_eq!(vm.status(), expected, "paused={paused}: after the refusal");
        let (pause_us, bytes) = vm
            .snapshot()
            .unwrap_or_else(|e| panic!("paused={paused}: the snapshot after it failed: {e}"));
        assert!(bytes > 1 << 20, "paused={paused}: {bytes} bytes");
        assert_eq!(
            pause_us > 0,
            !paused,
            "paused={paused}: pause {pause_us} us"
        );
        assert_eq!(
            vm.status(),
            expected,
            "paused={paused}: after the good snapshot"
        );
        assert_ne!(top_layers(&mut vm), [before], "paused={paused}: switched");
        if !paused {
            vm.wait_ticks(2, Duration::from_secs(30));
        }
    }
}

#[test]
fn a_guest_paused_by_the_operator_stays_paused_through_snapshots() {
    if skip("a_guest_paused_by_the_operator_stays_paused_through_snapshots") {
        return;
    }
    let mut vm = Vm::boot("paused");
    vm.backend.pause().unwrap();
    assert_eq!(vm.status(), "paused");
    std::thread::sleep(Duration::from_millis(500));
    let frozen = vm.last_tick();
    for i in 0..2 {
        let (pause_us, bytes) = vm.snapshot().unwrap();
        assert!(bytes > 1 << 20);
        assert_eq!(pause_us, 0, "no pause of ours on a paused guest");
        assert_eq!(
            vm.status(),
            "paused",
            "snapshot {i} resumed the operator's paused guest"
        );
    }
    // A failed capture does not resume it either.
    vm.backend.inject_fault(FaultStep::AfterMigrate);
    assert!(vm.snapshot().is_err());
    assert_eq!(
        vm.status(),
        "paused",
        "a failed capture resumed the paused guest"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        vm.last_tick() <= frozen + 1,
        "the paused guest ticked on: {frozen} -> {}",
        vm.last_tick()
    );
    vm.backend.resume().unwrap();
    assert_eq!(vm.status(), "running");
    vm.wait_ticks(2, Duration::from_secs(30));
}

#[test]
fn many_snapshots_on_one_qemu_instance() {
    if skip("many_snapshots_on_one_qemu_instance") {
        return;
    }
    let mut vm = Vm::boot("many");
    for i in 0..5 {
        let (pause_us, _) = vm
            .snapshot()
            .unwrap_or_else(|e| panic!("snapshot {i} on the same QEMU failed: {e}"));
        eprintln!("snapshot {i}: pause {pause_us} us");
        assert_eq!(vm.status(), "running");
    }
    vm.wait_ticks(1, Duration::from_secs(30));
}

/// The phases of a capture's pause, in order.
fn phases(report: &CaptureReport) -> Vec<&str> {
    report
        .pause_breakdown
        .iter()
        .map(|(phase, _)| phase.as_str())
        .collect()
}

/// On QEMU ≥ 9.0, once a QEMU has taken one snapshot, `migrate` goes in before `stop` (QEMU
/// pre-faults guest RAM while the guest still runs): the pause has no `migrate` phase. A lead
/// so long that QEMU's own stop comes first is caught, that capture discarded and taken again
/// with `stop` first; the guest runs on through all of it. On 7.2/8.x `stop` always comes first.
#[test]
fn migrate_goes_in_before_stop_on_qemus_that_keep_a_stopped_guest_stopped() {
    if skip("migrate_goes_in_before_stop_on_qemus_that_keep_a_stopped_guest_stopped") {
        return;
    }
    // 1 GiB, the size the pause goal is set for: QEMU's pre-fault of guest RAM takes long
    // enough there for a lead (at 256 MiB it is ~2 ms).
    let mut vm = Vm::boot_with("lead", 1024);
    let keeps_stopped =
        vm.backend.capture_plan().unwrap().resume == backstop_qemu::Resume::AfterWriteTracking;
    let (first, _) = vm.snapshot_report().unwrap();
    assert!(
        phases(&first).contains(&"migrate"),
        "the first capture on a QEMU has no lead yet: {:?}",
        first.pause_breakdown
    );
    // Whatever lead it learnt (none for a guest this idle: its setup is a few ms, see
    // `version::SetupTimes`), each capture is whole and the guest runs on.
    let mut early = 0;
    for i in 0..2 {
        let (report, bytes) = vm.snapshot_report().unwrap();
        let p = phases(&report);
        eprintln!(
            "learnt lead, snapshot {i}: pause {} us {:?}, lost so far {}",
            report.pause_us,
            report.pause_breakdown,
            vm.backend.lost_races()
        );
        assert!(bytes > 1 << 20 && report.pause_us > 0);
        assert_eq!(p.first(), Some(&"stop"), "{p:?}");
        assert_eq!(p.last(), Some(&"resume"), "{p:?}");
        if !p.contains(&"migrate") {
            early += 1;
        }
        assert_eq!(vm.status(), "running");
    }
    if !keeps_stopped {
        // Even with a lead forced on it, a 7.2/8.x QEMU gets `stop` first.
        vm.backend.force_migrate_lead(Some(Duration::ZERO));
        let (report, _) = vm.snapshot_report().unwrap();
        assert!(
            phases(&report).contains(&"migrate"),
            "{:?}",
            report.pause_breakdown
        );
        assert_eq!(
            early, 0,
            "7.2/8.x resume the guest themselves: stop must come first"
        );
        assert_eq!(vm.backend.lost_races(), 0);
        assert!(
            vm.backend
                .status_details()
                .get("capture_migrate_first")
                .is_none(),
            "no migrate-first status on a QEMU that never does it"
        );
        return;
    }
    // `stop` written right behind `migrate`: usually before QEMU's pre-fault of 1 GiB is done.
    // QEMU sends STOP only once the vCPU has stopped, which under TCG can come after `active`
    // (then counted as lost, safely): so up to five tries for one capture in that order.
    vm.backend.force_migrate_lead(Some(Duration::ZERO));
    let mut early = 0;
    for i in 0..5 {
        let lost_before = vm.backend.lost_races();
        let (report, _) = vm.snapshot_report().unwrap();
        eprintln!(
            "no lead, snapshot {i}: pause {} us {:?}",
            report.pause_us, report.pause_breakdown
        );
        // Each capture either went in `migrate` first, or lost and was taken `stop` first.
        let lost = vm.backend.lost_races() - lost_before;
        assert_eq!(
            phases(&report).contains(&"migrate"),
            lost == 1,
            "lost {lost}: {:?}",
            report.pause_breakdown
        );
        if lost == 0 {
            early += 1;
            break;
        }
    }
    assert_eq!(
        early, 1,
        "stop right behind migrate lost to QEMU's stop 5 times"
    );
    // QEMU's setup takes tens of ms: a 3 s lead always lets QEMU's own stop come first.
    let lost_before = vm.backend.lost_races();
    vm.backend.force_migrate_lead(Some(Duration::from_secs(3)));
    // The discarded capture is read out 2 s late (a large guest's drain on a slow host): the
    // guest must run meanwhile, not wait for it.
    vm.backend.slow_discard(Duration::from_secs(2));
    let ticks_before = vm.last_tick();
    let (report, bytes) = vm
        .snapshot_report()
        .expect("a lost race is taken again, stop first");
    assert_eq!(vm.backend.lost_races(), lost_before + 1);
    // `status --json` shows it (backend_details).
    let details = vm.backend.status_details();
    assert_eq!(
        details["capture_migrate_first"]["races_lost"],
        vm.backend.lost_races(),
        "{details:?}"
    );
    assert_eq!(
        details["capture_migrate_first"]["lead_ms"], 3000.0,
        "{details:?}"
    );
    let lost_stop = details["capture_migrate_first"]["last_lost_stop_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("no last_lost_stop_ms after a lost race: {details:?}"));
    assert!(
        lost_stop < 1000.0,
        "the lost race kept the guest stopped {lost_stop} ms: it must run again before the \
         discarded capture is read out (2 s late here)"
    );
    vm.backend.slow_discard(Duration::ZERO);
    assert!(
        phases(&report).contains(&"migrate"),
        "the capture taken again sends stop first: {:?}",
        report.pause_breakdown
    );
    assert!(bytes > 1 << 20 && report.pause_us > 0);
    assert_eq!(vm.status(), "running", "after a lost race");
    assert!(
        vm.last_tick() > ticks_before,
        "the guest ran through the 3 s lead"
    );
    vm.wait_ticks(2, Duration::from_secs(30));
}

/// `vm.capture_order = "migrate-first"` on a QEMU whose snapshot thread resumes the guest by
/// itself (7.2/8.x): `migrate` goes in before `stop` there too (the pause loses QEMU's
/// pre-fault of guest RAM), and a capture whose disk switch was done only after QEMU's own
/// resume is no snapshot: it is discarded with `SwitchedAfterResume` (the disks stay
/// switched, the guest runs on), and the next capture goes `stop` first. On ≥ 9.0 the order
/// changes nothing (`auto` sends `migrate` first there already; the test above).
#[test]
fn migrate_first_on_a_qemu_that_resumes_by_itself_discards_a_switch_after_that_resume() {
    let name = "migrate_first_on_a_qemu_that_resumes_by_itself_discards_a_switch_after_that_resume";
    if skip(name) {
        return;
    }
    let mut vm = Vm::boot_with("order", 1024);
    let plan = vm.backend.capture_plan().unwrap();
    if plan.resume != backstop_qemu::Resume::ByQemu {
        eprintln!(
            "SKIPPED {name}: QEMU {} keeps a stopped guest stopped (the test above covers it)",
            plan.version
        );
        return;
    }
    vm.backend
        .set_capture_order(backstop_qemu::version::CaptureOrder::MigrateFirst);
    let (first, _) = vm.snapshot_report().unwrap();
    assert!(
        phases(&first).contains(&"migrate"),
        "the first capture on a QEMU has no lead yet: {:?}",
        first.pause_breakdown
    );
    assert!(
        vm.backend
            .status_details()
            .get("capture_migrate_first")
            .is_some(),
        "migrate-first status on 7.2/8.x once the order allows it"
    );
    // `stop` right behind `migrate`: up to five tries for one capture in that order (a `stop`
    // whose STOP came after QEMU's `active` counts as lost and is taken again, `stop` first).
    vm.backend.force_migrate_lead(Some(Duration::ZERO));
    let mut early = None;
    for i in 0..5 {
        let lost_before = vm.backend.lost_races();
        let (report, bytes) = match vm.snapshot_report() {
            Err(BackendError::SwitchedAfterResume) => {
                // On a loaded host backstop's switch can come after QEMU's own resume even with
                // no lead (seen in CI): discarded, and the next capture goes `stop` first.
                assert_eq!(vm.backend.lost_races(), lost_before + 1);
                let (report, _) = vm.snapshot_report().unwrap();
                eprintln!(
                    "no lead, snapshot {i}: switched after QEMU's resume, discarded; then {:?}",
                    report.pause_breakdown
                );
                assert!(
                    phases(&report).contains(&"migrate"),
                    "{:?}",
                    report.pause_breakdown
                );
                continue;
            }
            r => r.unwrap(),
        };
        let lost = vm.backend.lost_races() - lost_before;
        eprintln!(
            "no lead, snapshot {i}: pause {} us {:?}, lost {lost}",
            report.pause_us, report.pause_breakdown
        );
        assert!(bytes > 1 << 20 && report.pause_us > 0);
        assert_eq!(
            phases(&report).contains(&"migrate"),
            lost == 1,
            "lost {lost}: {:?}",
            report.pause_breakdown
        );
        assert_eq!(vm.status(), "running");
        if lost == 0 {
            early = Some(report);
            break;
        }
    }
    let early = early.expect("no capture of 5 with stop right behind migrate was kept");
    // QEMU's own device save, write-protection start and resume end the pause.
    assert_eq!(
        phases(&early).last(),
        Some(&"resume"),
        "{:?}",
        early.pause_breakdown
    );
    // A switch held back 1.5 s after a `stop` that won: QEMU's thread resumes the guest long
    // before it. That capture must not be kept.
    vm.backend.delay_switch(Duration::from_millis(1500));
    let ticks_before = vm.last_tick();
    let mut discarded = false;
    for i in 0..5 {
        let lost_before = vm.backend.lost_races();
        match vm.snapshot_report() {
            Err(BackendError::SwitchedAfterResume) => {
                assert_eq!(vm.backend.lost_races(), lost_before + 1);
                discarded = true;
                break;
            }
            Ok((report, _)) => {
                // Only a lost race (QEMU's stop first, taken again `stop` first) is kept.
                assert_eq!(
                    vm.backend.lost_races(),
                    lost_before + 1,
                    "try {i}: a capture switched 1.5 s after its stop was kept: {:?}",
                    report.pause_breakdown
                );
                assert!(phases(&report).contains(&"migrate"));
            }
            Err(e) => panic!("try {i}: {e}"),
        }
    }
    assert!(discarded, "no capture won its race in 5 tries");
    assert_eq!(vm.status(), "running", "after a discarded capture");
    assert!(
        vm.last_tick() > ticks_before,
        "the guest ran while the switch was held back (QEMU resumed it)"
    );
    // The next capture goes `stop` first whatever the lead, and works on the switched disk.
    let (report, bytes) = vm
        .snapshot_report()
        .expect("the capture after a discarded one");
    assert!(
        phases(&report).contains(&"migrate"),
        "taken again with stop first: {:?}",
        report.pause_breakdown
    );
    assert!(bytes > 1 << 20 && report.pause_us > 0);
    vm.backend.delay_switch(Duration::ZERO);
    vm.backend.force_migrate_lead(None);
    vm.snapshot().expect("a stop-first snapshot afterwards");
    assert_eq!(vm.status(), "running");
    vm.wait_ticks(2, Duration::from_secs(30));
}

/// The CPU time of QEMU's background-snapshot thread (named through `-name ...,debug-threads=on`)
/// is read while its setup runs, on both QEMUs: after a few captures `status` shows what the
/// setups cost in CPU and the share of it the next capture lets pass before `stop`, and captures
/// sent `migrate` first by that measure are whole (each either won or was taken again).
#[test]
fn the_snapshot_threads_cpu_time_is_learnt_and_times_the_stop() {
    if skip("the_snapshot_threads_cpu_time_is_learnt_and_times_the_stop") {
        return;
    }
    let mut vm = Vm::boot_with("cpu", 1024);
    // `migrate` may go first on every version (on ≥ 9.0 that is the default anyway).
    vm.backend
        .set_capture_order(backstop_qemu::version::CaptureOrder::MigrateFirst);
    // A setup is learnt when a reading of the thread's CPU came within 1 ms before `active`
    // (a loaded host starves the reader too): until two are, up to eight captures.
    let learnt = |vm: &Vm| -> Vec<f64> {
        vm.backend.status_details()["capture_migrate_first"]["setup_cpu_ms"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default()
    };
    for i in 0..8 {
        let (report, bytes) = match vm.snapshot_report() {
            Err(BackendError::SwitchedAfterResume) => vm.snapshot_report().unwrap(),
            r => r.unwrap(),
        };
        eprintln!(
            "snapshot {i}: {:?}, learnt {:?}",
            report.pause_breakdown,
            learnt(&vm)
        );
        assert!(bytes > 1 << 20);
        if learnt(&vm).len() >= 2 {
            break;
        }
    }
    let details = vm.backend.status_details();
    let m = &details["capture_migrate_first"];
    let cpu = learnt(&vm);
    // The QEMU's first capture is not counted.
    assert!(cpu.len() >= 2, "{m}");
    assert!(
        cpu.iter().all(|&c| (0.0..2000.0).contains(&c)),
        "QEMU's snapshot thread used {cpu:?} ms of CPU in its setups"
    );
    let target = m["stop_at_cpu_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("no stop_at_cpu_ms after two setups: {m}"));
    let least = cpu.iter().copied().fold(f64::MAX, f64::min);
    assert!((0.0..=least).contains(&target), "{target} of {cpu:?}");
    // `stop` goes early enough for QEMU to act on it before the least setup's CPU is used:
    // the longest recent time from backstop's `stop` to QEMU's STOP is allowed for.
    let floats = |key: &str| -> Vec<f64> {
        m[key]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default()
    };
    let latencies = floats("stop_latency_ms");
    assert!(
        !latencies.is_empty() && latencies.iter().all(|&l| (0.0..1000.0).contains(&l)),
        "{m}"
    );
    let led = floats("setup_cpu_led_ms");
    let basis = if led.len() >= 2 { &led } else { &cpu };
    let least_basis = basis.iter().copied().fold(f64::MAX, f64::min);
    let longest = latencies.iter().copied().fold(0.0, f64::max);
    // Figures are rounded to tenths of a ms.
    assert!(
        target <= (least_basis - longest).max(0.0) + 0.15,
        "stop at {target} ms of CPU, least setup {least_basis}, longest stop latency {longest}: {m}"
    );
    for i in 0..3 {
        let lost_before = vm.backend.lost_races();
        // As the engine does: a capture whose switch came after QEMU 7.2's own resume (a loaded
        // host) is taken again at once, `stop` first.
        let (report, bytes) = match vm.snapshot_report() {
            Err(BackendError::SwitchedAfterResume) => vm.snapshot_report().unwrap(),
            r => r.unwrap(),
        };
        let lost = vm.backend.lost_races() - lost_before;
        eprintln!(
            "by CPU, snapshot {i}: pause {} us {:?}, lost {lost}, {}",
            report.pause_us,
            report.pause_breakdown,
            vm.backend.status_details()["capture_migrate_first"]
        );
        assert!(bytes > 1 << 20 && report.pause_us > 0);
        assert_eq!(vm.status(), "running");
    }
    vm.wait_ticks(2, Duration::from_secs(30));
}
