//! systemd as it is meant, against a fake `$NOTIFY_SOCKET` (a datagram socket this test binds):
//! `EXTEND_TIMEOUT_USEC=` while the VMs start, then `READY=1`, a `STATUS=` line, `WATCHDOG=1` pings
//! at the pace `$WATCHDOG_USEC` asks that keep flowing through a rollback, and on SIGTERM
//! `STOPPING=1` with the stop extended while the final snapshot is taken.
#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backstop_e2e::{skip_unless_ready, Daemon};

/// Every datagram received, with when.
type Seen = Arc<Mutex<Vec<(Instant, String)>>>;

fn listen(sock: UnixDatagram) -> Seen {
    let seen: Seen = Arc::default();
    let out = Arc::clone(&seen);
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        // Ends with the test process; bounded by the test's own run.
        loop {
            if let Ok(n) = sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                out.lock().unwrap().push((Instant::now(), msg));
            }
        }
    });
    seen
}

fn messages(seen: &Seen) -> Vec<String> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|(_, m)| m.clone())
        .collect()
}

fn position(seen: &Seen, pred: impl Fn(&str) -> bool) -> Option<usize> {
    messages(seen).iter().position(|m| pred(m))
}

fn wait_for(seen: &Seen, what: &str, within: Duration, pred: impl Fn(&str) -> bool) -> usize {
    let deadline = Instant::now() + within;
    loop {
        if let Some(i) = position(seen, &pred) {
            return i;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not sent within {within:?}; got {:?}",
            messages(seen)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The watchdog's interval for this test: pings at half of it, at most a quarter late.
const WATCHDOG_USEC: u64 = 4_000_000;

#[test]
fn systemd_is_told_ready_status_watchdog_extensions_and_stopping() {
    if skip_unless_ready("systemd_is_told_ready_status_watchdog_extensions_and_stopping") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let seen = listen(UnixDatagram::bind(&notify).unwrap());
    let path = notify.display().to_string();
    let watchdog = WATCHDOG_USEC.to_string();
    let mut d = Daemon::start_with(
        "sd-notify",
        "",
        &[
            ("NOTIFY_SOCKET", path.as_str()),
            ("WATCHDOG_USEC", watchdog.as_str()),
        ],
    );
    let ready = wait_for(&seen, "READY=1", Duration::from_secs(30), |m| {
        m == "READY=1"
    });
    // Start-up was extended (by the wedge limit, 60 s by default) before READY=1.
    let extended = position(&seen, |m| m == "EXTEND_TIMEOUT_USEC=60000000");
    assert!(
        extended.is_some_and(|i| i < ready),
        "no extension before READY=1: {:?}",
        messages(&seen)
    );
    wait_for(&seen, "a STATUS= line", Duration::from_secs(30), |m| {
        m.starts_with("STATUS=guarding 1 VM: 1 running")
    });
    d.wait_tick(0, 2, Duration::from_secs(90));

    // Pings keep flowing while a rollback runs (verify, restore, resume).
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    d.ok(&[
        "trigger",
        "force_rollback",
        "--reason",
        "watchdog pings during a rollback",
    ]);
    std::thread::sleep(Duration::from_secs(3));
    let t1 = Instant::now();
    let pings: Vec<Instant> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, m)| m == "WATCHDOG=1" && *at >= t0 && *at <= t1)
        .map(|(at, _)| *at)
        .collect();
    assert!(pings.len() >= 3, "{} pings in {:?}", pings.len(), t1 - t0);
    let interval = Duration::from_micros(WATCHDOG_USEC);
    let mut gaps = vec![pings[0] - t0, t1 - pings[pings.len() - 1]];
    gaps.extend(pings.windows(2).map(|w| w[1] - w[0]));
    let longest = gaps.iter().max().unwrap();
    assert!(
        *longest < interval * 3 / 4 + Duration::from_millis(500),
        "a watchdog gap of {longest:?} (interval {interval:?}): {gaps:?}"
    );
    // Not faster than half the interval either (the protocol's pace).
    let shortest = pings.windows(2).map(|w| w[1] - w[0]).min().unwrap();
    assert!(
        shortest >= interval / 2 - Duration::from_millis(50),
        "{shortest:?}"
    );

    // SIGTERM: STOPPING=1, then the stop (a final snapshot) is extended too.
    let before_stop = messages(&seen).len();
    d.stop();
    // (The listener may not have read the last datagrams yet.)
    std::thread::sleep(Duration::from_millis(500));
    let after: Vec<String> = messages(&seen)[before_stop..].to_vec();
    let stopping = after.iter().position(|m| m == "STOPPING=1");
    assert!(stopping.is_some(), "no STOPPING=1: {after:?}");
    assert!(
        after[stopping.unwrap()..]
            .iter()
            .any(|m| m == "EXTEND_TIMEOUT_USEC=60000000"),
        "the stop was not extended: {after:?}"
    );
    // The log file (not a terminal) carries no colour codes.
    assert!(!d.log().contains('\u{1b}'), "colour codes in the log file");
}
