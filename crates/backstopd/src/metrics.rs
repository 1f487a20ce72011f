//! The OpenMetrics endpoint (`daemon.metrics`, off by default): `GET /metrics` over plain
//! HTTP/1.1 on a Unix socket or a loopback address, in the text exposition of the
//! `prometheus-client` crate.
//!
//! Every figure comes from the status each VM's actor publishes (the supervisor's handles), so
//! neither a scrape nor the sampler ever waits on an actor: a VM in the middle of a long rollback
//! is scraped all the same, its state saying so. Gauges and counters are read at scrape time.
//! Histograms need every event, not the latest: the sampler looks at the statuses every second
//! (and at each scrape) and adds a snapshot's pause when a VM's newest snapshot changes and a
//! rollback's duration when its last rollback changes. Two events of one VM within one sample
//! would count once; snapshots and rollbacks take longer than that.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use backstop_control::StatusView;
use backstop_engine::config::MetricsEndpoint;

/// Label pairs of one series (`vm`, and `trigger`, `state` or `nic` where they apply).
type Labels = Vec<(String, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Every state a VM's actor can publish (`VmState::as_str`), plus the supervisor's own two for
/// a VM that does not run: each VM has one series per state, 1 for the state it is in.
const STATES: [&str; 8] = [
    "stopped",
    "booting",
    "running",
    "snapshotting",
    "rolling_back",
    "halted",
    "config_invalid",
    "start_failed",
];

/// The content type of the OpenMetrics text format.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A request head larger than this is refused (`GET /metrics` needs a few hundred bytes).
const MAX_REQUEST_HEAD_BYTES: usize = 8 << 10;

/// How long one client may take to send its request or read the answer: connections are served
/// one at a time, so a stalled client delays the next scrape by at most this.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the statuses come from: every VM the daemon names (see `Supervisor::statuses`).
pub type StatusSource = Arc<dyn Fn() -> Vec<StatusView> + Send + Sync>;

fn pause_us_histogram() -> Histogram {
    // 100 µs to ~26 s: a background snapshot pauses for milliseconds, stop-and-copy for seconds.
    Histogram::new(exponential_buckets(100.0, 4.0, 10))
}

fn rollback_ms_histogram() -> Histogram {
    // 50 ms to ~100 s: a restore into a fresh QEMU is a fraction of a second, a large verify long.
    Histogram::new(exponential_buckets(50.0, 2.0, 12))
}

/// The histograms, fed by [`Histograms::sample`] from what each VM published.
pub struct Histograms {
    pause_us: HistogramFamily,
    rollback_ms: HistogramFamily,
    /// Per VM: the newest snapshot and the last rollback already counted.
    seen: Mutex<BTreeMap<String, Seen>>,
}

#[derive(Default)]
struct Seen {
    newest_snapshot: Option<String>,
    last_rollback: Option<(String, String)>,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            pause_us: Family::new_with_constructor(pause_us_histogram),
            rollback_ms: Family::new_with_constructor(rollback_ms_histogram),
            seen: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Histograms {
    /// Counts what is new in `statuses` since the last sample: a newest snapshot not seen
    /// before adds its pause, a rollback not seen before its duration.
    pub fn sample(&self, statuses: &[StatusView]) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for s in statuses {
            let labels = vm_labels(&s.vm);
            let mine = seen.entry(s.vm.clone()).or_default();
            if s.newest_snapshot.is_some() && s.newest_snapshot != mine.newest_snapshot {
                mine.newest_snapshot = s.newest_snapshot.clone();
                if let Some(pause_us) = s.newest_snapshot_pause_us {
                    self.pause_us
                        .get_or_create(&labels)
                        .observe(pause_us as f64);
                }
            }
            if let Some(r) = &s.last_rollback {
                let key = (r.snapshot_id.clone(), r.at.clone());
                if mine.last_rollback.as_ref() != Some(&key) {
                    mine.last_rollback = Some(key);
                    self.rollback_ms
                        .get_or_create(&labels)
                        .observe(r.duration_ms as f64);
                }
            }
        }
    }
}

fn vm_labels(vm: &str) -> Labels {
    vec![("vm".into(), vm.into())]
}

fn labels_with(vm: &str, key: &str, value: &str) -> Labels {
    vec![("vm".into(), vm.into()), (key.into(), value.into())]
}

/// The text exposition of `statuses` (read at `now`) and the histograms so far.
pub fn exposition(
    statuses: &[StatusView],
    histograms: &Histograms,
    now: time::OffsetDateTime,
) -> String {
    let mut registry = Registry::with_prefix("backstop");
    let state: Family<Labels, Gauge> = Family::default();
    let epoch: Family<Labels, Gauge> = Family::default();
    let snapshots: Family<Labels, Gauge> = Family::default();
    let snapshot_age_s: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> =
        Family::default();
    let heartbeat_age_ms: Family<Labels, Gauge> = Family::default();
    let store_bytes: Family<Labels, Gauge> = Family::default();
    let halts: Family<Labels, Counter> = Family::default();
    let rollbacks: Family<Labels, Counter> = Family::default();
    let link_up: Family<Labels, Gauge> = Family::default();
    let granted: Family<Labels, Gauge> = Family::default();
    let races_lost: Family<Labels, Counter> = Family::default();
    for s in statuses {
        let vm = vm_labels(&s.vm);
        for st in STATES {
            state
                .get_or_create(&labels_with(&s.vm, "state", st))
                .set(i64::from(s.state == st));
        }
        if STATES[6..].contains(&s.state.as_str()) {
            // A VM that does not run has no figures beyond its state.
            continue;
        }
        epoch.get_or_create(&vm).set(gauge_i64(s.epoch));
        snapshots
            .get_or_create(&vm)
            .set(gauge_i64(s.snapshots as u64));
        let newest = s
            .newest_snapshot_at
            .as_deref()
            .and_then(backstop_common::time::parse_rfc3339);
        if let Some(at) = newest {
            let age_s = (now - at).as_seconds_f64().max(0.0);
            snapshot_age_s.get_or_create(&vm).set(age_s);
        }
        if let Some(age_ms) = s.heartbeat_age_ms {
            heartbeat_age_ms.get_or_create(&vm).set(gauge_i64(age_ms));
        }
        store_bytes.get_or_create(&vm).set(gauge_i64(s.store_bytes));
        halts.get_or_create(&vm).inc_by(s.halts);
        for (trigger, n) in &s.rollbacks_by_trigger {
            rollbacks
                .get_or_create(&labels_with(&s.vm, "trigger", trigger))
                .inc_by(*n);
        }
        for l in &s.links {
            if let Some(up) = l.up {
                link_up
                    .get_or_create(&labels_with(&s.vm, "nic", &l.nic))
                    .set(i64::from(up));
            }
        }
        granted
            .get_or_create(&vm)
            .set(gauge_i64(s.granted_devices.len() as u64));
        // Where captures may send `migrate` first (QEMU ≥ 9.0, or 7.2/8.x with
        // `vm.capture_order = "migrate-first"`: the backend says it under
        // `capture_migrate_first`).
        if let Some(lost) = s
            .backend_details
            .get("capture_migrate_first")
            .and_then(|m| m.get("races_lost"))
            .and_then(serde_json::Value::as_u64)
        {
            races_lost.get_or_create(&vm).inc_by(lost);
        }
    }
    registry.register(
        "vm_state",
        "The VM's lifecycle state: 1 for the state it is in",
        state,
    );
    registry.register("vm_epoch", "Rollback epoch the guest was last told", epoch);
    registry.register("snapshots", "Snapshots held for the VM", snapshots);
    registry.register_with_unit(
        "newest_snapshot_age",
        "Time since the VM's newest snapshot was taken",
        Unit::Seconds,
        snapshot_age_s,
    );
    registry.register_with_unit(
        "heartbeat_age",
        "Time since the guest agent's last valid heartbeat (as the VM last published it)",
        Unit::Other("milliseconds".into()),
        heartbeat_age_ms,
    );
    registry.register_with_unit(
        "store",
        "What the VM's held snapshots stored (sum of their bytes_stored)",
        Unit::Bytes,
        store_bytes,
    );
    registry.register(
        "halts",
        "Times the VM entered HALTED since the daemon started",
        halts,
    );
    registry.register(
        "rollbacks",
        "Rollbacks completed since the daemon started, by trigger",
        rollbacks,
    );
    registry.register(
        "link_up",
        "A NIC's link as the guest reads it (1 up, 0 down)",
        link_up,
    );
    registry.register(
        "granted_devices",
        "Devices granted to the guest now",
        granted,
    );
    registry.register(
        "capture_races_lost",
        "Captures sent `migrate` before `stop` (QEMU >= 9.0) whose stop came after QEMU's own, \
         discarded and taken again; since the VM's QEMU started",
        races_lost,
    );
    registry.register_with_unit(
        "snapshot_pause",
        "Guest pause of each snapshot taken",
        Unit::Other("microseconds".into()),
        histograms.pause_us.clone(),
    );
    registry.register_with_unit(
        "rollback_duration",
        "Duration of each completed rollback, from request to resumed guest",
        Unit::Other("milliseconds".into()),
        histograms.rollback_ms.clone(),
    );
    let mut text = String::new();
    if encode(&mut text, &registry).is_err() {
        // Writing into a String cannot fail; an empty answer is the safe reading of the case.
        text.clear();
    }
    text
}

/// A gauge holds an i64; figures above its range (none in practice) read as its maximum.
fn gauge_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The bound endpoint.
pub enum Listener {
    Unix(std::os::unix::net::UnixListener, PathBuf),
    Tcp(std::net::TcpListener),
}

/// A connection of either kind.
trait Conn: Read + Write {}
impl<T: Read + Write> Conn for T {}

impl Listener {
    /// Binds `endpoint` before any VM starts (a port in use must fail the start, not a later
    /// scrape). A Unix socket gets mode 0600, or 0660 of `socket_gid` (the control socket's
    /// group, `daemon.socket_group`) when one is set; a stale socket left by a crash is
    /// replaced, anything else at the path is an error.
    pub fn bind(endpoint: &MetricsEndpoint, socket_gid: Option<u32>) -> std::io::Result<Self> {
        match endpoint {
            MetricsEndpoint::Tcp(addr) => Ok(Listener::Tcp(std::net::TcpListener::bind(addr)?)),
            MetricsEndpoint::Unix(path) => {
                use std::os::unix::fs::FileTypeExt;
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                match std::fs::symlink_metadata(path) {
                    Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
                    Ok(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::AlreadyExists,
                            "exists and is not a socket",
                        ))
                    }
                    Err(_) => {}
                }
                let listener = std::os::unix::net::UnixListener::bind(path)?;
                let mode = match socket_gid {
                    Some(gid) => {
                        std::os::unix::fs::chown(path, None, Some(gid))?;
                        0o660
                    }
                    None => 0o600,
                };
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
                Ok(Listener::Unix(listener, path.clone()))
            }
        }
    }

    /// Where it listens (the port a `:0` address got, for the log).
    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(_, path) => format!("unix:{}", path.display()),
            Listener::Tcp(l) => l
                .local_addr()
                .map_or_else(|e| format!("tcp ({e})"), |a| a.to_string()),
        }
    }

    /// The socket file to remove at a clean stop, if any.
    pub fn socket_path(&self) -> Option<&Path> {
        match self {
            Listener::Unix(_, path) => Some(path),
            Listener::Tcp(_) => None,
        }
    }

    fn accept(&self) -> std::io::Result<Box<dyn Conn>> {
        match self {
            Listener::Unix(l, _) => {
                let (s, _) = l.accept()?;
                s.set_read_timeout(Some(CLIENT_TIMEOUT))?;
                s.set_write_timeout(Some(CLIENT_TIMEOUT))?;
                Ok(Box::new(s))
            }
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_read_timeout(Some(CLIENT_TIMEOUT))?;
                s.set_write_timeout(Some(CLIENT_TIMEOUT))?;
                Ok(Box::new(s))
            }
        }
    }
}

/// Serves the endpoint on its own threads (`metrics`: one connection at a time; and
/// `metrics-sampler`: the histograms' sampling every second) for the life of the process.
pub fn serve(listener: Listener, source: StatusSource) -> std::io::Result<()> {
    let histograms = Arc::new(Histograms::default());
    {
        let histograms = Arc::clone(&histograms);
        let source = Arc::clone(&source);
        std::thread::Builder::new()
            .name("metrics-sampler".into())
            .spawn(move || loop {
                histograms.sample(&source());
                std::thread::sleep(Duration::from_secs(1));
            })?;
    }
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || loop {
            match listener.accept() {
                Ok(mut conn) => answer(&mut *conn, &source, &histograms),
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })?;
    Ok(())
}

/// What a request asks for, from its head.
#[derive(Debug, PartialEq, Eq)]
pub enum Asked {
    Metrics,
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

/// Reads the request line of an HTTP/1.x request head.
pub fn parse_request(head: &str) -> Asked {
    let line = head.lines().next().unwrap_or("");
    let mut words = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Asked::BadRequest;
    };
    if !version.starts_with("HTTP/1.") {
        return Asked::BadRequest;
    }
    if method != "GET" && method != "HEAD" {
        return Asked::MethodNotAllowed;
    }
    // A scraper may add a query string (`?name[]=…`); the whole set is served regardless.
    match target.split('?').next() {
        Some("/metrics") => Asked::Metrics,
        _ => Asked::NotFound,
    }
}

fn answer(conn: &mut dyn Conn, source: &StatusSource, histograms: &Histograms) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    // The head ends at the first blank line; a client that sends no more in time, or too much,
    // gets no answer beyond a 400.
    let complete = loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break true;
        }
        if head.len() > MAX_REQUEST_HEAD_BYTES {
            break false;
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    };
    let asked = if complete {
        parse_request(&String::from_utf8_lossy(&head))
    } else {
        Asked::BadRequest
    };
    let is_head = head.starts_with(b"HEAD ");
    let (status, content_type, body) = match asked {
        Asked::Metrics => {
            let statuses = source();
            histograms.sample(&statuses);
            let body = exposition(&statuses, histograms, time::OffsetDateTime::now_utc());
            ("200 OK", CONTENT_TYPE, body)
        }
        Asked::NotFound => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "only /metrics is served here\n".to_string(),
        ),
        Asked::MethodNotAllowed => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET /metrics is served here\n".to_string(),
        ),
        Asked::BadRequest => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "a request line like `GET /metrics HTTP/1.1` was expected\n".to_string(),
        ),
    };
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if asked == Asked::MethodNotAllowed {
        reply.push_str("Allow: GET, HEAD\r\n");
    }
    reply.push_str("\r\n");
    if !is_head {
        reply.push_str(&body);
    }
    if let Err(e) = conn.write_all(reply.as_bytes()).and_then(|_| conn.flush()) {
        tracing::debug!(error = %e, "metrics: client went away");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use backstop_control::{LastRollbackView, LinkView};

    fn running(vm: &str) -> StatusView {
        StatusView {
            vm: vm.into(),
            state: "running".into(),
            epoch: 2,
            snapshots: 3,
            newest_snapshot: Some("aaaa".into()),
            newest_snapshot_at: Some("2026-11-24T20:00:00.000Z".into()),
            newest_snapshot_pause_us: Some(3_000),
            heartbeat_age_ms: Some(450),
            store_bytes: 123_456,
            halts: 1,
            rollbacks_by_trigger: [("console".to_string(), 2), ("watchdog".to_string(), 1)]
                .into_iter()
                .collect(),
            last_rollback: Some(LastRollbackView {
                snapshot_id: "aaaa".into(),
                at: "2026-11-24T20:00:05.000Z".into(),
                trigger: "console".into(),
                rollback_type: "emergency".into(),
                duration_ms: 700,
            }),
            links: vec![
                LinkView {
                    nic: "net0".into(),
                    up: Some(false),
                },
                LinkView {
                    nic: "net1".into(),
                    up: None,
                },
            ],
            granted_devices: vec!["cam".into()],
            ..Default::default()
        }
    }

    fn at(s: &str) -> time::OffsetDateTime {
        backstop_common::time::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn the_exposition_has_every_series_of_a_running_vm() {
        let h = Histograms::default();
        let s = [running("web")];
        h.sample(&s);
        let text = exposition(&s, &h, at("2026-11-24T20:01:00.000Z"));
        for line in [
            "backstop_vm_state{vm=\"web\",state=\"running\"} 1",
            "backstop_vm_state{vm=\"web\",state=\"halted\"} 0",
            "backstop_vm_epoch{vm=\"web\"} 2",
            "backstop_snapshots{vm=\"web\"} 3",
            "backstop_newest_snapshot_age_seconds{vm=\"web\"} 60.0",
            "backstop_heartbeat_age_milliseconds{vm=\"web\"} 450",
            "backstop_store_bytes{vm=\"web\"} 123456",
            "backstop_halts_total{vm=\"web\"} 1",
            "backstop_rollbacks_total{vm=\"web\",trigger=\"console\"} 2",
            "backstop_rollbacks_total{vm=\"web\",trigger=\"watchdog\"} 1",
            "backstop_link_up{vm=\"web\",nic=\"net0\"} 0",
            "backstop_granted_devices{vm=\"web\"} 1",
            "backstop_snapshot_pause_microseconds_count{vm=\"web\"} 1",
            "backstop_snapshot_pause_microseconds_sum{vm=\"web\"} 3000.0",
            "backstop_rollback_duration_milliseconds_count{vm=\"web\"} 1",
            "backstop_rollback_duration_milliseconds_sum{vm=\"web\"} 700.0",
            "# TYPE backstop_rollbacks counter",
            "# TYPE backstop_snapshot_pause_microseconds histogram",
            "# UNIT backstop_newest_snapshot_age_seconds seconds",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        // An unreadable link has no series (neither up nor down is known).
        assert!(!text.contains("nic=\"net1\""), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        // No capture_migrate_first in its status (7.2/8.x, libvirt): no series.
        assert!(
            !text.contains("backstop_capture_races_lost_total{"),
            "{text}"
        );
    }

    #[test]
    fn lost_capture_races_are_counted_where_the_backend_reports_them() {
        let h = Histograms::default();
        let mut s = running("db");
        s.backend_details.insert(
            "capture_migrate_first".into(),
            serde_json::json!({"lead_ms": 7.5, "races_lost": 3, "setup_ms": [10.0]}),
        );
        let text = exposition(&[s], &h, at("2026-11-24T20:01:00.000Z"));
        for line in [
            "backstop_capture_races_lost_total{vm=\"db\"} 3",
            "# TYPE backstop_capture_races_lost counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
    }

    #[test]
    fn the_histograms_count_each_snapshot_and_rollback_once() {
        let h = Histograms::default();
        let mut s = running("web");
        h.sample(&[s.clone()]);
        h.sample(&[s.clone()]);
        s.newest_snapshot = Some("bbbb".into());
        s.newest_snapshot_pause_us = Some(5_000);
        s.last_rollback = Some(LastRollbackView {
            at: "2026-11-24T20:09:00.000Z".into(),
            duration_ms: 300,
            ..s.last_rollback.clone().unwrap()
        });
        h.sample(&[s.clone()]);
        h.sample(&[s.clone()]);
        let text = exposition(&[s], &h, at("2026-11-24T20:10:00.000Z"));
        for line in [
            "backstop_snapshot_pause_microseconds_count{vm=\"web\"} 2",
            "backstop_snapshot_pause_microseconds_sum{vm=\"web\"} 8000.0",
            "backstop_rollback_duration_milliseconds_count{vm=\"web\"} 2",
            "backstop_rollback_duration_milliseconds_sum{vm=\"web\"} 1000.0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
    }

    #[test]
    fn a_vm_that_does_not_run_shows_its_state_only() {
        let down = StatusView {
            vm: "bad".into(),
            state: "config_invalid".into(),
            ..Default::default()
        };
        let text = exposition(&[down], &Histograms::default(), at("2026-11-24T20:10:00Z"));
        assert!(text.contains("backstop_vm_state{vm=\"bad\",state=\"config_invalid\"} 1"));
        assert!(!text.contains("backstop_vm_epoch{vm=\"bad\"}"), "{text}");
    }

    #[test]
    fn only_get_metrics_is_served() {
        assert_eq!(
            parse_request("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Asked::Metrics
        );
        assert_eq!(
            parse_request("GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Asked::Metrics
        );
        assert_eq!(
            parse_request("HEAD /metrics HTTP/1.1\r\n\r\n"),
            Asked::Metrics
        );
        assert_eq!(parse_request("GET / HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(
            parse_request("POST /metrics HTTP/1.1\r\n\r\n"),
            Asked::MethodNotAllowed
        );
        assert_eq!(parse_request("GET /metrics\r\n\r\n"), Asked::BadRequest);
        assert_eq!(parse_request("\u{0}\u{1}"), Asked::BadRequest);
    }

    #[test]
    fn a_scrape_over_a_unix_socket_answers_http() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m/metrics.sock");
        let listener = Listener::bind(&MetricsEndpoint::Unix(path.clone()), None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let source: StatusSource = Arc::new(|| vec![running("web")]);
        serve(listener, source).unwrap();
        let mut c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains(CONTENT_TYPE), "{out}");
        assert!(out.contains("backstop_vm_epoch{vm=\"web\"} 2"), "{out}");
        // A stale socket (left by a crash) is replaced; a regular file is not.
        Listener::bind(&MetricsEndpoint::Unix(path.clone()), None).unwrap();
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, "keep").unwrap();
        assert!(Listener::bind(&MetricsEndpoint::Unix(file.clone()), None).is_err());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    }
}
