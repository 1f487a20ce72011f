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
