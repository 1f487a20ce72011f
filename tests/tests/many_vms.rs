//! Several VMs in one daemon: each snapshots and rolls back on its own, a rollback of one leaves
//! the others' guests running, at most `max_concurrent_captures` captures overlap, a refused VM
//! file or a panicking actor takes down only its own VM, and the console names VMs.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{parse_ticks, skip_unless_ready, Daemon};
use serde_json::Value;

fn ticks_of(d: &Daemon, vm: &str) -> Vec<backstop_e2e::Tick> {
    parse_ticks(&d.vm_serial(vm))
}

/// Waits until VM `vm` printed a tick with `ram >= min`.
fn wait_vm_tick(d: &Daemon, vm: &str, min: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ticks_of(d, vm).iter().any(|t| t.ram >= min) {
        assert!(
            Instant::now() < deadline,
            "{vm}: no tick >= {min}; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn event_times(d: &Daemon, vm: &str, event: &str, trigger: Option<&str>) -> Vec<(String, String)> {
    d.vm_journal(vm)
        .into_iter()
        .filter(|e| e["event"] == event)
        .filter(|e| trigger.is_none_or(|t| e["fields"]["trigger"] == t))
        .map(|e| {
            (
                e["ts"].as_str().unwrap().to_string(),
                e["fields"]["trace_id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

fn code_of(out: &std::process::Output) -> String {
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["error"]["code"].as_str().unwrap_or("").to_string()
}

#[test]
fn three_vms_snapshot_and_roll_back_independently_and_fail_alone() {
    if skip_unless_ready("three_vms_snapshot_and_roll_back_independently_and_fail_alone") {
        return;
    }
    let mut d = Daemon::start_many(
        "many",
        &["a", "b", "c"],
        "max_concurrent_captures = 1",
        &[
            ("broken.toml", "[vm]\nname = \"broken\"\nmemory_mib = "),
            (
                "named.toml",
                "[vm]\nname = \"other\"\nmemory_mib = 128\nkernel = \"/k\"\n",
            ),
        ],
        &[("BACKSTOP_FAULT_INJECT", "actor.panic-on-snapshot=c")],
    );

    // The console lists every VM, the refused ones with their reason.
    let vms = d.ok(&["vms"]);
    let list = vms["vms"].as_array().unwrap();
    let state = |n: &str| -> Value {
        list.iter()
            .find(|v| v["name"] == n)
            .cloned()
            .unwrap_or(Value::Null)
    };
    for n in ["a", "b", "c"] {
        assert!(
            matches!(state(n)["state"].as_str(), Some("running" | "snapshotting")),
            "{n}: {vms}"
        );
    }
    assert_eq!(state("broken")["state"], "config_invalid", "{vms}");
    assert_eq!(state("named")["state"], "config_invalid", "{vms}");
    assert!(
        state("named")["reason"]
            .as_str()
            .unwrap()
            .contains("must be the same"),
        "{vms}"
    );
    assert!(d
        .daemon_journal()
        .iter()
        .any(|e| e["event"] == "vm.config_invalid" && e["fields"]["vm"] == "broken"));

    // Without --vm the daemon names the VMs; an unknown or refused VM is a clear error.
    let out = d.cli(&["status"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(code_of(&out), "ERR_VM_NOT_NAMED");
    assert!(String::from_utf8_lossy(&out.stdout).contains("a, b, broken, c, named"));
    assert_eq!(code_of(&d.cli_vm("zz", &["status"])), "ERR_VM_NOT_FOUND");
    // A refused VM's status says what it is and why; what needs it running is refused.
    let st = d.ok_vm("broken", &["status"]);
    assert_eq!(st["state"], "config_invalid", "{st}");
    assert!(st["not_running"]["code"].is_string(), "{st}");
    assert_eq!(
        code_of(&d.cli_vm("broken", &["snapshot", "list"])),
        "ERR_VM_NOT_RUNNING"
    );

    for vm in ["a", "b"] {
        wait_vm_tick(&d, vm, 3);
        assert_eq!(d.ok_vm(vm, &["status"])["vm"], vm);
    }

    // Snapshots of a and b asked for at once: with one capture slot they never overlap.
    let (sa, sb) = std::thread::scope(|s| {
        let a = s.spawn(|| d.ok_vm("a", &["snapshot", "create", "--reason", "together"]));
        let b = s.spawn(|| d.ok_vm("b", &["snapshot", "create", "--reason", "together"]));
        (a.join().unwrap(), b.join().unwrap())
    });
    let span = |vm: &str, id: &Value| {
        let journal = d.vm_journal(vm);
        let done = journal
            .iter()
            .find(|e| {
                e["event"] == "snapshot.create.completed" && e["fields"]["snapshot_id"] == *id
            })
            .unwrap();
        let trace = done["fields"]["trace_id"].clone();
        let started = journal
            .iter()
            .find(|e| e["event"] == "snapshot.create.requested" && e["fields"]["trace_id"] == trace)
            .unwrap();
        (
            started["ts"].as_str().unwrap().to_string(),
            done["ts"].as_str().unwrap().to_string(),
        )
    };
    let (a0, a1) = span("a", &sa["summary"]["snapshot_id"]);
    let (b0, b1) = span("b", &sb["summary"]["snapshot_id"]);
    assert!(
        a1 <= b0 || b1 <= a0,
        "captures overlapped: a {a0}..{a1}, b {b0}..{b1}"
    );

    // Roll a back: its counter returns; b and c keep counting through it.
    let b_before = ticks_of(&d, "b").last().unwrap().ram;
    let c_before = ticks_of(&d, "c").len();
    wait_vm_tick(&d, "a", ticks_of(&d, "a").last().unwrap().ram + 3);
    let a_len = d.vm_serial("a").len();
    let a_before = ticks_of(&d, "a").last().unwrap().ram;
    let rolled = d.ok_vm(
        "a",
        &[
            "rollback",
            "--to",
            sa["summary"]["snapshot_id"].as_str().unwrap(),
            "--reason",
            "a only",
        ],
    );
    assert_eq!(rolled["snapshot_id"], sa["summary"]["snapshot_id"]);
    // a's counter went back to the snapshot point (its last tick before was 3 past it).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let after_a = parse_ticks(&d.vm_serial("a")[a_len..]);
        if let Some(back) = after_a.iter().find(|t| t.ram + 2 <= a_before) {
            assert_eq!(
                back.ram, back.disk,
                "a: RAM and disk from one instant: {after_a:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a did not go back: before {a_before}, after {after_a:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_vm_tick(&d, "b", b_before + 2);
    let deadline = Instant::now() + Duration::from_secs(60);
    while ticks_of(&d, "c").len() < c_before + 2 {
        assert!(
            Instant::now() < deadline,
            "c stopped counting during a's rollback"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        event_times(&d, "b", "rollback.completed", None).is_empty(),
        "b was rolled back"
    );
    assert_eq!(d.ok_vm("b", &["status"])["epoch"], 0);
    assert_eq!(d.ok_vm("a", &["status"])["epoch"], 1);

    // c's actor panics (injected): c alone is HALTED, durably; a and b run on.
    let out = d.cli_vm("c", &["snapshot", "create", "--reason", "boom"]);
    assert!(!out.status.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = d.ok_vm("c", &["status"]);
        if st["state"] == "halted" {
            assert_eq!(st["halted"]["code"], "ERR_VM_ACTOR_PANICKED", "{st}");
            assert!(st["pid"].is_null(), "c's guest must be ended: {st}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "c not HALTED after its actor panicked: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(d.vm_state_dir("c").join("halted.json").exists());
    let c_len = d.vm_serial("c").len();
    let (a_last, b_last) = (
        ticks_of(&d, "a").last().unwrap().ram,
        ticks_of(&d, "b").last().unwrap().ram,
    );
    wait_vm_tick(&d, "a", a_last + 2);
    wait_vm_tick(&d, "b", b_last + 2);
    assert_eq!(d.vm_serial("c").len(), c_len, "c's guest still runs");
    assert_eq!(
        code_of(&d.cli_vm("c", &["snapshot", "create", "--reason", "x"])),
        "ERR_VM_HALTED"
    );
    assert!(d.cli_vm("c", &["snapshot", "list"]).status.success());

    // A clean stop and start: a and b resume, c stays HALTED.
    d.stop();
    d.launch();
    for vm in ["a", "b"] {
        assert_eq!(
            d.vm_journal(vm)
                .iter()
                .filter(|e| e["event"] == "vm.resumed")
                .count(),
            1,
            "{vm} resumed once"
        );
    }
    assert_eq!(d.ok_vm("c", &["status"])["state"], "halted");
    // (c is HALTED: it answers only status and halt clear.)
    for vm in ["a", "b"] {
        d.ok_vm(vm, &["audit", "verify"]);
    }
    assert!(d
        .daemon_journal()
        .iter()
        .any(|e| e["event"] == "daemon.stopped"));

    // Reload: a new file starts its VM, a removed file stops its VM cleanly; a is undisturbed.
    let vms_dir = d.dir.path().join("vms.d");
    let a_file = std::fs::read_to_string(vms_dir.join("a.toml")).unwrap();
    std::fs::write(
        vms_dir.join("d.toml"),
        a_file.replace("name = \"a\"", "name = \"d\""),
    )
    .unwrap();
    std::fs::remove_file(vms_dir.join("b.toml")).unwrap();
    let a_epoch = d.ok_vm("a", &["status"])["epoch"].clone();
    // The two bad files are refused again: the reload exits 1 and says what it did all the same.
    let reload = || {
        let out = d.cli(&["reload"]);
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["refused"].as_array().map(Vec::len), Some(2), "{r}");
        r
    };
    let r = reload();
    assert_eq!(r["added"], serde_json::json!(["d"]), "{r}");
    assert_eq!(r["removed"], serde_json::json!(["b"]), "{r}");
    let names: Vec<String> = d.ok(&["vms"])["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    assert!(
        names.contains(&"d".to_string()) && !names.contains(&"b".to_string()),
        "{names:?}"
    );
    assert_eq!(code_of(&d.cli_vm("b", &["status"])), "ERR_VM_NOT_FOUND");
    wait_vm_tick(&d, "d", 2);
    let b_stop = d
        .vm_journal("b")
        .into_iter()
        .rfind(|e| e["event"] == "daemon.stopped")
        .unwrap();
    assert!(
        b_stop["fields"]["snapshot_id"].is_string(),
        "b stopped cleanly: {b_stop}"
    );
    assert_eq!(
        d.ok_vm("a", &["status"])["epoch"],
        a_epoch,
        "a was disturbed"
    );
    // A second reload with nothing changed changes nothing.
    let again = reload();
    assert_eq!(again["added"], serde_json::json!([]), "{again}");
    assert_eq!(again["removed"], serde_json::json!([]), "{again}");
}

/// Reload applies a changed VM file whose shape is the same (here the watchdog's timeout): that
/// VM is stopped cleanly and started on the new file, resuming from its final snapshot (the
/// guest's counter goes on, nothing is lost); a change of shape (memory) is not applied — its
/// snapshots could not restore into it — and that VM runs on untouched.
#[test]
fn reload_applies_a_changed_file_of_the_same_shape_and_keeps_the_guests_work() {
    if skip_unless_ready(
        "reload_applies_a_changed_file_of_the_same_shape_and_keeps_the_guests_work",
    ) {
        return;
    }
    let mut d = Daemon::start_many("reconf", &["a", "b"], "", &[], &[]);
    wait_vm_tick(&d, "a", 3);
    wait_vm_tick(&d, "b", 3);
    let vms_dir = d.dir.path().join("vms.d");
    let a_file = std::fs::read_to_string(vms_dir.join("a.toml")).unwrap();
    std::fs::write(
        vms_dir.join("a.toml"),
        format!("{a_file}\n[watchdog]\nheartbeat_timeout_s = 12\n"),
    )
    .unwrap();
    let b_file = std::fs::read_to_string(vms_dir.join("b.toml")).unwrap();
    assert!(b_file.contains("memory_mib = 192"));
    std::fs::write(
        vms_dir.join("b.toml"),
        b_file.replace("memory_mib = 192", "memory_mib = 256"),
    )
    .unwrap();
    let (a_pid, b_pid) = (
        d.ok_vm("a", &["status"])["pid"].as_u64().unwrap(),
        d.ok_vm("b", &["status"])["pid"].as_u64().unwrap(),
    );
    let a_last = ticks_of(&d, "a").last().unwrap().ram;

    let r = d.ok(&["reload"]);
    assert_eq!(r["applied"], serde_json::json!(["a"]), "{r}");
    assert_eq!(r["changed_not_applied"], serde_json::json!(["b"]), "{r}");
    assert!(d
        .daemon_journal()
        .iter()
        .any(|e| e["event"] == "vm.reconfigured" && e["fields"]["vm"] == "a"));
    // a: a new QEMU, resumed from the final snapshot of the clean stop, the counter goes on.
    let st = d.ok_vm("a", &["status"]);
    assert_eq!(st["state"], "running", "{st}");
    assert_ne!(st["pid"].as_u64(), Some(a_pid), "a was not restarted");
    assert_eq!(
        d.vm_journal("a")
            .iter()
            .filter(|e| e["event"] == "vm.resumed")
            .count(),
        1,
        "a did not resume from its final snapshot"
    );
    let from = d.vm_serial("a").len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        if let Some(t) = parse_ticks(&d.vm_serial("a")[from..]).first().copied() {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "a does not tick after the reload"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        first.ram > a_last && first.ram == first.disk,
        "a lost work or its disk: last tick before {a_last}, first after {first:?}"
    );
    // b: untouched.
    let st = d.ok_vm("b", &["status"]);
    assert_eq!(st["pid"].as_u64(), Some(b_pid), "b was restarted: {st}");
    // A reload with nothing new applies nothing again.
    let again = d.ok(&["reload"]);
    assert_eq!(again["applied"], serde_json::json!([]), "{again}");
    d.stop();
}

/// `backstop vms --watch` keeps the view live — one JSON line per refresh under `--json`, no
/// terminal escapes when stdout is not a terminal — and a daemon that goes away is shown as such
/// while the watch goes on.
#[test]
fn vms_watch_redraws_and_outlives_the_daemon() {
    if skip_unless_ready("vms_watch_redraws_and_outlives_the_daemon") {
        return;
    }
    use std::io::{BufRead, BufReader};
    let mut d = Daemon::start("watch");
    d.wait_tick(0, 1, Duration::from_secs(120));
    let mut watcher = std::process::Command::new(backstop_e2e::bin("backstop"))
        .arg("--socket")
        .arg(d.socket())
        .args(["--json", "vms", "--watch", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = watcher.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = || rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let mut frames = Vec::new();
    for _ in 0..2 {
        let line = next();
        assert!(
            !line.contains('\u{1b}'),
            "terminal escapes in a pipe: {line:?}"
        );
        let doc: Value = serde_json::from_str(&line).unwrap();
        assert!(doc["at"].is_string(), "{doc}");
        frames.push(doc);
    }
    let names: Vec<&str> = frames[1]["vms"]["vms"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", frames[1]))
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 1, "{}", frames[1]);
    assert_ne!(
        frames[0]["at"], frames[1]["at"],
        "a fresh frame each refresh"
    );
    d.stop();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc: Value = serde_json::from_str(&next()).unwrap();
        if doc["error"]["code"] == "ERR_CONTROL_UNAVAILABLE" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never showed the daemon gone: {doc}"
        );
    }
    assert!(
        watcher.try_wait().unwrap().is_none(),
        "the watch ended with the daemon"
    );
    watcher.kill().unwrap();
    let _ = watcher.wait();
}

/// SIGHUP is a reload (what `kill -HUP` and a classic `ExecReload` send), never an end: the
/// daemon process stays, the new VM file starts its VM, the running VM is undisturbed.
#[test]
fn sighup_reloads_the_vm_files_and_ends_nothing() {
    if skip_unless_ready("sighup_reloads_the_vm_files_and_ends_nothing") {
        return;
    }
    let mut d = Daemon::start_many("hup", &["a"], "", &[], &[]);
    wait_vm_tick(&d, "a", 2);
    let daemon_pid = d.pid().unwrap();
    let a_pid = d.ok_vm("a", &["status"])["pid"].clone();
    let vms_dir = d.dir.path().join("vms.d");
    let a_file = std::fs::read_to_string(vms_dir.join("a.toml")).unwrap();
    std::fs::write(
        vms_dir.join("e.toml"),
        a_file.replace("name = \"a\"", "name = \"e\""),
    )
    .unwrap();
    let st = std::process::Command::new("kill")
        .args(["-HUP", &daemon_pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = d.ok(&["vms"]);
        if v["vms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == "e")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "e never started: {v}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_vm_tick(&d, "e", 2);
    assert_eq!(d.pid(), Some(daemon_pid));
    assert!(
        std::path::Path::new(&format!("/proc/{daemon_pid}")).exists(),
        "SIGHUP ended the daemon"
    );
    assert_eq!(d.ok_vm("a", &["status"])["pid"], a_pid, "a was disturbed");
    assert!(d.log().contains("SIGHUP: VM files reloaded"), "{}", d.log());
    d.stop();
}

/// Whether process `pid` is gone or a zombie (ended, not yet reaped by its parent).
fn process_ended(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// An actor that wedges (injected: it sleeps for good inside a snapshot, without a sign of life)
/// HALTs its own VM and nothing else. Past `actor_silence_limit_secs` the supervisor writes the
/// HALTED record, ends that guest and answers the waiting console; the other VM keeps counting and
/// snapshotting; the daemon's stop does not wait for the wedged thread, and the next start keeps
/// the VM HALTED with the same code.
#[test]
fn a_wedged_actor_halts_its_own_vm_and_no_other() {
    if skip_unless_ready("a_wedged_actor_halts_its_own_vm_and_no_other") {
        return;
    }
    let mut d = Daemon::start_many(
        "wedge",
        &["a", "b"],
        "actor_silence_limit_secs = 20",
        &[],
        &[("BACKSTOP_FAULT_INJECT", "actor.wedge-on-snapshot=b")],
    );
    wait_vm_tick(&d, "a", 3);
    wait_vm_tick(&d, "b", 3);
    let b_pid = d.ok_vm("b", &["status"])["pid"].as_u64().unwrap();
    let a_pid = d.ok_vm("a", &["status"])["pid"].as_u64().unwrap();

    // b's snapshot wedges its actor; the console is answered once the supervisor gives up.
    let asked = Instant::now();
    let out = d.cli_vm("b", &["snapshot", "create", "--reason", "wedge"]);
    assert!(!out.status.success(), "a wedged actor's snapshot succeeded");
    assert_eq!(
        code_of(&out),
        "ERR_VM_ACTOR_WEDGED",
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        asked.elapsed() >= Duration::from_secs(15),
        "answered after {:?}, before the silence limit",
        asked.elapsed()
    );
    let st = d.ok_vm("b", &["status"]);
    assert_eq!(st["state"], "halted", "{st}");
    assert_eq!(st["halted"]["code"], "ERR_VM_ACTOR_WEDGED", "{st}");
    assert!(st["pid"].is_null(), "{st}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !process_ended(b_pid) {
        assert!(Instant::now() < deadline, "b's QEMU {b_pid} still runs");
        std::thread::sleep(Duration::from_millis(100));
    }
    let record = std::fs::read_to_string(d.vm_state_dir("b").join("halted.json"))
        .expect("b's HALTED record");
    assert!(record.contains("ERR_VM_ACTOR_WEDGED"), "{record}");
    assert!(
        d.daemon_journal().iter().any(|e| e["event"] == "vm.halted"
            && e["fields"]["vm"] == "b"
            && e["fields"]["code"] == "ERR_VM_ACTOR_WEDGED"),
        "the wedge is not in the daemon journal"
    );
    // Any other request for b is answered at once, with the same code.
    let t = Instant::now();
    assert_eq!(
        code_of(&d.cli_vm("b", &["snapshot", "list"])),
        "ERR_VM_ACTOR_WEDGED"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let vms = d.ok(&["vms"]);
    let b_row = vms["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "b")
        .cloned()
        .unwrap();
    assert_eq!(b_row["state"], "halted", "{vms}");

    // a never noticed: same QEMU, still counting, still snapshotting.
    assert_eq!(d.ok_vm("a", &["status"])["pid"].as_u64(), Some(a_pid));
    let b_len = d.vm_serial("b").len();
    let a_last = ticks_of(&d, "a").last().unwrap().ram;
    wait_vm_tick(&d, "a", a_last + 2);
    d.ok_vm("a", &["snapshot", "create", "--reason", "after b wedged"]);
    assert_eq!(d.vm_serial("b").len(), b_len, "b's guest still prints");

    // The stop does not wait on the wedged thread; the next start keeps b HALTED (durable) and
    // resumes a.
    let stopping = Instant::now();
    d.stop();
    assert!(
        stopping.elapsed() < Duration::from_secs(60),
        "the stop took {:?}",
        stopping.elapsed()
    );
    assert!(d
        .daemon_journal()
        .iter()
        .any(|e| e["event"] == "daemon.stopped"));
    d.launch();
    let st = d.ok_vm("b", &["status"]);
    assert_eq!(st["state"], "halted", "{st}");
    assert_eq!(st["halted"]["code"], "ERR_VM_ACTOR_WEDGED", "{st}");
    assert_eq!(d.ok_vm("a", &["status"])["state"], "running");
    assert_eq!(
        d.vm_journal("a")
            .iter()
            .filter(|e| e["event"] == "vm.resumed")
            .count(),
        1,
        "a did not resume from its final snapshot"
    );
    d.ok_vm("a", &["audit", "verify"]);
    d.stop();
}
