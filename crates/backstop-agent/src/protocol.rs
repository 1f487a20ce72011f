//! The agent's side of the channel, without I/O: the bounded line splitter for what the host
//! sends, the one message understood (`EPOCH <u64>`), the heartbeat line and its schedule, the
//! one-line outbox, and which epochs are new.
//!
//! The host end (`backstop_qemu::agent`) accepts only `HB <decimal u64>` lines of at most 64
//! bytes, newline included, at most 50 a second, and sends only `EPOCH <n>\n`.

use std::fmt;
use std::time::{Duration, Instant};

/// Longest line taken from the host, newline included (the same bound the host puts on what it
/// takes from the guest).
pub const HOST_LINE_MAX: usize = 64;

/// The smallest heartbeat interval: the host drops whatever comes faster than 50 lines a second.
pub const MIN_INTERVAL_MS: u64 = 20;

/// A rollback epoch, numbered by the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What one line from the host means.
#[derive(Debug, PartialEq, Eq)]
pub enum HostLine {
    /// `EPOCH <n>`: the VM was rolled back and is now in epoch `n`.
    Epoch(Epoch),
    /// Anything else. Not an error: it changes nothing.
    Ignored,
}

/// Parses one line from the host (without its newline). Strict: `EPOCH`, one space, a decimal
/// u64 as [`parse_decimal_u64`] takes it, nothing before or after.
pub fn parse_host_line(line: &[u8]) -> HostLine {
    line.strip_prefix(b"EPOCH ")
        .and_then(parse_decimal_u64)
        .map_or(HostLine::Ignored, |n| HostLine::Epoch(Epoch(n)))
}

/// 1–20 ASCII digits and nothing else (no sign, no space), whose value fits a u64.
pub fn parse_decimal_u64(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    digits.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The heartbeat with sequence number `seq`, newline included (at most 24 bytes).
pub fn heartbeat_line(seq: u64) -> String {
    format!("HB {seq}\n")
}

/// The epoch file's contents: the number and a newline (so that `read` in a shell takes it).
pub fn epoch_file_contents(epoch: Epoch) -> String {
    format!("{epoch}\n")
}

/// Reads back what [`epoch_file_contents`] wrote; anything else is `None`.
pub fn parse_epoch_file(contents: &[u8]) -> Option<Epoch> {
    contents
        .strip_suffix(b"\n")
        .and_then(parse_decimal_u64)
        .map(Epoch)
}

/// One line cut from the host's byte stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    /// A line within the bound, without its newline.
    Complete(&'a [u8]),
    /// A line over the bound: discarded whole, up to and including its newline.
    TooLong,
}

/// Splits a byte stream into lines of at most [`HOST_LINE_MAX`] bytes, newline included. An
/// over-long line is never buffered beyond the bound: its bytes are dropped as they come and it is
/// reported once, at its newline, as [`Line::TooLong`].
#[derive(Debug)]
pub struct LineSplitter {
    buf: Vec<u8>,
    overflow: bool,
}

impl Default for LineSplitter {
    fn default() -> Self {
        Self::new()
    }
}

impl LineSplitter {
    pub fn new() -> Self {
        LineSplitter {
            buf: Vec::with_capacity(HOST_LINE_MAX),
            overflow: false,
        }
    }

    /// Cuts `bytes` into lines; the tail after the last newline is kept for the next call.
    pub fn feed(&mut self, bytes: &[u8], mut emit: impl FnMut(Line<'_>)) {
        for &b in bytes {
            if b == b'\n' {
                if self.overflow {
                    emit(Line::TooLong);
                } else {
                    emit(Line::Complete(&self.buf));
                }
                self.buf.clear();
                self.overflow = false;
            } else if self.buf.len() + 1 >= HOST_LINE_MAX {
                // The bound counts the newline: a line holds at most HOST_LINE_MAX - 1 bytes.
                self.overflow = true;
            } else if !self.overflow {
                self.buf.push(b);
            }
        }
    }

    /// Forgets an unfinished line. For when the host goes away: whoever connects next starts a
    /// fresh line, and a fragment must not be glued to its first one (or, worse, read as a line:
    /// `EPOCH 12` cut from `EPOCH 123`).
    pub fn discard_partial(&mut self) {
        self.buf.clear();
        self.overflow = false;
    }

    /// Bytes of the unfinished line held (never more than `HOST_LINE_MAX - 1`).
    pub fn buffered_len(&self) -> usize {
        self.buf.len()
    }
}

/// Which epochs are news. An epoch is announced when it differs from the last one announced
/// (not only when it is greater: a host whose numbering was reset must still be heard), so a
/// repeated `EPOCH <n>` is announced once.
#[derive(Debug, Default)]
pub struct EpochTracker {
    last: Option<Epoch>,
}

impl EpochTracker {
    /// A tracker that has already announced `last` (read back from the epoch file at start, so a
    /// restarted agent does not announce the same rollback twice).
    pub fn new(last: Option<Epoch>) -> Self {
        EpochTracker { last }
    }

    /// Records `epoch`; true if it is new.
    pub fn observe(&mut self, epoch: Epoch) -> bool {
        if self.last == Some(epoch) {
            return false;
        }
        self.last = Some(epoch);
        true
    }

    pub fn last(&self) -> Option<Epoch> {
        self.last
    }
}

/// When heartbeats are due, and their sequence numbers (1 upward).
#[derive(Debug)]
pub struct Heartbeats {
    interval: Duration,
    next_at: Instant,
    seq: u64,
}

impl Heartbeats {
    /// The first heartbeat is due at `now`.
    pub fn new(interval: Duration, now: Instant) -> Self {
        Heartbeats {
            interval,
            next_at: now,
            seq: 0,
        }
    }

    /// The heartbeat line due at `now`, if one is. At most one per call: an agent that was not
    /// scheduled for a while (the guest paused for a snapshot, the port gone) does not catch up
    /// with a burst, it starts a fresh interval.
    pub fn due(&mut self, now: Instant) -> Option<String> {
        if now < self.next_at {
            return None;
        }
        self.seq = self.seq.saturating_add(1);
        self.next_at += self.interval;
        if self.next_at <= now {
            self.next_at = now + self.interval;
        }
        Some(heartbeat_line(self.seq))
    }

    /// How long from `now` until the next heartbeat is due (zero if it is).
    pub fn until_next(&self, now: Instant) -> Duration {
        self.next_at.saturating_duration_since(now)
    }
}

/// The one line waiting to go to the host. The port is non-blocking: a host that is not connected
/// or not reading leaves the line here, and a write may take only part of it.
#[derive(Debug, Default)]
pub struct Outbox {
    buf: Vec<u8>,
    sent: usize,
}

impl Outbox {
    /// Queues `line`, replacing a line none of which went out (a stale heartbeat is worth
    /// nothing). A line partly written is finished first and `line` is dropped (false): cutting
    /// it short would glue its head to the next line.
    pub fn offer(&mut self, line: &[u8]) -> bool {
        if self.sent > 0 {
            return false;
        }
        self.buf.clear();
        self.buf.extend_from_slice(line);
        true
    }

    /// What is still to be written.
    pub fn pending(&self) -> &[u8] {
        &self.buf[self.sent..]
    }

    pub fn is_empty(&self) -> bool {
        self.pending().is_empty()
    }

    /// `n` more bytes went out.
    pub fn advance(&mut self, n: usize) {
        self.sent = (self.sent + n).min(self.buf.len());
        if self.sent == self.buf.len() {
            self.clear();
        }
    }

    /// Drops what is waiting (after a write error: the next heartbeat starts afresh).
    pub fn clear(&mut self) {
        self.buf.clear();
        self.sent = 0;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The fuzz target `host_line`'s kept inputs (byte 0 seeds the chunking): never a panic,
    /// never more than the bound held, every complete line within it.
    #[test]
    fn fuzz_inputs_replay() {
        for (name, bytes) in backstop_common::fuzz_corpus::inputs("host_line") {
            let mut s = LineSplitter::new();
            for b in bytes.iter().skip(1) {
                s.feed(std::slice::from_ref(b), |line| {
                    if let Line::Complete(l) = line {
                        assert!(l.len() < HOST_LINE_MAX, "{name}");
                        let _ = parse_host_line(l);
                    }
                });
                assert!(s.buffered_len() <= HOST_LINE_MAX, "{name}");
            }
        }
    }

    fn split(s: &mut LineSplitter, bytes: &[u8]) -> Vec<Option<Vec<u8>>> {
        let mut got = Vec::new();
        s.feed(bytes, |l| {
            got.push(match l {
                Line::Complete(l) => Some(l.to_vec()),
                Line::TooLong => None,
            })
        });
        got
    }

    #[test]
    fn only_exact_epochs_are_understood() {
        assert_eq!(parse_host_line(b"EPOCH 3"), HostLine::Epoch(Epoch(3)));
        assert_eq!(parse_host_line(b"EPOCH 0"), HostLine::Epoch(Epoch(0)));
        assert_eq!(parse_host_line(b"EPOCH 007"), HostLine::Epoch(Epoch(7)));
        assert_eq!(
            parse_host_line(b"EPOCH 18446744073709551615"),
            HostLine::Epoch(Epoch(u64::MAX))
        );
        for bad in [
            &b""[..],
            b"EPOCH",
            b"EPOCH ",
            b"EPOCH  3",
            b"EPOCH 3 ",
            b" EPOCH 3",
            b"EPOCH 3\r",
            b"EPOCH\t3",
            b"epoch 3",
            b"EPOCH +3",
            b"EPOCH -3",
            b"EPOCH 3x",
            b"EPOCH 0x10",
            b"EPOCH 1e3",
            b"EPOCH 3\x00",
            b"EPOCH \xef\xbc\x93", // a full-width digit three
            b"HB 3",
            b"\xff\xfe",
            b"EPOCH 3 because the operator said so",
        ] {
            assert_eq!(parse_host_line(bad), HostLine::Ignored, "{bad:?}");
        }
    }

    #[test]
    fn epochs_beyond_u64_are_ignored() {
        assert_eq!(
            parse_host_line(b"EPOCH 18446744073709551616"),
            HostLine::Ignored
        );
        assert_eq!(
            parse_host_line(b"EPOCH 99999999999999999999"),
            HostLine::Ignored
        );
        // 21 digits, even with a value that would fit: too long.
        assert_eq!(
            parse_host_line(b"EPOCH 000000000000000000001"),
            HostLine::Ignored
        );
        assert_eq!(parse_decimal_u64(b"00000000000000000001"), Some(1));
    }

    #[test]
    fn lines_are_cut_at_newlines_across_feeds() {
        let mut s = LineSplitter::new();
        assert_eq!(split(&mut s, b"EPO"), Vec::<Option<Vec<u8>>>::new());
        assert_eq!(s.buffered_len(), 3);
        assert_eq!(
            split(&mut s, b"CH 3\n\nEPOCH 4\nEP"),
            vec![
                Some(b"EPOCH 3".to_vec()),
                Some(vec![]),
                Some(b"EPOCH 4".to_vec())
            ]
        );
        assert_eq!(split(&mut s, b"OCH 5\n"), vec![Some(b"EPOCH 5".to_vec())]);
        assert_eq!(s.buffered_len(), 0);
    }

    #[test]
    fn the_line_limit_counts_the_newline() {
        let mut s = LineSplitter::new();
        let longest = vec![b'7'; HOST_LINE_MAX - 1];
        let one_more = vec![b'7'; HOST_LINE_MAX];
        assert_eq!(split(&mut s, &longest), vec![]);
        assert_eq!(split(&mut s, b"\n"), vec![Some(longest)]);
        assert_eq!(split(&mut s, &one_more), vec![]);
        assert_eq!(split(&mut s, b"\n"), vec![None]);
    }

    #[test]
    fn an_over_long_line_is_dropped_whole_even_if_it_ends_like_an_epoch() {
        let mut s = LineSplitter::new();
        let mut flood = vec![b'x'; 100_000];
        flood.extend_from_slice(b"EPOCH 7\nEPOCH 8\n");
        assert_eq!(split(&mut s, &flood), vec![None, Some(b"EPOCH 8".to_vec())]);
        assert!(s.buf.capacity() <= 2 * HOST_LINE_MAX);
        // An over-long epoch: all digits, too many of them.
        let mut long_epoch = b"EPOCH ".to_vec();
        long_epoch.extend_from_slice(&[b'1'; HOST_LINE_MAX]);
        long_epoch.push(b'\n');
        assert_eq!(split(&mut s, &long_epoch), vec![None]);
    }

    #[test]
    fn a_discarded_fragment_is_not_glued_to_the_next_line() {
        let mut s = LineSplitter::new();
        assert_eq!(split(&mut s, b"EPOCH 12"), vec![]);
        s.discard_partial();
        assert_eq!(split(&mut s, b"EPOCH 3\n"), vec![Some(b"EPOCH 3".to_vec())]);
        // Also in the middle of an over-long line.
        assert_eq!(split(&mut s, &[b'x'; 200]), vec![]);
        s.discard_partial();
        assert_eq!(split(&mut s, b"EPOCH 4\n"), vec![Some(b"EPOCH 4".to_vec())]);
    }

    #[test]
    fn an_epoch_is_announced_once_and_any_change_is_news() {
        let mut t = EpochTracker::default();
        assert!(t.observe(Epoch(3)));
        assert!(!t.observe(Epoch(3)));
        assert!(t.observe(Epoch(4)));
        assert!(
            t.observe(Epoch(1)),
            "a host that starts again from 1 is heard"
        );
        assert_eq!(t.last(), Some(Epoch(1)));
        let mut restarted = EpochTracker::new(Some(Epoch(4)));
        assert!(!restarted.observe(Epoch(4)));
        assert!(restarted.observe(Epoch(5)));
    }

    #[test]
    fn the_epoch_file_round_trips_and_nothing_else_reads_back() {
        for n in [0, 3, u64::MAX] {
            let c = epoch_file_contents(Epoch(n));
            assert_eq!(parse_epoch_file(c.as_bytes()), Some(Epoch(n)));
        }
        assert_eq!(epoch_file_contents(Epoch(3)), "3\n");
        for bad in [
            &b""[..],
            b"\n",
            b"3",
            b"3\n\n",
            b" 3\n",
            b"x\n",
            b"18446744073709551616\n",
        ] {
            assert_eq!(parse_epoch_file(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn heartbeat_lines_fit_the_hosts_bound() {
        assert_eq!(heartbeat_line(1), "HB 1\n");
        assert!(heartbeat_line(u64::MAX).len() <= HOST_LINE_MAX);
    }

    #[test]
    fn heartbeats_come_once_per_interval_numbered_from_one_without_bursts() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut h = Heartbeats::new(ms(1000), t0);
        assert_eq!(h.due(t0).as_deref(), Some("HB 1\n"));
        assert_eq!(h.due(t0), None);
        assert_eq!(h.until_next(t0 + ms(400)), ms(600));
        assert_eq!(h.due(t0 + ms(999)), None);
        // A late wake-up keeps the cadence…
        assert_eq!(h.due(t0 + ms(1010)).as_deref(), Some("HB 2\n"));
        assert_eq!(h.until_next(t0 + ms(1010)), ms(990));
        // …a long stall gives one heartbeat, not one per missed interval.
        assert_eq!(h.due(t0 + ms(10_000)).as_deref(), Some("HB 3\n"));
        assert_eq!(h.due(t0 + ms(10_001)), None);
        assert_eq!(h.until_next(t0 + ms(10_000)), ms(1000));
        assert_eq!(h.until_next(t0 + ms(20_000)), Duration::ZERO);
    }

    #[test]
    fn a_stale_line_is_replaced_and_a_partial_one_finished_first() {
        let mut o = Outbox::default();
        assert!(o.is_empty());
        assert!(o.offer(b"HB 1\n"));
        assert!(o.offer(b"HB 2\n"), "nothing of HB 1 went out: replaced");
        assert_eq!(o.pending(), b"HB 2\n");
        o.advance(2);
        assert!(!o.offer(b"HB 3\n"), "HB 2 is half out: finished first");
        assert_eq!(o.pending(), b" 2\n");
        o.advance(3);
        assert!(o.is_empty());
        assert!(o.offer(b"HB 4\n"));
        o.clear();
        assert!(o.is_empty());
        assert!(o.offer(b"HB 5\n"));
        o.advance(100);
        assert!(o.is_empty());
    }

    proptest! {
        /// However the host's bytes are cut into reads, the same lines come out, each within the
        /// bound, and no more than the bound is ever held.
        #[test]
        fn splitting_is_independent_of_chunking_and_bounded(
            bytes in proptest::collection::vec(
                prop_oneof![Just(b'\n'), Just(b'E'), any::<u8>()], 0..600),
            cuts in proptest::collection::vec(1usize..80, 1..20),
        ) {
            let whole = split(&mut LineSplitter::new(), &bytes);
            let mut s = LineSplitter::new();
            let mut chunked = Vec::new();
            let mut rest = &bytes[..];
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (now, later) = rest.split_at((*cut).min(rest.len()));
                chunked.extend(split(&mut s, now));
                prop_assert!(s.buffered_len() < HOST_LINE_MAX);
                rest = later;
            }
            prop_assert_eq!(&whole, &chunked);
            for line in whole.iter().flatten() {
                prop_assert!(line.len() < HOST_LINE_MAX);
                prop_assert!(!line.contains(&b'\n'));
            }
        }

        #[test]
        fn every_u64_epoch_parses_back(n in any::<u64>()) {
            let line = format!("EPOCH {n}");
            prop_assert_eq!(parse_host_line(line.as_bytes()), HostLine::Epoch(Epoch(n)));
        }
    }
}
