//! The live view: `status` carries the last rollback, heartbeat age, links and grants; an
//! OpenMetrics endpoint (`daemon.metrics`, off by default, this host only) serves every VM's
//! figures at `GET /metrics` over a Unix socket or a loopback port.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use backstop_e2e::{skip_unless_ready, Daemon};

/// One HTTP/1.1 exchange on a connected stream: (status line, headers, body).
fn exchange(mut conn: impl Read + Write, request: &str) -> (String, String, String) {
    conn.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    conn.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_string(), headers.to_string(), body.to_string())
}

const GET: &str = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";

fn scrape_unix(path: &Path) -> String {
    let conn = std::os::unix::net::UnixStream::connect(path).unwrap();
    let (status, headers, body) = exchange(conn, GET);
    assert_eq!(status, "HTTP/1.1 200 OK", "{headers}\n{body}");
    assert!(
        headers.contains("application/openmetrics-text; version=1.0.0"),
        "{headers}"
    );
    body
}

fn scrape_tcp(addr: &str) -> String {
    let conn = std::net::TcpStream::connect(addr).unwrap();
    let (status, headers, body) = exchange(conn, GET);
    assert_eq!(status, "HTTP/1.1 200 OK", "{headers}\n{body}");
    body
}

/// The samples of a text exposition: `name{labels}` → value. Checks the format as it goes:
/// every sample's family was declared (`# TYPE`) and the text ends with `# EOF`.
fn parse(text: &str) -> BTreeMap<String, f64> {
    assert!(text.ends_with("# EOF\n"), "no # EOF at the end:\n{text}");
    let mut declared = Vec::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            declared.push(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let name = series.split('{').next().unwrap();
        assert!(
            declared.iter().any(|d| name.starts_with(d.as_str())),
            "{name} has no # TYPE:\n{text}"
        );
        samples.insert(series.to_string(), value.parse::<f64>().unwrap());
    }
    samples
}

fn sample(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    *m.get(series)
        .unwrap_or_else(|| panic!("no {series} in {:#?}", m.keys().collect::<Vec<_>>()))
}

/// All rollbacks of the VM, whatever their trigger.
fn rollbacks(m: &BTreeMap<String, f64>) -> f64 {
    m.iter()
        .filter(|(k, _)| k.starts_with("backstop_rollbacks_total{vm=\"e2e\","))
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn metrics_on_a_unix_socket_follow_the_vm_through_a_rollback() {
    if skip_unless_ready("metrics_on_a_unix_socket_follow_the_vm_through_a_rollback") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.sock");
    let mut d = Daemon::start_with(
        "metrics-unix",
        &format!("metrics = \"unix:{}\"", path.display()),
        &[],
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "root only without daemon.socket_group");
    d.wait_tick(0, 2, Duration::from_secs(90));
    let st = d.wait_status("a heartbeat", Duration::from_secs(60), |s| {
        s["heartbeat_age_ms"].is_u64()
    });
    // The status's live fields: the NIC's link as the guest reads it (a configured NIC no
    // grant controls starts up), no grant, no rollback yet.
    assert_eq!(st["links"][0]["nic"], "net0", "{st}");
    assert_ne!(st["links"][0]["up"], false, "{st}");
    assert!(st.get("granted_devices").is_none(), "{st}");
    assert!(st.get("last_rollback").is_none(), "{st}");
    assert!(st["newest_snapshot_pause_us"].is_u64(), "{st}");
    assert!(st["store_bytes"].as_u64().unwrap() > 0, "{st}");

    let before = parse(&scrape_unix(&path));
    assert_eq!(
        sample(&before, "backstop_vm_state{vm=\"e2e\",state=\"running\"}"),
        1.0
    );
    assert_eq!(
        sample(&before, "backstop_vm_state{vm=\"e2e\",state=\"halted\"}"),
        0.0
    );
    assert!(sample(&before, "backstop_snapshots{vm=\"e2e\"}") >= 1.0);
    let age_s = sample(&before, "backstop_newest_snapshot_age_seconds{vm=\"e2e\"}");
    assert!((0.0..600.0).contains(&age_s), "snapshot age {age_s}");
    let hb_ms = sample(&before, "backstop_heartbeat_age_milliseconds{vm=\"e2e\"}");
    assert!((0.0..30_000.0).contains(&hb_ms), "heartbeat age {hb_ms}");
    assert!(sample(&before, "backstop_store_bytes{vm=\"e2e\"}") > 0.0);
    assert_eq!(sample(&before, "backstop_halts_total{vm=\"e2e\"}"), 0.0);
    assert!(
        sample(
            &before,
            "backstop_snapshot_pause_microseconds_count{vm=\"e2e\"}"
        ) >= 1.0
    );
    let pause_sum = sample(
        &before,
        "backstop_snapshot_pause_microseconds_sum{vm=\"e2e\"}",
    );
    assert!(
        pause_sum > 0.0 && pause_sum < 60e6,
        "pause sum {pause_sum} us"
    );
    assert_eq!(
        sample(&before, "backstop_link_up{vm=\"e2e\",nic=\"net0\"}"),
        1.0
    );
    let rolled_before = rollbacks(&before);
    let durations_before = before
        .get("backstop_rollback_duration_milliseconds_count{vm=\"e2e\"}")
        .copied()
        .unwrap_or(0.0);

    let r = d.ok(&["trigger", "force_rollback", "--reason", "x"]);
    let after = parse(&scrape_unix(&path));
    assert_eq!(rollbacks(&after), rolled_before + 1.0, "{r}");
    assert_eq!(
        sample(
            &after,
            "backstop_rollbacks_total{vm=\"e2e\",trigger=\"force_rollback\"}"
        ),
        before
            .get("backstop_rollbacks_total{vm=\"e2e\",trigger=\"force_rollback\"}")
            .copied()
            .unwrap_or(0.0)
            + 1.0
    );
    assert_eq!(
        sample(
            &after,
            "backstop_rollback_duration_milliseconds_count{vm=\"e2e\"}"
        ),
        durations_before + 1.0
    );
    let took_ms = sample(
        &after,
        "backstop_rollback_duration_milliseconds_sum{vm=\"e2e\"}",
    );
    assert!(
        took_ms > 0.0 && took_ms < 300_000.0,
        "rollback {took_ms} ms"
    );
    assert_eq!(
        sample(&after, "backstop_vm_epoch{vm=\"e2e\"}"),
        r["epoch"].as_f64().unwrap()
    );
    // The status says the same, and the link is down after the rollback (no network survives).
    let st = d.status();
    let last = &st["last_rollback"];
    assert_eq!(last["trigger"], "force_rollback", "{st}");
    assert_eq!(last["snapshot_id"], r["snapshot_id"], "{st}");
    assert!(last["duration_ms"].as_u64().unwrap() > 0, "{st}");
    assert!(last["at"].as_str().unwrap().ends_with('Z'), "{st}");
    assert_eq!(st["rollbacks_by_trigger"]["force_rollback"], 1, "{st}");
    let st = d.wait_status("links read again", Duration::from_secs(30), |s| {
        s["links"][0]["nic"] == "net0"
    });
    assert_ne!(st["links"][0]["up"], true, "{st}");

    // Only GET /metrics is served.
    let conn = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let (status, _, _) = exchange(conn, "GET /other HTTP/1.1\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let conn = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let (status, headers, _) = exchange(conn, "POST /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
    assert!(headers.contains("Allow: GET"), "{headers}");
    // A clean stop removes the socket.
    d.stop();
    assert!(!path.exists(), "metrics socket left after a clean stop");
}

#[test]
fn metrics_on_a_loopback_port() {
    if skip_unless_ready("metrics_on_a_loopback_port") {
        return;
    }
    // A port free a moment ago (the daemon binds it before starting the VM).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start_with("metrics-tcp", &format!("metrics = \"{addr}\""), &[]);
    let m = parse(&scrape_tcp(&addr));
    assert_eq!(
        sample(&m, "backstop_vm_state{vm=\"e2e\",state=\"running\"}"),
        1.0
    );
    assert!(sample(&m, "backstop_snapshots{vm=\"e2e\"}") >= 1.0);
    assert!(d.log().contains("metrics endpoint ready"), "{}", d.log());
}

/// `daemon.metrics` with a non-local address: a one-line config error naming the key, exit
/// code 2, nothing started.
#[test]
fn a_metrics_address_off_this_host_is_refused_at_load() {
    let bin = backstop_e2e::bin("backstopd");
    if !bin.exists() {
        eprintln!(
            "SKIPPED a_metrics_address_off_this_host_is_refused_at_load: backstopd not built"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let run = dir.path().join("run");
    for value in ["0.0.0.0:9464", "192.0.2.1:9464", "unix:relative.sock"] {
        let config = dir.path().join("backstopd.toml");
        std::fs::write(
            &config,
            format!(
                "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\nmetrics = \"{value}\"\n",
                state.display(),
                run.display(),
                dir.path().join("vms.d").display()
            ),
        )
        .unwrap();
        for check in [false, true] {
            let mut cmd = Command::new(&bin);
            cmd.arg("--config").arg(&config);
            if check {
                cmd.arg("--check-config");
            }
            let out = cmd.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{value}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{value}: {stderr}");
            assert!(
                stderr.starts_with("backstopd: ERR_CONFIG_INVALID: ")
                    && stderr.contains("`daemon.metrics`")
                    && stderr.contains(value),
                "{value}: {stderr}"
            );
        }
        assert!(
            !state.exists() && !run.exists(),
            "{value}: something started"
        );
    }
}

#[test]
fn metrics_are_off_by_default() {
    if skip_unless_ready("metrics_are_off_by_default") {
        return;
    }
    let mut d = Daemon::start("metrics-off");
    // No metrics thread runs and nothing but the control socket is listened on.
    let pid = d.pid().unwrap();
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    assert!(threads.iter().any(|t| t == "accept"), "{threads:?}");
    assert!(
        !threads.iter().any(|t| t.starts_with("metrics")),
        "{threads:?}"
    );
    let listening_tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap();
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|f| std::fs::read_link(f.unwrap().path()).ok())
        .map(|l| l.display().to_string())
        .filter_map(|l| {
            l.strip_prefix("socket:[")
                .map(|s| s.trim_end_matches(']').to_string())
        })
        .collect();
    // State 0A is LISTEN: the daemon holds no listening TCP socket.
    for line in listening_tcp.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.get(3) == Some(&"0A") {
            assert!(
                !inodes.iter().any(|i| Some(&i.as_str()) == cols.get(9)),
                "backstopd listens on TCP: {line}"
            );
        }
    }
    assert!(!d.log().contains("metrics endpoint"), "{}", d.log());
    d.stop();
}

/// A metrics port already taken fails the start with one line, before any VM starts (the
/// daemon journal is not even opened).
#[test]
fn a_metrics_port_in_use_fails_the_start() {
    let bin = backstop_e2e::bin("backstopd");
    if !bin.exists() {
        eprintln!("SKIPPED a_metrics_port_in_use_fails_the_start: backstopd not built");
        return;
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let vms = dir.path().join("vms.d");
    std::fs::create_dir_all(&vms).unwrap();
    let config = dir.path().join("backstopd.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\nmetrics = \"{addr}\"\n",
            state.display(),
            dir.path().join("run").display(),
            vms.display()
        ),
    )
    .unwrap();
    let out = Command::new(&bin)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with(&format!(
            "backstopd: ERR_IO: metrics endpoint {addr} (daemon.metrics): "
        )),
        "{stderr}"
    );
    assert!(
        !state.join("daemon/journal.jsonl").exists(),
        "the daemon started its VMs"
    );
    drop(taken);
}
