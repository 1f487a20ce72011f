//! One journal entry: its fields, how it is hashed and sealed, and how a line is checked.

use backstop_integrity::{canonical, sha256_hex, HostKey};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `prev` of the first entry: 64 zeros.
pub const GENESIS_PREV: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Longest line (without its `'\n'`) the journal writes or reads.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The keys every line carries, and no others.
const ENTRY_KEYS: [&str; 7] = ["event", "fields", "hash", "mac", "prev", "seq", "ts"];

/// One journal line.
///
/// `hash` is the lower-case hex sha256 of the canonical JSON of `{event, fields, prev, seq, ts}`;
/// `mac` is [`HostKey::sign_hex`] over the ASCII bytes of `hash`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    /// RFC 3339 UTC with millisecond precision, e.g. `2026-11-22T10:00:00.123Z`.
    pub ts: String,
    pub event: String,
    pub fields: Map<String, Value>,
    /// `hash` of the entry before, or [`GENESIS_PREV`] for seq 1.
    pub prev: String,
    pub hash: String,
    pub mac: String,
}

/// The part of an entry that its hash covers.
#[derive(Serialize)]
struct Hashed<'a> {
    event: &'a str,
    fields: &'a Map<String, Value>,
    prev: &'a str,
    seq: u64,
    ts: &'a str,
}

impl Entry {
    /// Builds and seals the entry that follows `prev`.
    pub(crate) fn seal(
        seq: u64,
        ts: String,
        event: &str,
        fields: Map<String, Value>,
        prev: &str,
        key: &HostKey,
    ) -> Result<Self, serde_json::Error> {
        let hash = chain_hash(seq, &ts, event, &fields, prev)?;
        let mac = key.sign_hex(hash.as_bytes());
        Ok(Self {
            seq,
            ts,
            event: event.to_owned(),
            fields,
            prev: prev.to_owned(),
            hash,
            mac,
        })
    }

    /// Recomputes the hash from the entry's content (not from its `hash` field).
    pub fn compute_hash(&self) -> Result<String, serde_json::Error> {
        chain_hash(self.seq, &self.ts, &self.event, &self.fields, &self.prev)
    }

    /// Checks the entry against itself and the key: hash first, then mac.
    pub(crate) fn check_seal(&self, key: &HostKey) -> Result<(), &'static str> {
        match self.compute_hash() {
            Ok(h) if h == self.hash => {}
            _ => return Err("hash mismatch (entry edited)"),
        }
        // `verify_hex` takes only the lower-case hex the writer put there.
        if !key.verify_hex(self.hash.as_bytes(), &self.mac) {
            return Err("mac mismatch");
        }
        Ok(())
    }
}

fn chain_hash(
    seq: u64,
    ts: &str,
    event: &str,
    fields: &Map<String, Value>,
    prev: &str,
) -> Result<String, serde_json::Error> {
    let bytes = canonical::to_vec(&Hashed {
        event,
        fields,
        prev,
        seq,
        ts,
    })?;
    Ok(sha256_hex(&bytes))
}

/// Why one line is not an entry; `seq` when it could still be read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LineFault {
    pub seq: Option<u64>,
    pub reason: String,
}

/// A line that has the shape of an entry.
#[derive(Debug)]
pub(crate) struct ParsedLine {
    pub entry: Entry,
    /// Whether the line is byte for byte the canonical form of its value.
    pub canonical: bool,
}

/// Parses one line (without its `'\n'`): JSON validity, then the exact field set and types.
/// Says nothing about the seal or the chain.
pub(crate) fn parse_line(bytes: &[u8]) -> Result<ParsedLine, LineFault> {
    let fault = |seq, reason: String| LineFault { seq, reason };
    let value: Value =
        serde_json::from_slice(bytes).map_err(|_| fault(None, "not valid JSON".into()))?;
    let Value::Object(map) = &value else {
        return Err(fault(None, "not a JSON object".into()));
    };
    let seq = map.get("seq").and_then(Value::as_u64);
    for key in ENTRY_KEYS {
        if !map.contains_key(key) {
            return Err(fault(seq, format!("missing field `{key}`")));
        }
    }
    if let Some(extra) = map.keys().find(|k| !ENTRY_KEYS.contains(&k.as_str())) {
        return Err(fault(seq, format!("unexpected field `{extra}`")));
    }
    let entry: Entry = serde_json::from_value(value.clone())
        .map_err(|_| fault(seq, "a field has the wrong type".into()))?;
    if entry.seq == 0 {
        return Err(fault(Some(0), "seq 0 (sequence numbers start at 1)".into()));
    }
    let canonical = canonical::to_vec(&value)
        .map(|c| c == bytes)
        .unwrap_or(false);
    Ok(ParsedLine { entry, canonical })
}

/// Checks an event name: 1..=128 bytes of `a-z 0-9 . _ -`.
pub(crate) fn check_event_name(event: &str) -> Result<(), &'static str> {
    if event.is_empty() {
        return Err("empty");
    }
    if event.len() > 128 {
        return Err("longer than 128 bytes");
    }
    // spec/002 names its drift events exactly (`DriftDetectedEvent`): those, and only those,
    // keep their capitals.
    if !backstop_common::events::SPEC_EXACT_NAMES.contains(&event)
        && !event.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
    {
        // Upper case for the specs' own names (spec/003 `REPLAY_RESULT`, spec/002
        // `DriftDetectedEvent`), which are journaled verbatim.
        return Err("only A-Z, a-z, 0-9, '.', '_' and '-' are allowed");
    }
    Ok(())
}

/// Returns `fields` exactly as they will read back from the journal, or an error if the canonical
/// form does not survive a round trip (so every written entry verifies).
pub(crate) fn normalize_fields(
    fields: Map<String, Value>,
) -> Result<Map<String, Value>, crate::JournalError> {
    let invalid = |reason: String| crate::JournalError::InvalidFields { reason };
    let bytes = canonical::to_vec(&fields).map_err(|e| invalid(e.to_string()))?;
    let back: Map<String, Value> =
        serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    let again = canonical::to_vec(&back).map_err(|e| invalid(e.to_string()))?;
    if again != bytes {
        return Err(invalid(
            "a value does not survive the canonical round trip".into(),
        ));
    }
    Ok(back)
}

/// Now as RFC 3339 UTC with millisecond precision.
pub(crate) fn now_ts() -> String {
    backstop_common::time::now_rfc3339()
}

#[cfg(test)]
mod tests {
    use backstop_integrity::KEY_LEN;
    use serde_json::json;

    use super::*;

    fn key() -> HostKey {
        HostKey::from_bytes([3; KEY_LEN])
    }

    /// The kept inputs of a fuzz target, replayed by stable `cargo test`.
    use backstop_common::fuzz_corpus::inputs as fuzz_inputs;

    /// The fuzz target `journal_line`'s inputs: never a panic; a line reported canonical is the
    /// canonical encoding of the entry parsed from it.
    #[test]
    fn fuzz_inputs_replay() {
        let mut sealed = 0;
        for (name, bytes) in fuzz_inputs("journal_line") {
            match parse_line(&bytes) {
                Ok(p) => {
                    assert!(p.entry.seq >= 1, "{name}");
                    if p.canonical {
                        assert_eq!(canonical::to_vec(&p.entry).unwrap(), bytes, "{name}");
                    }
                    sealed += usize::from(p.canonical && p.entry.check_seal(&key()).is_ok());
                }
                Err(f) => assert!(!f.reason.is_empty(), "{name}"),
            }
        }
        assert!(sealed >= 2, "the seeds hold sealed canonical entries");
    }

    fn sample() -> Entry {
        let Value::Object(fields) = json!({"snapshot_id": "s1", "n": 2}) else {
            unreachable!()
        };
        Entry::seal(
            1,
            "2026-11-22T10:00:00.123Z".into(),
            "vm.started",
            fields,
            GENESIS_PREV,
            &key(),
        )
        .unwrap()
    }

    #[test]
    fn hash_covers_exactly_the_documented_object() {
        let e = sample();
        let expected = sha256_hex(
            br#"{"event":"vm.started","fields":{"n":2,"snapshot_id":"s1"},"prev":"0000000000000000000000000000000000000000000000000000000000000000","seq":1,"ts":"2026-11-22T10:00:00.123Z"}"#,
        );
        assert_eq!(e.hash, expected);
        assert!(key().verify_hex(e.hash.as_bytes(), &e.mac));
        assert_eq!(e.check_seal(&key()), Ok(()));
    }

    #[test]
    fn check_seal_names_hash_then_mac() {
        let mut e = sample();
        e.event = "vm.halted".into();
        assert_eq!(e.check_seal(&key()), Err("hash mismatch (entry edited)"));
        let mut e = sample();
        e.mac = "00".repeat(32);
        assert_eq!(e.check_seal(&key()), Err("mac mismatch"));
        assert_eq!(
            sample().check_seal(&HostKey::from_bytes([4; KEY_LEN])),
            Err("mac mismatch")
        );
    }

    #[test]
    fn a_mac_in_upper_case_does_not_verify() {
        // Found by tamper_prop in CI: flipping bit 5 of a hex letter in `mac` kept the same
        // bytes after decoding, and the line verified.
        let mut e = sample();
        assert_eq!(e.check_seal(&key()), Ok(()));
        let at = e
            .mac
            .find(|c: char| c.is_ascii_lowercase())
            .expect("a hex letter");
        let mut upper = e.mac.clone().into_bytes();
        upper[at] ^= 0x20;
        e.mac = String::from_utf8(upper).unwrap();
        assert_eq!(e.check_seal(&key()), Err("mac mismatch"));
    }

    #[test]
    fn a_canonical_line_parses_and_is_recognised_as_canonical() {
        let line = canonical::to_vec(&sample()).unwrap();
        let parsed = parse_line(&line).unwrap();
        assert_eq!(parsed.entry, sample());
        assert!(parsed.canonical);
        let spaced = String::from_utf8(line).unwrap().replacen(':', ": ", 1);
        assert!(!parse_line(spaced.as_bytes()).unwrap().canonical);
    }

    #[test]
    fn parse_line_names_what_is_wrong() {
        let reason = |b: &[u8]| parse_line(b).unwrap_err();
        assert_eq!(reason(b"{nope").reason, "not valid JSON");
        assert_eq!(reason(b"[1]").reason, "not a JSON object");
        let f = reason(br#"{"seq":4}"#);
        assert_eq!(
            (f.seq, f.reason.as_str()),
            (Some(4), "missing field `event`")
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v["extra"] = json!(1);
        assert_eq!(
            reason(v.to_string().as_bytes()).reason,
            "unexpected field `extra`"
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v["fields"] = json!("x");
        assert_eq!(
            reason(v.to_string().as_bytes()).reason,
            "a field has the wrong type"
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v["seq"] = json!(0);
        assert_eq!(reason(v.to_string().as_bytes()).seq, Some(0));
    }

    #[test]
    fn event_names_are_checked() {
        assert!(check_event_name("snapshot.create.requested").is_ok());
        assert!(check_event_name("").is_err());
        assert!(check_event_name("Bad Name").is_err());
        assert!(check_event_name("DriftDetectedEvent").is_ok());
        assert!(check_event_name("REPLAY_RESULT").is_ok());
        assert!(check_event_name("DriftDetectedEvent2").is_err());
        assert!(check_event_name("a/b").is_err());
        assert!(check_event_name(&"a".repeat(129)).is_err());
    }

    #[test]
    fn normalised_fields_read_back_identically() {
        let Value::Object(m) = json!({"f": 1e-12, "g": 0.1, "i": -3}) else {
            unreachable!()
        };
        let n = normalize_fields(m).unwrap();
        assert_eq!(
            canonical::to_string(&n).unwrap(),
            r#"{"f":0.000000000,"g":0.100000000,"i":-3}"#
        );
    }

    #[test]
    fn extreme_floats_read_back_to_the_same_bytes() {
        // Needs serde_json's `float_roundtrip`: the default parser is an ulp off for long numbers.
        let Value::Object(m) = json!({"a": 1.7e308, "b": 269637020409918.03, "c": -5e-324}) else {
            unreachable!()
        };
        let n = normalize_fields(m).unwrap();
        let bytes = canonical::to_vec(&n).unwrap();
        let back: Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(canonical::to_vec(&back).unwrap(), bytes);
    }

    #[test]
    fn timestamps_are_rfc3339_utc_milliseconds() {
        let ts = now_ts();
        assert_eq!(ts.len(), "2026-11-22T10:00:00.123Z".len(), "{ts}");
        assert!(
            ts.ends_with('Z') && &ts[10..11] == "T" && &ts[19..20] == ".",
            "{ts}"
        );
        let parsed =
            time::OffsetDateTime::parse(&ts, &time::format_description::well_known::Rfc3339);
        assert!(parsed.is_ok(), "{ts}");
    }
}
