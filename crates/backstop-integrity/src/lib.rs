//! Integrity primitives shared by the snapshot store and the audit journal.
//!
//! * [`canonical`]: the canonical JSON form of spec/003 §4 (sorted keys, UTF-8, no extra
//!   whitespace, floats with 9 decimals). Everything that is hashed or signed is hashed or signed
//!   in this form, so the same value always gives the same bytes.
//! * [`HostKey`]: the host's HMAC-SHA256 key. It is created once with mode 0600 and lives outside
//!   the snapshot store; it never enters a snapshot, a journal line or a log.
//!
//! This crate must never know about hypervisors, snapshots or events: it only turns values into
//! bytes and bytes into seals.

pub mod canonical;
mod key;

pub use key::{HostKey, KeyError, KEY_LEN};

use sha2::{Digest, Sha256};

/// `s` is lower-case hex digits only (the form every digest and tag here is written in).
pub fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
