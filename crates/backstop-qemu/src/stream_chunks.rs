//! Cutting a QEMU migration stream into chunks that deduplicate across snapshots.
//!
//! Blind content-defined chunking does badly on a background snapshot: QEMU writes RAM pages in
//! address order *except* the pages the guest writes while the capture runs, which it saves the
//! moment they fault. Those few out-of-place records, and every page that changed, shift the
//! bytes of 1 MiB chunks around them; an idle guest's second snapshot stored 41% of its first.
//!
//! This chunker parses just enough of the stream to cut it at page records: a chunk holds the
//! records of one 64 KiB run of guest addresses (runs of cheap zero-page records are merged up to
//! 16 KiB of stream, never across a 2 MiB region, so a change re-synchronises within 2 MiB). The
//! bytes are not changed at all — the chunks concatenate to exactly the stream QEMU wrote — so
//! restoring is unaffected, and anything the parser does not understand (another QEMU version,
//! compression, XBZRLE, a garbled stream) only means the rest is cut with FastCDC instead. A
//! stream is never rejected here; whether it loads is QEMU's decision at restore.
//!
//! Stream layout relied on (QEMU 7.2, `migration/savevm.c`, `migration/ram.c`):
//! * the RAM section starts `01 <section id: be32> 03 "ram" <instance: be32> <version: be32>`
//!   and opens with a `MEM_SIZE` record (`be64 total | 0x04`, then per block `u8 len, idstr,
//!   be64 used_length` until the lengths add up to the total);
//! * a page record is `be64 addr | flags`, then `u8 len, idstr` unless `CONTINUE` (0x20), then
//!   one byte for `ZERO` (0x02) or a whole page for `PAGE` (0x08);
//! * `EOS` (0x10) ends a section's data, optionally followed by a footer `7e <section id>`;
//!   the RAM section continues with `02`/`03 <section id>` (part / end); anything else is the
//!   device state, which goes to FastCDC.

use backstop_hypervisor::{CutChunks, StreamCutter};
use std::io::{self, Chain, Cursor, Read};

use fastcdc::v2020::{Error as CdcError, StreamCDC};

/// Guest-address span whose page records share a chunk.
pub const GROUP_BYTES: u64 = 64 * 1024;
/// Below this many stream bytes a chunk takes in the next group too (zero-page runs).
pub const MERGE_BELOW_BYTES: usize = 16 * 1024;
/// A chunk never spans two of these guest-address regions.
pub const REGION_BYTES: u64 = 2 * 1024 * 1024;
/// Longest chunk cut (the store's limit).
pub const CHUNK_MAX_BYTES: usize = 4 * 1024 * 1024;
/// How far into the stream the RAM section must start.
const PREAMBLE_MAX_BYTES: usize = 1024 * 1024;
/// Most unread bytes the parser ever asks to have in hand: the RAM section must start within
/// [`PREAMBLE_MAX_BYTES`] and is looked for 64 KiB at a time (a 4096-block `MEM_SIZE` list and a
/// 64 KiB page record are both smaller).
const NEED_MAX_BYTES: usize = PREAMBLE_MAX_BYTES + 64 * 1024;
/// The parser reads at least this much at a time.
const READ_MIN_BYTES: usize = 256 * 1024;
/// Most stream bytes a [`MigrationChunker`] holds while it parses page records: its read-ahead
/// (what it needs, as much again already consumed but not yet compacted away, and one minimum
/// read) plus the chunk it is building. See [`MigrationChunker::peak_held_bytes`].
pub const HELD_MAX_BYTES: usize = 2 * NEED_MAX_BYTES + READ_MIN_BYTES + CHUNK_MAX_BYTES;
/// A `MEM_SIZE` record naming more blocks than this is not believed.
const MAX_RAM_BLOCKS: usize = 4096;
/// FastCDC sizes for the device state and for anything not understood.
const CDC_MIN: usize = 64 * 1024;
const CDC_AVG: usize = 256 * 1024;
const CDC_MAX: usize = 1024 * 1024;

const SECTION_START: u8 = 0x01;
const SECTION_PART: u8 = 0x02;
const SECTION_END: u8 = 0x03;
const SECTION_FOOTER: u8 = 0x7e;

const FLAG_ZERO: u64 = 0x02;
const FLAG_MEM_SIZE: u64 = 0x04;
const FLAG_PAGE: u64 = 0x08;
const FLAG_EOS: u64 = 0x10;
const FLAG_CONTINUE: u64 = 0x20;

/// What the chunker made of a stream, for the snapshot's manifest and the logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkingReport {
    /// Page records parsed (full and zero pages).
    pub page_records: u64,
    /// Chunks cut at page-record boundaries (including the preamble chunk).
    pub record_chunks: u64,
    /// Chunks cut by FastCDC (device state, or everything after a fallback).
    pub cdc_chunks: u64,
    /// Why the parser gave up on the RAM section, if it did before its end.
    pub fallback: Option<String>,
}

/// An iterator of chunks over a migration stream; see the module documentation.
pub struct MigrationChunker<R: Read> {
    state: State<R>,
    report: ChunkingReport,
    /// The parser's `peak_held`, once it is gone.
    peak_held: usize,
}

enum State<R: Read> {
    Parsing(Box<Parser<R>>),
    Tail(Box<StreamCDC<TailReader<R>>>),
    Done,
}

impl<R: Read> MigrationChunker<R> {
    /// `page_size` is the target's page size (4096 on x86): a power of two from 512 to 64 KiB;
    /// anything else is taken as 4096 (cutting only affects dedup, never the bytes).
    pub fn new(reader: R, page_size: u64) -> Self {
        let page_size = if page_size.is_power_of_two() && (512..=65536).contains(&page_size) {
            page_size
        } else {
            4096
        };
        Self {
            state: State::Parsing(Box::new(Parser {
                reader,
                buf: Vec::with_capacity(1 << 20),
                pos: 0,
                end: 0,
                eof: false,
                cur: Vec::with_capacity(GROUP_BYTES as usize * 2),
                phase: Phase::Preamble,
                ram_section: [0; 4],
                block: Vec::new(),
                block_ordinal: 0,
                prev: None,
                page_size,
                page_records: 0,
                peak_held: 0,
            })),
            report: ChunkingReport::default(),
            peak_held: 0,
        }
    }

    /// The most bytes the parser has held at once so far (its read buffer and the chunk being
    /// built); never more than [`HELD_MAX_BYTES`]. After the parser hands the rest of the stream
    /// to FastCDC, that holds at most its own largest chunk beyond the read-ahead it was handed.
    pub fn peak_held_bytes(&self) -> usize {
        match &self.state {
            State::Parsing(p) => p.peak_held,
            State::Tail(_) | State::Done => self.peak_held,
        }
    }

    /// What has been cut so far (complete once the iterator returned `None`).
    pub fn report(&self) -> &ChunkingReport {
        &self.report
    }

    fn start_tail(&mut self, parser: Parser<R>, fallback: Option<String>) {
        let Parser {
            reader,
            mut buf,
            pos,
            end,
            page_records,
            peak_held,
            ..
        } = parser;
        self.report.page_records = page_records;
        self.peak_held = peak_held;
        if fallback.is_some() {
            self.report.fallback = fallback;
        }
        buf.truncate(end);
        buf.drain(..pos);
        let chained = RetryInterrupted(Cursor::new(buf).chain(reader));
        self.state = State::Tail(Box::new(StreamCDC::new(chained, CDC_MIN, CDC_AVG, CDC_MAX)));
    }
}

impl<R: Read> Iterator for MigrationChunker<R> {
    type Item = io::Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match std::mem::replace(&mut self.state, State::Done) {
                State::Done => return None,
                State::Parsing(mut parser) => match parser.next_chunk() {
                    Ok(Step::Chunk(chunk)) => {
                        self.report.record_chunks += 1;
                        self.state = State::Parsing(parser);
                        return Some(Ok(chunk));
                    }
                    Ok(Step::Tail { last, fallback }) => {
                        self.start_tail(*parser, fallback);
                        if let Some(chunk) = last {
                            self.report.record_chunks += 1;
                            return Some(Ok(chunk));
                        }
                    }
                    Err(e) => return Some(Err(e)),
                },
                State::Tail(mut cdc) => match cdc.next() {
                    None => return None,
                    Some(Ok(chunk)) => {
                        self.report.cdc_chunks += 1;
                        self.state = State::Tail(cdc);
                        return Some(Ok(chunk.data));
                    }
                    Some(Err(CdcError::IoError(e))) => return Some(Err(e)),
                    Some(Err(other)) => return Some(Err(io::Error::other(other.to_string()))),
                },
            }
        }
    }
}

/// What FastCDC reads once the parser is done: the parser's unread bytes, then the rest.
type TailReader<R> = RetryInterrupted<Chain<Cursor<Vec<u8>>, R>>;

/// A reader that retries a read interrupted by a signal (`EINTR`), as `Read::read_exact` does.
///
/// FastCDC's `StreamCDC` passes `ErrorKind::Interrupted` up as a failure, which would fail a
/// whole capture over a signal that arrived during a read; the parser itself already retries.
/// (Found by the `stream_cutter` fuzz target, whose reader is interrupted now and then.)
struct RetryInterrupted<R>(R);

impl<R: Read> Read for RetryInterrupted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.0.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the RAM section's start header.
    Preamble,
    /// Inside a RAM section's data.
    Records,
    /// After an `EOS`: a footer, another RAM section, or the device state.
    AfterEos,
}

enum Step {
    Chunk(Vec<u8>),
    /// The parser is done: `last` is its final chunk, the rest goes to FastCDC.
    Tail {
        last: Option<Vec<u8>>,
        fallback: Option<String>,
    },
}

/// Where a page record lies: (block ordinal, 64 KiB group, 2 MiB region).
type Place = (u64, u64, u64);

struct Parser<R: Read> {
    reader: R,
    /// Input read but not yet moved into `cur` is `buf[pos..end]`; `buf[end..]` is zeroed room
    /// for the next read.
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    eof: bool,
    /// The chunk being built.
    cur: Vec<u8>,
    phase: Phase,
    ram_section: [u8; 4],
    /// The RAM block the last record named, and how many block changes so far (0: none named).
    block: Vec<u8>,
    block_ordinal: u64,
    prev: Option<Place>,
    page_size: u64,
    page_records: u64,
    /// The most bytes `buf` and `cur` held at once.
    peak_held: usize,
}

impl<R: Read> Parser<R> {
    /// Makes `n` unread bytes available; false at EOF before that.
    fn need(&mut self, n: usize) -> io::Result<bool> {
        while self.end - self.pos < n {
            if self.eof {
                return Ok(false);
            }
            if self.pos > 0 && self.pos >= self.end / 2 {
                self.buf.copy_within(self.pos..self.end, 0);
                self.end -= self.pos;
                self.pos = 0;
            }
            let want = (n - (self.end - self.pos)).max(READ_MIN_BYTES);
            if self.buf.len() < self.end + want {
                // The room is zeroed once and reused: zeroed for every read, a reader returning
                // small pieces would cost 256 KiB of memset per read, however small (measured: the
                // `stream_cutter` fuzz target ran at 500 inputs a second that way).
                self.buf.resize(self.end + want, 0);
                self.peak_held = self.peak_held.max(self.buf.len() + self.cur.len());
            }
            let got = loop {
                match self.reader.read(&mut self.buf[self.end..]) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => break other,
                }
            };
            let got = got?;
            self.end += got;
            self.eof = got == 0;
        }
        Ok(true)
    }

    fn unread(&self) -> &[u8] {
        &self.buf[self.pos..self.end]
    }

    fn be64_at(&self, off: usize) -> u64 {
        let b = &self.unread()[off..off + 8];
        u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }

    /// Moves `n` unread bytes (already made available) into the current chunk.
    fn take(&mut self, n: usize) {
        self.cur
            .extend_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        self.peak_held = self.peak_held.max(self.buf.len() + self.cur.len());
    }

    /// The current chunk, if it has bytes; `cur` starts empty again.
    fn cut(&mut self) -> Option<Vec<u8>> {
        if self.cur.is_empty() {
            None
        } else {
            Some(std::mem::replace(
                &mut self.cur,
                Vec::with_capacity(GROUP_BYTES as usize * 2),
            ))
        }
    }

    fn tail(&mut self, fallback: Option<String>) -> Step {
        Step::Tail {
            last: self.cut(),
            fallback,
        }
    }

    fn next_chunk(&mut self) -> io::Result<Step> {
        loop {
            let step = match self.phase {
                Phase::Preamble => self.preamble()?,
                Phase::Records => self.record()?,
                Phase::AfterEos => self.after_eos()?,
            };
            if let Some(step) = step {
                return Ok(step);
            }
        }
    }

    /// Finds the RAM section's start header and its `MEM_SIZE` record; everything before goes
    /// into the first chunk.
    fn preamble(&mut self) -> io::Result<Option<Step>> {
        const HEADER: usize = 17; // 01 sid:4 03 "ram" instance:4 version:4
        let mut scanned = 0;
        loop {
            let avail = self.unread().len();
            if avail >= HEADER + 8 {
                let found = self.unread()[scanned..avail - (HEADER + 8) + 1]
                    .iter()
                    .enumerate()
                    .filter(|&(_, &b)| b == SECTION_START)
                    .map(|(i, _)| scanned + i)
                    .find(|&i| {
                        let u = self.unread();
                        &u[i + 5..i + 9] == b"\x03ram"
                            && self.be64_at(i + HEADER) & (self.page_size - 1) == FLAG_MEM_SIZE
                    });
                if let Some(i) = found {
                    let sid = &self.buf[self.pos + i + 1..self.pos + i + 5];
                    self.ram_section = [sid[0], sid[1], sid[2], sid[3]];
                    self.take(i + HEADER);
                    self.phase = Phase::Records;
                    return Ok(None);
                }
                scanned = avail - (HEADER + 8) + 1;
            }
            if avail >= PREAMBLE_MAX_BYTES {
                return Ok(Some(self.tail(Some(format!(
                    "no RAM section within the first {} KiB",
                    PREAMBLE_MAX_BYTES / 1024
                )))));
            }
            if !self.need(avail + 64 * 1024)? && self.unread().len() == avail {
                return Ok(Some(
                    self.tail(Some("the stream has no RAM section".into())),
                ));
            }
        }
    }

    /// One record of a RAM section; a page record may first cut the chunk before it.
    fn record(&mut self) -> io::Result<Option<Step>> {
        if !self.need(8)? {
            return Ok(Some(
                self.tail(Some("the stream ends inside the RAM section".into())),
            ));
        }
        let header = self.be64_at(0);
        let flags = header & (self.page_size - 1);
        let addr = header & !(self.page_size - 1);
        if flags == FLAG_EOS {
            self.take(8);
            self.phase = Phase::AfterEos;
            return Ok(None);
        }
        if flags == FLAG_MEM_SIZE {
            return Ok(self.mem_size(addr)?.map(|why| self.tail(Some(why))));
        }
        let kind = flags & !FLAG_CONTINUE;
        if kind != FLAG_PAGE && kind != FLAG_ZERO {
            return Ok(Some(
                self.tail(Some(format!("RAM record flags {flags:#x} not handled"))),
            ));
        }
        let mut len = 8;
        if flags & FLAG_CONTINUE == 0 {
            if !self.need(9)? {
                return Ok(Some(self.tail(Some("truncated RAM record".into()))));
            }
            let n = usize::from(self.unread()[8]);
            if !self.need(9 + n)? {
                return Ok(Some(self.tail(Some("truncated RAM record".into()))));
            }
            let idstr = &self.unread()[9..9 + n];
            if self.block_ordinal == 0 || idstr != self.block.as_slice() {
                self.block = idstr.to_vec();
                self.block_ordinal += 1;
            }
            len += 1 + n;
        } else if self.block_ordinal == 0 {
            return Ok(Some(
                self.tail(Some("a RAM record continues a block never named".into())),
            ));
        }
        len += if kind == FLAG_PAGE {
            self.page_size as usize
        } else {
            1
        };
        if !self.need(len)? {
            return Ok(Some(self.tail(Some("truncated RAM record".into()))));
        }
        let place = (self.block_ordinal, addr / GROUP_BYTES, addr / REGION_BYTES);
        let cut_here = match self.prev {
            None => true,
            Some(prev) => {
                let new_group = (prev.0, prev.1) != (place.0, place.1);
                let new_region = (prev.0, prev.2) != (place.0, place.2);
                (new_group && (self.cur.len() >= MERGE_BELOW_BYTES || new_region))
                    || self.cur.len() + len > CHUNK_MAX_BYTES
            }
        };
        self.prev = Some(place);
        self.page_records += 1;
        let chunk = if cut_here { self.cut() } else { None };
        self.take(len);
        Ok(chunk.map(Step::Chunk))
    }

    /// A `MEM_SIZE` record: the block list, until the used lengths add up to `total`.
    /// Returns why it is not understood, if it is not.
    fn mem_size(&mut self, total: u64) -> io::Result<Option<String>> {
        let mut off = 8;
        let mut sum = 0u64;
        let mut blocks = 0;
        while sum < total {
            blocks += 1;
            if blocks > MAX_RAM_BLOCKS {
                return Ok(Some("too many RAM blocks".into()));
            }
            if !self.need(off + 1)? {
                return Ok(Some("truncated RAM block list".into()));
            }
            let n = usize::from(self.unread()[off]);
            if !self.need(off + 1 + n + 8)? {
                return Ok(Some("truncated RAM block list".into()));
            }
            let used = self.be64_at(off + 1 + n);
            sum = match sum.checked_add(used) {
                Some(s) if s <= total => s,
                _ => return Ok(Some("RAM block sizes do not add up".into())),
            };
            off += 1 + n + 8;
        }
        if self.cur.len() + off > CHUNK_MAX_BYTES {
            // Only a pathological preamble gets here; cut rather than exceed the limit.
            return Ok(Some("RAM block list too long".into()));
        }
        self.take(off);
        Ok(None)
    }

    /// After `EOS`: an optional footer, then either the RAM section goes on or the device state
    /// starts (the tail).
    fn after_eos(&mut self) -> io::Result<Option<Step>> {
        if self.need(5)? && self.unread()[0] == SECTION_FOOTER {
            self.take(5);
        }
        if self.need(5)? {
            let u = self.unread();
            if (u[0] == SECTION_PART || u[0] == SECTION_END) && u[1..5] == self.ram_section {
                self.take(5);
                self.phase = Phase::Records;
                return Ok(None);
            }
        }
        Ok(Some(self.tail(None)))
    }
}

/// The QEMU backend's [`StreamCutter`]: a migration stream cut at its page records.
#[derive(Debug, Clone, Copy)]
pub struct MigrationCutter {
    /// The guest's target page size (4096 on x86).
    pub page_size: u64,
}

impl StreamCutter for MigrationCutter {
    fn cut<'a>(&self, src: Box<dyn Read + 'a>) -> Box<dyn CutChunks + 'a> {
        Box::new(MigrationChunker::new(src, self.page_size))
    }
}

impl<R: Read> CutChunks for MigrationChunker<R> {
    fn report(&self) -> serde_json::Value {
        let r = &self.report;
        serde_json::json!({
            "method": "qemu-page-records", "page_records": r.page_records,
            "record_chunks": r.record_chunks, "content_defined_chunks": r.cdc_chunks,
            "fallback": r.fallback,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use super::*;

    /// The kept inputs of a fuzz target, replayed by stable `cargo test`.
    use backstop_common::fuzz_corpus::inputs as fuzz_inputs;

    /// The fuzz target's reader: `data` in pseudo-random pieces, interrupted now and then.
    struct FuzzPieces<'a> {
        data: &'a [u8],
        state: u32,
    }

    impl Read for FuzzPieces<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 17;
            self.state ^= self.state << 5;
            if self.state.is_multiple_of(7) {
                return Err(io::ErrorKind::Interrupted.into());
            }
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

    /// The fuzz target `stream_cutter`'s inputs (byte 0: page size, byte 1: read sizes, then the
    /// stream), read as the target reads them: never a panic or an error, chunks within bounds
    /// and adding up to the stream, never more held than HELD_MAX_BYTES.
    #[test]
    fn fuzz_inputs_replay() {
        for (name, bytes) in fuzz_inputs("stream_cutter") {
            let [page, seed, stream @ ..] = bytes.as_slice() else {
                continue;
            };
            let page_size = match page % 9 {
                8 => u64::from(*page),
                k => 512 << k,
            };
            let reader = FuzzPieces {
                data: stream,
                state: u32::from(*seed) | 0x100,
            };
            let mut c = MigrationChunker::new(reader, page_size);
            let mut joined = Vec::new();
            for chunk in c.by_ref() {
                let chunk = chunk.unwrap();
                assert!(
                    !chunk.is_empty() && chunk.len() <= CHUNK_MAX_BYTES,
                    "{name}"
                );
                joined.extend_from_slice(&chunk);
            }
            assert!(joined == stream, "{name}");
            assert!(c.peak_held_bytes() <= HELD_MAX_BYTES, "{name}");
        }
    }

    /// The most the parser asks for at once: a preamble just short of PREAMBLE_MAX_BYTES with no
    /// RAM section, or a MEM_SIZE list of MAX_RAM_BLOCKS blocks with 255-byte names, read in odd
    /// pieces. It never holds more than HELD_MAX_BYTES.
    #[test]
    fn the_parser_holds_no_more_than_its_bound() {
        struct Pieces<'a>(&'a [u8], usize);
        impl Read for Pieces<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.1 = self.1 * 7 % 65_521 + 1;
                let n = self.1.min(buf.len()).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut blocks = b"QEVM".to_vec();
        blocks.extend_from_slice(b"\x01\x00\x00\x00\x02\x03ram\x00\x00\x00\x00\x00\x00\x00\x04");
        blocks.extend_from_slice(&(!(PAGE - 1) | FLAG_MEM_SIZE).to_be_bytes());
        for _ in 0..MAX_RAM_BLOCKS + 1 {
            blocks.push(255);
            blocks.extend_from_slice(&[b'r'; 255]);
            blocks.extend_from_slice(&1u64.to_be_bytes());
        }
        for stream in [vec![0xab; PREAMBLE_MAX_BYTES + 300_000], blocks] {
            let mut c = MigrationChunker::new(Pieces(&stream, 1), PAGE);
            let mut joined = Vec::new();
            for chunk in c.by_ref() {
                joined.extend_from_slice(&chunk.unwrap());
            }
            let most = c.peak_held_bytes();
            // The worst case comes close to the bound; the bound is not loose by much.
            assert!(
                most > PREAMBLE_MAX_BYTES && most <= HELD_MAX_BYTES,
                "held {most}"
            );
            assert!(joined == stream);
            assert!(c.report().fallback.is_some(), "{:?}", c.report());
        }
    }

    const PAGE: u64 = 4096;

    /// A synthetic QEMU 7.2 stream: header, configuration-ish bytes, a RAM section with the
    /// given page records (address, content byte or None for zero), split into parts of
    /// `per_part` records, then device state.
    struct Stream {
        bytes: Vec<u8>,
    }

    fn page_record(out: &mut Vec<u8>, block: &[u8], addr: u64, fill: Option<u8>, cont: bool) {
        let mut flags = if fill.is_some() { FLAG_PAGE } else { FLAG_ZERO };
        if cont {
            flags |= FLAG_CONTINUE;
        }
        out.extend_from_slice(&(addr | flags).to_be_bytes());
        if !cont {
            out.push(block.len() as u8);
            out.extend_from_slice(block);
        }
        match fill {
            Some(b) => out.extend(std::iter::repeat_n(b, PAGE as usize)),
            None => out.push(0),
        }
    }

    fn stream(pages: &[(u64, Option<u8>)], per_part: usize, device: &[u8]) -> Stream {
        let sid = 2u32.to_be_bytes();
        let mut b = b"QEVM\x00\x00\x00\x03\x07\x00\x00\x00\x0cpc-i440fx-7.2".to_vec();
        b.push(SECTION_START);
        b.extend_from_slice(&sid);
        b.extend_from_slice(b"\x03ram");
        b.extend_from_slice(&0u32.to_be_bytes());
        b.extend_from_slice(&4u32.to_be_bytes());
        let total = 64 << 20;
        b.extend_from_slice(&(total | FLAG_MEM_SIZE).to_be_bytes());
        for (name, len) in [
            (&b"pc.ram"[..], (64 << 20) - (1 << 20)),
            (b"vga.vram", 1 << 20),
        ] {
            b.push(name.len() as u8);
            b.extend_from_slice(name);
            b.extend_from_slice(&(len as u64).to_be_bytes());
        }
        b.extend_from_slice(&FLAG_EOS.to_be_bytes());
        b.push(SECTION_FOOTER);
        b.extend_from_slice(&sid);
        for (i, part) in pages.chunks(per_part.max(1)).enumerate() {
            b.push(if (i + 1) * per_part >= pages.len() {
                SECTION_END
            } else {
                SECTION_PART
            });
            b.extend_from_slice(&sid);
            for (j, &(addr, fill)) in part.iter().enumerate() {
                page_record(&mut b, b"pc.ram", addr, fill, j > 0);
            }
            b.extend_from_slice(&FLAG_EOS.to_be_bytes());
            b.push(SECTION_FOOTER);
            b.extend_from_slice(&sid);
        }
        b.extend_from_slice(device);
        Stream { bytes: b }
    }

    fn cut(bytes: &[u8]) -> (Vec<Vec<u8>>, ChunkingReport) {
        let mut c = MigrationChunker::new(bytes, PAGE);
        let chunks: Vec<Vec<u8>> = c.by_ref().map(|r| r.unwrap()).collect();
        (chunks, c.report().clone())
    }

    /// 8 MiB of guest memory: the first 4 MiB full pages (content by address), the rest zero.
    fn memory() -> Vec<(u64, Option<u8>)> {
        (0..2048u64)
            .map(|i| (i * PAGE, (i < 1024).then_some((i % 251) as u8)))
            .collect()
    }

    fn device_state(seed: u8) -> Vec<u8> {
        let mut d = vec![0x04];
        d.extend((0..300_000u32).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
        d
    }

    fn new_bytes(before: &[Vec<u8>], after: &[Vec<u8>]) -> usize {
        let seen: std::collections::HashSet<&Vec<u8>> = before.iter().collect();
        let mut counted = std::collections::HashSet::new();
        after
            .iter()
            .filter(|c| !seen.contains(c) && counted.insert(*c))
            .map(Vec::len)
            .sum()
    }

    #[test]
    fn chunks_concatenate_to_the_stream_and_respect_the_limits() {
        let s = stream(&memory(), 300, &device_state(1));
        let (chunks, report) = cut(&s.bytes);
        assert_eq!(chunks.concat(), s.bytes);
        assert!(chunks
            .iter()
            .all(|c| !c.is_empty() && c.len() <= CHUNK_MAX_BYTES));
        assert_eq!(report.fallback, None);
        assert_eq!(report.page_records, 2048);
        // 4 MiB of full pages in 64 KiB groups, the zero half merged per 2 MiB region.
        assert!(
            report.record_chunks >= 64 && report.record_chunks < 80,
            "{report:?}"
        );
        assert!(report.cdc_chunks >= 1);
    }

    #[test]
    fn one_changed_page_and_a_page_saved_out_of_order_cost_little() {
        let mem = memory();
        let first = cut(&stream(&mem, 300, &device_state(1)).bytes).0;

        // The guest wrote page 700 and page 1500 (in the zero half), and page 900 faulted
        // during the capture, so it comes early: right after page 100.
        let mut changed: Vec<(u64, Option<u8>)> = mem.clone();
        changed[700].1 = Some(0xee);
        changed[1500].1 = Some(0xdd);
        let early = changed.remove(900);
        changed.insert(101, early);
        let second = cut(&stream(&changed, 300, &device_state(2)).bytes).0;

        let added = new_bytes(&first, &second);
        let total: usize = second.iter().map(Vec::len).sum();
        // Here: three 64 KiB groups, the page moved, the section headers around it, and the
        // device state.
        assert!(added < 700 * 1024, "added {added} of {total}");

        // What the store's blind FastCDC (256 KiB / 1 MiB / 4 MiB) adds for the same change.
        let blind = |bytes: &[u8]| -> Vec<Vec<u8>> {
            StreamCDC::new(bytes, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
                .map(|c| c.unwrap().data)
                .collect()
        };
        let blind_added = new_bytes(
            &blind(&stream(&mem, 300, &device_state(1)).bytes),
            &blind(&stream(&changed, 300, &device_state(2)).bytes),
        );
        assert!(added * 3 < blind_added, "{added} vs blind {blind_added}");
    }

    #[test]
    fn an_identical_stream_is_cut_identically() {
        let s = stream(&memory(), 500, &device_state(3));
        assert_eq!(cut(&s.bytes).0, cut(&s.bytes).0);
    }

    #[test]
    fn anything_not_understood_falls_back_to_fastcdc_without_losing_a_byte() {
        let mut garbled = stream(&memory(), 300, &device_state(1)).bytes;
        // An XBZRLE record (flag 0x40) in the middle of the RAM data.
        // The record of page 100 (a full page, continuing its block).
        let header = ((100 * PAGE) | FLAG_PAGE | FLAG_CONTINUE).to_be_bytes();
        let pos = garbled.windows(8).position(|w| w == header).unwrap();
        assert!(pos > 0);
        garbled[pos + 7] = 0x40 | FLAG_CONTINUE as u8;
        let (chunks, report) = cut(&garbled);
        assert_eq!(chunks.concat(), garbled);
        assert!(
            report.fallback.as_deref().unwrap().contains("0x60"),
            "{report:?}"
        );

        for bytes in [
            Vec::new(),
            b"QEVM".to_vec(),
            vec![0xab; 3 * 1024 * 1024],
            stream(&memory(), 300, &[]).bytes[..5000].to_vec(),
        ] {
            let (chunks, report) = cut(&bytes);
            assert_eq!(chunks.concat(), bytes);
            assert!(chunks.iter().all(|c| c.len() <= CHUNK_MAX_BYTES));
            if !bytes.is_empty() {
                assert!(report.fallback.is_some(), "{report:?}");
            }
        }
    }

    /// Where the FastCDC tail cuts a fixed stream that is not a migration stream (pseudo-random
    /// bytes, then zeros: cuts forced at the 1 MiB maximum, then an odd-length tail). A fastcdc
    /// release that moved these would only cost dedup against chunks already stored; it must be
    /// a decision, not a surprise.
    #[test]
    fn fastcdc_boundaries_of_a_fixed_stream_are_pinned() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut bytes: Vec<u8> = (0..3 * 1024 * 1024 / 8)
            .flat_map(|_| {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes()
            })
            .collect();
        bytes.resize(bytes.len() + 2 * 1024 * 1024 + 4_321, 0);
        let (chunks, report) = cut(&bytes);
        assert!(report.fallback.is_some(), "{report:?}");
        assert_eq!(chunks.concat(), bytes);
        let lens: Vec<usize> = chunks.iter().map(Vec::len).collect();
        assert_eq!(
            lens,
            [
                155_757, 365_609, 404_704, 426_883, 333_975, 309_190, 329_070, 259_324, 501_706,
                1_048_576, 1_048_576, 63_831
            ]
        );
    }

    #[test]
    fn hostile_block_lists_and_records_never_panic() {
        let base = stream(&memory()[..64], 16, &device_state(0)).bytes;
        // Flip every byte of the first 400 (header, block list, first records) in turn.
        for i in 0..400.min(base.len()) {
            for v in [0x00, 0xff, 0x20, 0x04] {
                let mut b = base.clone();
                b[i] = v;
                let (chunks, _) = cut(&b);
                assert_eq!(chunks.concat(), b, "byte {i} set to {v:#x}");
            }
        }
    }

    #[test]
    fn interrupted_reads_are_retried_in_the_fastcdc_tail_too() {
        /// Every other read is interrupted.
        struct Interrupting<'a>(&'a [u8], bool);
        impl Read for Interrupting<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.1 = !self.1;
                if self.1 {
                    return Err(io::ErrorKind::Interrupted.into());
                }
                let n = buf.len().min(self.0.len()).min(4096);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let s = stream(&memory()[..64], 16, &device_state(4));
        let chunks: Vec<Vec<u8>> = MigrationChunker::new(Interrupting(&s.bytes, false), PAGE)
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(chunks.concat(), s.bytes);
    }

    #[test]
    fn read_errors_are_reported() {
        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::other("pipe broke"));
                }
                let n = buf.len().min(self.0);
                buf[..n].fill(0x11);
                self.0 -= n;
                Ok(n)
            }
        }
        let mut c = MigrationChunker::new(Failing(100_000), PAGE);
        let err = c.find_map(|r| r.err()).unwrap();
        assert_eq!(err.to_string(), "pipe broke");
    }
}
