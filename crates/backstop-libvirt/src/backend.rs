//! [`LibvirtBackend`]: the [`VmBackend`] of a domain libvirt runs (see the crate doc).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use backstop_common::ErrorCode;
use backstop_hypervisor::{
    Adoption, BackendError, BootMode, CaptureReport, CaptureStream, DiskAttachment, DiskSwitch,
    DiskSwitchTiming, EventWaker, GrantOutcome, GrantSpec, HeartbeatSource, HeartbeatStatus,
    Release, RestoreReport, Result, RevocationReport, RunState, VmBackend, VmEvent,
};
use backstop_qmp::version::{self, QemuVersion, Resume};
use backstop_qmp::{AgentChannel, Prefetch};
use serde_json::{json, Value};
use tracing::{info, warn};
use virt::connect::Connect;
use virt::domain::{
    Domain, DomainPausedReason, DomainShutoffReason, DomainState, DomainStateReason,
};
use virt::enumutil::Enum;
use virt::sys;

use crate::domain_xml::{self, DomainShape};
use crate::events::Feed;
use crate::precopy::{self, CopyPlan, Hold, Switchover};
use crate::save_image::{self, RestoreImageWriter};
use crate::{CaptureMode, LibvirtConfig};

mod devices;
mod guard;
mod supervision;

/// How long a state poll that finds the domain ended waits for libvirt's event saying why
/// (it is usually on its way): only when events are registered, and only once per ending.
const EVENT_GRACE: Duration = Duration::from_millis(100);

/// The downtime limit (ms) a pre-copy capture asks QEMU for: the pause it aims at.
const PRECOPY_DOWNTIME_MS: u64 = 20;

/// A capture in flight.
struct Capture {
    pause_us: u64,
    breakdown: Vec<(String, u64)>,
    bytes: Arc<AtomicU64>,
    /// `precopy`: the thread that switches the disks at QEMU's switchover.
    switchover: Option<Switchover>,
}

/// How a restore image's writing ended (set when the sink is dropped).
type RestoreDone = Arc<Mutex<Option<std::result::Result<String, String>>>>;

pub struct LibvirtBackend {
    cfg: LibvirtConfig,
    conn: Option<Connect>,
    dom: Option<Domain>,
    shape: Option<DomainShape>,
    /// Each captured disk's writable top layer now (target dev → file).
    actives: Vec<(String, PathBuf)>,
    /// The disks a restore puts the domain on (from `launch(Incoming)`).
    incoming: Vec<(String, PathBuf)>,
    pid: Option<u32>,
    qemu_version: (u32, u32, u32),
    /// Who ends the pause of a background snapshot on this QEMU (see `backstop_qmp::version`).
    resume: Resume,
    /// Where this domain's heartbeats come from (decided at adoption from the VM file and the
    /// domain's channels).
    heartbeat: HeartbeatSource,
    /// The heartbeat of the VM instance running now: backstop's agent channel, or qemu-ga
    /// pinged through libvirt.
    agent: Option<Heartbeat>,
    capture: Option<Capture>,
    /// Collapsing the guest RAM's huge pages again after a background snapshot split them
    /// (`backstop_qmp::huge_pages`); stopped before the next capture and before a pause.
    regather: Option<backstop_qmp::huge_pages::Regather>,
    /// `Some`: captures run as a pre-copy (`capture = "precopy"`, or `auto` without
    /// userfaultfd), live or with the guest paused by this QEMU's dirty tracking; `None`: as
    /// background snapshots.
    precopy: Option<CopyPlan>,
    /// Whether the last pre-copy capture switched the disks (see `capture_switched_disks`).
    last_switched: bool,
    /// The domain's `downtime-limit` while a pre-copy capture lowers it.
    saved_downtime_limit: Option<u64>,
    restore: Option<RestoreDone>,
    /// backstop ended the domain itself (a rollback): its shutoff is not an event.
    ended_by_us: bool,
    /// Connections opened again after libvirtd went away.
    reconnects: u32,
    /// libvirtd unreachable, and since when.
    down: Option<Outage>,
    /// What the journal must say (`take_notices`).
    notices: Vec<(backstop_common::AuditEvent, serde_json::Map<String, Value>)>,
    watchdog_reported: bool,
    exit_reported: bool,
    /// Why the domain is paused by someone else, as of the last `poll_events`.
    paused_outside: Option<String>,
    /// `pause()` (a rollback's start, a clean stop) suspended the domain: that pause is
    /// backstop's until the domain is seen running again.
    paused_by_us: bool,
    /// libvirt's domain events (`events.rs`): they wake the actor; the state poll decides.
    events: Feed,
    /// Granted devices: config id → the alias libvirt knows them by (`backend/devices.rs`).
    /// The host-wide claim on the domain's UUID, held while it is guarded (`guard.rs`).
    claim: Option<backstop_hypervisor::claim::Claim>,
    /// The domain's `<metadata>` names this daemon as its guardian.
    marked: bool,
    /// The adopted domain's UUID and name, kept for the HALTED record whatever else is torn
    /// down.
    halted_uuid: Option<String>,
    halted_name: Option<String>,
    grants: BTreeMap<String, String>,
    /// Aliases whose `DEVICE_REMOVED` arrived while nobody waited for it.
    removed: BTreeSet<String>,
}

/// A connection to `cfg.uri` and the domain the VM file names (by UUID, else by name), or why
/// not: `ERR_LIBVIRT_CONNECT` or `ERR_LIBVIRT_DOMAIN_NOT_FOUND` and one line. Adoption and
/// `vm check` look it up the same way.
pub(crate) fn open_domain(
    cfg: &LibvirtConfig,
) -> std::result::Result<(Connect, Domain), (ErrorCode, String)> {
    let uri = &cfg.uri;
    let conn = Connect::open(Some(uri)).map_err(|e| {
        (
            ErrorCode::LibvirtConnect,
            format!("cannot connect to libvirt at {uri}: {}", e.message()),
        )
    })?;
    let (what, found) = match (&cfg.uuid, &cfg.domain) {
        (Some(u), _) => (format!("uuid {u}"), conn.lookup_domain_by_uuid_string(u)),
        (None, Some(n)) => (format!("name {n}"), conn.lookup_domain_by_name(n)),
        (None, None) => {
            return Err((
                ErrorCode::LibvirtDomainNotFound,
                "no domain or uuid configured".into(),
            ))
        }
    };
    let dom = found.map_err(|e| {
        (
            ErrorCode::LibvirtDomainNotFound,
            format!(
                "libvirt at {uri} has no domain with {what}: {}",
                e.message()
            ),
        )
    })?;
    Ok((conn, dom))
}

/// How often a libvirtd that stays unreachable is logged again.
const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(60);

/// libvirtd unreachable since `at` (`since`, as a time for people); last logged `logged`.
struct Outage {
    at: Instant,
    since: String,
    logged: Instant,
}

fn refused(code: ErrorCode, message: String) -> BackendError {
    BackendError::Refused { code, message }
}

/// One QMP command to `dom` through libvirt's monitor passthrough; returns `return`.
pub(crate) fn qmp_on(
    dom: &Domain,
    step: &'static str,
    execute: &str,
    args: Option<Value>,
) -> Result<Value> {
    let mut cmd = json!({ "execute": execute });
    if let Some(a) = args {
        cmd["arguments"] = a;
    }
    let reply = dom
        .qemu_monitor_command(&cmd.to_string(), 0)
        .map_err(|e| cmd_err(step, e))?;
    qmp_return(step, &reply)
}

pub(crate) fn cmd_err(step: &'static str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Command {
        step,
        message: e.to_string(),
    }
}

/// libvirt's `major * 1_000_000 + minor * 1000 + release` as text.
pub fn version_text(v: u32) -> String {
    format!("{}.{}.{}", v / 1_000_000, (v / 1000) % 1000, v % 1000)
}

impl LibvirtBackend {
    pub fn new(cfg: LibvirtConfig) -> Self {
        static QUIET: Once = Once::new();
        // libvirt prints every error to stderr by default; ours are returned instead.
        QUIET.call_once(virt::error::clear_error_callback);
        // Before any connection is opened: libvirt's event loop, for the domain events.
        crate::events::ensure_event_loop();
        LibvirtBackend {
            cfg,
            conn: None,
            dom: None,
            shape: None,
            actives: Vec::new(),
            incoming: Vec::new(),
            pid: None,
            qemu_version: (0, 0, 0),
            resume: Resume::ByQemu,
            heartbeat: HeartbeatSource::BackstopAgent,
            agent: None,
            capture: None,
            regather: None,
            precopy: None,
            last_switched: false,
            saved_downtime_limit: None,
            restore: None,
            ended_by_us: false,
            reconnects: 0,
            watchdog_reported: false,
            exit_reported: false,
            paused_outside: None,
            paused_by_us: false,
            events: Feed::new(),
            grants: BTreeMap::new(),
            removed: BTreeSet::new(),
            claim: None,
            marked: false,
            halted_uuid: None,
            halted_name: None,
            down: None,
            notices: Vec::new(),
        }
    }

    fn dom(&self, step: &'static str) -> Result<&Domain> {
        self.dom.as_ref().ok_or(BackendError::NotRunning { step })
    }

    /// One QMP command through libvirt's monitor passthrough; returns `return`.
    fn qmp(&self, step: &'static str, execute: &str, args: Option<Value>) -> Result<Value> {
        qmp_on(self.dom(step)?, step, execute, args)
    }

    /// `getfd` through libvirt with `fd` passed along (virDomainQemuMonitorCommandWithFiles,
    /// libvirt ≥ 8.2; the safe layer of `virt` 0.5 has no binding for it).
    fn getfd(&self, name: &str, fd: &OwnedFd) -> Result<()> {
        let step = "getfd";
        let dom = self.dom(step)?;
        let cmd =
            CString::new(json!({"execute": "getfd", "arguments": {"fdname": name}}).to_string())
                .map_err(|e| cmd_err(step, e))?;
        let mut fds = [fd.as_raw_fd()];
        let mut nout: libc::c_uint = 0;
        let mut outfiles: *mut libc::c_int = std::ptr::null_mut();
        let mut result: *mut libc::c_char = std::ptr::null_mut();
        // SAFETY: `dom` owns a reference to a live virDomainPtr for the whole call; `cmd` is a
        // NUL-terminated string alive across the call; `fds` is one open descriptor that libvirt
        // only sends (it does not close or keep ours); `nout`, `outfiles` and `result` are valid
        // out-pointers that libvirt fills (outfiles/result with malloc'd memory, freed below).
        let rc = unsafe {
            sys::virDomainQemuMonitorCommandWithFiles(
                dom.as_ptr(),
                cmd.as_ptr(),
                1,
                fds.as_mut_ptr(),
                &mut nout,
                &mut outfiles,
                &mut result,
                0,
            )
        };
        if !outfiles.is_null() {
            for i in 0..nout as usize {
                // SAFETY: libvirt returned `nout` descriptors in the malloc'd array `outfiles`;
                // they are ours to close, and `i < nout` stays inside it.
                unsafe { libc::close(*outfiles.add(i)) };
            }
            // SAFETY: `outfiles` was malloc'd by libvirt and is not used after this.
            unsafe { libc::free(outfiles.cast()) };
        }
        if rc < 0 {
            return Err(cmd_err(step, virt::error::Error::last_error()));
        }
        let reply = if result.is_null() {
            String::new()
        } else {
            // SAFETY: on success libvirt stored a NUL-terminated, malloc'd string in `result`;
            // it is copied before being freed once, and not used after.
            unsafe {
                let s = CStr::from_ptr(result).to_string_lossy().into_owned();
                libc::free(result.cast());
                s
            }
        };
        qmp_return(step, &reply).map(|_| ())
    }

    fn set_background_snapshot(&self, on: bool) -> Result<()> {
        self.qmp(
            "migrate-set-capabilities",
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "background-snapshot", "state": on}]})),
        )
        .map(|_| ())
    }

    /// Stops a huge-page pass still running (at most one `process_madvise` call).
    fn stop_regather(&mut self) {
        backstop_qmp::huge_pages::Regather::stop_in(&mut self.regather);
    }

    fn read_pid(&self) -> Option<u32> {
        let name = self.shape.as_ref()?.name.clone();
        std::fs::read_to_string(format!("/run/libvirt/qemu/{name}.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn state(&self) -> Result<(DomainState, Option<DomainPausedReason>)> {
        self.state_with_reasons()
            .map(|(st, paused, _)| (st, paused))
    }

    /// The domain's state with why it is paused or shut off.
    fn state_with_reasons(
        &self,
    ) -> Result<(
        DomainState,
        Option<DomainPausedReason>,
        Option<DomainShutoffReason>,
    )> {
        let (st, reason) = self
            .dom("domain state")?
            .state()
            .map_err(|e| cmd_err("domain state", e))?;
        let st = match st {
            Enum::Known(s) => s,
            Enum::Unknown(_) => DomainState::NoState,
        };
        let (paused, shutoff) = match reason {
            Enum::Known(DomainStateReason::Paused(Enum::Known(r))) => (Some(r), None),
            Enum::Known(DomainStateReason::Shutoff(Enum::Known(r))) => (None, Some(r)),
            _ => (None, None),
        };
        Ok((st, paused, shutoff))
    }

    /// libvirtd restarted (an upgrade, `systemctl restart libvirtd`) or stopped: the connection
    /// died with it while the domain ran on. Opens a new one and finds the same domain by UUID;
    /// nothing else changes (no rollback: the guest never stopped). Tried at every tick until
    /// it works; the loss is logged once and then at most every [`OUTAGE_LOG_EVERY`], and both
    /// the loss and the return are journaled (`take_notices`).
    fn reconnect_if_lost(&mut self) {
        let Some(conn) = &self.conn else { return };
        if conn.is_alive().unwrap_or(false) {
            return;
        }
        let Some(uuid) = self.shape.as_ref().map(|s| s.uuid.clone()) else {
            return;
        };
        let uri = self.cfg.uri.clone();
        match Connect::open(Some(&uri)).and_then(|c| {
            let d = c.lookup_domain_by_uuid_string(&uuid)?;
            Ok((c, d))
        }) {
            Ok((c, d)) => {
                self.events.register(&c, &d);
                self.conn = Some(c);
                self.dom = Some(d);
                self.reconnects += 1;
                let was = self.down.take();
                let down_ms = was
                    .as_ref()
                    .map_or(0, |o| o.at.elapsed().as_millis() as u64);
                info!(%uri, %uuid, down_ms, "libvirt connection opened again");
                let mut f = serde_json::Map::new();
                f.insert("down_since".into(), json!(was.map(|o| o.since)));
                f.insert("down_ms".into(), json!(down_ms));
                self.notices
                    .push((backstop_common::AuditEvent::VmHypervisorReconnected, f));
            }
            Err(e) => {
                let error = e.message().to_string();
                match &mut self.down {
                    None => {
                        warn!(%uri, error = %error, "libvirt connection lost (libvirtd stopped?); reconnecting at every tick, logged again at most once a minute");
                        let since = backstop_common::time::now_rfc3339();
                        let mut f = serde_json::Map::new();
                        f.insert("since".into(), json!(since));
                        f.insert("error".into(), json!(error));
                        self.notices
                            .push((backstop_common::AuditEvent::VmHypervisorDisconnected, f));
                        self.down = Some(Outage {
                            at: Instant::now(),
                            since,
                            logged: Instant::now(),
                        });
                    }
                    Some(o) if o.logged.elapsed() >= OUTAGE_LOG_EVERY => {
                        warn!(%uri, error = %error, since = %o.since, "libvirt still unreachable");
                        o.logged = Instant::now();
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// Refuses `step` while libvirtd is unreachable, in one line with its own code, before
    /// anything is tried (a call would fail half-way with libvirt's raw socket error).
    fn refuse_while_down(&mut self, step: &str) -> Result<()> {
        self.reconnect_if_lost();
        match &self.down {
            Some(o) => Err(refused(
                ErrorCode::LibvirtConnect,
                format!(
                    "{step}: libvirtd is unreachable at {} (disconnected since {}); nothing was changed",
                    self.cfg.uri, o.since
                ),
            )),
            None => Ok(()),
        }
    }

    /// Checks that the live domain is what adoption needs and returns its shape.
    fn adopt_checked(&mut self) -> Result<Adoption> {
        let (conn, dom) = open_domain(&self.cfg).map_err(|(code, m)| refused(code, m))?;
        let xml = dom.xml_desc(0).map_err(|e| cmd_err("domain xml", e))?;
        let shape = domain_xml::inspect(&xml)
            .map_err(|u| refused(ErrorCode::LibvirtDomainUnsuitable, u.0))?;
        self.heartbeat = shape
            .heartbeat(self.cfg.heartbeat)
            .map_err(|u| refused(ErrorCode::LibvirtDomainUnsuitable, u.0))?;
        if let (Some(n), Some(_)) = (&self.cfg.domain, &self.cfg.uuid) {
            if *n != shape.name {
                return Err(refused(
                    ErrorCode::LibvirtDomainNotFound,
                    format!(
                        "domain {} has uuid {} but the config names {n}",
                        shape.name, shape.uuid
                    ),
                ));
            }
        }
        // Before anything touches the domain: one guardian per domain, host-wide.
        let me = self.cfg.guardian.clone();
        let (claim, taken_over) =
            guard::claim_domain(&dom, &self.cfg.claims_dir, &shape.name, &shape.uuid, &me)?;
        self.claim = Some(claim);
        self.halted_uuid = Some(shape.uuid.clone());
        self.halted_name = Some(shape.name.clone());
        self.conn = Some(conn);
        self.dom = Some(dom);
        self.shape = Some(shape.clone());
        let (st, _) = self.state()?;
        if st != DomainState::Running {
            return Err(refused(
                ErrorCode::LibvirtDomainUnsuitable,
                format!(
                    "domain {} is {st:?}, not running; start it (virsh start {}) before adoption",
                    shape.name, shape.name
                ),
            ));
        }
        let caps = self.qmp("query caps", "query-migrate-capabilities", None)?;
        let on = caps
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["capability"] == "background-snapshot" && c["state"] == true);
        if on {
            return Err(refused(
                ErrorCode::LibvirtDomainUnsuitable,
                format!("domain {}: the migration capability background-snapshot is on (another tool is capturing it?)", shape.name),
            ));
        }
        // Probe: QEMU refuses the capability when it cannot get a userfaultfd.
        let (precopy, reason) = match self.cfg.capture {
            CaptureMode::Precopy => (true, "configured: capture = \"precopy\"".to_string()),
            mode => match self.set_background_snapshot(true) {
                Ok(()) => {
                    self.set_background_snapshot(false)?;
                    (false, "QEMU accepted the background-snapshot capability (userfaultfd available)".to_string())
                }
                Err(e) if mode == CaptureMode::Auto => (
                    true,
                    format!("capture = \"auto\" and QEMU cannot take background snapshots ({e})"),
                ),
                Err(e) => {
                    return Err(refused(
                        ErrorCode::LibvirtNoUserfaultfd,
                        format!(
                            "domain {}: QEMU cannot take background snapshots ({e}); libvirt's QEMU runs unprivileged: enable `sysctl vm.unprivileged_userfaultfd=1`, or set capture = \"precopy\" in [vm.libvirt] (see README)",
                            shape.name
                        ),
                    ))
                }
            },
        };
        let v = self.qmp("query-version", "query-version", None)?;
        let qv = QemuVersion::from_query(&v)
            .ok_or_else(|| cmd_err("query-version", format!("unreadable QEMU version in {v}")))?;
        self.qemu_version = (qv.major as u32, qv.minor as u32, qv.micro as u32);
        self.precopy = if precopy {
            let kvm = self.qmp("query-kvm", "query-kvm", None)?;
            Some(CopyPlan::for_qemu(
                kvm["enabled"] == true,
                qv.major as u32,
                qv.minor as u32,
            ))
        } else {
            None
        };
        // The same versions and capture rule as the QEMU backend: 7.2/8.x resume the guest
        // themselves after a background snapshot's start, ≥ 9.0 keep it paused.
        let names: Vec<&str> = caps
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["capability"].as_str())
            .collect();
        let plan = version::capture_plan(qv, &names).map_err(|e| {
            refused(
                ErrorCode::LibvirtDomainUnsuitable,
                format!("domain {}: {e}", shape.name),
            )
        })?;
        self.resume = plan.resume;
        let conn = self
            .conn
            .as_ref()
            .ok_or(BackendError::NotRunning { step: "adopt" })?;
        let libvirt_version = conn.lib_version().map(version_text).unwrap_or_default();
        self.pid = self.read_pid();
        self.actives = shape
            .disks
            .iter()
            .map(|d| (d.target.clone(), d.source.clone()))
            .collect();
        self.agent = self.connect_heartbeat(&shape, false);
        guard::mark(self.dom("adopt")?, &me)?;
        self.marked = true;
        let mut details = serde_json::Map::new();
        if let Some(g) = &taken_over {
            details.insert("claim_taken_over".into(), json!(g));
        }
        details.insert(
            "claim".into(),
            json!(self.claim.as_ref().map(|c| c.path().display().to_string())),
        );
        for (k, v) in [
            ("uri", json!(self.cfg.uri)),
            ("domain", json!(shape.name)),
            ("uuid", json!(shape.uuid)),
            ("pid", json!(self.pid)),
            ("libvirt_version", json!(libvirt_version)),
            (
                "qemu_version",
                json!(format!(
                    "{}.{}.{}",
                    self.qemu_version.0, self.qemu_version.1, self.qemu_version.2
                )),
            ),
            (
                "capture_mode",
                json!(if precopy { "precopy" } else { "bg" }),
            ),
            ("capture_mode_reason", json!(reason)),
            (
                "disks",
                json!(self
                    .actives
                    .iter()
                    .map(|(t, p)| json!({"id": t, "active": p}))
                    .collect::<Vec<_>>()),
            ),
        ] {
            details.insert(k.into(), v);
        }
        if let Some(plan) = &self.precopy {
            details.insert("precopy_live".into(), json!(plan.is_live()));
            if let CopyPlan::GuestPaused(why) = plan {
                warn!(domain = %shape.name, "{why}");
                details.insert("precopy_paused_why".into(), json!(why));
            }
        }
        info!(domain = %shape.name, uuid = %shape.uuid, pid = ?self.pid, libvirt = %libvirt_version, "libvirt domain adopted");
        Ok(Adoption {
            disks: self
                .actives
                .iter()
                .map(|(id, active)| DiskAttachment {
                    id: id.clone(),
                    active: active.clone(),
                    captured: true,
                })
                .collect(),
            details,
        })
    }

    /// After a pre-copy capture: its capabilities off and the domain's downtime limit back.
    fn end_precopy(&mut self) {
        let caps = json!({"capabilities": [
            {"capability": "pause-before-switchover", "state": false},
            {"capability": "auto-converge", "state": false},
        ]});
        if let Err(e) = self.qmp(
            "migrate-set-capabilities",
            "migrate-set-capabilities",
            Some(caps),
        ) {
            warn!(error = %e, "could not switch the pre-copy capabilities off");
        }
        if let Some(ms) = self.saved_downtime_limit.take() {
            let _ = self.qmp(
                "migrate-set-parameters",
                "migrate-set-parameters",
                Some(json!({"downtime-limit": ms})),
            );
        }
    }

    /// `capture = "precopy"`: the migration starts live (no suspend; on a QEMU whose dirty
    /// tracking loses pages, [`CopyPlan::GuestPaused`], with the guest paused first); the
    /// switchover thread takes the disk-only snapshot `snap` when QEMU has stopped the guest
    /// for the last pages.
    fn begin_precopy(
        &mut self,
        snap: String,
        frozen: Vec<(String, PathBuf)>,
        xml: &str,
    ) -> Result<CaptureStream> {
        let step = "pre-copy capture";
        self.last_switched = false;
        // QEMU stops the guest once the rest would go out within the downtime limit (300 ms by
        // default: 119 ms of device-state pause measured on the test guest); a capture asks
        // for PRECOPY_DOWNTIME_MS and puts the domain's own value back afterwards.
        let params = self.qmp("query params", "query-migrate-parameters", None)?;
        self.saved_downtime_limit = params["downtime-limit"].as_u64();
        let caps = json!({"capabilities": [
            {"capability": "pause-before-switchover", "state": true},
            {"capability": "auto-converge", "state": true},
        ]});
        self.qmp(
            "migrate-set-capabilities",
            "migrate-set-capabilities",
            Some(caps),
        )?;
        let dom = self.dom(step)?.clone();
        let live = self.precopy.as_ref().is_none_or(CopyPlan::is_live);
        // A guest its operator paused stays paused; one this QEMU cannot track while it runs
        // is paused for the copy (from just before `migrate`).
        let mut hold = if self.state()?.0 == DomainState::Running {
            Hold::Live
        } else {
            Hold::Operator
        };
        let started = (|| -> Result<(OwnedFd, Switchover)> {
            self.qmp(
                "migrate-set-parameters",
                "migrate-set-parameters",
                Some(json!({
                    "max-bandwidth": self.cfg.max_bandwidth,
                    "downtime-limit": PRECOPY_DOWNTIME_MS,
                })),
            )?;
            let (rd, wr) = nix::unistd::pipe().map_err(|e| cmd_err("pipe", e))?;
            self.getfd("backstop-capture", &wr)?;
            drop(wr);
            if !live && hold == Hold::Live {
                let t = Instant::now();
                dom.suspend()
                    .map_err(|e| cmd_err("suspend for the copy", e))?;
                hold = Hold::PausedForCopy(t);
            }
            self.qmp(
                "migrate",
                "migrate",
                Some(json!({"uri": "fd:backstop-capture"})),
            )?;
            let sw = Switchover::watch(dom.clone(), snap, hold).map_err(|e| {
                let _ = self.qmp("migrate_cancel", "migrate_cancel", None);
                cmd_err("switchover thread", e)
            })?;
            Ok((rd, sw))
        })();
        let (rd, switchover) = match started {
            Ok(s) => s,
            Err(e) => {
                let _ = self.qmp(
                    "closefd",
                    "closefd",
                    Some(json!({"fdname": "backstop-capture"})),
                );
                self.end_precopy();
                if hold != Hold::Live {
                    if let Err(r) = precopy::restore(&dom, hold) {
                        warn!(error = %r, ?hold, "could not put the guest's run state back");
                    }
                }
                return Err(e);
            }
        };
        info!(live, ?hold, "libvirt pre-copy capture started");
        let bytes = Arc::new(AtomicU64::new(0));
        self.capture = Some(Capture {
            pause_us: 0,
            breakdown: Vec::new(),
            bytes: Arc::clone(&bytes),
            switchover: Some(switchover),
        });
        Ok(CaptureStream {
            reader: capture_reader(xml, Vec::new(), File::from(rd), bytes),
            frozen_layers: frozen,
            cutter: None,
            disk_switch: DiskSwitchTiming::AtFinish,
        })
    }

    /// Waits until the guest runs again after `migrate`, by this QEMU's rule (see
    /// `backstop_qmp::version`). QEMU 7.2/8.x resume it by themselves once the device state is
    /// saved: this returns when libvirt reports it running, and `None`. QEMU ≥ 9.0 keep it
    /// paused: it is resumed here through libvirt as soon as `query-migrate` shows write
    /// tracking on, and not earlier (the `MIGRATION` `active` comes before QEMU's thread
    /// stops the guest and starts tracking: a resume there would let the guest write between
    /// the disk switch and the RAM instant). Returns when tracking was seen on.
    ///
    /// A guest its operator paused (`was_running` false) stays paused: 7.2/8.x resume it all
    /// the same, and it is suspended again at once (the moment it ran is logged); ≥ 9.0 is not
    /// resumed once tracking is on.
    fn wait_resumed_after_migrate(&self, was_running: bool) -> Result<Option<Instant>> {
        let bound = Duration::from_secs(30);
        let deadline = Instant::now() + bound;
        loop {
            match self.resume {
                Resume::ByQemu => {
                    if self.state()?.0 == DomainState::Running {
                        if !was_running {
                            let t = Instant::now();
                            self.dom("pause again")?
                                .suspend()
                                .map_err(|e| cmd_err("pause again", e))?;
                            warn!(
                                ran_us = t.elapsed().as_micros() as u64,
                                qemu = ?self.qemu_version,
                                "this QEMU resumed the guest its operator had paused during the capture; paused it again"
                            );
                        }
                        return Ok(None);
                    }
                }
                Resume::AfterWriteTracking => {
                    let m = self.qmp("query-migrate", "query-migrate", None)?;
                    if version::write_tracking_on(&m) {
                        let tracking = Instant::now();
                        if was_running {
                            self.dom("resume")?
                                .resume()
                                .map_err(|e| cmd_err("resume", e))?;
                        }
                        return Ok(Some(tracking));
                    }
                    let status = m["status"].as_str().unwrap_or("");
                    if !matches!(status, "setup" | "active") {
                        return Err(cmd_err(
                            "background snapshot",
                            format!(
                                "migration {status} before write tracking was on: {}",
                                m["error-desc"].as_str().unwrap_or("")
                            ),
                        ));
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(BackendError::Timeout {
                    step: "resume after capture start",
                    timeout: bound,
                });
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// Whether QEMU still holds a migration's `migration` yank instance, which it drops in the
    /// migration's cleanup, a bottom half that runs some time after `completed`.
    fn migration_yank_held(&self) -> Result<bool> {
        let list = self.qmp("query-yank", "query-yank", None)?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .any(|i| i["type"] == "migration"))
    }

    /// Waits (up to `bound`) until the previous migration is cleaned up on QEMU's side, so the
    /// next `migrate` does not fail with `duplicate yank instance`.
    fn wait_migration_released(&self, bound: Duration) -> Result<()> {
        let deadline = Instant::now() + bound;
        while self.migration_yank_held()? {
            if Instant::now() >= deadline {
                return Err(BackendError::Timeout {
                    step: "previous migration's cleanup (yank instance)",
                    timeout: bound,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// A background snapshot whose start failed after `migrate`: QEMU finishes it into the
    /// void (the stream read to its end and dropped, as the QEMU backend's `drain_to_end` does:
    /// a cancel could leave a vCPU blocked on a write-protected page), the capability goes off,
    /// and a guest QEMU left paused (≥ 9.0) runs again on its new overlays, unless its operator
    /// had paused it (`was_running` false): that one is paused again if QEMU resumed it.
    fn drain_and_resume(&self, mut pipe: File, was_running: bool) {
        let drainer = std::thread::spawn(move || std::io::copy(&mut pipe, &mut std::io::sink()));
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let status = self
                .qmp("query-migrate", "query-migrate", None)
                .map(|m| m["status"].as_str().unwrap_or("").to_string());
            match status.as_deref() {
                Ok("completed" | "failed" | "cancelled") | Err(_) => break,
                _ if Instant::now() > deadline => {
                    let _ = self.qmp("migrate_cancel", "migrate_cancel", None);
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let drained = drainer.join().ok().and_then(|r| r.ok()).unwrap_or(0);
        let _ = self.wait_migration_released(Duration::from_secs(30));
        let _ = self.set_background_snapshot(false);
        if let Ok(dom) = self.dom("resume") {
            let hold = if was_running {
                Hold::Live
            } else {
                Hold::Operator
            };
            if let Err(e) = precopy::restore(dom, hold) {
                warn!(error = %e, ?hold, "could not put the guest's run state back after a failed capture start");
            }
        }
        warn!(
            drained,
            "capture start failed after migrate: stream drained to its end"
        );
    }
}

fn qmp_return(step: &'static str, reply: &str) -> Result<Value> {
    let v: Value = serde_json::from_str(reply).map_err(|e| BackendError::Protocol {
        step,
        detail: format!("{e}: {reply}"),
    })?;
    if let Some(err) = v.get("error") {
        return Err(cmd_err(step, err["desc"].as_str().unwrap_or("QMP error")));
    }
    Ok(v.get("return").cloned().unwrap_or(Value::Null))
}

/// The store's view of a capture: libvirt's save-image prefix (the domain XML), then QEMU's
/// stream (what was read from the pipe already, then the pipe), counted.
fn capture_reader(
    xml: &str,
    early: Vec<u8>,
    pipe: File,
    bytes: Arc<AtomicU64>,
) -> Box<dyn Read + Send> {
    let prefix = std::io::Cursor::new(save_image::capture_prefix(xml));
    Box::new(CountingReader {
        inner: prefix.chain(std::io::Cursor::new(early)).chain(pipe),
        bytes,
    })
}

/// Counts what the store reads from the capture pipe.
struct CountingReader<R> {
    inner: R,
    bytes: Arc<AtomicU64>,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The restore sink handed to the engine: records how the image's writing ended on drop.
struct RestoreSink {
    writer: Option<RestoreImageWriter<BufWriter<File>>>,
    done: RestoreDone,
    failed: Option<String>,
}

impl Write for RestoreSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| std::io::Error::other("restore sink closed"))?;
        w.write(buf)
            .inspect_err(|e| self.failed = Some(e.to_string()))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self.writer.as_mut() {
            Some(w) => w.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for RestoreSink {
    fn drop(&mut self) {
        let outcome = match (self.writer.take(), self.failed.take()) {
            (_, Some(e)) => Err(e),
            (None, None) => Err("restore sink closed twice".into()),
            (Some(mut w), None) => match (w.flush(), w.written_xml.take()) {
                (Err(e), _) => Err(e.to_string()),
                (Ok(()), None) => Err("the state stream ended before its domain XML".into()),
                (Ok(()), Some(xml)) => Ok(xml),
            },
        };
        if let Ok(mut d) = self.done.lock() {
            *d = Some(outcome);
        }
    }
}

impl VmBackend for LibvirtBackend {
    fn kind(&self) -> &'static str {
        "libvirt"
    }

    fn accel(&self) -> &str {
        // `type='qemu'` domains run TCG, `type='kvm'` KVM; the domain chooses, not backstop.
        "libvirt"
    }

    fn config_fingerprint(&self) -> String {
        self.shape
            .as_ref()
            .map(DomainShape::fingerprint)
            .unwrap_or_default()
    }

    fn pid(&self) -> Option<u32> {
        self.pid
    }

    fn adopt(&mut self) -> Result<Option<Adoption>> {
        match self.adopt_checked() {
            Ok(a) => {
                if let (Some(c), Some(d)) = (&self.conn, &self.dom) {
                    self.events.register(c, d);
                }
                if self.cfg.huge_pages.effective(false) != self.cfg.huge_pages {
                    tracing::warn!(
                        "vm.huge_pages = \"all\" applies to the QEMU backend on QEMU 9.0 or later \
                         only (a libvirt domain is suspended before its capture starts, so QEMU's \
                         pre-fault of guest RAM is inside the pause): \"resident\" is used"
                    );
                }
                Ok(Some(a))
            }
            Err(e) => {
                // Nothing was changed: drop what was opened, the claim and its mark included.
                if self.marked {
                    if let Some(d) = &self.dom {
                        guard::unmark(d);
                    }
                    self.marked = false;
                }
                self.claim = None;
                self.events.unregister();
                self.agent = None;
                self.dom = None;
                self.conn = None;
                self.shape = None;
                Err(e)
            }
        }
    }

    /// Each disk's top layer as the domain's live XML has it now (libvirt tracks every switch
    /// of its disks, a `virsh snapshot-create-as --disk-only` or a block job included).
    fn block_graph(&mut self) -> Result<Option<Vec<backstop_hypervisor::ActiveLayer>>> {
        let xml = self
            .dom("block graph")?
            .xml_desc(0)
            .map_err(|e| cmd_err("domain xml", e))?;
        let disks = domain_xml::live_disks(&xml).map_err(|e| cmd_err("domain xml", e))?;
        Ok(Some(
            disks
                .into_iter()
                .map(|(target, source)| backstop_hypervisor::ActiveLayer {
                    disk: target,
                    active: source,
                })
                .collect(),
        ))
    }

    fn hold_halted(&mut self, why: Option<&str>) -> Result<()> {
        let Some(uuid) = self.halted_uuid.clone() else {
            return Ok(());
        };
        let path = self.cfg.halted_dir.join(&uuid);
        let io = |e: std::io::Error| cmd_err("record HALTED for the libvirt hook", e.to_string());
        match why {
            Some(why) => {
                std::fs::create_dir_all(&self.cfg.halted_dir).map_err(io)?;
                let g = &self.cfg.guardian;
                let line = format!(
                    "vm '{}' of backstopd (state dir {}) since {}: {}; a person clears it with `backstop --vm {} halt clear --reason ...`\n",
                    g.vm,
                    g.state_dir,
                    backstop_common::time::now_rfc3339(),
                    why.replace('\n', " "),
                    g.vm
                );
                backstop_common::durable::write_atomic(&path, line.as_bytes()).map_err(io)
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e)),
                _ => Ok(()),
            },
        }
    }

    fn take_notices(
        &mut self,
    ) -> Vec<(backstop_common::AuditEvent, serde_json::Map<String, Value>)> {
        std::mem::take(&mut self.notices)
    }

    fn started_outside(&mut self) -> Option<String> {
        let (st, _) = self.state().ok()?;
        matches!(st, DomainState::Running | DomainState::Paused).then(|| {
            format!(
                "domain {} runs (QEMU pid {}), started outside backstop while HALTED",
                self.halted_name.as_deref().unwrap_or("?"),
                self.read_pid().map_or("?".to_string(), |p| p.to_string())
            )
        })
    }

    fn release(&mut self) {
        if self.marked {
            if let Some(d) = &self.dom {
                guard::unmark(d);
            }
            self.marked = false;
        }
        if let Some(c) = self.claim.take() {
            c.release();
        }
    }

    fn launch(&mut self, disks: &[DiskAttachment], mode: BootMode) -> Result<()> {
        match mode {
            BootMode::Cold => {
                let (st, _) = self.state()?;
                if st == DomainState::Shutoff || st == DomainState::Crashed {
                    return Err(BackendError::Launch(
                        "the adopted domain is not running (libvirt backend boots nothing itself)"
                            .into(),
                    ));
                }
                Ok(())
            }
            BootMode::Incoming => {
                self.incoming = disks
                    .iter()
                    .filter(|d| d.captured)
                    .map(|d| (d.id.clone(), d.active.clone()))
                    .collect();
                Ok(())
            }
        }
    }

    fn run_state(&mut self) -> Result<RunState> {
        if self.dom.is_none() {
            return Ok(RunState::NotStarted);
        }
        if self.restore.is_some() {
            return Ok(RunState::Incoming);
        }
        Ok(match self.state()?.0 {
            DomainState::Running | DomainState::Blocked => RunState::Running,
            DomainState::Paused | DomainState::PMSuspended => RunState::Paused,
            DomainState::Shutoff | DomainState::Crashed | DomainState::Shutdown => RunState::Exited,
            DomainState::NoState => RunState::NotStarted,
        })
    }

    fn poll_events(&mut self) -> Result<Vec<VmEvent>> {
        let mut events = Vec::new();
        // What libvirt's events said since the last look (they woke the actor for this).
        let mut heard = self.drain_events();
        if self.dom.is_none() || self.ended_by_us || self.restore.is_some() {
            return Ok(events);
        }
        // Level-triggered: the state is read every tick, so a missed event cannot hide one.
        self.reconnect_if_lost();
        // A watchdog whose action leaves the domain running (reset, none) shows in no state:
        // its event is the only report.
        if let Some(action) = Self::watchdog_heard(&heard).filter(|_| !self.watchdog_reported) {
            self.watchdog_reported = true;
            events.push(VmEvent::WatchdogExpired { action });
        }
        if self.down.is_some() {
            // Nothing can be read until libvirtd is back (said once, in reconnect_if_lost).
            return Ok(events);
        }
        let (st, paused, shutoff) = match self.state_with_reasons() {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "libvirt domain state unreadable");
                return Ok(events);
            }
        };
        // Paused with virDomainSuspend by someone else (`virsh suspend`): reason `user`.
        // backstop's own suspends are a capture's (begun and ended inside one of its calls, so
        // a look between them never sees one) and `pause()`'s (remembered).
        if st == DomainState::Running {
            self.paused_by_us = false;
        }
        self.paused_outside = (st == DomainState::Paused
            && paused == Some(DomainPausedReason::User)
            && !self.paused_by_us)
        .then(|| "paused outside backstop (libvirt: paused, reason user; `virsh resume` continues it)".to_string());
        // The state decides; libvirt's event about the ending, when it agrees, names it.
        let said = if self.exit_reported {
            None
        } else {
            self.ending_heard(st, &mut heard)
        };
        let outside = st == DomainState::Shutoff
            && matches!(
                shutoff,
                Some(DomainShutoffReason::Destroyed | DomainShutoffReason::Shutdown)
            );
        if let Some((_, text)) = said.filter(|(o, _)| *o == outside) {
            self.exit_reported = true;
            events.push(if outside {
                VmEvent::EndedOutside {
                    detail: format!("{text}, not by backstop"),
                }
            } else {
                VmEvent::Exited {
                    detail: format!("{text}, not ended by backstop"),
                }
            });
        }
        match st {
            DomainState::Paused
                if paused == Some(DomainPausedReason::Watchdog) && !self.watchdog_reported =>
            {
                self.watchdog_reported = true;
                events.push(VmEvent::WatchdogExpired {
                    action: "pause".into(),
                });
            }
            DomainState::Shutoff
                if !self.exit_reported
                    && matches!(
                        shutoff,
                        Some(DomainShutoffReason::Destroyed | DomainShutoffReason::Shutdown)
                    ) =>
            {
                self.exit_reported = true;
                events.push(VmEvent::EndedOutside {
                    detail: format!(
                        "libvirt reports the domain shut off ({:?}), not by backstop",
                        shutoff.unwrap_or(DomainShutoffReason::Unknown)
                    ),
                });
            }
            DomainState::Shutoff | DomainState::Crashed if !self.exit_reported => {
                self.exit_reported = true;
                events.push(VmEvent::Exited {
                    detail: format!(
                        "libvirt reports the domain {st:?} ({shutoff:?}), not ended by backstop"
                    ),
                });
            }
            _ => {}
        }
        Ok(events)
    }

    fn begin_capture(&mut self, switches: &[DiskSwitch]) -> Result<CaptureStream> {
        let step = "capture";
        self.stop_regather();
        self.refuse_while_down("capture")?;
        let xml = self
            .dom(step)?
            .xml_desc(sys::VIR_DOMAIN_XML_SECURE | sys::VIR_DOMAIN_XML_MIGRATABLE)
            .map_err(|e| cmd_err("capture xml", e))?;
        // The disk-only external snapshot: libvirt itself switches each captured disk onto the
        // overlay backstop created (REUSE_EXT), labels it, and updates its live and persistent
        // definitions; NO_METADATA keeps it out of libvirt's snapshot list.
        let mut snap = String::from("<domainsnapshot><memory snapshot='no'/><disks>");
        let mut frozen = Vec::new();
        for (id, active) in &self.actives {
            match switches.iter().find(|s| s.id == *id) {
                Some(s) => {
                    let file = s
                        .new_active
                        .to_str()
                        .filter(|p| !p.contains(['\'', '<', '&', '"']))
                        .ok_or_else(|| {
                            cmd_err(
                                step,
                                format!(
                                    "overlay path {} cannot go into XML",
                                    s.new_active.display()
                                ),
                            )
                        })?;
                    snap.push_str(&format!(
                        "<disk name='{id}' snapshot='external' type='file'><driver type='qcow2'/><source file='{file}'/></disk>"
                    ));
                    frozen.push((id.clone(), active.clone()));
                }
                None => snap.push_str(&format!("<disk name='{id}' snapshot='no'/>")),
            }
        }
        snap.push_str("</disks></domainsnapshot>");
        for s in switches {
            if !self.actives.iter().any(|(id, _)| *id == s.id) {
                return Err(cmd_err(
                    step,
                    format!("the domain has no captured disk {}", s.id),
                ));
            }
        }
        // QEMU cleans a finished migration up some time after it reports it `completed`; a
        // `migrate` before that fails with `duplicate yank instance` (QEMU ≥ 9.0).
        self.wait_migration_released(Duration::from_secs(30))?;
        if self.precopy.is_some() {
            return self.begin_precopy(snap, frozen, &xml);
        }
        // Outside the pause: capability, bandwidth, the pipe and its fd in QEMU.
        self.set_background_snapshot(true)?;
        let prepared = (|| -> Result<OwnedFd> {
            self.qmp(
                "migrate-set-parameters",
                "migrate-set-parameters",
                Some(json!({"max-bandwidth": self.cfg.max_bandwidth})),
            )?;
            let (rd, wr) = nix::unistd::pipe().map_err(|e| cmd_err("pipe", e))?;
            self.getfd("backstop-capture", &wr)?;
            drop(wr);
            Ok(rd)
        })();
        let rd = match prepared {
            Ok(rd) => rd,
            Err(e) => {
                let _ = self.set_background_snapshot(false);
                return Err(e);
            }
        };
        let undo = |me: &Self| {
            let _ = me.qmp(
                "closefd",
                "closefd",
                Some(json!({"fdname": "backstop-capture"})),
            );
            let _ = me.set_background_snapshot(false);
        };
        // A guest its operator paused is not suspended here, and is paused again after.
        let was_running = match self.state() {
            Ok((st, _)) => st == DomainState::Running,
            Err(e) => {
                undo(self);
                return Err(e);
            }
        };
        let t0 = Instant::now();
        if was_running {
            if let Err(e) = self.dom(step)?.suspend() {
                undo(self);
                return Err(cmd_err("suspend", e));
            }
        }
        let t_stop = t0.elapsed();
        let flags = sys::VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA
            | sys::VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC;
        if let Err(e) = self.dom(step)?.create_snapshot_xml(&snap, flags) {
            if was_running {
                let _ = self.dom(step)?.resume();
            }
            undo(self);
            return Err(cmd_err("disk-only snapshot", e.message()));
        }
        let t_switch = t0.elapsed();
        // From here the disks are switched: any failure is CaptureAfterSwitch.
        for s in switches {
            if let Some(a) = self.actives.iter_mut().find(|(id, _)| *id == s.id) {
                a.1 = s.new_active.clone();
            }
        }
        if let Err(e) = self.qmp(
            "migrate",
            "migrate",
            Some(json!({"uri": "fd:backstop-capture"})),
        ) {
            let _ = self.set_background_snapshot(false);
            if was_running {
                let _ = self.dom(step)?.resume();
            }
            return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
        }
        let t_migrate = t0.elapsed();
        // QEMU writes the stream from now on: it is read while the guest's pause ends, or a
        // full pipe stops QEMU's snapshot thread and with it the write faults a `cont` needs.
        let prefetch = Prefetch::start(File::from(rd));
        let resumed = self.wait_resumed_after_migrate(was_running);
        let (pipe, early) = prefetch.finish();
        let t_tracking = match resumed {
            Ok(t) => t.map(|t| t.duration_since(t0)),
            Err(e) => {
                self.drain_and_resume(pipe, was_running);
                return Err(BackendError::CaptureAfterSwitch(Box::new(e)));
            }
        };
        let pause = t0.elapsed();
        let us = |d: Duration| d.as_micros() as u64;
        let mut breakdown = vec![
            ("suspend".to_string(), us(t_stop)),
            ("switch".to_string(), us(t_switch - t_stop)),
            ("migrate".to_string(), us(t_migrate - t_switch)),
        ];
        match t_tracking {
            Some(t) => breakdown.extend([
                ("tracking".to_string(), us(t.saturating_sub(t_migrate))),
                ("resume".to_string(), us(pause.saturating_sub(t))),
            ]),
            None => breakdown.push(("resume".to_string(), us(pause - t_migrate))),
        }
        // A guest its operator paused was not paused by the capture.
        let pause_us = if was_running { us(pause) } else { 0 };
        if !was_running {
            breakdown.clear();
        }
        info!(pause_us, ?breakdown, was_running, qemu = ?self.qemu_version, "libvirt capture started");
        let bytes = Arc::new(AtomicU64::new(0));
        self.capture = Some(Capture {
            pause_us,
            breakdown,
            bytes: Arc::clone(&bytes),
            switchover: None,
        });
        Ok(CaptureStream {
            reader: capture_reader(&xml, early, pipe, bytes),
            frozen_layers: frozen,
            cutter: None,
            disk_switch: DiskSwitchTiming::AtStart,
        })
    }

    fn finish_capture(&mut self) -> Result<CaptureReport> {
        let cap = self
            .capture
            .take()
            .ok_or(cmd_err("finish capture", "no capture in flight"))?;
        if let Some(sw) = cap.switchover {
            let (outcome, switched) = sw.finish();
            self.last_switched = switched;
            self.end_precopy();
            if let Err(e) = self.wait_migration_released(Duration::from_secs(30)) {
                warn!(error = %e, "pre-copy capture: QEMU still cleaning the migration up");
            }
            let s = outcome?;
            return Ok(CaptureReport {
                pause_us: s.pause_us,
                downtime_ms: s.downtime_ms,
                state_bytes: cap.bytes.load(Ordering::Relaxed),
                pause_breakdown: s.breakdown,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        let m = loop {
            let m = self.qmp("query-migrate", "query-migrate", None)?;
            match m["status"].as_str().unwrap_or("") {
                "completed" => break m,
                "failed" | "cancelled" => {
                    let _ = self.set_background_snapshot(false);
                    return Err(cmd_err(
                        "background snapshot",
                        m["error-desc"].as_str().unwrap_or("migration failed"),
                    ));
                }
                _ if Instant::now() > deadline => {
                    return Err(BackendError::Timeout {
                        step: "background snapshot",
                        timeout: Duration::from_secs(600),
                    })
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        // The next capture must not race QEMU's cleanup of this one.
        self.wait_migration_released(Duration::from_secs(30))?;
        // Write tracking is off: the huge pages it split may be collapsed again.
        if let Some(pid) = self.pid {
            // The domain is suspended before `migrate`: QEMU's pre-fault is inside the pause, so
            // `all` falls back to `resident` (see `HugePages::effective`; warned at adoption).
            self.regather = Some(backstop_qmp::huge_pages::Regather::start(
                pid,
                self.cfg.huge_pages.effective(false),
            ));
        }
        self.set_background_snapshot(false)?;
        Ok(CaptureReport {
            pause_us: cap.pause_us,
            downtime_ms: m["downtime"].as_u64(),
            state_bytes: cap.bytes.load(Ordering::Relaxed),
            pause_breakdown: cap.breakdown,
        })
    }

    fn abort_capture(&mut self) {
        match self.capture.take() {
            Some(Capture {
                switchover: Some(sw),
                ..
            }) => {
                if let Ok(dom) = self.dom("abort capture") {
                    sw.abandon(dom);
                }
                let (outcome, switched) = sw.finish();
                if let Err(e) = outcome {
                    warn!(error = %e, switched, "abandoned pre-copy capture");
                }
                self.last_switched = switched;
                self.end_precopy();
            }
            Some(_) => {
                let _ = self.qmp("migrate_cancel", "migrate_cancel", None);
                let _ = self.set_background_snapshot(false);
            }
            None => {}
        }
    }

    fn capture_switched_disks(&self) -> bool {
        self.last_switched
    }

    /// Through libvirt, never behind its back: `virDomainBlockRebase(disk, base)` is a block
    /// pull (QEMU's `block-stream`) of every layer above `base` into the top; libvirt rewrites
    /// its view of the backing chain when the job completes. The `virt` 0.5 safe layer has no
    /// binding for it or for the job query, hence the raw calls.
    fn flatten_disk(&mut self, disk_id: &str, base: &Path, bound: Duration) -> Result<()> {
        let step = "flatten disk";
        self.refuse_while_down(step)?;
        let dom = self.dom(step)?;
        let disk = CString::new(disk_id).map_err(|e| cmd_err(step, e))?;
        let base_c = base
            .to_str()
            .and_then(|b| CString::new(b).ok())
            .ok_or_else(|| cmd_err(step, format!("base {} is not a C string", base.display())))?;
        // SAFETY: `dom` holds a reference to a live virDomainPtr for the whole call; `disk` and
        // `base_c` are NUL-terminated strings that outlive it; libvirt keeps neither pointer.
        let rc = unsafe {
            sys::virDomainBlockRebase(dom.as_ptr(), disk.as_ptr(), base_c.as_ptr(), 0, 0)
        };
        if rc < 0 {
            return Err(cmd_err("block pull", virt::error::Error::last_error()));
        }
        let deadline = Instant::now() + bound;
        loop {
            let mut info = sys::virDomainBlockJobInfo {
                type_: 0,
                bandwidth: 0,
                cur: 0,
                end: 0,
            };
            // SAFETY: as above; `info` is a valid, writable virDomainBlockJobInfo.
            let rc =
                unsafe { sys::virDomainGetBlockJobInfo(dom.as_ptr(), disk.as_ptr(), &mut info, 0) };
            match rc {
                0 => break,
                1 if Instant::now() > deadline => {
                    // SAFETY: as above. The chain stays as it was: QEMU changes the backing
                    // only when a stream completes.
                    unsafe { sys::virDomainBlockJobAbort(dom.as_ptr(), disk.as_ptr(), 0) };
                    return Err(BackendError::Timeout {
                        step: "block pull",
                        timeout: bound,
                    });
                }
                1 => std::thread::sleep(Duration::from_millis(20)),
                _ => return Err(cmd_err("block job info", virt::error::Error::last_error())),
            }
        }
        // libvirt's live view: the top's backing is now `base` itself.
        let xml = dom.xml_desc(0).map_err(|e| cmd_err("domain xml", e))?;
        let chain = domain_xml::backing_chain(&xml, disk_id);
        if chain.get(1).map(PathBuf::as_path) != Some(base) {
            return Err(cmd_err(
                step,
                format!(
                    "after the block pull libvirt names the chain {chain:?}, not the top over {}",
                    base.display()
                ),
            ));
        }
        info!(disk = disk_id, base = %base.display(), "libvirt block pull done");
        Ok(())
    }

    fn status_details(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        // The mode in effect: a domain is suspended before its capture, so never `all`.
        m.insert(
            "huge_pages".into(),
            json!(self.cfg.huge_pages.effective(false).as_str()),
        );
        if let Some(shape) = &self.shape {
            m.insert("domain".into(), json!(shape.name));
            m.insert(
                "capture_mode".into(),
                json!(if self.precopy.is_some() {
                    "precopy"
                } else {
                    "bg"
                }),
            );
            if let Some(plan) = &self.precopy {
                m.insert("precopy_live".into(), json!(plan.is_live()));
            }
            m.insert("libvirt_reconnects".into(), json!(self.reconnects));
            m.insert(
                "libvirt".into(),
                json!(self
                    .down
                    .as_ref()
                    .map_or("connected".to_string(), |o| format!(
                        "disconnected since {}",
                        o.since
                    ))),
            );
            m.insert("heartbeat_source".into(), json!(self.heartbeat.as_str()));
            m.insert("watchdog_device".into(), json!(shape.watchdog));
            if let Some(Heartbeat::Qga(q)) = &self.agent {
                let (set, skew) = q.clock();
                m.insert("clock_resynced".into(), json!(set));
                m.insert("clock_skew_ms".into(), json!(skew));
                if let Some(why) = q.down() {
                    m.insert("heartbeat_down".into(), json!(why));
                }
            }
            let (received, dropped) = self.events.counts();
            m.insert(
                "libvirt_events".into(),
                json!({"registered": self.events.registered(), "received": received, "dropped": dropped}),
            );
        }
        m
    }

    fn pause(&mut self) -> Result<()> {
        // A rollback starts here: its restore wants the CPUs.
        self.stop_regather();
        if self.state()?.0 == DomainState::Paused {
            return Ok(());
        }
        self.dom("pause")?
            .suspend()
            .map_err(|e| cmd_err("suspend", e))?;
        self.paused_by_us = true;
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        if self.state()?.0 == DomainState::Running {
            return Ok(());
        }
        self.dom("resume")?
            .resume()
            .map_err(|e| cmd_err("resume", e))?;
        Ok(())
    }

    fn revoke_devices(&mut self, bound: Duration) -> Result<RevocationReport> {
        // Every granted device and every <hostdev> detached, bounded by `bound` together
        // (`backend/devices.rs`); ending the domain (terminate) is the final revocation.
        let mut report = RevocationReport::default();
        self.revoke_all(bound, &mut report);
        if let Some(a) = self.agent.take() {
            a.close();
            report.revoked.push("guest agent channel closed".into());
        }
        Ok(report)
    }

    fn terminate(&mut self) -> Result<()> {
        self.agent = None;
        self.capture = None;
        let Some(dom) = self.dom.as_ref() else {
            return Ok(());
        };
        self.ended_by_us = true;
        if dom.is_active().unwrap_or(false) {
            dom.destroy().map_err(|e| cmd_err("destroy", e))?;
        }
        self.pid = None;
        Ok(())
    }

    fn begin_restore(&mut self) -> Result<Box<dyn Write + Send>> {
        if self.incoming.is_empty() {
            return Err(cmd_err("begin restore", "launch(Incoming) named no disks"));
        }
        let path = save_image::restore_image_path(&self.cfg.work_dir);
        let file = File::create(&path).map_err(|source| BackendError::Io {
            step: "create restore image",
            source,
        })?;
        let actives = self.incoming.clone();
        let rewrite = Box::new(move |xml: &str| domain_xml::rewrite_for_restore(xml, &actives));
        let done: RestoreDone = Arc::new(Mutex::new(None));
        self.restore = Some(Arc::clone(&done));
        Ok(Box::new(RestoreSink {
            writer: Some(RestoreImageWriter::new(
                BufWriter::with_capacity(1 << 20, file),
                rewrite,
            )),
            done,
            failed: None,
        }))
    }

    fn finish_restore(&mut self) -> Result<RestoreReport> {
        let done = self
            .restore
            .take()
            .ok_or(cmd_err("finish restore", "no restore in flight"))?;
        let path = save_image::restore_image_path(&self.cfg.work_dir);
        let outcome = done
            .lock()
            .map_err(|_| cmd_err("finish restore", "poisoned"))?
            .take()
            .unwrap_or_else(|| Err("the restore sink was not closed".into()));
        let xml = outcome.map_err(BackendError::RestoreCheck)?;
        let path_str = path
            .to_str()
            .ok_or(cmd_err("restore", "non-UTF-8 path"))?
            .to_string();
        let started = Instant::now();
        let conn = self
            .conn
            .as_ref()
            .ok_or(BackendError::NotRunning { step: "restore" })?;
        let restored = conn.restore_domain_flags(&path_str, None, sys::VIR_DOMAIN_SAVE_PAUSED);
        let _ = std::fs::remove_file(&path);
        restored.map_err(|e| cmd_err("virDomainRestoreFlags", e.message()))?;
        let load_ms = started.elapsed().as_millis() as u64;
        let lap = |what: &str| {
            tracing::debug!(ms = started.elapsed().as_millis() as u64, "restore: {what}")
        };
        let uuid = self
            .shape
            .as_ref()
            .map(|s| s.uuid.clone())
            .unwrap_or_default();
        let dom = conn
            .lookup_domain_by_uuid_string(&uuid)
            .map_err(|e| cmd_err("lookup restored domain", e))?;
        self.dom = Some(dom);
        lap("lookup");
        self.ended_by_us = false;
        self.watchdog_reported = false;
        self.exit_reported = false;
        // What the events said was about the instance that ended.
        self.events.clear();
        self.removed.clear();
        self.grants.clear();
        let (st, _) = self.state()?;
        if st != DomainState::Paused {
            return Err(BackendError::RestoreCheck(format!(
                "restored domain is {st:?}, not paused"
            )));
        }
        let live = self
            .dom("restore check")?
            .xml_desc(0)
            .map_err(|e| cmd_err("domain xml", e))?;
        self.check_nothing_granted(&live)?;
        let shape = domain_xml::inspect(&live).map_err(|u| BackendError::RestoreCheck(u.0))?;
        lap("live xml");
        for (id, want) in &self.incoming {
            let got = shape
                .disks
                .iter()
                .find(|d| d.target == *id)
                .map(|d| &d.source);
            if got != Some(want) {
                return Err(BackendError::RestoreCheck(format!(
                    "disk {id} is on {got:?}, not the fresh overlay {}",
                    want.display()
                )));
            }
        }
        if shape.uuid != uuid {
            return Err(BackendError::RestoreCheck(format!(
                "uuid {} is not {uuid}",
                shape.uuid
            )));
        }
        // spec/000 §8: network access does not survive a rollback. The restored domain is
        // still paused: each NIC's link goes down in the live definition only (the persistent
        // one is the operator's), before the guest runs one instruction.
        let nics = domain_xml::interfaces_link_down(&live).map_err(BackendError::RestoreCheck)?;
        for nic in &nics {
            self.dom("link down")?
                .update_device_flags(nic, sys::VIR_DOMAIN_AFFECT_LIVE)
                .map_err(|e| cmd_err("link down", e.message()))?;
        }
        let live = if nics.is_empty() {
            live
        } else {
            let live = self
                .dom("restore check")?
                .xml_desc(0)
                .map_err(|e| cmd_err("domain xml", e))?;
            if !domain_xml::all_links_down(&live) {
                return Err(BackendError::RestoreCheck(
                    "a NIC's link is still up after the link-down update".into(),
                ));
            }
            info!(
                nics = nics.len(),
                "restored domain: every NIC's link is down"
            );
            live
        };
        lap("links down");
        // A later cold start (virsh destroy; virsh start) must boot this same chain: the
        // operator's persistent definition, with only its disks moved (the captured XML is the
        // live one, which after a rollback has its links down: not for keeps).
        let persistent = self
            .dom("persistent xml")?
            .xml_desc(sys::VIR_DOMAIN_XML_INACTIVE | sys::VIR_DOMAIN_XML_SECURE)
            .map_err(|e| cmd_err("persistent xml", e))
            .and_then(|p| {
                domain_xml::rewrite_for_restore(&p, &self.incoming)
                    .map_err(|e| cmd_err("persistent xml", e))
            })
            .unwrap_or_else(|e| {
                warn!(error = %e, "persistent definition unreadable: defining the captured one");
                xml.clone()
            });
        conn.define_domain_xml(&persistent)
            .map_err(|e| cmd_err("define restored domain", e.message()))?;
        lap("define");
        self.actives = self.incoming.clone();
        self.pid = self.read_pid();
        self.agent = self.connect_heartbeat(&shape, true);
        lap("agent");
        let devices = domain_xml::device_list(&live);
        self.shape = Some(shape);
        Ok(RestoreReport { load_ms, devices })
    }

    fn notify_epoch(&mut self, epoch: u64) -> Result<()> {
        // Only backstop's agent hears of epochs; a guest with qemu-ga alone is not told.
        if let Some(Heartbeat::Agent(a)) = self.agent.as_mut() {
            a.send_epoch(epoch);
        }
        Ok(())
    }

    fn paused_outside(&self) -> Option<String> {
        self.paused_outside.clone()
    }

    fn heartbeats(&self) -> HeartbeatStatus {
        self.agent
            .as_ref()
            .map(Heartbeat::stats)
            .unwrap_or_default()
            .into()
    }

    fn grant_device(&mut self, spec: &GrantSpec) -> Result<GrantOutcome> {
        self.grant(spec)
    }

    fn revoke_device(&mut self, spec: &GrantSpec, bound: Duration) -> Result<Release> {
        self.revoke(spec, bound)
    }

    fn poll_revoked(&mut self, spec: &GrantSpec) -> Result<Release> {
        self.revoked_yet(spec)
    }

    fn defined_nics(&self) -> Vec<backstop_hypervisor::DefinedNic> {
        self.nics()
    }

    fn link_states(&mut self) -> Result<Vec<backstop_hypervisor::LinkState>> {
        self.links()
    }

    fn set_event_waker(&mut self, waker: EventWaker) {
        self.events.set_waker(waker);
    }

    fn heartbeat_probe(&self) -> Option<backstop_hypervisor::HeartbeatProbe> {
        let read = self.agent.as_ref()?.stats_reader();
        Some(Arc::new(move || read().into()))
    }
}

/// One VM instance's heartbeat: backstop's agent on its own channel, or qemu-ga through
/// libvirt's agent API.
enum Heartbeat {
    Agent(AgentChannel),
    Qga(crate::qga::QgaPinger),
}

impl Heartbeat {
    fn stats(&self) -> backstop_qmp::AgentStats {
        match self {
            Heartbeat::Agent(a) => a.stats(),
            Heartbeat::Qga(q) => q.stats(),
        }
    }

    fn stats_reader(&self) -> Box<dyn Fn() -> backstop_qmp::AgentStats + Send + Sync> {
        match self {
            Heartbeat::Agent(a) => Box::new(a.stats_reader()),
            Heartbeat::Qga(q) => Box::new(q.stats_reader()),
        }
    }

    /// Ends it: the channel closed, or the pinger told to stop.
    fn close(self) {
        match self {
            Heartbeat::Agent(mut a) => a.close(),
            Heartbeat::Qga(q) => drop(q),
        }
    }
}

impl LibvirtBackend {
    /// The heartbeat for the VM instance `shape` describes. `restored`: it was just restored
    /// from a snapshot (qemu-ga sets its clock once it answers).
    fn connect_heartbeat(&self, shape: &DomainShape, restored: bool) -> Option<Heartbeat> {
        match (self.heartbeat, &shape.agent_socket) {
            (HeartbeatSource::BackstopAgent, Some(sock)) => {
                Some(Heartbeat::Agent(AgentChannel::connect(sock)))
            }
            // The channel went between adoption and a restore (a changed definition): no
            // heartbeats, which the watchdog notices.
            (HeartbeatSource::BackstopAgent, None) => None,
            (HeartbeatSource::QemuGa, _) => Some(Heartbeat::Qga(crate::qga::QgaPinger::start(
                &self.cfg.uri,
                &shape.uuid,
                restored,
            ))),
        }
    }
}
