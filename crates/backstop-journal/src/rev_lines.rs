//! Reads a file's `'\n'`-separated segments from the end, never holding more than one line
//! (at most [`MAX_LINE_BYTES`]) plus one chunk in memory.
//!
//! The first segment returned is what follows the last `'\n'`: empty for a file that ends with a
//! newline, otherwise a torn line. Every later segment is a complete line, newest first.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::entry::MAX_LINE_BYTES;

const CHUNK: usize = 64 * 1024;

/// One segment and the byte offset where it starts.
#[derive(Debug, PartialEq)]
pub(crate) struct Segment {
    pub offset: u64,
    pub bytes: Vec<u8>,
}

#[derive(Debug)]
pub(crate) enum RevError {
    Io(std::io::Error),
    /// A segment ending before `end` is longer than [`MAX_LINE_BYTES`].
    TooLong {
        end: u64,
    },
}

pub(crate) struct RevLines<'a> {
    file: &'a File,
    /// Bytes before `pos` have not been read yet.
    pos: u64,
    /// Bytes `[pos, pos + carry.len())`, read but not yet returned; never contains the `'\n'`
    /// ending the segment being assembled.
    carry: Vec<u8>,
    done: bool,
}

impl<'a> RevLines<'a> {
    /// Reads `file[..len]` backwards.
    pub fn new(file: &'a File, len: u64) -> Self {
        Self {
            file,
            pos: len,
            carry: Vec::new(),
            done: false,
        }
    }

    pub fn next_segment(&mut self) -> Result<Option<Segment>, RevError> {
        loop {
            if let Some(i) = self.carry.iter().rposition(|&b| b == b'\n') {
                let bytes = self.carry.split_off(i + 1);
                self.carry.truncate(i);
                let offset = self.pos + i as u64 + 1;
                return self.checked(Segment { offset, bytes });
            }
            if self.pos == 0 {
                if self.done {
                    return Ok(None);
                }
                self.done = true;
                let bytes = std::mem::take(&mut self.carry);
                return self.checked(Segment { offset: 0, bytes });
            }
            if self.carry.len() > MAX_LINE_BYTES {
                return Err(RevError::TooLong {
                    end: self.pos + self.carry.len() as u64,
                });
            }
            let n = usize::try_from(self.pos).map_or(CHUNK, |p| p.min(CHUNK));
            let start = self.pos - n as u64;
            let mut chunk = vec![0u8; n];
            self.file
                .read_exact_at(&mut chunk, start)
                .map_err(RevError::Io)?;
            chunk.extend_from_slice(&self.carry);
            self.carry = chunk;
            self.pos = start;
        }
    }

    fn checked(&self, seg: Segment) -> Result<Option<Segment>, RevError> {
        if seg.bytes.len() > MAX_LINE_BYTES {
            return Err(RevError::TooLong {
                end: seg.offset + seg.bytes.len() as u64,
            });
        }
        Ok(Some(seg))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn segments(content: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(content).unwrap();
        let mut r = RevLines::new(&f, content.len() as u64);
        let mut out = Vec::new();
        while let Some(s) = r.next_segment().unwrap() {
            out.push((s.offset, s.bytes));
        }
        out
    }

    #[test]
    fn splits_from_the_end_with_offsets() {
        assert_eq!(
            segments(b"ab\ncd\n"),
            vec![(6, b"".to_vec()), (3, b"cd".to_vec()), (0, b"ab".to_vec())]
        );
        assert_eq!(
            segments(b"ab\ncd"),
            vec![(3, b"cd".to_vec()), (0, b"ab".to_vec())]
        );
        assert_eq!(segments(b""), vec![(0, b"".to_vec())]);
        assert_eq!(segments(b"\n"), vec![(1, b"".to_vec()), (0, b"".to_vec())]);
    }

    #[test]
    fn lines_longer_than_a_chunk_are_reassembled() {
        let long = vec![b'x'; CHUNK * 3 + 17];
        let mut content = b"first\n".to_vec();
        content.extend_from_slice(&long);
        content.push(b'\n');
        let segs = segments(&content);
        assert_eq!(segs[1], (6, long));
        assert_eq!(segs[2], (0, b"first".to_vec()));
    }

    #[test]
    fn an_over_long_line_is_an_error_not_a_buffer() {
        let mut f = tempfile::tempfile().unwrap();
        let content = vec![b'y'; MAX_LINE_BYTES + CHUNK * 2];
        f.write_all(&content).unwrap();
        f.write_all(b"\n").unwrap();
        let mut r = RevLines::new(&f, content.len() as u64 + 1);
        assert_eq!(r.next_segment().unwrap().map(|s| s.bytes.len()), Some(0));
        assert!(matches!(r.next_segment(), Err(RevError::TooLong { .. })));
        assert!(r.carry.len() <= MAX_LINE_BYTES + CHUNK);
    }
}
