//! A small S3 client: path-style requests signed with AWS Signature Version 4 (on the
//! workspace's hmac/sha2), sent with `ureq`. Only what replication needs: HEAD, GET and PUT of
//! objects, HEAD and PUT of the bucket; multipart upload of large objects (`multipart.rs`).
//! http or https (`crate::tls`).

use std::io::Read;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use backstop_common::ErrorCode;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use time::format_description::well_known::{Rfc2822, Rfc3339};
use time::OffsetDateTime;

use crate::config::OffsiteConfig;

mod multipart;

type HmacSha256 = Hmac<Sha256>;

/// What went wrong talking to the store.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    #[error("{method} {key}: {source}")]
    Transport {
        method: &'static str,
        key: String,
        source: Box<ureq::Error>,
    },
    #[error("{method} {key}: HTTP {status}: {body}")]
    Status {
        method: &'static str,
        key: String,
        status: u16,
        body: String,
    },
    #[error("GET {key}: larger than {limit} bytes")]
    TooLarge { key: String, limit: u64 },
    #[error("{key}: reading the local file: {source}")]
    Local { key: String, source: std::io::Error },
    /// The TLS handshake failed: the gateway's certificate is not trusted or not for its name.
    #[error("{method} {key}: TLS: {reason} (offsite.ca_file must hold the CA that signed the gateway's certificate, and the certificate must name the endpoint's host)")]
    Tls {
        method: &'static str,
        key: String,
        reason: String,
    },
    /// A multipart upload's bytes did not hash to the digest the object is named by.
    #[error("{key}: the uploaded bytes do not match sha256 {expected}; the upload was aborted")]
    Digest { key: String, expected: String },
}

impl S3Error {
    /// A 404 (the object is not there).
    pub fn is_not_found(&self) -> bool {
        matches!(self, S3Error::Status { status: 404, .. })
    }

    /// The spec-style code: a 403 is `ERR_OFFSITE_DENIED` (wrong keys, no permission) unless
    /// the gateway says the quota is full (RGW answers 403 `QuotaExceeded`), which is
    /// `ERR_OFFSITE_QUOTA_EXCEEDED` like a 507; everything else `ERR_OFFSITE_UNREACHABLE`.
    pub fn code(&self) -> ErrorCode {
        match self {
            S3Error::Status { status: 507, .. } => ErrorCode::OffsiteQuotaExceeded,
            S3Error::Status {
                status: 403, body, ..
            } if body == "QuotaExceeded" => ErrorCode::OffsiteQuotaExceeded,
            S3Error::Status { status: 403, .. } => ErrorCode::OffsiteDenied,
            S3Error::Local { .. } => ErrorCode::StoreIo,
            _ => ErrorCode::OffsiteUnreachable,
        }
    }
    /// A 412: a conditional PUT's precondition (`If-None-Match: *`, `If-Match`) did not hold.
    pub fn is_precondition_failed(&self) -> bool {
        matches!(self, S3Error::Status { status: 412, .. })
    }
}

/// The precondition of a compare-and-swap PUT. Measured on Ceph 16.2.15's RGW: `If-None-Match:
/// *` is refused (412) when the object exists; `If-Match` is honoured only with the ETag
/// *unquoted* (a quoted one always fails) and fails when the object is absent. `DELETE` ignores
/// `If-Match`, so a delete is read-check-delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutCondition {
    /// Only if no object has the key.
    Absent,
    /// Only if the object's ETag is this one (unquoted).
    ETag(String),
}

/// Caps the upload rate across every thread of the uploader (a token bucket refilled at
/// `bytes_per_s`; 0 = no cap).
pub struct Throttle {
    bytes_per_s: u64,
    state: Mutex<(Instant, f64)>,
}

impl Throttle {
    pub fn new(bytes_per_s: u64) -> Throttle {
        Throttle {
            bytes_per_s,
            state: Mutex::new((Instant::now(), 0.0)),
        }
    }

    /// Waits until `n` more bytes may be sent.
    pub fn take(&self, n: u64) {
        if self.bytes_per_s == 0 {
            return;
        }
        let wait = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let rate = self.bytes_per_s as f64;
            // Tokens accrue up to one second's worth; a debt is paid by sleeping.
            let elapsed = now.duration_since(s.0).as_secs_f64();
            s.1 = (s.1 + elapsed * rate).min(rate) - n as f64;
            s.0 = now;
            if s.1 < 0.0 {
                Duration::from_secs_f64(-s.1 / rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

/// Reads through the throttle, 64 KiB at a time.
struct Throttled<'a, R> {
    inner: R,
    throttle: &'a Throttle,
}

impl<R: Read> Read for Throttled<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let len = buf.len().min(64 * 1024);
        let n = self.inner.read(&mut buf[..len])?;
        self.throttle.take(n as u64);
        Ok(n)
    }
}

pub struct Client {
    agent: ureq::Agent,
    endpoint: String,
    host: String,
    bucket: String,
    region: String,
    access_key: String,
    secret_key: String,
    pub throttle: Throttle,
}

const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

impl Client {
    pub fn new(cfg: &OffsiteConfig, timeout: Duration) -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .tls_config(crate::tls::tls_config(&cfg.ca_certs))
            .build()
            .into();
        let host = cfg
            .endpoint
            .split_once("://")
            .map(|(_, h)| h)
            .unwrap_or(&cfg.endpoint)
            .to_string();
        Client {
            agent,
            endpoint: cfg.endpoint.clone(),
            host,
            bucket: cfg.bucket.clone(),
            region: cfg.region.clone(),
            access_key: cfg.credentials.access_key_id.clone(),
            secret_key: cfg.credentials.secret_access_key.clone(),
            throttle: Throttle::new(u64::from(cfg.max_upload_mib_per_s) * 1024 * 1024),
        }
    }

    fn path(&self, key: &str) -> String {
        if key.is_empty() {
            format!("/{}", self.bucket)
        } else {
            format!("/{}/{}", self.bucket, uri_encode(key))
        }
    }

    /// The SigV4 headers for one request (`payload_sha256`: hex digest of the body; `query`: the
    /// canonical query string, parameters sorted and encoded; `extra`: more `x-amz-*` headers,
    /// lower-case, signed with the rest).
    fn sign(
        &self,
        method: &str,
        path: &str,
        query: &str,
        payload_sha256: &str,
        extra: &[(&str, &str)],
    ) -> Vec<(String, String)> {
        let now = time::OffsetDateTime::now_utc();
        let date = format!(
            "{:04}{:02}{:02}",
            now.year(),
            u8::from(now.month()),
            now.day()
        );
        let amz_date = format!(
            "{date}T{:02}{:02}{:02}Z",
            now.hour(),
            now.minute(),
            now.second()
        );
        let mut headers: Vec<(String, String)> = vec![
            ("host".into(), self.host.clone()),
            ("x-amz-content-sha256".into(), payload_sha256.into()),
            ("x-amz-date".into(), amz_date.clone()),
        ];
        headers.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        headers.sort();
        let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
        let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
        let signed = signed.join(";");
        let canonical =
            format!("{method}\n{path}\n{query}\n{canonical_headers}\n{signed}\n{payload_sha256}");
        let scope = format!("{date}/{}/s3/aws4_request", self.region);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let mut k = hmac(
            format!("AWS4{}", self.secret_key).as_bytes(),
            date.as_bytes(),
        );
        for part in [self.region.as_bytes(), b"s3", b"aws4_request"] {
            k = hmac(&k, part);
        }
        let signature = hex::encode(hmac(&k, to_sign.as_bytes()));
        let mut out: Vec<(String, String)> =
            headers.into_iter().filter(|(k, _)| k != "host").collect();
        out.push((
            "authorization".into(),
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
                self.access_key
            ),
        ));
        out
    }

    /// `req` with the signature's headers (see [`sign`](Self::sign)) set on it.
    fn signed<B>(
        &self,
        mut req: ureq::RequestBuilder<B>,
        method: &str,
        path: &str,
        query: &str,
        payload_sha256: &str,
        extra: &[(&str, &str)],
    ) -> ureq::RequestBuilder<B> {
        for (k, v) in self.sign(method, path, query, payload_sha256, extra) {
            req = req.header(k, v);
        }
        req
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.endpoint)
    }

    /// The object's length, or `None` if it is not there.
    pub fn head(&self, key: &str) -> Result<Option<u64>, S3Error> {
        let path = self.path(key);
        let mut req = self.agent.head(self.url(&path));
        req = self.signed(req, "HEAD", &path, "", EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("HEAD", key, e))?;
        match resp.status().as_u16() {
            200 => Ok(resp
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())),
            404 => Ok(None),
            status => Err(head_error(key, status)),
        }
    }

    /// The object's bytes (at most `limit`).
    pub fn get(&self, key: &str, limit: u64) -> Result<Vec<u8>, S3Error> {
        let mut out = Vec::new();
        self.get_to(key, limit, &mut out)?;
        Ok(out)
    }

    /// Streams the object into `out`, at most `limit` bytes; returns the length.
    pub fn get_to(
        &self,
        key: &str,
        limit: u64,
        out: &mut dyn std::io::Write,
    ) -> Result<u64, S3Error> {
        let path = self.path(key);
        let mut req = self.agent.get(self.url(&path));
        req = self.signed(req, "GET", &path, "", EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("GET", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 200 {
            return Err(status_error("GET", key, status, &mut body));
        }
        let n = std::io::copy(&mut body.as_reader().take(limit + 1), out)
            .map_err(|e| transport("GET", key, ureq::Error::Io(e)))?;
        if n > limit {
            return Err(S3Error::TooLarge {
                key: key.into(),
                limit,
            });
        }
        Ok(n)
    }

    /// PUTs `body` (its sha256 is sent and checked by the gateway).
    pub fn put(&self, key: &str, body: &[u8]) -> Result<(), S3Error> {
        let sha = hex::encode(Sha256::digest(body));
        self.put_reader(key, &mut &body[..], body.len() as u64, &sha)
    }

    /// PUTs `len` bytes from `reader` whose sha256 is `sha256_hex` (the gateway refuses the
    /// object if the bytes do not match it), through the throttle.
    pub fn put_reader(
        &self,
        key: &str,
        reader: &mut dyn Read,
        len: u64,
        sha256_hex: &str,
    ) -> Result<(), S3Error> {
        self.put_stream(key, reader, len, sha256_hex, false)
            .map(|_| ())
    }

    /// [`Client::put_reader`] only if no object has the key (`If-None-Match: *`, which RGW 16
    /// honours): `Ok(false)` if one has (the bytes went over the wire for nothing, but in one
    /// round trip instead of a HEAD and a PUT — the uploader uses it for objects that are most
    /// likely new).
    pub fn put_reader_if_absent(
        &self,
        key: &str,
        reader: &mut dyn Read,
        len: u64,
        sha256_hex: &str,
    ) -> Result<bool, S3Error> {
        self.put_stream(key, reader, len, sha256_hex, true)
    }

    fn put_stream(
        &self,
        key: &str,
        reader: &mut dyn Read,
        len: u64,
        sha256_hex: &str,
        if_absent: bool,
    ) -> Result<bool, S3Error> {
        let path = self.path(key);
        let mut req = self
            .agent
            .put(self.url(&path))
            .header("content-length", len.to_string());
        if if_absent {
            req = req.header("if-none-match", "*");
        }
        req = self.signed(req, "PUT", &path, "", sha256_hex, &[]);
        let mut body = Throttled {
            inner: reader.take(len),
            throttle: &self.throttle,
        };
        let resp = req
            .send(ureq::SendBody::from_reader(&mut body))
            .map_err(|e| transport("PUT", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        match status {
            200 => Ok(true),
            412 if if_absent => Ok(false),
            _ => Err(status_error("PUT", key, status, &mut body)),
        }
    }

    /// The object's bytes (at most `limit`) and its ETag (unquoted), or `None` if it is not
    /// there.
    pub fn get_with_etag(
        &self,
        key: &str,
        limit: u64,
    ) -> Result<Option<(Vec<u8>, String)>, S3Error> {
        let path = self.path(key);
        let mut req = self.agent.get(self.url(&path));
        req = self.signed(req, "GET", &path, "", EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("GET", key, e))?;
        let status = resp.status().as_u16();
        let etag = etag_of(resp.headers());
        let mut body = resp.into_body();
        match status {
            200 => {}
            404 => return Ok(None),
            _ => return Err(status_error("GET", key, status, &mut body)),
        }
        let mut out = Vec::new();
        let n = std::io::copy(&mut body.as_reader().take(limit + 1), &mut out)
            .map_err(|e| transport("GET", key, ureq::Error::Io(e)))?;
        if n > limit {
            return Err(S3Error::TooLarge {
                key: key.into(),
                limit,
            });
        }
        Ok(Some((out, etag)))
    }

    /// PUTs `body` only if `condition` holds (a 412 otherwise: [`S3Error::is_precondition_failed`]);
    /// returns the new object's ETag (unquoted).
    pub fn put_if(
        &self,
        key: &str,
        body: &[u8],
        condition: &PutCondition,
    ) -> Result<String, S3Error> {
        let path = self.path(key);
        let sha = hex::encode(Sha256::digest(body));
        let mut req = self
            .agent
            .put(self.url(&path))
            .header("content-length", body.len().to_string());
        req = match condition {
            PutCondition::Absent => req.header("if-none-match", "*"),
            PutCondition::ETag(e) => req.header("if-match", e.trim_matches('"')),
        };
        req = self.signed(req, "PUT", &path, "", &sha, &[]);
        let resp = req.send(body).map_err(|e| transport("PUT", key, e))?;
        let status = resp.status().as_u16();
        let etag = etag_of(resp.headers());
        let mut rbody = resp.into_body();
        if status != 200 {
            return Err(status_error("PUT", key, status, &mut rbody));
        }
        Ok(etag)
    }

    /// Creates the bucket unless it exists.
    pub fn ensure_bucket(&self) -> Result<(), S3Error> {
        if self.head("")?.is_some() {
            return Ok(());
        }
        let path = self.path("");
        let mut req = self.agent.put(self.url(&path));
        req = self.signed(req, "PUT", &path, "", EMPTY_SHA256, &[]);
        let resp = req
            .send_empty()
            .map_err(|e| transport("PUT", "(bucket)", e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        // 409 BucketAlreadyOwnedByYou: another thread or host made it first.
        if status != 200 && status != 409 {
            return Err(status_error("PUT", "(bucket)", status, &mut body));
        }
        Ok(())
    }
    /// The object's length and `Last-Modified`, or `None` if it is not there.
    pub fn head_meta(&self, key: &str) -> Result<Option<(u64, OffsetDateTime)>, S3Error> {
        let path = self.path(key);
        let mut req = self.agent.head(self.url(&path));
        req = self.signed(req, "HEAD", &path, "", EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("HEAD", key, e))?;
        match resp.status().as_u16() {
            200 => {
                let h = |name: &str| {
                    resp.headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                let len = h("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let modified = h("last-modified")
                    .and_then(|v| OffsetDateTime::parse(&v, &Rfc2822).ok())
                    .ok_or_else(|| S3Error::Status {
                        method: "HEAD",
                        key: key.into(),
                        status: 200,
                        body: "no readable Last-Modified".into(),
                    })?;
                Ok(Some((len, modified)))
            }
            404 => Ok(None),
            status => Err(head_error(key, status)),
        }
    }

    /// Every object whose key starts with `prefix` (ListObjectsV2, 1000 a page, every page).
    pub fn list(&self, prefix: &str) -> Result<Vec<ListedObject>, S3Error> {
        let path = self.path("");
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            // Sorted by name, as SigV4's canonical query wants.
            let mut params = vec![("list-type", "2".to_string()), ("prefix", prefix.into())];
            if let Some(t) = &token {
                params.push(("continuation-token", t.clone()));
            }
            params.sort();
            let query = params
                .iter()
                .map(|(k, v)| format!("{k}={}", query_encode(v)))
                .collect::<Vec<_>>()
                .join("&");
            let mut req = self.agent.get(format!("{}?{query}", self.url(&path)));
            req = self.signed(req, "GET", &path, &query, EMPTY_SHA256, &[]);
            let key = format!("(list {prefix})");
            let resp = req.call().map_err(|e| transport("GET", &key, e))?;
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            if status != 200 {
                return Err(status_error("GET", &key, status, &mut body));
            }
            let mut text = String::new();
            body.as_reader()
                .take(16 * 1024 * 1024)
                .read_to_string(&mut text)
                .map_err(|e| transport("GET", &key, ureq::Error::Io(e)))?;
            let page = parse_list_page(&text).ok_or_else(|| S3Error::Status {
                method: "GET",
                key: key.clone(),
                status,
                body: "unreadable ListObjectsV2 answer".into(),
            })?;
            out.extend(page.objects);
            match page.next {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
    }

    /// Deletes the object (one that is not there is not an error).
    pub fn delete(&self, key: &str) -> Result<(), S3Error> {
        let path = self.path(key);
        let mut req = self.agent.delete(self.url(&path));
        req = self.signed(req, "DELETE", &path, "", EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("DELETE", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 204 && status != 200 && status != 404 {
            return Err(status_error("DELETE", key, status, &mut body));
        }
        Ok(())
    }

    /// Renews the object's `Last-Modified` without sending its bytes (a server-side copy onto
    /// itself): a chunk an upload found already there is then as young as a sent one, and the
    /// remote GC's grace period protects it the same way.
    pub fn touch(&self, key: &str) -> Result<(), S3Error> {
        let path = self.path(key);
        let source = path.clone();
        let extra = [
            ("x-amz-copy-source", source.as_str()),
            ("x-amz-metadata-directive", "REPLACE"),
        ];
        let mut req = self.agent.put(self.url(&path));
        req = self.signed(req, "PUT", &path, "", EMPTY_SHA256, &extra);
        let resp = req.send_empty().map_err(|e| transport("PUT", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 200 {
            return Err(status_error("PUT", key, status, &mut body));
        }
        // A copy can fail after its 200: the error is then in the body.
        let mut text = String::new();
        let _ = body.as_reader().take(4096).read_to_string(&mut text);
        if text.contains("<Error>") {
            return Err(S3Error::Status {
                method: "PUT",
                key: key.into(),
                status,
                body: xml_field(&text, "Code").unwrap_or_default(),
            });
        }
        Ok(())
    }
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedObject {
    pub key: String,
    pub size: u64,
    pub last_modified: OffsetDateTime,
}

struct ListPage {
    objects: Vec<ListedObject>,
    /// The continuation token when the listing is truncated.
    next: Option<String>,
}

/// The text of the first `<name>…</name>` in `xml`, entities decoded.
fn xml_field(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let (_, rest) = xml.split_once(&open)?;
    let (v, _) = rest.split_once(&close)?;
    Some(
        v.replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&"),
    )
}

/// One ListObjectsV2 answer; `None` if it does not read as one.
fn parse_list_page(xml: &str) -> Option<ListPage> {
    let mut objects = Vec::new();
    for part in xml.split("<Contents>").skip(1) {
        let (c, _) = part.split_once("</Contents>")?;
        objects.push(ListedObject {
            key: xml_field(c, "Key")?,
            size: xml_field(c, "Size")?.parse().ok()?,
            last_modified: OffsetDateTime::parse(&xml_field(c, "LastModified")?, &Rfc3339).ok()?,
        });
    }
    let truncated = xml_field(xml, "IsTruncated").as_deref() == Some("true");
    let next = if truncated {
        Some(xml_field(xml, "NextContinuationToken")?)
    } else {
        None
    };
    Some(ListPage { objects, next })
}

/// A query-string value as SigV4 wants it: every byte but the unreserved ones encoded (`/`
/// too).
fn query_encode(v: &str) -> String {
    uri_encode(v).replace('/', "%2F")
}

fn etag_of(headers: &ureq::http::HeaderMap) -> String {
    headers
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_default()
}

fn transport(method: &'static str, key: &str, e: ureq::Error) -> S3Error {
    if let Some(reason) = crate::tls::tls_reason(&e) {
        return S3Error::Tls {
            method,
            key: key.into(),
            reason,
        };
    }
    S3Error::Transport {
        method,
        key: key.into(),
        source: Box::new(e),
    }
}

fn status_error(method: &'static str, key: &str, status: u16, body: &mut ureq::Body) -> S3Error {
    let mut text = String::new();
    let _ = body.as_reader().take(512).read_to_string(&mut text);
    // The S3 error code is enough: <Code>NoSuchKey</Code>.
    let code = text
        .split_once("<Code>")
        .and_then(|(_, r)| r.split_once("</Code>"))
        .map(|(c, _)| c.to_string())
        .unwrap_or_default();
    S3Error::Status {
        method,
        key: key.into(),
        status,
        body: code,
    }
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC takes keys of any length.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// SigV4's URI encoding of an object key: every byte but the unreserved ones and `/`.
pub fn uri_encode(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A HEAD's unexpected status (a HEAD has no body to quote).
fn head_error(key: &str, status: u16) -> S3Error {
    S3Error::Status {
        method: "HEAD",
        key: if key.is_empty() {
            "(bucket)".into()
        } else {
            key.into()
        },
        status,
        body: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_as_sigv4_wants() {
        assert_eq!(uri_encode("p/chunks/ab12"), "p/chunks/ab12");
        assert_eq!(uri_encode("a b+c"), "a%20b%2Bc");
    }

    #[test]
    fn the_signing_key_chain_matches_aws_example() {
        // AWS's documented example: secret wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY, 20120215,
        // us-east-1, iam → f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d
        let mut k = hmac(b"AWS4wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", b"20120215");
        for part in [&b"us-east-1"[..], b"iam", b"aws4_request"] {
            k = hmac(&k, part);
        }
        assert_eq!(
            hex::encode(k),
            "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d"
        );
    }

    #[test]
    fn a_list_page_reads_keys_sizes_times_and_the_continuation() {
        let xml = r#"<?xml version="1.0"?><ListBucketResult><Name>b</Name><IsTruncated>true</IsTruncated><Contents><Key>p/chunks/a&amp;b</Key><LastModified>2026-11-25T06:38:34.123Z</LastModified><Size>5</Size></Contents><Contents><Key>p/layers/c</Key><LastModified>2026-11-25T06:38:35.000Z</LastModified><Size>7</Size></Contents><NextContinuationToken>tok/1+</NextContinuationToken></ListBucketResult>"#;
        let page = parse_list_page(xml).unwrap();
        assert_eq!(page.objects.len(), 2);
        assert_eq!(page.objects[0].key, "p/chunks/a&b");
        assert_eq!(page.objects[1].size, 7);
        assert_eq!(
            page.objects[0].last_modified.unix_timestamp(),
            1_795_588_714
        );
        assert_eq!(page.next.as_deref(), Some("tok/1+"));
        assert_eq!(query_encode("tok/1+"), "tok%2F1%2B");
        let last = parse_list_page(
            "<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>",
        )
        .unwrap();
        assert!(last.objects.is_empty() && last.next.is_none());
        // Truncated without a token, or an entry without a size: not a listing.
        assert!(parse_list_page("<IsTruncated>true</IsTruncated>").is_none());
        assert!(parse_list_page("<Contents><Key>k</Key></Contents>").is_none());
    }

    #[test]
    fn status_codes_map_to_the_offsite_codes() {
        let st = |status: u16, body: &str| S3Error::Status {
            method: "PUT",
            key: "k".into(),
            status,
            body: body.into(),
        };
        assert_eq!(
            st(403, "SignatureDoesNotMatch").code(),
            ErrorCode::OffsiteDenied
        );
        assert_eq!(
            st(403, "QuotaExceeded").code(),
            ErrorCode::OffsiteQuotaExceeded
        );
        assert_eq!(st(507, "").code(), ErrorCode::OffsiteQuotaExceeded);
        assert_eq!(st(500, "").code(), ErrorCode::OffsiteUnreachable);
        assert_eq!(st(404, "").code(), ErrorCode::OffsiteUnreachable);
    }

    #[test]
    fn the_throttle_paces_a_burst() {
        let t = Throttle::new(1024 * 1024);
        let start = Instant::now();
        t.take(1024 * 1024); // the first second's worth is a debt of ~1 s
        t.take(256 * 1024);
        assert!(start.elapsed() >= Duration::from_millis(200));
        Throttle::new(0).take(u64::MAX);
    }
}
