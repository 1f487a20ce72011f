//! Streaming a verified payload back out of the store.

use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;

use crate::chunk_path;
use crate::fsutil::{crc32_hex, read_capped_from, Capped};
use crate::index::ChunkRef;

/// Reads a chunked payload: its chunks concatenated in order. Each chunk's length and crc32 are
/// checked again as it is loaded; a chunk that changed since verification is an
/// [`io::ErrorKind::InvalidData`] error and no byte of it is returned.
pub struct PayloadReader {
    chunks_dir: PathBuf,
    chunks: Vec<ChunkRef>,
    next: usize,
    buf: Vec<u8>,
    pos: usize,
    total_bytes: u64,
}

impl std::fmt::Debug for PayloadReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadReader")
            .field("chunks", &self.chunks.len())
            .field("next", &self.next)
            .field("total_bytes", &self.total_bytes)
            .finish_non_exhaustive()
    }
}

impl PayloadReader {
    pub(crate) fn new(chunks_dir: PathBuf, chunks: Vec<ChunkRef>, total_bytes: u64) -> Self {
        Self {
            chunks_dir,
            chunks,
            next: 0,
            buf: Vec::new(),
            pos: 0,
            total_bytes,
        }
    }

    /// Length of the whole payload in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn load_next(&mut self) -> io::Result<bool> {
        let Some(chunk) = self.chunks.get(self.next) else {
            return Ok(false);
        };
        let invalid = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "chunk {} {what} since the snapshot was verified",
                    chunk.digest
                ),
            )
        };
        let path = chunk_path(&self.chunks_dir, &chunk.digest);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(invalid("vanished")),
            Err(e) => return Err(e),
        };
        let bytes = match read_capped_from(file, chunk.len)? {
            Capped::Bytes(b) if b.len() as u64 == chunk.len => b,
            _ => return Err(invalid("changed length")),
        };
        if crc32_hex(&bytes) != chunk.crc32 {
            return Err(invalid("changed content"));
        }
        self.buf = bytes;
        self.pos = 0;
        self.next += 1;
        Ok(true)
    }
}

impl Read for PayloadReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        while self.pos >= self.buf.len() {
            if !self.load_next()? {
                return Ok(0);
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
