//! Line framing shared by the server and the client: bounded reads, signal-free writes.

use std::io::{self, BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use nix::errno::Errno;
use nix::sys::socket::{send, MsgFlags};

/// Why a line could not be read.
#[derive(Debug)]
pub(crate) enum LineError {
    /// The peer closed the stream; `partial` says whether part of a line had arrived.
    Eof {
        partial: bool,
    },
    /// The line grew past the limit; nothing past the limit was buffered.
    TooLong,
    /// The deadline passed before a newline arrived.
    TimedOut,
    Io(io::Error),
}

/// Reads one `\n`-terminated line (newline not included), holding at most `max` bytes of it.
///
/// With a `deadline`, the whole line must arrive before it, however slowly the peer drips it.
pub(crate) fn read_line(
    reader: &mut BufReader<UnixStream>,
    max: usize,
    deadline: Option<Instant>,
) -> Result<Vec<u8>, LineError> {
    let mut line = Vec::new();
    loop {
        if let Some(deadline) = deadline {
            let now = Instant::now();
            if now >= deadline {
                return Err(LineError::TimedOut);
            }
            reader
                .get_ref()
                .set_read_timeout(Some(deadline - now))
                .map_err(LineError::Io)?;
        }
        let available = match reader.fill_buf() {
            Ok(available) => available,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if deadline.is_some()
                    && matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
            {
                return Err(LineError::TimedOut)
            }
            Err(e) => return Err(LineError::Io(e)),
        };
        if available.is_empty() {
            return Err(LineError::Eof {
                partial: !line.is_empty(),
            });
        }
        let newline = available.iter().position(|&b| b == b'\n');
        let take = newline.unwrap_or(available.len());
        if line.len() + take > max {
            return Err(LineError::TooLong);
        }
        line.extend_from_slice(&available[..take]);
        match newline {
            Some(at) => {
                reader.consume(at + 1);
                return Ok(line);
            }
            None => reader.consume(take),
        }
    }
}

/// How a write should treat a full socket buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteMode {
    /// Wait (up to the socket's send timeout) for room.
    Blocking,
    /// If not one byte fits right now, drop the line and report `Ok(false)`. Once part of
    /// the line is out, the rest is written blocking so the framing stays intact.
    DropIfFull,
}

/// Writes all of `bytes` with `MSG_NOSIGNAL`, so a vanished peer is an `EPIPE` error and never
/// a `SIGPIPE`. Returns `Ok(false)` only when [`WriteMode::DropIfFull`] dropped the line.
pub(crate) fn write_all(stream: &UnixStream, bytes: &[u8], mode: WriteMode) -> io::Result<bool> {
    let mut sent = 0;
    while sent < bytes.len() {
        let mut flags = MsgFlags::MSG_NOSIGNAL;
        if mode == WriteMode::DropIfFull && sent == 0 {
            flags |= MsgFlags::MSG_DONTWAIT;
        }
        match send(stream.as_raw_fd(), &bytes[sent..], flags) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => sent += n,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) if sent == 0 && mode == WriteMode::DropIfFull => return Ok(false),
            // SO_SNDTIMEO expiry surfaces as EAGAIN on a blocking socket.
            Err(Errno::EAGAIN) => return Err(io::Error::from(io::ErrorKind::TimedOut)),
            Err(errno) => return Err(io::Error::from(errno)),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use super::*;

    fn pair() -> (UnixStream, BufReader<UnixStream>) {
        let (a, b) = UnixStream::pair().unwrap();
        (a, BufReader::with_capacity(16, b))
    }

    #[test]
    fn reads_lines_one_at_a_time_across_small_buffers() {
        let (mut w, mut r) = pair();
        w.write_all(b"first line is long\nsecond\n").unwrap();
        assert_eq!(read_line(&mut r, 100, None).unwrap(), b"first line is long");
        assert_eq!(read_line(&mut r, 100, None).unwrap(), b"second");
        drop(w);
        assert!(matches!(
            read_line(&mut r, 100, None),
            Err(LineError::Eof { partial: false })
        ));
    }

    #[test]
    fn a_line_of_exactly_max_bytes_is_accepted_and_one_more_is_not() {
        let (mut w, mut r) = pair();
        w.write_all(b"12345\n123456\n").unwrap();
        assert_eq!(read_line(&mut r, 5, None).unwrap(), b"12345");
        assert!(matches!(
            read_line(&mut r, 5, None),
            Err(LineError::TooLong)
        ));
    }

    #[test]
    fn a_partial_line_then_eof_is_reported_as_partial() {
        let (mut w, mut r) = pair();
        w.write_all(b"no newline").unwrap();
        drop(w);
        assert!(matches!(
            read_line(&mut r, 100, None),
            Err(LineError::Eof { partial: true })
        ));
    }

    #[test]
    fn the_deadline_bounds_the_whole_line() {
        let (mut w, mut r) = pair();
        w.write_all(b"slow").unwrap();
        let deadline = Instant::now() + Duration::from_millis(100);
        assert!(matches!(
            read_line(&mut r, 100, Some(deadline)),
            Err(LineError::TimedOut)
        ));
    }

    #[test]
    fn writing_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let err = write_all(&a, b"x\n", WriteMode::Blocking).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPIPE));
    }

    #[test]
    fn a_full_buffer_drops_the_line_in_drop_mode() {
        let (a, _b) = UnixStream::pair().unwrap();
        a.set_write_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let chunk = [b'x'; 4096];
        let dropped =
            (0..10_000).any(|_| matches!(write_all(&a, &chunk, WriteMode::DropIfFull), Ok(false)));
        assert!(dropped, "socket buffer never filled");
    }
}
