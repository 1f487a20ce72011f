//! systemd's notify protocol, through the `sd-notify` crate: a no-op unless systemd set
//! `$NOTIFY_SOCKET`. backstopd runs as `Type=notify` with `WatchdogSec=`: it says `READY=1` once
//! serving, keeps a `STATUS=` line for `systemctl status`, and its main thread pings `WATCHDOG=1`
//! only while every VM actor has shown a sign of life recently ([`beat`], from each actor's loop
//! and from every step of a long operation, and [`keepalive_for_this_actor`] for the store's
//! long work). An actor silent past `daemon.actor_silence_limit_secs` is retired by the
//! supervisor, its VM alone HALTED, and stops counting; a daemon too stuck to ping at all is
//! restarted by systemd.
//!
//! Start-up (every VM verified and restored before `READY=1`) and the clean stop (a final
//! snapshot of every guest after `STOPPING=1`) can outlast `TimeoutStartSec=` /
//! `TimeoutStopSec=` on a large store; meanwhile the main thread is busy. A
//! [`TimeoutExtender`] covers those phases: while the actors show progress it sends
//! `EXTEND_TIMEOUT_USEC=` and keeps the watchdog pinged; once they stop showing it, it stops
//! too, and systemd's timeout runs out as it should.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use sd_notify::NotifyState;

/// Sends `states` to systemd, if it listens. The states of one call travel in one datagram,
/// newline-separated as the protocol has it, without a trailing newline (byte for byte what
/// backstopd always sent; `sd_notify::notify` would add one).
pub fn notify(states: &[NotifyState]) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let message = states
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let path = std::path::PathBuf::from(path);
    let sent = match path.to_str().and_then(|p| p.strip_prefix('@')) {
        Some(abstract_name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
                .and_then(|addr| sock.send_to_addr(message.as_bytes(), &addr))
        }
        None => sock.send_to(message.as_bytes(), &path),
    };
    if let Err(e) = sent {
        tracing::debug!(error = %e, "sd_notify: not delivered");
    }
}

/// A moment as milliseconds since the process's first look at the clock (fits an atomic).
pub fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// An actor thread's liveness cell, and the token whose end (the thread's end) takes it off the
/// list of actors the [`TimeoutExtender`] waits for.
struct Liveness {
    cell: Arc<AtomicU64>,
    _token: Arc<()>,
}

std::thread_local! {
    /// The liveness cell of the actor that runs on this thread, if any.
    static ALIVE: std::cell::RefCell<Option<Liveness>> = const { std::cell::RefCell::new(None) };
}

/// Every actor thread's cell, while its thread lives (the token is dropped with the thread).
static ACTORS: Mutex<Vec<(std::sync::Weak<()>, Arc<AtomicU64>)>> = Mutex::new(Vec::new());

/// Makes `cell` this thread's liveness cell: [`beat`] on this thread stamps it.
pub fn adopt_liveness(cell: Arc<AtomicU64>) {
    cell.store(now_ms(), Ordering::Relaxed);
    let token = Arc::new(());
    ACTORS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((Arc::downgrade(&token), Arc::clone(&cell)));
    ALIVE.with(|a| {
        *a.borrow_mut() = Some(Liveness {
            cell,
            _token: token,
        })
    });
}

/// Whether every actor thread still running stamped its cell within `limit_ms` (an actor busy
/// verifying a large disk stamps it per MiB; a wedged one does not).
pub fn actors_alive(limit_ms: u64) -> bool {
    let now = now_ms();
    let mut actors = ACTORS.lock().unwrap_or_else(|p| p.into_inner());
    actors.retain(|(token, _)| token.strong_count() > 0);
    actors
        .iter()
        .all(|(_, cell)| now.saturating_sub(cell.load(Ordering::Relaxed)) < limit_ms)
}

/// A sign of life for the actor on this thread that works from any thread: for the store's long
/// work (hashing a disk layer, checking chunks on worker threads). A no-op off an actor.
pub fn keepalive_for_this_actor() -> backstop_store::Keepalive {
    match ALIVE.with(|a| a.borrow().as_ref().map(|l| Arc::clone(&l.cell))) {
        Some(cell) => Arc::new(move || cell.store(now_ms(), Ordering::Relaxed)),
        None => Arc::new(|| {}),
    }
}

/// A sign of life from the actor on this thread (cheap; called every tick and every step).
pub fn beat() {
    ALIVE.with(|a| {
        if let Some(l) = a.borrow().as_ref() {
            l.cell.store(now_ms(), Ordering::Relaxed);
        }
    });
}

static LAST_PING: Mutex<Option<Instant>> = Mutex::new(None);

/// systemd's watchdog interval (`$WATCHDOG_USEC`, for this process), if it watches.
fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|d| !d.is_zero())
}

/// How often the daemon's main loop should come round: often enough that a ping at half the
/// watchdog interval is never late by more than a quarter of it.
pub fn loop_period() -> Duration {
    let second = Duration::from_secs(1);
    watchdog_interval().map_or(second, |i| (i / 4).clamp(Duration::from_millis(10), second))
}

/// Pings systemd's watchdog at half its interval; cheap to call often. Called by the daemon's
/// main thread while every actor is alive, and by a [`TimeoutExtender`] while the main thread
/// is busy starting or stopping the VMs.
pub fn watchdog_ping() {
    let Some(interval) = watchdog_interval() else {
        return;
    };
    let Ok(mut last) = LAST_PING.lock() else {
        return;
    };
    if last.is_some_and(|t| t.elapsed() < interval / 2) {
        return;
    }
    *last = Some(Instant::now());
    notify(&[NotifyState::Watchdog]);
}

/// While it lives, tells systemd that a long phase (start-up, the clean stop) goes on: every
/// second, as long as every actor thread shows life within `limit`, it sends
/// `EXTEND_TIMEOUT_USEC=<limit>` and pings the watchdog. An actor silent past `limit` (the
/// wedge limit, `daemon.actor_silence_limit_secs`) ends the extensions, so a stuck phase still
/// fails within `limit` of the last sign of life.
pub struct TimeoutExtender {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TimeoutExtender {
    /// Starts extending now (the first extension goes out at once). Without `$NOTIFY_SOCKET`
    /// it does nothing at all.
    pub fn start(limit: Duration) -> TimeoutExtender {
        let stop = Arc::new(AtomicBool::new(false));
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            return TimeoutExtender { stop, thread: None };
        }
        let limit_ms = limit.as_millis() as u64;
        let limit_us = u32::try_from(limit.as_micros()).unwrap_or(u32::MAX);
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("sd-extend".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    if actors_alive(limit_ms) {
                        notify(&[NotifyState::ExtendTimeoutUsec(limit_us)]);
                        watchdog_ping();
                    }
                    // Sleeps in short turns so that dropping the extender is quick.
                    for _ in 0..10 {
                        if flag.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
            .ok();
        TimeoutExtender { stop, thread }
    }
}

impl Drop for TimeoutExtender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn an_actor_thread_counts_while_it_lives_and_beats() {
        let cell = Arc::new(AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let thread_cell = Arc::clone(&cell);
        let t = std::thread::spawn(move || {
            adopt_liveness(thread_cell);
            ready_tx.send(()).unwrap();
            let _ = rx.recv();
        });
        ready_rx.recv().unwrap();
        assert!(actors_alive(60_000));
        // Silent for longer than the limit: not alive (a limit of 0 ms is always exceeded).
        assert!(!actors_alive(0));
        tx.send(()).unwrap();
        t.join().unwrap();
        // Its thread ended: it no longer counts, whatever its cell says.
        actors_alive(0);
        let listed = ACTORS
            .lock()
            .unwrap()
            .iter()
            .any(|(_, c)| Arc::ptr_eq(c, &cell));
        assert!(!listed);
    }
}
