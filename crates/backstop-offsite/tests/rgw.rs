//! The S3 client against a real Ceph RADOS Gateway (scripts/ceph-cluster.sh): bucket creation,
//! PUT/HEAD/GET, a body whose announced sha256 is wrong refused by the gateway, the upload
//! throughput of 4 MiB objects; listing (paged), DELETE and touch; remote retention and GC
//! (mark-and-sweep with a grace period); wrong credentials (ERR_OFFSITE_DENIED) and a full
//! bucket quota (ERR_OFFSITE_QUOTA_EXCEEDED); leases as compare-and-swap PUTs; https with a
//! private CA and multipart upload. Skipped (loudly) without Ceph unless BACKSTOP_REQUIRE_CEPH=1.
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
    // A PUT only if absent (the uploader's one-request path for objects that look new): the
    // gateway stores the first and refuses the second with 412, leaving the first in place.
    let digest = |b: &[u8]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b))
    };
    assert!(client
        .put_reader_if_absent("chunks/three", &mut &b"first"[..], 5, &digest(b"first"))
        .unwrap());
    assert!(!client
        .put_reader_if_absent("chunks/three", &mut &b"other"[..], 5, &digest(b"other"))
        .unwrap());
    assert_eq!(client.get("chunks/three", 5).unwrap(), b"first");

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

fn config(c: &Cluster, bucket: &str, extra: &str, secret: Option<&str>) -> OffsiteConfig {
    let text = format!(
        "[offsite]\nendpoint = \"{}\"\nbucket = \"{bucket}\"\nprefix = \"t\"\nhost = \"a\"\n{extra}",
        c.var("S3_ENDPOINT")
    );
    let ak = c.var("S3_ACCESS_KEY");
    let sk = secret.map_or_else(|| c.var("S3_SECRET_KEY"), str::to_string);
    let env = move |k: &str| match k {
        backstop_offsite::config::ENV_ACCESS_KEY => Some(ak.clone()),
        backstop_offsite::config::ENV_SECRET_KEY => Some(sk.clone()),
        _ => None,
    };
    OffsiteConfig::from_file_text(&text, &env).unwrap().unwrap()
}

fn sha(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// Puts a chunk (or layer) object; returns its digest.
fn put_blob(client: &Client, dir: &str, body: &[u8]) -> String {
    let d = sha(body);
    client.put(&format!("t/{dir}/{d}"), body).unwrap();
    d
}

/// Puts a synthetic snapshot of `host`: one index naming `chunks`, a manifest naming the index
/// and `layers`, created `age_s` ago, and (if `signed`) a signature object.
fn put_snapshot(
    client: &Client,
    host: &str,
    id: &str,
    age_s: i64,
    chunks: &[&str],
    layers: &[&str],
    signed: bool,
) {
    let p = format!("t/hosts/{host}/snapshots/{id}");
    let index = serde_json::json!({
        "chunks": chunks.iter().map(|c| serde_json::json!({"sha256": c, "crc32": "00000000", "len": 5})).collect::<Vec<_>>(),
        "total_bytes": 5 * chunks.len(),
    });
    client
        .put(&format!("{p}/vmstate.index"), index.to_string().as_bytes())
        .unwrap();
    let created = time::OffsetDateTime::now_utc() - time::Duration::seconds(age_s);
    let manifest = serde_json::json!({
        "snapshot_id": id,
        "created_at": backstop_common::time::rfc3339(created),
        "payload_refs": [
            {"name": "vmstate", "index": "vmstate.index", "layers": []},
            {"name": "disk:data", "layers": layers.iter().map(|l| serde_json::json!({"sha256": l, "bytes": 5})).collect::<Vec<_>>()},
        ],
    });
    client
        .put(
            &format!("{p}/manifest.json"),
            manifest.to_string().as_bytes(),
        )
        .unwrap();
    if signed {
        client
            .put(&format!("{p}/manifest.ed25519"), b"sig")
            .unwrap();
    }
}

fn keys(client: &Client, prefix: &str) -> Vec<String> {
    client
        .list(prefix)
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect()
}

#[test]
fn remote_gc_sweeps_only_unreferenced_objects_past_the_grace() {
    let Some(c) = Cluster::start() else { return };
    let cfg = config(
        &c,
        "gc-test",
        "[offsite.retention]\nkeep_last = 1\ngc_grace_s = 2\ngc_interval_s = 0\n",
        None,
    );
    let client = Client::new(&cfg, Duration::from_secs(60));
    client.ensure_bucket().unwrap();

    // Listing pages: 1003 objects come back in two pages.
    let t = Instant::now();
    std::thread::scope(|s| {
        for k in 0..4 {
            let client = &client;
            s.spawn(move || {
                for i in (k..1003).step_by(4) {
                    client.put(&format!("many/{i:04}"), b"x").unwrap();
                }
            });
        }
    });
    let many = client.list("many/").unwrap();
    assert_eq!(many.len(), 1003);
    println!(
        "rgw: 1003 PUTs and a 2-page listing in {} ms",
        t.elapsed().as_millis()
    );
    client.delete("many/0000").unwrap();
    client.delete("many/0000").unwrap(); // not there: not an error
    assert_eq!(client.list("many/").unwrap().len(), 1002);

    // Host a: an old snapshot s1 (chunks c1 c2, layer l1) and a new one s2 (c2 c3, l2); host b:
    // an old one (c4) that host a's rule never touches; c5 referenced by nobody.
    let ids = ["11".repeat(16), "22".repeat(16), "33".repeat(16)];
    let c1 = put_blob(&client, "chunks", b"one..");
    let c2 = put_blob(&client, "chunks", b"two..");
    let c3 = put_blob(&client, "chunks", b"three");
    let c4 = put_blob(&client, "chunks", b"four.");
    let c5 = put_blob(&client, "chunks", b"five.");
    let l1 = put_blob(&client, "layers", b"lay-1");
    let l2 = put_blob(&client, "layers", b"lay-2");
    put_snapshot(&client, "a", &ids[0], 7200, &[&c1, &c2], &[&l1], true);
    put_snapshot(&client, "a", &ids[1], 10, &[&c2, &c3], &[&l2], true);
    put_snapshot(&client, "b", &ids[2], 9000, &[&c4], &[], true);
    std::thread::sleep(Duration::from_secs(3));
    // An upload in progress: its chunk is there, its manifest not yet.
    let c6 = put_blob(&client, "chunks", b"six..");

    let dry = backstop_offsite::retention::run(&cfg, &client, true, &mut |_| {
        panic!("a dry run deletes nothing")
    })
    .unwrap();
    println!("rgw gc dry run: {dry:?}");
    assert_eq!(dry.snapshots_pruned.len(), 1);
    assert_eq!(dry.snapshots_pruned[0].snapshot_id, ids[0]);
    assert_eq!(dry.snapshots_kept, 1);
    assert_eq!((dry.objects_swept, dry.bytes_swept), (3, 15)); // c1 c5 l1
    assert_eq!(dry.objects_in_grace, 1); // c6
    assert_eq!(dry.objects_referenced, 4); // c2 c3 c4 l2
    assert_eq!(keys(&client, "t/chunks/").len(), 6);

    let mut pruned = Vec::new();
    let r = backstop_offsite::retention::run(&cfg, &client, false, &mut |p| {
        pruned.push(p.snapshot_id.clone())
    })
    .unwrap();
    println!("rgw gc: {r:?}");
    assert_eq!(pruned, [ids[0].clone()]);
    assert_eq!((r.objects_swept, r.objects_in_grace), (3, 1));
    assert!(keys(&client, &format!("t/hosts/a/snapshots/{}/", ids[0])).is_empty());
    assert_eq!(
        keys(&client, &format!("t/hosts/a/snapshots/{}/", ids[1])).len(),
        3
    );
    assert_eq!(
        keys(&client, &format!("t/hosts/b/snapshots/{}/", ids[2])).len(),
        3
    );
    let left = |dir: &str| -> Vec<String> {
        keys(&client, &format!("t/{dir}/"))
            .into_iter()
            .map(|k| k.rsplit('/').next().unwrap().to_string())
            .collect()
    };
    let mut want = vec![c2.clone(), c3.clone(), c4.clone(), c6.clone()];
    want.sort();
    assert_eq!(left("chunks"), want);
    assert!(!left("chunks").contains(&c1) && !left("chunks").contains(&c5));
    assert_eq!(left("layers"), std::slice::from_ref(&l2));

    // A chunk found already there by an upload is renewed (no bytes sent): it then counts as
    // young, and a manifest uploaded meanwhile finds it.
    let (_, before) = client
        .head_meta(&format!("t/chunks/{c6}"))
        .unwrap()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    client.touch(&format!("t/chunks/{c6}")).unwrap();
    let (len, after) = client
        .head_meta(&format!("t/chunks/{c6}"))
        .unwrap()
        .unwrap();
    assert_eq!(len, 5);
    assert!(
        after > before,
        "touch did not renew LastModified: {before} {after}"
    );
    assert_eq!(client.get(&format!("t/chunks/{c6}"), 5).unwrap(), b"six..");
    let r = backstop_offsite::retention::run(&cfg, &client, false, &mut |_| {}).unwrap();
    assert_eq!((r.objects_swept, r.objects_in_grace), (0, 1));
    // Past the grace, still unreferenced: swept.
    std::thread::sleep(Duration::from_secs(3));
    let r = backstop_offsite::retention::run(&cfg, &client, false, &mut |_| {}).unwrap();
    assert_eq!((r.objects_swept, r.objects_in_grace), (1, 0));
    assert!(!left("chunks").contains(&c6));

    // An upload that never finished (no signature), older than the grace: its rest goes.
    put_snapshot(&client, "a", &"44".repeat(16), 0, &[&c2], &[], false);
    std::thread::sleep(Duration::from_secs(3));
    let r = backstop_offsite::retention::run(&cfg, &client, false, &mut |_| {}).unwrap();
    assert_eq!(r.snapshots_pruned.len(), 1, "{r:?}");
    assert!(keys(
        &client,
        &format!("t/hosts/a/snapshots/{}/", "44".repeat(16))
    )
    .is_empty());
    assert_eq!(r.snapshots_kept, 1);
}

#[test]
fn wrong_credentials_are_denied_and_a_full_bucket_says_quota_exceeded() {
    let Some(c) = Cluster::start() else { return };
    let good = Client::new(&config(&c, "quota-test", "", None), Duration::from_secs(60));
    good.ensure_bucket().unwrap();
    let bad = Client::new(
        &config(&c, "quota-test", "", Some("not-the-secret")),
        Duration::from_secs(60),
    );
    let e = bad.put("t/chunks/x", b"hello").unwrap_err();
    println!("rgw: wrong secret: {e}");
    assert_eq!(e.code().as_str(), "ERR_OFFSITE_DENIED", "{e}");
    assert_eq!(
        bad.head("t/chunks/x").unwrap_err().code().as_str(),
        "ERR_OFFSITE_DENIED"
    );

    // A bucket quota of 1 MiB (RGW's own, radosgw-admin).
    let admin = |args: &[&str]| {
        let out = Command::new("radosgw-admin")
            .arg("-c")
            .arg(c.var("CEPH_CONF"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "radosgw-admin {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    admin(&[
        "quota",
        "set",
        "--quota-scope=bucket",
        "--bucket=quota-test",
        "--max-size=1048576",
    ]);
    admin(&[
        "quota",
        "enable",
        "--quota-scope=bucket",
        "--bucket=quota-test",
    ]);
    let body = vec![7u8; 256 * 1024];
    let t = Instant::now();
    let mut refused = None;
    for i in 0..40 {
        match good.put(&format!("t/chunks/q{i}"), &body) {
            Ok(()) => {}
            Err(e) => {
                refused = Some((i, e));
                break;
            }
        }
    }
    let (i, e) = refused.expect("40 x 256 KiB accepted under a 1 MiB quota");
    println!(
        "rgw: quota 1 MiB: PUT {i} of 256 KiB refused after {} ms: {e}",
        t.elapsed().as_millis()
    );
    assert_eq!(e.code().as_str(), "ERR_OFFSITE_QUOTA_EXCEEDED", "{e}");
    assert!(i <= 5, "refused only at PUT {i}");
    // Raised: accepted again.
    admin(&[
        "quota",
        "set",
        "--quota-scope=bucket",
        "--bucket=quota-test",
        "--max-size=104857600",
    ]);
    let start = Instant::now();
    loop {
        match good.put("t/chunks/after", &body) {
            Ok(()) => break,
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "still refused: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!(
        "rgw: quota raised: accepted after {} ms",
        start.elapsed().as_millis()
    );
}

#[test]
fn the_uploader_runs_retention_and_gc_every_interval_and_journals_it() {
    let Some(c) = Cluster::start() else { return };
    let cfg = config(
        &c,
        "interval-test",
        "[offsite.retention]\nkeep_last = 1\ngc_grace_s = 1\ngc_interval_s = 1\n",
        None,
    );
    let client = Client::new(&cfg, Duration::from_secs(60));
    client.ensure_bucket().unwrap();
    let (old, new) = ("55".repeat(16), "66".repeat(16));
    let c1 = put_blob(&client, "chunks", b"seven");
    let c2 = put_blob(&client, "chunks", b"eight");
    let orphan = put_blob(&client, "layers", b"nine.");
    put_snapshot(&client, "a", &old, 600, &[&c1], &[], true);
    put_snapshot(&client, "a", &new, 10, &[&c2], &[], true);
    std::thread::sleep(Duration::from_secs(2));

    let dir = tempfile::tempdir().unwrap();
    let journal: std::sync::Arc<std::sync::Mutex<Vec<(String, String, serde_json::Value)>>> =
        Default::default();
    let sink = std::sync::Arc::clone(&journal);
    let uploader = backstop_offsite::Uploader::start(
        cfg,
        &dir.path().join("queue.json"),
        backstop_integrity::HostKey::from_bytes([1; 32]),
        backstop_offsite::HostSigningKey::load_or_create(dir.path()).unwrap(),
        Box::new(Vec::new),
        Box::new(move |event, id, _result, fields| {
            sink.lock()
                .unwrap()
                .push((event.as_str().to_string(), id.to_string(), fields));
        }),
    )
    .unwrap();
    let start = Instant::now();
    let swept = loop {
        let j = journal.lock().unwrap().clone();
        if let Some(e) = j.iter().find(|e| e.0 == "offsite.gc.swept") {
            break (j.clone(), e.2.clone());
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no pass journaled: {j:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    uploader.stop();
    let (j, fields) = swept;
    println!(
        "rgw: interval pass after {} ms: {fields}",
        start.elapsed().as_millis()
    );
    assert!(j
        .iter()
        .any(|e| e.0 == "offsite.retention.pruned" && e.1 == old));
    assert_eq!(fields["trigger"], "interval");
    assert_eq!(fields["objects_swept"], 2, "{fields}"); // c1 and the orphan layer
    assert!(keys(&client, &format!("t/hosts/a/snapshots/{old}/")).is_empty());
    assert_eq!(
        keys(&client, &format!("t/hosts/a/snapshots/{new}/")).len(),
        3
    );
    assert!(client
        .head(&format!("t/layers/{orphan}"))
        .unwrap()
        .is_none());
    assert!(client.head(&format!("t/chunks/{c2}")).unwrap().is_some());
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

// ---- https (a private CA) and multipart upload ----

impl Cluster {
    /// A cluster whose gateway is started with `env` (e.g. CEPH_RGW_TLS_DIR).
    fn start_with_env(env: &[(&str, &std::path::Path)]) -> Option<Cluster> {
        if Command::new("radosgw").arg("--version").output().is_err() {
            assert!(
                std::env::var("BACKSTOP_REQUIRE_CEPH").as_deref() != Ok("1"),
                "BACKSTOP_REQUIRE_CEPH=1 but Ceph is not installed (scripts/setup-ceph.sh)"
            );
            eprintln!("SKIPPED: Ceph is not installed (scripts/setup-ceph.sh)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(script());
        cmd.arg("start").arg(dir.path().join("c"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        if !out.status.success() {
            // Say why the gateway did not come up, and stop what did before the dir goes.
            let log = std::fs::read_to_string(dir.path().join("c/log/client.rgw.a.log"))
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            let _ = Command::new(script())
                .arg("stop")
                .arg(dir.path().join("c"))
                .status();
            panic!(
                "{}\nradosgw log (last lines, newest first):\n{}",
                String::from_utf8_lossy(&out.stderr),
                tail.join("\n")
            );
        }
        let vars = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(Cluster { dir, vars })
    }

    /// A client for `endpoint` with these extra `[offsite]` lines.
    fn client(&self, endpoint: &str, extra: &str) -> Client {
        let cfg = self.config(endpoint, extra).unwrap();
        Client::new(&cfg, Duration::from_secs(120))
    }

    fn config(
        &self,
        endpoint: &str,
        extra: &str,
    ) -> Result<OffsiteConfig, backstop_offsite::config::ConfigError> {
        let text = format!(
            "[offsite]\nendpoint = \"{endpoint}\"\nbucket = \"backstop-test\"\nhost = \"a\"\n{extra}"
        );
        let (ak, sk) = (self.var("S3_ACCESS_KEY"), self.var("S3_SECRET_KEY"));
        let env = move |k: &str| match k {
            backstop_offsite::config::ENV_ACCESS_KEY => Some(ak.clone()),
            backstop_offsite::config::ENV_SECRET_KEY => Some(sk.clone()),
            _ => None,
        };
        OffsiteConfig::from_file_text(&text, &env).map(Option::unwrap)
    }
}

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (the test makes its throwaway CA with it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throwaway CA (ca.pem) and a server certificate for IP 127.0.0.1 only (cert.pem, key.pem)
/// signed by it, in `dir`.
fn make_ca_and_server_cert(dir: &std::path::Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=backstop-test-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "key.pem",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "cert.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// MiB/s of 16 PUTs of the same 4 MiB.
fn put_throughput(client: &Client, prefix: &str, body: &[u8]) -> f64 {
    let start = Instant::now();
    for i in 0..16 {
        client.put(&format!("{prefix}/{i}"), body).unwrap();
    }
    (16 * body.len()) as f64 / (1024.0 * 1024.0) / start.elapsed().as_secs_f64()
}

#[test]
fn https_with_a_private_ca_and_refusals_of_untrusted_certificates() {
    let tls = tempfile::tempdir().unwrap();
    make_ca_and_server_cert(tls.path());
    let Some(c) = Cluster::start_with_env(&[("CEPH_RGW_TLS_DIR", tls.path())]) else {
        return;
    };
    let https = c.var("S3_TLS_ENDPOINT");
    let ca_line = format!("ca_file = \"{}\"\n", tls.path().join("ca.pem").display());

    // With the CA: the round trip over real TLS.
    let client = c.client(&https, &ca_line);
    client.ensure_bucket().unwrap();
    assert_eq!(client.head("tls/none").unwrap(), None);
    client.put("tls/one", b"over https").unwrap();
    assert_eq!(client.head("tls/one").unwrap(), Some(10));
    assert_eq!(client.get("tls/one", 100).unwrap(), b"over https");
    // The gateway still checks the signed digest behind TLS.
    let e = client
        .put_reader("tls/two", &mut &b"hello"[..], 5, &"0".repeat(64))
        .unwrap_err();
    assert!(e.to_string().contains("400"), "{e}");

    // Without ca_file (the built-in Mozilla roots): refused, and said why.
    let e = c.client(&https, "").head("tls/one").unwrap_err();
    let f = backstop_offsite::upload::Failure::from(e);
    println!("no ca_file: {}: {}", f.code, f.message);
    assert_eq!(f.code.as_str(), "ERR_OFFSITE_UNREACHABLE");
    assert!(f.message.contains("TLS: "), "{}", f.message);
    assert!(f.message.contains("UnknownIssuer"), "{}", f.message);

    // The certificate names 127.0.0.1 only: asked for as `localhost`, it is refused.
    let port = c.var("RGW_TLS_PORT");
    let e = c
        .client(&format!("https://localhost:{port}"), &ca_line)
        .get("tls/one", 100)
        .unwrap_err();
    let f = backstop_offsite::upload::Failure::from(e);
    println!("wrong name: {}: {}", f.code, f.message);
    assert_eq!(f.code.as_str(), "ERR_OFFSITE_UNREACHABLE");
    assert!(f.message.contains("TLS: "), "{}", f.message);
    assert!(f.message.contains("not valid for name"), "{}", f.message);

    // A bad ca_file is refused at load, naming the key.
    let notpem = tls.path().join("server.ext");
    let e = c
        .config(&https, &format!("ca_file = \"{}\"\n", notpem.display()))
        .unwrap_err();
    assert_eq!(e.code().as_str(), "ERR_CONFIG_INVALID");
    assert!(e.to_string().starts_with("offsite.ca_file: "), "{e}");

    // The same bytes over http and https to the same gateway.
    let body = pattern(4 * 1024 * 1024, 1);
    let http_client = c.client(&c.var("S3_ENDPOINT"), "");
    let http = put_throughput(&http_client, "bench-http", &body);
    let https_rate = put_throughput(&client, "bench-https", &body);
    println!(
        "rgw upload, 64 MiB in 16 PUTs of 4 MiB: http {http:.1} MiB/s, https {https_rate:.1} MiB/s"
    );
    assert_eq!(
        client.get("bench-http/3", 8 << 20).unwrap(),
        http_client.get("bench-https/3", 8 << 20).unwrap()
    );
}

/// Errors after `ok` bytes: a disk that fails mid-layer.
struct FailingReader {
    inner: std::io::Cursor<Vec<u8>>,
    ok: u64,
}

impl std::io::Read for FailingReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.inner.position() >= self.ok {
            return Err(std::io::Error::other("injected read error"));
        }
        let room = (self.ok - self.inner.position()) as usize;
        let n = buf.len().min(room);
        self.inner.read(&mut buf[..n])
    }
}

#[test]
fn multipart_upload_to_a_real_gateway() {
    use sha2::{Digest, Sha256};
    use std::io::Read;

    let Some(c) = Cluster::start_with_env(&[]) else {
        return;
    };
    let cfg = c
        .config(
            &c.var("S3_ENDPOINT"),
            "multipart_threshold_mib = 8\nmultipart_part_mib = 5\n",
        )
        .unwrap();
    let part = u64::from(cfg.multipart_part_mib) << 20;
    let client = Client::new(&cfg, Duration::from_secs(120));
    client.ensure_bucket().unwrap();

    // 40 MiB in 5 MiB parts: 8 parts, read back byte for byte.
    let body = pattern(40 << 20, 7);
    let sha = hex::encode(Sha256::digest(&body));
    let start = Instant::now();
    let parts = client
        .put_multipart("layers/big", &mut &body[..], body.len() as u64, &sha, part)
        .unwrap();
    let multipart_s = start.elapsed().as_secs_f64();
    assert_eq!(parts, 8);
    assert_eq!(client.head("layers/big").unwrap(), Some(40 << 20));
    let back = client.get("layers/big", 40 << 20).unwrap();
    assert!(back == body, "the object read back differs");
    let start = Instant::now();
    client
        .put_reader("layers/single", &mut &body[..], body.len() as u64, &sha)
        .unwrap();
    let single_s = start.elapsed().as_secs_f64();
    // The multipart path hashes every byte twice on this side (each part's digest for its
    // header, the whole object's against its name); the single PUT was handed its digest.
    let start = Instant::now();
    let again = hex::encode(Sha256::digest(&body));
    let hash_s = start.elapsed().as_secs_f64();
    assert_eq!(again, sha);
    println!(
        "40 MiB: multipart (8 x 5 MiB) {multipart_s:.2} s, single PUT {single_s:.2} s; one sha256 pass over 40 MiB here: {hash_s:.2} s"
    );
    // The default part size: 3 parts.
    let start = Instant::now();
    let parts = client
        .put_multipart(
            "layers/big16",
            &mut &body[..],
            body.len() as u64,
            &sha,
            16 << 20,
        )
        .unwrap();
    assert_eq!(parts, 3);
    println!(
        "40 MiB: multipart (3 x 16 MiB parts) {:.2} s",
        start.elapsed().as_secs_f64()
    );
    assert!(client.list_multipart_uploads("").unwrap().is_empty());

    // Listing sees an upload in progress (so an empty list below means aborted).
    let id = client.create_multipart("layers/open").unwrap();
    let open = client.list_multipart_uploads("layers/").unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0].key, "layers/open");
    assert_eq!(open[0].upload_id, id);
    // A part whose bytes do not match its signed digest is refused by the gateway.
    let e = client
        .upload_part("layers/open", &id, 1, &body[..1024], &"0".repeat(64))
        .unwrap_err();
    assert!(e.to_string().contains("400"), "{e}");
    client.abort_multipart("layers/open", &id).unwrap();
    assert!(client.list_multipart_uploads("").unwrap().is_empty());

    // The reader fails in the third part: the upload is aborted, no part stays.
    let mut failing = FailingReader {
        inner: std::io::Cursor::new(body.clone()),
        ok: 12 << 20,
    };
    let e = client
        .put_multipart("layers/cut", &mut failing, body.len() as u64, &sha, part)
        .unwrap_err();
    let f = backstop_offsite::upload::Failure::from(e);
    assert_eq!(f.code.as_str(), "ERR_STORE_IO", "{}", f.message);
    assert!(f.message.contains("injected read error"), "{}", f.message);
    assert!(client.list_multipart_uploads("").unwrap().is_empty());
    assert_eq!(client.head("layers/cut").unwrap(), None);

    // Bytes that do not hash to the object's name: aborted, not completed.
    let wrong = hex::encode(Sha256::digest(b"something else"));
    let e = client
        .put_multipart(
            "layers/wrong",
            &mut (&body[..]).take(10 << 20),
            10 << 20,
            &wrong,
            part,
        )
        .unwrap_err();
    let f = backstop_offsite::upload::Failure::from(e);
    assert_eq!(f.code.as_str(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
    assert!(client.list_multipart_uploads("").unwrap().is_empty());
    assert_eq!(client.head("layers/wrong").unwrap(), None);
}
