//! `sd_notify` without libsystemd: one datagram to `$NOTIFY_SOCKET` when systemd set one.
//! backstopd runs as `Type=notify` with `WatchdogSec=`: it says `READY=1` once serving, and its
//! main thread pings `WATCHDOG=1` only while every VM actor has shown a sign of life recently
//! ([`beat`], from each actor's loop and from every step of a long operation, and
//! [`keepalive_for_this_actor`] for the store's long work). An actor silent past
//! `daemon.actor_silence_limit_secs` is retired by the supervisor, its VM alone HALTED, and stops
//! counting; a daemon too stuck to ping at all is restarted by systemd.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn notify(state: &str) {
    let Ok(path) = std::env::var("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let _ = if let Some(abstract_name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
}

/// A moment as milliseconds since the process's first look at the clock (fits an atomic).
pub fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

std::thread_local! {
    /// The liveness cell of the actor that runs on this thread, if any.
    static ALIVE: std::cell::RefCell<Option<Arc<AtomicU64>>> = const { std::cell::RefCell::new(None) };
}

/// Makes `cell` this thread's liveness cell: [`beat`] on this thread stamps it.
pub fn adopt_liveness(cell: Arc<AtomicU64>) {
    cell.store(now_ms(), Ordering::Relaxed);
    ALIVE.with(|a| *a.borrow_mut() = Some(cell));
}

/// A sign of life for the actor on this thread that works from any thread: for the store's long
/// work (hashing a disk layer, checking chunks on worker threads). A no-op off an actor.
pub fn keepalive_for_this_actor() -> backstop_store::Keepalive {
    match ALIVE.with(|a| a.borrow().clone()) {
        Some(cell) => Arc::new(move || cell.store(now_ms(), Ordering::Relaxed)),
        None => Arc::new(|| {}),
    }
}

/// A sign of life from the actor on this thread (cheap; called every tick and every step).
pub fn beat() {
    ALIVE.with(|a| {
        if let Some(cell) = a.borrow().as_ref() {
            cell.store(now_ms(), Ordering::Relaxed);
        }
    });
}

static LAST_PING: Mutex<Option<Instant>> = Mutex::new(None);

/// Pings systemd's watchdog at half its interval (`$WATCHDOG_USEC`); cheap to call often. Only
/// the daemon's main thread calls it, and only while every actor is alive.
pub fn watchdog_ping() {
    let Some(interval) = std::env::var("WATCHDOG_USEC")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    let half = Duration::from_micros(interval / 2);
    let Ok(mut last) = LAST_PING.lock() else {
        return;
    };
    if last.is_some_and(|t| t.elapsed() < half) {
        return;
    }
    *last = Some(Instant::now());
    notify("WATCHDOG=1");
}
