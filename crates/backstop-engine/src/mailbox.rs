//! The actor's mailbox: a [`VmHandle`] sends typed [`Order`]s to the [`VmActor`] running on its
//! own thread; the loop takes host triggers first, then orders in arrival order, and ticks the
//! actor when idle.
//!
//! One thread owns the engine because QEMU is started with `PR_SET_PDEATHSIG`, which fires when
//! the *thread* that forked it ends: the thread that launches QEMU must live as long as the
//! daemon. It also serialises every operation on the VM. `status` is answered from a shared copy
//! the engine publishes, so it works even while a long rollback runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use backstop_control::{Progress, Request, Response, RollbackArgs, StatusView, WireError};

use backstop_common::{AuditEvent, ErrorCode};

use crate::actor::{backend_for, Caller, Ctx, Services, VmActor};
use crate::error::EngineError;
use crate::snapshot::CaptureSlots;
use crate::Config;

/// The result a job's submitter receives: a response, or a failure with its code.
pub type JobResult = Result<Response, WireError>;

pub struct Job {
    pub request: Request,
    pub caller: Caller,
    pub progress: Box<dyn FnMut(Progress) + Send>,
    pub reply: mpsc::Sender<JobResult>,
}

/// What the actor can be told: the only way in. Requests arrive typed by the control protocol.
pub enum Order {
    /// A request, run in arrival order.
    Request(Job),
    /// A host trigger: runs before any queued order; an in-flight capture abandons for it.
    Trigger(Job),
    /// A peer the control socket turned away; journaled.
    NoteRefused { uid: u32, pid: i32 },
    /// Look at the VM (watchdog, leases, schedule). Taken when the loop is idle, and sent by
    /// the backend's event waker when the hypervisor reports something (a libvirt event).
    Tick,
    /// End the VM and stop the actor.
    Shutdown,
    /// Work on the VM's store from outside the engine (a snapshot pulled from another host is
    /// published this way: `backstop-offsite`), run on the actor's thread so that it never
    /// overlaps the actor's own captures and retention. Dropped unrun by a retired actor.
    WithStore(StoreWork),
}

/// See [`Order::WithStore`]: the work gets the VM's store and reports back on its own channel.
pub type StoreWork = Box<dyn FnOnce(&backstop_store::Store) + Send>;

pub struct VmHandle {
    name: String,
    /// The only strong owner of the sender besides callers' transient use: the backend's event
    /// waker holds a weak one, so dropping the handle still disconnects the actor.
    tx: Arc<mpsc::Sender<Order>>,
    preempt: Arc<std::sync::atomic::AtomicBool>,
    status: Arc<Mutex<StatusView>>,
    /// When the actor last showed a sign of life ([`crate::systemd::now_ms`]).
    alive: Arc<AtomicU64>,
    /// Set by the supervisor when it gave up on a wedged actor: the actor's loop ends at its
    /// next turn without touching the VM again, and callers waiting on it are answered.
    retired: Arc<AtomicBool>,
    /// The status a retired actor's VM shows from then on (HALTED, no guest): the wedged actor
    /// could still publish into `status` if it ever finished what it was doing.
    frozen: Mutex<Option<StatusView>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The VM's journal, read back (read-only) for `events` subscribers.
    journal_path: std::path::PathBuf,
}

/// What every actor of one daemon shares.
#[derive(Clone)]
pub struct Shared {
    /// At most `max_concurrent_captures` captures at once, across the VMs.
    pub captures: Arc<CaptureSlots>,
    /// The daemon journal, where each VM anchors its chain head.
    pub anchors: Option<Arc<Mutex<backstop_journal::Journal>>>,
}

impl Shared {
    pub fn for_daemon(daemon: &crate::config::DaemonConfig) -> Shared {
        Shared {
            captures: Arc::new(CaptureSlots::new(daemon.max_concurrent_captures)),
            anchors: None,
        }
    }
}

/// How often the engine looks at the VM when no job is waiting.
const TICK: Duration = Duration::from_millis(250);

/// Opens the services and the backend for `cfg` and starts an actor on this thread.
fn start_actor(cfg: &Config, shared: &Shared) -> Result<VmActor, EngineError> {
    // A VM that runs already (a libvirt domain) is checked and taken over before anything of
    // backstop's is written (state dir, key, journal): a refusal changes nothing.
    crate::services::check_layers_dir(&cfg.layers_dir())?;
    let mut adopted = None;
    if cfg.vm.libvirt.is_some() {
        let mut backend = crate::services::libvirt_backend(cfg)?;
        let adoption = backend.adopt().map_err(|source| EngineError::Backend {
            step: "adopt",
            source,
        })?;
        adopted = Some((backend, adoption));
    }
    // A VM backstop launches itself: its disk images are claimed host-wide first, the same
    // way (one guardian for a disk written in place; a shared base for many).
    let disk_claims = if adopted.is_none() {
        crate::disk_claims::claim_disks(cfg)?
    } else {
        Vec::new()
    };
    let mut services = Services::open(cfg)?;
    services.disk_claims = disk_claims;
    services.captures = Arc::clone(&shared.captures);
    services.anchors = shared.anchors.clone();
    let mut cfg = cfg.clone();
    crate::firmware::add_vars_disk(&mut cfg)?;
    let (backend, adoption) = match adopted {
        Some((backend, adoption)) => {
            crate::services::create_layers_dir(&cfg.layers_dir())?;
            if let Some(a) = &adoption {
                cfg.vm.disks = a
                    .disks
                    .iter()
                    .map(|d| crate::config::DiskConfig {
                        id: d.id.clone(),
                        path: d.active.clone(),
                        format: "qcow2".into(),
                        snapshot: crate::config::DiskSnapshotMode::Capture,
                        create_size_mib: None,
                    })
                    .collect();
            }
            (backend, adoption)
        }
        None => (backend_for(&cfg, &services.key)?, None),
    };
    VmActor::start(cfg, services, backend, adoption)
}

impl VmHandle {
    /// Starts the VM's actor on its own thread (`vm-<name>`) and waits until it has started
    /// (and reconciled). If the actor panics later, its VM is HALTED durably and a fresh actor
    /// comes up over the same records (HALTED), so `status` and `halt clear` keep working; the
    /// other VMs are untouched.
    pub fn spawn_in(cfg: Config, shared: Shared) -> Result<VmHandle, EngineError> {
        let (tx, rx) = mpsc::channel::<Order>();
        let tx = Arc::new(tx);
        let wake = Arc::downgrade(&tx);
        let (ready_tx, ready_rx) = mpsc::channel();
        let alive = Arc::new(AtomicU64::new(crate::systemd::now_ms()));
        let name = cfg.vm.name.clone();
        let journal_path = crate::services::journal_path(&cfg);
        let thread_alive = Arc::clone(&alive);
        let retired = Arc::new(AtomicBool::new(false));
        let thread_retired = Arc::clone(&retired);
        let thread = std::thread::Builder::new()
            .name(format!("vm-{name}"))
            .spawn(move || {
                crate::systemd::adopt_liveness(thread_alive);
                let mut engine = match start_actor(&cfg, &shared) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                engine.backend.set_event_waker(event_waker(&wake));
                let status = Arc::new(Mutex::new(engine.status()));
                let preempt = Arc::clone(&engine.preempt);
                engine.status_out = Some(Arc::clone(&status));
                let _ = ready_tx.send(Ok((Arc::clone(&status), Arc::clone(&preempt))));
                loop {
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run(engine, &rx, &thread_retired)
                    }));
                    let Err(panic) = ran else { return };
                    // Unwinding dropped the actor and with it the hypervisor (the guest ended).
                    let what = panic_text(&panic);
                    tracing::error!(vm = %cfg.vm.name, panic = %what, "VM actor panicked; the VM is HALTED");
                    if thread_retired.load(Ordering::SeqCst) {
                        // The supervisor gave up on it already and recorded the halt.
                        return;
                    }
                    halt_after_panic(&cfg, &what);
                    engine = match start_actor(&cfg, &shared) {
                        Ok(mut e) => {
                            e.backend.set_event_waker(event_waker(&wake));
                            e.status_out = Some(Arc::clone(&status));
                            e.preempt = Arc::clone(&preempt);
                            e.publish();
                            e
                        }
                        Err(e) => {
                            tracing::error!(vm = %cfg.vm.name, error = %e, "the HALTED VM's actor could not restart");
                            refuse_all(
                                &rx,
                                WireError::new(
                                    ErrorCode::VmHalted,
                                    format!("the VM is HALTED and its actor could not restart: {e}"),
                                ),
                            );
                            return;
                        }
                    };
                }
            })
            .map_err(|source| EngineError::Io {
                step: "spawn engine thread",
                source,
            })?;
        let (status, preempt) = ready_rx.recv().map_err(|_| EngineError::Io {
            step: "start engine",
            source: std::io::Error::other("engine thread died"),
        })??;
        Ok(VmHandle {
            name,
            tx,
            preempt,
            status,
            alive,
            retired,
            frozen: Mutex::new(None),
            thread: Mutex::new(Some(thread)),
            journal_path,
        })
    }

    /// The VM's journal file (read-only use: `events`).
    pub fn journal_path(&self) -> &std::path::Path {
        &self.journal_path
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Milliseconds since the actor last showed a sign of life.
    pub fn silent_ms(&self) -> u64 {
        crate::systemd::now_ms().saturating_sub(self.alive.load(Ordering::Relaxed))
    }

    /// Gives up on a wedged actor: its loop ends at its next turn (if it ever gets there) without
    /// touching the VM, and every caller waiting on it, or calling later, is answered
    /// `ERR_VM_ACTOR_WEDGED`. The supervisor ends the guest and records the halt itself.
    pub fn retire(&self, halt: backstop_control::HaltView) {
        // (A view of the VM for `status`, not the lifecycle: the actor that owns that is wedged.)
        let view = StatusView {
            state: "halted".into(),
            pid: None,
            halted: Some(halt),
            ..self.status()
        };
        *self.frozen.lock().unwrap_or_else(|p| p.into_inner()) = Some(view);
        self.retired.store(true, Ordering::SeqCst);
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst)
    }

    /// Queues a job; its reply arrives on `job.reply`.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.tx
            .send(Order::Request(job))
            .map_err(|_| EngineError::ShuttingDown)
    }

    /// Runs a request to completion (convenience for callers without their own channel).
    pub fn call(
        &self,
        request: Request,
        caller: Caller,
        progress: Box<dyn FnMut(Progress) + Send>,
    ) -> JobResult {
        if matches!(request, Request::Status) {
            return Ok(Response::Status(self.status()));
        }
        if self.is_retired() {
            return Err(wedged_refusal(&self.name));
        }
        let (reply, rx) = mpsc::channel();
        // A host trigger and a console emergency rollback are never queued behind routine
        // work: they preempt a capture in flight and jump the queue.
        let urgent = match &request {
            Request::Trigger { .. } => true,
            Request::Rollback(RollbackArgs {
                to: None,
                before: None,
                emergency,
                rollback_type,
                ..
            }) => *emergency || *rollback_type == Some(backstop_common::RollbackType::Emergency),
            _ => false,
        };
        let job = Job {
            request,
            caller,
            progress,
            reply,
        };
        let sent = if urgent {
            // Rollback overrides whatever is in flight (spec/000 §6): flag first, so a capture
            // running right now abandons, then queue ahead of everything else.
            self.preempt
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.tx
                .send(Order::Trigger(job))
                .map_err(|_| EngineError::ShuttingDown)
        } else {
            self.submit(job)
        };
        sent.map_err(|e| e.to_wire())?;
        // Waits in turns, so that a caller of an actor the supervisor gave up on is answered
        // instead of waiting for good.
        loop {
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(result) => return result,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(WireError::new(
                        ErrorCode::ShuttingDown,
                        "the engine stopped",
                    ))
                }
                Err(RecvTimeoutError::Timeout) if self.is_retired() => {
                    return Err(wedged_refusal(&self.name))
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Queues `work` on the actor's thread (see [`Order::WithStore`]).
    pub fn with_store(&self, work: StoreWork) -> Result<(), EngineError> {
        if self.is_retired() {
            return Err(EngineError::ShuttingDown);
        }
        self.tx
            .send(Order::WithStore(work))
            .map_err(|_| EngineError::ShuttingDown)
    }

    /// Records a connection the control socket refused (journaled as `control.refused`).
    pub fn note_refused(&self, uid: u32, pid: i32) {
        let _ = self.tx.send(Order::NoteRefused { uid, pid });
    }

    pub fn status(&self) -> StatusView {
        if let Some(f) = &*self.frozen.lock().unwrap_or_else(|p| p.into_inner()) {
            return f.clone();
        }
        match self.status.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Stops the actor (a clean stop: see [`VmActor::shutdown`]) and waits for its thread.
    /// Takes `&self`: other threads (the control socket's) may still hold the handle; orders they
    /// send afterwards are answered `ERR_SHUTTING_DOWN`.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Order::Shutdown);
        if self.is_retired() {
            // Its thread is wedged: waiting for it would wedge the daemon's stop as well. (Its
            // guest is ended already; the process's exit ends the thread.)
            return;
        }
        let thread = match self.thread.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// What the backend calls when the hypervisor reports something on its own (a libvirt domain
/// event): a [`Order::Tick`], so the actor looks at the VM now rather than at its next idle
/// tick. Holds the sender weakly: a VM whose handle is gone is not kept alive by its backend.
fn event_waker(tx: &std::sync::Weak<mpsc::Sender<Order>>) -> backstop_hypervisor::EventWaker {
    let tx = tx.clone();
    Arc::new(move || {
        if let Some(tx) = tx.upgrade() {
            let _ = tx.send(Order::Tick);
        }
    })
}

/// Takes the next message: urgent jobs first, then in arrival order; waits at most `wait`.
fn next_message(
    rx: &mpsc::Receiver<Order>,
    pending: &mut std::collections::VecDeque<Order>,
    wait: Duration,
) -> Result<Order, RecvTimeoutError> {
    if pending.is_empty() {
        pending.push_back(rx.recv_timeout(wait)?);
    }
    while let Ok(m) = rx.try_recv() {
        pending.push_back(m);
    }
    let pos = pending
        .iter()
        .position(|m| matches!(m, Order::Trigger(_) | Order::Shutdown))
        .unwrap_or(0);
    pending.remove(pos).ok_or(RecvTimeoutError::Timeout)
}

/// Longest an idle engine leaves the published status unrefreshed (scheduled snapshots and
/// similar background changes show up within this).
const STATUS_REFRESH: Duration = Duration::from_secs(2);

fn run(mut engine: VmActor, rx: &mpsc::Receiver<Order>, retired: &AtomicBool) {
    let mut pending = std::collections::VecDeque::new();
    let mut last_publish = std::time::Instant::now();
    let mut last_tick = std::time::Instant::now();
    loop {
        if retired.load(Ordering::SeqCst) {
            // The supervisor ended this VM's guest and recorded the halt while this actor was
            // wedged: it must not act on the VM again (no snapshot, no rollback, no relaunch).
            tracing::error!(vm = %engine.cfg.vm.name, "a wedged actor came back after the supervisor retired it; it stops here");
            refuse_all(rx, wedged_refusal(&engine.cfg.vm.name));
            return;
        }
        crate::systemd::beat();
        // Idle, the engine looks at the VM every TICK, and just after the heartbeat
        // watchdog's silence runs out: an expiry is acted on when it happens.
        let wait = crate::watchdog::idle_wait(
            std::time::Instant::now(),
            engine.heartbeat_due(),
            last_tick,
            crate::fault::idle_tick(engine.fault, TICK),
        );
        match next_message(rx, &mut pending, wait) {
            Ok(Order::Trigger(job)) => {
                // Whatever it preempted has stopped; the flag must not outlive this job (even
                // if the job is refused, e.g. while HALTED).
                engine
                    .preempt
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                serve(&mut engine, job);
            }
            Ok(Order::Request(job)) => serve(&mut engine, job),
            Ok(Order::NoteRefused { uid, pid }) => engine.note_refused(uid, pid),
            Ok(Order::WithStore(work)) => work(&engine.store),
            Ok(Order::Shutdown) | Err(RecvTimeoutError::Disconnected) => {
                engine.shutdown();
                return;
            }
            Ok(Order::Tick) | Err(RecvTimeoutError::Timeout) => {
                // A status lists and checks every manifest: refresh it when the tick changed
                // the VM's state or epoch, otherwise at most every STATUS_REFRESH (jobs publish
                // on their own when they finish).
                let before = (engine.life.state(), engine.vm.epoch);
                engine.tick();
                last_tick = std::time::Instant::now();
                if (engine.life.state(), engine.vm.epoch) != before
                    || last_publish.elapsed() >= STATUS_REFRESH
                {
                    engine.publish();
                    last_publish = std::time::Instant::now();
                }
            }
        }
    }
}

/// The text of a panic payload.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Writes the durable HALTED record of a VM whose actor failed (panicked or wedged): the
/// next start of the daemon finds it and keeps the VM HALTED until a person clears it.
pub(crate) fn write_halt_record(
    cfg: &Config,
    code: ErrorCode,
    reason: String,
) -> crate::records::HaltRecord {
    let records = crate::records::Records::new(&cfg.daemon.state_dir);
    let rec = crate::records::HaltRecord {
        reason,
        code: code.as_str().into(),
        since: backstop_common::time::now_rfc3339(),
        trace_id: backstop_common::ids::random_id(),
    };
    if let Err(e) = records.set_halted(&rec) {
        tracing::error!(vm = %cfg.vm.name, %code, error = %e, "could not write the HALTED record");
    }
    rec
}

/// Records HALTED durably for a VM whose actor panicked, and journals it in the VM's chain.
fn halt_after_panic(cfg: &Config, what: &str) {
    let rec = write_halt_record(
        cfg,
        ErrorCode::VmActorPanicked,
        format!("the VM's actor panicked ({what}); its guest was ended"),
    );
    let trace = rec.trace_id.clone();
    let journaled = Services::open(cfg).and_then(|mut s| {
        let mut f = serde_json::Map::new();
        for (k, v) in [
            ("session_id", serde_json::Value::Null),
            ("trace_id", trace.clone().into()),
            ("snapshot_id", serde_json::Value::Null),
            ("result", "halted".into()),
            ("code", rec.code.clone().into()),
            ("reason", rec.reason.clone().into()),
        ] {
            f.insert(k.into(), v);
        }
        s.journal
            .append(AuditEvent::VmHalted.as_str(), f)
            .map_err(EngineError::from)
    });
    if let Err(e) = journaled {
        tracing::error!(error = %e, "could not journal the halt after a panic");
    }
}

/// Answers every request with `refusal` until the handle goes away or says shut down: the
/// thread of an actor that cannot restart, or of one the supervisor retired.
fn refuse_all(rx: &mpsc::Receiver<Order>, refusal: WireError) {
    while let Ok(order) = rx.recv() {
        match order {
            Order::Request(job) | Order::Trigger(job) => {
                let _ = job.reply.send(Err(refusal.clone()));
            }
            Order::Shutdown => return,
            Order::NoteRefused { .. } | Order::Tick | Order::WithStore(_) => {}
        }
    }
}

/// The answer to every request for a VM whose wedged actor the supervisor retired.
fn wedged_refusal(vm: &str) -> WireError {
    WireError::new(
        ErrorCode::VmActorWedged,
        format!(
            "VM {vm} is HALTED: its actor stopped answering and its guest was ended; restart \
             backstopd (the other VMs resume where they were) and clear the halt then"
        ),
    )
}

/// Runs one job on the engine thread and sends its reply.
fn serve(engine: &mut VmActor, mut job: Job) {
    let mut ctx = Ctx {
        caller: job.caller.clone(),
        trace_id: engine.new_id(),
        progress: &mut *job.progress,
    };
    let span = tracing::info_span!("request", op = job.request.name(), trace_id = %ctx.trace_id, by = %ctx.caller.label());
    let _g = span.enter();
    let result = engine.handle(job.request, &mut ctx).map_err(|e| {
        if matches!(e.code(), ErrorCode::VmHalted | ErrorCode::BadRequest) {
            tracing::warn!(code = %e.code(), error = %e, "request refused");
        } else {
            tracing::error!(code = %e.code(), error = %e, "request failed");
        }
        e.to_wire()
    });
    engine.publish();
    let _ = job.reply.send(result);
    // A heartbeat expiry that abandoned the job's capture: its rollback now, before anything
    // else queued.
    engine.watchdog_after_job();
    // After the answer, so the asker does not wait for it: the cheap invariants after a state
    // change the job made (drift detection).
    engine.drift_after_change();
}
