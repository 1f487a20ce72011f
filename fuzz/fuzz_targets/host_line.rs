//! What backstop-agent reads from the host on its port: `protocol::LineSplitter` fed arbitrary
//! bytes in arbitrary chunks, each line parsed by `parse_host_line`.
//!
//! The first input byte seeds the chunking. Asserts: the splitter never holds more than
//! HOST_LINE_MAX bytes; every complete line fits HOST_LINE_MAX with its newline; how the bytes
//! were chunked never changes the lines; an accepted epoch is `EPOCH`, one space and the digits
//! of its value.
#![no_main]

use backstop_agent::protocol::{parse_host_line, HostLine, Line, LineSplitter, HOST_LINE_MAX};
use libfuzzer_sys::fuzz_target;

fn split(data: &[u8], mut chunk_len: impl FnMut() -> usize) -> Vec<Option<Vec<u8>>> {
    let mut splitter = LineSplitter::new();
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(chunk_len().clamp(1, rest.len()));
        rest = tail;
        splitter.feed(chunk, |line| {
            out.push(match line {
                Line::Complete(l) => Some(l.to_vec()),
                Line::TooLong => None,
            })
        });
        assert!(splitter.buffered_len() <= HOST_LINE_MAX);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, data)) = data.split_first() else {
        return;
    };
    let mut state = u32::from(seed) | 1;
    let lines = split(data, || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state % 80) as usize + 1
    });
    assert_eq!(lines, split(data, || data.len()), "chunking changed the lines");
    for line in lines.iter().flatten() {
        assert!(line.len() < HOST_LINE_MAX, "line of {} bytes", line.len());
        if let HostLine::Epoch(e) = parse_host_line(line) {
            let digits = line.strip_prefix(b"EPOCH ").expect("an epoch starts `EPOCH `");
            assert!((1..=20).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit));
            assert_eq!(std::str::from_utf8(digits).ok().and_then(|d| d.parse().ok()), Some(e.0));
        }
    }
});
