//! The chunk index of one chunked payload: `<payload>.index`, canonical JSON
//! `{"chunks":[{"crc32":"8 hex","len":N,"sha256":"64 hex"},...],"total_bytes":N}` (index
//! version 1.0), or with `"blake3"` in place of `"sha256"` (index version 1.1, see [`ChunkHash`]).
//!
//! The store only parses an index after its sha256 and crc32 matched the signed manifest, but the
//! parser still treats its input as hostile: any bytes give a value or an error, never a panic.

use serde::{Deserialize, Serialize};

use crate::fsutil::is_lower_hex;

/// Smallest chunk FastCDC cuts (except the last chunk of a stream).
pub const CHUNK_MIN_BYTES: u32 = 256 * 1024;
/// Average chunk size FastCDC aims for.
pub const CHUNK_AVG_BYTES: u32 = 1024 * 1024;
/// Largest chunk FastCDC cuts; an index naming a longer chunk is invalid.
pub const CHUNK_MAX_BYTES: u32 = 4 * 1024 * 1024;

/// The hash that names a chunk (its file under `chunks/`) and proves its bytes.
///
/// sha256 is the default (a store written without `chunk_hash` holds sha256 chunks). BLAKE3
/// (`[daemon] chunk_hash = "blake3"`) hashes ~4.3x faster on this project's machines (5.7 against
/// 1.3 GB/s on one core, 64 KiB chunks), which is most of a capture's CPU. Both are 256-bit
/// cryptographic hashes, named by 64 lower-case hex digits; a store may hold chunks of both (the
/// two namespaces never meet: a name is a digest of its bytes under the hash its index says).
/// Chunks of one index all use one hash; an index of BLAKE3 chunks is index version 1.1, which a
/// reader of 1.0 refuses (`ERR_SNAPSHOT_COMPATIBILITY_BLOCKED`) rather than misreads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkHash {
    #[default]
    Sha256,
    Blake3,
}

impl ChunkHash {
    /// The hash's name as configs and indexes spell it.
    pub fn name(self) -> &'static str {
        match self {
            ChunkHash::Sha256 => "sha256",
            ChunkHash::Blake3 => "blake3",
        }
    }

    /// Lower-case hex digest of `bytes`.
    pub fn hex(self, bytes: &[u8]) -> String {
        match self {
            ChunkHash::Sha256 => backstop_integrity::sha256_hex(bytes),
            ChunkHash::Blake3 => blake3::hash(bytes).to_hex().to_string(),
        }
    }

    /// The index version of a manifest whose chunks use this hash.
    pub fn index_version(self) -> &'static str {
        match self {
            ChunkHash::Sha256 => "1.0",
            ChunkHash::Blake3 => "1.1",
        }
    }

    /// Whether a manifest of index version `version` may name chunks by this hash: 1.0 knows
    /// sha256 only; 1.1 (and a newer minor let through by compatibility mode) either.
    pub fn allowed_in(self, version: &str) -> bool {
        self == ChunkHash::Sha256 || version != "1.0"
    }
}

impl std::fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ChunkHash {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [ChunkHash::Sha256, ChunkHash::Blake3]
            .into_iter()
            .find(|h| h.name() == s)
            .ok_or_else(|| format!("{s:?} is not a chunk hash (sha256 or blake3)"))
    }
}

/// One chunk of a payload, in stream order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ChunkRefWire", into = "ChunkRefWire")]
pub struct ChunkRef {
    /// The hash `digest` is of.
    pub hash: ChunkHash,
    /// Digest of the chunk, 64 lower-case hex digits; also its file name under `chunks/`.
    pub digest: String,
    /// crc32 (IEEE) of the chunk, 8 lower-case hex digits.
    pub crc32: String,
    /// Length in bytes (1 ..= [`CHUNK_MAX_BYTES`]).
    pub len: u64,
}

impl ChunkRef {
    /// Whether `bytes` are this chunk: its length, its digest under its hash and its crc32.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        bytes.len() as u64 == self.len
            && crate::fsutil::crc32_hex(bytes) == self.crc32
            && self.hash.hex(bytes) == self.digest
    }
}

/// A chunk as the index spells it: exactly one of `sha256` and `blake3`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChunkRefWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blake3: Option<String>,
    crc32: String,
    len: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
}

impl TryFrom<ChunkRefWire> for ChunkRef {
    type Error = String;
    fn try_from(w: ChunkRefWire) -> Result<Self, String> {
        let (hash, digest) = match (w.sha256, w.blake3) {
            (Some(d), None) => (ChunkHash::Sha256, d),
            (None, Some(d)) => (ChunkHash::Blake3, d),
            (Some(_), Some(_)) => return Err("a chunk names both a sha256 and a blake3".into()),
            (None, None) => return Err("a chunk names neither a sha256 nor a blake3".into()),
        };
        Ok(ChunkRef {
            hash,
            digest,
            crc32: w.crc32,
            len: w.len,
        })
    }
}

impl From<ChunkRef> for ChunkRefWire {
    fn from(c: ChunkRef) -> Self {
        let (sha256, blake3) = match c.hash {
            ChunkHash::Sha256 => (Some(c.digest), None),
            ChunkHash::Blake3 => (None, Some(c.digest)),
        };
        ChunkRefWire {
            blake3,
            crc32: c.crc32,
            len: c.len,
            sha256,
        }
    }
}

/// The ordered chunks of one payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkIndex {
    pub chunks: Vec<ChunkRef>,
    /// Sum of the chunks' lengths.
    pub total_bytes: u64,
}

impl ChunkIndex {
    /// Parses and checks an index: well-formed digests, chunk lengths within bounds, and
    /// `total_bytes` equal to the sum of the lengths.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let index: ChunkIndex = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        index.check()?;
        Ok(index)
    }

    fn check(&self) -> Result<(), String> {
        let mut sum = 0u64;
        let hash = self.chunks.first().map(|c| c.hash);
        for (i, c) in self.chunks.iter().enumerate() {
            if !is_lower_hex(&c.digest, 64) {
                return Err(format!(
                    "chunk {i}: {} is not 64 lower-case hex digits",
                    c.hash
                ));
            }
            if Some(c.hash) != hash {
                return Err(format!(
                    "chunk {i}: named by {} where chunk 0 is named by {}: one index, one hash",
                    c.hash,
                    hash.unwrap_or_default()
                ));
            }
            if !is_lower_hex(&c.crc32, 8) {
                return Err(format!("chunk {i}: crc32 is not 8 lower-case hex digits"));
            }
            if c.len == 0 || c.len > u64::from(CHUNK_MAX_BYTES) {
                return Err(format!("chunk {i}: length {} is out of bounds", c.len));
            }
            sum = sum
                .checked_add(c.len)
                .ok_or_else(|| "total length overflows".to_string())?;
        }
        if sum != self.total_bytes {
            return Err(format!(
                "total_bytes {} differs from the sum of chunk lengths {sum}",
                self.total_bytes
            ));
        }
        Ok(())
    }

    /// The hash naming this index's chunks (`None` for an empty index).
    pub fn hash(&self) -> Option<ChunkHash> {
        self.chunks.first().map(|c| c.hash)
    }

    /// The canonical bytes written to `<payload>.index`.
    pub fn to_canonical(&self) -> Result<Vec<u8>, serde_json::Error> {
        backstop_integrity::canonical::to_vec(self)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> ChunkIndex {
        ChunkIndex {
            chunks: vec![
                ChunkRef {
                    hash: ChunkHash::Sha256,
                    digest: "a".repeat(64),
                    crc32: "0123abcd".into(),
                    len: 10,
                },
                ChunkRef {
                    hash: ChunkHash::Sha256,
                    digest: "b".repeat(64),
                    crc32: "ffffffff".into(),
                    len: 5,
                },
            ],
            total_bytes: 15,
        }
    }

    #[test]
    fn canonical_form_round_trips_and_has_the_documented_shape() {
        let bytes = sample().to_canonical().unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with(r#"{"chunks":[{"crc32":"0123abcd","len":10,"sha256":"aaaa"#));
        assert!(text.ends_with(r#"],"total_bytes":15}"#));
        assert_eq!(ChunkIndex::parse(&bytes).unwrap(), sample());
    }

    /// Index 1.1: the same shape with `blake3` in place of `sha256`, keys in canonical order.
    #[test]
    fn a_blake3_index_has_its_own_key_and_round_trips() {
        let mut index = sample();
        for c in &mut index.chunks {
            c.hash = ChunkHash::Blake3;
        }
        let bytes = index.to_canonical().unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with(r#"{"chunks":[{"blake3":"aaaa"#), "{text}");
        assert!(!text.contains("sha256"), "{text}");
        let back = ChunkIndex::parse(&bytes).unwrap();
        assert_eq!(back, index);
        assert_eq!(back.hash(), Some(ChunkHash::Blake3));
        assert_eq!(sample().hash(), Some(ChunkHash::Sha256));
    }

    /// A chunk names exactly one digest, under a key the index version knows.
    #[test]
    fn a_chunk_with_both_digests_none_or_an_unknown_key_is_refused() {
        let d = "a".repeat(64);
        for (bad, why) in [
            (
                format!(
                    r#"{{"chunks":[{{"blake3":"{d}","crc32":"00000000","len":1,"sha256":"{d}"}}],"total_bytes":1}}"#
                ),
                "both",
            ),
            (
                r#"{"chunks":[{"crc32":"00000000","len":1}],"total_bytes":1}"#.to_string(),
                "neither",
            ),
            (
                format!(
                    r#"{{"chunks":[{{"crc32":"00000000","len":1,"sha512":"{d}"}}],"total_bytes":1}}"#
                ),
                "sha512",
            ),
        ] {
            let err = ChunkIndex::parse(bad.as_bytes()).unwrap_err();
            assert!(err.contains(why) || err.contains("unknown field"), "{err}");
        }
    }

    /// `matches` holds for the chunk's own bytes under either hash (published test vectors for
    /// "abc") and for nothing else: another byte, one byte more, or the other hash's digest.
    #[test]
    fn a_chunk_matches_its_own_bytes_under_its_own_hash_only() {
        let sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let b3 = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85";
        assert_eq!(ChunkHash::Sha256.hex(b"abc"), sha);
        assert_eq!(ChunkHash::Blake3.hex(b"abc"), b3);
        let crc32 = crate::fsutil::crc32_hex(b"abc");
        for (hash, digest, other) in [(ChunkHash::Sha256, sha, b3), (ChunkHash::Blake3, b3, sha)] {
            let c = ChunkRef {
                hash,
                digest: digest.into(),
                crc32: crc32.clone(),
                len: 3,
            };
            assert!(c.matches(b"abc"));
            assert!(!c.matches(b"abd"));
            assert!(!c.matches(b"abcd"));
            let wrong = ChunkRef {
                digest: other.into(),
                ..c.clone()
            };
            assert!(!wrong.matches(b"abc"));
        }
        assert!(ChunkHash::Sha256.allowed_in("1.0") && ChunkHash::Sha256.allowed_in("1.1"));
        assert!(!ChunkHash::Blake3.allowed_in("1.0") && ChunkHash::Blake3.allowed_in("1.1"));
        assert_eq!("blake3".parse::<ChunkHash>(), Ok(ChunkHash::Blake3));
        assert!("md5"
            .parse::<ChunkHash>()
            .unwrap_err()
            .contains("sha256 or blake3"));
    }

    /// The fuzz target `chunk_index`'s inputs: never a panic, and an accepted index re-encodes
    /// to canonical bytes that parse to itself.
    #[test]
    fn fuzz_inputs_replay() {
        let mut accepted = 0;
        for (name, bytes) in crate::fuzz_inputs("chunk_index") {
            if let Ok(index) = ChunkIndex::parse(&bytes) {
                let again = ChunkIndex::parse(&index.to_canonical().unwrap());
                assert_eq!(again.unwrap(), index, "{name}");
                accepted += 1;
            }
        }
        assert!(accepted >= 2, "the seeds hold valid indexes");
    }

    #[test]
    fn inconsistent_indexes_are_rejected() {
        let mut bad_total = sample();
        bad_total.total_bytes = 16;
        let mut bad_sha = sample();
        bad_sha.chunks[0].digest = "A".repeat(64);
        let mut mixed = sample();
        mixed.chunks[1].hash = ChunkHash::Blake3;
        let mut bad_crc = sample();
        bad_crc.chunks[1].crc32 = "123".into();
        let mut zero = sample();
        zero.chunks[1].len = 0;
        zero.total_bytes = 10;
        let mut huge = sample();
        huge.chunks[1].len = u64::from(CHUNK_MAX_BYTES) + 1;
        huge.total_bytes = 10 + huge.chunks[1].len;
        let mut overflow = sample();
        overflow.chunks[0].len = u64::MAX;
        for bad in [bad_total, bad_sha, mixed, bad_crc, zero, huge, overflow] {
            let bytes = serde_json::to_vec(&bad).unwrap();
            assert!(ChunkIndex::parse(&bytes).is_err(), "{bad:?} was accepted");
        }
    }

    /// Any well-formed index: 0 to 8 chunks of 1 ..= CHUNK_MAX_BYTES, total = sum.
    fn index() -> impl Strategy<Value = ChunkIndex> {
        let chunk = (
            "[0-9a-f]{64}",
            "[0-9a-f]{8}",
            1..=u64::from(CHUNK_MAX_BYTES),
        );
        (
            proptest::collection::vec(chunk, 0..8),
            prop_oneof![Just(ChunkHash::Sha256), Just(ChunkHash::Blake3)],
        )
            .prop_map(|(chunks, hash)| {
                let chunks: Vec<ChunkRef> = chunks
                    .into_iter()
                    .map(|(digest, crc32, len)| ChunkRef {
                        hash,
                        digest,
                        crc32,
                        len,
                    })
                    .collect();
                ChunkIndex {
                    total_bytes: chunks.iter().map(|c| c.len).sum(),
                    chunks,
                }
            })
    }

    /// A mutation of encoded bytes: overwrite one byte, delete one, or insert one.
    #[derive(Debug, Clone)]
    enum Mutation {
        Set(proptest::sample::Index, u8),
        Delete(proptest::sample::Index),
        Insert(proptest::sample::Index, u8),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        use proptest::sample::Index;
        prop_oneof![
            (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            any::<Index>().prop_map(Mutation::Delete),
            (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn encode_then_parse_is_the_identity(index in index()) {
            let bytes = index.to_canonical().unwrap();
            prop_assert_eq!(ChunkIndex::parse(&bytes).unwrap(), index);
        }

        /// One byte changed, removed or added: the index is rejected, or it reads back equal, or
        /// (the one change that still parses) one digest digit became another hex digit — which
        /// the manifest's sha256 and crc32 of the index file catch before it is parsed.
        #[test]
        fn a_mutated_encoding_is_rejected_or_equal(index in index(), m in mutation()) {
            let mut bytes = index.to_canonical().unwrap();
            match &m {
                Mutation::Set(i, b) => {
                    let i = i.index(bytes.len());
                    bytes[i] = *b;
                }
                Mutation::Delete(i) => {
                    bytes.remove(i.index(bytes.len()));
                }
                Mutation::Insert(i, b) => bytes.insert(i.index(bytes.len() + 1), *b),
            }
            let Ok(parsed) = ChunkIndex::parse(&bytes) else {
                return Ok(());
            };
            prop_assert_eq!(
                ChunkIndex::parse(&parsed.to_canonical().unwrap()).unwrap(),
                parsed.clone()
            );
            if parsed == index {
                return Ok(());
            }
            prop_assert!(matches!(m, Mutation::Set(..)), "{:?} gave {:?}", m, parsed);
            prop_assert_eq!(parsed.total_bytes, index.total_bytes);
            prop_assert_eq!(parsed.chunks.len(), index.chunks.len());
            let digests_changed = parsed
                .chunks
                .iter()
                .zip(&index.chunks)
                .map(|(p, o)| {
                    prop_assert_eq!(p.len, o.len);
                    prop_assert_eq!(p.hash, o.hash);
                    Ok(usize::from(p.digest != o.digest) + usize::from(p.crc32 != o.crc32))
                })
                .sum::<Result<usize, TestCaseError>>()?;
            prop_assert_eq!(digests_changed, 1, "{:?} gave {:?}", m, parsed);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ChunkIndex::parse(&bytes);
        }

        #[test]
        fn mutated_indexes_never_panic(pos in any::<usize>(), byte in any::<u8>(), cut in any::<usize>()) {
            let mut bytes = sample().to_canonical().unwrap();
            let i = pos % bytes.len();
            bytes[i] = byte;
            bytes.truncate(cut % (bytes.len() + 1));
            let _ = ChunkIndex::parse(&bytes);
        }
    }
}
