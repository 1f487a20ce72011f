//! The host's HMAC key: 32 random bytes in a 0600 file that only the daemon reads.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Length of the key in bytes.
pub const KEY_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot create key directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read host key {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write host key {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("host key {path} has {len} bytes, expected {KEY_LEN}")]
    BadLength { path: PathBuf, len: usize },
    #[error("host key {path} is readable by others (mode {mode:o}); it must be 0600 or stricter")]
    TooOpen { path: PathBuf, mode: u32 },
    #[error("no randomness for a new host key: {0}")]
    Random(String),
}

/// The host's signing key. `Debug` never prints the bytes.
#[derive(Clone)]
pub struct HostKey {
    bytes: [u8; KEY_LEN],
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostKey(<secret>)")
    }
}

impl HostKey {
    /// A key from raw bytes (tests, and keys held elsewhere).
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self { bytes }
    }

    /// Loads the key at `path`, creating it (mode 0600, parent 0700) if it does not exist.
    /// A key file that others can read is refused rather than silently trusted.
    pub fn load_or_create(path: &Path) -> Result<Self, KeyError> {
        match File::open(path) {
            Ok(file) => Self::read_from(path, file),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Self::create(path),
            Err(source) => Err(KeyError::Read {
                path: path.into(),
                source,
            }),
        }
    }

    fn read_from(path: &Path, mut file: File) -> Result<Self, KeyError> {
        let meta = file.metadata().map_err(|source| KeyError::Read {
            path: path.into(),
            source,
        })?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyError::TooOpen {
                path: path.into(),
                mode,
            });
        }
        let mut buf = Vec::with_capacity(KEY_LEN);
        Read::by_ref(&mut file)
            .take(KEY_LEN as u64 + 1)
            .read_to_end(&mut buf)
            .map_err(|source| KeyError::Read {
                path: path.into(),
                source,
            })?;
        let bytes: [u8; KEY_LEN] = buf.as_slice().try_into().map_err(|_| KeyError::BadLength {
            path: path.into(),
            len: buf.len(),
        })?;
        Ok(Self { bytes })
    }

    fn create(path: &Path) -> Result<Self, KeyError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|source| KeyError::CreateDir {
                path: dir.into(),
                source,
            })?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
                KeyError::CreateDir {
                    path: dir.into(),
                    source,
                }
            })?;
        }
        let mut bytes = [0u8; KEY_LEN];
        getrandom::fill(&mut bytes).map_err(|e| KeyError::Random(e.to_string()))?;
        let write_err = |source| KeyError::Write {
            path: path.into(),
            source,
        };
        // create_new: two daemons racing to create the key must not overwrite each other.
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(write_err)?;
        file.write_all(&bytes).map_err(write_err)?;
        file.sync_all().map_err(write_err)?;
        if let Some(dir) = path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(write_err)?;
        }
        Ok(Self { bytes })
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length; 32 bytes can never be rejected.
        <HmacSha256 as KeyInit>::new_from_slice(&self.bytes).unwrap_or_else(|_| unreachable!())
    }

    /// HMAC-SHA256 of `data`, lower-case hex.
    pub fn sign_hex(&self, data: &[u8]) -> String {
        let mut mac = self.mac();
        mac.update(data);
        hex::encode(mac.finalize().into_bytes())
    }

    /// Constant-time check of a hex HMAC over `data`. Only the exact form [`sign_hex`] writes
    /// (lower-case hex, nothing around it) verifies: a decoder alone would take `AB…` for `ab…`,
    /// so a changed byte in a sealed line or file could still verify. Anything else is `false`.
    ///
    /// [`sign_hex`]: HostKey::sign_hex
    pub fn verify_hex(&self, data: &[u8], mac_hex: &str) -> bool {
        if !crate::is_lower_hex(mac_hex) {
            return false;
        }
        let Ok(tag) = hex::decode(mac_hex) else {
            return false;
        };
        let mut mac = self.mac();
        mac.update(data);
        mac.verify_slice(&tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_key_is_0600_and_reloads_identically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/host.key");
        let a = HostKey::load_or_create(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        let b = HostKey::load_or_create(&path).unwrap();
        assert_eq!(a.sign_hex(b"x"), b.sign_hex(b"x"));
    }

    #[test]
    fn world_readable_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.key");
        HostKey::load_or_create(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            HostKey::load_or_create(&path),
            Err(KeyError::TooOpen { .. })
        ));
    }

    #[test]
    fn wrong_length_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.key");
        fs::write(&path, b"short").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            HostKey::load_or_create(&path),
            Err(KeyError::BadLength { len: 5, .. })
        ));
    }

    /// Known answers (Python's hmac and hashlib), so a sha2/hmac upgrade that changed a digest
    /// (and with it every seal already written) fails here.
    #[test]
    fn hmac_and_sha256_match_known_answers() {
        let key = HostKey::from_bytes([7; KEY_LEN]);
        assert_eq!(
            key.sign_hex(b"backstop"),
            "366abc51336ecb586f3bad398bf6de9c350855556dec24fe43be0a97f283a58f"
        );
        assert_eq!(
            crate::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn verify_rejects_a_flipped_byte_and_bad_hex() {
        let key = HostKey::from_bytes([7; KEY_LEN]);
        let tag = key.sign_hex(b"payload");
        assert!(key.verify_hex(b"payload", &tag));
        assert!(!key.verify_hex(b"paylobd", &tag));
        assert!(!key.verify_hex(b"payload", "zz"));
        // The same tag in capitals or with a space around it is not what was written.
        assert!(!key.verify_hex(b"payload", &tag.to_ascii_uppercase()));
        assert!(!key.verify_hex(b"payload", &format!("{tag} ")));
        let other = HostKey::from_bytes([8; KEY_LEN]);
        assert!(!other.verify_hex(b"payload", &tag));
    }
}
