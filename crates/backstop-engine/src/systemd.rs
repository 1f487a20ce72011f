//! `sd_notify` without libsystemd: one datagram to `$NOTIFY_SOCKET` when systemd set one.
//! backstopd runs as `Type=notify` with `WatchdogSec=`: it says `READY=1` once serving and pings
//! `WATCHDOG=1` from the engine thread, so a wedged engine is restarted by systemd (and its QEMU,
//! tied to it by PDEATHSIG, stops with it).

use std::sync::Mutex;
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

static LAST_PING: Mutex<Option<Instant>> = Mutex::new(None);

/// Pings systemd's watchdog at half its interval (`$WATCHDOG_USEC`); cheap to call often.
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
