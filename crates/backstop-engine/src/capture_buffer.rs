//! Bounds how long a slow store can stall the guest during a capture.
//!
//! A background snapshot write-protects guest RAM and QEMU saves each page before the guest may
//! write it again; QEMU writes the pages into the capture pipe. If the store stops reading (a slow
//! or stalled disk), the pipe fills, QEMU blocks, and every guest write to a not-yet-saved page
//! waits: the guest is frozen while `pause_us` says ~10 ms. So a thread here reads the pipe,
//! whatever the store does, into a bounded buffer the store consumes (its only waits are 0.5 ms
//! naps while the pipe is nearly empty, see [`GATHER`]); when the buffer stays full longer than
//! the bound, the capture is abandoned: the thread reads the rest of the stream and discards it,
//! so QEMU completes its capture and lifts the protection, and the store's next read fails with
//! [`STALLED`]. What the guest saw (the longest time the thread could not hand a block over, the
//! pipe unread meanwhile) is reported with the capture.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Read size from the pipe, and the unit of the buffer.
const BLOCK: usize = 1 << 20;
/// A read shorter than this found the pipe nearly empty: wait [`GATHER`] before the next.
const SHORT_READ: usize = 128 << 10;
const GATHER: Duration = Duration::from_micros(500);

/// The message of the error the store's read returns once the capture was abandoned.
pub(crate) const STALLED: &str = "capture abandoned: the store stalled the guest past the bound";

/// What the reading thread tells the capture.
#[derive(Default)]
pub(crate) struct StallReport {
    /// Set once the capture was abandoned: how long the store had not taken a block, in ms.
    abandoned_after_ms: AtomicU64,
    abandoned: AtomicBool,
    /// The longest time the pipe went unread because the buffer was full, in ms.
    longest_ms: AtomicU64,
    /// The consumer is gone (capture failed elsewhere): drain, hand nothing over.
    consumer_gone: AtomicBool,
}

impl StallReport {
    /// `Some(ms)` when the capture was abandoned for a stalled store.
    pub(crate) fn abandoned_after_ms(&self) -> Option<u64> {
        self.abandoned
            .load(Ordering::SeqCst)
            .then(|| self.abandoned_after_ms.load(Ordering::SeqCst))
    }

    /// The longest stall of the pipe the store caused, in ms (the guest's writes to unsaved
    /// pages waited at most this long, plus QEMU's own time).
    pub(crate) fn longest_ms(&self) -> u64 {
        self.longest_ms.load(Ordering::SeqCst)
    }
}

/// The store's side: a `Read` over the buffered blocks.
pub(crate) struct Buffered {
    rx: Receiver<std::io::Result<Vec<u8>>>,
    /// Emptied blocks, back to the reading thread.
    give_back: std::sync::mpsc::Sender<Vec<u8>>,
    block: Vec<u8>,
    pos: usize,
    report: Arc<StallReport>,
}

/// Starts reading `src` on its own thread into a buffer of `capacity` (rounded up to whole
/// 1 MiB blocks); past `bound` with the buffer full the capture is abandoned (see the module).
pub(crate) fn buffered(
    mut src: Box<dyn Read + Send>,
    capacity: usize,
    bound: Duration,
) -> std::io::Result<(Buffered, Arc<StallReport>)> {
    let blocks = capacity.div_ceil(BLOCK).max(1);
    let (tx, rx) = sync_channel::<std::io::Result<Vec<u8>>>(blocks);
    // Blocks the store has emptied come back for the next reads: no allocation (and no page
    // faults on fresh memory) per block once the buffer has been around once.
    let (give_back, spare) = std::sync::mpsc::channel::<Vec<u8>>();
    let report = Arc::new(StallReport::default());
    let shared = Arc::clone(&report);
    std::thread::Builder::new()
        .name("capture-read".into())
        .spawn(move || {
            let mut buf = vec![0u8; BLOCK];
            let mut filled = 0;
            loop {
                let n = match src.read(&mut buf[filled..]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let _ = tx.try_send(Err(e));
                        return;
                    }
                };
                let draining = shared.abandoned.load(Ordering::SeqCst)
                    || shared.consumer_gone.load(Ordering::SeqCst);
                if draining {
                    if n == 0 {
                        return;
                    }
                    filled = 0;
                    continue; // Draining: QEMU must reach the end of its capture.
                }
                filled += n;
                if n != 0 && filled < BLOCK {
                    if n < SHORT_READ {
                        // QEMU writes a page record at a time (strace of a 1 GiB guest's
                        // capture: ~262,000 writes for a 504 MB stream). A reader waiting on
                        // the pipe is woken for each one, which costs QEMU's migration thread
                        // and this one a CPU each on a 2-core host; a short nap lets the pipe
                        // gather a few hundred KiB first. The pipe (1 MiB) holds ~4 ms of
                        // QEMU's stream: it never fills meanwhile.
                        std::thread::sleep(GATHER);
                    }
                    continue;
                }
                if filled == 0 {
                    return; // The stream ended on a block boundary.
                }
                let next = spare.try_recv().unwrap_or_else(|_| vec![0u8; BLOCK]);
                let mut block = std::mem::replace(&mut buf, next);
                block.truncate(filled);
                let end = n == 0;
                filled = 0;
                let mut item = Ok(block);
                let mut blocked: Option<Instant> = None;
                loop {
                    match tx.try_send(item) {
                        Ok(()) => break,
                        Err(TrySendError::Disconnected(_)) => {
                            shared.consumer_gone.store(true, Ordering::SeqCst);
                            break;
                        }
                        Err(TrySendError::Full(back)) => {
                            item = back;
                            let since = *blocked.get_or_insert_with(Instant::now);
                            let waited = since.elapsed();
                            shared
                                .longest_ms
                                .fetch_max(waited.as_millis() as u64, Ordering::SeqCst);
                            if waited > bound {
                                shared
                                    .abandoned_after_ms
                                    .store(waited.as_millis() as u64, Ordering::SeqCst);
                                shared.abandoned.store(true, Ordering::SeqCst);
                                tracing::warn!(
                                    waited_ms = waited.as_millis() as u64,
                                    "the store stalls the capture: abandoned, draining the stream"
                                );
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                }
                if end {
                    return;
                }
            }
        })?;
    Ok((
        Buffered {
            rx,
            give_back,
            block: Vec::new(),
            pos: 0,
            report: Arc::clone(&report),
        },
        report,
    ))
}

impl Read for Buffered {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.report.abandoned.load(Ordering::SeqCst) {
            return Err(std::io::Error::other(STALLED));
        }
        if self.pos == self.block.len() {
            match self.rx.recv() {
                Ok(Ok(block)) => {
                    let mut used = std::mem::replace(&mut self.block, block);
                    if used.capacity() == BLOCK {
                        used.resize(BLOCK, 0);
                        let _ = self.give_back.send(used);
                    }
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                // The thread ended: the stream is over (or abandoned just now).
                Err(_) if self.report.abandoned.load(Ordering::SeqCst) => {
                    return Err(std::io::Error::other(STALLED))
                }
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.block.len() - self.pos);
        out[..n].copy_from_slice(&self.block[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        // Whatever ended the capture, the thread drains the rest so QEMU can finish.
        self.report.consumer_gone.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source of `len` bytes (a counter pattern) that counts how much was read from it.
    struct Source {
        left: usize,
        next: u8,
        read: Arc<AtomicU64>,
    }

    impl Read for Source {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let n = out.len().min(self.left).min(64 << 10);
            for b in &mut out[..n] {
                *b = self.next;
                self.next = self.next.wrapping_add(1);
            }
            self.left -= n;
            self.read.fetch_add(n as u64, Ordering::SeqCst);
            Ok(n)
        }
    }

    fn source(len: usize) -> (Box<dyn Read + Send>, Arc<AtomicU64>) {
        let read = Arc::new(AtomicU64::new(0));
        let s = Source {
            left: len,
            next: 0,
            read: Arc::clone(&read),
        };
        (Box::new(s), read)
    }

    #[test]
    fn a_store_that_keeps_up_gets_the_stream_exactly() {
        let (src, _) = source(5 << 20 | 123);
        let (mut b, report) = buffered(src, 2 << 20, Duration::from_secs(5)).unwrap();
        let mut all = Vec::new();
        b.read_to_end(&mut all).unwrap();
        assert_eq!(all.len(), 5 << 20 | 123);
        assert!(all.iter().enumerate().all(|(i, &x)| x == i as u8));
        assert_eq!(report.abandoned_after_ms(), None);
    }

    #[test]
    fn small_reads_reach_the_store_in_whole_blocks() {
        // QEMU writes the pipe a page record at a time; the store still gets 1 MiB blocks.
        let (src, _) = source(3 * BLOCK + 4096);
        let (mut b, _) = buffered(src, 8 * BLOCK, Duration::from_secs(5)).unwrap();
        let mut got = Vec::new();
        let mut one = [0u8; 1];
        while b.read(&mut one).unwrap() == 1 {
            if b.pos == 1 {
                got.push(b.block.len());
            }
        }
        assert_eq!(got, vec![BLOCK, BLOCK, BLOCK, 4096]);
    }

    #[test]
    fn a_stalled_store_abandons_the_capture_and_the_stream_is_drained_to_its_end() {
        let len = 64 << 20;
        let (src, read) = source(len);
        let (mut b, report) = buffered(src, 2 << 20, Duration::from_millis(100)).unwrap();
        let mut first = [0u8; 10];
        b.read_exact(&mut first).unwrap();
        // The store stalls: the source is still read to its end (QEMU is not left blocked).
        let deadline = Instant::now() + Duration::from_secs(20);
        while read.load(Ordering::SeqCst) < len as u64 {
            assert!(Instant::now() < deadline, "the stream was not drained");
            std::thread::sleep(Duration::from_millis(10));
        }
        let waited = report.abandoned_after_ms().expect("abandoned");
        assert!(waited >= 100, "{waited}");
        assert!(report.longest_ms() >= 100);
        let err = b.read(&mut first).unwrap_err();
        assert_eq!(err.to_string(), STALLED);
    }

    #[test]
    fn a_consumer_that_gives_up_leaves_the_stream_drained() {
        let len = 32 << 20;
        let (src, read) = source(len);
        let (b, report) = buffered(src, 1 << 20, Duration::from_secs(60)).unwrap();
        drop(b);
        let deadline = Instant::now() + Duration::from_secs(20);
        while read.load(Ordering::SeqCst) < len as u64 {
            assert!(Instant::now() < deadline, "the stream was not drained");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(report.abandoned_after_ms(), None, "not a stall");
    }
}
