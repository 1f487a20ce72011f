//! backstopd: loads the config, starts one actor per VM under a supervisor, serves the control
//! socket. Thin by design: every decision lives in `backstop-engine`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};

use backstop_control::{
    Accepted, AccessPolicy, Connection, ControlServer, Reply, Request, Response, WireError,
};
use backstop_engine::supervisor::Supervisor;
use backstop_engine::systemd::{NotifyState, TimeoutExtender};
use backstop_engine::{Caller, HostConfig, VmSlot};
use backstopd::Args;

mod offsite;

fn main() -> ExitCode {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", backstop_engine::config::DEFAULT_CONFIG);
        return ExitCode::SUCCESS;
    }
    init_logging(args.log_json);
    let host = match &args.config {
        Some(p) => HostConfig::load(p),
        None => HostConfig::parse(backstop_engine::config::DEFAULT_CONFIG),
    };
    let host = match host {
        Ok(c) => c.refuse_missing_files(),
        Err(e) => {
            fatal(args.log_json, &format!("{}: {e}", e.code()));
            return ExitCode::from(2);
        }
    };
    // `[offsite]`: the daemon file's, parsed strictly; a bad one starts nothing.
    let offsite_cfg = match &args.config {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| format!("ERR_CONFIG_INVALID: {}: {e}", p.display()))
            .and_then(|text| {
                backstop_offsite::OffsiteConfig::from_file_text(&text, &|k| std::env::var(k).ok())
                    .map_err(|e| format!("{}: {e}", e.code()))
            }),
        None => Ok(None),
    };
    let offsite_cfg = match offsite_cfg {
        Ok(c) => c,
        Err(msg) => {
            fatal(args.log_json, &msg);
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        let mut bad = false;
        if let Err(e) = host.daemon.socket_gid() {
            bad = true;
            println!("config REFUSED: daemon: {}: {e}", e.code());
        }
        for vm in &host.vms {
            match vm {
                // An adopted domain is checked against libvirt too: every problem at once.
                VmSlot::Ready(c) if c.vm.libvirt.is_some() => {
                    let r = backstop_engine::services::check_vm(c);
                    if r.problems.is_empty() {
                        println!("config OK: vm {} ({})", c.vm.name, r.notes.join("; "));
                    } else {
                        bad = true;
                        for p in &r.problems {
                            println!("config REFUSED: vm {}: {p}", c.vm.name);
                        }
                    }
                }
                VmSlot::Ready(c) => println!("config OK: vm {}", c.vm.name),
                VmSlot::Invalid(i) => {
                    bad = true;
                    println!(
                        "config REFUSED: vm {} ({}): {}: {}",
                        i.name,
                        i.file.display(),
                        i.code,
                        i.reason
                    );
                }
            }
        }
        return if bad {
            ExitCode::from(2)
        } else {
            ExitCode::SUCCESS
        };
    }
    match run(host, args.config.clone(), offsite_cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            fatal(args.log_json, &msg);
            ExitCode::from(1)
        }
    }
}

/// The one line a fatal error gets on stderr: `backstopd: CODE: message`, or under `--log-json`
/// a JSON object like the log lines around it (`level`, `fatal`, `message`).
fn fatal(json: bool, msg: &str) {
    if json {
        let line = serde_json::json!({
            "timestamp": backstop_common::time::now_rfc3339(),
            "level": "ERROR", "fatal": true, "target": "backstopd", "message": msg,
        });
        eprintln!("{line}");
    } else {
        eprintln!("backstopd: {msg}");
    }
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BACKSTOP_LOG")
        .unwrap_or_else(|_| "info".into());
    // No colour codes in a journal or a file: only a terminal gets them.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Raises the soft descriptor limit to the hard one (systemd's default soft limit is 1024,
/// the hard one far higher): every VM holds QEMU's sockets, its journal and, while verifying or
/// capturing, chunk files, and running out is an outage, not a verdict (see
/// `backstop_common::resources`).
fn raise_descriptor_limit() {
    // SAFETY: getrlimit/setrlimit on a stack rlimit struct.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: l.rlim_max,
                rlim_max: l.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                tracing::info!(
                    from = l.rlim_cur,
                    to = l.rlim_max,
                    "descriptor limit raised"
                );
            }
        }
    }
}

fn run(
    host: HostConfig,
    config_path: Option<PathBuf>,
    offsite_cfg: Option<backstop_offsite::OffsiteConfig>,
) -> Result<(), String> {
    raise_descriptor_limit();
    // Signals are taken by one thread with sigwait; every other thread, and QEMU's children
    // (which reset their mask), inherit the mask set here.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    // SIGHUP is `backstop reload` (what `kill -HUP` and a classic ExecReload expect), never an
    // end: its default action would kill the daemon, which is a crash (every VM rolled back).
    signals.add(Signal::SIGHUP);
    signals
        .thread_block()
        .map_err(|e| format!("blocking signals: {e}"))?;

    let state_dir = &host.daemon.state_dir;
    std::fs::create_dir_all(state_dir)
        .map_err(|e| format!("ERR_IO: {}: {e}", state_dir.display()))?;
    let _lock = lock_state_dir(state_dir)?;
    let access = AccessPolicy {
        console_uids: host.daemon.console_uids.clone(),
        policy_uids: host.daemon.policy_uids.clone(),
        console_gids: host.daemon.console_gids.clone(),
        policy_gids: host.daemon.policy_gids.clone(),
        socket_gid: host
            .daemon
            .socket_gid()
            .map_err(|e| format!("{}: {e}", e.code()))?,
    };
    let socket_gid = access.socket_gid;
    let socket = host.socket_path();
    // Bind before starting any VM: a second daemon must fail before it touches anything.
    let server = ControlServer::bind(&socket, access).map_err(|e| format!("{}: {e}", e.code()))?;
    // The metrics endpoint too: an address in use fails the start, not a later scrape.
    let metrics = match host
        .daemon
        .metrics_endpoint()
        .map_err(|e| format!("{}: {e}", e.code()))?
    {
        Some(endpoint) => Some(
            backstopd::metrics::Listener::bind(&endpoint, socket_gid).map_err(|e| {
                format!("ERR_IO: metrics endpoint {endpoint} (daemon.metrics): {e}")
            })?,
        ),
        None => None,
    };
    // Every VM is verified and restored (or resumed) before READY=1: on a large store that
    // outlasts TimeoutStartSec=, so the start-up is extended while the actors show progress.
    let silence_limit = std::time::Duration::from_secs(host.daemon.actor_silence_limit_secs);
    let starting = TimeoutExtender::start(silence_limit);
    let engine =
        Arc::new(Supervisor::start(&host, config_path).map_err(|e| format!("{}: {e}", e.code()))?);
    drop(starting);
    // The host's ed25519 key, made at first start beside the HMAC key: what other hosts of the
    // fleet check this host's replicated manifests against (its public half in `.pub`).
    let key_path = host.key_path();
    let key_dir = key_path
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| state_dir.clone());
    let signer = backstop_offsite::HostSigningKey::load_or_create(&key_dir)
        .map_err(|e| format!("ERR_IO: host ed25519 key: {e}"))?;
    let offsite = match offsite_cfg {
        Some(cfg) => {
            let hmac = backstop_integrity::HostKey::load_or_create(&key_path)
                .map_err(|e| format!("ERR_IO: host key: {e}"))?;
            let o = offsite::Offsite::start(cfg, state_dir, hmac, signer, &engine)
                .map_err(|e| format!("ERR_IO: offsite: {e}"))?;
            Some(Arc::new(o))
        }
        None => None,
    };
    let metrics_socket = match metrics {
        Some(listener) => {
            let at = listener.describe();
            let path = listener.socket_path().map(std::path::Path::to_path_buf);
            let source_engine = Arc::clone(&engine);
            backstopd::metrics::serve(listener, Arc::new(move || source_engine.statuses()))
                .map_err(|e| format!("ERR_IO: spawn metrics threads: {e}"))?;
            tracing::info!(endpoint = %at, "metrics endpoint ready (GET /metrics)");
            path
        }
        None => None,
    };
    tracing::info!(socket = %socket.display(), vms = host.vms.len(), "control socket ready");
    backstop_engine::systemd::notify(&[NotifyState::Ready]);

    let server = Arc::new(server);
    {
        let engine = Arc::clone(&engine);
        let server = Arc::clone(&server);
        let offsite = offsite.clone();
        std::thread::Builder::new()
            .name("accept".into())
            .spawn(move || accept_loop(&server, &engine, offsite))
            .map_err(|e| format!("spawn accept thread: {e}"))?;
    }
    // Wait for a signal; meanwhile HALT the VM of any actor silent past its limit (that VM
    // alone), and ping systemd's watchdog while every other actor is alive (a daemon too stuck
    // to do this is restarted by systemd).
    let mut last_status = String::new();
    let sig = loop {
        engine.halt_wedged();
        if engine.all_alive() {
            backstop_engine::systemd::watchdog_ping();
        }
        // `systemctl status` shows this line.
        let status = status_line(&engine.vms());
        if status != last_status {
            backstop_engine::systemd::notify(&[NotifyState::Status(&status)]);
            last_status = status;
        }
        match wait_signal(&signals, backstop_engine::systemd::loop_period()) {
            Ok(Some(Signal::SIGHUP)) => reload_in_background(&engine),
            Ok(Some(sig)) => break sig,
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for signals: {e}")),
        }
    };
    tracing::info!(signal = ?sig, "stopping");
    backstop_engine::systemd::notify(&[NotifyState::Stopping]);
    // A clean stop: each guest is paused and a final snapshot taken (the next start resumes
    // from it), then each VM ends. The accept thread may still hold the supervisor; requests
    // get ERR_SHUTTING_DOWN from here on. The final snapshots can outlast TimeoutStopSec=:
    // extended while the actors show progress.
    let stopping = TimeoutExtender::start(silence_limit);
    engine.shutdown();
    // Every VM has stopped: its lease is deleted so another host may start it at once.
    if let Some(o) = &offsite {
        o.release_leases();
    }
    drop(stopping);
    let _ = std::fs::remove_file(&socket);
    if let Some(path) = metrics_socket {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// SIGHUP: the VM files are read again as `backstop reload` does, off the signal thread (a
/// reload may take final snapshots of changed VMs; the watchdog pings go on meanwhile). Two
/// reloads never overlap: the supervisor serialises them.
fn reload_in_background(engine: &Arc<Supervisor>) {
    let engine = Arc::clone(engine);
    let spawned = std::thread::Builder::new()
        .name("sighup-reload".into())
        .spawn(move || {
            // MONOTONIC_USEC pairs with RELOADING=1 (systemd ≥ 253 wants both together).
            match NotifyState::monotonic_usec_now() {
                Ok(now) => backstop_engine::systemd::notify(&[NotifyState::Reloading, now]),
                Err(_) => backstop_engine::systemd::notify(&[NotifyState::Reloading]),
            }
            match engine.reload() {
                Ok(r) => tracing::info!(
                    added = ?r.added, removed = ?r.removed, applied = ?r.applied,
                    changed_not_applied = ?r.changed_not_applied, refused = ?r.refused,
                    "SIGHUP: VM files reloaded"
                ),
                Err((code, message)) => {
                    tracing::error!(%code, %message, "SIGHUP: reload refused; nothing changed")
                }
            }
            backstop_engine::systemd::notify(&[NotifyState::Ready]);
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "SIGHUP: could not start the reload");
    }
}

/// Waits up to `timeout` for one of the blocked `signals`.
fn wait_signal(
    signals: &SigSet,
    timeout: std::time::Duration,
) -> Result<Option<Signal>, nix::Error> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the set is a valid sigset_t owned by `signals`; no siginfo is asked for (null);
    // `ts` lives across the call.
    let rc = unsafe { libc::sigtimedwait(signals.as_ref(), std::ptr::null_mut(), &ts) };
    if rc >= 0 {
        return Signal::try_from(rc).map(Some);
    }
    match nix::errno::Errno::last() {
        nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR => Ok(None),
        e => Err(e),
    }
}

/// At most this many connections are served at once (each holds a descriptor and a thread
/// until its request is answered, or for at most the request timeout if it sends nothing): local
/// clients, idle or not, cannot take every descriptor the VMs need.
const MAX_CLIENTS: usize = 64;

/// Counts a connection as served until dropped.
struct ClientSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// One line for `systemctl status`: how many VMs, in which states.
fn status_line(vms: &[backstop_control::VmSummary]) -> String {
    let mut by_state: std::collections::BTreeMap<&str, usize> = Default::default();
    for vm in vms {
        *by_state.entry(vm.state.as_str()).or_default() += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
    format!(
        "guarding {} VM{}: {}",
        vms.len(),
        if vms.len() == 1 { "" } else { "s" },
        states.join(", ")
    )
}

fn accept_loop(
    server: &ControlServer,
    engine: &Arc<Supervisor>,
    offsite: Option<Arc<offsite::Offsite>>,
) {
    use std::sync::atomic::Ordering;
    let clients = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        match server.accept() {
            Ok(Accepted::Conn(mut conn)) => {
                if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                    clients.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!(
                        uid = conn.peer().uid,
                        max = MAX_CLIENTS,
                        "control connection refused: too many clients"
                    );
                    let _ = conn.send(&Reply::Failed {
                        code: backstop_common::ErrorCode::ControlTooManyClients.as_str().into(),
                        message: format!(
                            "backstopd serves at most {MAX_CLIENTS} connections at once; retry when one ends"
                        ),
                    });
                    continue;
                }
                let slot = ClientSlot(Arc::clone(&clients));
                let engine = Arc::clone(engine);
                let offsite = offsite.clone();
                let _ = std::thread::Builder::new()
                    .name("conn".into())
                    .spawn(move || {
                        let _slot = slot;
                        serve(conn, &engine, offsite.as_deref())
                    });
            }
            Ok(Accepted::Refused { peer }) => {
                tracing::warn!(uid = peer.uid, pid = peer.pid, "control connection refused");
                engine.note_refused(peer.uid, peer.pid);
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}

fn serve(mut conn: Connection, engine: &Supervisor, offsite: Option<&offsite::Offsite>) {
    let Ok(envelope) = conn.read_envelope() else {
        return;
    };
    let request = envelope.request;
    tracing::debug!(
        op = request.name(),
        uid = conn.peer().uid,
        "request received"
    );
    let caller = Caller {
        role: conn.role(),
        uid: conn.peer().uid,
    };
    if let Err(msg) = permitted(conn.role(), &request) {
        let _ = conn.send(&Reply::from(WireError::new(
            backstop_common::ErrorCode::ControlPermissionDenied,
            msg,
        )));
        return;
    }
    // Requests about the set of VMs are the daemon's own.
    match request {
        Request::Vms => {
            let _ = conn.send(&Reply::Done(Response::Vms { vms: engine.vms() }));
            return;
        }
        Request::DaemonAuditVerify => {
            let reply = match engine.audit_verify() {
                Ok(r) => Reply::Done(Response::AuditVerified(r)),
                Err((code, message)) => Reply::Failed {
                    code: code.to_string(),
                    message,
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        Request::Events {
            since,
            types,
            follow,
        } => {
            serve_events(
                &mut conn,
                engine,
                envelope.vm.as_deref(),
                since,
                types,
                follow,
            );
            return;
        }
        Request::Reload => {
            let reply = match engine.reload() {
                Ok(r) => Reply::Done(Response::Reloaded(r)),
                Err((code, message)) => Reply::Failed {
                    code: code.to_string(),
                    message,
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        Request::VmAdd {
            file_name,
            text,
            from_snapshot,
            from,
        } => {
            let _ = conn.send(&vm_add(
                engine,
                offsite,
                &file_name,
                &text,
                from_snapshot.as_deref(),
                from.as_deref(),
            ));
            return;
        }
        Request::VmCheck { file_name, text } => {
            let reply = match engine.check_vm_file(&file_name, &text) {
                Ok(r) => Reply::Done(Response::VmChecked(r)),
                Err((code, message)) => Reply::Failed {
                    code: code.to_string(),
                    message,
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        Request::VmReset { name, reason } => {
            let reply = match engine.reset_vm(&name, &reason, &caller.label()) {
                Ok(r) => Reply::Done(Response::VmReset(r)),
                Err((code, message)) => Reply::Failed {
                    code: code.to_string(),
                    message,
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        Request::SnapshotPull {
            id,
            from,
            for_start,
        } => {
            let reply = match offsite {
                Some(o) => o.pull(
                    engine,
                    envelope.vm.as_deref(),
                    &id,
                    &from,
                    for_start,
                    caller,
                ),
                None => Reply::Failed {
                    code: backstop_common::ErrorCode::OffsiteNotConfigured
                        .as_str()
                        .into(),
                    message: "this daemon has no [offsite] table: nothing to pull from".into(),
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        Request::OffsiteGc { dry_run } => {
            let reply = match offsite {
                Some(o) => o.gc(dry_run),
                None => Reply::Failed {
                    code: backstop_common::ErrorCode::OffsiteNotConfigured
                        .as_str()
                        .into(),
                    message: "this daemon has no [offsite] table: no bucket to collect".into(),
                },
            };
            let _ = conn.send(&reply);
            return;
        }
        _ => {}
    }
    // `status` of a VM that does not run shows it stopped, and why, as `vms` does.
    if let Request::Status = request {
        if let Some(view) = engine.status_of_down(envelope.vm.as_deref()) {
            let _ = conn.send(&Reply::Done(Response::Status(view)));
            return;
        }
    }
    let vm = match engine.route(envelope.vm.as_deref()) {
        Ok(vm) => vm,
        Err((code, message)) => {
            let _ = conn.send(&Reply::Failed {
                code: code.to_string(),
                message,
            });
            return;
        }
    };
    let mut reply = if let Request::Status = request {
        Reply::Done(Response::Status(vm.status()))
    } else {
        let sink = conn.progress_sink();
        let progress = Box::new(move |p: backstop_control::Progress| {
            sink.progress(&p.step, &p.message, p.bytes)
        });
        match vm.call(request, caller, progress) {
            Ok(r) => Reply::Done(r),
            Err(e) => Reply::from(e),
        }
    };
    if let (Some(o), Reply::Done(response)) = (offsite, &mut reply) {
        o.annotate(vm.name(), response);
    }
    let _ = conn.send(&reply);
}

/// `vm add FILE [--from-snapshot ID --from HOST]`: the daemon's own (it changes the set of VMs).
fn vm_add(
    engine: &Supervisor,
    offsite: Option<&offsite::Offsite>,
    file_name: &str,
    text: &str,
    from_snapshot: Option<&str>,
    from: Option<&str>,
) -> Reply {
    use backstop_common::ErrorCode;
    let fail = |code: ErrorCode, message: String| Reply::Failed {
        code: code.to_string(),
        message,
    };
    match (from_snapshot, from) {
        (Some(id), Some(host)) => match offsite {
            Some(o) => o.add_from_snapshot(engine, file_name, text, id, host),
            None => fail(
                ErrorCode::OffsiteNotConfigured,
                "this daemon has no [offsite] table: there is no snapshot to start from".into(),
            ),
        },
        (None, None) => {
            let started = std::time::Instant::now();
            let new = match engine.check_new_vm(file_name, text) {
                Ok(n) => n,
                Err((code, message)) => return fail(code, message),
            };
            // A VM another host runs is not cold-booted here too.
            if let Some(Err((code, message))) = offsite.map(|o| o.check_plain_add(&new.cfg.vm.name))
            {
                return fail(code, message);
            }
            match engine.add_vm(&new, serde_json::json!({})) {
                Ok(vm) => Reply::Done(Response::VmAdded(backstop_control::VmAddReport {
                    vm,
                    file: new.dest.display().to_string(),
                    from_snapshot: None,
                    total_ms: started.elapsed().as_millis() as u64,
                })),
                Err(e) => fail(e.code, e.message),
            }
        }
        _ => fail(
            ErrorCode::BadRequest,
            "--from-snapshot ID and --from HOST go together: nothing changed".into(),
        ),
    }
}

/// An `events` subscription, on this connection's thread: it reads the VMs' journals back
/// (read-only) and never waits on an actor. Ends when caught up (not following), when the
/// client goes away, or when the daemon stops.
fn serve_events(
    conn: &mut Connection,
    engine: &Supervisor,
    vm: Option<&str>,
    since: Option<u64>,
    types: Vec<String>,
    follow: bool,
) {
    let fail = |conn: &mut Connection, code: backstop_common::ErrorCode, message: String| {
        let _ = conn.send(&Reply::Failed {
            code: code.to_string(),
            message,
        });
    };
    if let Err((code, message)) = backstop_engine::subscribers::check_types(&types) {
        return fail(conn, code, message);
    }
    let handles = match vm {
        Some(_) => match engine.route(vm) {
            Ok(h) => vec![h],
            Err((code, message)) => return fail(conn, code, message),
        },
        None if since.is_some() && engine.handles().len() > 1 => {
            return fail(
                conn,
                backstop_common::ErrorCode::BadRequest,
                "--since is one VM's sequence number: name the VM (--vm NAME)".into(),
            )
        }
        None => engine.handles(),
    };
    let mut followers = Vec::new();
    for h in &handles {
        match backstop_engine::subscribers::Follower::open(
            h.name(),
            h.journal_path(),
            since,
            types.clone(),
        ) {
            Ok(f) => followers.push(f),
            Err((code, message)) => return fail(conn, code, message),
        }
    }
    let mut delivered = 0u64;
    loop {
        for f in &mut followers {
            match f.poll() {
                Ok(batch) => {
                    for n in batch {
                        if conn.send(&Reply::Event(n)).is_err() {
                            return;
                        }
                        delivered += 1;
                    }
                }
                Err(e) => {
                    return fail(
                        conn,
                        backstop_common::ErrorCode::Io,
                        format!("cannot read a VM journal: {e}"),
                    )
                }
            }
        }
        if !follow {
            let last_seq = handles
                .iter()
                .zip(&followers)
                .map(|(h, f)| (h.name().to_string(), f.last_seq))
                .collect();
            let _ = conn.send(&Reply::Done(Response::Events {
                delivered,
                last_seq,
            }));
            return;
        }
        if conn.client_gone() || conn.peer_closed() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// The host policy engine may trigger, inspect and revoke; only a person at the console clears
/// HALTED or grants a device.
fn permitted(role: backstop_control::Role, request: &Request) -> Result<(), String> {
    match (role, request) {
        (
            backstop_control::Role::Policy,
            Request::HaltClear { .. } | Request::HaltClearTo { .. },
        ) => Err("only a person at the console can clear HALTED".into()),
        (backstop_control::Role::Policy, Request::DeviceGrant { .. }) => {
            Err("only a person at the console can grant devices".into())
        }
        (backstop_control::Role::Policy, Request::Resume { .. }) => {
            Err("only a person at the console can continue a paused guest".into())
        }
        (backstop_control::Role::Policy, Request::SnapshotDelete { .. }) => {
            Err("only a person at the console can delete a snapshot".into())
        }
        (backstop_control::Role::Policy, Request::SnapshotPull { .. }) => {
            Err("only a person at the console can pull a snapshot from another host".into())
        }
        (backstop_control::Role::Policy, Request::OffsiteGc { .. }) => {
            Err("only a person at the console can collect the off-host bucket".into())
        }
        (backstop_control::Role::Policy, Request::Reload) => {
            Err("only a person at the console can reload the VM files".into())
        }
        (backstop_control::Role::Policy, Request::VmAdd { .. }) => {
            Err("only a person at the console can add a VM".into())
        }
        (backstop_control::Role::Policy, Request::VmCheck { .. }) => {
            Err("only a person at the console can check a VM file".into())
        }
        (backstop_control::Role::Policy, Request::VmReset { .. }) => {
            Err("only a person at the console can reset a VM's state".into())
        }
        _ => Ok(()),
    }
}

/// One daemon per state directory: two would fight over the same VM and layers.
fn lock_state_dir(dir: &std::path::Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    let path = dir.join("backstopd.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("ERR_IO: {}: {e}", path.display()))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| {
        format!(
            "ERR_ALREADY_RUNNING: another backstopd holds {}",
            path.display()
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Adding a VM changes the set of VMs: a person at the console only, as reload.
    #[test]
    fn only_the_console_may_add_a_vm() {
        let add = Request::VmAdd {
            file_name: "web.toml".into(),
            text: String::new(),
            from_snapshot: None,
            from: None,
        };
        assert!(permitted(backstop_control::Role::Policy, &add).is_err());
        assert!(permitted(backstop_control::Role::Console, &add).is_ok());
    }

    /// The state directory's lock is held for as long as its guard lives, and refuses a second
    /// holder (flock locks belong to the open file, so a second open in this process conflicts
    /// as another daemon's would).
    #[test]
    fn the_state_dir_lock_refuses_a_second_holder_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock_state_dir(dir.path()).unwrap();
        let err = lock_state_dir(dir.path()).unwrap_err();
        assert!(err.starts_with("ERR_ALREADY_RUNNING: "), "{err}");
        assert!(err.contains("backstopd.lock"), "{err}");
        drop(held);
        lock_state_dir(dir.path()).unwrap();
        let missing = dir.path().join("absent");
        assert!(lock_state_dir(&missing)
            .unwrap_err()
            .starts_with("ERR_IO: "));
    }
}
