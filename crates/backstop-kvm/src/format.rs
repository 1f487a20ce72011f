//! The vCPU/VM state file: a self-describing, checksummed, signed container of sections.
//!
//! ```text
//! offset 0   StateFileHeader (64 bytes): magic "BSTPKVMS", format major/minor, header length,
//!            section count, body length, crc32 of the body
//! offset 64  body: section table (section_count × 24-byte SectionEntry: tag, index, offset,
//!            length; offsets relative to the body) followed by the section payloads
//! ```
//!
//! All integers are little-endian. The HMAC-SHA256 signature (hex) of the whole file lives in a
//! sibling `.sig` file, exactly like a store manifest.
//!
//! Checks before anything is used, in this order (each with its stable code):
//! 1. size cap (`ERR_SNAPSHOT_MANIFEST_INVALID`) and at least a header (`…INTEGRITY…`, truncated);
//! 2. the signature over every byte (`ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED`): nothing is decoded
//!    from a file the host key did not sign;
//! 3. magic (`ERR_SNAPSHOT_MANIFEST_INVALID`), then version: the major must equal ours and the
//!    minor must not be newer (`ERR_SNAPSHOT_COMPATIBILITY_BLOCKED`);
//! 4. body length (truncation) and crc32 of the body (`…INTEGRITY…`);
//! 5. the section table: every section inside the body, no overlap with the table, no duplicate
//!    (`ERR_SNAPSHOT_MANIFEST_INVALID`).

use backstop_common::ErrorCode;
use std::collections::BTreeMap;

use backstop_integrity::HostKey;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// First eight bytes of every state file.
pub const STATE_MAGIC: [u8; 8] = *b"BSTPKVMS";
/// Bumped when an older reader could misread a file.
pub const FORMAT_MAJOR: u16 = 1;
/// Bumped for additions an older reader of the same major may not know.
pub const FORMAT_MINOR: u16 = 0;
/// Largest state file accepted (the state of 64 vCPUs fits in well under 1 MiB).
pub const STATE_FILE_MAX_BYTES: u64 = 16 << 20;

const HEADER_LEN: usize = std::mem::size_of::<StateFileHeader>();
const ENTRY_LEN: usize = std::mem::size_of::<SectionEntry>();

/// Fixed header at offset 0.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct StateFileHeader {
    pub magic: [u8; 8],
    pub format_major: U16,
    pub format_minor: U16,
    pub header_len: U32,
    pub section_count: U32,
    pub reserved0: U32,
    pub body_len: U64,
    pub body_crc32: U32,
    pub reserved1: [u8; 28],
}

/// One row of the section table.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SectionEntry {
    pub tag: U32,
    /// vCPU index for per-vCPU sections, 0 otherwise.
    pub index: U32,
    /// Offset of the payload from the start of the body.
    pub offset: U64,
    pub len: U64,
}

/// Why a state file was refused. `code()` gives the spec's stable code.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("state file has {len} bytes, more than the {max}-byte cap")]
    TooLarge { len: u64, max: u64 },
    #[error("state file truncated: {len} bytes, at least {need} needed")]
    Truncated { len: u64, need: u64 },
    #[error("state file signature does not verify with the host key")]
    BadSignature,
    #[error("not a backstop KVM state file (magic {found:02x?})")]
    BadMagic { found: [u8; 8] },
    #[error(
        "state file format {major}.{minor} cannot be read by format {FORMAT_MAJOR}.{FORMAT_MINOR}"
    )]
    Incompatible { major: u16, minor: u16 },
    #[error("state file body crc32 {actual:08x} does not match the header's {expected:08x}")]
    Crc { expected: u32, actual: u32 },
    #[error("state file malformed: {0}")]
    Malformed(String),
    #[error("state file has no {0} section")]
    MissingSection(&'static str),
}

impl StateFileError {
    /// Stable code for the console and the journal.
    pub fn code(&self) -> ErrorCode {
        match self {
            StateFileError::Truncated { .. }
            | StateFileError::BadSignature
            | StateFileError::Crc { .. } => ErrorCode::SnapshotIntegrityCheckFailed,
            StateFileError::Incompatible { .. } => ErrorCode::SnapshotCompatibilityBlocked,
            StateFileError::TooLarge { .. }
            | StateFileError::BadMagic { .. }
            | StateFileError::Malformed(_)
            | StateFileError::MissingSection(_) => ErrorCode::SnapshotManifestInvalid,
        }
    }
}

/// Builds a state file from sections.
#[derive(Debug, Default)]
pub struct StateFileWriter {
    sections: Vec<(u32, u32, Vec<u8>)>,
}

impl StateFileWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one section; `(tag, index)` must be unique.
    pub fn push(&mut self, tag: u32, index: u32, payload: Vec<u8>) {
        self.sections.push((tag, index, payload));
    }

    /// Adds every section of `other`, in order.
    pub fn append(&mut self, other: StateFileWriter) {
        self.sections.extend(other.sections);
    }

    /// The finished file: header, table, payloads (each payload 8-byte aligned).
    pub fn finish(self) -> Vec<u8> {
        self.finish_with_version(FORMAT_MAJOR, FORMAT_MINOR)
    }

    /// As [`finish`](Self::finish) with a chosen version (tests of version checks).
    pub fn finish_with_version(self, major: u16, minor: u16) -> Vec<u8> {
        let table_len = self.sections.len() * ENTRY_LEN;
        let mut body = vec![0u8; table_len];
        let mut entries = Vec::with_capacity(self.sections.len());
        for (tag, index, payload) in &self.sections {
            while !body.len().is_multiple_of(8) {
                body.push(0);
            }
            entries.push(SectionEntry {
                tag: U32::new(*tag),
                index: U32::new(*index),
                offset: U64::new(body.len() as u64),
                len: U64::new(payload.len() as u64),
            });
            body.extend_from_slice(payload);
        }
        for (slot, entry) in body.chunks_exact_mut(ENTRY_LEN).zip(&entries) {
            slot.copy_from_slice(entry.as_bytes());
        }
        let header = StateFileHeader {
            magic: STATE_MAGIC,
            format_major: U16::new(major),
            format_minor: U16::new(minor),
            header_len: U32::new(HEADER_LEN as u32),
            section_count: U32::new(entries.len() as u32),
            reserved0: U32::new(0),
            body_len: U64::new(body.len() as u64),
            body_crc32: U32::new(crc32fast::hash(&body)),
            reserved1: [0; 28],
        };
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&body);
        out
    }
}

/// A state file that passed every check of the module docs.
#[derive(Debug, Clone)]
pub struct VerifiedStateFile {
    header: StateFileHeader,
    bytes: Vec<u8>,
    sections: BTreeMap<(u32, u32), (usize, usize)>,
}

impl VerifiedStateFile {
    /// Runs every check, in the documented order, and indexes the sections.
    pub fn verify(
        bytes: Vec<u8>,
        signature_hex: &str,
        key: &HostKey,
    ) -> Result<Self, StateFileError> {
        let len = bytes.len() as u64;
        if len > STATE_FILE_MAX_BYTES {
            return Err(StateFileError::TooLarge {
                len,
                max: STATE_FILE_MAX_BYTES,
            });
        }
        if bytes.len() < HEADER_LEN {
            return Err(StateFileError::Truncated {
                len,
                need: HEADER_LEN as u64,
            });
        }
        if !key.verify_hex(&bytes, signature_hex.trim()) {
            return Err(StateFileError::BadSignature);
        }
        let (header, body) = StateFileHeader::read_from_prefix(&bytes)
            .map_err(|_| StateFileError::Malformed("header".into()))?;
        if header.magic != STATE_MAGIC {
            return Err(StateFileError::BadMagic {
                found: header.magic,
            });
        }
        let (major, minor) = (header.format_major.get(), header.format_minor.get());
        if major != FORMAT_MAJOR || minor > FORMAT_MINOR {
            return Err(StateFileError::Incompatible { major, minor });
        }
        if header.header_len.get() as usize != HEADER_LEN {
            return Err(StateFileError::Malformed(format!(
                "header length {}",
                header.header_len.get()
            )));
        }
        let body_len = header.body_len.get();
        if body_len != body.len() as u64 {
            return Err(StateFileError::Truncated {
                len,
                need: HEADER_LEN as u64 + body_len,
            });
        }
        let actual = crc32fast::hash(body);
        if actual != header.body_crc32.get() {
            return Err(StateFileError::Crc {
                expected: header.body_crc32.get(),
                actual,
            });
        }
        let count = header.section_count.get() as usize;
        let table_len = count
            .checked_mul(ENTRY_LEN)
            .filter(|&t| t <= body.len())
            .ok_or_else(|| StateFileError::Malformed(format!("{count} sections")))?;
        let mut sections = BTreeMap::new();
        for raw in body[..table_len].chunks_exact(ENTRY_LEN) {
            let entry = SectionEntry::read_from_bytes(raw)
                .map_err(|_| StateFileError::Malformed("section entry".into()))?;
            let (offset, len) = (entry.offset.get(), entry.len.get());
            let end = offset.checked_add(len).filter(|&e| e <= body.len() as u64);
            if offset < table_len as u64 || end.is_none() {
                return Err(StateFileError::Malformed(format!(
                    "section {:#x}/{} at {offset}+{len} outside the body",
                    entry.tag.get(),
                    entry.index.get()
                )));
            }
            let key = (entry.tag.get(), entry.index.get());
            let start = HEADER_LEN + offset as usize;
            if sections.insert(key, (start, len as usize)).is_some() {
                return Err(StateFileError::Malformed(format!(
                    "duplicate section {:#x}/{}",
                    key.0, key.1
                )));
            }
        }
        Ok(Self {
            header,
            bytes,
            sections,
        })
    }

    /// The header as read.
    pub fn header(&self) -> &StateFileHeader {
        &self.header
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// A section's payload, if present.
    pub fn section(&self, tag: u32, index: u32) -> Option<&[u8]> {
        self.sections
            .get(&(tag, index))
            .map(|&(start, len)| &self.bytes[start..start + len])
    }

    /// A section that must be present.
    pub fn require(
        &self,
        tag: u32,
        index: u32,
        name: &'static str,
    ) -> Result<&[u8], StateFileError> {
        self.section(tag, index)
            .ok_or(StateFileError::MissingSection(name))
    }

    /// Every `(tag, index)` present, in order.
    pub fn section_keys(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.sections.keys().copied()
    }
}

/// Decodes a fixed-size record, naming it in the error.
pub fn decode_exact<T: FromBytes>(bytes: &[u8], what: &str) -> Result<T, StateFileError> {
    T::read_from_bytes(bytes).map_err(|_| {
        StateFileError::Malformed(format!(
            "{what}: {} bytes, expected {}",
            bytes.len(),
            std::mem::size_of::<T>()
        ))
    })
}

/// Decodes a packed array of fixed-size records.
pub fn decode_array<T: FromBytes + Clone>(
    bytes: &[u8],
    what: &str,
) -> Result<Vec<T>, StateFileError> {
    let size = std::mem::size_of::<T>();
    if size == 0 || !bytes.len().is_multiple_of(size) {
        return Err(StateFileError::Malformed(format!(
            "{what}: {} bytes is not a multiple of {size}",
            bytes.len()
        )));
    }
    bytes
        .chunks_exact(size)
        .map(|chunk| decode_exact::<T>(chunk, what))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> HostKey {
        HostKey::from_bytes([7; 32])
    }

    fn sample() -> Vec<u8> {
        let mut w = StateFileWriter::new();
        w.push(1, 0, b"{\"a\":1}".to_vec());
        w.push(0x10, 0, vec![1, 2, 3]);
        w.push(0x10, 1, vec![]);
        w.finish()
    }

    fn verify(bytes: &[u8]) -> Result<VerifiedStateFile, StateFileError> {
        let sig = key().sign_hex(bytes);
        VerifiedStateFile::verify(bytes.to_vec(), &sig, &key())
    }

    #[test]
    fn round_trip_sections() {
        let file = verify(&sample()).unwrap();
        assert_eq!(file.section(1, 0), Some(&b"{\"a\":1}"[..]));
        assert_eq!(file.section(0x10, 0), Some(&[1u8, 2, 3][..]));
        assert_eq!(file.section(0x10, 1), Some(&[][..]));
        assert_eq!(file.section(0x11, 0), None);
        assert_eq!(file.section_keys().count(), 3);
    }

    #[test]
    fn unsigned_or_flipped_byte_is_integrity_failure() {
        let bytes = sample();
        let err = VerifiedStateFile::verify(bytes.clone(), "00", &key()).unwrap_err();
        assert_eq!(err.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        let sig = key().sign_hex(&bytes);
        let mut flipped = bytes;
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        let err = VerifiedStateFile::verify(flipped, &sig, &key()).unwrap_err();
        assert!(matches!(err, StateFileError::BadSignature));
        assert_eq!(err.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
    }

    #[test]
    fn truncated_is_integrity_failure_even_when_signed() {
        let bytes = sample();
        let err = verify(&bytes[..bytes.len() - 2]).unwrap_err();
        assert!(matches!(err, StateFileError::Truncated { .. }), "{err}");
        assert_eq!(err.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        let err = verify(&bytes[..10]).unwrap_err();
        assert!(matches!(err, StateFileError::Truncated { .. }), "{err}");
    }

    #[test]
    fn crc_mismatch_is_integrity_failure_even_when_signed() {
        let mut bytes = sample();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        let err = verify(&bytes).unwrap_err();
        assert!(matches!(err, StateFileError::Crc { .. }), "{err}");
        assert_eq!(err.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
    }

    #[test]
    fn wrong_magic_is_manifest_invalid() {
        let mut bytes = sample();
        bytes[0] = b'X';
        let err = verify(&bytes).unwrap_err();
        assert!(matches!(err, StateFileError::BadMagic { .. }), "{err}");
        assert_eq!(err.code(), "ERR_SNAPSHOT_MANIFEST_INVALID");
    }

    #[test]
    fn newer_major_or_minor_is_compatibility_blocked() {
        let mut w = StateFileWriter::new();
        w.push(1, 0, vec![0]);
        let err = verify(&w.finish_with_version(FORMAT_MAJOR + 1, 0)).unwrap_err();
        assert!(matches!(err, StateFileError::Incompatible { .. }), "{err}");
        assert_eq!(err.code(), "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED");
        let mut w = StateFileWriter::new();
        w.push(1, 0, vec![0]);
        let err = verify(&w.finish_with_version(FORMAT_MAJOR, FORMAT_MINOR + 1)).unwrap_err();
        assert_eq!(err.code(), "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED");
    }

    #[test]
    fn oversized_is_refused_before_the_signature() {
        let bytes = vec![0u8; STATE_FILE_MAX_BYTES as usize + 1];
        let err = VerifiedStateFile::verify(bytes, "", &key()).unwrap_err();
        assert!(matches!(err, StateFileError::TooLarge { .. }));
        assert_eq!(err.code(), "ERR_SNAPSHOT_MANIFEST_INVALID");
    }

    /// A signed file with a section pointing outside the body (a buggy writer, not an attacker).
    #[test]
    fn section_outside_body_is_manifest_invalid() {
        let mut bytes = sample();
        // First table entry's length field: header + tag(4) + index(4) + offset(8).
        let at = HEADER_LEN + 16;
        bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let body = bytes[HEADER_LEN..].to_vec();
        let crc = crc32fast::hash(&body);
        let crc_at = std::mem::offset_of!(StateFileHeader, body_crc32);
        bytes[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
        let err = verify(&bytes).unwrap_err();
        assert!(matches!(err, StateFileError::Malformed(_)), "{err}");
        assert_eq!(err.code(), "ERR_SNAPSHOT_MANIFEST_INVALID");
    }

    #[test]
    fn decode_helpers_check_lengths() {
        assert!(decode_exact::<U64>(&[0; 7], "x").is_err());
        assert_eq!(
            decode_exact::<U64>(&[1, 0, 0, 0, 0, 0, 0, 0], "x")
                .unwrap()
                .get(),
            1
        );
        assert!(decode_array::<U32>(&[0; 6], "x").is_err());
        assert_eq!(decode_array::<U32>(&[0; 8], "x").unwrap().len(), 2);
    }

    proptest::proptest! {
        /// Any signed byte string is either refused with a code or decodes; never a panic.
        #[test]
        fn arbitrary_signed_bytes_never_panic(bytes in proptest::collection::vec(0u8..=255, 0..512)) {
            match verify(&bytes) {
                Ok(file) => { let _ = file.section_keys().count(); }
                Err(e) => { let _ = e.code(); }
            }
        }

        /// Arbitrary sections round-trip.
        #[test]
        fn arbitrary_sections_round_trip(payloads in proptest::collection::vec(proptest::collection::vec(0u8..=255, 0..64), 0..8)) {
            let mut w = StateFileWriter::new();
            for (i, p) in payloads.iter().enumerate() {
                w.push(0x20, i as u32, p.clone());
            }
            let file = verify(&w.finish()).unwrap();
            for (i, p) in payloads.iter().enumerate() {
                proptest::prop_assert_eq!(file.section(0x20, i as u32), Some(p.as_slice()));
            }
        }
    }
}
