//! Store tests: round trip, dedup, one test per rejection, crash safety, resolve.

#![allow(clippy::unwrap_used)] // a test may panic on what it sets up itself

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use backstop_integrity::{canonical, HostKey};
use serde_json::{json, Value};
use tempfile::TempDir;

use super::*;

const MIB: usize = 1024 * 1024;

/// Deterministic pseudo-random bytes (xorshift64*).
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn key() -> HostKey {
    HostKey::from_bytes([7; 32])
}

fn input(reason: &str) -> ManifestInput {
    ManifestInput {
        created_by: "operator:test".into(),
        reason: reason.into(),
        scope: "full".into(),
        vm: "vm1".into(),
        trigger: "console".into(),
        epoch: 1,
        config_fingerprint: "fp-1".into(),
        capture: json!({"pause_us": 3000, "capture_ms": 12}),
        lineage: None,
        name: None,
    }
}

struct Fixture {
    dir: TempDir,
    store: Store,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (store, report) = Store::open(&dir.path().join("store"), key()).unwrap();
        assert_eq!(report, SweepReport::default());
        Self { dir, store }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    fn reopen(&mut self) -> SweepReport {
        let (store, report) = Store::open(&self.root(), key()).unwrap();
        self.store = store;
        report
    }

    /// Two small disk layers outside the store.
    fn layers(&self, seed: u64) -> Vec<PathBuf> {
        let disks = self.dir.path().join(format!("disks-{seed}"));
        fs::create_dir_all(&disks).unwrap();
        let base = disks.join("base.qcow2");
        let top = disks.join("top.qcow2");
        fs::write(&base, random_bytes(seed, 70_000)).unwrap();
        fs::write(&top, random_bytes(seed + 1, 3_000)).unwrap();
        vec![base, top]
    }

    fn snapshot(&self, data: &[u8], layers: &[PathBuf], reason: &str) -> Manifest {
        let mut b = self.store.begin().unwrap();
        b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
            .unwrap();
        if !layers.is_empty() {
            b.add_disk_chain("root", layers).unwrap();
        }
        b.publish(input(reason)).unwrap()
    }

    /// A published snapshot of 1.5 MiB of state and a 2-layer disk.
    fn small_snapshot(&self) -> Manifest {
        let layers = self.layers(100);
        self.snapshot(&random_bytes(1, 3 * MIB / 2), &layers, "small")
    }

    fn snap_dir(&self, id: &str) -> PathBuf {
        self.root().join("snapshots").join(id)
    }

    fn chunk_file(&self, sha256: &str) -> PathBuf {
        self.root().join("chunks").join(&sha256[..2]).join(sha256)
    }

    fn first_chunk(&self, id: &str) -> ChunkRef {
        let bytes = fs::read(self.snap_dir(id).join("vmstate.index")).unwrap();
        ChunkIndex::parse(&bytes).unwrap().chunks.remove(0)
    }

    /// Verifies snapshot `id` and reads its `vmstate` payload back.
    fn read_back(&self, id: &str) -> Vec<u8> {
        let v = self.store.verify(id, &VerifyOptions::default()).unwrap();
        let mut back = Vec::new();
        self.store
            .open_payload(&v, "vmstate")
            .unwrap()
            .read_to_end(&mut back)
            .unwrap();
        back
    }

    fn verify_err(&self, id: &str) -> StoreError {
        self.store
            .verify(id, &VerifyOptions::default())
            .unwrap_err()
    }

    fn tmp_entries(&self) -> usize {
        fs::read_dir(self.root().join("tmp")).unwrap().count()
    }

    fn chunk_files(&self) -> usize {
        let mut n = 0;
        for sub in fs::read_dir(self.root().join("chunks")).unwrap() {
            n += fs::read_dir(sub.unwrap().path()).unwrap().count();
        }
        n
    }

    /// Rewrites a manifest with the host key, as a key holder could. With `rehash`, the id is
    /// derived again and the directory renamed, so the change reaches past the id check.
    fn reseal(&self, id: &str, rehash: bool, change: impl FnOnce(&mut Value)) -> String {
        let dir = self.snap_dir(id);
        let mut value: Value =
            serde_json::from_slice(&fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
        change(&mut value);
        let mut new_id = id.to_string();
        if rehash {
            new_id = manifest::content_id(&value).unwrap();
            value["snapshot_id"] = json!(new_id);
            fs::rename(&dir, self.snap_dir(&new_id)).unwrap();
        }
        let dir = self.snap_dir(&new_id);
        let bytes = canonical::to_vec(&value).unwrap();
        fs::write(dir.join(MANIFEST_FILE), &bytes).unwrap();
        fs::write(
            dir.join(SIGNATURE_FILE),
            format!("{}\n", key().sign_hex(&bytes)),
        )
        .unwrap();
        new_id
    }
}

fn flip_byte(path: &Path, offset: usize) {
    let mut bytes = fs::read(path).unwrap();
    let i = offset % bytes.len();
    bytes[i] ^= 0x01;
    fs::write(path, bytes).unwrap();
}

fn assert_code(err: &StoreError, code: &str) {
    assert_eq!(err.code(), code, "{err}");
}

const INTEGRITY: &str = "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED";
const MANIFEST_INVALID: &str = "ERR_SNAPSHOT_MANIFEST_INVALID";
const BLOCKED: &str = "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED";
const MISSING: &str = "MISSING_SNAPSHOT";

// ---------------------------------------------------------------- round trip and layout

#[test]
fn interrupted_reads_of_the_source_are_retried() {
    /// Every other read is interrupted by a "signal".
    struct Interrupting<'a>(&'a [u8], bool);
    impl Read for Interrupting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.1 = !self.1;
            if self.1 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            self.0.read(buf)
        }
    }
    let fx = Fixture::new();
    let data = random_bytes(7, 3 * MIB);
    let mut b = fx.store.begin().unwrap();
    let payload = b
        .write_chunked(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut Interrupting(&data, false),
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(payload.total_bytes, data.len() as u64);
}

#[test]
fn round_trip_publish_list_verify_and_stream_back() {
    let fx = Fixture::new();
    let data = random_bytes(42, 5 * MIB);
    let layers = fx.layers(7);

    let mut b = fx.store.begin().unwrap();
    let build_dir = b.dir().to_path_buf();
    assert!(build_dir.starts_with(fx.root().join("tmp")));
    let mut seen = Vec::new();
    let payload = b
        .write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |n| {
            seen.push(n)
        })
        .unwrap();
    assert_eq!(payload.total_bytes, data.len() as u64);
    assert_eq!(payload.new_bytes, data.len() as u64);
    assert_eq!(payload.index.as_deref(), Some("vmstate.index"));
    assert!(
        payload.chunks >= 2,
        "5 MiB should be cut into several chunks"
    );
    assert_eq!(seen.len() as u64, payload.chunks);
    assert!(seen.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(seen.last().copied(), Some(data.len() as u64));
    let disk = b.add_disk_chain("root", &layers).unwrap();
    assert_eq!(disk.name, "disk:root");
    assert_eq!(disk.total_bytes, 73_000);

    // Nothing is visible before publish.
    assert!(fx.store.list().unwrap().is_empty());
    let m = b.publish(input("round trip")).unwrap();
    assert!(!build_dir.exists());
    assert_eq!(fx.tmp_entries(), 0);
    assert!(is_snapshot_id(&m.snapshot_id));
    assert_eq!(m.bytes_stored, data.len() as u64);
    assert_eq!(m.checksums.len(), 3);
    assert_eq!(m.checksums[1].reference, "disk:root/base.qcow2");
    assert_eq!(m.checksums[2].reference, "disk:root/top.qcow2");

    let listed = fx.store.list().unwrap();
    assert_eq!(listed, vec![ListEntry::Valid(m.clone())]);

    let v = fx
        .store
        .verify(&m.snapshot_id, &VerifyOptions::default())
        .unwrap();
    assert_eq!(v.manifest, m);
    assert_eq!(v.report.chunks_checked, payload.chunks);
    assert_eq!(v.report.disk_layers_checked, 2);
    assert_eq!(v.report.bytes_checked, data.len() as u64 + 73_000);

    let mut reader = fx.store.open_payload(&v, "vmstate").unwrap();
    assert_eq!(reader.total_bytes(), data.len() as u64);
    let mut back = Vec::new();
    reader.read_to_end(&mut back).unwrap();
    assert!(back == data, "payload differs from the stream written");
}

#[test]
fn layout_is_private_and_manifest_is_canonical_and_signed() {
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    for dir in ["", "chunks", "tmp", "snapshots"] {
        let mode = fs::metadata(fx.root().join(dir))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o700, "{dir}");
    }
    let chunk = fx.first_chunk(&m.snapshot_id);
    let mode = fs::metadata(fx.chunk_file(&chunk.digest))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);

    let dir = fx.snap_dir(&m.snapshot_id);
    let bytes = fs::read(dir.join(MANIFEST_FILE)).unwrap();
    let value: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        canonical::to_vec(&value).unwrap(),
        bytes,
        "manifest.json is canonical"
    );
    for field in [
        "snapshot_id",
        "created_at",
        "created_by",
        "schema_version",
        "index_version",
        "scope",
        "reason",
        "checksums",
        "payload_refs",
        "vm",
        "trigger",
        "epoch",
        "config_fingerprint",
        "capture",
        "bytes_stored",
    ] {
        assert!(value.get(field).is_some(), "{field} missing");
    }
    assert_eq!(value["schema_version"], "1.0");
    assert_eq!(value["index_version"], "1.0");
    assert_eq!(value["checksums"][0]["ref"], "vmstate.index");
    assert_eq!(value["payload_refs"][1]["kind"], "disk-layer-chain");
    assert!(value["payload_refs"][1]["index"].is_null());
    let created = value["created_at"].as_str().unwrap();
    assert_eq!(created.len(), "2026-01-01T00:00:00.000Z".len(), "{created}");
    assert!(created.ends_with('Z'));
    let sig = fs::read_to_string(dir.join(SIGNATURE_FILE)).unwrap();
    assert_eq!(sig, format!("{}\n", key().sign_hex(&bytes)));
    // The id is the content hash with the id blanked.
    let mut blank = value.clone();
    blank["snapshot_id"] = json!("");
    let hash = backstop_integrity::sha256_hex(&canonical::to_vec(&blank).unwrap());
    assert_eq!(m.snapshot_id, hash[..32]);
}

#[test]
fn empty_stream_round_trips() {
    let fx = Fixture::new();
    let m = fx.snapshot(&[], &[], "empty state");
    let back = fx.read_back(&m.snapshot_id);
    assert!(back.is_empty());
}

// ---------------------------------------------------------------- dedup

#[test]
fn same_stream_again_adds_nothing() {
    let fx = Fixture::new();
    let data = random_bytes(5, 5 * MIB);
    let first = fx.snapshot(&data, &[], "first");
    assert_eq!(first.bytes_stored, data.len() as u64);
    let chunks_before = fx.chunk_files();
    let second = fx.snapshot(&data, &[], "second");
    assert_ne!(first.snapshot_id, second.snapshot_id);
    assert_eq!(second.bytes_stored, 0);
    assert_eq!(second.payload_refs[0].new_bytes, 0);
    assert_eq!(fx.chunk_files(), chunks_before);
    fx.store
        .verify(&second.snapshot_id, &VerifyOptions::default())
        .unwrap();
}

/// Where FastCDC cuts a fixed stream: pseudo-random data (content-defined cuts), a run of zeros
/// (cuts forced at the 4 MiB maximum) and an odd-length tail. A fastcdc release that moved these
/// would only cost dedup against the chunks already stored (an index names each chunk's length
/// and digest, so old snapshots stay readable), but it must be a decision, not a surprise.
#[test]
fn chunk_boundaries_of_a_fixed_stream_are_pinned() {
    let fx = Fixture::new();
    let mut data = random_bytes(18, 9 * MIB);
    data.resize(data.len() + 9 * MIB, 0);
    data.extend_from_slice(&random_bytes(19, MIB + 12_345));
    let m = fx.snapshot(&data, &[], "pinned boundaries");
    let index = fs::read(fx.snap_dir(&m.snapshot_id).join("vmstate.index")).unwrap();
    let lens: Vec<u64> = ChunkIndex::parse(&index)
        .unwrap()
        .chunks
        .iter()
        .map(|c| c.len)
        .collect();
    assert_eq!(lens.iter().sum::<u64>(), data.len() as u64);
    assert_eq!(
        lens,
        [
            975_997, 695_794, 567_976, 1_550_668, 308_557, 1_332_917, 951_367, 919_220, 1_257_729,
            4_194_304, 4_194_304, 2_576_324, 410_132
        ]
    );
}

#[test]
fn stream_with_ten_percent_changed_adds_a_small_fraction() {
    let fx = Fixture::new();
    let len = 32 * MIB;
    let mut data = random_bytes(6, len);
    let before = fx.snapshot(&data, &[], "before");
    // The guest rewrote 10 % of its memory, in one region in the middle.
    let changed = len / 10;
    let start = len / 2;
    data[start..start + changed].copy_from_slice(&random_bytes(99, changed));
    let after = fx.snapshot(&data, &[], "after");
    let new = after.bytes_stored;
    eprintln!(
        "chunks {} -> {}, new bytes {new} of {len} ({:.1} %)",
        before.payload_refs[0].chunks,
        after.payload_refs[0].chunks,
        new as f64 * 100.0 / len as f64
    );
    assert!(
        new >= changed as u64,
        "the changed bytes must be stored, got {new}"
    );
    // The changed region plus at most a few chunks around its edges.
    assert!(
        new <= (changed + 4 * CHUNK_AVG_BYTES as usize) as u64,
        "{new} of {len} stored again"
    );
    assert!(new < len as u64 / 4, "{new} of {len} stored again");
    let back = fx.read_back(&after.snapshot_id);
    assert!(back == data);
}

// ---------------------------------------------------------------- rejections

#[test]
fn flipped_byte_in_manifest_fails_the_signature() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    flip_byte(&fx.snap_dir(&id).join(MANIFEST_FILE), 40);
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::SignatureMismatch { .. }), "{err}");
    // list reports it without trusting it.
    match &fx.store.list().unwrap()[..] {
        [ListEntry::Corrupt {
            snapshot_id, code, ..
        }] => {
            assert_eq!(snapshot_id, &id);
            assert_eq!(*code, INTEGRITY);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn flipped_byte_in_signature_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    flip_byte(&fx.snap_dir(&id).join(SIGNATURE_FILE), 10);
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::SignatureMismatch { .. }), "{err}");
}

#[test]
fn missing_signature_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    fs::remove_file(fx.snap_dir(&id).join(SIGNATURE_FILE)).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::SignatureMissing { .. }), "{err}");
}

#[test]
fn missing_or_oversized_manifest_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let path = fx.snap_dir(&id).join(MANIFEST_FILE);
    let original = fs::read(&path).unwrap();
    fs::remove_file(&path).unwrap();
    assert!(matches!(
        fx.verify_err(&id),
        StoreError::ManifestMissing { .. }
    ));
    assert_code(&fx.verify_err(&id), INTEGRITY);
    let mut big = original;
    big.resize(MANIFEST_MAX_BYTES as usize + 1, b' ');
    fs::write(&path, big).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::TooLarge { .. }), "{err}");
}

#[test]
fn another_hosts_key_fails() {
    let mut fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let (store, _) = Store::open(&fx.root(), HostKey::from_bytes([8; 32])).unwrap();
    fx.store = store;
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::SignatureMismatch { .. }), "{err}");
}

#[test]
fn flipped_byte_in_index_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    flip_byte(&fx.snap_dir(&id).join("vmstate.index"), 30);
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains("vmstate.index")),
        "{err}"
    );
}

#[test]
fn missing_index_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    fs::remove_file(fx.snap_dir(&id).join("vmstate.index")).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::IndexMissing { .. }), "{err}");
}

#[test]
fn flipped_byte_in_chunk_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let chunk = fx.first_chunk(&id);
    flip_byte(&fx.chunk_file(&chunk.digest), 12_345);
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains(&chunk.digest)),
        "{err}"
    );
}

#[test]
fn with_several_bad_chunks_verify_names_the_first_in_stream_order() {
    // Chunks are checked on several threads; the error must not depend on which finished first.
    let fx = Fixture::new();
    let m = fx.snapshot(&random_bytes(5, 12 * MIB), &[], "many chunks");
    let bytes = fs::read(fx.snap_dir(&m.snapshot_id).join("vmstate.index")).unwrap();
    let chunks = ChunkIndex::parse(&bytes).unwrap().chunks;
    assert!(chunks.len() >= 6, "{} chunks", chunks.len());
    for c in &chunks[2..] {
        fs::remove_file(fx.chunk_file(&c.digest)).unwrap();
    }
    flip_byte(&fx.chunk_file(&chunks[1].digest), 100);
    for _ in 0..5 {
        let err = fx.verify_err(&m.snapshot_id);
        assert!(
            matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains(&chunks[1].digest)),
            "{err}"
        );
    }
}

#[test]
fn deleted_chunk_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let chunk = fx.first_chunk(&id);
    fs::remove_file(fx.chunk_file(&chunk.digest)).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(&err, StoreError::ChunkMissing { chunk: name, .. } if *name == chunk.digest));
}

#[test]
fn truncated_or_extended_chunk_fails() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let chunk = fx.first_chunk(&id);
    let path = fx.chunk_file(&chunk.digest);
    let original = fs::read(&path).unwrap();
    fs::write(&path, &original[..original.len() - 1]).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(err, StoreError::ChunkSizeMismatch { expected, found, .. }
            if expected == chunk.len && found == chunk.len - 1),
        "{err}"
    );
    let mut longer = original;
    longer.push(0);
    fs::write(&path, longer).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::ChunkSizeMismatch { .. }), "{err}");
}

#[test]
fn flipped_byte_in_disk_layer_fails() {
    let fx = Fixture::new();
    let layers = fx.layers(3);
    let id = fx
        .snapshot(&random_bytes(2, 1000), &layers, "disk")
        .snapshot_id;
    flip_byte(&layers[0], 500);
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains("base.qcow2")),
        "{err}"
    );
}

#[test]
fn missing_or_resized_disk_layer_fails() {
    let fx = Fixture::new();
    let layers = fx.layers(3);
    let id = fx
        .snapshot(&random_bytes(2, 1000), &layers, "disk")
        .snapshot_id;
    let top = fs::read(&layers[1]).unwrap();
    fs::write(&layers[1], &top[..100]).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(err, StoreError::LayerSizeMismatch { found: 100, .. }),
        "{err}"
    );
    fs::remove_file(&layers[1]).unwrap();
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::LayerMissing { .. }), "{err}");
}

#[test]
fn each_missing_or_empty_required_field_is_manifest_invalid() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let manifest_path = fx.snap_dir(&id).join(MANIFEST_FILE);
    let sig_path = fx.snap_dir(&id).join(SIGNATURE_FILE);
    let original = (
        fs::read(&manifest_path).unwrap(),
        fs::read(&sig_path).unwrap(),
    );
    let fields = [
        "snapshot_id",
        "created_at",
        "created_by",
        "schema_version",
        "index_version",
        "scope",
        "reason",
        "checksums",
        "payload_refs",
    ];
    for field in fields {
        for empty in [false, true] {
            fx.reseal(&id, false, |v| {
                let obj = v.as_object_mut().unwrap();
                if empty {
                    let blank = if obj[field].is_array() {
                        json!([])
                    } else {
                        json!("")
                    };
                    obj.insert(field.into(), blank);
                } else {
                    obj.remove(field);
                }
            });
            let err = fx.verify_err(&id);
            assert_code(&err, MANIFEST_INVALID);
            assert!(
                matches!(&err, StoreError::ManifestInvalid { field: f, .. } if f == field),
                "{field}: {err}"
            );
            fs::write(&manifest_path, &original.0).unwrap();
            fs::write(&sig_path, &original.1).unwrap();
        }
    }
    fx.store.verify(&id, &VerifyOptions::default()).unwrap();
}

#[test]
fn our_own_fields_are_required_too() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let id = fx.reseal(&id, true, |v| {
        v.as_object_mut().unwrap().remove("config_fingerprint");
    });
    let err = fx.verify_err(&id);
    assert_code(&err, MANIFEST_INVALID);
    assert!(err.to_string().contains("config_fingerprint"), "{err}");
}

#[test]
fn major_version_2_is_blocked() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let id = fx.reseal(&id, true, |v| v["schema_version"] = json!("2.0"));
    let err = fx.verify_err(&id);
    assert_code(&err, BLOCKED);
    let allowed = VerifyOptions {
        allow_newer_minor: true,
    };
    assert_code(&fx.store.verify(&id, &allowed).unwrap_err(), BLOCKED);

    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    // Blocked before the id is checked: a new major may derive ids differently.
    fx.reseal(&id, false, |v| v["index_version"] = json!("2.0"));
    let err = fx.verify_err(&id);
    assert_code(&err, BLOCKED);
    assert!(matches!(
        err,
        StoreError::CompatibilityBlocked {
            field: "index_version",
            ..
        }
    ));
}

#[test]
fn newer_minor_is_blocked_unless_allowed() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let id = fx.reseal(&id, true, |v| {
        v["schema_version"] = json!("1.1");
        // A newer minor may add fields this build does not know.
        v["future_field"] = json!({"x": 1});
    });
    let err = fx.verify_err(&id);
    assert_code(&err, BLOCKED);
    assert!(matches!(
        err,
        StoreError::CompatibilityBlocked {
            field: "schema_version",
            ..
        }
    ));
    let v = fx
        .store
        .verify(
            &id,
            &VerifyOptions {
                allow_newer_minor: true,
            },
        )
        .unwrap();
    assert_eq!(v.manifest.schema_version, "1.1");
    // list shows it (verify decides whether it may be used).
    assert!(matches!(
        &fx.store.list().unwrap()[..],
        [ListEntry::Valid(_)]
    ));
}

#[test]
fn malformed_version_is_manifest_invalid() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    for bad in ["1", "one.zero", "1.0.0", ""] {
        fx.reseal(&id, false, |v| v["index_version"] = json!(bad));
        let err = fx.verify_err(&id);
        assert_code(&err, MANIFEST_INVALID);
        assert!(
            matches!(&err, StoreError::ManifestInvalid { field, .. } if field == "index_version"),
            "{bad:?}: {err}"
        );
    }
}

#[test]
fn id_must_match_directory_and_content() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    // Signed, but the content no longer hashes to the id.
    fx.reseal(&id, false, |v| v["reason"] = json!("rewritten"));
    let err = fx.verify_err(&id);
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(err, StoreError::ContentHashMismatch { .. }),
        "{err}"
    );

    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let other = "0123456789abcdef0123456789abcdef";
    fs::rename(fx.snap_dir(&id), fx.snap_dir(other)).unwrap();
    let err = fx.verify_err(other);
    assert_code(&err, INTEGRITY);
    assert!(matches!(err, StoreError::IdMismatch { .. }), "{err}");
}

#[test]
fn unknown_snapshot_is_missing() {
    let fx = Fixture::new();
    for id in ["0123456789abcdef0123456789abcdef", "../../etc", ""] {
        assert_code(&fx.verify_err(id), MISSING);
    }
}

// ---------------------------------------------------------------- streaming after verify

#[test]
fn payload_reader_rechecks_chunks_changed_after_verify() {
    let fx = Fixture::new();
    let data = random_bytes(11, 3 * MIB);
    let id = fx.snapshot(&data, &[], "stream").snapshot_id;
    let v = fx.store.verify(&id, &VerifyOptions::default()).unwrap();
    let chunk = fx.first_chunk(&id);
    flip_byte(&fx.chunk_file(&chunk.digest), 77);
    let mut back = Vec::new();
    let err = fx
        .store
        .open_payload(&v, "vmstate")
        .unwrap()
        .read_to_end(&mut back)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(
        back.is_empty(),
        "no byte of a changed chunk may be returned"
    );

    fs::remove_file(fx.chunk_file(&chunk.digest)).unwrap();
    let err = fx
        .store
        .open_payload(&v, "vmstate")
        .unwrap()
        .read_to_end(&mut back)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
}

#[test]
fn open_payload_refuses_unknown_and_unchunked_payloads() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let v = fx.store.verify(&id, &VerifyOptions::default()).unwrap();
    let err = fx.store.open_payload(&v, "nope").unwrap_err();
    assert!(matches!(err, StoreError::NoSuchPayload { .. }), "{err}");
    let err = fx.store.open_payload(&v, "disk:root").unwrap_err();
    assert!(matches!(err, StoreError::NotChunked { .. }), "{err}");
}

// ---------------------------------------------------------------- caller-cut chunks

#[test]
fn caller_cut_chunks_round_trip_dedup_within_and_across_snapshots() {
    let fx = Fixture::new();
    let a = random_bytes(1, 64 * 1024);
    let b = random_bytes(2, 300_000);
    let c = random_bytes(3, 10);
    let cut = |parts: &[&Vec<u8>]| -> Vec<std::io::Result<Vec<u8>>> {
        parts.iter().map(|p| Ok((*p).clone())).collect()
    };

    // `a` twice in one payload: stored once, still two entries in the index.
    let mut builder = fx.store.begin().unwrap();
    let p = builder
        .write_chunks(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut cut(&[&a, &b, &a]).into_iter(),
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(p.chunks, 3);
    assert_eq!(p.total_bytes as usize, 2 * a.len() + b.len());
    assert_eq!(p.new_bytes as usize, a.len() + b.len());
    assert_eq!(
        fx.chunk_files(),
        0,
        "nothing reaches chunks/ before publish"
    );
    let first = builder.publish(input("first")).unwrap();
    assert_eq!(fx.chunk_files(), 2);

    // The next snapshot shares `b`: only `c` is new.
    let mut builder = fx.store.begin().unwrap();
    let p = builder
        .write_chunks(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut cut(&[&b, &c]).into_iter(),
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(p.new_bytes as usize, c.len());
    let second = builder.publish(input("second")).unwrap();
    assert_eq!(second.bytes_stored as usize, c.len());
    assert_eq!(fx.chunk_files(), 3);

    for (m, want) in [
        (&first, [a.clone(), b.clone(), a.clone()].concat()),
        (&second, [b, c].concat()),
    ] {
        let back = fx.read_back(&m.snapshot_id);
        assert_eq!(back, want);
    }
}

#[test]
fn caller_cut_chunks_out_of_bounds_or_failing_are_refused() {
    let fx = Fixture::new();
    for bad in [Vec::new(), vec![0u8; 4 * MIB + 1]] {
        let mut b = fx.store.begin().unwrap();
        let err = b
            .write_chunks(
                "vmstate",
                KIND_RAM_DEVICE,
                &mut vec![Ok(vec![1u8; 10]), Ok(bad)].into_iter(),
                &mut |_| {},
            )
            .unwrap_err();
        assert_code(&err, MANIFEST_INVALID);
        assert!(err.to_string().contains("chunk length"), "{err}");
    }
    let mut b = fx.store.begin().unwrap();
    let err = b
        .write_chunks(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut vec![
                Ok(vec![1u8; 10]),
                Err(std::io::Error::other("capture died")),
            ]
            .into_iter(),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(matches!(err, StoreError::ReadSource { .. }), "{err}");
    drop(b);
    assert_eq!(fx.chunk_files(), 0);
    assert_eq!(fx.tmp_entries(), 0);
    assert!(fx.store.list().unwrap().is_empty());
}

// ---------------------------------------------------------------- building with bad input

#[test]
fn bad_build_input_is_refused() {
    let fx = Fixture::new();
    let mut b = fx.store.begin().unwrap();
    for name in ["", "../x", ".hidden", "a/b", "disk:root"] {
        let err = b.write_chunked(name, KIND_RAM_DEVICE, &mut &b"x"[..], &mut |_| {});
        assert_code(&err.unwrap_err(), MANIFEST_INVALID);
    }
    let err = b.write_chunked(
        "vmstate",
        KIND_DISK_LAYER_CHAIN,
        &mut &b"x"[..],
        &mut |_| {},
    );
    assert_code(&err.unwrap_err(), MANIFEST_INVALID);
    assert_code(
        &b.add_disk_chain("root", &[PathBuf::from("rel.qcow2")])
            .unwrap_err(),
        MANIFEST_INVALID,
    );
    assert_code(
        &b.add_disk_chain("root", &[]).unwrap_err(),
        MANIFEST_INVALID,
    );
    let missing = fx.dir.path().join("no-such-layer");
    assert_code(
        &b.add_disk_chain("root", &[missing]).unwrap_err(),
        "ERR_STORE_IO",
    );
    b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &b"x"[..], &mut |_| {})
        .unwrap();
    let err = b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &b"x"[..], &mut |_| {});
    assert!(matches!(
        err.unwrap_err(),
        StoreError::DuplicatePayload { .. }
    ));
    let mut partial = input("x");
    partial.scope = "partial".into();
    assert_code(&b.publish(partial).unwrap_err(), MANIFEST_INVALID);

    let b = fx.store.begin().unwrap();
    assert!(matches!(
        b.publish(input("nothing")).unwrap_err(),
        StoreError::EmptySnapshot
    ));
    assert!(fx.store.list().unwrap().is_empty());
    assert_eq!(fx.tmp_entries(), 0);
}

#[test]
fn a_failing_source_fails_the_payload() {
    struct Failing(usize);
    impl Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::other("capture died"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(1);
            self.0 -= n;
            Ok(n)
        }
    }
    let fx = Fixture::new();
    let mut b = fx.store.begin().unwrap();
    let err = b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut Failing(MIB), &mut |_| {});
    let err = err.unwrap_err();
    assert!(matches!(err, StoreError::ReadSource { .. }), "{err}");
    assert_code(&err, "ERR_STORE_IO");
}

// ---------------------------------------------------------------- crash safety

#[test]
fn dropped_builder_leaves_nothing_after_reopen() {
    let mut fx = Fixture::new();
    let earlier = fx.small_snapshot();
    let chunks_before = fx.chunk_files();

    let mut b = fx.store.begin().unwrap();
    let p = b
        .write_chunked(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut &random_bytes(77, 2 * MIB)[..],
            &mut |_| {},
        )
        .unwrap();
    assert!(p.new_bytes > 0);
    // New chunks wait in the build directory: nothing unpublished ever enters chunks/.
    assert_eq!(fx.chunk_files(), chunks_before);
    let pending = fs::read_dir(b.dir().join("pending")).unwrap().count() as u64;
    assert_eq!(pending, p.chunks);
    drop(b);
    assert_eq!(fx.tmp_entries(), 0, "drop removes the build directory");

    let report = fx.reopen();
    assert_eq!(report, SweepReport::default());
    assert_eq!(fx.chunk_files(), chunks_before);
    assert_eq!(
        fx.store.list().unwrap(),
        vec![ListEntry::Valid(earlier.clone())]
    );
    fx.store
        .verify(&earlier.snapshot_id, &VerifyOptions::default())
        .unwrap();
}

#[test]
fn build_interrupted_by_a_crash_is_swept_at_open() {
    let mut fx = Fixture::new();
    let shared = random_bytes(8, 2 * MIB);
    let earlier = fx.snapshot(&shared, &fx.layers(1), "earlier");
    let chunks_before = fx.chunk_files();

    // The process "dies" mid-build: the builder never runs its Drop.
    let mut b = fx.store.begin().unwrap();
    let mut data = shared.clone();
    data.extend(random_bytes(9, 2 * MIB));
    let p = b
        .write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
        .unwrap();
    assert!(
        p.new_bytes > 0 && p.new_bytes < p.total_bytes,
        "shares chunks with earlier"
    );
    assert_eq!(
        fx.chunk_files(),
        chunks_before,
        "pending chunks stay in tmp/"
    );
    std::mem::forget(b);
    // ...and a chunk was half written when it died (a store written by an older version).
    let stray = fx.root().join("chunks/ab/.tmp-0011223344556677");
    fs::create_dir_all(stray.parent().unwrap()).unwrap();
    fs::write(&stray, b"partial").unwrap();
    // ...and another build had got as far as writing its manifest.
    let copy = fx.root().join("tmp/abandoned");
    fs::create_dir(&copy).unwrap();
    for name in [MANIFEST_FILE, SIGNATURE_FILE, "vmstate.index"] {
        fs::copy(
            fx.snap_dir(&earlier.snapshot_id).join(name),
            copy.join(name),
        )
        .unwrap();
    }
    assert_eq!(fx.tmp_entries(), 2);

    let report = fx.reopen();
    assert_eq!(report.tmp_removed, 2);
    assert_eq!(report.chunks_removed, 1, "the stray: {report:?}");
    assert_eq!(fx.tmp_entries(), 0);
    assert!(!stray.exists());
    assert_eq!(fx.chunk_files(), chunks_before, "only the orphans are gone");
    assert_eq!(
        fx.store.list().unwrap(),
        vec![ListEntry::Valid(earlier.clone())]
    );
    fx.store
        .verify(&earlier.snapshot_id, &VerifyOptions::default())
        .unwrap();
    // A second open finds nothing more to do.
    assert_eq!(fx.reopen(), SweepReport::default());
}

/// A crash inside `publish` after the syncfs and the chunk renames, before the build directory
/// was renamed into `snapshots/`: the manifest rename is the commit point, so no snapshot
/// exists, and the chunks that reached `chunks/` are referenced by nothing and collected at the
/// next open (those an earlier snapshot shares stay).
#[test]
fn a_crash_after_the_chunks_moved_but_before_the_publishing_rename_leaves_no_snapshot() {
    let mut fx = Fixture::new();
    let shared = random_bytes(10, 2 * MIB);
    let earlier = fx.snapshot(&shared, &[], "earlier");
    let chunks_before = fx.chunk_files();

    let mut b = fx.store.begin().unwrap();
    let mut data = shared.clone();
    data.extend(random_bytes(11, 3 * MIB));
    let p = b
        .write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
        .unwrap();
    assert!(p.new_bytes > 0 && p.new_bytes < p.total_bytes);
    // What publish does up to its last step: every pending chunk under its final name, the
    // manifest and signature written in the build directory (copied from a real snapshot).
    let pending = b.dir().join("pending");
    let mut moved = 0;
    for entry in fs::read_dir(&pending).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        let to = fx.chunk_file(&name);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::rename(entry.path(), &to).unwrap();
        moved += 1;
    }
    assert!(moved > 0);
    for name in [MANIFEST_FILE, SIGNATURE_FILE] {
        fs::copy(
            fx.snap_dir(&earlier.snapshot_id).join(name),
            b.dir().join(name),
        )
        .unwrap();
    }
    std::mem::forget(b); // the process dies: no Drop
    assert_eq!(fx.chunk_files(), chunks_before + moved);
    assert_eq!(
        fx.store.list().unwrap(),
        vec![ListEntry::Valid(earlier.clone())],
        "nothing is published before the rename"
    );

    let report = fx.reopen();
    assert_eq!(report.tmp_removed, 1);
    assert_eq!(report.chunks_removed, moved as u64);
    assert_eq!(fx.chunk_files(), chunks_before);
    assert_eq!(
        fx.store.list().unwrap(),
        vec![ListEntry::Valid(earlier.clone())]
    );
    fx.store
        .verify(&earlier.snapshot_id, &VerifyOptions::default())
        .unwrap();
    // The same stream captured again is whole: the collected chunks are written anew.
    let again = fx.snapshot(&data, &[], "again");
    assert_eq!(again.bytes_stored, p.new_bytes);
    assert_eq!(fx.read_back(&again.snapshot_id), data);
}

#[test]
fn unreadable_published_index_stops_chunk_collection() {
    let mut fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let mut b = fx.store.begin().unwrap();
    b.write_chunked(
        "vmstate",
        KIND_RAM_DEVICE,
        &mut &random_bytes(3, MIB)[..],
        &mut |_| {},
    )
    .unwrap();
    drop(b);
    let chunks = fx.chunk_files();
    fs::write(fx.snap_dir(&id).join("vmstate.index"), b"{garbage").unwrap();
    let report = fx.reopen();
    assert_eq!(
        report.chunks_removed, 0,
        "unknown references: keep every chunk"
    );
    assert_eq!(fx.chunk_files(), chunks);
}

// ---------------------------------------------------------------- resolve and list order

#[test]
fn resolve_by_id_and_prefix_ambiguous_and_missing() {
    let fx = Fixture::new();
    // 17 ids over 16 hex digits: two must share their first digit.
    let ids: Vec<String> = (0..17)
        .map(|i| {
            fx.snapshot(&random_bytes(i, 1000), &[], &format!("r{i}"))
                .snapshot_id
        })
        .collect();
    for id in &ids {
        assert_eq!(&fx.store.resolve(id).unwrap(), id);
        let unique = (1..=32)
            .map(|n| &id[..n])
            .find(|p| ids.iter().filter(|o| o.starts_with(p)).count() == 1)
            .unwrap();
        assert_eq!(&fx.store.resolve(unique).unwrap(), id);
    }
    let shared = (b'0'..=b'f')
        .filter(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        .map(|c| (c as char).to_string())
        .find(|p| ids.iter().filter(|o| o.starts_with(p.as_str())).count() > 1)
        .unwrap();
    let err = fx.store.resolve(&shared).unwrap_err();
    assert_code(&err, MISSING);
    assert!(matches!(&err, StoreError::AmbiguousPrefix { matches, .. } if matches.len() > 1));

    let absent = (0..)
        .map(|i: u32| format!("{i:032x}"))
        .find(|c| !ids.contains(c))
        .unwrap();
    for bad in [
        absent.as_str(),
        "",
        "XYZ",
        "../snapshots",
        &format!("{}0", ids[0]),
    ] {
        let err = fx.store.resolve(bad).unwrap_err();
        assert_code(&err, MISSING);
        assert!(matches!(err, StoreError::MissingSnapshot { .. }), "{bad:?}");
    }

    let listed = fx.store.list().unwrap();
    assert_eq!(listed.len(), 17);
    let times: Vec<String> = listed
        .iter()
        .map(|e| match e {
            ListEntry::Valid(m) => m.created_at.clone(),
            ListEntry::Corrupt { .. } => panic!("{e:?}"),
        })
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "oldest first: {times:?}"
    );
    let mut listed_ids: Vec<&str> = listed.iter().map(ListEntry::snapshot_id).collect();
    let mut all: Vec<&str> = ids.iter().map(String::as_str).collect();
    listed_ids.sort();
    all.sort();
    assert_eq!(listed_ids, all);
}

#[test]
fn list_puts_unusable_entries_last() {
    let fx = Fixture::new();
    let a = fx.small_snapshot();
    let b = fx.snapshot(&random_bytes(4, 1000), &[], "later");
    flip_byte(&fx.snap_dir(&a.snapshot_id).join(MANIFEST_FILE), 3);
    fs::create_dir(fx.root().join("snapshots/not-an-id")).unwrap();
    let listed = fx.store.list().unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0], ListEntry::Valid(b));
    assert!(listed[1..]
        .iter()
        .all(|e| matches!(e, ListEntry::Corrupt { code, .. } if *code == INTEGRITY)));
}

// ---------------------------------------------------------------- never panics on file content

mod never_panics {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Arbitrary manifest bytes, signed with the right key so they reach the decoder.
        #[test]
        fn signed_garbage_manifest_is_an_error_not_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..1024)
        ) {
            let fx = Fixture::new();
            let id = "00112233445566778899aabbccddeeff";
            let dir = fx.snap_dir(id);
            fs::create_dir(&dir).unwrap();
            fs::write(dir.join(MANIFEST_FILE), &bytes).unwrap();
            fs::write(dir.join(SIGNATURE_FILE), format!("{}\n", key().sign_hex(&bytes))).unwrap();
            prop_assert!(fx.store.verify(id, &VerifyOptions::default()).is_err());
            let corrupt = matches!(&fx.store.list().unwrap()[..], [ListEntry::Corrupt { .. }]);
            prop_assert!(corrupt);
        }
    }
}

/// The store's long work keeps its caller alive: hashing a disk layer calls the keepalive after
/// every MiB (building and verifying), and checking chunks after every chunk, also on the
/// verification's worker threads.
#[test]
fn long_work_calls_the_keepalive_per_mib_hashed_and_per_chunk_checked() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let fx = Fixture::new();
    let calls = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&calls);
    let store = fx.store.clone().with_keepalive(Arc::new(move || {
        counter.fetch_add(1, Ordering::Relaxed);
    }));
    let layer = fx.root().join("big-layer.qcow2");
    fs::write(&layer, random_bytes(9, 6 * MIB)).unwrap();
    let mut b = store.begin().unwrap();
    let data = random_bytes(10, 5 * MIB);
    let payload = b
        .write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
        .unwrap();
    b.add_disk_chain("root", std::slice::from_ref(&layer))
        .unwrap();
    let built = calls.swap(0, Ordering::Relaxed);
    assert!(built >= 6, "6 MiB hashed with {built} keepalives");
    let m = b.publish(input("keepalive")).unwrap();
    store
        .verify(&m.snapshot_id, &VerifyOptions::default())
        .unwrap();
    let verified = calls.load(Ordering::Relaxed);
    assert!(
        verified >= 6 + payload.chunks,
        "6 MiB layer and {} chunks verified with {verified} keepalives",
        payload.chunks
    );
    // A store without a keepalive verifies the same snapshot and calls nothing.
    fx.store
        .verify(&m.snapshot_id, &VerifyOptions::default())
        .unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), verified);
}

// ---------------------------------------------------------------- drift: per-chunk re-verification

#[test]
fn a_snapshot_rechecked_chunk_by_chunk_finds_the_damaged_one_and_quarantines_it() {
    let fx = Fixture::new();
    let id = fx.small_snapshot().snapshot_id;
    let chunks = fx.store.snapshot_chunks(&id).unwrap();
    assert!(!chunks.is_empty());
    for c in &chunks {
        fx.store.check_chunk(&id, c).unwrap();
    }
    let bad = chunks[0].clone();
    flip_byte(&fx.chunk_file(&bad.digest), 7);
    let err = fx.store.check_chunk(&id, &bad).unwrap_err();
    assert!(matches!(err, StoreError::ChecksumMismatch { .. }), "{err}");
    let to = fx.store.quarantine_chunk(&bad.digest).unwrap();
    assert!(to.starts_with(fx.store.root().join("quarantine")));
    assert!(!fx.chunk_file(&bad.digest).exists());
    let err = fx.store.check_chunk(&id, &bad).unwrap_err();
    assert!(matches!(err, StoreError::ChunkMissing { .. }), "{err}");
    // Not a chunk name: refused, nothing moved.
    assert!(fx.store.quarantine_chunk("../../etc").is_err());
    // A damaged index is refused before any chunk is named.
    flip_byte(&fx.snap_dir(&id).join("vmstate.index"), 3);
    assert_code(&fx.store.snapshot_chunks(&id).unwrap_err(), INTEGRITY);
}

// ---------------------------------------------------------------- checked once

fn verify_trusting(fx: &Fixture, id: &str) -> Result<VerifiedSnapshot, StoreError> {
    fx.store
        .verify_trusting_checked(id, &VerifyOptions::default())
}

#[test]
fn what_the_builder_wrote_is_trusted_until_a_file_changes() {
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    let id = &m.snapshot_id;
    // Every chunk and both layers were hashed in memory as they were written: nothing is read.
    let v = verify_trusting(&fx, id).unwrap();
    assert_eq!(v.report.bytes_checked, 0, "{:?}", v.report);
    let total: u64 = m.payload_refs.iter().map(|p| p.total_bytes).sum();
    assert_eq!(v.report.bytes_trusted, total);
    // A full verification never trusts the record.
    let full = fx.store.verify(id, &VerifyOptions::default()).unwrap();
    assert_eq!(full.report.bytes_trusted, 0);
    assert_eq!(full.report.bytes_checked, total);

    // A chunk changed behind the store's back (same length): read again, and it fails.
    let chunk = fx.first_chunk(id);
    std::thread::sleep(std::time::Duration::from_millis(20)); // a later clock tick (checked.rs)
    flip_byte(&fx.chunk_file(&chunk.digest), 7);
    let err = verify_trusting(&fx, id).unwrap_err();
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains(&chunk.digest)),
        "{err}"
    );
    // Put back byte for byte, it verifies again (read, not trusted: its ctime moved).
    flip_byte(&fx.chunk_file(&chunk.digest), 7);
    let v = verify_trusting(&fx, id).unwrap();
    assert_eq!(v.report.bytes_checked, chunk.len, "{:?}", v.report);
    // ...and from then on it is trusted again.
    assert_eq!(verify_trusting(&fx, id).unwrap().report.bytes_checked, 0);
}

#[test]
fn a_layer_rewritten_in_place_is_read_again_and_fails() {
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    let id = &m.snapshot_id;
    let layer = m
        .payload_refs
        .iter()
        .flat_map(|p| p.layers.iter())
        .next()
        .unwrap()
        .path
        .clone();
    std::thread::sleep(std::time::Duration::from_millis(20)); // a later clock tick (checked.rs)
    flip_byte(&layer, 1_000);
    let err = verify_trusting(&fx, id).unwrap_err();
    assert_code(&err, INTEGRITY);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains("disk layer")),
        "{err}"
    );
    // Removed: missing, not trusted from memory.
    fs::remove_file(&layer).unwrap();
    let err = verify_trusting(&fx, id).unwrap_err();
    assert!(matches!(err, StoreError::LayerMissing { .. }), "{err}");
}

#[test]
fn a_reopened_store_trusts_nothing_and_a_deleted_chunk_is_missing() {
    let mut fx = Fixture::new();
    let m = fx.small_snapshot();
    let id = m.snapshot_id.clone();
    // The record is this process's memory of one store: a fresh open starts empty.
    fx.reopen();
    let v = verify_trusting(&fx, &id).unwrap();
    assert_eq!(v.report.bytes_trusted, 0);
    assert!(v.report.bytes_checked > 0);
    assert_eq!(
        verify_trusting(&fx, &id).unwrap().report.bytes_checked,
        0,
        "checked once, trusted after"
    );
    let chunk = fx.first_chunk(&id);
    fs::remove_file(fx.chunk_file(&chunk.digest)).unwrap();
    let err = verify_trusting(&fx, &id).unwrap_err();
    assert!(matches!(&err, StoreError::ChunkMissing { chunk: name, .. } if *name == chunk.digest));
}

#[test]
fn a_trusted_chunk_swapped_for_another_file_or_a_symlink_is_read_again() {
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    let id = &m.snapshot_id;
    assert_eq!(verify_trusting(&fx, id).unwrap().report.bytes_checked, 0);
    let chunk = fx.first_chunk(id);
    let path = fx.chunk_file(&chunk.digest);
    // The same bytes in a new file renamed over it: another inode, so read (and it passes).
    let copy = path.with_extension("copy");
    fs::copy(&path, &copy).unwrap();
    fs::rename(&copy, &path).unwrap();
    let v = verify_trusting(&fx, id).unwrap();
    assert_eq!(v.report.bytes_checked, chunk.len, "{:?}", v.report);
    // A symlink to other bytes of the same length: the link is not the file that was
    // checked, so the bytes it leads to are read, and they fail.
    let other = fx.store.root().join("other-bytes");
    let mut bytes = fs::read(&path).unwrap();
    bytes[3] ^= 0xff;
    fs::write(&other, &bytes).unwrap();
    fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&other, &path).unwrap();
    let err = verify_trusting(&fx, id).unwrap_err();
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains(&chunk.digest)),
        "{err}"
    );
}

#[test]
fn resolve_tries_the_exact_id_then_the_name_then_a_unique_prefix() {
    let fx = Fixture::new();
    let publish = |name: Option<&str>, seed: u64| {
        let mut b = fx.store.begin().unwrap();
        let data = random_bytes(seed, 1000);
        b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &data[..], &mut |_| {})
            .unwrap();
        let mut i = input("named");
        i.name = name.map(str::to_string);
        b.publish(i).unwrap()
    };
    let a = publish(Some("before-upgrade"), 1);
    let b = publish(None, 2);
    assert_eq!(a.name.as_deref(), Some("before-upgrade"));
    assert_eq!(fx.store.resolve("before-upgrade").unwrap(), a.snapshot_id);
    assert_eq!(fx.store.resolve(&a.snapshot_id).unwrap(), a.snapshot_id);
    assert_eq!(fx.store.resolve(&b.snapshot_id).unwrap(), b.snapshot_id);
    let unique = (1..=32)
        .map(|n| &b.snapshot_id[..n])
        .find(|p| !a.snapshot_id.starts_with(p))
        .unwrap();
    assert_eq!(fx.store.resolve(unique).unwrap(), b.snapshot_id);
    // Names are exact (case and all): anything else is missing.
    for missing in ["Before-upgrade", "before", "before-upgrade2"] {
        let err = fx.store.resolve(missing).unwrap_err();
        assert!(
            matches!(err, StoreError::MissingSnapshot { .. }),
            "{missing}"
        );
    }
    // The list carries the name, for every view that shows it.
    let listed = fx.store.list().unwrap();
    assert!(listed
        .iter()
        .any(|e| matches!(e, ListEntry::Valid(m) if m.name.as_deref() == Some("before-upgrade"))));
    // An invalid name is refused at publish, nothing published.
    let mut bld = fx.store.begin().unwrap();
    bld.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &b"x"[..], &mut |_| {})
        .unwrap();
    let mut bad = input("bad name");
    bad.name = Some("-x".into());
    assert!(bld.publish(bad).is_err());
    assert_eq!(fx.store.list().unwrap().len(), 2);
}

#[test]
fn a_disk_layer_seen_before_and_unchanged_is_not_read_again_by_the_next_snapshot() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut fx = Fixture::new();
    let reads = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&reads);
    // keepalive runs once per MiB a layer is hashed: it counts the layer reads.
    fx.store = fx.store.clone().with_keepalive(Arc::new(move || {
        counter.fetch_add(1, Ordering::Relaxed);
    }));
    let disks = fx.dir.path().join("big");
    fs::create_dir_all(&disks).unwrap();
    let base = disks.join("base.img");
    fs::write(&base, random_bytes(77, 4 * MIB)).unwrap();
    let layers = vec![base.clone()];
    let data = random_bytes(78, 1000);
    let during = |fx: &Fixture, why: &str| {
        let before = reads.load(Ordering::Relaxed);
        let m = fx.snapshot(&data, &layers, why);
        (reads.load(Ordering::Relaxed) - before, m)
    };
    let (first, m1) = during(&fx, "first");
    assert!(
        first >= 4,
        "the first snapshot reads the 4 MiB layer: {first}"
    );
    let (second, m2) = during(&fx, "second");
    assert!(second < first, "read again: {second} vs {first}");
    let digest = |m: &Manifest| {
        m.payload_refs
            .iter()
            .find(|p| !p.layers.is_empty())
            .unwrap()
            .layers[0]
            .sha256
            .clone()
    };
    assert_eq!(digest(&m1), digest(&m2));
    // Changed in place: read again, and the new digest is recorded. (Not within the same
    // coarse clock tick as the recording: see checked.rs.)
    std::thread::sleep(std::time::Duration::from_millis(20));
    flip_byte(&base, 5);
    let (third, m3) = during(&fx, "third");
    assert!(third >= 4, "a changed layer is read: {third}");
    assert_ne!(digest(&m3), digest(&m1));
    assert!(fx
        .store
        .verify(&m3.snapshot_id, &VerifyOptions::default())
        .is_ok());
}

/// A publish moves its new chunks to their final names on two threads: every one of them
/// lands under its name (and reads back), and one that cannot fails the publish with the
/// rename named, nothing published.
#[test]
fn chunk_renames_shared_by_threads_all_land_or_the_publish_fails() {
    let fx = Fixture::new();
    let data = random_bytes(30, 6 * MIB);
    let m = fx.snapshot(&data, &[], "many chunks");
    let index =
        ChunkIndex::parse(&fs::read(fx.snap_dir(&m.snapshot_id).join("vmstate.index")).unwrap())
            .unwrap();
    use crate::builder::RENAME_THREADS;
    assert!(
        index.chunks.len() >= 2 * RENAME_THREADS,
        "{} chunks",
        index.chunks.len()
    );
    for c in &index.chunks {
        assert!(
            fx.chunk_file(&c.digest).is_file(),
            "chunk {} not under its name",
            c.digest
        );
    }
    assert_eq!(fx.read_back(&m.snapshot_id), data);
    assert!(!fx.snap_dir(&m.snapshot_id).join("pending").exists());

    // The next build's chunks: one whose directory is taken by a plain file cannot move.
    let more = random_bytes(31, 6 * MIB);
    let mut b = fx.store.begin().unwrap();
    b.write_chunked("vmstate", KIND_RAM_DEVICE, &mut &more[..], &mut |_| {})
        .unwrap();
    let pending: Vec<String> = fs::read_dir(b.dir().join("pending"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        pending.len() >= 2 * RENAME_THREADS,
        "{} new chunks",
        pending.len()
    );
    let blocked = pending
        .iter()
        .map(|sha| fx.root().join("chunks").join(&sha[..2]))
        .find(|d| !d.exists())
        .expect("a chunk whose directory does not exist yet");
    fs::write(&blocked, b"not a directory").unwrap();
    let err = b.publish(input("blocked")).unwrap_err();
    assert!(matches!(err, StoreError::Rename { .. }), "{err}");
    assert_code(&err, "ERR_STORE_IO");
    assert_eq!(
        fx.store.list().unwrap(),
        vec![ListEntry::Valid(m.clone())],
        "nothing published"
    );
}

/// A chunk file the writer cannot create ends the payload with that write's error — the
/// writer, its flusher and the hashing stage all stop (no hang) — and the build leaves nothing.
#[test]
fn a_chunk_the_writer_cannot_create_fails_the_payload_and_leaves_nothing() {
    let fx = Fixture::new();
    let chunks: Vec<Vec<u8>> = (0..40u64).map(|i| random_bytes(200 + i, 70_000)).collect();
    let mut b = fx.store.begin().unwrap();
    // The writer creates each new chunk with create_new: a name already taken cannot be.
    let pending = b.dir().join("pending");
    fs::create_dir(&pending).unwrap();
    let taken = backstop_integrity::sha256_hex(&chunks[25]);
    fs::write(pending.join(&taken), b"in the way").unwrap();
    let err = b
        .write_chunks(
            "vmstate",
            KIND_RAM_DEVICE,
            &mut chunks.clone().into_iter().map(Ok),
            &mut |_| {},
        )
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Write { path, .. } if path.ends_with(&taken)),
        "{err}"
    );
    drop(b);
    assert_eq!(fx.chunk_files(), 0);
    assert_eq!(fx.tmp_entries(), 0);
    assert!(fx.store.list().unwrap().is_empty());
}

/// `[daemon] chunk_hash = "blake3"`: chunks named by BLAKE3, index version 1.1; the bytes read
/// back, each chunk's file is its BLAKE3 digest, and a flipped byte is caught by verification as
/// with sha256.
#[test]
fn a_blake3_store_names_chunks_by_blake3_and_verifies_them() {
    let mut fx = Fixture::new();
    fx.store = fx.store.clone().with_chunk_hash(ChunkHash::Blake3);
    assert_eq!(fx.store.chunk_hash(), ChunkHash::Blake3);
    let data = random_bytes(31, 3 * MIB);
    let m = fx.snapshot(&data, &fx.layers(31), "blake3");
    assert_eq!(m.index_version, "1.1");
    let text = fs::read_to_string(fx.snap_dir(&m.snapshot_id).join("vmstate.index")).unwrap();
    assert!(
        text.contains(r#""blake3":""#) && !text.contains("sha256"),
        "{text}"
    );
    let index = ChunkIndex::parse(text.as_bytes()).unwrap();
    assert_eq!(index.hash(), Some(ChunkHash::Blake3));
    let mut offset = 0usize;
    for c in &index.chunks {
        let bytes = fs::read(fx.chunk_file(&c.digest)).unwrap();
        assert_eq!(bytes, data[offset..offset + c.len as usize]);
        assert_eq!(c.digest, blake3::hash(&bytes).to_hex().to_string());
        offset += c.len as usize;
    }
    assert_eq!(offset, data.len());
    assert_eq!(fx.read_back(&m.snapshot_id), data);

    let chunk = fx.first_chunk(&m.snapshot_id);
    flip_byte(&fx.chunk_file(&chunk.digest), 4_321);
    let err = fx.verify_err(&m.snapshot_id);
    assert!(
        matches!(&err, StoreError::ChecksumMismatch { what, .. } if what.contains(&chunk.digest)),
        "{err}"
    );
}

/// A store that switches hash keeps every snapshot readable: the sha256 snapshot written before
/// and the BLAKE3 one after both verify and read back; the same bytes are stored once per hash
/// (the namespaces never meet); removing the older snapshot collects exactly its chunks, and a
/// reopen (the startup sweep) collects nothing of either.
#[test]
fn sha256_and_blake3_snapshots_live_side_by_side() {
    let mut fx = Fixture::new();
    let data = random_bytes(41, 2 * MIB);
    let old = fx.snapshot(&data, &[], "sha256");
    assert_eq!(old.index_version, "1.0");
    let old_chunks = fx.chunk_files();
    fx.store = fx.store.clone().with_chunk_hash(ChunkHash::Blake3);
    let new = fx.snapshot(&data, &[], "blake3");
    assert_eq!(new.index_version, "1.1");
    assert_eq!(fx.chunk_files(), 2 * old_chunks, "one copy per hash");
    assert_eq!(fx.reopen(), SweepReport::default());
    fx.store = fx.store.clone().with_chunk_hash(ChunkHash::Blake3);
    assert_eq!(fx.read_back(&old.snapshot_id), data);
    assert_eq!(fx.read_back(&new.snapshot_id), data);
    let report = fx
        .store
        .remove_snapshots(std::slice::from_ref(&old.snapshot_id))
        .unwrap();
    assert_eq!(report.chunks_removed, old_chunks as u64);
    assert_eq!(fx.chunk_files(), old_chunks);
    assert_eq!(fx.read_back(&new.snapshot_id), data);
    // A disks-only snapshot stays index 1.0 whatever the store's hash: nothing in it needs 1.1.
    let mut b = fx.store.begin().unwrap();
    b.add_disk_chain("root", &fx.layers(42)).unwrap();
    assert_eq!(b.publish(input("disks")).unwrap().index_version, "1.0");
}

/// An index of BLAKE3 chunks under a manifest that claims index 1.0 (which names chunks by
/// sha256 only) is refused, though the signature and every checksum are good.
#[test]
fn blake3_chunks_under_index_version_1_0_are_refused() {
    let mut fx = Fixture::new();
    fx.store = fx.store.clone().with_chunk_hash(ChunkHash::Blake3);
    let m = fx.snapshot(&random_bytes(51, MIB), &[], "blake3");
    let id = fx.reseal(&m.snapshot_id, true, |v| v["index_version"] = json!("1.0"));
    let err = fx.verify_err(&id);
    assert!(
        matches!(&err, StoreError::IndexInvalid { reason, .. } if reason.contains("blake3 chunks in a manifest of index version 1.0")),
        "{err}"
    );
}

/// The reader hands out the same bytes whatever the caller's buffer: a byte at a time (through
/// its own buffer), or several MiB (whole chunks read from their files straight into it); and
/// with a big buffer a changed chunk still fails, after exactly the chunks before it.
#[test]
fn payload_reader_gives_the_same_bytes_at_any_read_size_and_rechecks_direct_reads() {
    let fx = Fixture::new();
    let data = random_bytes(61, 5 * MIB);
    let id = fx.snapshot(&data, &[], "sizes").snapshot_id;
    let v = fx.store.verify(&id, &VerifyOptions::default()).unwrap();
    let read_with =
        |size: usize| read_in_steps(&mut fx.store.open_payload(&v, "vmstate").unwrap(), size);
    for size in [1, 4096, MIB, 4 * MIB + 1, 9 * MIB] {
        let (back, res) = read_with(size);
        res.unwrap();
        assert!(back == data, "read size {size}: payload differs");
    }
    let index =
        ChunkIndex::parse(&fs::read(fx.snap_dir(&id).join("vmstate.index")).unwrap()).unwrap();
    assert!(index.chunks.len() >= 3, "{}", index.chunks.len());
    let bad = &index.chunks[2];
    flip_byte(&fx.chunk_file(&bad.digest), 9);
    let before: u64 = index.chunks[..2].iter().map(|c| c.len).sum();
    for size in [4096, 9 * MIB] {
        let (back, res) = read_with(size);
        assert_eq!(res.unwrap_err().kind(), io::ErrorKind::InvalidData);
        assert_eq!(back.len() as u64, before, "read size {size}");
    }
}

/// The reader opens chunks ahead of its turn (a readahead window, for chunks not in the page
/// cache): a chunk that vanished or changed far past the window's start still fails only at its
/// own turn, after exactly the bytes of the chunks before it, whatever the read size; and the
/// early start (`prefetch`) changes none of that.
#[test]
fn payload_reader_reads_ahead_yet_fails_a_bad_chunk_only_at_its_turn() {
    let fx = Fixture::new();
    let parts: Vec<Vec<u8>> = (0..300).map(|i| random_bytes(1000 + i, 4096)).collect();
    let mut b = fx.store.begin().unwrap();
    b.write_chunks(
        "vmstate",
        KIND_RAM_DEVICE,
        &mut parts.iter().map(|p| Ok(p.clone())),
        &mut |_| {},
    )
    .unwrap();
    let id = b.publish(input("ahead")).unwrap().snapshot_id;
    let v = fx.store.verify(&id, &VerifyOptions::default()).unwrap();
    let index =
        ChunkIndex::parse(&fs::read(fx.snap_dir(&id).join("vmstate.index")).unwrap()).unwrap();
    assert_eq!(index.chunks.len(), 300);
    let read_all = |size: usize, early: bool| {
        let mut r = fx.store.open_payload(&v, "vmstate").unwrap();
        if early {
            r.prefetch();
        }
        read_in_steps(&mut r, size)
    };
    let (back, res) = read_all(MIB, true);
    res.unwrap();
    assert!(back == parts.concat(), "the whole payload, in order");

    fs::remove_file(fx.chunk_file(&index.chunks[250].digest)).unwrap();
    flip_byte(&fx.chunk_file(&index.chunks[180].digest), 5);
    for (size, early) in [(1000, false), (MIB, true), (4 * MIB, false)] {
        let (back, res) = read_all(size, early);
        let err = res.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("changed content"), "{err}");
        assert!(
            back == parts[..180].concat(),
            "read size {size}: {} bytes",
            back.len()
        );
    }
    // The changed chunk back as it was: now the vanished one stops the stream, at its turn.
    flip_byte(&fx.chunk_file(&index.chunks[180].digest), 5);
    let (back, res) = read_all(MIB, true);
    let err = res.unwrap_err();
    assert!(err.to_string().contains("vanished"), "{err}");
    assert!(back == parts[..250].concat(), "{} bytes", back.len());
}

/// Reads `r` to its end `size` bytes at a time: what came out, and how it ended.
fn read_in_steps(r: &mut impl Read, size: usize) -> (Vec<u8>, io::Result<()>) {
    let mut buf = vec![0u8; size];
    let mut back = Vec::new();
    loop {
        match r.read(&mut buf) {
            Ok(0) => return (back, Ok(())),
            Ok(n) => back.extend_from_slice(&buf[..n]),
            Err(e) => return (back, Err(e)),
        }
    }
}

/// Something put in a chunk's place that would block an open — a FIFO nobody writes — fails
/// the verification and the read back, instead of hanging them (both open chunks ahead of
/// their turn, and a blocking open would wait for a writer forever).
#[test]
fn a_fifo_in_a_chunks_place_fails_verify_and_read_back_instead_of_hanging() {
    let fx = Fixture::new();
    let data = random_bytes(71, 3 * MIB);
    let id = fx.snapshot(&data, &[], "fifo").snapshot_id;
    let v = fx.store.verify(&id, &VerifyOptions::default()).unwrap();
    let chunk = fx.first_chunk(&id);
    let path = fx.chunk_file(&chunk.digest);
    fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    if !matches!(made, Ok(s) if s.success()) {
        eprintln!("SKIP: no mkfifo here");
        return;
    }
    let store = fx.store.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let verified = store.verify(&id, &VerifyOptions::default()).map(drop);
        let read = store
            .open_payload(&v, "vmstate")
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|mut r| read_in_steps(&mut r, MIB).1);
        let _ = tx.send((verified, read));
    });
    let (verified, read) = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("verify and read back hung on a FIFO");
    assert!(verified.is_err(), "a FIFO verified as a chunk");
    let err = read.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
}

// ---------------------------------------------------------------- routine verification

#[test]
fn a_routine_verification_rehashes_only_what_is_older_than_its_period() {
    use std::time::Duration;
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    let id = &m.snapshot_id;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let routine = |period: Duration| {
        fx.store
            .verify_routine(id, &VerifyOptions::default(), period, &stop)
    };
    let total: u64 = m.payload_refs.iter().map(|p| p.total_bytes).sum();
    // Just written (hashed in memory): nothing is read again within the period.
    let v = routine(Duration::from_secs(3600)).unwrap();
    assert_eq!(v.report.bytes_checked, 0, "{:?}", v.report);
    assert_eq!(v.report.bytes_trusted, total, "{:?}", v.report);
    // Past the period every byte is hashed again (and the record refreshed)...
    std::thread::sleep(Duration::from_millis(30));
    let v = routine(Duration::from_millis(10)).unwrap();
    assert_eq!(v.report.bytes_checked, total, "{:?}", v.report);
    assert_eq!(v.report.bytes_trusted, 0);
    // ...and a file changed behind the store's back is read and fails whatever the period.
    let chunk = fx.first_chunk(id);
    std::thread::sleep(Duration::from_millis(20)); // a later clock tick (checked.rs)
    flip_byte(&fx.chunk_file(&chunk.digest), 7);
    let err = routine(Duration::from_secs(3600)).unwrap_err();
    assert_code(&err, INTEGRITY);
}

#[test]
fn a_routine_verification_stops_when_a_rollback_is_waiting() {
    let fx = Fixture::new();
    let m = fx.small_snapshot();
    let stop = std::sync::atomic::AtomicBool::new(true);
    let err = fx
        .store
        .verify_routine(
            &m.snapshot_id,
            &VerifyOptions::default(),
            std::time::Duration::ZERO,
            &stop,
        )
        .unwrap_err();
    assert!(matches!(err, StoreError::Preempted { .. }), "{err}");
    assert_code(&err, "ERR_VERIFY_PREEMPTED");
    // A person's full verification stops the same way, and reads every byte when not told to.
    let err = fx
        .store
        .verify_stoppable(&m.snapshot_id, &VerifyOptions::default(), &stop)
        .unwrap_err();
    assert!(matches!(err, StoreError::Preempted { .. }), "{err}");
    let go = std::sync::atomic::AtomicBool::new(false);
    let v = fx
        .store
        .verify_stoppable(&m.snapshot_id, &VerifyOptions::default(), &go)
        .unwrap();
    let total: u64 = m.payload_refs.iter().map(|p| p.total_bytes).sum();
    assert_eq!(v.report.bytes_checked, total);
    // A layer being hashed stops within a read of the flag: a reader told to stop fails.
    let flag = std::cell::Cell::new(false);
    let stopped = || flag.get();
    let mut r = crate::fsutil::Stoppable {
        inner: std::io::Cursor::new(vec![0u8; 4 << 20]),
        stopped: &stopped,
    };
    let mut buf = [0u8; 1024];
    assert!(std::io::Read::read(&mut r, &mut buf).is_ok());
    flag.set(true);
    assert!(std::io::Read::read(&mut r, &mut buf).is_err());
}
