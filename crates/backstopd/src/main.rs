//! backstopd: loads the config, starts the engine, serves the control socket. Thin by design:
//! every decision lives in `backstop-engine`.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};

use backstop_control::{
    Accepted, AccessPolicy, Connection, ControlServer, Reply, Request, Response,
};
use backstop_engine::{Caller, Config, EngineHandle};

#[derive(Parser)]
#[command(
    name = "backstopd",
    version,
    about = "backstop daemon: live snapshots and atomic rollback of a QEMU VM"
)]
struct Args {
    /// Config file (TOML). Without it, the embedded default config (vmm-config/default.toml).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Print the embedded default config and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Load and validate the config, then exit.
    #[arg(long)]
    check_config: bool,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long)]
    log_json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", backstop_engine::config::DEFAULT_CONFIG);
        return ExitCode::SUCCESS;
    }
    init_logging(args.log_json);
    let cfg = match &args.config {
        Some(p) => Config::load(p),
        None => Config::parse(backstop_engine::config::DEFAULT_CONFIG),
    };
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("backstopd: {}: {e}", e.code());
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        println!("config OK: vm {}", cfg.vm.name);
        return ExitCode::SUCCESS;
    }
    match run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("backstopd: {msg}");
            ExitCode::from(1)
        }
    }
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BACKSTOP_LOG")
        .unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn run(cfg: Config) -> Result<(), String> {
    // Signals are taken by one thread with sigwait; every other thread, and QEMU's children
    // (which reset their mask), inherit the mask set here.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals
        .thread_block()
        .map_err(|e| format!("blocking signals: {e}"))?;

    std::fs::create_dir_all(&cfg.daemon.state_dir)
        .map_err(|e| format!("ERR_IO: {}: {e}", cfg.daemon.state_dir.display()))?;
    let _lock = lock_state_dir(&cfg.daemon.state_dir)?;
    let access = AccessPolicy {
        console_uids: cfg.daemon.console_uids.clone(),
        policy_uids: cfg.daemon.policy_uids.clone(),
    };
    let socket = cfg.socket_path();
    // Bind before starting the VM: a second daemon must fail before it touches anything.
    let server = ControlServer::bind(&socket, access).map_err(|e| format!("{}: {e}", e.code()))?;
    let engine = Arc::new(EngineHandle::spawn(cfg).map_err(|e| format!("{}: {e}", e.code()))?);
    tracing::info!(socket = %socket.display(), "control socket ready");
    backstop_engine::systemd::notify("READY=1");

    let server = Arc::new(server);
    {
        let engine = Arc::clone(&engine);
        let server = Arc::clone(&server);
        std::thread::Builder::new()
            .name("accept".into())
            .spawn(move || accept_loop(&server, &engine))
            .map_err(|e| format!("spawn accept thread: {e}"))?;
    }
    let sig = signals
        .wait()
        .map_err(|e| format!("waiting for signals: {e}"))?;
    tracing::info!(signal = ?sig, "stopping");
    backstop_engine::systemd::notify("STOPPING=1");
    match Arc::try_unwrap(engine) {
        Ok(e) => e.shutdown(),
        Err(_) => tracing::warn!("engine still in use at shutdown; the VM ends with the process"),
    }
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

fn accept_loop(server: &ControlServer, engine: &Arc<EngineHandle>) {
    loop {
        match server.accept() {
            Ok(Accepted::Conn(conn)) => {
                let engine = Arc::clone(engine);
                let _ = std::thread::Builder::new()
                    .name("conn".into())
                    .spawn(move || serve(conn, &engine));
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

fn serve(mut conn: Connection, engine: &EngineHandle) {
    let Ok(request) = conn.read_request() else {
        return;
    };
    tracing::debug!(
        op = request.name(),
        uid = conn.peer().uid,
        "request received"
    );
    let caller = Caller {
        role: conn.role().as_str(),
        uid: conn.peer().uid,
    };
    if let Err(msg) = permitted(conn.role(), &request) {
        let _ = conn.send(&Reply::Failed {
            code: "ERR_CONTROL_PERMISSION_DENIED".into(),
            message: msg,
        });
        return;
    }
    let reply = if let Request::Status = request {
        Reply::Done(Response::Status(engine.status()))
    } else {
        let sink = conn.progress_sink();
        let progress = Box::new(move |p: backstop_control::Progress| {
            sink.progress(&p.step, &p.message, p.bytes)
        });
        match engine.call(request, caller, progress) {
            Ok(r) => Reply::Done(r),
            Err((code, message)) => Reply::Failed { code, message },
        }
    };
    let _ = conn.send(&reply);
}

/// The host policy engine may trigger, inspect and revoke; only a person at the console clears
/// HALTED or grants a device.
fn permitted(role: backstop_control::Role, request: &Request) -> Result<(), String> {
    match (role, request) {
        (backstop_control::Role::Policy, Request::HaltClear { .. }) => {
            Err("only a person at the console can clear HALTED".into())
        }
        (backstop_control::Role::Policy, Request::DeviceGrant { .. }) => {
            Err("only a person at the console can grant devices".into())
        }
        _ => Ok(()),
    }
}

/// One daemon per state directory: two would fight over the same VM and layers.
fn lock_state_dir(dir: &std::path::Path) -> Result<std::fs::File, String> {
    let path = dir.join("backstopd.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("ERR_IO: {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is shared with the kernel.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(format!(
            "ERR_ALREADY_RUNNING: another backstopd holds {}",
            path.display()
        ));
    }
    Ok(f)
}
