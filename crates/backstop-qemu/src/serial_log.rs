//! The guest's serial console, written to its log by backstop, within a size bound.
//!
//! The guest is untrusted and its console is guest-driven output: a guest printing nonstop
//! writes ~400 KiB/s, and a log QEMU appends to by itself fills the state filesystem (shared with
//! the store and the journal) until snapshots fail for lack of space. So QEMU writes into a FIFO
//! and one thread here copies it to the log, rotating it (`log` → `log.1`, the older `.1`
//! dropped) whenever it would exceed the bound: the console never takes more than twice the
//! bound on disk.
//!
//! The FIFO is opened read-write before QEMU starts and stays open across QEMU restarts
//! (rollbacks), so QEMU's open never blocks and nothing the guest prints early is lost; the
//! thread always reads, so QEMU's writes never block on a full pipe, even when the log cannot
//! be written (a full disk drops console output, never the guest).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub(crate) struct SerialLog {
    fifo: PathBuf,
    /// Our read-write end: it keeps the FIFO open between QEMUs and wakes the thread at drop.
    wake: File,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SerialLog {
    /// Makes the FIFO (replacing whatever is at `fifo`) and starts copying it into `log`,
    /// keeping `log` at most `max_bytes` long.
    pub(crate) fn start(fifo: &Path, log: &Path, max_bytes: u64) -> std::io::Result<SerialLog> {
        let _ = std::fs::remove_file(fifo);
        let c = CString::new(fifo.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::other("NUL in the serial FIFO path"))?;
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Read-write: a FIFO opened so never blocks and never reads EOF between writers.
        let reader = OpenOptions::new().read(true).write(true).open(fifo)?;
        let wake = reader.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut sink = Rotating::open(log.to_path_buf(), max_bytes.max(1))?;
        let thread = {
            let stop = Arc::clone(&stop);
            let mut reader = reader;
            std::thread::Builder::new()
                .name("serial-log".into())
                .spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    while !stop.load(Ordering::Relaxed) {
                        match reader.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) if !stop.load(Ordering::Relaxed) => sink.write(&buf[..n]),
                            Ok(_) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(_) => break,
                        }
                    }
                })?
        };
        Ok(SerialLog {
            fifo: fifo.to_path_buf(),
            wake,
            stop,
            thread: Some(thread),
        })
    }

    /// Writes a line of backstop's own into the console log, in order with the guest's output:
    /// it goes through the FIFO (one write under `PIPE_BUF` bytes, so never torn), after every
    /// byte a QEMU wrote before it. A guest can print the same text; it is a reader's landmark,
    /// not evidence.
    pub(crate) fn note(&self, line: &str) {
        let text = format!("\n[backstop] {line}\n");
        debug_assert!(text.len() < 4096);
        let _ = (&self.wake).write_all(text.as_bytes());
    }
}

impl Drop for SerialLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // One byte wakes the reader; it sees `stop` and ends without logging it.
        let _ = self.wake.write_all(b"\n");
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.fifo);
    }
}

/// An append-only file that is moved to `<path>.1` before it would grow past `max` bytes.
struct Rotating {
    path: PathBuf,
    file: Option<File>,
    len: u64,
    max: u64,
}

impl Rotating {
    fn open(path: PathBuf, max: u64) -> std::io::Result<Rotating> {
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let len = file.metadata()?.len();
        Ok(Rotating {
            path,
            file: Some(file),
            len,
            max,
        })
    }

    /// Writes what fits; output that cannot be written (a full disk) is dropped.
    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.len >= self.max {
                self.rotate();
            }
            let room = (self.max - self.len.min(self.max)) as usize;
            let n = bytes.len().min(room.max(1));
            let Some(f) = self.file.as_mut() else { return };
            if f.write_all(&bytes[..n]).is_err() {
                return;
            }
            self.len += n as u64;
            bytes = &bytes[n..];
        }
    }

    fn rotate(&mut self) {
        self.file = None;
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let _ = std::fs::rename(&self.path, &old);
        self.file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&self.path)
            .ok();
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (5 s at most) until the copying thread has made `log` hold exactly `want`.
    fn wait_for_log(log: &Path, want: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_to_string(log).unwrap() != want {
            assert!(
                std::time::Instant::now() < deadline,
                "log: {:?}",
                std::fs::read_to_string(log)
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn the_log_rotates_at_the_bound_and_keeps_the_newest_output() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("vm-serial.log");
        let mut r = Rotating::open(log.clone(), 100).unwrap();
        for i in 0..50u32 {
            r.write(format!("line {i:04}\n").as_bytes()); // 10 bytes each
        }
        let newest = std::fs::read_to_string(&log).unwrap();
        let older = std::fs::read_to_string(d.path().join("vm-serial.log.1")).unwrap();
        assert!(newest.len() <= 100 && older.len() <= 100);
        assert!(newest.ends_with("line 0049\n"), "{newest}");
        assert_eq!(older.len(), 100);
        assert!(older.ends_with("line 0039\n"), "{older}");
    }

    #[test]
    fn a_note_lands_between_the_output_written_before_and_after_it() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let fifo = d.path().join("serial.fifo");
        let s = SerialLog::start(&fifo, &log, 1 << 20).unwrap();
        let mut old = OpenOptions::new().append(true).open(&fifo).unwrap();
        old.write_all(b"old guest\n").unwrap();
        s.note("restored");
        let mut new = OpenOptions::new().append(true).open(&fifo).unwrap();
        new.write_all(b"new guest\n").unwrap();
        wait_for_log(&log, "old guest\n\n[backstop] restored\nnew guest\n");
    }

    #[test]
    fn what_qemu_writes_into_the_fifo_reaches_the_log_across_writers() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let fifo = d.path().join("serial.fifo");
        let s = SerialLog::start(&fifo, &log, 1 << 20).unwrap();
        // Two writers one after the other, as two QEMUs across a rollback.
        for text in ["first qemu\n", "second qemu\n"] {
            let mut w = OpenOptions::new().append(true).open(&fifo).unwrap();
            w.write_all(text.as_bytes()).unwrap();
        }
        wait_for_log(&log, "first qemu\nsecond qemu\n");
        drop(s);
        assert!(!d.path().join("serial.fifo").exists());
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "first qemu\nsecond qemu\n",
            "the wake-up byte is not logged"
        );
    }
}
