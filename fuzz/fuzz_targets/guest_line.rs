//! The guest agent channel: `LineSplitter` fed arbitrary bytes in arbitrary chunks, each line
//! it emits parsed by `parse_guest_line`.
//!
//! The first input byte seeds the chunking. Asserts: the splitter never holds more than
//! GUEST_LINE_MAX bytes; every line it emits fits GUEST_LINE_MAX with its newline; how the bytes
//! were chunked never changes what is emitted; a credited heartbeat is `HB` and the digits of its
//! value.
#![no_main]

use backstop_qemu::{parse_guest_line, GuestLine, LineSplitter, GUEST_LINE_MAX};
use libfuzzer_sys::fuzz_target;

fn split(data: &[u8], mut chunk_len: impl FnMut() -> usize) -> Vec<Option<Vec<u8>>> {
    let mut splitter = LineSplitter::default();
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(chunk_len().clamp(1, rest.len()));
        rest = tail;
        splitter.feed(chunk, |line| out.push(line.map(<[u8]>::to_vec)));
        assert!(splitter.buffered_len() <= GUEST_LINE_MAX);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, data)) = data.split_first() else {
        return;
    };
    let mut state = u32::from(seed) | 1;
    let lines = split(data, || {
        // xorshift: chunk lengths 1..=80, so lines straddle chunks in every way.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state % 80) as usize + 1
    });
    assert_eq!(
        lines,
        split(data, || data.len()),
        "chunking changed the lines"
    );
    for line in lines.iter().flatten() {
        assert!(line.len() < GUEST_LINE_MAX, "line of {} bytes", line.len());
        assert!(!line.contains(&b'\n'));
        if let GuestLine::Heartbeat(n) = parse_guest_line(line) {
            // `HB`, one space, 1 to 20 decimal digits (leading zeros allowed) naming n.
            let digits = line.strip_prefix(b"HB ").expect("a heartbeat starts `HB `");
            assert!((1..=20).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit));
            assert_eq!(
                std::str::from_utf8(digits)
                    .ok()
                    .and_then(|d| d.parse().ok()),
                Some(n)
            );
        }
    }
    let _ = parse_guest_line(data);
});
