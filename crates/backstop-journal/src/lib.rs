//! The audit journal of backstop: an append-only file of JSON lines, each entry hash-chained to the
//! one before and sealed with the host key's HMAC, plus a sealed head file so that cutting entries
//! off the end is detected too. [`Journal`] appends, [`verify`] walks the whole chain and names the
//! first bad line, [`tail`] reads the newest entries cheaply. The journal is data, not the log.
//!
//! This crate must never rewrite or delete an entry (the one thing it ever cuts off is a torn,
//! incomplete last line, which it first copies aside and then records), and it knows nothing of
//! VMs, snapshots or hypervisors: events are names and fields given by the caller.
//!
//! # Format
//! `journal.jsonl` holds one canonical JSON object (spec/003 §4) per line:
//! `{"event","fields","hash","mac","prev","seq","ts"}`. `seq` starts at 1 and is contiguous; `prev`
//! is the previous entry's `hash` (64 zeros for seq 1); `hash` is the sha256 of the canonical JSON
//! of `{event,fields,prev,seq,ts}`; `mac` is the host key's HMAC-SHA256 over the ASCII of `hash`.
//! `<journal>.head` holds `{"hash","mac","seq"}` of the last entry, replaced atomically after
//! every append.
//!
//! # Limits
//! The head lives beside the journal: someone who can write both and kept an old copy of both can
//! roll them back together, and emptying the journal while deleting the head looks like a new
//! journal. Ship `seq`/`hash` off the host when that matters.

mod entry;
mod error;
mod head;
mod journal;
mod rev_lines;
mod verify;

pub use entry::{Entry, GENESIS_PREV, MAX_LINE_BYTES};
pub use error::{
    JournalError, ERR_AUDIT_CHAIN_BROKEN, ERR_AUDIT_INVALID_ENTRY, ERR_AUDIT_IO, ERR_AUDIT_LOCKED,
};
pub use head::head_path;
pub use journal::Journal;
pub use verify::{tail, verify, Fault, VerifyOutcome};

/// The line parser, for the fuzz targets in `fuzz/` only.
///
/// `entry::parse_line` stays `pub(crate)`: callers outside this crate must go through [`verify`],
/// which also checks the seal and the chain. A cargo feature (rather than a `#[doc(hidden)] pub`
/// item) keeps even a hidden entry point out of every normal build; no workspace crate enables
/// `fuzzing`. The wrapper returns plain values so `LineFault`/`ParsedLine` stay private too.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use crate::Entry;

    /// [`crate::entry::parse_line`]: the entry and whether the line is byte for byte canonical,
    /// or the fault's `seq` (when it could be read) and reason.
    pub fn parse_line(bytes: &[u8]) -> Result<(Entry, bool), (Option<u64>, String)> {
        crate::entry::parse_line(bytes)
            .map(|p| (p.entry, p.canonical))
            .map_err(|f| (f.seq, f.reason))
    }
}
