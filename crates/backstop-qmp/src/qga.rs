//! The heartbeat from the QEMU guest agent (`qemu-ga`, what distributions ship and enable), over
//! its own virtio-serial port `org.qemu.guest_agent.0`.
//!
//! Once a second a pinger thread sends `{"execute":"guest-ping","id":"bs-<n>"}`. A heartbeat is
//! credited only for a reply that is exactly `{"return": {}, "id": "bs-<n>"}` for the newest
//! ping sent; anything else — garbage, an error, an old or foreign id, a line over
//! [`QGA_LINE_MAX`] bytes, lines beyond `MAX_LINES_PER_SEC` a second — is
//! counted as rejected and is silence to the watchdog. A guest that floods, stalls or echoes
//! the wrong id thus expires like a silent one; memory stays bounded by the line limit.
//!
//! The first ping of a channel is preceded by a `0xFF` byte, which resets qemu-ga's JSON parser
//! (whatever a previous connection or a restored guest left half-read in it). After a restore
//! the guest's clock is where the snapshot left it: such a channel sends `guest-set-time` with
//! the host's time once, after the first pong (the restored agent is running again).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::agent::{AgentStats, LineRate, LineSplitter};

/// Longest reply line accepted from qemu-ga, newline included. A pong is ~30 bytes.
pub const QGA_LINE_MAX: usize = 512;
/// How often the guest is pinged.
pub const PING_EVERY: Duration = Duration::from_secs(1);
/// Longest id we send (`bs-` + a u64, or `bs-time-` + a u64).
const ID_MAX: usize = 32;

/// What one line from qemu-ga means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QgaLine {
    /// `{"return": {}, "id": ID}`: the answer to a ping (or to `guest-set-time`).
    Ok { id: String },
    /// `{"error": {"class": C, "desc": D}, "id": ID}`.
    Error { id: String, class: String },
    /// Anything else.
    Rejected,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Reply {
    #[serde(rename = "return")]
    ret: Option<serde_json::Map<String, serde_json::Value>>,
    error: Option<ReplyError>,
    id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplyError {
    class: String,
    /// Required by the reply's shape (strict parsing); its text is the guest's, never shown.
    #[allow(dead_code)]
    desc: String,
}

/// Parses one reply line (without its newline), strictly: one JSON object with exactly
/// `return` (an empty object) or `error`, and our kind of `id`.
pub fn parse_qga_line(line: &[u8]) -> QgaLine {
    if line.len() >= QGA_LINE_MAX {
        return QgaLine::Rejected;
    }
    let Ok(r) = serde_json::from_slice::<Reply>(line) else {
        return QgaLine::Rejected;
    };
    let id_ok = r.id.len() <= ID_MAX
        && r.id.starts_with("bs-")
        && r.id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !id_ok {
        return QgaLine::Rejected;
    }
    match (r.ret, r.error) {
        (Some(ret), None) if ret.is_empty() => QgaLine::Ok { id: r.id },
        (None, Some(e)) if e.class.len() <= 64 => QgaLine::Error {
            id: r.id,
            class: e.class,
        },
        _ => QgaLine::Rejected,
    }
}

/// What the pinger and the reader share.
#[derive(Default)]
struct Shared {
    stats: AgentStats,
    /// The id of the newest ping; only its pong is credited.
    awaiting: Option<String>,
    /// The id of a `guest-set-time` sent, until answered.
    time_id: Option<String>,
    /// Whether the clock resync is still to be sent (a restored guest) / was confirmed.
    resync_pending: bool,
    clock_resynced: bool,
}

/// The host end of qemu-ga's channel, with its pinger and reader threads.
pub struct QgaChannel {
    stream: Option<UnixStream>,
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
}

impl QgaChannel {
    /// Connects to QEMU's chardev socket for the port and starts pinging. A socket that cannot
    /// be reached just gives no heartbeats (the watchdog notices). `resync_clock`: this guest
    /// was restored from a snapshot; set its clock once its agent answers.
    pub fn connect(path: &Path, resync_clock: bool) -> QgaChannel {
        let shared = Arc::new(Mutex::new(Shared {
            resync_pending: resync_clock,
            ..Shared::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let mut stream = None;
        for _ in 0..100 {
            if let Ok(s) = UnixStream::connect(path) {
                stream = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(s) = &stream {
            if let (Ok(reader), Ok(writer)) = (s.try_clone(), s.try_clone()) {
                let (sh, st) = (Arc::clone(&shared), Arc::clone(&stop));
                let _ = std::thread::Builder::new()
                    .name("qga-reader".into())
                    .spawn(move || read_loop(reader, sh));
                let sh = Arc::clone(&shared);
                let _ = std::thread::Builder::new()
                    .name("qga-pinger".into())
                    .spawn(move || ping_loop(writer, sh, st));
            }
        }
        QgaChannel {
            stream,
            shared,
            stop,
        }
    }

    pub fn stats(&self) -> AgentStats {
        self.shared.lock().map(|s| s.stats).unwrap_or_default()
    }

    /// [`QgaChannel::stats`] for another thread (the reader thread keeps them).
    pub fn stats_reader(&self) -> impl Fn() -> AgentStats + Send + Sync + 'static {
        let shared = Arc::clone(&self.shared);
        move || shared.lock().map(|s| s.stats).unwrap_or_default()
    }

    /// Whether the guest's clock was set after a restore (qemu-ga answered `guest-set-time`).
    pub fn clock_resynced(&self) -> bool {
        self.shared
            .lock()
            .map(|s| s.clock_resynced)
            .unwrap_or(false)
    }

    pub fn close(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.stream.take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for QgaChannel {
    fn drop(&mut self) {
        self.close();
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos().min(i64::MAX as u128) as i64)
        .unwrap_or(0)
}

fn ping_loop(mut stream: UnixStream, shared: Arc<Mutex<Shared>>, stop: Arc<AtomicBool>) {
    // A guest whose port nobody reads must never hold this thread for long.
    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
    let mut first = true;
    let mut n: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let mut msg = Vec::with_capacity(128);
        if first {
            msg.push(0xFF);
            first = false;
        }
        let id = format!("bs-{n}");
        msg.extend_from_slice(format!(r#"{{"execute":"guest-ping","id":"{id}"}}"#).as_bytes());
        msg.push(b'\n');
        {
            let Ok(mut s) = shared.lock() else { return };
            s.awaiting = Some(id);
            if s.resync_pending && s.stats.heartbeats > 0 && s.time_id.is_none() {
                let tid = format!("bs-time-{n}");
                msg.extend_from_slice(
                    format!(
                        r#"{{"execute":"guest-set-time","arguments":{{"time":{}}},"id":"{tid}"}}"#,
                        now_ns()
                    )
                    .as_bytes(),
                );
                msg.push(b'\n');
                s.time_id = Some(tid);
            }
        }
        if stream.write_all(&msg).is_err() && stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(PING_EVERY);
    }
}

fn read_loop(mut stream: UnixStream, shared: Arc<Mutex<Shared>>) {
    let mut splitter = LineSplitter::with_max(QGA_LINE_MAX);
    let mut rate = LineRate::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let Ok(mut s) = shared.lock() else { return };
        splitter.feed(&buf[..n], |line| {
            if !rate.admit() {
                s.stats.dropped_rate += 1;
                return;
            }
            credit(&mut s, line.map_or(QgaLine::Rejected, parse_qga_line));
        });
    }
}

/// Books one reply: a pong for the newest ping is a heartbeat; the answer to our
/// `guest-set-time` settles the resync; everything else is rejected.
fn credit(s: &mut Shared, line: QgaLine) {
    match line {
        QgaLine::Ok { id } if s.awaiting.as_deref() == Some(id.as_str()) => {
            s.awaiting = None;
            s.stats.heartbeats += 1;
            s.stats.last_seq = id.strip_prefix("bs-").and_then(|n| n.parse().ok());
            s.stats.last_heartbeat = Some(Instant::now());
        }
        QgaLine::Ok { id } if s.time_id.as_deref() == Some(id.as_str()) => {
            s.resync_pending = false;
            s.clock_resynced = true;
            tracing::info!("guest clock set through qemu-ga after the restore");
        }
        QgaLine::Error { id, class } if s.time_id.as_deref() == Some(id.as_str()) => {
            // Not retried: a guest that refuses keeps its clock (it is its own business).
            s.resync_pending = false;
            tracing::warn!(class = %class, "qemu-ga refused guest-set-time after the restore");
        }
        _ => s.stats.rejected += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use backstop_common::fuzz_corpus::inputs as fuzz_inputs;

    #[test]
    fn a_pong_is_exactly_an_empty_return_with_our_id() {
        assert_eq!(
            parse_qga_line(br#"{"return": {}, "id": "bs-7"}"#),
            QgaLine::Ok { id: "bs-7".into() }
        );
        assert_eq!(
            parse_qga_line(
                br#"{"error": {"class": "GenericError", "desc": "x"}, "id": "bs-time-3"}"#
            ),
            QgaLine::Error {
                id: "bs-time-3".into(),
                class: "GenericError".into()
            }
        );
        for bad in [
            &br#"{"return": {}}"#[..],
            br#"{"return": {"x": 1}, "id": "bs-1"}"#,
            br#"{"return": {}, "id": "other"}"#,
            br#"{"return": {}, "id": 5}"#,
            br#"{"return": {}, "id": "bs-1", "extra": 1}"#,
            br#"{"return": {}, "error": {"class": "a", "desc": "b"}, "id": "bs-1"}"#,
            br#"{"return": {}, "id": "bs-1111111111111111111111111111111111"}"#,
            br#"{"return": {}, "id": "BS-1"}"#,
            b"\xff{\"return\": {}, \"id\": \"bs-1\"}",
            b"",
            b"HB 1",
            b"[]",
        ] {
            assert_eq!(
                parse_qga_line(bad),
                QgaLine::Rejected,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = format!(
            r#"{{"return": {{}}, "id": "bs-1"{}}}"#,
            " ".repeat(QGA_LINE_MAX)
        );
        assert_eq!(parse_qga_line(long.as_bytes()), QgaLine::Rejected);
    }

    #[test]
    fn only_the_newest_pings_pong_counts_and_the_set_time_answer_settles_the_resync() {
        let mut s = Shared {
            resync_pending: true,
            ..Shared::default()
        };
        s.awaiting = Some("bs-2".into());
        credit(&mut s, QgaLine::Ok { id: "bs-1".into() });
        assert_eq!((s.stats.heartbeats, s.stats.rejected), (0, 1));
        credit(&mut s, QgaLine::Ok { id: "bs-2".into() });
        assert_eq!(s.stats.heartbeats, 1);
        assert_eq!(s.stats.last_seq, Some(2));
        // An echo of the same pong is not a second heartbeat.
        credit(&mut s, QgaLine::Ok { id: "bs-2".into() });
        assert_eq!((s.stats.heartbeats, s.stats.rejected), (1, 2));
        credit(
            &mut s,
            QgaLine::Error {
                id: "bs-3".into(),
                class: "x".into(),
            },
        );
        assert_eq!(s.stats.rejected, 3);
        s.time_id = Some("bs-time-3".into());
        credit(
            &mut s,
            QgaLine::Ok {
                id: "bs-time-3".into(),
            },
        );
        assert!(s.clock_resynced && !s.resync_pending);
    }

    /// The fuzz target `qga_reply`'s kept inputs: never a panic, never more than the line
    /// limit held.
    #[test]
    fn fuzz_inputs_replay() {
        for (name, bytes) in fuzz_inputs("qga_reply") {
            let mut sp = LineSplitter::with_max(QGA_LINE_MAX);
            let mut s = Shared::default();
            sp.feed(&bytes, |line| {
                if let Some(line) = line {
                    assert!(line.len() < QGA_LINE_MAX, "{name}");
                }
                credit(&mut s, line.map_or(QgaLine::Rejected, parse_qga_line));
            });
            assert!(sp.buffered_len() <= QGA_LINE_MAX, "{name}");
        }
    }

    /// A real socket: a fake qemu-ga answers the first two pings correctly, then with the
    /// wrong id; only the two count.
    #[test]
    fn pings_over_a_socket_are_credited_only_when_answered_with_their_id() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qga.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut first = Vec::new();
            // The first request is preceded by 0xFF (a parser reset).
            std::io::BufRead::read_until(&mut r, b'\n', &mut first).unwrap();
            assert_eq!(first[0], 0xFF);
            let mut line = String::from_utf8(first[1..].to_vec()).unwrap();
            for i in 0..4 {
                let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
                assert_eq!(v["execute"], "guest-ping");
                let id = v["id"].as_str().unwrap().to_string();
                let id = if i < 2 { id } else { "bs-999".into() };
                writeln!(s, r#"{{"return": {{}}, "id": "{id}"}}"#).unwrap();
                line.clear();
                std::io::BufRead::read_line(&mut r, &mut line).unwrap();
            }
        });
        let mut ch = QgaChannel::connect(&path, false);
        server.join().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let st = ch.stats();
        assert_eq!(st.heartbeats, 2, "{st:?}");
        assert_eq!(st.rejected, 2, "{st:?}");
        ch.close();
    }
}
