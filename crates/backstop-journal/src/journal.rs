//! The writer: opens (and if need be repairs a torn tail of) a journal, then appends to it.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use backstop_integrity::{canonical, sha256_hex, HostKey};
use nix::fcntl::{Flock, FlockArg};
use serde_json::{Map, Value};

use crate::entry::{self, Entry, GENESIS_PREV, MAX_LINE_BYTES};
use crate::head::{head_path, read_head, write_head, HeadState};
use crate::rev_lines::{RevError, RevLines, Segment};
use backstop_common::AuditEvent;

use crate::{verify, JournalError};

/// An open journal, locked (`flock`, exclusive) against every other writer for as long as it lives.
#[derive(Debug)]
pub struct Journal {
    file: Flock<File>,
    path: PathBuf,
    head_path: PathBuf,
    key: HostKey,
    last_seq: u64,
    last_hash: String,
    /// Length of the file as this writer left it; a failed write is cut back to it.
    len: u64,
    /// Set when a write could not be undone or an fsync failed: the file's state is unknown.
    poisoned: bool,
}

impl Journal {
    /// Opens or creates the journal at `path` (file 0600; a missing parent directory is created
    /// 0700, an existing one is left as it is) and continues its chain.
    ///
    /// Only the end of the file is read: the last complete line must parse and carry a valid hash
    /// and mac, and the head file must agree with it (or lag by one entry, as after a crash between
    /// the two writes). A broken chain is refused with [`JournalError::TamperedTail`] and nothing is
    /// changed. A torn last line (no trailing `'\n'`) is then copied to `<path>.torn-<unix_ms>`, cut
    /// off, and recorded in a `journal.torn_tail_recovered` entry.
    pub fn open(path: &Path, key: HostKey) -> Result<Journal, JournalError> {
        let dir = parent_dir(path);
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| JournalError::CreateDir {
                path: dir.into(),
                source,
            })?;
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| JournalError::Open {
                path: path.into(),
                source,
            })?;
        let file = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, source)| {
            JournalError::Locked {
                path: path.into(),
                source,
            }
        })?;
        let meta = file.metadata().map_err(|source| JournalError::Open {
            path: path.into(),
            source,
        })?;
        if meta.permissions().mode() & 0o077 != 0 {
            fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|source| {
                JournalError::SetMode {
                    path: path.into(),
                    source,
                }
            })?;
        }
        let len = meta.len();

        let mut rev = RevLines::new(&file, len);
        let torn = next_segment(&mut rev, path)?.filter(|s| !s.bytes.is_empty());
        let last = next_segment(&mut rev, path)?;
        let (last_seq, last_hash, last_prev) = match &last {
            None => (0, GENESIS_PREV.to_owned(), None),
            Some(seg) => {
                let tampered = |reason: String| JournalError::TamperedTail {
                    path: path.into(),
                    reason: format!("last entry: {reason}"),
                };
                let parsed = entry::parse_line(&seg.bytes).map_err(|f| tampered(f.reason))?;
                let e = parsed.entry;
                e.check_seal(&key)
                    .map_err(|r| tampered(format!("seq {}: {r}", e.seq)))?;
                (e.seq, e.hash, Some(e.prev))
            }
        };

        let head_path = head_path(path);
        let tampered = |reason: String| JournalError::TamperedTail {
            path: path.into(),
            reason,
        };
        let head_lags = match read_head(&head_path, &key)? {
            HeadState::Missing if last_seq == 0 => true,
            HeadState::Missing => return Err(tampered("head file missing".into())),
            HeadState::Bad(reason) => return Err(tampered(reason)),
            HeadState::Sealed { seq, .. } if seq > last_seq => {
                return Err(tampered(format!(
                    "journal ends at seq {last_seq} but head says {seq} (tail truncated)"
                )))
            }
            HeadState::Sealed { seq, hash } if seq == last_seq => {
                if hash != last_hash {
                    return Err(tampered(format!("head does not match entry at seq {seq}")));
                }
                false
            }
            HeadState::Sealed { seq, hash } if seq + 1 == last_seq => {
                if Some(&hash) != last_prev.as_ref() {
                    return Err(tampered(format!("head does not match entry at seq {seq}")));
                }
                true
            }
            HeadState::Sealed { .. } => {
                // The head lags by more than one entry (earlier head writes failed): only a walk
                // of the whole chain can tell whether it still belongs to this journal.
                let limit = torn.as_ref().map_or(len, |t| t.offset);
                let outcome = verify::verify_prefix(path, &key, limit)?;
                if let Some(fault) = outcome.first_bad {
                    return Err(tampered(format!("line {}: {}", fault.line, fault.reason)));
                }
                true
            }
        };
        drop(rev);

        let mut journal = Journal {
            file,
            path: path.into(),
            head_path,
            key,
            last_seq,
            last_hash,
            len,
            poisoned: false,
        };
        if head_lags {
            write_head(
                &journal.head_path,
                &journal.key,
                last_seq,
                &journal.last_hash,
            )?;
        }
        if let Some(torn) = torn {
            journal.recover_torn_tail(torn)?;
        }
        Ok(journal)
    }

    /// Saves a torn tail aside, cuts it off and journals that it did.
    fn recover_torn_tail(&mut self, torn: Segment) -> Result<(), JournalError> {
        let saved = save_torn(&self.path, &torn.bytes)?;
        self.file
            .set_len(torn.offset)
            .map_err(|source| JournalError::Truncate {
                path: self.path.clone(),
                source,
            })?;
        self.file.sync_all().map_err(|source| JournalError::Fsync {
            path: self.path.clone(),
            source,
        })?;
        self.len = torn.offset;
        let mut fields = Map::new();
        fields.insert("offset".into(), Value::from(torn.offset));
        fields.insert("bytes".into(), Value::from(torn.bytes.len()));
        fields.insert("sha256".into(), Value::from(sha256_hex(&torn.bytes)));
        fields.insert(
            "saved_to".into(),
            Value::from(saved.to_string_lossy().into_owned()),
        );
        self.append(AuditEvent::JournalTornTailRecovered.as_str(), fields)?;
        Ok(())
    }

    /// Appends one entry, written and `fdatasync`ed before this returns, then re-seals the head.
    ///
    /// A bad event name or fields that cannot be written change nothing. If the write fails it is
    /// cut back; if that or the fsync fails the journal refuses further appends
    /// ([`JournalError::Poisoned`]) until reopened. A [`JournalError::WriteHead`] means the entry
    /// itself is durable and only the head lags.
    pub fn append(
        &mut self,
        event: &str,
        fields: Map<String, Value>,
    ) -> Result<Entry, JournalError> {
        if self.poisoned {
            return Err(JournalError::Poisoned {
                path: self.path.clone(),
            });
        }
        entry::check_event_name(event).map_err(|reason| JournalError::InvalidEvent {
            event: event.into(),
            reason,
        })?;
        let fields = entry::normalize_fields(fields)?;
        let seq = self
            .last_seq
            .checked_add(1)
            .ok_or_else(|| JournalError::SeqExhausted {
                path: self.path.clone(),
            })?;
        let entry = Entry::seal(
            seq,
            entry::now_ts(),
            event,
            fields,
            &self.last_hash,
            &self.key,
        )
        .map_err(|e| JournalError::InvalidFields {
            reason: e.to_string(),
        })?;
        let mut line = canonical::to_vec(&entry).map_err(|e| JournalError::InvalidFields {
            reason: e.to_string(),
        })?;
        if line.len() > MAX_LINE_BYTES {
            return Err(JournalError::EntryTooLarge {
                bytes: line.len(),
                max: MAX_LINE_BYTES,
            });
        }
        line.push(b'\n');

        if let Err(source) = self.file.write_all(&line) {
            if self.file.set_len(self.len).is_err() {
                self.poisoned = true;
            }
            return Err(JournalError::Write {
                path: self.path.clone(),
                source,
            });
        }
        if let Err(source) = self.file.sync_data() {
            self.poisoned = true;
            return Err(JournalError::Fsync {
                path: self.path.clone(),
                source,
            });
        }
        self.len += line.len() as u64;
        self.last_seq = seq;
        self.last_hash.clone_from(&entry.hash);
        write_head(&self.head_path, &self.key, seq, &entry.hash)?;
        Ok(entry)
    }

    /// Seals the head again for the last entry: after a [`JournalError::WriteHead`] (the entry
    /// is durable, only its head lagged), once space is back.
    pub fn reseal_head(&self) -> Result<(), JournalError> {
        write_head(&self.head_path, &self.key, self.last_seq, &self.last_hash)
    }

    /// Seq of the last entry, 0 for an empty journal.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Hash of the last entry, [`GENESIS_PREV`] for an empty journal.
    pub fn last_hash(&self) -> &str {
        &self.last_hash
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the journal on disk is still the one this writer left: its sealed head file
    /// names the last entry written (seq and hash, mac checked) and the file has the length
    /// the last append left. `Ok(None)`: it is; `Ok(Some(why))`: it is not (a head file
    /// replaced or removed, entries cut off or added behind this writer). The next append
    /// rewrites the head, so a mismatch is seen only until then.
    pub fn check_sealed_head(&self) -> Result<Option<String>, JournalError> {
        let on_disk = std::fs::metadata(&self.path)
            .map_err(|source| JournalError::Read {
                path: self.path.clone(),
                source,
            })?
            .len();
        if on_disk != self.len {
            return Ok(Some(format!(
                "journal is {on_disk} bytes on disk, {} after the last append",
                self.len
            )));
        }
        Ok(match read_head(&self.head_path, &self.key)? {
            HeadState::Sealed { seq, hash } if seq == self.last_seq && hash == self.last_hash => {
                None
            }
            HeadState::Sealed { seq, .. } => Some(format!(
                "head file names entry {seq}, the last entry written is {}",
                self.last_seq
            )),
            HeadState::Missing if self.last_seq == 0 => None,
            HeadState::Missing => Some("head file is missing".into()),
            HeadState::Bad(why) => Some(why),
        })
    }
}

fn next_segment(rev: &mut RevLines<'_>, path: &Path) -> Result<Option<Segment>, JournalError> {
    rev.next_segment().map_err(|e| match e {
        RevError::Io(source) => JournalError::Read {
            path: path.into(),
            source,
        },
        RevError::TooLong { end } => JournalError::Malformed {
            path: path.into(),
            offset: end,
            reason: format!("line ending at byte {end} is longer than {MAX_LINE_BYTES} bytes"),
        },
    })
}

/// Copies torn bytes to a new `<path>.torn-<unix_ms>[-n]` (0600, fsynced with its directory).
fn save_torn(path: &Path, bytes: &[u8]) -> Result<PathBuf, JournalError> {
    let unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let mut attempt = 0u32;
    loop {
        let mut name = OsString::from(path.as_os_str());
        name.push(format!(".torn-{unix_ms}"));
        if attempt > 0 {
            name.push(format!("-{attempt}"));
        }
        let target = PathBuf::from(name);
        let err = |source| JournalError::SaveTorn {
            path: target.clone(),
            source,
        };
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&target)
        {
            Ok(mut file) => {
                file.write_all(bytes).map_err(err)?;
                file.sync_all().map_err(err)?;
                sync_dir(&target).map_err(err)?;
                return Ok(target);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 1000 => {
                attempt += 1;
            }
            Err(e) => return Err(err(e)),
        }
    }
}

/// The directory holding `path` (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// fsyncs the directory holding `path`, making a create or rename in it durable.
pub(crate) fn sync_dir(path: &Path) -> std::io::Result<()> {
    backstop_common::durable::fsync_dir(parent_dir(path))
}
