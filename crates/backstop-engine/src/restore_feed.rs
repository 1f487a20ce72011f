//! Feeding a verified state stream into the fresh VM's loader (a rollback's `load` phase).
//!
//! The rollback reads (and re-checks) chunks into 1 MiB buffers on one thread and hands them to
//! the loader on another. A backend that loads from a pipe (QEMU, `migrate-incoming fd:`) gets
//! the buffers' pages with `vmsplice` instead of a copy into the pipe: measured on QEMU 10, the
//! copy and the pipe lock held across it cost QEMU's loader time spinning on that lock
//! (`mutex_spin_on_owner`) while the feed copied.
//!
//! `vmsplice` without `SPLICE_F_GIFT` puts references to the caller's pages into the pipe; the
//! pages must not change until the reader has consumed them. A pipe holds at most
//! `capacity / 4096` page slots and a slot holds at most a page, so once `capacity` more bytes
//! went in after a buffer, every slot of that buffer has left the pipe: only then is it handed
//! back to be refilled. The last buffers are kept, unchanged, until the loader is done with the
//! whole stream ([`Held`]). Where `vmsplice` is refused, the feed copies each buffer into the pipe
//! (`write`).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice, Write};

/// Where the stream goes.
pub(crate) enum Sink {
    /// The write end of the pipe the loader reads.
    Pipe(File),
    /// Anything else: written (copied).
    Writer(Box<dyn Write + Send>),
}

/// Buffers whose pages may still be in the pipe: drop only after the loader finished.
pub(crate) struct Held {
    _buffers: VecDeque<(u64, Vec<u8>)>,
}

pub(crate) struct Feed {
    sink: Sink,
    /// Bytes the pipe holds at most (`F_GETPIPE_SZ`).
    capacity: u64,
    /// Bytes handed over so far.
    total: u64,
    /// Buffers spliced, with the stream offset where each ends, oldest first.
    in_pipe: VecDeque<(u64, Vec<u8>)>,
    /// `vmsplice` was refused once: copy from then on.
    copy: bool,
}

impl Feed {
    pub(crate) fn new(sink: Sink) -> Feed {
        let capacity = match &sink {
            Sink::Pipe(p) => nix::fcntl::fcntl(p, nix::fcntl::FcntlArg::F_GETPIPE_SZ)
                .map_or(0, |n| u64::try_from(n).unwrap_or(0)),
            Sink::Writer(_) => 0,
        };
        Feed {
            copy: capacity == 0,
            sink,
            capacity,
            total: 0,
            in_pipe: VecDeque::new(),
        }
    }

    /// Whether buffers are handed over by reference (`vmsplice`) rather than copied.
    pub(crate) fn splices(&self) -> bool {
        matches!(self.sink, Sink::Pipe(_)) && !self.copy
    }

    /// Hands `buf` to the loader (blocking while the pipe is full). Returns the buffers that
    /// may be refilled now: `buf` itself when it was copied, older spliced ones once enough
    /// followed them.
    pub(crate) fn push(&mut self, buf: Vec<u8>) -> io::Result<Vec<Vec<u8>>> {
        let mut sent = 0;
        if let (Sink::Pipe(pipe), false) = (&self.sink, self.copy) {
            while sent < buf.len() {
                match nix::fcntl::vmsplice(
                    pipe,
                    &[IoSlice::new(&buf[sent..])],
                    nix::fcntl::SpliceFFlags::empty(),
                ) {
                    Ok(n) => sent += n,
                    Err(nix::errno::Errno::EINTR) => {}
                    Err(e @ (nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS)) => {
                        tracing::debug!(error = %e, "vmsplice refused: copying into the pipe");
                        self.copy = true;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if sent < buf.len() {
            match &mut self.sink {
                Sink::Pipe(p) => p.write_all(&buf[sent..])?,
                Sink::Writer(w) => w.write_all(&buf[sent..])?,
            }
        }
        self.total += buf.len() as u64;
        if sent == 0 {
            return Ok(vec![buf]);
        }
        self.in_pipe.push_back((self.total, buf));
        let mut free = Vec::new();
        while let Some((end, _)) = self.in_pipe.front() {
            if self.total - end < self.capacity {
                break;
            }
            if let Some((_, b)) = self.in_pipe.pop_front() {
                free.push(b);
            }
        }
        Ok(free)
    }

    /// Ends the stream (the loader sees EOF). The returned buffers must outlive the load.
    pub(crate) fn finish(self) -> io::Result<Held> {
        match self.sink {
            Sink::Pipe(p) => drop(p),
            Sink::Writer(mut w) => {
                w.flush()?;
                drop(w);
            }
        }
        Ok(Held {
            _buffers: self.in_pipe,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use std::io::Read;

    use super::*;

    fn pipe() -> (File, File) {
        let (r, w) = nix::unistd::pipe().unwrap();
        (File::from(r), File::from(w))
    }

    /// What goes in by `vmsplice` comes out byte for byte, though every buffer handed back is
    /// overwritten at once by the producer (as the rollback's reader refills it): a buffer is
    /// only handed back once its pages can no longer be in the pipe.
    #[test]
    fn spliced_buffers_come_back_only_when_the_pipe_no_longer_holds_them() {
        let (mut r, w) = pipe();
        // A small pipe (16 pages) and a slow reader make reuse too early show up as garbage.
        nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 16)).unwrap();
        let reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            let mut buf = vec![0u8; 4096];
            loop {
                std::thread::sleep(std::time::Duration::from_micros(50));
                match r.read(&mut buf).unwrap() {
                    0 => return out,
                    n => out.extend_from_slice(&buf[..n]),
                }
            }
        });
        let mut feed = Feed::new(Sink::Pipe(w));
        assert!(feed.splices());
        assert_eq!(feed.capacity, 1 << 16);
        let mut free: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 20_000]).collect();
        let mut want = Vec::new();
        for i in 0..200u32 {
            let mut b = free.pop().unwrap_or_else(|| vec![0u8; 20_000]);
            // Fill the buffer with this round's pattern: a reused buffer still in the pipe
            // would show the reader a later round's bytes.
            for (j, x) in b.iter_mut().enumerate() {
                *x = (i as usize * 7 + j / 4096) as u8;
            }
            want.extend_from_slice(&b);
            for mut back in feed.push(b).unwrap() {
                back.iter_mut().for_each(|x| *x = 0xee);
                free.push(back);
            }
        }
        let held = feed.finish().unwrap();
        let got = reader.join().unwrap();
        drop(held);
        assert_eq!(got.len(), want.len());
        assert!(
            got == want,
            "the reader saw bytes of a buffer reused too early"
        );
    }

    /// A sink that is not a pipe is written, and each buffer is free again at once.
    #[test]
    fn a_plain_writer_copies_and_frees_each_buffer_at_once() {
        let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut feed = Feed::new(Sink::Writer(Box::new(Shared(out.clone()))));
        assert!(!feed.splices());
        let back = feed.push(vec![1, 2, 3]).unwrap();
        assert_eq!(back, vec![vec![1, 2, 3]]);
        feed.finish().unwrap();
        assert_eq!(*out.lock().unwrap(), vec![1, 2, 3]);
    }
}
