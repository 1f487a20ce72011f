//! qemu-ga's replies (the guest is untrusted): `LineSplitter::with_max(QGA_LINE_MAX)` fed
//! arbitrary bytes in arbitrary chunks, each line it emits parsed by `parse_qga_line`.
//!
//! The first input byte seeds the chunking. Asserts: the splitter never holds more than
//! QGA_LINE_MAX bytes; every line fits QGA_LINE_MAX with its newline; a line accepted as an
//! answer names an id of backstop's own shape (`bs-` and `[a-z0-9-]`, at most 32 bytes), so a
//! guest can never be credited for an id backstop did not send.
#![no_main]

use backstop_qemu::qga::{parse_qga_line, QgaLine, QGA_LINE_MAX};
use backstop_qemu::LineSplitter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&seed, data)) = data.split_first() else {
        return;
    };
    let mut state = u32::from(seed) | 1;
    let mut splitter = LineSplitter::with_max(QGA_LINE_MAX);
    let mut rest = data;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let n = ((state % 700) as usize + 1).min(rest.len());
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        splitter.feed(chunk, |line| {
            let Some(line) = line else { return };
            assert!(line.len() < QGA_LINE_MAX, "line of {} bytes", line.len());
            let id = match parse_qga_line(line) {
                QgaLine::Ok { id } | QgaLine::Error { id, .. } => id,
                QgaLine::Rejected => return,
            };
            assert!(id.len() <= 32 && id.starts_with("bs-"), "{id:?}");
            assert!(id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
        });
        assert!(splitter.buffered_len() <= QGA_LINE_MAX);
    }
    let _ = parse_qga_line(data);
});
