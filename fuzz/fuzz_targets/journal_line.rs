//! One audit journal line, the journal's `parse_line` (exported for fuzzing only, behind the
//! journal crate's `fuzzing` feature).
//!
//! Asserts: an accepted line has seq >= 1; a line reported canonical is byte for byte the
//! canonical encoding of the parsed entry; hashing an accepted entry never panics.
#![no_main]

use backstop_integrity::canonical;
use backstop_journal::fuzzing::parse_line;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_line(data) {
        Ok((entry, is_canonical)) => {
            assert!(entry.seq >= 1);
            if is_canonical {
                let bytes = canonical::to_vec(&entry).expect("a parsed entry encodes");
                assert_eq!(bytes, data, "canonical line does not re-encode to itself");
            }
            let _ = entry.compute_hash();
        }
        Err((_, reason)) => assert!(!reason.is_empty()),
    }
});
