//! Reviewer evidence for e2e tests: a reviewer key and tokens made with the real console
//! (`backstop review keygen` / `backstop review sign`), as a reviewer would make them.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bin;

/// Creates a reviewer key in `dir` and returns its path.
pub fn reviewer_key(dir: &Path) -> PathBuf {
    let key = dir.join("reviewer.key");
    let out = Command::new(bin("backstop"))
        .args(["review", "keygen"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "review keygen: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    key
}

/// The `[restore_gate]` table naming `key`.
pub fn restore_gate_toml(key: &Path) -> String {
    format!("[restore_gate]\nreviewer_key = \"{}\"\n", key.display())
}

/// Signs a token for `snapshot_id` with `key`; writes it next to the key and returns its path.
pub fn token(key: &Path, snapshot_id: &str) -> PathBuf {
    let out = Command::new(bin("backstop"))
        .args([
            "review",
            "sign",
            "--reviewer",
            "e2e-reviewer",
            "--expires-in",
            "10m",
        ])
        .arg("--key")
        .arg(key)
        .args(["--snapshot", snapshot_id])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "review sign: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = key.with_file_name(format!("token-{snapshot_id}.json"));
    std::fs::write(&path, &out.stdout).unwrap();
    path
}
