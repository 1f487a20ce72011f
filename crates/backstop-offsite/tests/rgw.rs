//! The S3 client against a real Ceph RADOS Gateway (scripts/ceph-cluster.sh): bucket creation,
//! PUT/HEAD/GET, a body whose announced sha256 is wrong refused by the gateway, and the upload
//! throughput of 4 MiB objects. Skipped (loudly) without Ceph unless BACKSTOP_REQUIRE_CEPH=1.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use backstop_offsite::s3::Client;
use backstop_offsite::OffsiteConfig;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

struct Cluster {
    dir: tempfile::TempDir,
    vars: Vec<(String, String)>,
}

impl Cluster {
    fn start() -> Option<Cluster> {
        if Command::new("radosgw").arg("--version").output().is_err() {
            assert!(
                std::env::var("BACKSTOP_REQUIRE_CEPH").as_deref() != Ok("1"),
                "BACKSTOP_REQUIRE_CEPH=1 but Ceph is not installed (scripts/setup-ceph.sh)"
            );
            eprintln!("SKIPPED: Ceph is not installed (scripts/setup-ceph.sh)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(script())
            .arg("start")
            .arg(dir.path().join("c"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let vars = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(Cluster { dir, vars })
    }

    fn var(&self, k: &str) -> String {
        self.vars.iter().find(|(n, _)| n == k).unwrap().1.clone()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("stop")
            .arg(self.dir.path().join("c"))
            .status();
    }
}

#[test]
fn the_client_talks_to_a_real_gateway() {
    let Some(c) = Cluster::start() else { return };
    let text = format!(
        "[offsite]\nendpoint = \"{}\"\nbucket = \"backstop-test\"\nhost = \"a\"\n",
        c.var("S3_ENDPOINT")
    );
    let (ak, sk) = (c.var("S3_ACCESS_KEY"), c.var("S3_SECRET_KEY"));
    let env = move |k: &str| match k {
        backstop_offsite::config::ENV_ACCESS_KEY => Some(ak.clone()),
        backstop_offsite::config::ENV_SECRET_KEY => Some(sk.clone()),
        _ => None,
    };
    let cfg = OffsiteConfig::from_file_text(&text, &env).unwrap().unwrap();
    let client = Client::new(&cfg, Duration::from_secs(60));
    client.ensure_bucket().unwrap();
    client.ensure_bucket().unwrap();
    assert_eq!(client.head("chunks/none").unwrap(), None);
    client.put("chunks/one", b"hello").unwrap();
    assert_eq!(client.head("chunks/one").unwrap(), Some(5));
    assert_eq!(client.get("chunks/one", 5).unwrap(), b"hello");
    assert!(client.get("chunks/one", 4).is_err());
    assert!(client.get("chunks/none", 10).unwrap_err().is_not_found());
    // The gateway checks the announced digest: bytes that do not match it are refused.
    let wrong = "0".repeat(64);
    let e = client
        .put_reader("chunks/two", &mut &b"hello"[..], 5, &wrong)
        .unwrap_err();
    assert!(e.to_string().contains("400"), "{e}");
    assert_eq!(client.head("chunks/two").unwrap(), None);

    // Throughput: 16 objects of 4 MiB, one after the other.
    let body: Vec<u8> = (0..4 * 1024 * 1024u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    let start = Instant::now();
    for i in 0..16 {
        client.put(&format!("bench/{i}"), &body).unwrap();
    }
    let s = start.elapsed().as_secs_f64();
    println!(
        "rgw upload: 64 MiB in 16 PUTs of 4 MiB: {:.2} s, {:.1} MiB/s",
        s,
        64.0 / s
    );
}

/// The gateway's compare-and-swap on PUT, as the leases use it, then two hosts' lease keepers
/// against it: A takes and renews the lease of a VM it runs, B (running a VM of the same name)
/// does not take it and its start is refused with ERR_OFFSITE_LEASE_HELD; A's clean stop
/// deletes it and B takes it; an expired lease of a third host is taken over only by a start.
#[test]
fn leases_are_compare_and_swap_on_a_real_gateway() {
    use std::sync::{Arc, Mutex};

    use backstop_offsite::lease::{self, Current, Lease, LeaseKeeper};
    use backstop_offsite::s3::PutCondition;

    let Some(c) = Cluster::start() else { return };
    let (ak, sk) = (c.var("S3_ACCESS_KEY"), c.var("S3_SECRET_KEY"));
    let env = move |k: &str| match k {
        backstop_offsite::config::ENV_ACCESS_KEY => Some(ak.clone()),
        backstop_offsite::config::ENV_SECRET_KEY => Some(sk.clone()),
        _ => None,
    };
    let cfg_for = |host: &str| {
        let text = format!(
            "[offsite]\nendpoint = \"{}\"\nbucket = \"backstop-lease\"\nprefix = \"p\"\nhost = \"{host}\"\nlease_ttl_s = 3\n",
            c.var("S3_ENDPOINT")
        );
        OffsiteConfig::from_file_text(&text, &env).unwrap().unwrap()
    };
    let (cfg_a, cfg_b) = (cfg_for("host-a"), cfg_for("host-b"));
    let client = Client::new(&cfg_a, Duration::from_secs(60));
    client.ensure_bucket().unwrap();

    // What RGW 16 honours: If-None-Match: * and If-Match with the unquoted ETag.
    let e1 = client
        .put_if("cas/x", b"one", &PutCondition::Absent)
        .unwrap();
    assert!(client
        .put_if("cas/x", b"two", &PutCondition::Absent)
        .unwrap_err()
        .is_precondition_failed());
    let e2 = client
        .put_if("cas/x", b"three", &PutCondition::ETag(e1.clone()))
        .unwrap();
    assert!(client
        .put_if("cas/x", b"four", &PutCondition::ETag(e1))
        .unwrap_err()
        .is_precondition_failed());
    assert!(client
        .put_if("cas/absent", b"five", &PutCondition::ETag(e2.clone()))
        .unwrap_err()
        .is_precondition_failed());
    assert_eq!(
        client.get_with_etag("cas/x", 100).unwrap(),
        Some((b"three".to_vec(), e2))
    );

    let events: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let journal = |host: &'static str| {
        let events = Arc::clone(&events);
        Box::new(
            move |e: backstop_common::AuditEvent, f: serde_json::Value| {
                let _ = f;
                events
                    .lock()
                    .unwrap()
                    .push((host.to_string(), e.as_str().to_string()));
            },
        ) as lease::LeaseJournalFn
    };
    let a =
        LeaseKeeper::start(cfg_a.clone(), Box::new(|| vec!["web".into()]), journal("a")).unwrap();
    let wait = |k: &LeaseKeeper, state: &str| {
        let start = Instant::now();
        loop {
            let v = k.views();
            if v.iter().any(|l| l.vm == "web" && l.state == state) {
                return v;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "{state}: {v:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let held = wait(&a, "held");
    let first = held[0].expires_at.clone().unwrap();
    // Renewed every ttl/3 (1 s): the expiry moves on, the lease stays A's.
    std::thread::sleep(Duration::from_millis(2500));
    let renewed = wait(&a, "held");
    assert!(
        renewed[0].expires_at.clone().unwrap() > first,
        "{renewed:?}"
    );
    println!(
        "lease renew: one If-Match PUT in {} ms",
        renewed[0].last_write_ms.unwrap()
    );

    let b =
        LeaseKeeper::start(cfg_b.clone(), Box::new(|| vec!["web".into()]), journal("b")).unwrap();
    let seen = wait(&b, "held_elsewhere");
    assert_eq!(seen[0].holder.as_deref(), Some("host-a"));
    let e = b.check_for_start("web").unwrap_err();
    assert_eq!(e.code.as_str(), "ERR_OFFSITE_LEASE_HELD");
    assert!(
        e.message.contains("host-a") && !e.message.contains('\n'),
        "{e}"
    );
    assert_eq!(
        b.acquire_for_start("web").unwrap_err().code.as_str(),
        "ERR_OFFSITE_LEASE_HELD"
    );

    // A's clean stop deletes it; B's start takes it.
    a.release_all();
    b.check_for_start("web").unwrap();
    let (taken, over) = b.acquire_for_start("web").unwrap();
    assert_eq!((taken.host.as_str(), over), ("host-b", None));
    match lease::read(&cfg_b, &client, "web").unwrap() {
        Current::Lease { lease, .. } => assert_eq!(lease.host, "host-b"),
        other => panic!("{other:?}"),
    }

    // The gateway down: B's renewals fail (status says so, journaled once), and it holds the
    // lease again once the gateway is back.
    let rgw = |what: &str| {
        let st = Command::new(script())
            .arg(what)
            .arg(c.dir.path().join("c"))
            .status()
            .unwrap();
        assert!(st.success(), "ceph-cluster.sh {what}");
    };
    wait(&b, "held");
    rgw("stop-rgw");
    let failing = wait(&b, "renew_failing");
    assert!(failing[0].last_error.is_some(), "{failing:?}");
    std::thread::sleep(Duration::from_millis(2500));
    rgw("start-rgw");
    wait(&b, "held");
    let count = |host: &str, event: &str| {
        events
            .lock()
            .unwrap()
            .iter()
            .filter(|(h, e)| h == host && e == event)
            .count()
    };
    assert_eq!(count("b", "offsite.lease.renew_failed"), 1);

    // Another host's lease, expired: B's renewer leaves it; a start takes it over.
    let old = Lease::new(
        "host-c",
        "db",
        "s",
        time::OffsetDateTime::now_utc() - time::Duration::seconds(10),
        Duration::from_secs(3),
    );
    client
        .put(&lease::key(&cfg_b, "db"), &old.to_bytes())
        .unwrap();
    let (_, over) = b.acquire_for_start("db").unwrap();
    assert_eq!(over.map(|l| l.host), Some("host-c".to_string()));
    // Live: refused.
    let live = Lease::new(
        "host-c",
        "app",
        "s",
        time::OffsetDateTime::now_utc(),
        Duration::from_secs(60),
    );
    client
        .put(&lease::key(&cfg_b, "app"), &live.to_bytes())
        .unwrap();
    let e = b.acquire_for_start("app").unwrap_err();
    assert!(e.message.contains("host-c"), "{e}");
    b.release_all();
    let ev = events.lock().unwrap().clone();
    for want in [
        ("a", "offsite.lease.acquired"),
        ("a", "offsite.lease.released"),
        ("b", "offsite.lease.held_elsewhere"),
        ("b", "offsite.lease.acquired"),
    ] {
        assert!(
            ev.iter().any(|(h, e)| h == want.0 && e == want.1),
            "{want:?} not in {ev:?}"
        );
    }
}
