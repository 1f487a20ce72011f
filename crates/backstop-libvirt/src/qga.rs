//! The heartbeat from the stock QEMU guest agent (`qemu-ga`) of an adopted domain, through
//! libvirt's agent API (`virDomainQemuAgentCommand`): libvirt owns the domain's
//! `org.qemu.guest_agent.0` channel, so backstop asks libvirt to ping, on a connection of its
//! own, from a thread of its own.
//!
//! Once a second `guest-ping`; a heartbeat is credited only for a reply that is exactly
//! `{"return":{}}`, within [`REPLY_MAX`] bytes. Anything else (an error, garbage, a longer
//! reply) counts as rejected and is silence to the watchdog; a call that fails or times out
//! (no agent, a paused guest) is silence. At most one call is outstanding, so what the guest
//! can send is bounded by the ping rate and the reply limit.
//!
//! After a restore the guest's clock is where the snapshot left it: once the restored agent
//! answers its first ping, its time is read (`guest-get-time`), the skew to the host's clock
//! kept, and its clock set to the host's (`guest-set-time`) — once.

#[cfg(feature = "libvirt")]
pub use pinger::QgaPinger;
use serde::Deserialize;

/// Longest reply accepted from the agent. A pong is 13 bytes, a time ~35.
pub const REPLY_MAX: usize = 256;

/// What one agent reply means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// `{"return":{}}`.
    Empty,
    /// `{"return":N}`: a number (nanoseconds, for `guest-get-time`).
    Number(i64),
    /// Anything else.
    Rejected,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    #[serde(rename = "return")]
    ret: serde_json::Value,
}

/// Parses one reply, strictly: one JSON object with exactly `return`, an empty object or an
/// integer; at most [`REPLY_MAX`] bytes.
pub fn parse_reply(text: &str) -> Reply {
    if text.len() > REPLY_MAX {
        return Reply::Rejected;
    }
    match serde_json::from_str::<Wire>(text.trim_end()) {
        Ok(Wire {
            ret: serde_json::Value::Object(m),
        }) if m.is_empty() => Reply::Empty,
        Ok(Wire {
            ret: serde_json::Value::Number(n),
        }) => n.as_i64().map_or(Reply::Rejected, Reply::Number),
        _ => Reply::Rejected,
    }
}

#[cfg(feature = "libvirt")]
mod pinger {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use backstop_qmp::AgentStats;
    use virt::connect::Connect;
    use virt::domain::Domain;

    use super::{parse_reply, Reply};

    /// How often the guest is pinged.
    const PING_EVERY: Duration = Duration::from_secs(1);
    /// How long libvirt waits for one agent reply (seconds, libvirt's unit).
    const REPLY_TIMEOUT_S: i32 = 2;

    #[derive(Debug, Default)]
    struct Shared {
        stats: AgentStats,
        resync_pending: bool,
        clock_resynced: bool,
        /// Host minus guest, at the resync (ms).
        clock_skew_ms: Option<i64>,
        /// Why the pinger has no domain to ask (its own connection failed).
        down: Option<String>,
    }

    /// One VM instance's qemu-ga heartbeat: a pinger thread on its own libvirt connection.
    pub struct QgaPinger {
        shared: Arc<Mutex<Shared>>,
        stop: Arc<AtomicBool>,
    }

    impl QgaPinger {
        /// Starts pinging the domain `uuid` over a new connection to `uri`. `resync_clock`: this
        /// instance was restored from a snapshot; set its clock once its agent answers.
        pub fn start(uri: &str, uuid: &str, resync_clock: bool) -> QgaPinger {
            let shared = Arc::new(Mutex::new(Shared {
                resync_pending: resync_clock,
                ..Shared::default()
            }));
            let stop = Arc::new(AtomicBool::new(false));
            let (sh, st, uri, uuid) = (
                Arc::clone(&shared),
                Arc::clone(&stop),
                uri.to_string(),
                uuid.to_string(),
            );
            let _ = std::thread::Builder::new()
                .name("qga-libvirt".into())
                .spawn(move || ping_loop(&uri, &uuid, &sh, &st));
            QgaPinger { shared, stop }
        }

        pub fn stats(&self) -> AgentStats {
            self.shared.lock().map(|s| s.stats).unwrap_or_default()
        }

        /// [`QgaPinger::stats`] for another thread.
        pub fn stats_reader(&self) -> impl Fn() -> AgentStats + Send + Sync + 'static {
            let shared = Arc::clone(&self.shared);
            move || shared.lock().map(|s| s.stats).unwrap_or_default()
        }

        /// Whether the restored guest's clock was set, and the skew corrected (host − guest, ms).
        pub fn clock(&self) -> (bool, Option<i64>) {
            self.shared
                .lock()
                .map(|s| (s.clock_resynced, s.clock_skew_ms))
                .unwrap_or((false, None))
        }

        /// Why the pinger cannot ask at all, if it cannot.
        pub fn down(&self) -> Option<String> {
            self.shared.lock().ok().and_then(|s| s.down.clone())
        }
    }

    impl Drop for QgaPinger {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
        }
    }

    fn now_ns() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    }

    fn ping_loop(uri: &str, uuid: &str, shared: &Mutex<Shared>, stop: &AtomicBool) {
        let mut conn: Option<(Connect, Domain)> = None;
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            if conn.is_none() {
                match Connect::open(Some(uri))
                    .map_err(|e| e.message().to_string())
                    .and_then(|c| {
                        let d = c
                            .lookup_domain_by_uuid_string(uuid)
                            .map_err(|e| e.message().to_string())?;
                        Ok((c, d))
                    }) {
                    Ok(c) => {
                        conn = Some(c);
                        if let Ok(mut s) = shared.lock() {
                            s.down = None;
                        }
                    }
                    Err(e) => {
                        if let Ok(mut s) = shared.lock() {
                            s.down = Some(e);
                        }
                    }
                }
            }
            if let Some((_, dom)) = conn.as_ref() {
                match dom.qemu_agent_command(r#"{"execute":"guest-ping"}"#, REPLY_TIMEOUT_S, 0) {
                    Ok(text) => {
                        let pong = parse_reply(&text) == Reply::Empty;
                        let resync = {
                            let Ok(mut s) = shared.lock() else { return };
                            if pong {
                                s.stats.heartbeats += 1;
                                s.stats.last_seq = Some(s.stats.heartbeats);
                                s.stats.last_heartbeat = Some(Instant::now());
                            } else {
                                s.stats.rejected += 1;
                            }
                            pong && s.resync_pending
                        };
                        if resync {
                            set_clock(dom, shared);
                        }
                    }
                    // No agent, a paused guest, a timeout: silence. A connection that died with
                    // libvirtd is opened again next round.
                    Err(_) => {
                        if conn
                            .as_ref()
                            .is_some_and(|(c, _)| !c.is_alive().unwrap_or(false))
                        {
                            conn = None;
                        }
                    }
                }
            }
            let spent = started.elapsed();
            if spent < PING_EVERY {
                std::thread::sleep(PING_EVERY - spent);
            }
        }
    }

    /// Reads the restored guest's clock, keeps the skew, and sets it to the host's. A guest that
    /// refuses either keeps its clock (its own business) and is not asked again.
    fn set_clock(dom: &Domain, shared: &Mutex<Shared>) {
        let guest = dom
            .qemu_agent_command(r#"{"execute":"guest-get-time"}"#, REPLY_TIMEOUT_S, 0)
            .ok()
            .and_then(|t| match parse_reply(&t) {
                Reply::Number(n) => Some(n),
                _ => None,
            });
        let host = now_ns();
        let set = dom.qemu_agent_command(
            &format!(r#"{{"execute":"guest-set-time","arguments":{{"time":{host}}}}}"#),
            REPLY_TIMEOUT_S,
            0,
        );
        let Ok(mut s) = shared.lock() else { return };
        s.resync_pending = false;
        match set.map(|t| parse_reply(&t)) {
            Ok(Reply::Empty) => {
                s.clock_resynced = true;
                s.clock_skew_ms = guest.map(|g| (host - g) / 1_000_000);
                tracing::info!(skew_ms = ?s.clock_skew_ms, "guest clock set through qemu-ga after the restore");
            }
            Ok(_) => {
                s.stats.rejected += 1;
                tracing::warn!(
                    "qemu-ga answered guest-set-time with something else: clock not set"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "qemu-ga refused guest-set-time after the restore")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_exact_empty_return_is_a_pong() {
        assert_eq!(parse_reply(r#"{"return":{}}"#), Reply::Empty);
        assert_eq!(parse_reply("{\"return\": {}}\n"), Reply::Empty);
        assert_eq!(
            parse_reply(r#"{"return":1701234567890123456}"#),
            Reply::Number(1_701_234_567_890_123_456)
        );
        for bad in [
            r#"{"return":{"x":1}}"#,
            r#"{"return":{},"id":"x"}"#,
            r#"{"error":{"class":"GenericError","desc":"no"}}"#,
            r#"{"return":1.5}"#,
            r#"{"return":"1"}"#,
            "[]",
            "",
            "not json",
            r#"{"return":{}} trailing"#,
        ] {
            assert_eq!(parse_reply(bad), Reply::Rejected, "{bad}");
        }
        let long = format!(r#"{{"return":{{}}}}{}"#, " ".repeat(REPLY_MAX));
        assert_eq!(parse_reply(&long), Reply::Rejected, "over the limit");
    }
}
