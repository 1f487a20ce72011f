//! The chunk index of one chunked payload: `<payload>.index`, canonical JSON
//! `{"chunks":[{"crc32":"8 hex","len":N,"sha256":"64 hex"},...],"total_bytes":N}`.
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

/// One chunk of a payload, in stream order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// sha256 of the chunk, lower-case hex; also its file name under `chunks/`.
    pub sha256: String,
    /// crc32 (IEEE) of the chunk, 8 lower-case hex digits.
    pub crc32: String,
    /// Length in bytes (1 ..= [`CHUNK_MAX_BYTES`]).
    pub len: u64,
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
        for (i, c) in self.chunks.iter().enumerate() {
            if !is_lower_hex(&c.sha256, 64) {
                return Err(format!("chunk {i}: sha256 is not 64 lower-case hex digits"));
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
                    sha256: "a".repeat(64),
                    crc32: "0123abcd".into(),
                    len: 10,
                },
                ChunkRef {
                    sha256: "b".repeat(64),
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
        bad_sha.chunks[0].sha256 = "A".repeat(64);
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
        for bad in [bad_total, bad_sha, bad_crc, zero, huge, overflow] {
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
        )
            .prop_map(|(sha256, crc32, len)| ChunkRef { sha256, crc32, len });
        proptest::collection::vec(chunk, 0..8).prop_map(|chunks| ChunkIndex {
            total_bytes: chunks.iter().map(|c| c.len).sum(),
            chunks,
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
                    Ok(usize::from(p.sha256 != o.sha256) + usize::from(p.crc32 != o.crc32))
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
