//! The libvirt backend end to end: a real libvirtd (scripts/setup-libvirt.sh), the test guest
//! defined and started with `virsh`, a real backstopd (built with `--features libvirt`) adopting
//! it, a snapshot, the guest moving on, a rollback, and the guest's own serial output.
//!
//! Skips loudly when libvirt is not usable here; with `BACKSTOP_REQUIRE_LIBVIRT=1` that fails.
//! Background snapshots need `vm.unprivileged_userfaultfd=1` for libvirt's unprivileged QEMU:
//! the tests set it and put the old value back.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use backstop_e2e::{bin, disk_sector0, guest_dir, parse_ticks, Daemon, Tick};
use serde_json::Value;

const TEMPLATE: &str =
    include_str!("../../crates/backstop-libvirt/tests/fixtures/test-guest-domain.xml");
const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(90);

fn virsh(args: &[&str]) -> Output {
    Command::new("nice")
        .args(["-n", "10", "virsh", "-c", "qemu:///system"])
        .args(args)
        .output()
        .unwrap()
}

fn virsh_text(args: &[&str]) -> String {
    let o = virsh(args);
    assert!(o.status.success(), "virsh {args:?}: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// Why the libvirt tests cannot run here, if they cannot.
fn libvirt_missing() -> Option<String> {
    if !guest_dir().join("vmlinuz").exists() {
        return Some("test guest missing (run scripts/setup.sh)".into());
    }
    match Command::new("virsh")
        .args(["-c", "qemu:///system", "version"])
        .output()
    {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Some(format!(
                "libvirtd does not answer on qemu:///system (run scripts/setup-libvirt.sh): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
        Err(_) => return Some("virsh not installed (run scripts/setup-libvirt.sh)".into()),
    }
    if !bin("backstopd").exists() || !bin("backstop").exists() {
        return Some("backstopd/backstop not built".into());
    }
    // A backstopd built without the feature refuses the config at load, naming it.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        config(
            &dir.path().join("s"),
            &dir.path().join("r"),
            "x",
            "",
            Path::new("/tmp/x"),
        ),
    )
    .unwrap();
    let o = Command::new(bin("backstopd"))
        .arg("--check-config")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    if out.contains("without the libvirt backend") {
        return Some("backstopd was built without `--features libvirt`".into());
    }
    if let Err(why) = libvirt_emulator() {
        return Some(why);
    }
    None
}

fn skip_unless_libvirt(test: &str) -> bool {
    match libvirt_missing() {
        None => false,
        Some(why) if std::env::var("BACKSTOP_REQUIRE_LIBVIRT").as_deref() == Ok("1") => {
            panic!("{test}: BACKSTOP_REQUIRE_LIBVIRT=1 but {why}")
        }
        Some(why) => {
            eprintln!("SKIPPED {test}: {why}");
            true
        }
    }
}

fn config(state: &Path, run: &Path, domain: &str, extra_libvirt: &str, layers: &Path) -> String {
    format!(
        r#"[daemon]
state_dir = "{state}"
run_dir = "{run}"

[vm]
name = "lv"
backend = "libvirt"

[vm.libvirt]
uri = "qemu:///system"
domain = "{domain}"
layers_dir = "{layers}"
{extra_libvirt}

[watchdog]
heartbeat_timeout_s = 30
boot_grace_s = 120
"#,
        state = state.display(),
        run = run.display(),
        layers = layers.display(),
    )
}

/// Sets `vm.unprivileged_userfaultfd` and puts the old value back on drop.
///
/// The sysctl is one value for the whole host while the tests of this file run in parallel:
/// the guard holds a process-wide lock for as long as it lives, so a test that needs 0 waits
/// for the one that needs 1 (without it, the "refused without userfaultfd" check set 0 in the
/// middle of the other test's adoption: a CI failure).
struct Uffd {
    old: String,
    _held: std::sync::MutexGuard<'static, ()>,
}
static UFFD_SYSCTL: std::sync::Mutex<()> = std::sync::Mutex::new(());
impl Uffd {
    fn set(v: &str) -> Uffd {
        let held = UFFD_SYSCTL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let p = "/proc/sys/vm/unprivileged_userfaultfd";
        let old = std::fs::read_to_string(p).unwrap().trim().to_string();
        std::fs::write(p, v).unwrap();
        Uffd { old, _held: held }
    }
}
impl Drop for Uffd {
    fn drop(&mut self) {
        // Runs before the fields drop: the old value is back before the lock is released.
        let _ = std::fs::write("/proc/sys/vm/unprivileged_userfaultfd", &self.old);
    }
}

/// The tests of this file share one libvirtd; the one that restarts it holds this exclusively.
static LIBVIRTD: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn libvirtd_shared() -> std::sync::RwLockReadGuard<'static, ()> {
    LIBVIRTD.read().unwrap_or_else(|p| p.into_inner())
}

/// Where scripts/setup-libvirt.sh publishes the QEMU 10 of scripts/setup.sh for libvirt: its
/// QEMU runs as `libvirt-qemu`, which cannot traverse /root/.cache.
const LIBVIRT_QEMU10: &str = "/var/lib/backstop-qemu10/bin/qemu-system-x86_64";

/// `M.m.u` from a QEMU's `--version` ("QEMU emulator version 10.0.2 (Debian ...)").
fn version_of(out: &[u8]) -> Option<String> {
    String::from_utf8_lossy(out)
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .map(str::to_string)
}

/// The emulator this pass runs the test domains on, and its version. `BACKSTOP_QEMU` unset:
/// `None`, the template's (the system QEMU). Set (scripts/test.sh's second pass: the QEMU 10
/// wrapper): a wrapper of the same version that libvirt's `libvirt-qemu` user can run —
/// `BACKSTOP_LIBVIRT_QEMU`, `BACKSTOP_QEMU` itself, or the copy scripts/setup-libvirt.sh
/// publishes — or why there is none.
fn libvirt_emulator() -> Result<Option<(PathBuf, String)>, String> {
    static PICKED: std::sync::OnceLock<Result<Option<(PathBuf, String)>, String>> =
        std::sync::OnceLock::new();
    PICKED
        .get_or_init(|| {
            let Ok(wanted) = std::env::var("BACKSTOP_QEMU") else {
                return Ok(None);
            };
            let version = Command::new(&wanted)
                .arg("--version")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| version_of(&o.stdout))
                .ok_or_else(|| format!("BACKSTOP_QEMU={wanted} does not run"))?;
            let mut tried = Vec::new();
            let candidates = std::env::var("BACKSTOP_LIBVIRT_QEMU")
                .into_iter()
                .chain([wanted.clone(), LIBVIRT_QEMU10.to_string()]);
            for c in candidates {
                let o = Command::new("runuser")
                    .args(["-u", "libvirt-qemu", "--", &c, "--version"])
                    .output();
                let got = o
                    .ok()
                    .filter(|o| o.status.success())
                    .and_then(|o| version_of(&o.stdout));
                if got.as_deref() == Some(version.as_str()) {
                    return Ok(Some((PathBuf::from(c), version)));
                }
                tried.push(format!("{c}: {got:?}"));
            }
            Err(format!(
                "BACKSTOP_QEMU={wanted} is QEMU {version}, but no wrapper of it that libvirt's \
                 libvirt-qemu user can run (tried {}; run scripts/setup-libvirt.sh after \
                 scripts/setup.sh)",
                tried.join(", ")
            ))
        })
        .clone()
}

/// The domain XML on the emulator under test (see [`libvirt_emulator`]); unchanged without
/// `BACKSTOP_QEMU`.
fn on_emulator_under_test(xml: String) -> String {
    let Ok(Some((emulator, _))) = libvirt_emulator() else {
        return xml;
    };
    let (Some(a), Some(b)) = (xml.find("<emulator>"), xml.find("</emulator>")) else {
        panic!("no <emulator> in the domain XML");
    };
    format!("{}<emulator>{}{}", &xml[..a], emulator.display(), &xml[b..])
}

impl TestDomain {
    /// The running QEMU's own version (`query-version` through libvirt), `M.m.u`.
    fn qemu_version(&self) -> String {
        let out = virsh_text(&[
            "qemu-monitor-command",
            &self.name,
            r#"{"execute":"query-version"}"#,
        ]);
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        let q = &v["return"]["qemu"];
        format!("{}.{}.{}", q["major"], q["minor"], q["micro"])
    }

    /// Prints which QEMU the domain runs on and checks it is the one under test.
    fn check_qemu(&self) {
        let running = self.qemu_version();
        let emulator = libvirt_emulator().unwrap();
        eprintln!(
            "domain {} runs on QEMU {running} ({})",
            self.name,
            emulator
                .as_ref()
                .map_or("the template's emulator".to_string(), |e| e
                    .0
                    .display()
                    .to_string())
        );
        if let Some((_, wanted)) = emulator {
            assert_eq!(running, wanted, "the domain runs the QEMU under test");
        }
    }

    /// Disk `vda`'s top layer in QEMU's own view (`query-block`).
    fn qmp_vda_top(&self) -> String {
        let out = virsh_text(&[
            "qemu-monitor-command",
            &self.name,
            r#"{"execute":"query-block"}"#,
        ]);
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        let disks: Vec<&Value> = v["return"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["inserted"].is_object())
            .collect();
        assert_eq!(disks.len(), 1, "one disk in the test domain: {v}");
        disks[0]["inserted"]["file"].as_str().unwrap().to_string()
    }
}

/// A domain of the test guest defined and started with virsh; destroyed and undefined on drop.
struct TestDomain {
    name: String,
    dir: PathBuf,
}

impl TestDomain {
    /// `edit` changes the domain XML before `virsh define`.
    fn start(name: &str, edit: &dyn Fn(String) -> String) -> TestDomain {
        let name = format!("{name}-{}", std::process::id());
        let root = Path::new("/var/lib/backstop-lvtest");
        let dir = root.join(&name);
        let _ = virsh(&["destroy", &name]);
        let _ = virsh(&["undefine", &name]);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for d in [root, dir.as_path()] {
            Command::new("chmod").arg("755").arg(d).status().unwrap();
        }
        let g = guest_dir();
        for f in ["vmlinuz", "initrd.img"] {
            std::fs::copy(g.join(f), dir.join(f)).unwrap();
        }
        std::fs::copy(g.join("disk-base.qcow2"), dir.join("base.qcow2")).unwrap();
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(dir.join("base.qcow2"))
            .arg(dir.join("disk.qcow2"))
            .status()
            .unwrap();
        assert!(st.success());
        let xml = edit(
            TEMPLATE
                .replace("@NAME@", &name)
                .replace("@DIR@", dir.to_str().unwrap())
                .replace("@MEM_MIB@", "256")
                .replace("@CMDLINE@", "console=ttyS0 quiet panic=-1 no_timer_check"),
        );
        let xml = on_emulator_under_test(xml);
        std::fs::write(dir.join("domain.xml"), xml).unwrap();
        let dom = TestDomain { name, dir };
        virsh_text(&["define", dom.dir.join("domain.xml").to_str().unwrap()]);
        virsh_text(&["start", &dom.name]);
        dom.check_qemu();
        dom.renice();
        dom
    }

    fn pid(&self) -> u32 {
        std::fs::read_to_string(format!("/run/libvirt/qemu/{}.pid", self.name))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The machine is shared: libvirt's QEMU runs at nice 10 like all the tests start.
    fn renice(&self) {
        let _ = Command::new("renice")
            .args(["-n", "10", "-p", &self.pid().to_string()])
            .output();
    }

    fn serial(&self) -> String {
        std::fs::read_to_string(self.dir.join("serial.log")).unwrap_or_default()
    }

    fn wait_ticks(&self, from: usize, what: &str, done: impl Fn(&[Tick]) -> bool) -> Vec<Tick> {
        let end = Instant::now() + BOOT;
        loop {
            let text = self.serial();
            let t = parse_ticks(&text[from.min(text.len())..]);
            if done(&t) {
                return t;
            }
            assert!(Instant::now() < end, "{what}: serial:\n{text}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn layers(&self) -> PathBuf {
        self.dir.join("layers")
    }
}

impl Drop for TestDomain {
    fn drop(&mut self) {
        let _ = virsh(&["destroy", &self.name]);
        let _ = virsh(&["undefine", &self.name]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn events<'a>(journal: &'a [Value], name: &str) -> Vec<&'a Value> {
    journal.iter().filter(|e| e["event"] == name).collect()
}

#[test]
fn libvirt_adopt_snapshot_rollback_keeps_name_uuid_and_one_instant() {
    let test = "libvirt_adopt_snapshot_rollback_keeps_name_uuid_and_one_instant";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid_before = dom.pid();
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();

    let layers = dom.layers();
    let (name, l2) = (dom.name.clone(), layers.clone());
    let mut d = Daemon::prepare_custom(
        "lv-adopt",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();

    // Adopted, not restarted: same QEMU, versions and capture mode journaled.
    let adopted =
        d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted")["fields"].clone();
    eprintln!("vm.adopted: {adopted}");
    assert_eq!(adopted["pid"], pid_before, "{adopted}");
    assert_eq!(adopted["uuid"], uuid.as_str());
    assert_eq!(adopted["domain"], dom.name.as_str());
    assert_eq!(adopted["capture_mode"], "bg");
    assert!(
        adopted["libvirt_version"]
            .as_str()
            .unwrap()
            .starts_with("9."),
        "{adopted}"
    );
    assert!(!adopted["qemu_version"].as_str().unwrap().is_empty());
    assert_eq!(
        adopted["qemu_version"],
        dom.qemu_version().as_str(),
        "vm.adopted journals the adopted QEMU's version"
    );
    assert_eq!(
        dom.pid(),
        pid_before,
        "the same QEMU process after adoption"
    );
    let baseline = d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let snaps = d.ok(&["snapshot", "list"]);
    assert_eq!(snaps["snapshots"].as_array().unwrap().len(), 1, "{snaps}");
    assert_eq!(
        snaps["snapshots"][0]["snapshot_id"], baseline["fields"]["snapshot_id"],
        "the baseline is listed"
    );
    assert_eq!(dom.pid(), pid_before, "the baseline snapshot kept the QEMU");

    // A snapshot: libvirt's own view follows the new top layer, the capability is off again.
    let v = d.ok(&["snapshot", "create", "--reason", "before the change"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let completed = d.wait_journal(STEP, "snapshot completed", |e| {
        e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == id.as_str()
    });
    eprintln!(
        "snapshot {id}: pause_us {}",
        completed["fields"]["pause_us"]
    );
    let show = d.ok(&["snapshot", "show", &id]);
    let refs = show["manifest"]["payload_refs"].as_array().unwrap();
    let chain = refs
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain" && p["name"] == "disk:vda")
        .unwrap_or_else(|| panic!("vda in the manifest: {show}"));
    let frozen_top = PathBuf::from(
        chain["layers"].as_array().unwrap().last().unwrap()["path"]
            .as_str()
            .unwrap(),
    );
    let snap_disk = disk_sector0(&frozen_top);
    assert!(snap_disk > 0);
    let blk = virsh_text(&["domblklist", &dom.name]);
    let live_top = blk
        .lines()
        .find_map(|l| l.trim().strip_prefix("vda"))
        .unwrap()
        .trim()
        .to_string();
    assert!(live_top.starts_with(layers.to_str().unwrap()), "{blk}");
    assert!(
        virsh_text(&["dumpxml", "--inactive", &dom.name]).contains(&live_top),
        "the persistent definition names the new top too"
    );
    let caps = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"query-migrate-capabilities"}"#,
    ]);
    assert!(
        caps.contains(r#"{"state":false,"capability":"background-snapshot"}"#),
        "{caps}"
    );
    assert_eq!(
        virsh_text(&["snapshot-list", "--name", &dom.name]).trim(),
        "",
        "no libvirt snapshot metadata (NO_METADATA)"
    );

    // The guest moves on; then the rollback.
    dom.wait_ticks(0, "guest moving on", |t| {
        t.last().is_some_and(|t| t.ram >= snap_disk + 5)
    });
    let before = dom.serial().len();
    let started = Instant::now();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: undo the change"]);
    eprintln!(
        "rollback in {:?}: phases {}",
        started.elapsed(),
        rb["phases"]
    );
    assert_eq!(rb["snapshot_id"], id.as_str());
    dom.renice();
    let after = dom.wait_ticks(before, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<Tick> = after
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    eprintln!("snapshot disk {snap_disk}; first ticks after rollback {restored:?}");
    assert_eq!(
        restored[0].ram, restored[0].disk,
        "RAM and disk at one instant"
    );
    assert!(
        restored[0].ram == snap_disk || restored[0].ram == snap_disk + 1,
        "at the snapshot point: {restored:?} vs {snap_disk}"
    );

    // Same name and UUID in libvirt, a new QEMU, the persistent definition on the new chain.
    let info = virsh_text(&["dominfo", &dom.name]);
    assert!(info.contains(&uuid), "{info}");
    assert!(info.contains(&dom.name), "{info}");
    assert_ne!(dom.pid(), pid_before, "a fresh QEMU");
    dom.check_qemu();
    let top_now = virsh_text(&["domblklist", &dom.name]);
    let top_now = top_now
        .lines()
        .find_map(|l| l.trim().strip_prefix("vda"))
        .unwrap()
        .trim()
        .to_string();
    assert_ne!(top_now, live_top, "fresh overlay");
    assert!(virsh_text(&["dumpxml", "--inactive", &dom.name]).contains(&top_now));
    let j = d.journal();
    assert_eq!(events(&j, "rollback.completed").len(), 1);
    d.ok(&["audit", "verify"]);
    // A clean stop of the daemon leaves the operator's domain running, on the same QEMU.
    let pid_restored = dom.pid();
    let epoch_before = d.status()["epoch"].clone();
    d.stop();
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    assert_eq!(
        dom.pid(),
        pid_restored,
        "stopping backstopd did not end the domain"
    );
    let stopped = d.journal();
    let stopped = events(&stopped, "daemon.stopped");
    assert_eq!(stopped.last().unwrap()["fields"]["vm_left_running"], true);

    // The next start adopts the still-running domain again and, finding it as the clean stop
    // left it (same UUID, QEMU process, block graph, epoch), re-attaches to it as it runs: no
    // rollback, the epoch unchanged, the guest's writes since the newest snapshot kept.
    let last_before = parse_ticks(&dom.serial()).last().copied().unwrap();
    let rollbacks_before = events(&d.journal(), "rollback.completed").len();
    d.launch();
    let re = d.wait_journal(STEP, "re-attached after a clean stop", |e| {
        e["event"] == "vm.reattached"
    });
    eprintln!("after restart: {}", re["fields"]);
    assert_eq!(
        re["fields"]["compared"]["pid"], pid_restored,
        "{}",
        re["fields"]
    );
    assert_eq!(re["fields"]["compared"]["uuid"], uuid.as_str());
    let j = d.journal();
    let adoptions = events(&j, "vm.adopted");
    assert_eq!(adoptions.len(), 2, "journaled at each adoption");
    assert_eq!(adoptions[1]["fields"]["pid"], pid_restored);
    assert_eq!(dom.pid(), pid_restored, "the same QEMU after the restart");
    assert_eq!(d.status()["epoch"], epoch_before, "epoch unchanged");
    assert_eq!(
        events(&j, "rollback.completed").len(),
        rollbacks_before,
        "no rollback at a clean restart"
    );
    let from = dom.serial().len();
    let on = dom.wait_ticks(from, "guest running on after the restart", |t| t.len() >= 2);
    assert!(
        on[0].disk >= last_before.disk && on[0].ram >= last_before.ram,
        "the guest went on from where it was ({last_before:?} then {on:?})"
    );

    // A crash of backstopd (kill -9) leaves no such record: the next start takes the
    // fail-closed way, back to the newest verified snapshot, keeping name and UUID.
    d.kill9();
    let before = dom.serial().len();
    d.launch();
    let rb2 = d.wait_journal(STEP, "rollback after a crash", |e| {
        e["event"] == "rollback.completed" && e["fields"]["rollback_type"] == "emergency"
    });
    eprintln!("after a crash: {}", rb2["fields"]);
    let started = d.wait_journal(STEP, "the crash's window journaled", |e| {
        e["event"] == "rollback.completed" && e.to_string().contains("ran unwatched since")
    });
    eprintln!("journaled with the window: {}", started["fields"]);
    dom.renice();
    let again = dom.wait_ticks(before, "guest after the restart rollback", |t| t.len() >= 2);
    assert_eq!(again[0].ram, again[0].disk, "{again:?}");
    assert!(virsh_text(&["dominfo", &dom.name]).contains(&uuid));
    let top_now = virsh_text(&["domblklist", &dom.name])
        .lines()
        .find_map(|l| l.trim().strip_prefix("vda").map(|p| p.trim().to_string()))
        .unwrap();
    d.kill9();
    // A cold start by the operator boots the restored chain (the persistent definition).
    virsh_text(&["destroy", &dom.name]);
    virsh_text(&["start", &dom.name]);
    dom.renice();
    let cold = virsh_text(&["domblklist", &dom.name]);
    assert!(
        cold.contains(&top_now),
        "cold start on the restored chain: {cold}"
    );
    let from = dom.serial().len();
    dom.wait_ticks(from, "cold-started guest ticking", |t| t.len() >= 2);
}

/// Captures and rollbacks under libvirt on each QEMU (run on the system QEMU and, in
/// scripts/test.sh's second pass, on QEMU 10): three snapshots in a row on one QEMU instance (QEMU
/// ≥ 9.0 refuses a `migrate` until the previous one is cleaned up: `duplicate yank instance`), each
/// ended by this QEMU's rule (≥ 9.0 keeps the guest paused: backstop resumes it once write tracking
/// is on, seen as the `tracking` phase of the pause), the capability off and libvirt and QMP on the
/// same top after each, then a rollback to the second lands at its instant on the same emulator.
#[test]
fn libvirt_snapshots_in_a_row_on_one_qemu_then_rollback_to_the_second() {
    let test = "libvirt_snapshots_in_a_row_on_one_qemu_then_rollback_to_the_second";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-row", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();
    let qemu = dom.qemu_version();
    let major: u32 = qemu.split('.').next().unwrap().parse().unwrap();
    // Restoring a snapshot that is not the newest needs a reviewer's token.
    let keys = tempfile::tempdir().unwrap();
    let key = backstop_e2e::review::reviewer_key(keys.path());
    let gate = backstop_e2e::review::restore_gate_toml(&key);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-row",
        &move |s: &Path, r: &Path| config(s, r, &name, &gate, &l2),
        &[],
    );
    d.launch();
    let adopted = d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted");
    assert_eq!(adopted["fields"]["qemu_version"], qemu.as_str());
    assert_eq!(adopted["fields"]["capture_mode"], "bg");
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let mut ids = Vec::new();
    for i in 1..=3 {
        let v = d.ok(&["snapshot", "create", "--reason", "in a row"]);
        let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
        d.wait_journal(STEP, "snapshot completed", |e| {
            e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == id.as_str()
        });
        let show = d.ok(&["snapshot", "show", &id]);
        let f = &show["manifest"]["capture"];
        let phases: Vec<&str> = f["pause_breakdown_us"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[0].as_str().unwrap())
            .collect();
        eprintln!(
            "QEMU {qemu} snapshot {i}: pause_us {} breakdown {} downtime_ms {}",
            f["pause_us"], f["pause_breakdown_us"], f["downtime_ms"]
        );
        if major >= 9 {
            assert_eq!(
                phases,
                ["suspend", "switch", "migrate", "tracking", "resume"],
                "QEMU {qemu}: resumed by backstop once write tracking was on"
            );
        } else {
            assert_eq!(phases, ["suspend", "switch", "migrate", "resume"]);
        }
        assert!(
            virsh_text(&["domstate", &dom.name]).contains("running"),
            "the guest runs after snapshot {i}"
        );
        assert_eq!(dom.pid(), pid, "one QEMU instance for all the snapshots");
        let caps = virsh_text(&[
            "qemu-monitor-command",
            &dom.name,
            r#"{"execute":"query-migrate-capabilities"}"#,
        ]);
        assert!(
            caps.contains(r#"{"state":false,"capability":"background-snapshot"}"#),
            "{caps}"
        );
        let libvirt_top = virsh_text(&["domblklist", &dom.name])
            .lines()
            .find_map(|l| l.trim().strip_prefix("vda").map(|p| p.trim().to_string()))
            .unwrap();
        assert_eq!(dom.qmp_vda_top(), libvirt_top, "libvirt and QMP agree");
        assert_eq!(
            newest_layer(&dom.layers(), "vda").as_deref(),
            Some(Path::new(&libvirt_top)),
            "the guest writes the newest overlay"
        );
        ids.push(id);
    }
    let second = &ids[1];
    let snap_disk = disk_sector0(&frozen_vda_top(&d.ok(&["snapshot", "show", second])));
    dom.wait_ticks(0, "guest moving on", |t| {
        t.last().is_some_and(|t| t.ram >= snap_disk + 5)
    });
    let before = dom.serial().len();
    let token = backstop_e2e::review::token(&key, second);
    let rb = d.ok(&[
        "rollback",
        "--to",
        second,
        "--reviewer-token",
        token.to_str().unwrap(),
        "--reason",
        "back to the second",
    ]);
    assert_eq!(rb["snapshot_id"], second.as_str());
    dom.renice();
    let after = dom.wait_ticks(before, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<Tick> = after
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    eprintln!(
        "QEMU {qemu}: second snapshot's disk {snap_disk}; first ticks after rollback {restored:?}"
    );
    assert!(
        restored[0].ram == snap_disk || restored[0].ram == snap_disk + 1,
        "at the second snapshot's point: {restored:?} vs {snap_disk}"
    );
    for t in &restored {
        assert_eq!(t.ram, t.disk, "RAM and disk at one instant: {restored:?}");
    }
    assert!(virsh_text(&["dominfo", &dom.name]).contains(&uuid));
    dom.check_qemu();
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// A domain its operator paused with `virsh suspend` stays paused through background snapshots:
/// on 7.2/8.x QEMU resumes it after the capture's start and backstop pauses it again at once; on
/// ≥ 9.0 backstop does not resume it once write tracking is on. Paused past the heartbeat
/// timeout it is not rolled back (a paused guest is not hung), and after `virsh resume` its
/// silence counts from the resume.
#[test]
fn libvirt_a_domain_paused_with_virsh_stays_paused_through_snapshots() {
    let test = "libvirt_a_domain_paused_with_virsh_stays_paused_through_snapshots";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    const HEARTBEAT_S: u64 = 8;
    let dom = TestDomain::start("bs-e2e-held", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-held",
        &move |s: &Path, r: &Path| {
            config(s, r, &name, "", &l2).replace(
                "heartbeat_timeout_s = 30",
                &format!("heartbeat_timeout_s = {HEARTBEAT_S}"),
            )
        },
        &[],
    );
    d.launch();
    let adopted = d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted");
    assert_eq!(adopted["fields"]["capture_mode"], "bg");
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    // Paused past the heartbeat timeout (8 s here): a paused guest sends no heartbeats and is
    // not hung.
    stays_paused_through_snapshots(&d, &dom, 2, Duration::from_secs(HEARTBEAT_S + 4));
    // After `virsh resume` the allowed silence counts from the resume (the last heartbeat is
    // older than the timeout by then): no rollback for another timeout and more.
    let rollbacks = events(&d.journal(), "rollback.triggered").len();
    std::thread::sleep(Duration::from_secs(HEARTBEAT_S + 2));
    assert_eq!(
        events(&d.journal(), "rollback.triggered").len(),
        rollbacks,
        "rolled back after virsh resume"
    );
    // And a running guest is still paused by a snapshot and runs after it.
    let v = d.ok(&["snapshot", "create", "--reason", "running again"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let show = d.ok(&["snapshot", "show", &id]);
    assert!(show["manifest"]["capture"]["pause_us"].as_u64().unwrap() > 0);
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    d.ok(&["audit", "verify"]);
    d.kill9();
}

#[test]
fn libvirt_bad_input_is_one_line_with_a_code_and_changes_nothing() {
    let test = "libvirt_bad_input_is_one_line_with_a_code_and_changes_nothing";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    // A domain without the agent channel.
    let dom = TestDomain::start("bs-e2e-nochan", &|x| {
        let a = x.find("<channel").unwrap();
        let b = x.find("</channel>").unwrap() + "</channel>".len();
        format!("{}{}", &x[..a], &x[b..])
    });
    let pid = dom.pid();
    let layers = dom.layers();
    for (case, domain, extra, code, says) in [
        (
            "missing domain",
            "bs-no-such-domain",
            "",
            "ERR_LIBVIRT_DOMAIN_NOT_FOUND",
            "bs-no-such-domain",
        ),
        (
            "wrong uri",
            dom.name.as_str(),
            "",
            "ERR_LIBVIRT_CONNECT",
            "cannot connect to libvirt",
        ),
        (
            "no agent channel",
            dom.name.as_str(),
            "",
            "ERR_LIBVIRT_DOMAIN_UNSUITABLE",
            "<channel type='unix'>",
        ),
    ] {
        let (name, l2, extra) = (domain.to_string(), layers.clone(), extra.to_string());
        let wrong_uri = case == "wrong uri";
        let mut d = Daemon::prepare_custom(
            "lv-refuse",
            &move |s: &Path, r: &Path| {
                let c = config(s, r, &name, &extra, &l2);
                if wrong_uri {
                    c.replace(
                        "qemu:///system",
                        "qemu+unix:///system?socket=/nonexistent/libvirt-sock",
                    )
                } else {
                    c
                }
            },
            &[],
        );
        d.launch_answering();
        let st = d.cli(&["status"]);
        let text =
            String::from_utf8_lossy(&st.stdout).to_string() + &String::from_utf8_lossy(&st.stderr);
        let log = d.log();
        eprintln!("{case}: status: {text}");
        let line = log
            .lines()
            .find(|l| l.contains("could not start"))
            .unwrap_or_else(|| panic!("{case}: no refusal in the log:\n{log}"));
        eprintln!("{case}: log: {line}");
        assert!(text.contains(code), "{case}: status names {code}: {text}");
        assert!(line.contains(says), "{case}: the line says why: {line}");
        assert!(line.contains(code), "{case}: the line names {code}: {line}");
        // Nothing changed: no VM journal or layers, the domain runs on the same QEMU.
        assert!(
            !d.journal_path().exists(),
            "{case}: a VM journal was written"
        );
        assert!(!layers.exists(), "{case}: layers dir created");
        assert_eq!(dom.pid(), pid, "{case}: the domain was touched");
        d.kill9();
    }
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));

    // A layers directory backstop cannot write (a read-only file system: refused for root
    // too), checked before the domain is looked at: one line, and the domain, its metadata
    // and the directory as they were.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let ro = dom.dir.join("ro-layers");
    std::fs::create_dir_all(&ro).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
        .arg(&ro)
        .status()
        .unwrap();
    assert!(
        mounted.success(),
        "mount a read-only tmpfs at {}",
        ro.display()
    );
    let _unmount = Unmount(ro.clone());
    let xml_before = virsh_text(&["dumpxml", &dom.name]);
    let (name, l2) = (dom.name.clone(), ro.join("layers"));
    let mut d = Daemon::prepare_custom(
        "lv-rolayers",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch_answering();
    let st = d.cli(&["status"]);
    let text = String::from_utf8_lossy(&st.stdout).to_string();
    let log = d.log();
    let line = log.lines().find(|l| l.contains("could not start")).unwrap();
    eprintln!("read-only layers dir: {line}");
    assert!(text.contains("ERR_IO"), "{text}");
    assert!(
        line.contains(&format!("layers_dir: {} is not writable", ro.display())),
        "{line}"
    );
    assert!(!d.journal_path().exists(), "a VM journal was written");
    assert_eq!(std::fs::read_dir(&ro).unwrap().count(), 0);
    assert_eq!(
        virsh_text(&["dumpxml", &dom.name]),
        xml_before,
        "the domain changed"
    );
    assert_eq!(dom.pid(), pid);
    d.kill9();

    // A good domain, but libvirt's unprivileged QEMU cannot get a userfaultfd
    // (vm.unprivileged_userfaultfd=0, Debian's default): refused, naming the sysctl.
    let _uffd = Uffd::set("0");
    let good = TestDomain::start("bs-e2e-nouffd", &|x| x);
    let pid = good.pid();
    let (name, l2) = (good.name.clone(), good.layers());
    let mut d = Daemon::prepare_custom(
        "lv-nouffd",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch_answering();
    let st = d.cli(&["status"]);
    let text = String::from_utf8_lossy(&st.stdout).to_string();
    let log = d.log();
    let line = log.lines().find(|l| l.contains("could not start")).unwrap();
    eprintln!("no userfaultfd: log: {line}");
    assert!(text.contains("ERR_LIBVIRT_NO_USERFAULTFD"), "{text}");
    assert!(line.contains("vm.unprivileged_userfaultfd=1"), "{line}");
    assert!(!d.journal_path().exists());
    assert_eq!(good.pid(), pid);
    let caps = virsh_text(&[
        "qemu-monitor-command",
        &good.name,
        r#"{"execute":"query-migrate-capabilities"}"#,
    ]);
    assert!(caps.contains(r#"{"state":false,"capability":"background-snapshot"}"#));
    d.kill9();
}

/// A host that keeps `vm.unprivileged_userfaultfd=0` (Debian's default) can still guard a domain:
/// with `capture = "auto"` adoption falls back to the live pre-copy capture, the disks switch at
/// QEMU's switchover, and a rollback lands RAM and disk at one instant.
#[test]
fn libvirt_precopy_capture_without_userfaultfd_keeps_one_instant() {
    let test = "libvirt_precopy_capture_without_userfaultfd_keeps_one_instant";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("0");
    let dom = TestDomain::start("bs-e2e-pre", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid_before = dom.pid();
    let layers = dom.layers();
    let (name, l2) = (dom.name.clone(), layers.clone());
    let mut d = Daemon::prepare_custom(
        "lv-precopy",
        &move |s: &Path, r: &Path| config(s, r, &name, r#"capture = "auto""#, &l2),
        &[],
    );
    d.launch();
    let adopted =
        d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted")["fields"].clone();
    eprintln!("vm.adopted: {adopted}");
    assert_eq!(adopted["pid"], pid_before, "{adopted}");
    assert_eq!(adopted["capture_mode"], "precopy", "{adopted}");
    assert!(
        adopted["capture_mode_reason"]
            .as_str()
            .unwrap()
            .contains("auto"),
        "{adopted}"
    );
    // The test domains run under TCG, whose dirty tracking loses pages before QEMU 9.0 (QEMU
    // 03bfc2188f): there the guest is paused for the whole copy, and the adoption says why.
    let major: u32 = dom
        .qemu_version()
        .split('.')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(adopted["precopy_live"], major >= 9, "{adopted}");
    assert_eq!(
        adopted["precopy_paused_why"].is_string(),
        major < 9,
        "{adopted}"
    );
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    assert_eq!(
        d.status()["backend_details"]["precopy_live"],
        major >= 9,
        "status shows how this domain is copied"
    );

    let v = d.ok(&["snapshot", "create", "--reason", "pre-copy"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let show = d.ok(&["snapshot", "show", &id]);
    let capture = &show["manifest"]["capture"];
    eprintln!("pre-copy capture: {capture}");
    let phases: Vec<&str> = capture["pause_breakdown_us"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        ["stop-seen", "switch", "device-state", "resume"],
        "{capture}"
    );
    assert!(capture["pause_us"].as_u64().unwrap() > 0, "{capture}");
    let frozen_top = frozen_vda_top(&show);
    let snap_disk = disk_sector0(&frozen_top);
    assert!(snap_disk > 0);
    // libvirt follows the switch; the guest runs; the capabilities are off again.
    let blk = virsh_text(&["domblklist", &dom.name]);
    assert!(!blk.contains(frozen_top.to_str().unwrap()), "{blk}");
    assert!(blk.contains(layers.to_str().unwrap()), "{blk}");
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    let caps = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"query-migrate-capabilities"}"#,
    ]);
    for c in [
        "pause-before-switchover",
        "auto-converge",
        "background-snapshot",
    ] {
        assert!(
            caps.contains(&format!(r#"{{"state":false,"capability":"{c}"}}"#)),
            "{c} still on: {caps}"
        );
    }
    let params = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"query-migrate-parameters"}"#,
    ]);
    assert!(
        params.contains(r#""downtime-limit":300"#),
        "the domain's downtime limit is back: {params}"
    );
    assert_eq!(dom.pid(), pid_before, "captured without restarting QEMU");

    dom.wait_ticks(0, "guest moving on", |t| {
        t.last().is_some_and(|t| t.ram >= snap_disk + 5)
    });
    rollback_lands_at(&d, &dom, &id, snap_disk);
    // A guest its operator paused is copied without running: the pre-copy's end leaves QEMU in
    // `postmigrate`, and the guest stays paused through it and through the next capture.
    stays_paused_through_snapshots(&d, &dom, 2, Duration::from_secs(2));
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// `virsh suspend`, then `n` snapshots: each one succeeds with no pause of backstop's
/// (`pause_us` 0), and after each the domain is still paused (reason `user`) and the guest has not
/// ticked. It stays paused `held` more: `status` says it is paused outside backstop, journaled
/// once, and nothing rolls it back. `virsh resume` lets it tick on, on the same QEMU, journaled.
fn stays_paused_through_snapshots(d: &Daemon, dom: &TestDomain, n: usize, held: Duration) {
    let pid = dom.pid();
    let rollbacks = events(&d.journal(), "rollback.triggered").len();
    let outside = events(&d.journal(), "vm.paused_outside").len();
    virsh_text(&["suspend", &dom.name]);
    assert!(virsh_text(&["domstate", &dom.name]).contains("paused"));
    // A tick already on its way out of the guest's serial port.
    std::thread::sleep(Duration::from_millis(500));
    let from = dom.serial().len();
    for i in 0..n {
        let v = d.ok(&[
            "snapshot",
            "create",
            "--reason",
            "while the operator paused it",
        ]);
        let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
        let show = d.ok(&["snapshot", "show", &id]);
        let capture = &show["manifest"]["capture"];
        eprintln!("snapshot {i} of the paused guest: {capture}");
        assert_eq!(capture["pause_us"], 0, "no pause of backstop's: {capture}");
        let state = virsh_text(&["domstate", "--reason", &dom.name]);
        assert!(
            state.contains("paused") && state.contains("user"),
            "snapshot {i} left the operator's paused guest {state}"
        );
        assert!(
            backstop_e2e::parse_ticks(&dom.serial()[from..]).is_empty(),
            "the paused guest ran through snapshot {i}: {}",
            &dom.serial()[from..]
        );
    }
    std::thread::sleep(held);
    assert!(
        backstop_e2e::parse_ticks(&dom.serial()[from..]).is_empty(),
        "the paused guest ran after the snapshots: {}",
        &dom.serial()[from..]
    );
    let st = d.status();
    assert_eq!(st["state"], "running", "backstop is not halted: {st}");
    assert!(
        st["guest_paused_outside"]
            .as_str()
            .is_some_and(|w| w.contains("outside backstop")),
        "status says who paused it: {st}"
    );
    let journal = d.journal();
    assert_eq!(
        events(&journal, "vm.paused_outside").len(),
        outside + 1,
        "the pause is journaled once"
    );
    assert_eq!(
        events(&journal, "rollback.triggered").len(),
        rollbacks,
        "a guest paused by its operator was rolled back"
    );
    virsh_text(&["resume", &dom.name]);
    dom.wait_ticks(from, "the guest ticks after virsh resume", |t| t.len() >= 2);
    let resumed = d.wait_journal(STEP, "vm.resumed_outside", |e| {
        e["event"] == "vm.resumed_outside"
    });
    assert!(
        resumed["fields"]["paused_ms"].as_u64().unwrap() >= held.as_millis() as u64,
        "{resumed}"
    );
    assert_eq!(d.status()["guest_paused_outside"], Value::Null);
    assert_eq!(dom.pid(), pid, "the same QEMU throughout");
}

/// Rolls `d`'s domain back to snapshot `id`, whose frozen disk says `snap_disk`, and asserts the
/// guest's first ticks after it have RAM = disk at that point (one instant).
fn rollback_lands_at(d: &Daemon, dom: &TestDomain, id: &str, snap_disk: u64) {
    let before = dom.serial().len();
    let rb = d.ok(&["rollback", "--to", id, "--reason", "test: undo"]);
    assert_eq!(rb["snapshot_id"], id);
    dom.renice();
    let after = dom.wait_ticks(before, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<Tick> = after
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    eprintln!("snapshot disk {snap_disk}; first ticks after rollback {restored:?}");
    assert_eq!(
        restored[0].ram, restored[0].disk,
        "RAM and disk at one instant"
    );
    assert!(
        restored[0].ram == snap_disk || restored[0].ram == snap_disk + 1,
        "at the snapshot point: {restored:?} vs {snap_disk}"
    );
}

/// The last layer of disk `vda`'s chain in a `snapshot show` view: the layer frozen at the
/// snapshot.
fn frozen_vda_top(show: &Value) -> PathBuf {
    let chain = show["manifest"]["payload_refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain" && p["name"] == "disk:vda")
        .unwrap_or_else(|| panic!("vda in the manifest: {show}"));
    PathBuf::from(
        chain["layers"].as_array().unwrap().last().unwrap()["path"]
            .as_str()
            .unwrap(),
    )
}

/// The newest layer file backstop made for `disk` under a domain's layers directory.
fn newest_layer(layers: &Path, disk: &str) -> Option<PathBuf> {
    std::fs::read_dir(layers.join(disk))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
        .max()
}

/// The pre-copy's failure path: when the disk switch at the switchover fails (here the new overlay
/// vanished while the store stalled), the migration is cancelled, the guest runs on its old top
/// layer in the same QEMU, nothing is published, the capabilities and downtime limit are back, and
/// the next snapshot switches and publishes normally.
#[test]
fn libvirt_precopy_switch_failure_leaves_the_guest_on_its_disk() {
    let test = "libvirt_precopy_switch_failure_leaves_the_guest_on_its_disk";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("0");
    let dom = TestDomain::start("bs-e2e-prefail", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let layers = dom.layers();
    let (name, l2) = (dom.name.clone(), layers.clone());
    // Every snapshot but the baseline stalls its store 4 s after 1 MiB (well inside the bound).
    let mut d = Daemon::prepare_custom(
        "lv-prefail",
        &move |s: &Path, r: &Path| {
            config(s, r, &name, r#"capture = "precopy""#, &l2)
                .replace("[vm]", "max_capture_stall_ms = 60000\n\n[vm]")
        },
        &[("BACKSTOP_FAULT_INJECT", "capture.stall=4")],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let snapshots = d.ok(&["snapshot", "list"])["snapshots"].clone();
    let top_before = virsh_text(&["domblklist", &dom.name]);
    let before_layer = newest_layer(&layers, "vda");

    let create = Command::new(bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["--json", "snapshot", "create", "--reason", "switch fails"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The overlay is made before the capture starts; the store stalls for 4 s after 1 MiB.
    let deadline = Instant::now() + Duration::from_secs(10);
    let overlay = loop {
        match newest_layer(&layers, "vda") {
            Some(p) if Some(&p) != before_layer.as_ref() => break p,
            _ => {
                assert!(Instant::now() < deadline, "no new overlay appeared");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(&overlay).unwrap();
    let out = create.wait_with_output().unwrap();
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("switch failure: {err}");
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("disk-only snapshot at the switchover"),
        "{err}"
    );
    assert_eq!(dom.pid(), pid, "the QEMU was replaced");
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    assert_eq!(
        virsh_text(&["domblklist", &dom.name]),
        top_before,
        "the guest left its top layer"
    );
    assert_eq!(d.ok(&["snapshot", "list"])["snapshots"], snapshots);
    let from = dom.serial().len();
    dom.wait_ticks(from, "guest ticking after the failed switch", |t| {
        t.len() >= 2
    });
    let caps = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"query-migrate-capabilities"}"#,
    ]);
    assert!(
        caps.contains(r#"{"state":false,"capability":"pause-before-switchover"}"#),
        "{caps}"
    );
    let params = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"query-migrate-parameters"}"#,
    ]);
    assert!(params.contains(r#""downtime-limit":300"#), "{params}");

    // The next snapshot switches and publishes; its chain ends at the layer the guest left.
    let v = d.ok(&["snapshot", "create", "--reason", "after the failure"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    let show = d.ok(&["snapshot", "show", &id]);
    let chain = show["manifest"]["payload_refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "disk:vda")
        .unwrap()["layers"]
        .clone();
    let frozen_top = chain.as_array().unwrap().last().unwrap()["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        top_before.contains(&frozen_top),
        "the snapshot froze {frozen_top}, the guest wrote {top_before}"
    );
    assert!(!virsh_text(&["domblklist", &dom.name]).contains(&frozen_top));
    d.ok(&["snapshot", "verify", &id]);
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// Restarts libvirtd as scripts/setup-libvirt.sh starts it (no systemd here) and waits until it
/// answers again.
fn start_libvirtd() {
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = Command::new("libvirtd").arg("-d").status().unwrap();
    assert!(st.success(), "libvirtd -d failed");
    while !virsh(&["version"]).status.success() {
        assert!(Instant::now() < deadline, "libvirtd did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn stop_libvirtd() {
    let st = Command::new("pkill")
        .args(["-x", "libvirtd"])
        .status()
        .unwrap();
    assert!(st.success(), "no libvirtd to stop");
    let deadline = Instant::now() + Duration::from_secs(30);
    while Command::new("pgrep")
        .args(["-x", "libvirtd"])
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(Instant::now() < deadline, "libvirtd did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Supervision through libvirt: a libvirtd outage is shown, refused in one line and journaled,
/// and survived without a rollback (backstop opens its connection again and snapshots on), and an operator's `virsh destroy` makes the VM HALTED —
/// not restarted behind their back — until `halt clear` brings the domain back, same name and UUID,
/// from the newest snapshot.
#[test]
fn libvirt_destroy_by_hand_halts_and_a_libvirtd_restart_is_survived() {
    let test = "libvirt_destroy_by_hand_halts_and_a_libvirtd_restart_is_survived";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = LIBVIRTD.write().unwrap_or_else(|p| p.into_inner());
    // With a NIC: network access must not survive the rollback `halt clear` makes.
    let dom = TestDomain::start("bs-e2e-sup", &|x| {
        x.replace(
            "<watchdog",
            "<interface type='user'><model type='virtio'/></interface>\n    <watchdog",
        )
    });
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();
    let (name, l2) = (dom.name.clone(), dom.layers());
    // `auto`: whatever this host's userfaultfd sysctl says, the domain is guarded.
    let mut d = Daemon::prepare_custom(
        "lv-sup",
        &move |s: &Path, r: &Path| config(s, r, &name, r#"capture = "auto""#, &l2),
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let st = d.status();
    eprintln!("status: {st}");
    assert_eq!(st["backend_details"]["domain"], dom.name.as_str(), "{st}");
    assert!(st["backend_details"]["capture_mode"].is_string(), "{st}");
    assert_eq!(st["backend_details"]["libvirt_reconnects"], 0, "{st}");
    // The huge-page mode in effect (a domain never gets `all`: it is suspended first).
    assert_eq!(st["backend_details"]["huge_pages"], "resident", "{st}");

    // libvirtd goes away: `status` says so at the next tick, a snapshot is refused in one line
    // with its own code, the loss is journaled and logged once, and backstop's agent keeps the
    // heartbeat watchdog fed (its channel is QEMU's, not libvirt's), so nothing is rolled back.
    let log_before = d.log().len();
    /// Starts libvirtd again if the test ends while it is stopped (the other tests need it).
    struct Restart;
    impl Drop for Restart {
        fn drop(&mut self) {
            if !virsh(&["version"]).status.success() {
                let _ = Command::new("libvirtd").arg("-d").status();
            }
        }
    }
    let _restart = Restart;
    stop_libvirtd();
    let stopped = Instant::now();
    let st = loop {
        let st = d.status();
        if st["backend_details"]["libvirt"]
            .as_str()
            .is_some_and(|l| l.starts_with("disconnected since "))
        {
            break st;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(5),
            "outage not shown: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "libvirt shown {} ms after libvirtd stopped: {}",
        stopped.elapsed().as_millis(),
        st["backend_details"]["libvirt"]
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(2),
        "not within a tick or so"
    );
    let out = d.cli(&["snapshot", "create", "--reason", "libvirtd is down"]);
    assert!(!out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("snapshot while libvirtd is down: {doc}");
    assert_eq!(doc["error"]["code"], "ERR_LIBVIRT_CONNECT", "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains("libvirtd is unreachable"),
        "{doc}"
    );
    std::thread::sleep(Duration::from_secs(3));
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    assert!(
        st["heartbeat_age_ms"].as_u64().is_some_and(|a| a < 3000),
        "heartbeats through the outage: {st}"
    );
    let log = d.log();
    let lost = log[log_before..]
        .lines()
        .filter(|l| {
            l.contains("libvirt connection lost") || l.contains("libvirt still unreachable")
        })
        .count();
    assert_eq!(
        lost,
        1,
        "the outage is logged once:\n{}",
        &log[log_before..]
    );
    assert!(
        !log[log_before..].contains("libvirt domain state unreadable"),
        "the state poll logs every tick:\n{}",
        &log[log_before..]
    );
    let gone = d.wait_journal(STEP, "the outage journaled", |e| {
        e["event"] == "vm.hypervisor_disconnected"
    });
    assert!(gone["fields"]["since"].is_string(), "{gone}");
    // libvirtd is back; the guest never stopped, so nothing is rolled back.
    start_libvirtd();
    let back = d.wait_journal(STEP, "the return journaled", |e| {
        e["event"] == "vm.hypervisor_reconnected"
    });
    eprintln!("reconnected: {}", back["fields"]);
    assert!(
        back["fields"]["down_ms"].as_u64().unwrap() >= 3000,
        "{back}"
    );
    assert_eq!(back["fields"]["down_since"], gone["fields"]["since"]);
    let deadline = Instant::now() + STEP;
    loop {
        let st = d.status();
        if st["backend_details"]["libvirt_reconnects"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "never reconnected: {st}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let v = d.ok(&["snapshot", "create", "--reason", "after libvirtd restarted"]);
    assert!(v["summary"]["snapshot_id"].is_string(), "{v}");
    assert_eq!(dom.pid(), pid, "the domain's QEMU was replaced");
    assert_eq!(d.status()["state"], "running");
    let j = d.journal();
    assert!(
        j.iter()
            .all(|e| !e["event"].as_str().unwrap().starts_with("rollback.")),
        "a rollback after a libvirtd restart"
    );

    // An operator destroys the domain: HALTED, and it stays off.
    virsh_text(&["destroy", &dom.name]);
    let deadline = Instant::now() + STEP;
    let st = loop {
        let st = d.status();
        if st["state"] == "halted" {
            break st;
        }
        assert!(Instant::now() < deadline, "not halted: {st}");
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("after virsh destroy: {st}");
    assert_eq!(st["halted"]["code"], "ERR_VM_ENDED_OUTSIDE", "{st}");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        virsh_text(&["domstate", &dom.name]).contains("shut off"),
        "restarted behind the operator's back"
    );
    let j = d.journal();
    assert!(j
        .iter()
        .all(|e| !e["event"].as_str().unwrap().starts_with("rollback.")));

    // halt clear brings it back from the newest snapshot: same name and UUID, a fresh QEMU.
    let before = dom.serial().len();
    d.ok(&["halt", "clear", "--reason", "test: the operator is done"]);
    assert_eq!(d.status()["state"], "running");
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    assert!(virsh_text(&["dominfo", &dom.name]).contains(&uuid));
    assert_ne!(dom.pid(), pid);
    // spec/000 §8: the restored guest's NIC has its link down (live), while the operator's
    // persistent definition keeps its NIC as it was.
    let live = virsh_text(&["dumpxml", &dom.name]);
    assert!(live.contains("<interface type='user'>"), "{live}");
    assert!(
        backstop_libvirt::domain_xml::all_links_down(&live),
        "a NIC's link survived the rollback: {live}"
    );
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("state='down'"));
    dom.renice();
    dom.wait_ticks(before, "guest after halt clear", |t| t.len() >= 2);
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// libvirt refuses backing chains deeper than 200, and every snapshot adds a layer. Past 16 the
/// running chain is merged through libvirt (`virDomainBlockRebase`, a block pull), so libvirt's own
/// view stays short; the layers older snapshots name stay intact, so a rollback to one from before
/// the merge still lands RAM and disk at one instant. `BACKSTOP_LIBVIRT_SNAPSHOTS` sets the count
/// (CI: 24; 210 would pass libvirt's limit of 200 without the merges).
#[test]
fn libvirt_many_snapshots_keep_libvirts_chain_bounded() {
    let test = "libvirt_many_snapshots_keep_libvirts_chain_bounded";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    // The default capture mode, pinned (the host-wide sysctl is held): what this test is about
    // is libvirt's chain, the same in both modes.
    let _uffd = Uffd::set("1");
    let n: usize = std::env::var("BACKSTOP_LIBVIRT_SNAPSHOTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let dom = TestDomain::start("bs-e2e-deep", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-deep",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();
    let adopted = d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted");
    eprintln!("deep chain: adopted {}", adopted["fields"]);
    assert_eq!(adopted["fields"]["capture_mode"], "bg");
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let mut early = None;
    let mut max_depth = 0;
    eprintln!("libvirt-chain,n,engine_depth,libvirt_sources");
    for i in 1..=n {
        let v = d.ok(&["snapshot", "create", "--reason", "deep chain"]);
        if i == 2 {
            early = v["summary"]["snapshot_id"].as_str().map(str::to_string);
        }
        let vm: Value =
            serde_json::from_slice(&std::fs::read(d.state_dir().join("vm-state.json")).unwrap())
                .unwrap();
        let depth = vm["chains"]["vda"].as_array().unwrap().len();
        let chain = backstop_libvirt::domain_xml::backing_chain(
            &virsh_text(&["dumpxml", &dom.name]),
            "vda",
        );
        eprintln!("libvirt-chain,{i},{depth},{}", chain.len());
        assert!(depth <= 17, "the running chain grew to {depth} layers");
        // libvirt's chain: the engine's layers plus the domain's own base image below them.
        assert_eq!(chain.len(), depth + 1, "libvirt's view differs: {chain:?}");
        max_depth = max_depth.max(chain.len());
    }
    let j = d.journal();
    let pauses: Vec<u64> = events(&j, "snapshot.create.completed")
        .iter()
        .filter_map(|e| e["fields"]["pause_us"].as_u64())
        .collect();
    eprintln!(
        "libvirt pause_us per snapshot on QEMU {}: {pauses:?}",
        dom.qemu_version()
    );
    if n > 16 {
        assert!(
            !events(&j, "disk.chain_flattened").is_empty(),
            "no merge after {n} snapshots"
        );
    }
    eprintln!("{n} snapshots: libvirt's chain at most {max_depth} deep");

    // A snapshot from before the merge still verifies: every layer it names is byte-identical
    // (restoring it needs reviewer evidence, the restore gate's business, not this test's).
    d.ok(&["snapshot", "verify", &early.unwrap()]);
    // The newest snapshot, taken on the merged chain, restores to its own instant.
    let newest = d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let show = d.ok(&["snapshot", "show", &newest]);
    let snap_disk = disk_sector0(&frozen_vda_top(&show));
    dom.wait_ticks(0, "guest moving on", |t| {
        t.last().is_some_and(|t| t.ram >= snap_disk + 3)
    });
    rollback_lands_at(&d, &dom, &newest, snap_disk);
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// The hardware watchdog of an adopted domain. The guest's kicker feeds its i6300esb (`<watchdog
/// model='i6300esb' action='pause'/>`, as adoption requires) and is killed at a set uptime; the
/// device fires, libvirt pauses the domain for the watchdog, and backstop rolls it back to the
/// newest snapshot as an emergency (`watchdog_device`): the guest runs again at that point, told
/// the new epoch, under the same domain name and UUID.
#[test]
fn libvirt_an_unkicked_i6300esb_rolls_the_adopted_domain_back() {
    let test = "libvirt_an_unkicked_i6300esb_rolls_the_adopted_domain_back";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-wd", &|x| {
        x.replace(
            "no_timer_check",
            "no_timer_check backstop.watchdog=1 backstop.wd_timeout=3 backstop.wd_stop_at=45",
        )
    });
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    assert!(
        dom.serial().contains("BACKSTOP watchdog armed"),
        "the guest's i6300esb kicker did not start: {}",
        dom.serial()
    );
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-wd",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let v = d.ok(&["snapshot", "create", "--reason", "the kicker still runs"]);
    let id = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    assert!(
        !dom.serial().contains("BACKSTOP watchdog stopped"),
        "the kicker stopped before the snapshot: raise wd_stop_at"
    );

    let done = d.wait_journal(Duration::from_secs(150), "device watchdog rollback", |e| {
        e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_device"
    });
    assert_eq!(done["fields"]["snapshot_id"], id.as_str(), "{done}");
    let j = d.journal();
    assert!(
        events(&j, "rollback.initiated")
            .iter()
            .any(|e| e["fields"]["trigger"] == "watchdog_device"),
        "no watchdog_device rollback.initiated"
    );
    // The guest runs again from the snapshot (before its kicker was killed), told epoch 1.
    let stopped = dom
        .serial()
        .find("BACKSTOP watchdog stopped")
        .expect("the kicker was killed");
    let deadline = Instant::now() + STEP;
    while !dom.serial()[stopped..].contains("BACKSTOP epoch=1") {
        assert!(
            Instant::now() < deadline,
            "no epoch=1 after the rollback: {}",
            &dom.serial()[stopped..]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    dom.renice();
    let st = d.status();
    assert_eq!(st["state"], "running", "{st}");
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    assert!(virsh_text(&["dominfo", &dom.name]).contains(&uuid));
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// Two devices granted through libvirt: emulated USB input devices, hot-plugged into the default
/// `qemu-xhci` controller libvirt gives a q35 domain (no USB host device exists in these
/// containers).
const LIBVIRT_DEVICES: &str = r#"
[[devices]]
id = "tablet"
class = "usb"
max_lease_s = 600
release_timeout_s = 10
libvirt = { xml = "<input type='tablet' bus='usb'/>" }

[[devices]]
id = "kbd"
class = "usb"
max_lease_s = 600
libvirt = { xml = "<input type='keyboard' bus='usb'/>" }
"#;

/// QEMU's own view through libvirt's monitor passthrough: the USB devices (`info usb`, one
/// line each with its id) and the devices added by id (`qom-list /machine/peripheral`).
fn qemu_usb_and_peripherals(dom: &TestDomain) -> (String, String) {
    let usb = virsh_text(&["qemu-monitor-command", &dom.name, "--hmp", "info usb"]);
    let per = virsh_text(&[
        "qemu-monitor-command",
        &dom.name,
        r#"{"execute":"qom-list","arguments":{"path":"/machine/peripheral"}}"#,
    ]);
    (usb, per)
}

#[test]
fn libvirt_a_granted_usb_device_is_gone_after_rollback_and_after_revoke() {
    let test = "libvirt_a_granted_usb_device_is_gone_after_rollback_and_after_revoke";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-dev", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    // The hot-plug target: libvirt's default USB controller of a q35 domain.
    let live = virsh_text(&["dumpxml", &dom.name]);
    assert!(
        live.contains("<controller type='usb' index='0' model='qemu-xhci'>"),
        "{live}"
    );
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-dev",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2) + LIBVIRT_DEVICES,
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let list = d.ok(&["device", "list"]);
    let sources: Vec<&str> = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["source"].as_str().unwrap())
        .collect();
    assert_eq!(sources, ["libvirt <input>", "libvirt <input>"], "{list}");

    // A console grant and a console revoke: the keyboard comes and goes, as libvirt and QEMU
    // see it; the revoke waits for libvirt's DEVICE_REMOVED.
    let g = d.ok(&["device", "grant", "kbd", "--reason", "e2e: usb keyboard"]);
    eprintln!("grant kbd: {}", g["changed"]);
    assert!(
        g["changed"][0]
            .as_str()
            .unwrap()
            .contains("attach <input> alias=ua-backstop-kbd (live only)"),
        "{g}"
    );
    let live = virsh_text(&["dumpxml", &dom.name]);
    assert!(live.contains("<alias name='ua-backstop-kbd'/>"), "{live}");
    let (usb, per) = qemu_usb_and_peripherals(&dom);
    assert!(usb.contains("ID: ua-backstop-kbd"), "{usb}");
    assert!(per.contains("ua-backstop-kbd"), "{per}");
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("ua-backstop"));
    let r = d.ok(&["device", "revoke", "kbd", "--reason", "e2e: done with it"]);
    let line = r["changed"][0].as_str().unwrap().to_string();
    eprintln!("revoke kbd: {line}");
    assert!(
        line.starts_with("revoked kbd: detach <input> ua-backstop-kbd: DEVICE_REMOVED after"),
        "{r}"
    );
    assert!(!virsh_text(&["dumpxml", &dom.name]).contains("ua-backstop-kbd"));
    let (usb, per) = qemu_usb_and_peripherals(&dom);
    assert!(!usb.contains("ua-backstop"), "{usb}");
    assert!(!per.contains("ua-backstop"), "{per}");
    let j = d.journal();
    let revoked = events(&j, "device.revoked");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0]["fields"]["device_id"], "kbd");
    assert!(revoked[0]["fields"]["detail"]
        .as_str()
        .unwrap()
        .contains("DEVICE_REMOVED"));

    // The tablet, granted after its pre-action snapshot, is gone after a rollback to it.
    let g = d.ok(&["device", "grant", "tablet", "--reason", "e2e: usb tablet"]);
    let granted = d.wait_journal(STEP, "device.granted tablet", |e| {
        e["event"] == "device.granted" && e["fields"]["device_id"] == "tablet"
    });
    let pre = granted["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    let dev = g["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == "tablet")
        .unwrap();
    assert_eq!(dev["grant"]["pre_action_snapshot"], pre.as_str(), "{g}");
    let pre_show = d.ok(&["snapshot", "show", &pre]);
    assert_eq!(pre_show["manifest"]["trigger"], "pre_action", "{pre_show}");
    let live = virsh_text(&["dumpxml", &dom.name]);
    assert!(
        live.contains("<input type='tablet' bus='usb'>")
            && live.contains("<alias name='ua-backstop-tablet'/>"),
        "{live}"
    );
    let (usb, _) = qemu_usb_and_peripherals(&dom);
    assert!(
        usb.contains("Product QEMU USB Tablet, ID: ua-backstop-tablet"),
        "{usb}"
    );
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("ua-backstop"));
    // No snapshot holds a granted device.
    let out = d.cli(&["snapshot", "create", "--reason", "while granted"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED"));

    let rb = d.ok(&[
        "rollback",
        "--to",
        &pre,
        "--reason",
        "e2e: take the tablet away",
    ]);
    assert_eq!(rb["snapshot_id"], pre.as_str(), "{rb}");
    let done = d.wait_journal(STEP, "rollback.completed", |e| {
        e["event"] == "rollback.completed"
    });
    let revoked_list = done["fields"]["revoked"].to_string();
    eprintln!("rollback revoked: {revoked_list}");
    assert!(
        revoked_list.contains("detach <input> ua-backstop-tablet (DEVICE_REMOVED after"),
        "{revoked_list}"
    );
    assert_eq!(d.status()["state"], "running");
    let live = virsh_text(&["dumpxml", &dom.name]);
    assert!(
        !live.contains("ua-backstop"),
        "a grant survived the rollback: {live}"
    );
    assert!(!live.contains("<input type='tablet'"), "{live}");
    assert!(!live.contains("<hostdev"), "{live}");
    let (usb, per) = qemu_usb_and_peripherals(&dom);
    assert!(
        !usb.contains("Tablet") && !usb.contains("ua-backstop"),
        "{usb}"
    );
    assert!(!per.contains("ua-backstop"), "{per}");
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("ua-backstop"));
    let j = d.journal();
    for (id, cause) in [("kbd", None), ("tablet", Some("rollback"))] {
        assert!(
            events(&j, "device.granted")
                .iter()
                .any(|e| e["fields"]["device_id"] == id),
            "no device.granted for {id}"
        );
        assert!(
            events(&j, "device.revoked")
                .iter()
                .any(|e| e["fields"]["device_id"] == id
                    && cause.is_none_or(|c| e["fields"]["cause"] == c)),
            "no device.revoked for {id}"
        );
    }
    dom.renice();
    let before = dom.serial().len();
    dom.wait_ticks(before, "guest after the rollback", |t| t.len() >= 2);
    d.ok(&["audit", "verify"]);
    d.kill9();
}

/// Milliseconds since the Unix epoch of a journal timestamp (`2026-11-25T03:05:38.770Z`).
fn journal_ts_ms(ts: &str) -> i64 {
    let n = |r: std::ops::Range<usize>| ts[r].parse::<i64>().unwrap();
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days from 1970-01-01 (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 24 + n(11..13)) * 60 + n(14..16)) * 60_000 + n(17..19) * 1000 + n(20..23)
}

/// Supervision hears libvirt's lifecycle event. `virsh destroy` → HALTED within one supervision
/// tick (250 ms, the actor's idle tick, not configurable), named by the event, not by the next
/// tick's state poll. HALTED then holds: `virsh start` is refused by backstop's libvirt hook;
/// `halt clear` restores the domain, and refuses (ending nothing) when someone started it
/// where no hook guarded it.
#[test]
fn libvirt_virsh_destroy_halts_at_once_through_the_lifecycle_event() {
    let test = "libvirt_virsh_destroy_halts_at_once_through_the_lifecycle_event";
    if skip_unless_libvirt(test) {
        return;
    }
    const TICK_MS: i64 = 250;
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-ev", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-ev",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let st = d.status();
    assert_eq!(
        st["backend_details"]["libvirt_events"]["registered"], true,
        "{st}"
    );
    // Let the capture's own suspend/resume events be read, then idle.
    std::thread::sleep(Duration::from_secs(1));
    let asked = std::time::SystemTime::now();
    virsh_text(&["destroy", &dom.name]);
    let returned = std::time::SystemTime::now();
    let halted = d.wait_journal(STEP, "vm.halted", |e| e["event"] == "vm.halted");
    let ms = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
    };
    let at = journal_ts_ms(halted["ts"].as_str().unwrap());
    let after_return = at - ms(returned);
    eprintln!(
        "virsh destroy took {} ms; vm.halted journaled {after_return} ms after it returned \
         ({} ms after it was asked); supervision tick {TICK_MS} ms; halted: {}",
        ms(returned) - ms(asked),
        at - ms(asked),
        halted["fields"]
    );
    assert_eq!(halted["fields"]["code"], "ERR_VM_ENDED_OUTSIDE", "{halted}");
    assert!(
        halted["fields"]["reason"]
            .as_str()
            .unwrap()
            .contains("libvirt event: stopped (destroyed), not by backstop"),
        "not named by libvirt's event: {halted}"
    );
    assert!(
        after_return < TICK_MS,
        "HALTED {after_return} ms after virsh destroy returned: not faster than one tick ({TICK_MS} ms)"
    );
    let st = d.status();
    assert_eq!(st["state"], "halted", "{st}");
    assert!(
        st["backend_details"]["libvirt_events"]["received"]
            .as_u64()
            .unwrap()
            >= 1,
        "{st}"
    );

    // HALTED holds: libvirt refuses to start the domain (backstop's hook), naming backstop and
    // the way out.
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();
    let marker = Path::new("/var/lib/backstop/halted").join(&uuid);
    assert!(marker.exists(), "no HALTED record for the hook");
    let start = virsh(&["start", &dom.name]);
    let err = String::from_utf8_lossy(&start.stderr).to_string();
    eprintln!("virsh start of a HALTED domain: {}", err.trim());
    assert!(!start.status.success(), "a HALTED domain started");
    assert!(
        err.contains("is HALTED") && err.contains("halt clear") && err.contains("vm 'lv'"),
        "{err}"
    );
    assert!(virsh_text(&["domstate", &dom.name]).contains("shut off"));
    // A person clears it: the record goes, the domain is restored and runs.
    d.ok(&["halt", "clear", "--reason", "e2e: cleared"]);
    assert!(!marker.exists(), "the HALTED record outlived halt clear");
    assert_eq!(d.status()["state"], "running");
    dom.renice();

    // Without the hook (its record removed by hand), someone starts a HALTED domain: halt
    // clear says so and ends nothing.
    virsh_text(&["destroy", &dom.name]);
    d.wait_status("HALTED again", STEP, |s| s["state"] == "halted");
    std::fs::remove_file(&marker).unwrap();
    virsh_text(&["start", &dom.name]);
    let theirs = dom.pid();
    let out = d.cli(&["halt", "clear", "--reason", "e2e: theirs runs"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("halt clear with a domain started outside: {doc}");
    assert_eq!(doc["error"]["code"], "ERR_VM_BUSY", "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains("started outside backstop while HALTED"),
        "{doc}"
    );
    assert_eq!(
        dom.pid(),
        theirs,
        "halt clear ended a domain someone started"
    );
    assert_eq!(d.status()["state"], "halted");
    d.kill9();
}

/// The pause: after each background snapshot of an adopted domain, its QEMU's guest RAM is mapped
/// in huge pages again (QEMU's snapshot splits them all; see crates/backstop-qmp/src/huge_pages.rs
/// and tests/huge_pages.rs for the QEMU backend).
#[test]
fn libvirt_guest_ram_is_mapped_huge_again_after_each_snapshot() {
    let test = "libvirt_guest_ram_is_mapped_huge_again_after_each_snapshot";
    if skip_unless_libvirt(test) {
        return;
    }
    if backstop_e2e::skip_unless_huge_pages(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-huge", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-huge",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();
    let adopted = d.wait_journal(STEP, "vm.adopted", |e| e["event"] == "vm.adopted");
    assert_eq!(adopted["fields"]["capture_mode"], "bg");
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    for i in 0..3 {
        if i > 0 {
            d.ok(&["snapshot", "create", "--reason", "huge pages"]);
        }
        let (rss, huge, took) =
            backstop_e2e::wait_guest_ram_huge(u64::from(pid), Duration::from_secs(30));
        eprintln!(
            "libvirt snapshot {i}: resident {} MiB, huge {} MiB again after {} ms",
            rss >> 20,
            huge >> 20,
            took.as_millis()
        );
        assert!(
            huge * 2 >= rss && rss > 0,
            "snapshot {i}: the domain's guest RAM was not mapped huge again: resident {rss}, \
             huge {huge}; log:\n{}",
            backstop_e2e::tail(&d.log(), 20)
        );
        assert_eq!(dom.pid(), pid, "one QEMU instance");
    }
    assert!(virsh_text(&["domstate", &dom.name]).contains("running"));
    d.kill9();
}

/// Every file under `dir` (recursively) with its inode, size and mtime.
fn files_with_identity(dir: &Path) -> std::collections::BTreeMap<PathBuf, (u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.insert(e.path(), (m.ino(), m.size(), m.mtime(), m.mtime_nsec()));
            }
        }
    }
    out
}

/// Waits until VM `vm` of a many-VM daemon journals `event`; returns the entry.
fn wait_vm_event(d: &Daemon, vm: &str, what: &str, event: &str) -> Value {
    let deadline = Instant::now() + STEP;
    loop {
        if let Some(e) = d.vm_journal(vm).into_iter().find(|e| e["event"] == event) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no {event}; log:\n{}",
            backstop_e2e::tail(&d.log(), 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The disk `vda`'s writable top layer as libvirt runs it.
fn live_vda(dom: &TestDomain) -> PathBuf {
    virsh_text(&["domblklist", &dom.name])
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("vda")
                .map(|p| PathBuf::from(p.trim()))
        })
        .unwrap()
}

/// One guardian per domain, and nothing of the operator's ever replaced:
/// - two VM files of one daemon naming one domain: one adopts it, the other is refused with
///   `ERR_VM_ALREADY_GUARDED` naming the first; a second daemon on another state dir is
///   refused the same way and writes nothing; the domain's `<metadata>` names its guardian;
/// - the guardian's snapshots and rollbacks work on;
/// - the obvious state reset (the VM's state moved aside, the daemon restarted): the domain
///   is adopted again on a new lineage, the files it finds in its layers directory are
///   journaled and left exactly as they were (inode, size, mtime) through three snapshots, a
///   rollback and a prune, and the guest's RAM and disk land at one instant.
#[test]
fn libvirt_one_guardian_per_domain_and_a_state_reset_replaces_no_layer() {
    let test = "libvirt_one_guardian_per_domain_and_a_state_reset_replaces_no_layer";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-guard", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let uuid = virsh_text(&["domuuid", &dom.name]).trim().to_string();

    // One daemon, two VM files for the same domain.
    let (name, root) = (dom.name.clone(), dom.dir.clone());
    let mut d = Daemon::prepare_custom(
        "lv-guard",
        &move |s: &Path, r: &Path| {
            let vms = s.parent().unwrap().join("vms.d");
            std::fs::create_dir_all(&vms).unwrap();
            for vm in ["lva", "lvb"] {
                std::fs::write(
                    vms.join(format!("{vm}.toml")),
                    format!(
                        "[vm]\nname = \"{vm}\"\nbackend = \"libvirt\"\n\n[vm.libvirt]\n\
                         uri = \"qemu:///system\"\ndomain = \"{name}\"\nlayers_dir = \"{}\"\n\n\
                         [watchdog]\nheartbeat_timeout_s = 30\nboot_grace_s = 120\n",
                        root.join(format!("layers-{vm}")).display()
                    ),
                )
                .unwrap();
            }
            format!(
                "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\n",
                s.display(),
                r.display(),
                vms.display()
            )
        },
        &[],
    );
    d.launch_answering();
    let adopted_by = |vm: &str| d.vm_journal(vm).iter().any(|e| e["event"] == "vm.adopted");
    let deadline = Instant::now() + STEP;
    while !(adopted_by("lva") || adopted_by("lvb")) {
        assert!(Instant::now() < deadline, "no adoption; log:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let (winner, loser) = if adopted_by("lva") {
        ("lva", "lvb")
    } else {
        ("lvb", "lva")
    };
    let refusal = {
        let deadline = Instant::now() + STEP;
        loop {
            let log = d.log();
            if let Some(l) = log
                .lines()
                .find(|l| l.contains("could not start") && l.contains(loser))
            {
                break l.to_string();
            }
            assert!(
                Instant::now() < deadline,
                "{loser} not refused; log:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    eprintln!("second VM file: {refusal}");
    assert!(refusal.contains("ERR_VM_ALREADY_GUARDED"), "{refusal}");
    assert!(
        refusal.contains(&format!(
            "vm '{winner}' of backstopd pid {}",
            d.pid().unwrap()
        )),
        "the refusal names the first guardian: {refusal}"
    );
    assert!(!adopted_by(loser), "{loser} must not adopt");
    let vms = d.ok(&["vms"]);
    eprintln!("vms: {vms}");
    assert!(vms.to_string().contains("ERR_VM_ALREADY_GUARDED"), "{vms}");
    wait_vm_event(&d, winner, "baseline", "snapshot.create.completed");
    assert_eq!(dom.pid(), pid, "adopted, not restarted");
    let xml = virsh_text(&["dumpxml", &dom.name]);
    assert!(
        xml.contains("urn:backstop:guard:1") && xml.contains(&format!("vm=\"{winner}\"")),
        "the domain's metadata names its guardian: {xml}"
    );

    // A second daemon, another state dir, the same domain: refused, nothing written.
    let (name, l2) = (dom.name.clone(), dom.dir.join("layers-other"));
    let mut other = Daemon::prepare_custom(
        "lv-guard2",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    other.launch_answering();
    let st = other.cli(&["status"]);
    let text = String::from_utf8_lossy(&st.stdout).to_string();
    assert!(text.contains("ERR_VM_ALREADY_GUARDED"), "{text}");
    let log = other.log();
    let line = log.lines().find(|l| l.contains("could not start")).unwrap();
    eprintln!("second daemon: {line}");
    assert!(
        line.contains(&format!("vm '{winner}'")) && line.contains(&uuid),
        "{line}"
    );
    assert!(
        !other.journal_path().exists(),
        "the refused daemon journaled"
    );
    assert!(!dom.dir.join("layers-other").exists(), "layers dir created");
    assert_eq!(dom.pid(), pid);
    other.kill9();

    // The guardian works on.
    let a = d.ok_vm(winner, &["snapshot", "create", "--reason", "e2e: guarded"]);
    let a = a["summary"]["snapshot_id"].as_str().unwrap().to_string();

    // A disk switched outside backstop (a person's disk-only snapshot): drift, HIGH, and the
    // next capture refused with its code, nothing published; a rollback puts the disks back on
    // backstop's chain and the drift resolves.
    let outside = dom.dir.join("outside-overlay.qcow2");
    virsh_text(&[
        "snapshot-create-as",
        &dom.name,
        "--disk-only",
        "--no-metadata",
        "--atomic",
        "--diskspec",
        &format!("vda,file={}", outside.display()),
    ]);
    assert_eq!(live_vda(&dom), outside);
    let listed = d.ok_vm(winner, &["snapshot", "list"])["snapshots"]
        .as_array()
        .unwrap()
        .len();
    let out = d.cli_vm(
        winner,
        &["snapshot", "create", "--reason", "e2e: after virsh"],
    );
    assert!(!out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("capture after a disk switched outside: {doc}");
    assert_eq!(doc["error"]["code"], "ERR_DRIFT_DISK_ACTIVE_LAYER", "{doc}");
    let drift = wait_vm_event(&d, winner, "layer drift", "DriftDetectedEvent");
    assert_eq!(
        drift["fields"]["invariant_id"], "disk.active_layer",
        "{drift}"
    );
    assert_eq!(drift["fields"]["severity"], "HIGH", "{drift}");
    assert_eq!(
        d.ok_vm(winner, &["snapshot", "list"])["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        listed,
        "nothing published"
    );
    d.ok_vm(
        winner,
        &["rollback", "--to", &a, "--reason", "e2e: guarded rollback"],
    );
    dom.renice();
    wait_vm_event(&d, winner, "layer drift resolved", "DriftResolvedEvent");
    assert_ne!(live_vda(&dom), outside, "back on backstop's chain");
    assert!(outside.exists(), "the operator's overlay is left alone");

    // The state reset: stop, move the VM's state aside, keep one VM file, start again.
    let layers = dom.dir.join(format!("layers-{winner}"));
    d.stop();
    assert!(
        !virsh_text(&["dumpxml", &dom.name]).contains("urn:backstop:guard:1"),
        "a clean stop removes the guard mark"
    );
    let before = files_with_identity(&layers);
    assert!(before.len() >= 3, "{before:?}");
    let live_top = live_vda(&dom);
    let aside = d.state_dir().join("vms").join(format!("{winner}.aside"));
    std::fs::rename(d.vm_state_dir(winner), &aside).unwrap();
    std::fs::remove_file(d.dir.path().join(format!("vms.d/{loser}.toml"))).unwrap();
    d.launch();
    let found = wait_vm_event(
        &d,
        winner,
        "foreign layers journaled",
        "layers.foreign_found",
    );
    eprintln!("layers.foreign_found: {}", found["fields"]);
    assert_eq!(
        found["fields"]["count"],
        before.len(),
        "{}",
        found["fields"]
    );
    wait_vm_event(&d, winner, "new baseline", "snapshot.create.completed");
    let mut last = String::new();
    for i in 0..3 {
        let v = d.ok_vm(
            winner,
            &[
                "snapshot",
                "create",
                "--reason",
                &format!("e2e: after reset {i}"),
            ],
        );
        last = v["summary"]["snapshot_id"].as_str().unwrap().to_string();
    }
    let show = d.ok_vm(winner, &["snapshot", "show", &last]);
    let snap_disk = disk_sector0(&frozen_vda_top(&show));
    dom.wait_ticks(0, "guest moving on", |t| {
        t.last().is_some_and(|t| t.ram >= snap_disk + 3)
    });
    let from = dom.serial().len();
    d.ok_vm(
        winner,
        &[
            "rollback",
            "--to",
            &last,
            "--reason",
            "e2e: after the reset",
        ],
    );
    dom.renice();
    let after = dom.wait_ticks(from, "restored guest ticking", |t| {
        t.iter().skip_while(|t| t.ram > snap_disk + 1).count() >= 2
    });
    let restored: Vec<Tick> = after
        .into_iter()
        .skip_while(|t| t.ram > snap_disk + 1)
        .collect();
    assert_eq!(
        restored[0].ram, restored[0].disk,
        "RAM and disk at one instant: {restored:?}"
    );
    d.ok_vm(winner, &["snapshot", "prune"]);
    // Every file that was there is there as it was; the one the guest was writing at the reset
    // (the live top) only grew, and is the same file.
    let now = files_with_identity(&layers);
    for (p, id) in &before {
        let seen = now
            .get(p)
            .unwrap_or_else(|| panic!("{} is gone", p.display()));
        if *p == live_top {
            assert_eq!(seen.0, id.0, "the live top is the same file");
            assert!(seen.1 >= id.1, "the live top was not truncated");
        } else {
            assert_eq!(seen, id, "{} changed", p.display());
        }
    }
    assert!(
        aside.join("audit/journal.jsonl").exists(),
        "the old evidence is kept"
    );
    d.ok_vm(winner, &["audit", "verify"]);
}

/// Never harm the adopted domain:
/// - a file at the next overlay's name is refused with `ERR_LAYER_EXISTS` and left byte for
///   byte; the next capture takes another name;
/// - `reload` of a changed VM file of an adopted domain applies it live: the old actor's clean
///   stop records the domain and the new one re-attaches to it as it runs (same QEMU, epoch
///   unchanged, no rollback, the guest's writes kept); a change naming another domain is not
///   applied and says why and what applying it takes;
/// - with `after_crash = "reattach"`, a start after kill -9 re-attaches to the domain as it
///   ran unwatched, journaled with the window; when the domain is not the one last guarded
///   (another QEMU process), the re-attach is refused naming why and the VM rolls back.
#[test]
fn libvirt_reload_applies_live_and_after_crash_reattach_is_the_operators_choice() {
    let test = "libvirt_reload_applies_live_and_after_crash_reattach_is_the_operators_choice";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let dom = TestDomain::start("bs-e2e-reload", &|x| x);
    dom.wait_ticks(0, "guest booting under libvirt", |t| t.len() >= 3);
    let pid = dom.pid();
    let (name, root) = (dom.name.clone(), dom.dir.clone());
    let vm_file = move |timeout: u32, domain: &str, extra: &str| {
        format!(
            "[vm]\nname = \"lvr\"\nbackend = \"libvirt\"\n\n[vm.libvirt]\n\
             uri = \"qemu:///system\"\ndomain = \"{domain}\"\nlayers_dir = \"{}\"\n{extra}\n\n\
             [watchdog]\nheartbeat_timeout_s = {timeout}\nboot_grace_s = 120\n",
            root.join("layers").display()
        )
    };
    let first = vm_file(30, &name, "");
    let mut d = Daemon::prepare_custom(
        "lv-reload",
        &move |s: &Path, r: &Path| {
            let vms = s.parent().unwrap().join("vms.d");
            std::fs::create_dir_all(&vms).unwrap();
            std::fs::write(vms.join("lvr.toml"), &first).unwrap();
            format!(
                "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\n",
                s.display(),
                r.display(),
                vms.display()
            )
        },
        &[],
    );
    d.launch_answering();
    wait_vm_event(&d, "lvr", "baseline", "snapshot.create.completed");
    let file = d.dir.path().join("vms.d/lvr.toml");
    let rollbacks = |d: &Daemon| events(&d.vm_journal("lvr"), "rollback.completed").len();

    // Someone's file at the name of the next overlay: the capture is refused with a code and
    // the file stays byte for byte as it was; the next capture takes another name.
    let rec: Value = serde_json::from_slice(
        &std::fs::read(d.vm_state_dir("lvr").join("vm-state.json")).unwrap(),
    )
    .unwrap();
    let planted = dom.dir.join("layers/vda").join(format!(
        "{}-{:06}.qcow2",
        rec["lineage"].as_str().unwrap(),
        rec["next_layer"].as_u64().unwrap() + 1
    ));
    std::fs::write(&planted, b"an operator's file, not backstop's\n").unwrap();
    let out = d.cli_vm(
        "lvr",
        &["snapshot", "create", "--reason", "e2e: name taken"],
    );
    assert!(!out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("overlay name taken: {doc}");
    assert_eq!(doc["error"]["code"], "ERR_LAYER_EXISTS", "{doc}");
    assert_eq!(
        std::fs::read(&planted).unwrap(),
        b"an operator's file, not backstop's\n"
    );
    d.ok_vm("lvr", &["snapshot", "create", "--reason", "e2e: next name"]);
    assert_ne!(live_vda(&dom), planted);
    assert_eq!(dom.pid(), pid);
    let epoch = d.ok_vm("lvr", &["status"])["epoch"].clone();

    // A changed watchdog and the crash choice: applied by a re-attach, nothing rolled back.
    std::fs::write(&file, vm_file(31, &dom.name, "after_crash = \"reattach\"")).unwrap();
    let last_before = parse_ticks(&dom.serial()).last().copied().unwrap();
    let r = d.ok(&["reload"]);
    eprintln!("reload: {r}");
    assert_eq!(r["applied"], serde_json::json!(["lvr"]), "{r}");
    let re = wait_vm_event(&d, "lvr", "re-attached by the reload", "vm.reattached");
    assert_eq!(re["fields"]["after"], "clean_stop", "{re}");
    assert_eq!(re["fields"]["compared"]["pid"], pid, "{re}");
    assert_eq!(dom.pid(), pid, "the same QEMU after the reload");
    assert_eq!(rollbacks(&d), 0, "no rollback for a reload");
    assert_eq!(
        d.ok_vm("lvr", &["status"])["epoch"],
        epoch,
        "epoch unchanged"
    );
    assert!(d
        .daemon_journal()
        .iter()
        .any(|e| e["event"] == "vm.reconfigured"));
    let from = dom.serial().len();
    let on = dom.wait_ticks(from, "guest on after the reload", |t| t.len() >= 2);
    assert!(
        on[0].disk >= last_before.disk,
        "the guest went on from where it was ({last_before:?} then {on:?})"
    );

    // Another domain is another adoption: not applied, and the reason says what it takes.
    std::fs::write(
        &file,
        vm_file(31, "bs-e2e-other", "after_crash = \"reattach\""),
    )
    .unwrap();
    let r = d.ok(&["reload"]);
    eprintln!("reload of another domain: {r}");
    assert_eq!(r["changed_not_applied"], serde_json::json!(["lvr"]), "{r}");
    let why = r["not_applied_why"][0][1].as_str().unwrap_or_default();
    assert!(
        why.contains("vm.libvirt.domain changed") && why.contains("new adoption"),
        "{r}"
    );
    assert_eq!(dom.pid(), pid);
    std::fs::write(&file, vm_file(31, &dom.name, "after_crash = \"reattach\"")).unwrap();

    // kill -9 with `after_crash = "reattach"`: the same domain is guarded again as it ran,
    // and the journal names how long it ran unwatched.
    let guarded = d.ok_vm("lvr", &["status"])["epoch"].clone();
    d.kill9();
    let last_before = parse_ticks(&dom.serial()).last().copied().unwrap();
    d.launch();
    let re = {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(e) = d
                .vm_journal("lvr")
                .into_iter()
                .find(|e| e["event"] == "vm.reattached" && e["fields"]["after"] == "crash")
            {
                break e;
            }
            assert!(
                Instant::now() < deadline,
                "no re-attach after the crash; log:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    eprintln!("after a crash: {}", re["fields"]);
    assert!(
        re["fields"]["unwatched_since"]
            .as_str()
            .is_some_and(|s| s.starts_with("20")),
        "the window is journaled: {re}"
    );
    assert_eq!(dom.pid(), pid, "the same QEMU");
    assert_eq!(rollbacks(&d), 0, "no rollback after the chosen re-attach");
    assert_eq!(d.ok_vm("lvr", &["status"])["epoch"], guarded);
    let from = dom.serial().len();
    let on = dom.wait_ticks(from, "guest on after the crash", |t| t.len() >= 2);
    assert!(
        on[0].disk >= last_before.disk,
        "{last_before:?} then {on:?}"
    );

    // kill -9, and the domain restarted by hand meanwhile: not the one last guarded.
    d.kill9();
    virsh_text(&["destroy", &dom.name]);
    virsh_text(&["start", &dom.name]);
    dom.renice();
    let new_pid = dom.pid();
    assert_ne!(new_pid, pid);
    d.launch();
    let refused =
        {
            let deadline = Instant::now() + STEP;
            loop {
                if let Some(e) = d.vm_journal("lvr").into_iter().find(|e| {
                    e["event"] == "vm.reattach_refused" && e["fields"]["after"] == "crash"
                }) {
                    break e;
                }
                assert!(Instant::now() < deadline, "no refusal; log:\n{}", d.log());
                std::thread::sleep(Duration::from_millis(200));
            }
        };
    eprintln!("another QEMU after a crash: {}", refused["fields"]);
    assert!(
        refused["fields"]["differs"]
            .to_string()
            .contains("QEMU pid"),
        "{refused}"
    );
    let deadline = Instant::now() + STEP;
    while rollbacks(&d) == 0 {
        assert!(
            Instant::now() < deadline,
            "no fail-closed rollback; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    dom.renice();
    d.ok_vm("lvr", &["audit", "verify"]);
}

/// The guest's clock as its qemu-ga reads it, minus the host's (ms), asked through virsh.
fn guest_clock_skew_ms(dom: &TestDomain) -> i64 {
    let out = virsh_text(&[
        "qemu-agent-command",
        &dom.name,
        r#"{"execute":"guest-get-time"}"#,
    ]);
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    v["return"].as_i64().unwrap() / 1_000_000 - host
}

/// A stock guest: the domain has only the QEMU guest agent's channel — no backstop channel,
/// no watchdog device — and the guest runs Debian's qemu-ga and nothing of backstop's. It is
/// adopted (`auto` picks qemu-ga), its pongs through libvirt keep it running, it is
/// snapshotted and rolled back, and the restored guest's clock is set to the host's (the skew
/// corrected is reported); when qemu-ga stops answering, the watchdog rolls it back within the
/// timeout and 2 s.
#[test]
fn libvirt_a_guest_with_only_qemu_ga_is_guarded_and_its_clock_set_after_rollback() {
    let test = "libvirt_a_guest_with_only_qemu_ga_is_guarded_and_its_clock_set_after_rollback";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    const STOP_AT_S: u64 = 50;
    const TIMEOUT_S: u64 = 5;
    let dom = TestDomain::start("bs-e2e-qga", &|x| {
        x.replace(
            "name='org.backstop.agent.0'",
            "name='org.qemu.guest_agent.0'",
        )
        .replace("agent.sock", "qga.sock")
        .replace("<watchdog model='i6300esb' action='pause'/>", "")
        .replace(
            "no_timer_check</cmdline>",
            &format!("no_timer_check backstop.qga=1 backstop.hb=off backstop.qga_stop_at={STOP_AT_S}</cmdline>"),
        )
    });
    let xml = virsh_text(&["dumpxml", &dom.name]);
    assert!(
        xml.contains("org.qemu.guest_agent.0")
            && !xml.contains("org.backstop.agent.0")
            && !xml.contains("i6300esb"),
        "a stock domain: {xml}"
    );
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-qga",
        &move |s: &Path, r: &Path| {
            config(s, r, &name, "", &l2).replace(
                "heartbeat_timeout_s = 30",
                &format!("heartbeat_timeout_s = {TIMEOUT_S}"),
            )
        },
        &[],
    );
    d.launch_answering();
    let fresh = |s: &Value| s["heartbeat_age_ms"].as_u64().is_some_and(|a| a < 3000);
    let st = d.wait_status("a pong through libvirt", BOOT, fresh);
    eprintln!("adopted: {}", st["backend_details"]);
    assert_eq!(st["backend_details"]["heartbeat_source"], "qemu-ga", "{st}");
    assert_eq!(st["backend_details"]["watchdog_device"], false, "{st}");
    dom.wait_ticks(0, "guest ticking", |t| t.len() >= 2);
    let snap = d.ok(&["snapshot", "create", "--reason", "e2e: stock guest"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    // Time passes; the snapshot's clock stays where it was.
    std::thread::sleep(Duration::from_secs(8));
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        assert!(fresh(&d.status()), "pongs keep it alive");
    }
    assert!(events(&d.journal(), "rollback.completed").is_empty());

    let rb = d.ok(&["rollback", "--to", &id, "--reason", "e2e: stock guest back"]);
    assert_eq!(rb["epoch"], 1, "{rb}");
    dom.renice();
    let st = d.wait_status("clock set after the rollback", STEP, |s| {
        s["backend_details"]["clock_resynced"] == true && fresh(s)
    });
    eprintln!("after the rollback: {}", st["backend_details"]);
    let corrected = st["backend_details"]["clock_skew_ms"].as_i64().unwrap();
    assert!(
        corrected >= 5_000,
        "the restored clock was behind by the time since the snapshot: {corrected} ms"
    );
    let skew = guest_clock_skew_ms(&dom);
    assert!(skew.abs() <= 2_000, "guest clock {skew} ms off the host's");

    // qemu-ga stops answering (the guest kills it at uptime STOP_AT_S): the watchdog rolls
    // the domain back within the timeout and 2 s.
    let from = dom.serial().len();
    let deadline = Instant::now() + Duration::from_secs(STOP_AT_S + 60);
    let stopped_at = loop {
        if dom.serial()[from..].contains("BACKSTOP qemu-ga stopped") {
            break std::time::SystemTime::now();
        }
        assert!(
            Instant::now() < deadline,
            "qemu-ga never stopped:\n{}",
            dom.serial()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let fired = d.wait_journal(
        Duration::from_secs(TIMEOUT_S + 30),
        "watchdog rollback",
        |e| e["event"] == "rollback.completed" && e["fields"]["trigger"] == "watchdog_timeout",
    );
    let requested = d
        .journal()
        .into_iter()
        .find(|e| {
            e["fields"]["trace_id"] == fired["fields"]["trace_id"]
                && e["event"] == "rollback.initiated"
        })
        .expect("the watchdog rollback's start");
    let at_ms = journal_ts_ms(requested["ts"].as_str().unwrap());
    let stop_ms = stopped_at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let after = at_ms - stop_ms;
    eprintln!("watchdog fired {after} ms after qemu-ga stopped (timeout {TIMEOUT_S} s)");
    assert!(
        after <= (TIMEOUT_S as i64 + 2) * 1000,
        "the watchdog took {after} ms"
    );
    assert_eq!(fired["fields"]["rollback_type"], "emergency");
    dom.renice();
    d.wait_status("pongs after the watchdog rollback", STEP, fresh);
    d.ok(&["audit", "verify"]);
}

/// `backstop vm check FILE` asks libvirt and the host and lists exactly what is missing, each
/// with its fix, changing nothing; as each is fixed in turn (the domain started, qemu-ga's
/// channel attached live, `capture = "precopy"` for a host without userfaultfd) it drops off,
/// and a ready file exits 0 with what guarding it would choose.
#[test]
fn libvirt_vm_check_lists_exactly_what_is_missing() {
    let test = "libvirt_vm_check_lists_exactly_what_is_missing";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("0");
    let dom = TestDomain::start("bs-e2e-check", &|x| {
        x.replace("name='org.backstop.agent.0'", "name='org.other.0'")
    });
    virsh_text(&["destroy", &dom.name]);
    let mut d = Daemon::prepare_custom(
        "lv-check",
        &move |s: &Path, r: &Path| {
            let vms = s.parent().unwrap().join("vms.d");
            std::fs::create_dir_all(&vms).unwrap();
            format!(
                "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\n",
                s.display(),
                r.display(),
                vms.display()
            )
        },
        &[],
    );
    d.launch_answering();
    let file = dom.dir.join("lvc.toml");
    let write = |extra: &str| {
        std::fs::write(
            &file,
            format!(
                "[vm]\nname = \"lvc\"\nbackend = \"libvirt\"\n\n[vm.libvirt]\nuri = \"qemu:///system\"\n\
                 domain = \"{}\"\nlayers_dir = \"{}\"\n{extra}\n",
                dom.name,
                dom.layers().display()
            ),
        )
        .unwrap();
    };
    let check = |d: &Daemon| {
        let out = d.cli(&["vm", "check", file.to_str().unwrap()]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        (out.status.code().unwrap(), doc)
    };
    let xml_before = virsh_text(&["dumpxml", "--inactive", &dom.name]);
    write("");
    let (code, doc) = check(&d);
    eprintln!("shut off, no channel, no userfaultfd: {doc}");
    let problems: Vec<String> = doc["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    assert_eq!(code, 1, "{doc}");
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems.iter().any(|p| p.contains("no heartbeat channel")
        && p.contains("org.qemu.guest_agent.0")
        && p.contains("virsh attach-device")));
    assert!(problems.iter().any(|p| p.contains("is not running")));
    assert!(problems
        .iter()
        .any(|p| p.contains("vm.unprivileged_userfaultfd = 0")
            && p.contains("capture = \"precopy\"")));
    assert_eq!(
        virsh_text(&["dumpxml", "--inactive", &dom.name]),
        xml_before,
        "vm check changed the domain"
    );
    assert!(!dom.layers().exists(), "vm check made the layers dir");

    virsh_text(&["start", &dom.name]);
    dom.renice();
    let (_, doc) = check(&d);
    assert_eq!(doc["problems"].as_array().unwrap().len(), 2, "{doc}");

    let chan = dom.dir.join("qga-channel.xml");
    std::fs::write(
        &chan,
        "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>",
    )
    .unwrap();
    virsh_text(&[
        "attach-device",
        &dom.name,
        chan.to_str().unwrap(),
        "--live",
        "--config",
    ]);
    let (_, doc) = check(&d);
    eprintln!("channel attached live: {doc}");
    let problems = doc["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 1, "{doc}");
    assert!(
        problems[0].as_str().unwrap().contains("userfaultfd"),
        "{doc}"
    );

    write("capture = \"precopy\"");
    let (code, doc) = check(&d);
    eprintln!("ready: {doc}");
    assert_eq!(code, 0, "{doc}");
    assert!(doc["problems"].as_array().unwrap().is_empty(), "{doc}");
    let notes = doc["notes"].to_string();
    assert!(
        notes.contains("heartbeat: qemu-ga") && notes.contains("capture: precopy"),
        "{notes}"
    );
    d.kill9();
}

#[path = "libvirt/nics.rs"]
mod nics;
