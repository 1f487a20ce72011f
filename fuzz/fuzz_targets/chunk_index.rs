//! A payload's chunk index, `ChunkIndex::parse`.
//!
//! Asserts: an accepted index keeps its documented bounds (64-hex digest, 8-hex crc32, chunk
//! lengths 1..=CHUNK_MAX_BYTES, total = sum of lengths) and re-encodes to canonical bytes that
//! parse to the same index.
#![no_main]

use backstop_store::{ChunkIndex, CHUNK_MAX_BYTES};
use libfuzzer_sys::fuzz_target;

fn lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fuzz_target!(|data: &[u8]| {
    let Ok(index) = ChunkIndex::parse(data) else {
        return;
    };
    let mut sum = 0u64;
    for c in &index.chunks {
        assert!(lower_hex(&c.digest, 64) && lower_hex(&c.crc32, 8), "{c:?}");
        assert!((1..=u64::from(CHUNK_MAX_BYTES)).contains(&c.len), "{c:?}");
        sum = sum
            .checked_add(c.len)
            .expect("accepted lengths do not overflow");
    }
    assert_eq!(sum, index.total_bytes);
    let bytes = index.to_canonical().expect("an accepted index re-encodes");
    assert_eq!(
        ChunkIndex::parse(&bytes).expect("its re-encoding parses"),
        index
    );
});
