//! The sealed head file `<journal>.head`: the seq and hash of the last entry, so that cutting
//! entries off the end of the journal is detected.
//!
//! Its mac is [`HostKey::sign_hex`] over the canonical JSON of
//! `{"domain":"backstop.journal.head.v1","hash":..,"seq":..}`; the domain keeps an entry's mac
//! from being reused as a head's.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use backstop_integrity::{canonical, HostKey};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::JournalError;

const HEAD_DOMAIN: &str = "backstop.journal.head.v1";
const MAX_HEAD_BYTES: u64 = 4096;

/// `<journal path>.head`.
pub fn head_path(journal: &Path) -> PathBuf {
    let mut name = OsString::from(journal.as_os_str());
    name.push(".head");
    PathBuf::from(name)
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeadFile {
    seq: u64,
    hash: String,
    mac: String,
}

/// What the head file says.
#[derive(Debug, PartialEq)]
pub(crate) enum HeadState {
    Missing,
    /// Present but unreadable as a sealed head; the reason is short.
    Bad(String),
    Sealed {
        seq: u64,
        hash: String,
    },
}

/// The bytes a head's mac covers.
fn head_message(seq: u64, hash: &str) -> Vec<u8> {
    let msg = json!({"domain": HEAD_DOMAIN, "hash": hash, "seq": seq});
    // A `Value` of strings and an integer always serialises.
    canonical::to_vec(&msg).unwrap_or_default()
}

fn head_mac(key: &HostKey, seq: u64, hash: &str) -> String {
    key.sign_hex(&head_message(seq, hash))
}

/// Reads and checks the head file (at most 4 KiB of it).
pub(crate) fn read_head(path: &Path, key: &HostKey) -> Result<HeadState, JournalError> {
    let err = |source| JournalError::ReadHead {
        path: path.into(),
        source,
    };
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HeadState::Missing),
        Err(e) => return Err(err(e)),
    };
    let mut buf = Vec::new();
    file.take(MAX_HEAD_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(err)?;
    if buf.len() as u64 > MAX_HEAD_BYTES {
        return Ok(HeadState::Bad("head file is too large".into()));
    }
    let Ok(head) = serde_json::from_slice::<HeadFile>(&buf) else {
        return Ok(HeadState::Bad("head file is not a valid head".into()));
    };
    if !key.verify_hex(&head_message(head.seq, &head.hash), &head.mac) {
        return Ok(HeadState::Bad("head mac mismatch".into()));
    }
    Ok(HeadState::Sealed {
        seq: head.seq,
        hash: head.hash,
    })
}

/// Writes the head atomically: temp file, fsync, rename, fsync the directory.
pub(crate) fn write_head(
    path: &Path,
    key: &HostKey,
    seq: u64,
    hash: &str,
) -> Result<(), JournalError> {
    let err = |source| JournalError::WriteHead {
        path: path.into(),
        source,
    };
    let head = HeadFile {
        seq,
        hash: hash.to_owned(),
        mac: head_mac(key, seq, hash),
    };
    let mut bytes = canonical::to_vec(&head).map_err(|e| err(std::io::Error::other(e)))?;
    bytes.push(b'\n');
    let mut tmp_name = OsString::from(path.as_os_str());
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(&bytes).map_err(err)?;
    file.sync_all().map_err(err)?;
    drop(file);
    fs::rename(&tmp, path).map_err(err)?;
    crate::journal::sync_dir(path).map_err(err)
}

#[cfg(test)]
mod tests {
    use backstop_integrity::KEY_LEN;

    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl.head");
        let key = HostKey::from_bytes([1; KEY_LEN]);
        assert_eq!(read_head(&path, &key).unwrap(), HeadState::Missing);
        write_head(&path, &key, 7, "ab").unwrap();
        assert_eq!(
            read_head(&path, &key).unwrap(),
            HeadState::Sealed {
                seq: 7,
                hash: "ab".into()
            }
        );
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(r#"{"hash":"ab","mac":""#), "{text}");
        let other = HostKey::from_bytes([2; KEY_LEN]);
        assert_eq!(
            read_head(&path, &other).unwrap(),
            HeadState::Bad("head mac mismatch".into())
        );
        fs::write(&path, text.replace("\"seq\":7", "\"seq\":8")).unwrap();
        assert_eq!(
            read_head(&path, &key).unwrap(),
            HeadState::Bad("head mac mismatch".into())
        );
        fs::write(&path, "garbage").unwrap();
        assert!(matches!(read_head(&path, &key).unwrap(), HeadState::Bad(_)));
        assert_eq!(
            head_path(Path::new("/a/journal.jsonl")),
            Path::new("/a/journal.jsonl.head")
        );
    }

    #[test]
    fn an_entry_mac_is_not_a_head_mac() {
        let key = HostKey::from_bytes([1; KEY_LEN]);
        assert_ne!(head_mac(&key, 1, "ab"), key.sign_hex(b"ab"));
    }
}
