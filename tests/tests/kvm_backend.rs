//! The embedded KVM backend behind the same engine and console as QEMU.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[test]
fn the_console_snapshots_and_rolls_back_a_kvm_micro_vm() {
    let ready =
        std::path::Path::new("/dev/kvm").exists() && backstop_e2e::bin("backstopd").exists();
    if !ready {
        if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") {
            panic!("BACKSTOP_REQUIRE_E2E=1 but /dev/kvm or the binaries are missing");
        }
        eprintln!("SKIPPED the_console_snapshots_and_rolls_back_a_kvm_micro_vm: no /dev/kvm");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = format!("/tmp/bsk-{}", std::process::id());
    let shipped = include_str!("../../vmm-config/kvm.toml");
    let config = shipped
        .replace(
            "state_dir = \"/var/lib/backstop\"",
            &format!("state_dir = \"{}/state\"", dir.path().display()),
        )
        .replace(
            "run_dir = \"/run/backstop\"",
            &format!("run_dir = \"{run}\""),
        )
        .replace(
            "work_dir = \"/var/lib/backstop/kvm\"",
            &format!("work_dir = \"{}/kvm\"", dir.path().display()),
        )
        .replace("memory_mib = 256", "memory_mib = 128");
    let cfg = dir.path().join("kvm.toml");
    std::fs::write(&cfg, config).unwrap();
    let log = std::fs::File::create(dir.path().join("backstopd.log")).unwrap();
    let mut daemon = Command::new(backstop_e2e::bin("backstopd"))
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let sock = format!("{run}/control.sock");
    let cli = |args: &[&str]| -> Value {
        let out = Command::new(backstop_e2e::bin("backstop"))
            .args(["--socket", &sock, "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "backstop {args:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::path::Path::new(&sock).exists()
        || !Command::new(backstop_e2e::bin("backstop"))
            .args(["--socket", &sock, "status"])
            .output()
            .unwrap()
            .status
            .success()
    {
        assert!(
            Instant::now() < deadline,
            "backstopd (kvm) did not come up: {}",
            std::fs::read_to_string(dir.path().join("backstopd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = cli(&["status"]);
    assert_eq!(st["backend"], "kvm");
    assert_eq!(st["state"], "running");
    let snap = cli(&["snapshot", "create", "--reason", "kvm backend"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();
    cli(&["snapshot", "verify", &id]);
    let rb = cli(&["rollback", "--to", &id, "--reason", "back"]);
    assert_eq!(rb["epoch"], 1);
    assert_eq!(cli(&["status"])["state"], "running");
    let v = cli(&["audit", "verify"]);
    assert!(v["first_bad"].is_null());
    let _ = daemon.kill();
    let _ = daemon.wait();
    let _ = std::fs::remove_dir_all(&run);
}
