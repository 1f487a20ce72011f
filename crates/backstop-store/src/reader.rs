//! Streaming a verified payload back out of the store.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use crate::chunk_path;
use crate::fsutil::crc32_hex;
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

    /// Loads the next chunk into the internal buffer (its allocation reused); false at the end.
    fn load_next(&mut self) -> io::Result<bool> {
        let Some(chunk) = self.chunks.get(self.next) else {
            return Ok(false);
        };
        self.buf.resize(chunk.len as usize, 0);
        read_chunk_into(&self.chunks_dir, chunk, &mut self.buf)?;
        self.pos = 0;
        self.next += 1;
        Ok(true)
    }
}

/// Reads `chunk` from its file into `out` (exactly its length) and checks it: the file's length
/// and the bytes' crc32 must be the chunk's. On error `out` holds bytes that must not be used.
fn read_chunk_into(chunks_dir: &Path, chunk: &ChunkRef, out: &mut [u8]) -> io::Result<()> {
    let invalid = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "chunk {} {what} since the snapshot was verified",
                chunk.digest
            ),
        )
    };
    let path = chunk_path(chunks_dir, &chunk.digest);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(invalid("vanished")),
        Err(e) => return Err(e),
    };
    debug_assert_eq!(
        out.len() as u64,
        chunk.len,
        "callers size `out` to the chunk"
    );
    if file.metadata()?.len() != chunk.len {
        return Err(invalid("changed length"));
    }
    match file.read_exact(out) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(invalid("changed length"))
        }
        Err(e) => return Err(e),
    }
    if crc32_hex(out) != chunk.crc32 {
        return Err(invalid("changed content"));
    }
    Ok(())
}

impl Read for PayloadReader {
    /// Hands out the chunks' bytes in order. A chunk that fits whole into what is left of `out`
    /// (a rollback's feed reads 1 MiB at a time; chunks of RAM are ~64 KiB) is read from its file
    /// straight into `out` and checked there: no copy through the internal buffer.
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.pos >= self.buf.len() {
            if let Some(chunk) = self.chunks.get(self.next) {
                let len = chunk.len as usize;
                if len <= out.len() {
                    read_chunk_into(&self.chunks_dir, chunk, &mut out[..len])?;
                    self.next += 1;
                    return Ok(len);
                }
            }
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
