//! Reviewer evidence for a restore (spec/001 governance): a token naming one snapshot, the
//! reviewer, and an expiry, sealed with HMAC-SHA256 under a reviewer key that the daemon's config
//! names (`[restore_gate] reviewer_key`).
//!
//! The token file is JSON, parsed strictly (unknown fields refused, size bounded):
//!
//! ```json
//! {"snapshot_id":"<32 hex>","reviewer":"alice","expires_at":"2026-05-01T12:00:00.000Z","hmac":"<64 hex>"}
//! ```
//!
//! `hmac` is over the canonical JSON of `{"expires_at","kind","reviewer","snapshot_id"}` with
//! `kind` = [`TOKEN_KIND`], so a token cannot be replayed as any other signed object. The key file
//! is 32 raw bytes, mode 0600 or stricter, like the host key (and never the host key).

use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use backstop_integrity::{canonical, HostKey, KEY_LEN};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use time::OffsetDateTime;

/// Domain separation for the sealed bytes.
pub const TOKEN_KIND: &str = "backstop.reviewer-token.v1";
/// Largest token accepted, in bytes of JSON.
pub const TOKEN_MAX_BYTES: usize = 4096;
/// Longest validity a token may claim (from now), so a leaked token does not live for ever.
pub const TOKEN_MAX_VALIDITY_S: i64 = 7 * 24 * 3600;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReviewerToken {
    pub snapshot_id: String,
    pub reviewer: String,
    /// RFC 3339 (written UTC with milliseconds; any RFC 3339 time is read).
    pub expires_at: String,
    /// HMAC-SHA256, lower-case hex.
    pub hmac: String,
}

/// Why a token is not evidence. Every variant maps to one refusal the daemon journals.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvidenceError {
    #[error("reviewer token is malformed: {0}")]
    Malformed(String),
    #[error("reviewer token is for snapshot {found}, not {wanted}")]
    WrongSnapshot { found: String, wanted: String },
    #[error("reviewer token expired at {0}")]
    Expired(String),
    #[error("reviewer token claims validity until {0}, beyond the 7-day limit")]
    TooLong(String),
    #[error("reviewer token signature does not match the configured reviewer key")]
    BadSignature,
    #[error("cannot use reviewer key {path}: {reason}")]
    Key { path: String, reason: String },
}

fn sealed_bytes(snapshot_id: &str, reviewer: &str, expires_at: &str) -> Vec<u8> {
    let v = json!({
        "kind": TOKEN_KIND, "snapshot_id": snapshot_id, "reviewer": reviewer, "expires_at": expires_at,
    });
    // Canonical JSON of plain strings cannot fail; an empty vector would only fail to verify.
    canonical::to_vec(&v).unwrap_or_default()
}

fn valid_reviewer(r: &str) -> bool {
    !r.is_empty() && r.len() <= 128 && r.chars().all(|c| !c.is_control()) && r.trim() == r
}

fn valid_snapshot_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Makes a token for `snapshot_id` (a full id) valid until `expires_at`.
pub fn sign(
    key: &HostKey,
    snapshot_id: &str,
    reviewer: &str,
    expires_at: OffsetDateTime,
) -> Result<ReviewerToken, EvidenceError> {
    if !valid_snapshot_id(snapshot_id) {
        return Err(EvidenceError::Malformed(
            "snapshot_id must be a full snapshot id (32 hex digits)".into(),
        ));
    }
    if !valid_reviewer(reviewer) {
        return Err(EvidenceError::Malformed(
            "reviewer must be 1-128 printable characters".into(),
        ));
    }
    let expires_at = backstop_common::time::rfc3339(expires_at);
    let hmac = key.sign_hex(&sealed_bytes(snapshot_id, reviewer, &expires_at));
    Ok(ReviewerToken {
        snapshot_id: snapshot_id.into(),
        reviewer: reviewer.into(),
        expires_at,
        hmac,
    })
}

/// Checks `token` (as sent over the socket) against `key`, for a restore of `snapshot_id` at
/// `now`. Order: size → strict shape → fields → signature → snapshot → expiry.
pub fn verify(
    key: &HostKey,
    token: &Value,
    snapshot_id: &str,
    now: OffsetDateTime,
) -> Result<ReviewerToken, EvidenceError> {
    let len = serde_json::to_vec(token)
        .map(|b| b.len())
        .unwrap_or(usize::MAX);
    if len > TOKEN_MAX_BYTES {
        return Err(EvidenceError::Malformed(format!(
            "larger than {TOKEN_MAX_BYTES} bytes"
        )));
    }
    let t: ReviewerToken = serde_json::from_value(token.clone())
        .map_err(|e| EvidenceError::Malformed(e.to_string()))?;
    if !valid_snapshot_id(&t.snapshot_id) || !valid_reviewer(&t.reviewer) {
        return Err(EvidenceError::Malformed(
            "snapshot_id or reviewer is not well formed".into(),
        ));
    }
    let expires = backstop_common::time::parse_rfc3339(&t.expires_at)
        .ok_or_else(|| EvidenceError::Malformed("expires_at is not an RFC 3339 time".into()))?;
    if t.hmac.len() != 64
        || !key.verify_hex(
            &sealed_bytes(&t.snapshot_id, &t.reviewer, &t.expires_at),
            &t.hmac,
        )
    {
        return Err(EvidenceError::BadSignature);
    }
    if t.snapshot_id != snapshot_id {
        return Err(EvidenceError::WrongSnapshot {
            found: t.snapshot_id,
            wanted: snapshot_id.into(),
        });
    }
    if expires <= now {
        return Err(EvidenceError::Expired(t.expires_at));
    }
    if (expires - now).whole_seconds() > TOKEN_MAX_VALIDITY_S {
        return Err(EvidenceError::TooLong(t.expires_at));
    }
    Ok(t)
}

/// Loads a reviewer key: exactly 32 bytes, mode 0600 or stricter. Never creates one.
pub fn load_key(path: &Path) -> Result<HostKey, EvidenceError> {
    let err = |reason: String| EvidenceError::Key {
        path: path.display().to_string(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mode = file
        .metadata()
        .map_err(|e| err(e.to_string()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(err(format!(
            "readable by others (mode {:o}); it must be 0600 or stricter",
            mode & 0o777
        )));
    }
    let mut buf = Vec::new();
    file.take(KEY_LEN as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| err(e.to_string()))?;
    let bytes: [u8; KEY_LEN] = buf
        .as_slice()
        .try_into()
        .map_err(|_| err(format!("has {} bytes, expected {KEY_LEN}", buf.len())))?;
    Ok(HostKey::from_bytes(bytes))
}

/// Creates a new random reviewer key at `path` (mode 0600); refuses to overwrite one.
pub fn create_key(path: &Path) -> Result<(), EvidenceError> {
    let err = |reason: String| EvidenceError::Key {
        path: path.display().to_string(),
        reason,
    };
    let mut bytes = [0u8; KEY_LEN];
    getrandom::fill(&mut bytes).map_err(|e| err(e.to_string()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| err(e.to_string()))?;
    std::io::Write::write_all(&mut f, &bytes).map_err(|e| err(e.to_string()))?;
    f.sync_all().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use time::Duration;

    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn a_signed_token_verifies_once_and_only_for_its_snapshot() {
        let key = HostKey::from_bytes([5; 32]);
        let now = OffsetDateTime::now_utc();
        let t = sign(&key, ID, "alice", now + Duration::hours(1)).unwrap();
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(verify(&key, &v, ID, now).unwrap().reviewer, "alice");

        let other = "f".repeat(32);
        assert!(matches!(
            verify(&key, &v, &other, now),
            Err(EvidenceError::WrongSnapshot { .. })
        ));
        assert!(matches!(
            verify(&key, &v, ID, now + Duration::hours(2)),
            Err(EvidenceError::Expired(_))
        ));
        let wrong_key = HostKey::from_bytes([6; 32]);
        assert_eq!(
            verify(&wrong_key, &v, ID, now),
            Err(EvidenceError::BadSignature)
        );

        // Any field changed breaks the seal.
        for (field, value) in [
            ("reviewer", json!("mallory")),
            ("snapshot_id", json!(other)),
            ("expires_at", json!("2099-01-01T00:00:00Z")),
        ] {
            let mut forged = v.clone();
            forged[field] = value;
            assert_eq!(
                verify(&key, &forged, ID, now),
                Err(EvidenceError::BadSignature),
                "{field}"
            );
        }
        // Strict shape.
        let mut extra = v.clone();
        extra["scope"] = json!("everything");
        assert!(matches!(
            verify(&key, &extra, ID, now),
            Err(EvidenceError::Malformed(_))
        ));
        assert!(matches!(
            verify(&key, &json!("x"), ID, now),
            Err(EvidenceError::Malformed(_))
        ));
        let mut huge = v.clone();
        huge["reviewer"] = json!("x".repeat(5000));
        assert!(matches!(
            verify(&key, &huge, ID, now),
            Err(EvidenceError::Malformed(_))
        ));
        // A token valid for a year is refused even when correctly signed.
        let long = sign(&key, ID, "alice", now + Duration::days(365)).unwrap();
        let long = serde_json::to_value(&long).unwrap();
        assert!(matches!(
            verify(&key, &long, ID, now),
            Err(EvidenceError::TooLong(_))
        ));
        assert!(sign(&key, "abc", "alice", now).is_err());
        assert!(sign(&key, ID, "", now).is_err());
    }

    /// New tokens carry the journal's time format (UTC, milliseconds); a token written with
    /// any other RFC 3339 form (older consoles wrote nanoseconds, people write offsets) still
    /// verifies, because the signature covers the string as written.
    #[test]
    fn tokens_write_one_time_format_and_read_any_rfc_3339() {
        let key = HostKey::from_bytes([5; 32]);
        let now = time::macros::datetime!(2026-05-01 12:00:00.123456789 UTC);
        let t = sign(&key, ID, "alice", now + Duration::hours(1)).unwrap();
        assert_eq!(t.expires_at, "2026-05-01T13:00:00.123Z");
        for expires_at in [
            "2026-05-01T13:00:00.123456789Z",
            "2026-05-01T15:00:00+02:00",
            "2026-05-01T13:00:00Z",
        ] {
            let v = json!({
                "snapshot_id": ID, "reviewer": "alice", "expires_at": expires_at,
                "hmac": key.sign_hex(&sealed_bytes(ID, "alice", expires_at)),
            });
            let got = verify(&key, &v, ID, now).unwrap();
            assert_eq!(got.expires_at, expires_at);
            assert!(matches!(
                verify(&key, &v, ID, now + Duration::hours(2)),
                Err(EvidenceError::Expired(_))
            ));
        }
        let v = json!({
            "snapshot_id": ID, "reviewer": "alice", "expires_at": "2026-05-01 13:00:00",
            "hmac": key.sign_hex(&sealed_bytes(ID, "alice", "2026-05-01 13:00:00")),
        });
        assert!(matches!(
            verify(&key, &v, ID, now),
            Err(EvidenceError::Malformed(_))
        ));
    }

    #[test]
    fn keys_are_created_private_and_loaded_strictly() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("reviewer.key");
        create_key(&p).unwrap();
        assert!(create_key(&p).is_err(), "never overwrites");
        load_key(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_key(&p)
            .unwrap_err()
            .to_string()
            .contains("readable by others"));
        let short = d.path().join("short.key");
        std::fs::write(&short, [1u8; 16]).unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load_key(&short)
            .unwrap_err()
            .to_string()
            .contains("16 bytes"));
        assert!(load_key(&d.path().join("none")).is_err());
    }
}
