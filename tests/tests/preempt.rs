//! Nothing waits behind routine work: a person's `snapshot verify` of a snapshot with a large
//! disk stops as soon as a host trigger arrives (`ERR_VERIFY_PREEMPTED`), and the trigger's
//! rollback runs at once instead of queueing behind the verification.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::time::{Duration, Instant};

use backstop_e2e::{bin, skip_unless_ready, Daemon, Options};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(120);

/// Size of the captured disk full of random data: hashing it takes seconds, so the trigger
/// lands while the verification runs.
const BIG_MIB: usize = 1024;

#[test]
fn a_trigger_stops_a_long_verification_and_is_not_held_up_by_it() {
    if skip_unless_ready("a_trigger_stops_a_long_verification_and_is_not_held_up_by_it") {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let big = files.path().join("big.raw");
    {
        let mut f = std::fs::File::create(&big).unwrap();
        let mut rnd = std::fs::File::open("/dev/urandom").unwrap();
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..BIG_MIB {
            std::io::Read::read_exact(&mut rnd, &mut buf).unwrap();
            f.write_all(&buf).unwrap();
        }
        f.sync_all().unwrap();
    }
    let disk = format!(
        "[[vm.disks]]\nid = \"big\"\npath = \"{}\"\nformat = \"raw\"\nsnapshot = \"capture\"\n",
        big.display()
    );
    let d = Daemon::start_opts(
        "preempt",
        &Options {
            extra_toml: &disk,
            ..Options::default()
        },
    );
    let baseline = d.wait_journal(BOOT, "baseline", |e| {
        e["event"] == "snapshot.create.completed"
    });
    let id = baseline["fields"]["snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();

    // A person verifies the snapshot (every byte, the 1 GiB disk included)...
    let socket = d.socket().to_path_buf();
    let verify_id = id.clone();
    let verify = std::thread::spawn(move || {
        let t0 = Instant::now();
        let out = std::process::Command::new(bin("backstop"))
            .arg("--socket")
            .arg(&socket)
            .args(["--json", "snapshot", "verify", &verify_id])
            .output()
            .unwrap();
        (out, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(400));
    // ...and meanwhile the policy engine finds a violation.
    let t0 = Instant::now();
    let r = d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "while a verify runs",
    ]);
    let trigger_took = t0.elapsed();
    let (out, verify_took) = verify.join().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    eprintln!(
        "trigger answered in {} ms; the verification ended after {} ms: {v}",
        trigger_took.as_millis(),
        verify_took.as_millis()
    );
    assert_eq!(r["epoch"], 1, "{r}");
    assert_eq!(r["snapshot_id"], id.as_str(), "{r}");
    // The verification stopped for it (it is asked again), it did not hold the rollback up.
    assert_eq!(out.status.code(), Some(1), "{v}");
    assert_eq!(v["error"]["code"], "ERR_VERIFY_PREEMPTED", "{v}");
    // Asked again, it runs to the end and passes.
    let again = d.ok(&["snapshot", "verify", &id]);
    assert!(
        again["disk_layers_checked"].as_u64().unwrap() >= 1,
        "{again}"
    );
}
