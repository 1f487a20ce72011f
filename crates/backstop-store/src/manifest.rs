//! The signed manifest: spec/001's required fields plus the store's own, its content-derived id,
//! and the checks run on it in a fixed order — signature over the raw bytes first, then the
//! required fields, the versions, the id, and only then the full decode.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use backstop_integrity::{canonical, sha256_hex, HostKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;

use crate::error::StoreError;
use crate::fsutil::is_lower_hex;

/// Schema version written into new manifests.
pub const SCHEMA_VERSION: &str = "1.0";
/// Index version written into new manifests whose chunks are named by sha256 (BLAKE3: 1.1, see
/// [`crate::ChunkHash`]).
pub const INDEX_VERSION: &str = "1.0";
/// Schema version this build reads: same major, minor at most this (newer minor only with
/// [`VerifyOptions::allow_newer_minor`]).
pub const SUPPORTED_SCHEMA: (u32, u32) = (1, 0);
/// Index version this build reads (same rule as [`SUPPORTED_SCHEMA`]).
pub const SUPPORTED_INDEX: (u32, u32) = (1, 1);
/// The only scope spec/001 defines so far.
pub const SCOPE_FULL: &str = "full";
/// Kind of the RAM + device state payload.
pub const KIND_RAM_DEVICE: &str = "ram+device";
/// Kind of a disk's layer chain (files outside the store).
pub const KIND_DISK_LAYER_CHAIN: &str = "disk-layer-chain";
/// Prefix of a disk chain's payload name: `disk:<disk id>`.
pub const DISK_PAYLOAD_PREFIX: &str = "disk:";
/// Largest manifest.json read; anything longer is refused unread.
pub const MANIFEST_MAX_BYTES: u64 = 1024 * 1024;
/// Number of hex digits of a snapshot id.
pub const SNAPSHOT_ID_LEN: usize = 32;

/// String fields spec/001 requires, each present and non-empty.
const REQUIRED_STRINGS: [&str; 7] = [
    "snapshot_id",
    "created_at",
    "created_by",
    "schema_version",
    "index_version",
    "scope",
    "reason",
];
/// List fields spec/001 requires, each present and non-empty.
const REQUIRED_LISTS: [&str; 2] = ["checksums", "payload_refs"];

/// A published snapshot's manifest (`manifest.json`, canonical JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// First 32 hex digits of sha256 of the canonical manifest with `snapshot_id` = "".
    pub snapshot_id: String,
    /// RFC 3339, UTC, milliseconds.
    pub created_at: String,
    pub created_by: String,
    /// "MAJOR.MINOR".
    pub schema_version: String,
    /// "MAJOR.MINOR".
    pub index_version: String,
    pub scope: String,
    pub reason: String,
    /// One per index file and per disk layer.
    pub checksums: Vec<Checksum>,
    pub payload_refs: Vec<PayloadRef>,
    pub vm: String,
    pub trigger: String,
    pub epoch: u64,
    pub config_fingerprint: String,
    /// Backend figures (pause_us, capture_ms, ...); opaque to the store.
    pub capture: Value,
    /// Sum of the payloads' `new_bytes`: what this snapshot added to the store.
    pub bytes_stored: u64,
    /// Where the snapshot sits in the VM's history (spec/004 lineage). Absent in manifests
    /// written before lineage was recorded; their place is inferred from creation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<Lineage>,
    /// What a person called it (`snapshot create --name`; the rule is
    /// [`backstop_common::names::check_snapshot_name`]). Absent in unnamed snapshots and in
    /// manifests written before names existed, which decode without one. Signed and part of the
    /// content id like every field, so a name cannot be changed or moved to another snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A snapshot's place in the VM's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lineage {
    /// The snapshot the captured VM descended from: the last one published before it on its
    /// line, or the rollback target it was restored from; `None` for the first after a cold
    /// boot.
    pub parent: Option<String>,
}

/// Digests of one file the snapshot depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksum {
    /// `<payload>.index` for an index file, `disk:<id>/<layer file name>` for a disk layer.
    #[serde(rename = "ref")]
    pub reference: String,
    pub sha256: String,
    /// 8 lower-case hex digits.
    pub crc32: String,
}

/// One payload of a snapshot: a chunked stream (with an index file) or a disk layer chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadRef {
    /// `vmstate`, or `disk:<id>` for a disk chain.
    pub name: String,
    /// [`KIND_RAM_DEVICE`], [`KIND_DISK_LAYER_CHAIN`], ...
    pub kind: String,
    /// Index file name (`<name>.index`) of a chunked payload; `None` for a disk chain.
    pub index: Option<String>,
    /// A disk chain's layers, base first; empty for a chunked payload.
    pub layers: Vec<DiskLayer>,
    pub total_bytes: u64,
    /// Bytes of chunks that were not in the store before (0 for disk chains: they live outside).
    pub new_bytes: u64,
    /// Number of chunks (0 for disk chains).
    pub chunks: u64,
}

/// One immutable disk layer (outside the store).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskLayer {
    /// Absolute path.
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
    pub crc32: String,
}

/// What the caller supplies when publishing; the store fills in the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestInput {
    pub created_by: String,
    pub reason: String,
    /// Must be [`SCOPE_FULL`].
    pub scope: String,
    pub vm: String,
    pub trigger: String,
    pub epoch: u64,
    pub config_fingerprint: String,
    pub capture: Value,
    /// The snapshot's lineage (always recorded by the engine; `None` only in old callers).
    pub lineage: Option<Lineage>,
    /// A person's name for it (checked by the caller: the store refuses an invalid one, it
    /// cannot know which names the VM's other snapshots hold).
    pub name: Option<String>,
}

/// How strict verification is about versions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyOptions {
    /// Accept a newer minor schema/index version (spec/001's explicit compatibility mode).
    pub allow_newer_minor: bool,
}

/// `s` has the shape of a snapshot id (32 lower-case hex digits).
pub fn is_snapshot_id(s: &str) -> bool {
    is_lower_hex(s, SNAPSHOT_ID_LEN)
}

/// Parses "MAJOR.MINOR" (decimal digits only, at most 9 each).
pub fn parse_version(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once('.')?;
    let num = |p: &str| {
        if p.is_empty() || p.len() > 9 || !p.bytes().all(|b| b.is_ascii_digit()) {
            None
        } else {
            p.parse::<u32>().ok()
        }
    };
    Some((num(major)?, num(minor)?))
}

/// Checks `manifest.sig` (exactly 64 lower-case hex digits and a newline) against the raw
/// manifest bytes. Nothing is decoded before this passes.
pub fn check_signature(
    key: &HostKey,
    id: &str,
    manifest: &[u8],
    sig: &[u8],
) -> Result<(), StoreError> {
    let mismatch = || StoreError::SignatureMismatch { id: id.into() };
    let hex = sig.strip_suffix(b"\n").ok_or_else(mismatch)?;
    let hex = std::str::from_utf8(hex).map_err(|_| mismatch())?;
    if !is_lower_hex(hex, 64) || !key.verify_hex(manifest, hex) {
        return Err(mismatch());
    }
    Ok(())
}

/// The signature file's content for `manifest`.
pub(crate) fn signature_file(key: &HostKey, manifest: &[u8]) -> String {
    format!("{}\n", key.sign_hex(manifest))
}

/// Decodes manifest bytes **whose signature has already been checked** for the snapshot whose
/// directory is named `id`. Order: JSON → required fields → versions → id → full decode →
/// consistency of payloads and checksums. Any bytes give a manifest or an error, never a panic.
pub fn decode_manifest(
    id: &str,
    bytes: &[u8],
    opts: &VerifyOptions,
) -> Result<Manifest, StoreError> {
    let invalid = |field: &str, reason: String| StoreError::ManifestInvalid {
        id: id.into(),
        field: field.into(),
        reason,
    };
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| invalid("(document)", e.to_string()))?;
    let Value::Object(obj) = &value else {
        return Err(invalid("(document)", "not a JSON object".into()));
    };
    for field in REQUIRED_STRINGS {
        match obj.get(field) {
            None => return Err(invalid(field, "missing".into())),
            Some(Value::String(s)) if s.is_empty() => return Err(invalid(field, "empty".into())),
            Some(Value::String(_)) => {}
            Some(_) => return Err(invalid(field, "not a string".into())),
        }
    }
    for field in REQUIRED_LISTS {
        match obj.get(field) {
            None => return Err(invalid(field, "missing".into())),
            Some(Value::Array(a)) if a.is_empty() => return Err(invalid(field, "empty".into())),
            Some(Value::Array(_)) => {}
            Some(_) => return Err(invalid(field, "not a list".into())),
        }
    }
    // A newer major may derive ids differently, so versions are checked before the id.
    let text = |field: &str| obj.get(field).and_then(Value::as_str).unwrap_or_default();
    check_version(
        id,
        "schema_version",
        text("schema_version"),
        SUPPORTED_SCHEMA,
        opts,
    )?;
    check_version(
        id,
        "index_version",
        text("index_version"),
        SUPPORTED_INDEX,
        opts,
    )?;

    let named = text("snapshot_id");
    if named != id {
        return Err(StoreError::IdMismatch {
            id: id.into(),
            found: named.into(),
        });
    }
    let computed = content_id(&value)?;
    if computed != id {
        return Err(StoreError::ContentHashMismatch {
            id: id.into(),
            computed,
        });
    }
    let manifest: Manifest =
        serde_json::from_value(value.clone()).map_err(|e| invalid("(structure)", e.to_string()))?;
    // A manifest of a version this build writes is exactly the document that was signed and
    // hashed: serde alone would drop a key `Manifest` does not define and read a missing
    // `index` as null. Only a newer minor (let through by `allow_newer_minor`) may carry
    // fields this build does not know. (Found by the `manifest` fuzz target: `"indnx":null`
    // decoded, and re-encoded as `"index":null` it no longer matched its own id.)
    let newer = is_newer_minor(text("schema_version"), SUPPORTED_SCHEMA)
        || is_newer_minor(text("index_version"), SUPPORTED_INDEX);
    if !newer {
        let decoded =
            serde_json::to_value(&manifest).map_err(|e| StoreError::Encode(e.to_string()))?;
        if let (Value::Object(doc), Value::Object(decoded)) = (&value, &decoded) {
            let keys: BTreeSet<&String> = doc.keys().chain(decoded.keys()).collect();
            if let Some(key) = keys.into_iter().find(|k| doc.get(*k) != decoded.get(*k)) {
                return Err(invalid(
                    key,
                    "not a field of this schema version, or not as it defines it".into(),
                ));
            }
        }
    }
    check_consistency(&manifest)?;
    Ok(manifest)
}

/// `found` is a newer minor of `supported`'s major.
fn is_newer_minor(found: &str, supported: (u32, u32)) -> bool {
    parse_version(found).is_some_and(|(major, minor)| major == supported.0 && minor > supported.1)
}

fn check_version(
    id: &str,
    field: &'static str,
    found: &str,
    supported: (u32, u32),
    opts: &VerifyOptions,
) -> Result<(), StoreError> {
    let Some((major, minor)) = parse_version(found) else {
        return Err(StoreError::ManifestInvalid {
            id: id.into(),
            field: field.into(),
            reason: format!("{found:?} is not MAJOR.MINOR"),
        });
    };
    let blocked = major != supported.0 || (minor > supported.1 && !opts.allow_newer_minor);
    if blocked {
        return Err(StoreError::CompatibilityBlocked {
            id: id.into(),
            field,
            found: found.into(),
            supported: format!("{}.{}", supported.0, supported.1),
        });
    }
    Ok(())
}

/// First 32 hex digits of sha256 of the canonical form of `value` with `snapshot_id` = "".
pub(crate) fn content_id(value: &Value) -> Result<String, StoreError> {
    let mut blank = value.clone();
    if let Value::Object(obj) = &mut blank {
        obj.insert("snapshot_id".into(), Value::String(String::new()));
    }
    let bytes = canonical::to_vec(&blank).map_err(|e| StoreError::Encode(e.to_string()))?;
    let mut hex = sha256_hex(&bytes);
    hex.truncate(SNAPSHOT_ID_LEN);
    Ok(hex)
}

/// Derives the id of `manifest` (its `snapshot_id` is ignored) and returns the manifest with its
/// id and the exact bytes to write. Non-integer numbers are first brought to a fixed point of
/// canonical form → parse, so that re-reading the bytes derives the same id.
pub(crate) fn seal(manifest: &Manifest) -> Result<(Manifest, Vec<u8>), StoreError> {
    let enc = |e: serde_json::Error| StoreError::Encode(e.to_string());
    let mut value = serde_json::to_value(manifest).map_err(enc)?;
    let mut bytes = canonical::to_vec(&value).map_err(enc)?;
    let mut settled = false;
    for _ in 0..4 {
        value = serde_json::from_slice(&bytes).map_err(enc)?;
        let again = canonical::to_vec(&value).map_err(enc)?;
        if again == bytes {
            settled = true;
            break;
        }
        bytes = again;
    }
    if !settled {
        return Err(StoreError::Encode(
            "numbers in capture do not settle in canonical form".into(),
        ));
    }
    let id = content_id(&value)?;
    if let Value::Object(obj) = &mut value {
        obj.insert("snapshot_id".into(), Value::String(id));
    }
    let bytes = canonical::to_vec(&value).map_err(enc)?;
    let manifest = serde_json::from_value(value).map_err(enc)?;
    Ok((manifest, bytes))
}

/// Current time as RFC 3339 UTC with milliseconds.
pub(crate) fn now_rfc3339_ms() -> Result<String, StoreError> {
    Ok(backstop_common::time::now_rfc3339())
}

/// Parses `created_at`.
pub(crate) fn parse_created_at(s: &str) -> Option<OffsetDateTime> {
    backstop_common::time::parse_rfc3339(s)
}

/// A payload name or disk id: 1–128 of `[A-Za-z0-9._-]`, not starting with a dot.
pub(crate) fn is_valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A payload kind: 1–64 of `[a-z0-9+._-]`.
pub(crate) fn is_valid_kind(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'.' | b'_' | b'-')
        })
}

/// Index file name of a chunked payload.
pub(crate) fn index_file_name(payload: &str) -> String {
    format!("{payload}.index")
}

/// Checksum ref of a disk layer.
pub(crate) fn layer_ref(payload_name: &str, layer: &DiskLayer) -> Option<String> {
    let file = layer.path.file_name()?.to_str()?;
    Some(format!("{payload_name}/{file}"))
}

/// Cross-checks of a decoded manifest: payloads well-formed, one checksum per index file and per
/// disk layer and no other, sizes adding up.
fn check_consistency(m: &Manifest) -> Result<(), StoreError> {
    let id = m.snapshot_id.as_str();
    let invalid = |field: String, reason: &str| StoreError::ManifestInvalid {
        id: id.into(),
        field,
        reason: reason.into(),
    };
    if parse_created_at(&m.created_at).is_none() {
        return Err(invalid("created_at".into(), "not an RFC 3339 time"));
    }
    if m.scope != SCOPE_FULL {
        return Err(invalid("scope".into(), "only \"full\" is supported"));
    }
    if let Some(name) = &m.name {
        if let Err(why) = backstop_common::names::check_snapshot_name(name) {
            return Err(invalid("name".into(), &why));
        }
    }
    let mut checksums: BTreeMap<&str, &Checksum> = BTreeMap::new();
    for (i, c) in m.checksums.iter().enumerate() {
        if !is_lower_hex(&c.sha256, 64) || !is_lower_hex(&c.crc32, 8) {
            return Err(invalid(format!("checksums[{i}]"), "malformed digest"));
        }
        if checksums.insert(c.reference.as_str(), c).is_some() {
            return Err(invalid(format!("checksums[{i}].ref"), "duplicate ref"));
        }
    }
    let mut expected_refs: BTreeSet<String> = BTreeSet::new();
    let mut names = BTreeSet::new();
    let mut new_bytes = 0u64;
    for (i, p) in m.payload_refs.iter().enumerate() {
        let field = |f: &str| format!("payload_refs[{i}].{f}");
        if !names.insert(p.name.as_str()) {
            return Err(invalid(field("name"), "duplicate payload name"));
        }
        new_bytes = new_bytes
            .checked_add(p.new_bytes)
            .ok_or_else(|| invalid(field("new_bytes"), "sum overflows"))?;
        if p.kind == KIND_DISK_LAYER_CHAIN {
            let disk = p.name.strip_prefix(DISK_PAYLOAD_PREFIX).unwrap_or_default();
            if !is_valid_name(disk) {
                return Err(invalid(field("name"), "not disk:<id>"));
            }
            if p.index.is_some() || p.layers.is_empty() || p.chunks != 0 || p.new_bytes != 0 {
                return Err(invalid(
                    field("layers"),
                    "a disk chain has layers and no index",
                ));
            }
            let mut total = 0u64;
            for (j, layer) in p.layers.iter().enumerate() {
                let lfield = format!("payload_refs[{i}].layers[{j}]");
                if !layer.path.is_absolute() {
                    return Err(invalid(lfield, "path is not absolute"));
                }
                let Some(reference) = layer_ref(&p.name, layer) else {
                    return Err(invalid(lfield, "path has no UTF-8 file name"));
                };
                match checksums.get(reference.as_str()) {
                    Some(c) if c.sha256 == layer.sha256 && c.crc32 == layer.crc32 => {}
                    _ => return Err(invalid(lfield, "no matching entry in checksums")),
                }
                if !expected_refs.insert(reference) {
                    return Err(invalid(lfield, "two layers with the same file name"));
                }
                total = total
                    .checked_add(layer.bytes)
                    .ok_or_else(|| invalid(field("total_bytes"), "sum overflows"))?;
            }
            if total != p.total_bytes {
                return Err(invalid(
                    field("total_bytes"),
                    "differs from the sum of the layers",
                ));
            }
        } else {
            if !is_valid_kind(&p.kind) {
                return Err(invalid(field("kind"), "malformed kind"));
            }
            if !is_valid_name(&p.name) {
                return Err(invalid(field("name"), "malformed payload name"));
            }
            let expected = index_file_name(&p.name);
            if p.index.as_deref() != Some(expected.as_str()) || !p.layers.is_empty() {
                return Err(invalid(
                    field("index"),
                    "a chunked payload has <name>.index",
                ));
            }
            if p.new_bytes > p.total_bytes {
                return Err(invalid(field("new_bytes"), "larger than total_bytes"));
            }
            if !checksums.contains_key(expected.as_str()) {
                return Err(invalid(field("index"), "no matching entry in checksums"));
            }
            expected_refs.insert(expected);
        }
    }
    if checksums.len() != expected_refs.len() {
        return Err(invalid("checksums".into(), "an entry matches no payload"));
    }
    if new_bytes != m.bytes_stored {
        return Err(invalid(
            "bytes_stored".into(),
            "differs from the sum of new_bytes",
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn sample() -> Manifest {
        Manifest {
            snapshot_id: String::new(),
            created_at: "2026-01-02T03:04:05.678Z".into(),
            created_by: "tester".into(),
            schema_version: SCHEMA_VERSION.into(),
            index_version: INDEX_VERSION.into(),
            scope: SCOPE_FULL.into(),
            reason: "unit test".into(),
            checksums: vec![
                Checksum {
                    reference: "vmstate.index".into(),
                    sha256: "1".repeat(64),
                    crc32: "00000001".into(),
                },
                Checksum {
                    reference: "disk:root/base.qcow2".into(),
                    sha256: "2".repeat(64),
                    crc32: "00000002".into(),
                },
            ],
            payload_refs: vec![
                PayloadRef {
                    name: "vmstate".into(),
                    kind: KIND_RAM_DEVICE.into(),
                    index: Some("vmstate.index".into()),
                    layers: vec![],
                    total_bytes: 100,
                    new_bytes: 40,
                    chunks: 2,
                },
                PayloadRef {
                    name: "disk:root".into(),
                    kind: KIND_DISK_LAYER_CHAIN.into(),
                    index: None,
                    layers: vec![DiskLayer {
                        path: "/var/lib/vm/base.qcow2".into(),
                        bytes: 7,
                        sha256: "2".repeat(64),
                        crc32: "00000002".into(),
                    }],
                    total_bytes: 7,
                    new_bytes: 0,
                    chunks: 0,
                },
            ],
            vm: "vm1".into(),
            trigger: "console".into(),
            epoch: 3,
            config_fingerprint: "fp".into(),
            capture: json!({"pause_us": 3000, "ratio": 0.25}),
            bytes_stored: 40,
            lineage: None,
            name: None,
        }
    }

    #[test]
    fn a_name_is_sealed_with_the_manifest_and_checked_when_read() {
        // Unnamed manifests (all written before names existed) carry no `name` key at all.
        let (m, bytes) = seal(&sample()).unwrap();
        let doc: Value = serde_json::from_slice(&bytes).unwrap();
        assert!(doc.get("name").is_none(), "{doc}");
        let mut named = sample();
        named.name = Some("before-upgrade".into());
        let (n, bytes) = seal(&named).unwrap();
        assert_ne!(
            n.snapshot_id, m.snapshot_id,
            "the name is part of the content id"
        );
        let back = decode_manifest(&n.snapshot_id, &bytes, &VerifyOptions::default()).unwrap();
        assert_eq!(back.name.as_deref(), Some("before-upgrade"));
        // A name breaking the rule is refused even under a good id (only a key holder could
        // write one; a reader still never shows it).
        named.name = Some("cafe".into());
        let (bad, bytes) = seal(&named).unwrap();
        match decode_manifest(&bad.snapshot_id, &bytes, &VerifyOptions::default()) {
            Err(StoreError::ManifestInvalid { field, .. }) => assert_eq!(field, "name"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sealed_manifest_decodes_to_itself() {
        let (m, bytes) = seal(&sample()).unwrap();
        assert!(is_snapshot_id(&m.snapshot_id));
        let back = decode_manifest(&m.snapshot_id, &bytes, &VerifyOptions::default()).unwrap();
        assert_eq!(back, m);
        // Canonical JSON with spec/001's field names.
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains(r#""ref":"vmstate.index""#), "{text}");
        assert!(text.contains(r#""index":null"#), "{text}");
    }

    #[test]
    fn large_floats_in_capture_still_give_a_stable_id() {
        let mut m = sample();
        m.capture = json!({"x": 100_000_000.0 + 0.123_456_789, "y": 1e300, "z": -3.3e-12});
        let (m, bytes) = seal(&m).unwrap();
        decode_manifest(&m.snapshot_id, &bytes, &VerifyOptions::default()).unwrap();
    }

    #[test]
    fn versions_parse_strictly() {
        assert_eq!(parse_version("1.0"), Some((1, 0)));
        assert_eq!(parse_version("12.34"), Some((12, 34)));
        for bad in [
            "",
            "1",
            "1.",
            ".1",
            "1.0.0",
            "+1.0",
            "1.-0",
            "a.b",
            "1.0 ",
            "9999999999.0",
        ] {
            assert_eq!(parse_version(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn consistency_errors_name_the_field() {
        type Change = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(&str, Change)> = vec![
            ("bytes_stored", Box::new(|m| m.bytes_stored = 1)),
            ("scope", Box::new(|m| m.scope = "partial".into())),
            (
                "created_at",
                Box::new(|m| m.created_at = "yesterday".into()),
            ),
            (
                "payload_refs[0].index",
                Box::new(|m| m.payload_refs[0].index = Some("../x".into())),
            ),
            (
                "payload_refs[1].total_bytes",
                Box::new(|m| m.payload_refs[1].total_bytes = 8),
            ),
            (
                "checksums",
                Box::new(|m| {
                    m.checksums.push(Checksum {
                        reference: "stray".into(),
                        sha256: "3".repeat(64),
                        crc32: "00000003".into(),
                    })
                }),
            ),
            (
                "payload_refs[1].layers[0]",
                Box::new(|m| m.checksums[1].crc32 = "0000000f".into()),
            ),
        ];
        for (field, change) in cases {
            let mut m = sample();
            change(&mut m);
            let (m, bytes) = seal(&m).unwrap();
            let err =
                decode_manifest(&m.snapshot_id, &bytes, &VerifyOptions::default()).unwrap_err();
            assert_eq!(
                err.code(),
                "ERR_SNAPSHOT_MANIFEST_INVALID",
                "{field}: {err}"
            );
            assert!(
                matches!(&err, StoreError::ManifestInvalid { field: f, .. } if f == field),
                "{field}: {err}"
            );
        }
    }

    /// The fuzz target `manifest`'s inputs (byte 0: options, then the document): never a panic,
    /// and an accepted manifest re-encodes to bytes that decode to itself.
    #[test]
    fn fuzz_inputs_replay() {
        let mut accepted = 0;
        for (name, bytes) in crate::fuzz_inputs("manifest") {
            let Some((&flags, bytes)) = bytes.split_first() else {
                continue;
            };
            let opts = VerifyOptions {
                allow_newer_minor: flags & 1 == 1,
            };
            let id = serde_json::from_slice::<Value>(bytes)
                .ok()
                .and_then(|v| Some(v.get("snapshot_id")?.as_str()?.to_string()))
                .unwrap_or_default();
            if let Ok(m) = decode_manifest(&id, bytes, &opts) {
                let again = canonical::to_vec(&m).unwrap();
                assert_eq!(decode_manifest(&id, &again, &opts).unwrap(), m, "{name}");
                accepted += 1;
            }
        }
        assert!(accepted >= 2, "the seeds hold valid manifests");
    }

    #[test]
    fn fields_this_version_does_not_define_are_refused() {
        type Change = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Change)> = vec![
            ("extra", Box::new(|v| v["extra"] = json!(1))),
            (
                "payload_refs",
                Box::new(|v| {
                    let disk = v["payload_refs"][1].as_object_mut().unwrap();
                    disk.remove("index");
                    disk.insert("indnx".into(), Value::Null);
                }),
            ),
            (
                "checksums",
                Box::new(|v| v["checksums"][0]["note"] = json!("x")),
            ),
        ];
        for (field, change) in cases {
            let (_, bytes) = seal(&sample()).unwrap();
            let mut v: Value = serde_json::from_slice(&bytes).unwrap();
            change(&mut v);
            let id = content_id(&v).unwrap();
            v["snapshot_id"] = json!(id);
            let bytes = canonical::to_vec(&v).unwrap();
            let err = decode_manifest(&id, &bytes, &VerifyOptions::default()).unwrap_err();
            assert!(
                matches!(&err, StoreError::ManifestInvalid { field: f, .. } if f == field),
                "{field}: {err}"
            );
            // A newer minor may add fields; this build reads what it knows of it.
            v["schema_version"] = json!("1.1");
            let id = content_id(&v).unwrap();
            v["snapshot_id"] = json!(id);
            let bytes = canonical::to_vec(&v).unwrap();
            let newer = VerifyOptions {
                allow_newer_minor: true,
            };
            decode_manifest(&id, &bytes, &newer).unwrap();
        }
    }

    #[test]
    fn signature_file_must_be_exact() {
        let key = HostKey::from_bytes([1; 32]);
        let sig = signature_file(&key, b"m");
        assert!(check_signature(&key, "x", b"m", sig.as_bytes()).is_ok());
        let no_newline = sig.trim_end();
        assert!(check_signature(&key, "x", b"m", no_newline.as_bytes()).is_err());
        let upper = sig.to_uppercase();
        assert!(check_signature(&key, "x", b"m", upper.as_bytes()).is_err());
        assert!(check_signature(&key, "x", b"m", &[0xff, b'\n']).is_err());
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_manifest("00000000000000000000000000000000", &bytes, &VerifyOptions::default());
        }

        #[test]
        fn mutated_manifests_never_panic(
            pos in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(), newer in any::<bool>()
        ) {
            let (m, mut bytes) = seal(&sample()).unwrap();
            let i = pos % bytes.len();
            bytes[i] = byte;
            bytes.truncate(cut % (bytes.len() + 1));
            let opts = VerifyOptions { allow_newer_minor: newer };
            let _ = decode_manifest(&m.snapshot_id, &bytes, &opts);
        }

        #[test]
        fn random_json_values_never_panic(
            fields in proptest::collection::btree_map(
                prop_oneof![
                    Just("snapshot_id".to_string()), Just("schema_version".to_string()),
                    Just("index_version".to_string()), Just("checksums".to_string()),
                    Just("payload_refs".to_string()), Just("scope".to_string()), "[a-z_]{1,12}",
                ],
                prop_oneof![
                    Just(json!(null)), Just(json!("1.0")), Just(json!("2.1")), Just(json!([])),
                    Just(json!([{}])), any::<i64>().prop_map(|n| json!(n)), ".{0,8}".prop_map(|s| json!(s)),
                ],
                0..12,
            )
        ) {
            let value = Value::Object(fields.into_iter().collect());
            let bytes = serde_json::to_vec(&value).unwrap();
            let _ = decode_manifest("00000000000000000000000000000000", &bytes, &VerifyOptions::default());
        }
    }
}
