//! Trust across hosts: each host's ed25519 signing key (beside its HMAC key, 0600; the public
//! half in `<key>.pub`), and the fleet trust file that names every host's public key.
//!
//! A host's HMAC key cannot be handed to the others, so a manifest that leaves the host carries
//! an ed25519 signature over exactly the bytes of `manifest.json`; the receiving host checks it
//! against the trust file before it decodes a byte of the manifest.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::Deserialize;

use crate::config::is_valid_host;

/// The file name of the ed25519 key, next to the HMAC key.
pub const SIGNING_KEY_FILE: &str = "host-ed25519.key";
/// The public half, as a trust-file value (`ed25519:<64 hex>`).
pub const PUBLIC_KEY_FILE: &str = "host-ed25519.pub";
const PUBLIC_PREFIX: &str = "ed25519:";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: mode {mode:04o} lets others read the key; chmod 600 it")]
    TooOpen { path: PathBuf, mode: u32 },
    #[error("{path}: not a 32-byte key")]
    BadLength { path: PathBuf },
    #[error("no randomness: {0}")]
    Random(String),
}

/// This host's ed25519 key.
pub struct HostSigningKey {
    key: SigningKey,
}

impl HostSigningKey {
    /// Loads `dir/host-ed25519.key`, creating it (0600) and `dir/host-ed25519.pub` (0644) at
    /// first start. A key others can read is refused.
    pub fn load_or_create(dir: &Path) -> Result<HostSigningKey, KeyError> {
        let path = dir.join(SIGNING_KEY_FILE);
        let io = |source| KeyError::Io {
            path: path.clone(),
            source,
        };
        let key = match File::open(&path) {
            Ok(mut f) => {
                let mode = f.metadata().map_err(io)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(KeyError::TooOpen { path, mode });
                }
                let mut buf = Vec::new();
                Read::by_ref(&mut f)
                    .take(33)
                    .read_to_end(&mut buf)
                    .map_err(io)?;
                let bytes: [u8; 32] = buf
                    .as_slice()
                    .try_into()
                    .map_err(|_| KeyError::BadLength { path: path.clone() })?;
                SigningKey::from_bytes(&bytes)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir_all(dir).map_err(io)?;
                let mut bytes = [0u8; 32];
                getrandom::fill(&mut bytes).map_err(|e| KeyError::Random(e.to_string()))?;
                let mut f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io)?;
                f.write_all(&bytes).map_err(io)?;
                f.sync_all().map_err(io)?;
                SigningKey::from_bytes(&bytes)
            }
            Err(e) => return Err(io(e)),
        };
        let me = HostSigningKey { key };
        // The public half is rewritten when it is missing or wrong (it is derived, not secret).
        let pub_path = dir.join(PUBLIC_KEY_FILE);
        let want = format!("{}\n", me.public());
        if fs::read_to_string(&pub_path).ok().as_deref() != Some(want.as_str()) {
            let tmp = dir.join(format!("{PUBLIC_KEY_FILE}.tmp"));
            let pio = |source| KeyError::Io {
                path: pub_path.clone(),
                source,
            };
            fs::write(&tmp, &want).map_err(pio)?;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644)).map_err(pio)?;
            fs::rename(&tmp, &pub_path).map_err(pio)?;
        }
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        Ok(me)
    }

    #[cfg(test)]
    pub fn from_bytes(bytes: [u8; 32]) -> HostSigningKey {
        HostSigningKey {
            key: SigningKey::from_bytes(&bytes),
        }
    }

    /// `ed25519:<64 hex>`: this host's line in a trust file.
    pub fn public(&self) -> String {
        format!(
            "{PUBLIC_PREFIX}{}",
            hex::encode(self.key.verifying_key().as_bytes())
        )
    }

    /// The content of `manifest.ed25519` for `manifest`: 128 hex digits and a newline.
    pub fn sign_manifest(&self, manifest: &[u8]) -> String {
        format!("{}\n", hex::encode(self.key.sign(manifest).to_bytes()))
    }
}

/// Why a trust file or a signature was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TrustError {
    #[error("trust file {path}: {message}")]
    File { path: String, message: String },
    #[error("host {host:?} is not in the fleet trust file: its snapshots cannot be trusted")]
    UnknownHost { host: String },
    #[error("the ed25519 signature of {host}'s manifest does not verify against the trust file")]
    BadSignature { host: String },
}

impl TrustError {
    pub fn code(&self) -> backstop_common::ErrorCode {
        match self {
            TrustError::File { .. } => backstop_common::ErrorCode::ConfigInvalid,
            _ => backstop_common::ErrorCode::SnapshotIntegrityCheckFailed,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrust {
    hosts: BTreeMap<String, String>,
}

/// The fleet trust file: `[hosts]` with one `name = "ed25519:<64 hex>"` per host.
#[derive(Debug, Clone)]
pub struct TrustFile {
    hosts: BTreeMap<String, VerifyingKey>,
}

impl TrustFile {
    pub fn load(path: &Path) -> Result<TrustFile, TrustError> {
        let shown = path.display().to_string();
        let text = fs::read_to_string(path).map_err(|e| TrustError::File {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        Self::parse(&text).map_err(|message| TrustError::File {
            path: shown,
            message,
        })
    }

    /// Parses a trust file strictly: unknown keys, bad host names and malformed or weak keys
    /// are refused.
    pub fn parse(text: &str) -> Result<TrustFile, String> {
        let raw: RawTrust = toml::from_str(text).map_err(|e| {
            e.to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })?;
        let mut hosts = BTreeMap::new();
        for (name, value) in raw.hosts {
            if !is_valid_host(&name) {
                return Err(format!("host {name:?}: use 1-64 of [A-Za-z0-9._-]"));
            }
            let hex_key = value
                .strip_prefix(PUBLIC_PREFIX)
                .ok_or_else(|| format!("host {name}: the key must start with {PUBLIC_PREFIX}"))?;
            let mut bytes = [0u8; 32];
            if hex_key.len() != 64 || hex::decode_to_slice(hex_key, &mut bytes).is_err() {
                return Err(format!("host {name}: the key is not 64 hex digits"));
            }
            let key = VerifyingKey::from_bytes(&bytes)
                .map_err(|_| format!("host {name}: not a valid ed25519 public key"))?;
            if key.is_weak() {
                return Err(format!("host {name}: a weak (small-order) key"));
            }
            hosts.insert(name, key);
        }
        Ok(TrustFile { hosts })
    }

    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts.keys().map(String::as_str)
    }

    /// Checks `sig` (the content of `manifest.ed25519`) over the raw `manifest` bytes against
    /// `host`'s key. Nothing of the manifest is decoded before this passes.
    pub fn verify(&self, host: &str, manifest: &[u8], sig: &[u8]) -> Result<(), TrustError> {
        let key = self
            .hosts
            .get(host)
            .ok_or_else(|| TrustError::UnknownHost { host: host.into() })?;
        let bad = || TrustError::BadSignature { host: host.into() };
        let hex_sig = sig.strip_suffix(b"\n").ok_or_else(bad)?;
        let mut bytes = [0u8; 64];
        if hex_sig.len() != 128 || hex::decode_to_slice(hex_sig, &mut bytes).is_err() {
            return Err(bad());
        }
        let signature = Signature::from_bytes(&bytes);
        key.verify_strict(manifest, &signature).map_err(|_| bad())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn trust_for(name: &str, k: &HostSigningKey) -> TrustFile {
        TrustFile::parse(&format!("[hosts]\n{name} = \"{}\"\n", k.public())).unwrap()
    }

    #[test]
    fn a_signed_manifest_verifies_and_any_change_does_not() {
        let a = HostSigningKey::from_bytes([7; 32]);
        let trust = trust_for("host-a", &a);
        let m = br#"{"snapshot_id":"x"}"#;
        let sig = a.sign_manifest(m);
        trust.verify("host-a", m, sig.as_bytes()).unwrap();
        // Another manifest, another signature, another host, a mangled file: all refused.
        let e = trust
            .verify("host-a", br#"{"snapshot_id":"y"}"#, sig.as_bytes())
            .unwrap_err();
        assert_eq!(e.code().as_str(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        let b = HostSigningKey::from_bytes([8; 32]);
        assert!(trust
            .verify("host-a", m, b.sign_manifest(m).as_bytes())
            .is_err());
        let e = trust.verify("host-b", m, sig.as_bytes()).unwrap_err();
        assert_eq!(
            e,
            TrustError::UnknownHost {
                host: "host-b".into()
            }
        );
        assert_eq!(e.code().as_str(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        for bad in [&sig.as_bytes()[..10], sig.trim_end().as_bytes(), b"zz\n"] {
            assert!(trust.verify("host-a", m, bad).is_err());
        }
    }

    #[test]
    fn the_trust_file_parser_is_strict() {
        let a = HostSigningKey::from_bytes([7; 32]);
        let good = format!("[hosts]\nhost-a = \"{}\"\n", a.public());
        assert_eq!(
            TrustFile::parse(&good).unwrap().hosts().collect::<Vec<_>>(),
            ["host-a"]
        );
        let short = a.public()[..70].to_string();
        for bad in [
            String::new(),
            format!("{good}extra = 1\n"),
            format!("[hosts]\nhost-a = \"{}\"\n", &a.public()[8..]),
            format!("[hosts]\nhost-a = \"{short}\"\n"),
            format!("[hosts]\n\"a/b\" = \"{}\"\n", a.public()),
            format!("[hosts]\nh = \"ed25519:{}\"\n", "00".repeat(32)),
            format!("[hosts]\nh = \"ed25519:{}\"\n", "zz".repeat(32)),
            format!("{good}host-a = \"{}\"\n", a.public()),
        ] {
            assert!(TrustFile::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_key_is_created_private_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let k1 = HostSigningKey::load_or_create(dir.path()).unwrap();
        let mode = fs::metadata(dir.path().join(SIGNING_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let k2 = HostSigningKey::load_or_create(dir.path()).unwrap();
        assert_eq!(k1.public(), k2.public());
        let pubtext = fs::read_to_string(dir.path().join(PUBLIC_KEY_FILE)).unwrap();
        assert_eq!(pubtext.trim(), k1.public());
        fs::set_permissions(
            dir.path().join(SIGNING_KEY_FILE),
            fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        assert!(matches!(
            HostSigningKey::load_or_create(dir.path()),
            Err(KeyError::TooOpen { .. })
        ));
    }
}
