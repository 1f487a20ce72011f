//! The snapshot manifest decoder, `decode_manifest`, on bytes whose signature is taken as
//! checked (the store checks it first; the decoder must still never panic).
//!
//! A manifest is only decoded fully when its `snapshot_id` is the content hash of the document,
//! which random bytes never are. So each input is decoded twice: as it is, and — when it is a
//! JSON object — with `snapshot_id` set to its content id, which takes it past the id checks to
//! the full decode and the consistency checks. The first input byte picks the options.
//!
//! Asserts: an accepted manifest re-encodes (canonical JSON) without panic, and — unless it is a
//! newer minor version, which may carry fields this build drops — the re-encoded bytes decode
//! to the same manifest.
#![no_main]

use backstop_integrity::{canonical, sha256_hex};
use backstop_store::{
    decode_manifest, parse_version, Manifest, VerifyOptions, SUPPORTED_INDEX, SUPPORTED_SCHEMA,
};

const SNAPSHOT_ID_LEN: usize = 32;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// What the store derives: the first 32 hex digits of sha256 of the canonical document with
/// `snapshot_id` = "".
fn content_id(value: &Value) -> Option<String> {
    let mut blank = value.clone();
    blank
        .as_object_mut()?
        .insert("snapshot_id".into(), Value::String(String::new()));
    let mut id = sha256_hex(&canonical::to_vec(&blank).ok()?);
    id.truncate(SNAPSHOT_ID_LEN);
    Some(id)
}

fn check_accepted(id: &str, manifest: &Manifest, opts: &VerifyOptions) {
    assert_eq!(manifest.snapshot_id, id);
    let bytes = canonical::to_vec(manifest).expect("an accepted manifest re-encodes");
    let again = decode_manifest(id, &bytes, opts);
    // A newer minor may carry fields this build does not know (and drops): its re-encoding is
    // another document, with another id. Any other manifest is exactly what it decoded to.
    let newer = |v: &str, (major, minor): (u32, u32)| {
        parse_version(v).is_some_and(|(ma, mi)| ma == major && mi > minor)
    };
    if !newer(&manifest.schema_version, SUPPORTED_SCHEMA)
        && !newer(&manifest.index_version, SUPPORTED_INDEX)
    {
        assert_eq!(&again.expect("its re-encoding decodes"), manifest);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, bytes)) = data.split_first() else {
        return;
    };
    let opts = VerifyOptions {
        allow_newer_minor: flags & 1 == 1,
    };
    let Ok(mut value) = serde_json::from_slice::<Value>(bytes) else {
        let _ = decode_manifest("00000000000000000000000000000000", bytes, &opts);
        return;
    };
    let named = value
        .get("snapshot_id")
        .and_then(Value::as_str)
        .unwrap_or("00000000000000000000000000000000")
        .to_string();
    if let Ok(m) = decode_manifest(&named, bytes, &opts) {
        check_accepted(&named, &m, &opts);
    }
    let Some(id) = content_id(&value) else {
        return;
    };
    if let Some(obj) = value.as_object_mut() {
        obj.insert("snapshot_id".into(), Value::String(id.clone()));
    }
    let Ok(sealed) = canonical::to_vec(&value) else {
        return;
    };
    if let Ok(m) = decode_manifest(&id, &sealed, &opts) {
        check_accepted(&id, &m, &opts);
    }
});
