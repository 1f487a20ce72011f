//! `[offsite]` in the daemon file, parsed strictly, and the S3 credentials (a 0600 file or the
//! environment; never the command line).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Environment variables holding the credentials when no `credentials_file` is given.
pub const ENV_ACCESS_KEY: &str = "BACKSTOP_OFFSITE_ACCESS_KEY_ID";
pub const ENV_SECRET_KEY: &str = "BACKSTOP_OFFSITE_SECRET_ACCESS_KEY";

/// A config problem: always `ERR_CONFIG_INVALID`, one line naming the key.
#[derive(Debug, thiserror::Error)]
#[error("offsite.{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub fn code(&self) -> backstop_common::ErrorCode {
        backstop_common::ErrorCode::ConfigInvalid
    }
}

fn bad(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    endpoint: String,
    bucket: String,
    #[serde(default)]
    prefix: String,
    #[serde(default = "default_region")]
    region: String,
    host: Option<String>,
    credentials_file: Option<PathBuf>,
    trust_file: Option<PathBuf>,
    #[serde(default = "default_concurrency")]
    max_concurrent_uploads: u32,
    #[serde(default)]
    max_upload_mib_per_s: u32,
    #[serde(default = "default_retry_max_s")]
    retry_max_s: u64,
    #[serde(default = "default_lease_ttl_s")]
    lease_ttl_s: u64,
    #[serde(default = "default_lag_threshold_s")]
    lag_threshold_s: u64,
    #[serde(default)]
    retention: RawRetention,
    ca_file: Option<PathBuf>,
    #[serde(default = "default_multipart_threshold_mib")]
    multipart_threshold_mib: u32,
    #[serde(default = "default_multipart_part_mib")]
    multipart_part_mib: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetention {
    keep_last: Option<u32>,
    keep_within_s: Option<u64>,
    #[serde(default = "default_gc_grace_s")]
    gc_grace_s: u64,
    #[serde(default = "default_gc_interval_s")]
    gc_interval_s: u64,
}

impl Default for RawRetention {
    fn default() -> Self {
        RawRetention {
            keep_last: None,
            keep_within_s: None,
            gc_grace_s: default_gc_grace_s(),
            gc_interval_s: default_gc_interval_s(),
        }
    }
}

fn default_lag_threshold_s() -> u64 {
    600
}
fn default_gc_grace_s() -> u64 {
    86_400
}
fn default_gc_interval_s() -> u64 {
    3600
}

fn default_region() -> String {
    "us-east-1".into()
}
fn default_concurrency() -> u32 {
    4
}
fn default_retry_max_s() -> u64 {
    60
}
fn default_lease_ttl_s() -> u64 {
    60
}

/// The shortest and longest lease (renewed every third of it).
pub const LEASE_TTL_RANGE_S: std::ops::RangeInclusive<u64> = 3..=3600;
fn default_multipart_threshold_mib() -> u32 {
    64
}
fn default_multipart_part_mib() -> u32 {
    16
}

/// The daemon's off-host target.
#[derive(Debug, Clone)]
pub struct OffsiteConfig {
    /// `http://host:port` (path-style addressing: `endpoint/bucket/key`).
    pub endpoint: String,
    pub bucket: String,
    /// Key prefix inside the bucket (no leading or trailing `/`; may be empty).
    pub prefix: String,
    pub region: String,
    /// This host's name in the fleet (`hosts/<host>/...`, the trust file's key).
    pub host: String,
    pub credentials: Credentials,
    /// The fleet trust file (host name → ed25519 public key); needed to pull.
    pub trust_file: Option<PathBuf>,
    pub max_concurrent_uploads: u32,
    /// 0: unlimited.
    pub max_upload_mib_per_s: u32,
    /// The longest wait between two attempts of one snapshot's upload.
    pub retry_max_s: u64,
    /// How long a VM's lease lives unrenewed; renewed every third of it.
    pub lease_ttl_s: u64,
    /// The oldest queued snapshot waiting longer than this is journaled as lagging.
    pub lag_threshold_s: u64,
    /// `[offsite.retention]`: what the bucket keeps of this host's snapshots, and its GC.
    pub retention: RemoteRetention,
    /// A PEM bundle of CA certificates trusted for https (instead of the built-in roots).
    pub ca_file: Option<PathBuf>,
    /// Its certificates, read when the config was loaded (empty: the built-in roots).
    pub ca_certs: Vec<ureq::tls::Certificate<'static>>,
    /// Objects larger than this are uploaded in parts (S3 multipart upload).
    pub multipart_threshold_mib: u32,
    /// The size of one part (two per object being uploaded are held in memory).
    pub multipart_part_mib: u32,
}

/// `[offsite.retention]`: the remote's own rule for this host's snapshots (`hosts/<host>/`
/// only) and the garbage collection of the shared `chunks/` and `layers/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRetention {
    /// Keep the newest N complete snapshots (`None`: no count rule).
    pub keep_last: Option<u32>,
    /// Keep every snapshot created within this many seconds (`None`: no age rule).
    pub keep_within_s: Option<u64>,
    /// An unreferenced chunk or layer is deleted only once it is older than this: an upload in
    /// progress (its manifest not there yet) must finish within it.
    pub gc_grace_s: u64,
    /// Seconds between two GC passes of the uploader (0: only on demand, `backstop offsite gc`).
    pub gc_interval_s: u64,
}

impl Default for RemoteRetention {
    fn default() -> Self {
        RemoteRetention {
            keep_last: None,
            keep_within_s: None,
            gc_grace_s: default_gc_grace_s(),
            gc_interval_s: default_gc_interval_s(),
        }
    }
}

#[derive(Clone)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    access_key_id: String,
    secret_access_key: String,
}

/// A host or VM name as it appears in object keys: 1-64 of `[A-Za-z0-9._-]`, not starting with
/// a dot.
pub fn is_valid_host(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

impl OffsiteConfig {
    /// The `[offsite]` table of a daemon file (`None`: replication is off). `env` looks up an
    /// environment variable (the daemon passes `std::env::var`).
    pub fn from_file_text(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<OffsiteConfig>, ConfigError> {
        let value: toml::Table = toml::from_str(text).map_err(|e| bad("(file)", one_line(&e)))?;
        match value.get("offsite") {
            None => Ok(None),
            Some(v) => Self::from_value(v.clone(), env).map(Some),
        }
    }

    pub fn from_value(
        value: toml::Value,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<OffsiteConfig, ConfigError> {
        let raw: Raw = value
            .try_into()
            .map_err(|e: toml::de::Error| bad("(table)", one_line(&e)))?;
        let endpoint = raw.endpoint.trim_end_matches('/').to_string();
        if !endpoint.starts_with("http://") && !endpoint.starts_with("https://") {
            return Err(bad("endpoint", "must start with http:// or https://"));
        }
        if raw.bucket.len() < 3
            || raw.bucket.len() > 63
            || !raw
                .bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        {
            return Err(bad(
                "bucket",
                "3-63 of lower-case letters, digits, '-' and '.'",
            ));
        }
        let prefix = raw.prefix.trim_matches('/').to_string();
        if !prefix.split('/').all(|p| p.is_empty() || is_valid_host(p)) {
            return Err(bad("prefix", "path segments of [A-Za-z0-9._-]"));
        }
        let host = match raw.host {
            Some(h) => h,
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        };
        if !is_valid_host(&host) {
            return Err(bad(
                "host",
                format!("{host:?}: use 1-64 of [A-Za-z0-9._-], not starting with a dot"),
            ));
        }
        if raw.max_concurrent_uploads == 0 || raw.max_concurrent_uploads > 64 {
            return Err(bad("max_concurrent_uploads", "must be 1..=64"));
        }
        if raw.retry_max_s == 0 || raw.retry_max_s > 3600 {
            return Err(bad("retry_max_s", "must be 1..=3600"));
        }
        if !LEASE_TTL_RANGE_S.contains(&raw.lease_ttl_s) {
            return Err(bad(
                "lease_ttl_s",
                format!(
                    "{}: must be {}..={} seconds",
                    raw.lease_ttl_s,
                    LEASE_TTL_RANGE_S.start(),
                    LEASE_TTL_RANGE_S.end()
                ),
            ));
        }
        if raw.lag_threshold_s == 0 {
            return Err(bad("lag_threshold_s", "must be at least 1"));
        }
        let r = &raw.retention;
        if r.keep_last == Some(0) {
            return Err(bad(
                "retention.keep_last",
                "must be at least 1 (leave it out to keep everything)",
            ));
        }
        if r.keep_within_s == Some(0) {
            return Err(bad(
                "retention.keep_within_s",
                "must be at least 1 (leave it out to keep everything)",
            ));
        }
        if r.gc_grace_s == 0 {
            return Err(bad(
                "retention.gc_grace_s",
                "must be at least 1: a chunk of an upload in progress needs the grace period",
            ));
        }
        let retention = RemoteRetention {
            keep_last: r.keep_last,
            keep_within_s: r.keep_within_s,
            gc_grace_s: r.gc_grace_s,
            gc_interval_s: r.gc_interval_s,
        };
        let credentials = match &raw.credentials_file {
            Some(path) => read_credentials(path)?,
            None => match (env(ENV_ACCESS_KEY), env(ENV_SECRET_KEY)) {
                (Some(a), Some(s)) if !a.is_empty() && !s.is_empty() => Credentials {
                    access_key_id: a,
                    secret_access_key: s,
                },
                _ => {
                    return Err(bad(
                        "credentials_file",
                        format!(
                            "no credentials: give credentials_file (mode 0600) or set {ENV_ACCESS_KEY} and {ENV_SECRET_KEY}"
                        ),
                    ))
                }
            },
        };
        if let Some(t) = &raw.trust_file {
            if !t.is_absolute() {
                return Err(bad("trust_file", "must be an absolute path"));
            }
        }
        let ca_certs = match &raw.ca_file {
            None => Vec::new(),
            Some(p) if !p.is_absolute() => return Err(bad("ca_file", "must be an absolute path")),
            Some(p) => crate::tls::read_ca_file(p).map_err(|e| bad("ca_file", e))?,
        };
        // S3: parts of 5 MiB..5 GiB, a single PUT of at most 5 GiB. Parts are held in memory,
        // so they are capped lower than S3 allows.
        if !(5..=1024).contains(&raw.multipart_part_mib) {
            return Err(bad("multipart_part_mib", "must be 5..=1024"));
        }
        if !(5..=5120).contains(&raw.multipart_threshold_mib) {
            return Err(bad("multipart_threshold_mib", "must be 5..=5120"));
        }
        Ok(OffsiteConfig {
            endpoint,
            bucket: raw.bucket,
            prefix,
            region: raw.region,
            host,
            credentials,
            trust_file: raw.trust_file,
            max_concurrent_uploads: raw.max_concurrent_uploads,
            max_upload_mib_per_s: raw.max_upload_mib_per_s,
            retry_max_s: raw.retry_max_s,
            lease_ttl_s: raw.lease_ttl_s,
            lag_threshold_s: raw.lag_threshold_s,
            retention,
            ca_file: raw.ca_file,
            ca_certs,
            multipart_threshold_mib: raw.multipart_threshold_mib,
            multipart_part_mib: raw.multipart_part_mib,
        })
    }

    /// `prefix/rest`, or `rest` without a prefix.
    pub fn key(&self, rest: &str) -> String {
        if self.prefix.is_empty() {
            rest.to_string()
        } else {
            format!("{}/{rest}", self.prefix)
        }
    }
}

/// Reads the credentials file; refused unless only its owner can read it.
fn read_credentials(path: &Path) -> Result<Credentials, ConfigError> {
    let key = "credentials_file";
    let meta = std::fs::metadata(path).map_err(|e| bad(key, format!("{}: {e}", path.display())))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(bad(
            key,
            format!(
                "{}: mode {mode:04o} lets others read the secret; chmod 600 it",
                path.display()
            ),
        ));
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(key, format!("{}: {e}", path.display())))?;
    let f: CredentialsFile = toml::from_str(&text)
        .map_err(|e| bad(key, format!("{}: {}", path.display(), one_line(&e))))?;
    if f.access_key_id.is_empty() || f.secret_access_key.is_empty() {
        return Err(bad(key, format!("{}: empty key", path.display())));
    }
    Ok(Credentials {
        access_key_id: f.access_key_id,
        secret_access_key: f.secret_access_key,
    })
}

fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::Write;

    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn creds(mode: u32) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "access_key_id = \"AK\"\nsecret_access_key = \"SK\"").unwrap();
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        f
    }

    fn text(creds: &Path) -> String {
        format!(
            "[daemon]\nstate_dir = \"/x\"\n[offsite]\nendpoint = \"http://127.0.0.1:7480/\"\nbucket = \"backstop\"\nhost = \"a\"\ncredentials_file = \"{}\"\n",
            creds.display()
        )
    }

    #[test]
    fn a_private_credentials_file_is_read() {
        let f = creds(0o600);
        let c = OffsiteConfig::from_file_text(&text(f.path()), &no_env)
            .unwrap()
            .unwrap();
        assert_eq!(c.endpoint, "http://127.0.0.1:7480");
        assert_eq!(c.credentials.access_key_id, "AK");
        assert_eq!(c.key("chunks/x"), "chunks/x");
        assert!(!format!("{:?}", c.credentials).contains("SK"));
        // Nothing is deleted remotely unless a rule says so.
        assert_eq!(c.retention, RemoteRetention::default());
        assert_eq!(c.retention.keep_last, None);
        assert_eq!(c.retention.gc_grace_s, 86_400);
        assert_eq!(c.lag_threshold_s, 600);
        let t = format!(
            "{}lag_threshold_s = 30\n[offsite.retention]\nkeep_last = 3\nkeep_within_s = 7200\ngc_grace_s = 5\ngc_interval_s = 0\n",
            text(f.path())
        );
        let c = OffsiteConfig::from_file_text(&t, &no_env).unwrap().unwrap();
        assert_eq!(c.lag_threshold_s, 30);
        assert_eq!(
            c.retention,
            RemoteRetention {
                keep_last: Some(3),
                keep_within_s: Some(7200),
                gc_grace_s: 5,
                gc_interval_s: 0
            }
        );
    }

    #[test]
    fn a_readable_credentials_file_is_refused_in_one_line() {
        let f = creds(0o644);
        let e = OffsiteConfig::from_file_text(&text(f.path()), &no_env).unwrap_err();
        assert_eq!(e.code().as_str(), "ERR_CONFIG_INVALID");
        assert!(e.to_string().contains("mode 0644"), "{e}");
        assert!(!e.to_string().contains('\n'));
    }

    #[test]
    fn credentials_come_from_the_environment_otherwise() {
        let t = "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\n";
        assert!(OffsiteConfig::from_file_text(t, &no_env).is_err());
        let env = |k: &str| Some(format!("v-{k}"));
        let c = OffsiteConfig::from_file_text(t, &env).unwrap().unwrap();
        assert_eq!(c.credentials.access_key_id, format!("v-{ENV_ACCESS_KEY}"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let env = |_: &str| Some("k".to_string());
        for t in [
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nsecret = \"x\"\n",
            "[offsite]\nendpoint = \"ftp://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"B\"\nhost = \"a\"\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a/b\"\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nmax_concurrent_uploads = 0\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nlease_ttl_s = 2\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nlease_ttl_s = 3601\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nlease_ttl_s = \"60s\"\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nmultipart_part_mib = 4\n",
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nmultipart_threshold_mib = 6000\n",
        ] {
            let e = OffsiteConfig::from_file_text(t, &env).unwrap_err();
            assert_eq!(e.code().as_str(), "ERR_CONFIG_INVALID", "{t}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
        let ttl = OffsiteConfig::from_file_text(
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\nlease_ttl_s = 2\n",
            &env,
        )
        .unwrap_err();
        assert_eq!(
            ttl.to_string(),
            "offsite.lease_ttl_s: 2: must be 3..=3600 seconds"
        );
        let c = OffsiteConfig::from_file_text(
            "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\n",
            &env,
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.lease_ttl_s, 60);
        for t in [
            "[offsite.retention]\nkeep_last = 0\n",
            "[offsite.retention]\ngc_grace_s = 0\n",
            "[offsite.retention]\nkeep_forever = true\n",
            "lag_threshold_s = 0\n",
        ] {
            let t = format!(
                "[offsite]\nendpoint = \"http://h:1\"\nbucket = \"bkt\"\nhost = \"a\"\n{t}"
            );
            let e = OffsiteConfig::from_file_text(&t, &env).unwrap_err();
            assert_eq!(e.code().as_str(), "ERR_CONFIG_INVALID", "{t}");
        }
        assert!(OffsiteConfig::from_file_text("[daemon]\n", &env)
            .unwrap()
            .is_none());
    }

    #[test]
    fn https_is_accepted_and_a_bad_ca_file_is_refused_at_load_naming_the_key() {
        let env = |_: &str| Some("k".to_string());
        let base =
            "[offsite]\nendpoint = \"https://rgw.example:443\"\nbucket = \"bkt\"\nhost = \"a\"\n";
        let c = OffsiteConfig::from_file_text(base, &env).unwrap().unwrap();
        assert!(c.ca_certs.is_empty());
        assert_eq!(c.multipart_threshold_mib, 64);
        assert_eq!(c.multipart_part_mib, 16);
        let mut notpem = tempfile::NamedTempFile::new().unwrap();
        writeln!(notpem, "hello").unwrap();
        for (ca, why) in [
            ("/nonexistent/ca.pem".to_string(), "No such file"),
            (notpem.path().display().to_string(), "no PEM certificate"),
            ("ca.pem".to_string(), "absolute"),
        ] {
            let t = format!("{base}ca_file = \"{ca}\"\n");
            let e = OffsiteConfig::from_file_text(&t, &env).unwrap_err();
            assert_eq!(e.code().as_str(), "ERR_CONFIG_INVALID");
            let line = e.to_string();
            assert!(line.starts_with("offsite.ca_file: "), "{line}");
            assert!(line.contains(why), "{line}");
            assert!(!line.contains('\n'), "{line}");
        }
    }
}
