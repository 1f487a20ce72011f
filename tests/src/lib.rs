//! Harness for backstop's end-to-end tests: starts the real `backstopd` on a private state
//! directory with a real QEMU guest (the test guest from scripts/build-guest.sh), drives it with
//! the real `backstop` console, and reads the guest's own serial output.
//!
//! Where QEMU or the test guest is missing, tests skip loudly; with `BACKSTOP_REQUIRE_E2E=1`
//! (set by CI) a missing prerequisite fails instead, so CI can never pass by skipping.
#![allow(clippy::unwrap_used)]

pub mod review;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The line backstopd writes into a QEMU VM's console log when a restored state has loaded:
/// what follows it is the restored guest's output (`backstop-qemu`'s serial log).
pub const RESTORED_MARK: &str = "[backstop] restored state loaded";

/// Directory of the test guest.
pub fn guest_dir() -> PathBuf {
    match std::env::var("BACKSTOP_GUEST_DIR") {
        Ok(d) if !d.is_empty() => d.into(),
        _ => PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
            .join(".cache/backstop/guest"),
    }
}

/// The QEMU the end-to-end tests run: `BACKSTOP_QEMU` (e.g. the QEMU 10 wrapper that
/// scripts/setup.sh prints), else `qemu-system-x86_64` on PATH. Written into each test's config
/// as `vm.qemu_binary`.
pub fn qemu_binary() -> String {
    match std::env::var("BACKSTOP_QEMU") {
        Ok(q) if !q.is_empty() => q,
        _ => "qemu-system-x86_64".into(),
    }
}

/// `(major, minor)` of the QEMU the tests run (`qemu_binary`), from its `--version`.
pub fn qemu_version() -> (u64, u64) {
    let out = Command::new(qemu_binary())
        .arg("--version")
        .output()
        .expect("run qemu --version");
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap_or_else(|| panic!("no version in {text:?}"));
    let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// The workspace's built binaries (`cargo build --workspace` runs before the tests).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).unwrap();
    dir.join(name)
}

/// Returns why the end-to-end tests cannot run here, if they cannot.
pub fn missing_prerequisite() -> Option<String> {
    let g = guest_dir();
    for f in ["vmlinuz", "initrd.img", "disk-base.qcow2"] {
        if !g.join(f).exists() {
            return Some(format!(
                "test guest file {} missing (run scripts/setup.sh)",
                g.join(f).display()
            ));
        }
    }
    for tool in [qemu_binary().as_str(), "qemu-img"] {
        let ok = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            return Some(format!("{tool} not installed (run scripts/setup.sh)"));
        }
    }
    for b in ["backstopd", "backstop"] {
        if !bin(b).exists() {
            return Some(format!(
                "{} not built (cargo build --workspace)",
                bin(b).display()
            ));
        }
    }
    None
}

/// Skips the calling test (returns true) when prerequisites are missing, loudly; panics instead
/// under `BACKSTOP_REQUIRE_E2E=1`.
pub fn skip_unless_ready(test: &str) -> bool {
    match missing_prerequisite() {
        None => false,
        Some(why) if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") => {
            panic!("{test}: BACKSTOP_REQUIRE_E2E=1 but {why}")
        }
        Some(why) => {
            eprintln!("SKIPPED {test}: {why}");
            true
        }
    }
}

/// A test that needs more than [`skip_unless_ready`] checks (OVMF, the Debian image, a network
/// namespace) and lacks it: skipped loudly, or a failure where CI requires every e2e test to
/// run (`BACKSTOP_REQUIRE_E2E=1`: scripts/setup.sh provides all of it).
pub fn skip_for(test: &str, why: &str) {
    if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") {
        panic!("{test}: BACKSTOP_REQUIRE_E2E=1 but {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
}

/// One tick line of the guest workload: `BACKSTOP tick ram=<n> disk=<d>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    pub ram: u64,
    pub disk: u64,
    /// What the guest found on the excluded disk before this tick overwrote it.
    pub scratch: Option<u64>,
}

/// Complete lines only: the guest may be mid-line (`ram=12 disk=1` of `disk=12`).
pub fn parse_ticks(text: &str) -> Vec<Tick> {
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("BACKSTOP tick ram=")?;
            let (ram, rest) = rest.split_once(" disk=")?;
            let mut words = rest.split_whitespace();
            let disk = words.next()?;
            let scratch = words
                .next()
                .and_then(|w| w.strip_prefix("scratch="))
                .and_then(|v| v.parse().ok());
            Some(Tick {
                ram: ram.parse().ok()?,
                disk: disk.parse().ok()?,
                scratch,
            })
        })
        .collect()
}

/// Test config knobs.
#[derive(Default, Clone, Copy)]
pub struct Options<'a> {
    /// Appended to the `[daemon]` table.
    pub extra_daemon: &'a str,
    /// Appended to the guest kernel cmdline (test switches of scripts/guest/init).
    pub guest_flags: &'a str,
    /// Extra TOML tables at the end (e.g. `[watchdog]`).
    pub extra_toml: &'a str,
    /// Extra keys of the `[vm]` table (e.g. `heartbeat = "qemu-ga"`).
    pub extra_vm: &'a str,
    /// Run backstopd in this network namespace (made by the test).
    pub netns: Option<&'a str>,
    /// Environment for the daemon process.
    pub env: &'a [(&'a str, &'a str)],
}

/// A running backstopd on its own state directory.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub run_dir: PathBuf,
    pub config_path: PathBuf,
    child: Option<Child>,
    pub extra_env: Vec<(String, String)>,
    /// Run backstopd (and so its QEMU) inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
}

impl Daemon {
    /// Writes a config for this test and starts the daemon; waits until it serves `status`.
    pub fn start(name: &str) -> Daemon {
        Self::start_with(name, "", &[])
    }

    /// `extra_daemon` is appended to the `[daemon]` table; `env` goes to the daemon process.
    pub fn start_with(name: &str, extra_daemon: &str, env: &[(&str, &str)]) -> Daemon {
        Self::start_opts(
            name,
            &Options {
                extra_daemon,
                env,
                ..Options::default()
            },
        )
    }

    /// Full control over the test config.
    pub fn start_opts(name: &str, o: &Options) -> Daemon {
        let (extra_daemon, env) = (o.extra_daemon, o.env);
        let dir = tempfile::Builder::new()
            .prefix(&format!("bs-{name}-"))
            .tempdir()
            .unwrap();
        // Unix socket paths are limited to 108 bytes: keep the run dir short.
        let run_dir = PathBuf::from(format!("/tmp/bsr-{}-{}", std::process::id(), short(name)));
        let _ = std::fs::remove_dir_all(&run_dir);
        let g = guest_dir();
        let state = dir.path().join("state");
        let config = format!(
            r#"[daemon]
state_dir = "{state}"
run_dir = "{run}"
{extra_daemon}

[vm]
name = "e2e"
qemu_binary = "{qemu}"
accel = "auto"
memory_mib = 256
kernel = "{g}/vmlinuz"
initrd = "{g}/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check {guest_flags}"
nics = ["net0"]
watchdog_device = true
{extra_vm}

[[vm.disks]]
id = "data"
path = "{g}/disk-base.qcow2"
snapshot = "capture"

[[vm.disks]]
id = "scratch"
path = "{state}/scratch.qcow2"
snapshot = "exclude"
create_size_mib = 16

{extra_toml}
"#,
            guest_flags = o.guest_flags,
            extra_toml = o.extra_toml,
            extra_vm = o.extra_vm,
            state = state.display(),
            run = run_dir.display(),
            g = g.display(),
            qemu = qemu_binary(),
        );
        let config_path = dir.path().join("backstop.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut d = Daemon {
            dir,
            run_dir,
            config_path,
            child: None,
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            netns: o.netns.map(str::to_string),
        };
        d.launch();
        d
    }

    /// A daemon on a config of the test's own making, not launched yet (`launch` starts it).
    /// `config` gets the state and run directories and returns the whole TOML file.
    pub fn prepare_custom(
        name: &str,
        config: &dyn Fn(&Path, &Path) -> String,
        env: &[(&str, &str)],
    ) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix(&format!("bs-{name}-"))
            .tempdir()
            .unwrap();
        let run_dir = PathBuf::from(format!("/tmp/bsr-{}-{}", std::process::id(), short(name)));
        let _ = std::fs::remove_dir_all(&run_dir);
        let config_path = dir.path().join("backstop.toml");
        std::fs::write(&config_path, config(&dir.path().join("state"), &run_dir)).unwrap();
        Daemon {
            dir,
            run_dir,
            config_path,
            child: None,
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            netns: None,
        }
    }

    /// A daemon guarding several VMs: a daemon file with `vms_dir`, and one `NAME.toml` per
    /// VM (the same small test guest each). `extra_daemon` goes into `[daemon]`; `bad_files`
    /// are written into `vms.d/` as they are (file name, content).
    pub fn start_many(
        name: &str,
        vms: &[&str],
        extra_daemon: &str,
        bad_files: &[(&str, &str)],
        env: &[(&str, &str)],
    ) -> Daemon {
        let mut d = Self::prepare_many(name, vms, extra_daemon, bad_files, env);
        d.launch();
        d
    }

    /// [`Daemon::start_many`] without starting the daemon (to prepare its state first).
    pub fn prepare_many(
        name: &str,
        vms: &[&str],
        extra_daemon: &str,
        bad_files: &[(&str, &str)],
        env: &[(&str, &str)],
    ) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix(&format!("bs-{name}-"))
            .tempdir()
            .unwrap();
        let run_dir = PathBuf::from(format!("/tmp/bsr-{}-{}", std::process::id(), short(name)));
        let _ = std::fs::remove_dir_all(&run_dir);
        let g = guest_dir();
        let state = dir.path().join("state");
        let vms_dir = dir.path().join("vms.d");
        std::fs::create_dir_all(&vms_dir).unwrap();
        for vm in vms {
            let file = format!(
                r#"[vm]
name = "{vm}"
qemu_binary = "{qemu}"
accel = "auto"
memory_mib = 192
kernel = "{g}/vmlinuz"
initrd = "{g}/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check"
watchdog_device = true

[[vm.disks]]
id = "data"
path = "{g}/disk-base.qcow2"
snapshot = "capture"
"#,
                qemu = qemu_binary(),
                g = g.display(),
            );
            std::fs::write(vms_dir.join(format!("{vm}.toml")), file).unwrap();
        }
        for (file, content) in bad_files {
            std::fs::write(vms_dir.join(file), content).unwrap();
        }
        let config = format!(
            "[daemon]\nstate_dir = \"{}\"\nrun_dir = \"{}\"\nvms_dir = \"{}\"\n{extra_daemon}\n",
            state.display(),
            run_dir.display(),
            vms_dir.display()
        );
        let config_path = dir.path().join("backstop.toml");
        std::fs::write(&config_path, config).unwrap();
        Daemon {
            dir,
            run_dir,
            config_path,
            child: None,
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            netns: None,
        }
    }

    /// A VM's own state directory in a many-VM daemon.
    pub fn vm_state_dir(&self, vm: &str) -> PathBuf {
        self.state_dir().join("vms").join(vm)
    }

    /// A VM's serial output (many-VM daemon).
    pub fn vm_serial(&self, vm: &str) -> String {
        std::fs::read(self.vm_state_dir(vm).join(format!("{vm}-serial.log")))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// A VM's journal entries (many-VM daemon), oldest first.
    pub fn vm_journal(&self, vm: &str) -> Vec<Value> {
        read_journal(&self.vm_state_dir(vm).join("audit/journal.jsonl"))
    }

    /// The daemon's own journal (daemon events, refused VM files), oldest first.
    pub fn daemon_journal(&self) -> Vec<Value> {
        read_journal(&self.state_dir().join("daemon/journal.jsonl"))
    }

    /// The console for one VM (`--vm NAME`), JSON output.
    pub fn cli_vm(&self, vm: &str, args: &[&str]) -> Output {
        let mut all = vec!["--vm", vm];
        all.extend_from_slice(args);
        self.cli(&all)
    }

    /// [`Daemon::cli_vm`] that must succeed; its JSON answer.
    pub fn ok_vm(&self, vm: &str, args: &[&str]) -> Value {
        let out = self.cli_vm(vm, args);
        assert!(
            out.status.success(),
            "backstop --vm {vm} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
    pub fn socket(&self) -> PathBuf {
        self.run_dir.join("control.sock")
    }
    pub fn serial_path(&self) -> PathBuf {
        self.state_dir().join("e2e-serial.log")
    }
    pub fn journal_path(&self) -> PathBuf {
        self.state_dir().join("audit/journal.jsonl")
    }
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("backstopd.log")
    }

    /// backstopd, inside the test's network namespace if it has one.
    fn daemon_command(&self) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin("backstopd"));
                c
            }
            None => Command::new(bin("backstopd")),
        }
    }

    /// (Re)starts the daemon process and waits for its socket to answer `status`.
    pub fn launch(&mut self) {
        self.spawn();
        self.wait_up();
    }

    /// Starts backstopd without waiting for it to serve (to crash it while it starts).
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let mut cmd = self.daemon_command();
        cmd.arg("--config")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        cmd.env("BACKSTOP_LOG", daemon_log_filter());
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().unwrap());
    }

    /// Waits until the spawned backstopd serves `status`.
    pub fn wait_up(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("backstopd exited early ({st}); log:\n{}", self.log());
                }
            }
            if self.socket().exists() {
                let out = self.cli(&["status"]);
                // Up: it answers, even if only to refuse this uid.
                let stdout = String::from_utf8_lossy(&out.stdout);
                // (A daemon of several VMs answers a status without --vm by naming them.)
                if out.status.success()
                    || stdout.contains("ERR_CONTROL_PERMISSION_DENIED")
                    || stdout.contains("ERR_VM_NOT_NAMED")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "backstopd did not come up; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts the daemon and waits until its control socket answers at all, even with an
    /// error: for a VM the daemon must refuse to start while it serves the others.
    pub fn launch_answering(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let mut cmd = self.daemon_command();
        cmd.arg("--config")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        cmd.env("BACKSTOP_LOG", daemon_log_filter());
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.socket().exists() || self.cli(&["status"]).stdout.is_empty() {
            assert!(
                Instant::now() < deadline,
                "backstopd did not answer; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (clean stop).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            // A clean stop takes a final snapshot of each guest first: give it the time the
            // systemd unit does (TimeoutStopSec) before ending it like a crash.
            let deadline = Instant::now() + Duration::from_secs(90);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Journal entries (parsed), oldest first.
    pub fn journal(&self) -> Vec<Value> {
        std::fs::read_to_string(self.journal_path())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits until the journal has an entry for which `pred` holds; returns it.
    pub fn wait_journal(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.journal().into_iter().find(|e| pred(e)) {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not journaled within {timeout:?}; journal tail:\n{}\ndaemon log:\n{}",
                tail(
                    &std::fs::read_to_string(self.journal_path()).unwrap_or_default(),
                    8
                ),
                tail(&self.log(), 20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Runs the console with `--json` against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin("backstop"))
            .arg("--socket")
            .arg(self.socket())
            .arg("--json")
            .args(args)
            .output()
            .unwrap()
    }

    /// Runs the console and requires success; returns its JSON output.
    pub fn ok(&self, args: &[&str]) -> Value {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "backstop {args:?} failed ({}): {}{}\ndaemon log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            tail(&self.log(), 30)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("bad JSON from backstop {args:?}: {e}"))
    }

    pub fn status(&self) -> Value {
        self.ok(&["status"])
    }

    pub fn serial(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(self.serial_path()) {
            let mut b = Vec::new();
            let _ = f.read_to_end(&mut b);
            s = String::from_utf8_lossy(&b).into_owned();
        }
        s
    }

    pub fn serial_len(&self) -> usize {
        std::fs::metadata(self.serial_path())
            .map(|m| m.len() as usize)
            .unwrap_or(0)
    }

    /// Serial output from byte `from` on.
    pub fn serial_since(&self, from: usize) -> String {
        let s = self.serial();
        s.get(from.min(s.len())..).unwrap_or("").to_string()
    }

    /// Waits until a tick with `ram >= min` appears after byte `from`; returns all ticks since `from`.
    pub fn wait_tick(&self, from: usize, min: u64, timeout: Duration) -> Vec<Tick> {
        let deadline = Instant::now() + timeout;
        loop {
            let ticks = parse_ticks(&self.serial_since(from));
            if ticks.iter().any(|t| t.ram >= min) {
                return ticks;
            }
            assert!(
                Instant::now() < deadline,
                "no tick with ram >= {min} within {timeout:?}; serial tail:\n{}\ndaemon log:\n{}",
                tail(&self.serial(), 15),
                tail(&self.log(), 30)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until `pred` holds for the ticks after byte `from`.
    pub fn wait_ticks_until(
        &self,
        from: usize,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&[Tick]) -> bool,
    ) -> Vec<Tick> {
        let deadline = Instant::now() + timeout;
        loop {
            let ticks = parse_ticks(&self.serial_since(from));
            if pred(&ticks) {
                return ticks;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not seen within {timeout:?}; serial since byte {from}:\n{}\ndaemon log:\n{}",
                tail(&self.serial_since(from), 40),
                tail(&self.log(), 20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the guest prints `line` after byte `from` of its serial output; returns the
    /// byte where it starts.
    pub fn wait_serial(&self, from: usize, line: &str, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            if let Some(at) = self.serial_since(from).find(line) {
                return from + at;
            }
            if Instant::now() >= deadline {
                // The tail below may be one line a guest workload repeats: with repeats
                // collapsed, what came before it (the boot's messages) shows too.
                eprintln!(
                    "console, repeated lines collapsed:\n{}",
                    tail(&collapse_repeats(&self.serial()), 60)
                );
            }
            assert!(
                Instant::now() < deadline,
                "guest never printed {line:?} within {within:?}:\n{}\ndaemon log:\n{}",
                tail(&self.serial(), 25),
                tail(&self.log(), 20)
            );
            std::thread::sleep(Duration::from_millis(150));
        }
    }

    /// Waits until `status` satisfies `pred`; returns it.
    pub fn wait_status(
        &self,
        what: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let st = self.status();
            if pred(&st) {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}: {st}\ndaemon log:\n{}",
                tail(&self.log(), 20)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The newest tick seen so far.
    pub fn last_tick(&self) -> Option<Tick> {
        parse_ticks(&self.serial()).last().copied()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.run_dir);
        // BACKSTOP_E2E_KEEP=1 keeps the state directory (store, journal, serial log) to look at.
        if std::env::var_os("BACKSTOP_E2E_KEEP").is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("kept {}", self.dir.path().display());
        }
    }
}

fn short(name: &str) -> String {
    name.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(12)
        .collect()
}

/// Journal entries of the journal file at `path` (parsed), oldest first.
pub fn read_journal(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `s` with each run of identical lines written once, followed by how many there were.
pub fn collapse_repeats(s: &str) -> String {
    let written = |(line, n): (&str, usize)| match n {
        1 => line.to_string(),
        n => format!("{line}  (x{n})"),
    };
    let mut out = Vec::new();
    let mut run: Option<(&str, usize)> = None;
    for line in s.lines() {
        match &mut run {
            Some((prev, n)) if *prev == line => *n += 1,
            _ => out.extend(run.replace((line, 1)).map(written)),
        }
    }
    out.extend(run.map(written));
    out.join("\n")
}

#[test]
fn repeated_console_lines_are_written_once_with_their_count() {
    assert_eq!(
        collapse_repeats("boot\nabsent\nabsent\nabsent\nup\nabsent"),
        "boot\nabsent  (x3)\nup\nabsent"
    );
    assert_eq!(collapse_repeats(""), "");
}

/// The daemons' log filter: `info`, or `BACKSTOP_E2E_LOG` for one run's diagnosis
/// (`BACKSTOP_E2E_LOG=info,backstop_qemu=debug`).
pub fn daemon_log_filter() -> String {
    std::env::var("BACKSTOP_E2E_LOG").unwrap_or_else(|_| "info".into())
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Reads sector 0 of a disk image chain through `qemu-img` (sharing locks with a running QEMU)
/// and parses the decimal number the guest wrote there.
pub fn disk_sector0(image: &Path) -> u64 {
    let out_dir = tempfile::tempdir().unwrap();
    let raw = out_dir.path().join("d.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(image)
        .arg(&raw)
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img convert {} failed", image.display());
    let mut f = std::fs::File::open(&raw).unwrap();
    let mut sector = [0u8; 512];
    f.read_exact(&mut sector).unwrap();
    let text = String::from_utf8_lossy(&sector);
    text.trim_matches(|c: char| !c.is_ascii_digit())
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or("")
        .parse()
        .unwrap_or(0)
}

/// The disk layer a snapshot made immutable: the top of its first disk chain, from its manifest.
pub fn top_disk_layer(manifest: &Value) -> PathBuf {
    manifest["payload_refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["kind"] == "disk-layer-chain")
        .and_then(|p| p["layers"].as_array().unwrap().last().cloned())
        .unwrap()["path"]
        .as_str()
        .unwrap()
        .into()
}

/// Flips one byte of `path` at `offset` (from the end when negative); returns a restorer.
pub fn flip_byte(path: &Path, offset: i64) -> impl FnOnce() {
    use std::os::unix::fs::PermissionsExt;
    let orig_mode = std::fs::metadata(path).unwrap().permissions().mode();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    let i = if offset < 0 {
        bytes.len() - (-offset) as usize
    } else {
        offset as usize
    };
    let original = bytes.clone();
    bytes[i] ^= 0x5a;
    std::fs::write(path, &bytes).unwrap();
    let p = path.to_path_buf();
    move || {
        std::fs::write(&p, &original).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(orig_mode)).unwrap();
    }
}

/// Runs the console as another uid (fork + setuid), returning its exit code and stderr.
pub fn cli_as_uid(socket: &Path, uid: u32, args: &[&str]) -> (i32, String) {
    let out = Command::new(bin("backstop"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the console as `uid` with primary group `gid`: (exit code, stdout).
pub fn cli_as(socket: &Path, uid: u32, gid: u32, args: &[&str]) -> (i32, String) {
    let out = Command::new(bin("backstop"))
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .args(args)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Runs the console as `uid`, primary group `gid` and supplementary `groups`: (exit code,
/// stdout). The identity is set in the child by hand (std's `uid` clears supplementary groups).
pub fn cli_as_groups(
    socket: &Path,
    uid: u32,
    gid: u32,
    groups: &[u32],
    args: &[&str],
) -> (i32, String) {
    let groups: Vec<libc::gid_t> = groups.to_vec();
    let mut cmd = Command::new(bin("backstop"));
    cmd.arg("--socket").arg(socket).arg("--json").args(args);
    // SAFETY: setgroups/setgid/setuid are async-signal-safe; `groups` is owned by the closure.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

use std::os::unix::process::CommandExt;

/// Skips `test` loudly when the host gives no transparent huge pages (nothing to collapse).
pub fn skip_unless_huge_pages(test: &str) -> bool {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[always]") || thp.contains("[madvise]") {
        return false;
    }
    skip_for(
        test,
        &format!("transparent huge pages are off on this host ({thp:?})"),
    );
    true
}

/// The guest RAM mapping of a QEMU process (huge pages): its largest private anonymous writable
/// mapping (`-m` RAM is one). Returns (size, resident, resident in huge pages) in bytes.
pub fn qemu_guest_ram(pid: u64) -> (u64, u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut best = (0, 0, 0);
    let mut cur: Option<(u64, u64, u64)> = None;
    let finish = |c: Option<(u64, u64, u64)>, best: &mut (u64, u64, u64)| {
        if let Some(c) = c {
            if c.0 > best.0 {
                *best = c;
            }
        }
    };
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let header = fields.len() >= 5
            && fields[0].contains('-')
            && fields[3].contains(':')
            && fields[1].len() == 4;
        if header {
            finish(cur.take(), &mut best);
            let anon_private_rw = fields.len() == 5 && fields[1] == "rw-p";
            if anon_private_rw {
                let (a, b) = fields[0].split_once('-').unwrap();
                let size =
                    u64::from_str_radix(b, 16).unwrap() - u64::from_str_radix(a, 16).unwrap();
                cur = Some((size, 0, 0));
            }
            continue;
        }
        let Some(c) = cur.as_mut() else { continue };
        let kib = || {
            fields
                .get(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        match fields.first() {
            Some(&"Rss:") => c.1 = kib(),
            Some(&"AnonHugePages:") => c.2 = kib(),
            _ => {}
        }
    }
    finish(cur.take(), &mut best);
    best
}

/// Waits up to `within` until at least half of a QEMU's resident guest RAM is mapped in huge
/// pages (what backstop restores after each background snapshot); returns (resident bytes,
/// huge-mapped bytes, how long it took) at the end, whether or not it got there.
pub fn wait_guest_ram_huge(pid: u64, within: Duration) -> (u64, u64, Duration) {
    let t0 = Instant::now();
    loop {
        let (_, rss, huge) = qemu_guest_ram(pid);
        if (huge * 2 >= rss && rss > 0) || t0.elapsed() > within {
            return (rss, huge, t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_lines_parse_with_and_without_scratch() {
        let t = parse_ticks("junk\nBACKSTOP tick ram=3 disk=3\nBACKSTOP tick ram=4 disk=4 scratch=9\nBACKSTOP tick ram=x disk=1\n");
        assert_eq!(
            t,
            vec![
                Tick {
                    ram: 3,
                    disk: 3,
                    scratch: None
                },
                Tick {
                    ram: 4,
                    disk: 4,
                    scratch: Some(9)
                }
            ]
        );
        // A line still being printed is not a tick yet.
        assert_eq!(parse_ticks("BACKSTOP tick ram=12 disk=1").len(), 0);
        assert_eq!(
            parse_ticks("BACKSTOP tick ram=5 disk=5\r\nBACKSTOP tick ram=6 disk=").len(),
            1
        );
    }
}
