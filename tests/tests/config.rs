//! Config that tries to disable rollback is refused at load, naming the key, before anything runs.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn check(config: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::write(&p, config).unwrap();
    let out = Command::new(backstop_e2e::bin("backstopd"))
        .arg("--check-config")
        .arg("--config")
        .arg(&p)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn default_config() -> String {
    let out = Command::new(backstop_e2e::bin("backstopd"))
        .arg("--print-default-config")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn configs_that_would_disable_rollback_are_refused_at_load() {
    if !backstop_e2e::bin("backstopd").exists() {
        eprintln!(
            "SKIPPED configs_that_would_disable_rollback_are_refused_at_load: backstopd not built"
        );
        return;
    }
    // The default config names the test guest and QEMU, which must exist for it to load.
    if backstop_e2e::skip_unless_ready("configs_that_would_disable_rollback_are_refused_at_load") {
        return;
    }
    let base = default_config();
    assert_eq!(check(&base).0, 0, "the default config loads");
    let cases = [
        (
            base.replace("[rollback]", "[rollback]\nenabled = false"),
            "rollback.enabled",
        ),
        (
            base.replace("[watchdog]", "[watchdog]\ndisable = true"),
            "watchdog.disable",
        ),
        (
            base.replace("heartbeat_timeout_s = 10", "heartbeat_timeout_s = 0"),
            "watchdog.heartbeat_timeout_s",
        ),
        (
            base.replace("heartbeat_timeout_s = 10", "heartbeat_timeout_s = 99999999"),
            "watchdog.heartbeat_timeout_s",
        ),
        (
            base.replace("[daemon]", "[daemon]\nsnapshots_enabled = false"),
            "daemon.snapshots_enabled",
        ),
    ];
    for (config, key) in cases {
        let (code, err) = check(&config);
        assert_eq!(code, 2, "{key}: {err}");
        assert!(
            err.contains(key) && err.contains("ERR_CONFIG_INVALID"),
            "{key}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "one-line error: {err}");
    }
}

/// `--check-config` output (stdout and stderr together) and exit code.
fn check_all(config: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::write(&p, config).unwrap();
    let out = Command::new(backstop_e2e::bin("backstopd"))
        .arg("--check-config")
        .arg("--config")
        .arg(&p)
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// A config whose binaries, kernel, initrd or disk image do not exist is refused by
/// `--check-config` (exit 2), naming the key and the path, instead of a QEMU that dies at launch.
/// Every file is made in a temporary directory, so the test needs neither QEMU nor the guest.
#[test]
fn check_config_refuses_files_that_do_not_exist() {
    use std::os::unix::fs::PermissionsExt;
    if !backstop_e2e::bin("backstopd").exists() {
        eprintln!("SKIPPED check_config_refuses_files_that_do_not_exist: backstopd not built");
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let f = |name: &str| files.path().join(name).display().to_string();
    for name in ["vmlinuz", "initrd.img", "disk.qcow2"] {
        std::fs::write(f(name), b"x").unwrap();
    }
    for name in ["qemu", "qemu-img"] {
        std::fs::write(f(name), b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(f(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let config = |qemu: &str, qemu_img: &str, kernel: &str, initrd: &str, disk: &str| {
        format!(
            "[daemon]\nstate_dir = \"{s}\"\nrun_dir = \"{s}/run\"\n\n[vm]\nname = \"files\"\n\
             qemu_binary = \"{qemu}\"\nqemu_img = \"{qemu_img}\"\nmemory_mib = 128\n\
             kernel = \"{kernel}\"\ninitrd = \"{initrd}\"\n\n[[vm.disks]]\nid = \"data\"\n\
             path = \"{disk}\"\n\n[[vm.disks]]\nid = \"scratch\"\npath = \"{s}/scratch.qcow2\"\n\
             snapshot = \"exclude\"\ncreate_size_mib = 16\n",
            s = f("state"),
        )
    };
    let (q, qi, k, i, d) = (
        f("qemu"),
        f("qemu-img"),
        f("vmlinuz"),
        f("initrd.img"),
        f("disk.qcow2"),
    );
    let (code, out) = check_all(&config(&q, &qi, &k, &i, &d));
    assert_eq!(
        code, 0,
        "every file exists (the excluded disk is created): {out}"
    );
    let gone = f("gone");
    let cases = [
        (config(&gone, &qi, &k, &i, &d), "vm.qemu_binary"),
        (config(&q, &gone, &k, &i, &d), "vm.qemu_img"),
        (
            config("no-such-qemu-on-path", &qi, &k, &i, &d),
            "vm.qemu_binary",
        ),
        (config(&q, &qi, &gone, &i, &d), "vm.kernel"),
        (config(&q, &qi, &k, &gone, &d), "vm.initrd"),
        (config(&q, &qi, &k, &i, &gone), "vm.disks[0].path"),
    ];
    for (cfg, key) in cases {
        let (code, out) = check_all(&cfg);
        assert_eq!(code, 2, "{key}: {out}");
        assert!(
            out.contains(key)
                && out.contains("does not exist")
                && out.contains("ERR_CONFIG_INVALID"),
            "{key} not named: {out}"
        );
    }
    // A program that is not executable is as good as missing.
    std::fs::set_permissions(f("qemu"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, out) = check_all(&config(&q, &qi, &k, &i, &d));
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("vm.qemu_binary"), "{out}");
}

/// A fatal error is one line on stderr: `backstopd: CODE: …`, or under `--log-json` one JSON
/// object like the log lines (so a log collector parsing JSON does not lose it).
#[test]
fn a_fatal_error_is_one_line_and_json_under_log_json() {
    if !backstop_e2e::bin("backstopd").exists() {
        eprintln!("SKIPPED a_fatal_error_is_one_line_and_json_under_log_json: backstopd not built");
        return;
    }
    let run = |json: bool| {
        let mut cmd = Command::new(backstop_e2e::bin("backstopd"));
        cmd.args(["--config", "/nonexistent/backstopd.toml"]);
        if json {
            cmd.arg("--log-json");
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, plain) = run(false);
    assert_eq!(code, Some(2));
    assert_eq!(plain.lines().count(), 1, "{plain}");
    assert!(plain.starts_with("backstopd: ERR_CONFIG"), "{plain}");
    assert!(
        !plain.contains('\u{1b}'),
        "colour codes on a pipe: {plain:?}"
    );
    let (code, json) = run(true);
    assert_eq!(code, Some(2));
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(v["fatal"], true);
    assert_eq!(v["level"], "ERROR");
    assert!(
        v["message"].as_str().unwrap().starts_with("ERR_CONFIG"),
        "{v}"
    );
}
