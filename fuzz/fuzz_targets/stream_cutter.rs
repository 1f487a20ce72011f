//! The QEMU migration-stream cutter (`MigrationCutter`, the backend's `StreamCutter`) over
//! arbitrary bytes read in arbitrary pieces, with interrupted reads between them.
//!
//! Input: byte 0 picks the page size (512 B .. 64 KiB, or an invalid one), byte 1 seeds the read
//! sizes, the rest is the stream. Asserts: no read error surfaces (an interrupted read is
//! retried); every chunk is 1 ..= CHUNK_MAX_BYTES; the chunks concatenate to the stream exactly;
//! the parser never holds more than HELD_MAX_BYTES; the report always has a `method`.
#![no_main]

use std::io::{self, Read};

use backstop_hypervisor::StreamCutter;
use backstop_qemu::stream_chunks::{CHUNK_MAX_BYTES, HELD_MAX_BYTES};
use backstop_qemu::{MigrationChunker, MigrationCutter};
use libfuzzer_sys::fuzz_target;

/// Hands out `data` in pseudo-random pieces (1 byte to 64 KiB), interrupted now and then.
struct Pieces<'a> {
    data: &'a [u8],
    state: u32,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 17;
        self.state ^= self.state << 5;
        if self.state.is_multiple_of(7) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        // Mostly small pieces, sometimes big ones.
        let max = if self.state.is_multiple_of(5) {
            65536
        } else {
            64
        };
        let n = (self.state as usize % max + 1)
            .min(buf.len())
            .min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

fuzz_target!(|data: &[u8]| {
    let [page, seed, stream @ ..] = data else {
        return;
    };
    let page_size = match page % 9 {
        8 => u64::from(*page), // not a power of two in range: taken as 4096
        k => 512 << k,
    };
    let reader = Pieces {
        data: stream,
        state: u32::from(*seed) | 0x100,
    };
    let mut chunker = MigrationChunker::new(reader, page_size);
    let mut joined = Vec::with_capacity(stream.len());
    for chunk in chunker.by_ref() {
        let chunk = chunk.expect("an interrupted read is retried, never an error");
        assert!(
            !chunk.is_empty() && chunk.len() <= CHUNK_MAX_BYTES,
            "chunk of {} bytes",
            chunk.len()
        );
        joined.extend_from_slice(&chunk);
    }
    assert!(joined == stream, "the chunks are not the stream");
    let held = chunker.peak_held_bytes();
    assert!(held <= HELD_MAX_BYTES, "held {held} bytes at once");

    // The trait object the store uses, on the same bytes in one piece: same chunks.
    let cutter: Box<dyn StreamCutter> = Box::new(MigrationCutter { page_size });
    let mut chunks = cutter.cut(Box::new(stream));
    let mut joined = Vec::with_capacity(stream.len());
    for chunk in chunks.by_ref() {
        joined.extend_from_slice(&chunk.expect("a slice never fails to read"));
    }
    assert!(joined == stream, "the chunks are not the stream");
    assert!(chunks.report().get("method").is_some());
});
