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

// ---- https (a private CA) and multipart upload: issue 20, production readiness ----

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
