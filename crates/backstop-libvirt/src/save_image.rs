//! The two framings around QEMU's migration stream this backend uses.
//!
//! * **Capture stream** (what the store keeps): [`CAPTURE_MAGIC`], the domain XML's length
//!   (u32 LE) and the XML (`virDomainGetXMLDesc(SECURE|MIGRATABLE)` at capture), then QEMU's raw
//!   stream. A snapshot is so self-contained: its restore needs nothing from the daemon's memory.
//! * **libvirt save image** (what `virDomainRestoreFlags` reads; libvirt 9.0
//!   `src/qemu/qemu_saveimage.h`): a 92-byte header — magic `LibvirtQemudSave`, `version` = 2,
//!   `data_len` (the XML with its NUL), `was_running`, `format` = 0 (raw), `cookieOffset` = 0,
//!   14 unused u32 — then the XML and its NUL, then QEMU's raw stream.
//!
//! [`RestoreImageWriter`] turns the first into the second while it streams, rewriting the XML's
//! disks onto the fresh overlays.

use std::io::{self, Write};
use std::path::PathBuf;

/// Starts every capture stream of this backend.
pub const CAPTURE_MAGIC: &[u8; 16] = b"BACKSTOP-LVXML1\n";
/// libvirt's save image magic (ABI).
pub const SAVE_MAGIC: &[u8; 16] = b"LibvirtQemudSave";
pub const SAVE_HEADER_LEN: usize = 92;
/// Longest domain XML accepted in a capture stream.
pub const MAX_XML_LEN: usize = 4 << 20;

/// The prefix of a capture stream.
pub fn capture_prefix(xml: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + xml.len());
    v.extend_from_slice(CAPTURE_MAGIC);
    v.extend_from_slice(&(xml.len() as u32).to_le_bytes());
    v.extend_from_slice(xml.as_bytes());
    v
}

/// libvirt's save header for an XML of `xml_len` bytes (without NUL).
pub fn save_header(xml_len: usize, was_running: bool) -> [u8; SAVE_HEADER_LEN] {
    let mut h = [0u8; SAVE_HEADER_LEN];
    h[..16].copy_from_slice(SAVE_MAGIC);
    let fields = [2u32, xml_len as u32 + 1, was_running as u32, 0, 0];
    for (i, f) in fields.iter().enumerate() {
        h[16 + 4 * i..20 + 4 * i].copy_from_slice(&f.to_le_bytes());
    }
    h
}

/// Rewrites the captured domain XML for the restored domain (or says why it cannot).
pub type RewriteXml = Box<dyn FnMut(&str) -> Result<String, String> + Send>;

/// Writes a libvirt save image from a capture stream, rewriting the XML with `rewrite`.
pub struct RestoreImageWriter<W: Write> {
    out: W,
    /// Bytes of the prefix seen so far (until the XML is complete).
    head: Vec<u8>,
    xml_done: bool,
    rewrite: RewriteXml,
    /// The XML written into the image (after the rewrite).
    pub written_xml: Option<String>,
    pub stream_bytes: u64,
}

impl<W: Write> RestoreImageWriter<W> {
    pub fn new(out: W, rewrite: RewriteXml) -> Self {
        RestoreImageWriter {
            out,
            head: Vec::new(),
            xml_done: false,
            rewrite,
            written_xml: None,
            stream_bytes: 0,
        }
    }

    /// Whether the whole prefix was seen and the header written.
    pub fn header_written(&self) -> bool {
        self.xml_done
    }

    pub fn into_inner(self) -> W {
        self.out
    }

    fn bad(msg: String) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, msg)
    }
}

impl<W: Write> Write for RestoreImageWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.xml_done {
            let n = self.out.write(buf)?;
            self.stream_bytes += n as u64;
            return Ok(n);
        }
        // Take at most what completes the prefix, so the rest goes through the fast path.
        let need = if self.head.len() < 20 {
            20 - self.head.len()
        } else {
            let len =
                u32::from_le_bytes([self.head[16], self.head[17], self.head[18], self.head[19]])
                    as usize;
            20 + len - self.head.len()
        };
        let take = need.min(buf.len());
        self.head.extend_from_slice(&buf[..take]);
        if self.head.len() >= 16 && &self.head[..16] != CAPTURE_MAGIC {
            return Err(Self::bad(
                "not a libvirt-backend capture stream (bad magic)".into(),
            ));
        }
        if self.head.len() == 20 {
            let len =
                u32::from_le_bytes([self.head[16], self.head[17], self.head[18], self.head[19]])
                    as usize;
            if len == 0 || len > MAX_XML_LEN {
                return Err(Self::bad(format!("domain XML length {len} out of bounds")));
            }
        } else if self.head.len() > 20 {
            let len =
                u32::from_le_bytes([self.head[16], self.head[17], self.head[18], self.head[19]])
                    as usize;
            if self.head.len() == 20 + len {
                let xml = std::str::from_utf8(&self.head[20..])
                    .map_err(|_| Self::bad("domain XML is not UTF-8".into()))?;
                let xml = (self.rewrite)(xml).map_err(Self::bad)?;
                self.out.write_all(&save_header(xml.len(), true))?;
                self.out.write_all(xml.as_bytes())?;
                self.out.write_all(&[0])?;
                self.written_xml = Some(xml);
                self.xml_done = true;
                self.head = Vec::new();
            }
        }
        Ok(take)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// Where a restore image is written (the layers directory: libvirtd reads it as root).
pub fn restore_image_path(dir: &std::path::Path) -> PathBuf {
    dir.join("restore.img")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_libvirts_92_bytes() {
        let h = save_header(10, true);
        assert_eq!(&h[..16], b"LibvirtQemudSave");
        assert_eq!(u32::from_le_bytes(h[16..20].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(h[20..24].try_into().unwrap()), 11);
        assert_eq!(u32::from_le_bytes(h[24..28].try_into().unwrap()), 1);
        assert!(h[28..].iter().all(|b| *b == 0));
    }

    #[test]
    fn a_capture_stream_becomes_a_save_image_in_any_write_sizes() {
        let mut stream = capture_prefix("<domain>X</domain>");
        stream.extend_from_slice(b"QEVM-payload");
        for step in [1, 3, 7, 100] {
            let mut w =
                RestoreImageWriter::new(Vec::new(), Box::new(|x: &str| Ok(x.replace('X', "YY"))));
            for c in stream.chunks(step) {
                w.write_all(c).unwrap();
            }
            assert!(w.header_written());
            let out = w.into_inner();
            let xml = b"<domain>YY</domain>\0";
            assert_eq!(&out[..92], &save_header(xml.len() - 1, true));
            assert_eq!(&out[92..92 + xml.len()], xml);
            assert_eq!(&out[92 + xml.len()..], b"QEVM-payload");
        }
    }

    #[test]
    fn foreign_streams_are_refused() {
        let mut w = RestoreImageWriter::new(Vec::new(), Box::new(|x: &str| Ok(x.into())));
        assert!(w.write_all(b"QEVM\0\0\0\x03 raw qemu stream").is_err());
        let mut w = RestoreImageWriter::new(Vec::new(), Box::new(|x: &str| Ok(x.into())));
        let mut s = CAPTURE_MAGIC.to_vec();
        s.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(w.write_all(&s).is_err());
    }
}
