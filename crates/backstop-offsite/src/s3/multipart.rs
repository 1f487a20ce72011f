//! S3 multipart upload, for objects above `[offsite] multipart_threshold_mib` (disk layers:
//! a single PUT is capped at 5 GiB by S3, and a failed one starts again from its first byte).
//!
//! CreateMultipartUpload, then UploadPart for each part (read into memory, its sha256 sent in
//! `x-amz-content-sha256` and signed, so the gateway refuses a part whose bytes do not match;
//! a part that fails is sent again up to `PART_ATTEMPTS` times; `PARTS_IN_FLIGHT` parts are
//! sent at once), then CompleteMultipartUpload.
//! Any failure aborts the upload (AbortMultipartUpload), so no orphan parts stay in the bucket.
//!
//! Integrity of the whole object: neither RGW nor S3 checks a whole-object sha256 for a
//! multipart upload (its ETag is a digest of the parts' digests). Two things cover it: the
//! bytes are hashed here as they are read and the upload is aborted, not completed, if they do
//! not hash to the digest the object is named by; and a pull checks every layer it fetches
//! against the digest in the ed25519-signed manifest before anything is published.

use std::io::Read;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{status_error, transport, uri_encode, Client, S3Error, Throttled, EMPTY_SHA256};

/// S3 allows at most 10 000 parts in one upload.
const MAX_PARTS: u64 = 10_000;
/// Attempts of one part before the upload is aborted.
const PART_ATTEMPTS: u32 = 3;
/// Parts of one object sent at once (each held in memory while it is sent).
const PARTS_IN_FLIGHT: u64 = 2;

/// An upload in progress, as ListMultipartUploads shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingUpload {
    pub key: String,
    pub upload_id: String,
}

/// SigV4's encoding of a query value (`/` encoded too, unlike in a path).
fn query_encode(v: &str) -> String {
    uri_encode(v).replace('/', "%2F")
}

/// The part size for an object of `len` bytes: `part_bytes`, grown (to whole MiB) if the
/// object would otherwise need more than 10 000 parts.
pub fn part_size(len: u64, part_bytes: u64) -> u64 {
    let mib = 1024 * 1024;
    let min = len.div_ceil(MAX_PARTS).div_ceil(mib) * mib;
    part_bytes.max(min)
}

/// `<Tag>value</Tag>` of a small XML reply (S3 replies are flat enough for this).
fn xml_values<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some((_, after)) = rest.split_once(open.as_str()) {
        let Some((value, tail)) = after.split_once(close.as_str()) else {
            break;
        };
        out.push(value);
        rest = tail;
    }
    out
}

fn xml_unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Reads until `buf` is full or the reader ends; the number of bytes read.
fn read_full(reader: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match reader.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Client {
    /// Uploads `len` bytes from `reader` as `key` in parts of about `part_bytes`; the bytes
    /// must hash to `sha256_hex` or the upload is aborted. On any error the upload is aborted.
    /// Returns the number of parts.
    pub fn put_multipart(
        &self,
        key: &str,
        reader: &mut (dyn Read + Send),
        len: u64,
        sha256_hex: &str,
        part_bytes: u64,
    ) -> Result<u32, S3Error> {
        let upload_id = self.create_multipart(key)?;
        match self.send_parts(key, &upload_id, reader, len, sha256_hex, part_bytes) {
            Ok(parts) => match self.complete_multipart(key, &upload_id, &parts) {
                Ok(()) => Ok(parts.len() as u32),
                Err(e) => {
                    self.abort_quietly(key, &upload_id);
                    Err(e)
                }
            },
            Err(e) => {
                self.abort_quietly(key, &upload_id);
                Err(e)
            }
        }
    }

    fn abort_quietly(&self, key: &str, upload_id: &str) {
        if let Err(e) = self.abort_multipart(key, upload_id) {
            // The bucket keeps the parts until a lifecycle rule or a later abort removes them.
            tracing::warn!(key, upload_id, error = %e, "multipart upload not aborted");
        }
    }

    /// Every part; their (number, ETag) in order. `PARTS_IN_FLIGHT` threads each take the
    /// next part from the reader (in turn, under a lock: the reader and the whole-object hash
    /// see the bytes in order) and send it.
    fn send_parts(
        &self,
        key: &str,
        upload_id: &str,
        reader: &mut (dyn Read + Send),
        len: u64,
        sha256_hex: &str,
        part_bytes: u64,
    ) -> Result<Vec<(u32, String)>, S3Error> {
        struct Next<'r> {
            reader: &'r mut (dyn Read + Send),
            whole: Sha256,
            /// Bytes read so far.
            read: u64,
            number: u32,
            stop: bool,
        }
        let part_bytes = part_size(len, part_bytes);
        let count = len.div_ceil(part_bytes).max(1);
        let next = Mutex::new(Next {
            reader,
            whole: Sha256::new(),
            read: 0,
            number: 0,
            stop: false,
        });
        let parts = Mutex::new(Vec::new());
        let failed: Mutex<Option<S3Error>> = Mutex::new(None);
        let fail = |e: S3Error| {
            lock(&next).stop = true;
            lock(&failed).get_or_insert(e);
        };
        std::thread::scope(|s| {
            for _ in 0..count.min(PARTS_IN_FLIGHT) {
                s.spawn(|| {
                    let size = usize::try_from(part_bytes.min(len.max(1))).unwrap_or(usize::MAX);
                    let mut buf = vec![0u8; size];
                    loop {
                        let (number, n) = {
                            let mut g = lock(&next);
                            if g.stop || (g.read >= len && g.number > 0) {
                                return;
                            }
                            let want = usize::try_from((len - g.read).min(part_bytes))
                                .unwrap_or(buf.len());
                            let n = match read_full(g.reader, &mut buf[..want]) {
                                Ok(n) if n == want => n,
                                Ok(n) => {
                                    let at = g.read + n as u64;
                                    drop(g);
                                    return fail(S3Error::Local {
                                        key: key.into(),
                                        source: std::io::Error::new(
                                            std::io::ErrorKind::UnexpectedEof,
                                            format!("ended at byte {at} of {len}"),
                                        ),
                                    });
                                }
                                Err(source) => {
                                    drop(g);
                                    return fail(S3Error::Local {
                                        key: key.into(),
                                        source,
                                    });
                                }
                            };
                            g.whole.update(&buf[..n]);
                            g.read += n as u64;
                            g.number += 1;
                            (g.number, n)
                        };
                        match self.upload_part_retrying(key, upload_id, number, &buf[..n]) {
                            Ok(etag) => lock(&parts).push((number, etag)),
                            Err(e) => return fail(e),
                        }
                    }
                });
            }
        });
        if let Some(e) = lock(&failed).take() {
            return Err(e);
        }
        let whole = next.into_inner().unwrap_or_else(|p| p.into_inner()).whole;
        if hex::encode(whole.finalize()) != sha256_hex {
            return Err(S3Error::Digest {
                key: key.into(),
                expected: sha256_hex.into(),
            });
        }
        let mut parts = parts.into_inner().unwrap_or_else(|p| p.into_inner());
        parts.sort();
        Ok(parts)
    }

    fn upload_part_retrying(
        &self,
        key: &str,
        upload_id: &str,
        number: u32,
        body: &[u8],
    ) -> Result<String, S3Error> {
        let sha = hex::encode(Sha256::digest(body));
        let mut attempt = 1;
        loop {
            match self.upload_part(key, upload_id, number, body, &sha) {
                Ok(etag) => return Ok(etag),
                // A 4xx other than a throttle will not get better by sending again.
                Err(e) if is_permanent(&e) => return Err(e),
                Err(e) if attempt >= PART_ATTEMPTS => return Err(e),
                Err(e) => {
                    tracing::warn!(key, part = number, attempt, error = %e, "part upload failed; sending it again");
                    std::thread::sleep(Duration::from_millis(500 << attempt));
                    attempt += 1;
                }
            }
        }
    }

    /// CreateMultipartUpload: the upload id.
    pub fn create_multipart(&self, key: &str) -> Result<String, S3Error> {
        let path = self.path(key);
        let mut req = self.agent.post(format!("{}?uploads", self.url(&path)));
        req = self.signed(req, "POST", &path, "uploads=", EMPTY_SHA256, &[]);
        let resp = req.send_empty().map_err(|e| transport("POST", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 200 {
            return Err(status_error("POST", key, status, &mut body));
        }
        let text = read_text(&mut body, key)?;
        xml_values(&text, "UploadId")
            .first()
            .map(|v| xml_unescape(v))
            .filter(|v| !v.is_empty())
            .ok_or_else(|| S3Error::Status {
                method: "POST",
                key: key.into(),
                status,
                body: "no UploadId in the reply".into(),
            })
    }

    /// UploadPart: the part's ETag.
    pub fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        number: u32,
        body: &[u8],
        sha256_hex: &str,
    ) -> Result<String, S3Error> {
        let path = self.path(key);
        let query = format!("partNumber={number}&uploadId={}", query_encode(upload_id));
        let mut req = self
            .agent
            .put(format!("{}?{query}", self.url(&path)))
            .header("content-length", body.len().to_string());
        req = self.signed(req, "PUT", &path, &query, sha256_hex, &[]);
        let mut reader = Throttled {
            inner: body,
            throttle: &self.throttle,
        };
        let resp = req
            .send(ureq::SendBody::from_reader(&mut reader))
            .map_err(|e| transport("PUT", key, e))?;
        let status = resp.status().as_u16();
        let etag = resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut rbody = resp.into_body();
        if status != 200 {
            return Err(status_error("PUT", key, status, &mut rbody));
        }
        etag.ok_or_else(|| S3Error::Status {
            method: "PUT",
            key: key.into(),
            status,
            body: format!("no ETag for part {number}"),
        })
    }

    /// CompleteMultipartUpload with the parts' (number, ETag) in order.
    pub fn complete_multipart(
        &self,
        key: &str,
        upload_id: &str,
        parts: &[(u32, String)],
    ) -> Result<(), S3Error> {
        let path = self.path(key);
        let query = format!("uploadId={}", query_encode(upload_id));
        let mut xml = String::from("<CompleteMultipartUpload>");
        for (n, etag) in parts {
            xml.push_str(&format!(
                "<Part><PartNumber>{n}</PartNumber><ETag>{}</ETag></Part>",
                xml_escape(etag)
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let sha = hex::encode(Sha256::digest(xml.as_bytes()));
        let mut req = self.agent.post(format!("{}?{query}", self.url(&path)));
        req = self.signed(req, "POST", &path, &query, &sha, &[]);
        let resp = req
            .send(xml.as_bytes())
            .map_err(|e| transport("POST", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 200 {
            return Err(status_error("POST", key, status, &mut body));
        }
        // S3 may answer 200 and still fail: the error is then in the body.
        let text = read_text(&mut body, key)?;
        if text.contains("<Error>") {
            let code = xml_values(&text, "Code").first().copied().unwrap_or("");
            return Err(S3Error::Status {
                method: "POST",
                key: key.into(),
                status,
                body: code.to_string(),
            });
        }
        Ok(())
    }

    /// AbortMultipartUpload: the parts are deleted (404 NoSuchUpload counts as done).
    pub fn abort_multipart(&self, key: &str, upload_id: &str) -> Result<(), S3Error> {
        let path = self.path(key);
        let query = format!("uploadId={}", query_encode(upload_id));
        let mut req = self.agent.delete(format!("{}?{query}", self.url(&path)));
        req = self.signed(req, "DELETE", &path, &query, EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("DELETE", key, e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if !matches!(status, 200 | 204 | 404) {
            return Err(status_error("DELETE", key, status, &mut body));
        }
        Ok(())
    }

    /// ListMultipartUploads under `prefix` (the first 1000: enough to check and clean up).
    pub fn list_multipart_uploads(&self, prefix: &str) -> Result<Vec<PendingUpload>, S3Error> {
        let path = self.path("");
        let query = format!("prefix={}&uploads=", query_encode(prefix));
        let mut req = self.agent.get(format!(
            "{}?prefix={}&uploads",
            self.url(&path),
            query_encode(prefix)
        ));
        req = self.signed(req, "GET", &path, &query, EMPTY_SHA256, &[]);
        let resp = req.call().map_err(|e| transport("GET", "(uploads)", e))?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status != 200 {
            return Err(status_error("GET", "(uploads)", status, &mut body));
        }
        let text = read_text(&mut body, "(uploads)")?;
        Ok(xml_values(&text, "Upload")
            .into_iter()
            .filter_map(|u| {
                Some(PendingUpload {
                    key: xml_unescape(xml_values(u, "Key").first()?),
                    upload_id: xml_unescape(xml_values(u, "UploadId").first()?),
                })
            })
            .collect())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn is_permanent(e: &S3Error) -> bool {
    match e {
        S3Error::Status { status, .. } => (400..500).contains(status) && *status != 429,
        S3Error::Tls { .. } | S3Error::Local { .. } | S3Error::Digest { .. } => true,
        _ => false,
    }
}

/// A small XML reply (at most 4 MiB).
fn read_text(body: &mut ureq::Body, key: &str) -> Result<String, S3Error> {
    let mut text = String::new();
    body.as_reader()
        .take(4 * 1024 * 1024)
        .read_to_string(&mut text)
        .map_err(|e| transport("read", key, ureq::Error::Io(e)))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_grow_past_ten_thousand() {
        let mib = 1024 * 1024;
        assert_eq!(part_size(40 * mib, 5 * mib), 5 * mib);
        assert_eq!(part_size(10_000 * 16 * mib, 16 * mib), 16 * mib);
        // 1 TiB in 16 MiB parts would be 65 536 parts: 105 MiB parts instead.
        let p = part_size(1024 * 1024 * mib, 16 * mib);
        assert_eq!(p, 105 * mib);
        assert!((1024 * 1024 * mib).div_ceil(p) <= MAX_PARTS);
    }

    #[test]
    fn replies_are_read() {
        let x = "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>2~a&amp;b</UploadId></InitiateMultipartUploadResult>";
        assert_eq!(xml_values(x, "UploadId"), vec!["2~a&amp;b"]);
        assert_eq!(xml_unescape(xml_values(x, "UploadId")[0]), "2~a&b");
        let l = "<ListMultipartUploadsResult><Upload><Key>a</Key><UploadId>1</UploadId></Upload><Upload><Key>b</Key><UploadId>2</UploadId></Upload></ListMultipartUploadsResult>";
        assert_eq!(xml_values(l, "Upload").len(), 2);
        assert_eq!(query_encode("a/b c"), "a%2Fb%20c");
        assert_eq!(xml_escape("\"e\""), "&quot;e&quot;");
    }
}
