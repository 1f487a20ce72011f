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

pub mod events;

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
