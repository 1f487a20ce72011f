//! Readers: a full verification walk and a bounded tail. Neither writes anything.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use backstop_integrity::HostKey;
use serde_json::Value;

use crate::entry::{self, GENESIS_PREV, MAX_LINE_BYTES};
use crate::head::{head_path, read_head, HeadState};
use crate::rev_lines::{RevError, RevLines};
use crate::JournalError;

/// Result of [`verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyOutcome {
    /// Entries that verified before the first fault (all of them when there is none).
    pub entries: u64,
    /// The first fault found, if any; the walk stops there.
    pub first_bad: Option<Fault>,
}

impl VerifyOutcome {
    /// No fault anywhere.
    pub fn is_ok(&self) -> bool {
        self.first_bad.is_none()
    }
}

/// Where the chain first breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// 1-based line number. A fault found through the head file points at the entry it names,
    /// or, for a missing tail or a missing or broken head, at the line after the last entry.
    pub line: u64,
    /// The entry's seq when it could be read.
    pub seq: Option<u64>,
    /// Short reason, e.g. `"mac mismatch"`, `"hash mismatch (entry edited)"`.
    pub reason: String,
}

/// Walks the whole journal and its head file: JSON validity, exact field set, seq contiguity from
/// 1, hash recomputation, mac, `prev` linkage, canonical form, then the head (present when there
/// are entries, sealed, not beyond the last entry, and naming an entry of this chain).
///
/// I/O failures are errors; everything wrong with the content is a [`Fault`]. The head is read
/// before the journal, so a verification racing a writer sees at worst a head that lags.
pub fn verify(path: &Path, key: &HostKey) -> Result<VerifyOutcome, JournalError> {
    verify_prefix(path, key, u64::MAX)
}

/// [`verify`] of the first `limit` bytes of the journal.
pub(crate) fn verify_prefix(
    path: &Path,
    key: &HostKey,
    limit: u64,
) -> Result<VerifyOutcome, JournalError> {
    let head = read_head(&head_path(path), key)?;
    let file = File::open(path).map_err(|source| JournalError::Open {
        path: path.into(),
        source,
    })?;
    let mut reader = BufReader::new(file.take(limit));
    let head_seq = match &head {
        HeadState::Sealed { seq, .. } => Some(*seq),
        _ => None,
    };

    let mut entries = 0u64;
    let mut last_hash = GENESIS_PREV.to_owned();
    let mut hash_at_head_seq = (head_seq == Some(0)).then(|| GENESIS_PREV.to_owned());
    let mut buf = Vec::with_capacity(1024);
    loop {
        let line = entries + 1;
        let fault = |seq, reason: String| {
            Ok(VerifyOutcome {
                entries,
                first_bad: Some(Fault { line, seq, reason }),
            })
        };
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|source| JournalError::Read {
                path: path.into(),
                source,
            })?;
        if n == 0 {
            break;
        }
        if buf.last() != Some(&b'\n') {
            if buf.len() > MAX_LINE_BYTES {
                return fault(None, format!("line longer than {MAX_LINE_BYTES} bytes"));
            }
            return fault(
                None,
                "last line has no trailing newline (torn write)".into(),
            );
        }
        buf.pop();
        let parsed = match entry::parse_line(&buf) {
            Ok(p) => p,
            Err(f) => return fault(f.seq, f.reason),
        };
        let e = parsed.entry;
        let expected = entries + 1;
        if e.seq != expected {
            return fault(
                Some(e.seq),
                format!(
                    "seq {} follows {} (entry deleted or reordered)",
                    e.seq, entries
                ),
            );
        }
        if let Err(reason) = e.check_seal(key) {
            return fault(Some(e.seq), reason.into());
        }
        if e.prev != last_hash {
            return fault(Some(e.seq), "prev does not match entry before".into());
        }
        if !parsed.canonical {
            return fault(Some(e.seq), "line is not in canonical form".into());
        }
        if head_seq == Some(e.seq) {
            hash_at_head_seq = Some(e.hash.clone());
        }
        entries = e.seq;
        last_hash = e.hash;
    }

    let after = |seq, reason: String| Fault {
        line: entries + 1,
        seq,
        reason,
    };
    let first_bad = match head {
        HeadState::Missing if entries == 0 => None,
        HeadState::Missing => Some(after(None, "head file missing".into())),
        HeadState::Bad(reason) => Some(after(None, reason)),
        HeadState::Sealed { seq, .. } if seq > entries => Some(after(
            Some(entries + 1),
            format!("journal ends at seq {entries} but head says {seq} (tail truncated)"),
        )),
        HeadState::Sealed { seq, hash } => {
            (hash_at_head_seq.as_ref() != Some(&hash)).then(|| Fault {
                line: seq.max(1),
                seq: Some(seq),
                reason: format!("head does not match entry at seq {seq}"),
            })
        }
    };
    Ok(VerifyOutcome { entries, first_bad })
}

/// The last `n` entries, oldest first, as parsed JSON (not verified: use [`verify`] for that).
/// Reads backwards from the end, never holding more than one line; a torn last line is skipped,
/// a line over 1 MiB or one that is not JSON is a [`JournalError::Malformed`].
pub fn tail(path: &Path, n: usize) -> Result<Vec<Value>, JournalError> {
    let file = File::open(path).map_err(|source| JournalError::Open {
        path: path.into(),
        source,
    })?;
    let len = file
        .metadata()
        .map_err(|source| JournalError::Read {
            path: path.into(),
            source,
        })?
        .len();
    let mut rev = RevLines::new(&file, len);
    let mut next = || {
        rev.next_segment().map_err(|e| match e {
            RevError::Io(source) => JournalError::Read {
                path: path.into(),
                source,
            },
            RevError::TooLong { end } => JournalError::Malformed {
                path: path.into(),
                offset: end,
                reason: format!("line longer than {MAX_LINE_BYTES} bytes"),
            },
        })
    };
    let mut out = Vec::with_capacity(n.min(1024));
    if n == 0 {
        return Ok(out);
    }
    next()?; // the torn remainder after the last '\n', if any
    while out.len() < n {
        let Some(seg) = next()? else { break };
        let value = serde_json::from_slice(&seg.bytes).map_err(|_| JournalError::Malformed {
            path: path.into(),
            offset: seg.offset,
            reason: "line is not valid JSON".into(),
        })?;
        out.push(value);
    }
    out.reverse();
    Ok(out)
}
