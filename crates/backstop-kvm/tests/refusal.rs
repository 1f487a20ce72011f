//! A snapshot that fails any check is refused with the spec's code before any VM is created.
//! One test function (its own binary) so the process-wide VM counter sees no other test.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is a test failure

mod common;

use std::path::{Path, PathBuf};

use backstop_integrity::HostKey;
use backstop_kvm::format::FORMAT_MAJOR;
use backstop_kvm::{vms_created, KvmVm, RestoreOptions, SnapshotKind};
use common::*;

fn resign(dir: &Path, state: &[u8]) {
    rewrite(&dir.join("state.bin"), state);
    rewrite(&dir.join("state.sig"), key().sign_hex(state).as_bytes());
}

fn refused(dirs: &[PathBuf], with: &HostKey) -> String {
    let before = vms_created();
    let err = KvmVm::restore(dirs, with, RestoreOptions::default())
        .map(|_| ())
        .expect_err("restore must be refused");
    assert_eq!(
        vms_created(),
        before,
        "a refused restore created a VM ({err})"
    );
    eprintln!("refused: {}: {err}", err.code());
    err.code().to_string()
}

#[test]
fn bad_snapshots_are_refused_with_their_code_and_start_no_vm() {
    if !kvm_or_skip("bad_snapshots_are_refused_with_their_code_and_start_no_vm") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    let diff = tmp.path().join("diff");
    {
        let mut vm = KvmVm::create(config(16, 1, 4, 64)).unwrap();
        run_ticks(&mut vm, 2);
        vm.capture(&good, SnapshotKind::Full, &key()).unwrap();
        run_ticks(&mut vm, 1);
        vm.capture(&diff, SnapshotKind::Diff, &key()).unwrap();
    }
    let state = std::fs::read(good.join("state.bin")).unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let case = |mutate: &dyn Fn(&Path)| -> PathBuf {
        let dir = tmp.path().join(format!(
            "case{}",
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        copy_snapshot(&good, &dir);
        mutate(&dir);
        dir
    };
    let integrity = "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED";

    // A copy with untouched bytes is fine by content; only its mtime changed, so the instant
    // (metadata) check refuses the memory file and the full check accepts it.
    let copy = case(&|_| {});
    assert_eq!(refused(std::slice::from_ref(&copy), &key()), integrity);
    let full = RestoreOptions {
        memory_check: backstop_kvm::MemoryCheck::Full,
        ..RestoreOptions::default()
    };
    KvmVm::restore(&[&copy], &key(), full).expect("an intact copy passes the full check");
    let baseline = vms_created();

    // One flipped byte in the body, signature left as it was.
    let d = case(&|d| {
        let mut s = state.clone();
        let at = s.len() - 100;
        s[at] ^= 0x01;
        rewrite(&d.join("state.bin"), &s);
    });
    assert_eq!(refused(&[d], &key()), integrity);

    // Truncated, signature left as it was; and truncated then signed (a writer that died).
    let d = case(&|d| rewrite(&d.join("state.bin"), &state[..state.len() / 2]));
    assert_eq!(refused(&[d], &key()), integrity);
    let d = case(&|d| resign(d, &state[..state.len() - 8]));
    assert_eq!(refused(&[d], &key()), integrity);
    let d = case(&|d| resign(d, &state[..20]));
    assert_eq!(refused(&[d], &key()), integrity);

    // Body corrupted and signed anyway: the crc32 catches it.
    let d = case(&|d| {
        let mut s = state.clone();
        let at = s.len() - 1;
        s[at] ^= 0x80;
        resign(d, &s);
    });
    assert_eq!(refused(&[d], &key()), integrity);

    // Signed with another key.
    assert_eq!(
        refused(std::slice::from_ref(&good), &HostKey::from_bytes([1; 32])),
        integrity
    );

    // Wrong magic (signed): not one of our files.
    let d = case(&|d| {
        let mut s = state.clone();
        s[..8].copy_from_slice(b"QEVM\0\0\0\x01");
        resign(d, &s);
    });
    assert_eq!(refused(&[d], &key()), "ERR_SNAPSHOT_MANIFEST_INVALID");

    // A newer major format (signed): compatibility blocked.
    let d = case(&|d| {
        let mut s = state.clone();
        s[8..10].copy_from_slice(&(FORMAT_MAJOR + 1).to_le_bytes());
        resign(d, &s);
    });
    assert_eq!(refused(&[d], &key()), "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED");

    // The memory file changed after capture (same length, new content, read-only again).
    let d = case(&|d| {
        let mut m = std::fs::read(d.join("memory.img")).unwrap();
        m[0x2000] ^= 0xff;
        rewrite(&d.join("memory.img"), &m);
    });
    assert_eq!(refused(std::slice::from_ref(&d), &key()), integrity);
    let before = vms_created();
    let err = KvmVm::restore(&[&d], &key(), full).map(|_| ()).unwrap_err();
    assert_eq!(
        (err.code().as_str(), vms_created()),
        (integrity, before),
        "{err}"
    );
    assert!(err.to_string().contains("sha256"), "{err}");
    // ... and is now writable.
    let d = case(&|d| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.join("memory.img"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
    });
    assert_eq!(refused(&[d], &key()), integrity);
    // ... or is gone: a file missing from a snapshot that is there is an integrity failure.
    let d = case(&|d| std::fs::remove_file(d.join("memory.img")).unwrap());
    assert_eq!(refused(&[d], &key()), integrity);
    // MISSING_SNAPSHOT is for the snapshot itself being absent.
    assert_eq!(
        refused(&[tmp.path().join("never-captured")], &key()),
        "MISSING_SNAPSHOT"
    );

    // A chain that does not start with a full snapshot, or a diff after the wrong parent.
    assert_eq!(
        refused(std::slice::from_ref(&diff), &key()),
        "ERR_SNAPSHOT_MANIFEST_INVALID"
    );
    assert_eq!(
        refused(&[diff.clone(), good.clone()], &key()),
        "ERR_SNAPSHOT_MANIFEST_INVALID"
    );
    let other = tmp.path().join("other");
    {
        let mut vm = KvmVm::create(config(16, 1, 4, 64)).unwrap();
        vm.capture(&other, SnapshotKind::Full, &key()).unwrap();
    }
    let baseline_after_other = vms_created();
    assert_eq!(
        refused(&[other, diff.clone()], &key()),
        "ERR_SNAPSHOT_MANIFEST_INVALID"
    );
    assert_eq!(vms_created(), baseline_after_other);

    // The untouched chain still restores.
    assert!(vms_created() >= baseline);
    KvmVm::restore(&[&good, &diff], &key(), RestoreOptions::default()).unwrap();
}
