//! QEMU's own reports, the moment QEMU sends them (from a watchdog expiry to the guest running
//! again from its snapshot: ≤ 0.3 s).
//!
//! The VM's actor reads QEMU's events on its monitor when it looks at the VM — between jobs,
//! at its idle tick (250 ms). A fired i6300esb (`WATCHDOG`), a guest that panicked or shut down,
//! or a QEMU that died would wait for that look. So every QEMU backstop starts has a second,
//! listen-only monitor, `events.sock` in its run directory: a thread reads it and wakes the
//! actor ([`EventWaker`]) on an event that calls for one, or when the monitor closes (QEMU
//! ended). The actor then looks at once and reads the same events on its own monitor (QEMU
//! sends every event to every monitor), so nothing is decided here and nothing is lost if this
//! thread is late or gone: the tick still finds it.
//!
//! The thread never sends a command after the handshake. What it reads is bounded like any QMP
//! reply ([`crate::qmp::MAX_QMP_LINE`]); a protocol error ends it (with a wake).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use backstop_hypervisor::{BackendError, EventWaker, Result};

use crate::qmp::Qmp;

/// The listen-only monitor's socket, in the QEMU's run directory.
pub(crate) const EVENTS_SOCKET: &str = "events.sock";

/// Whether QEMU's event `name` calls for a look at the VM now (what `poll_events` acts on).
pub(crate) fn wakes(name: &str) -> bool {
    matches!(name, "WATCHDOG" | "SHUTDOWN" | "GUEST_PANICKED")
}

/// The thread reading one QEMU's events monitor; stopped (and joined) when dropped.
pub(crate) struct EventWatch {
    stop: Arc<AtomicBool>,
    closed: Arc<AtomicBool>,
    conn: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl EventWatch {
    /// Connects to the events monitor at `path` (QEMU made it when it started) and starts
    /// reading it.
    pub(crate) fn start(path: &Path, timeout: Duration, waker: EventWaker) -> Result<EventWatch> {
        let mut qmp = Qmp::connect(path, timeout, || None)?;
        let conn = qmp.stream_handle().map_err(|source| BackendError::Io {
            step: "events monitor",
            source,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let closed = Arc::new(AtomicBool::new(false));
        let (thread_stop, thread_closed) = (Arc::clone(&stop), Arc::clone(&closed));
        let thread = std::thread::Builder::new()
            .name("qemu-events".into())
            .spawn(move || loop {
                match qmp.next_event("events monitor", Duration::from_secs(3600)) {
                    Ok(ev) if wakes(&ev.name) => {
                        tracing::debug!(event = %ev.name, "QEMU event: waking the VM's actor");
                        waker();
                    }
                    Ok(_) | Err(BackendError::Timeout { .. }) => {}
                    Err(e) => {
                        // Closed: QEMU ended (or this watch is being stopped). Either way the
                        // actor looks now; a stop asked for wakes nobody.
                        if !thread_stop.load(Ordering::SeqCst) {
                            tracing::debug!(error = %e, "QEMU's events monitor closed");
                            thread_closed.store(true, Ordering::SeqCst);
                            waker();
                        }
                        return;
                    }
                }
            })
            .map_err(|source| BackendError::Io {
                step: "start the events thread",
                source,
            })?;
        Ok(EventWatch {
            stop,
            closed,
            conn,
            thread: Some(thread),
        })
    }

    /// Whether the monitor closed on its own since the last call (QEMU is ending): asked once,
    /// so that whoever looks can wait a moment for the process to be reapable.
    pub(crate) fn take_closed(&self) -> bool {
        self.closed.swap(false, Ordering::SeqCst)
    }
}

impl Drop for EventWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    /// A monitor that greets, accepts `qmp_capabilities`, then sends `lines` and (if `close`)
    /// hangs up; otherwise it keeps the connection open until the client goes.
    fn monitor(dir: &Path, lines: Vec<String>, close: bool) -> std::thread::JoinHandle<()> {
        let listener = UnixListener::bind(dir.join(EVENTS_SOCKET)).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
                .unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut cmd = String::new();
            r.read_line(&mut cmd).unwrap();
            assert!(cmd.contains("qmp_capabilities"), "{cmd}");
            let id: serde_json::Value = serde_json::from_str(&cmd).unwrap();
            s.write_all(format!("{{\"return\": {{}}, \"id\": {}}}\r\n", id["id"]).as_bytes())
                .unwrap();
            for l in lines {
                s.write_all(l.as_bytes()).unwrap();
                s.write_all(b"\r\n").unwrap();
            }
            if !close {
                // Until the client shuts the connection down.
                let mut rest = String::new();
                let _ = r.read_line(&mut rest);
            }
        })
    }

    fn event(name: &str) -> String {
        format!("{{\"event\": \"{name}\", \"data\": {{}}, \"timestamp\": {{\"seconds\": 1, \"microseconds\": 2}}}}")
    }

    /// A watch on a fake monitor that sends `lines` (then hangs up if `close`), and how many
    /// times it woke its actor.
    struct Watched {
        _dir: tempfile::TempDir,
        server: std::thread::JoinHandle<()>,
        watch: EventWatch,
        woken: Arc<AtomicUsize>,
    }

    fn watched(lines: Vec<String>, close: bool) -> Watched {
        let dir = tempfile::tempdir().unwrap();
        let server = monitor(dir.path(), lines, close);
        let woken = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&woken);
        let waker: EventWaker = Arc::new(move || {
            count.fetch_add(1, Ordering::SeqCst);
        });
        let watch = EventWatch::start(
            &dir.path().join(EVENTS_SOCKET),
            Duration::from_secs(5),
            waker,
        )
        .unwrap();
        Watched {
            _dir: dir,
            server,
            watch,
            woken,
        }
    }

    fn wait_for(n: &AtomicUsize, want: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while n.load(Ordering::SeqCst) < want {
            assert!(
                Instant::now() < deadline,
                "woken {} times, want {want}",
                n.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_events_that_matter_wake_and_others_do_not() {
        let lines = vec![
            event("STOP"),
            event("RESUME"),
            event("WATCHDOG"),
            "{\"return\": {}, \"id\": 99}".into(),
            event("GUEST_PANICKED"),
            event("SHUTDOWN"),
        ];
        let Watched {
            _dir,
            server,
            watch: w,
            woken: n,
        } = watched(lines, false);
        wait_for(&n, 3);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            n.load(Ordering::SeqCst),
            3,
            "WATCHDOG, GUEST_PANICKED, SHUTDOWN only"
        );
        // Stopping it while it waits for more: it ends at once and wakes nobody.
        let t = Instant::now();
        drop(w);
        assert!(t.elapsed() < Duration::from_secs(2));
        assert_eq!(n.load(Ordering::SeqCst), 3);
        server.join().unwrap();
    }

    #[test]
    fn a_monitor_that_closes_wakes_once_and_says_so_once() {
        let Watched {
            _dir,
            server,
            watch: w,
            woken: n,
        } = watched(vec![event("STOP")], true);
        wait_for(&n, 1);
        assert!(w.take_closed());
        assert!(!w.take_closed(), "said once");
        drop(w);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        server.join().unwrap();
    }

    #[test]
    fn junk_on_the_monitor_ends_the_watch_with_a_wake_never_a_panic() {
        let Watched {
            _dir,
            server,
            watch: w,
            woken: n,
        } = watched(vec!["not json".into()], false);
        wait_for(&n, 1);
        drop(w);
        server.join().unwrap();
    }
}
