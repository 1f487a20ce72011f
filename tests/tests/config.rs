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
