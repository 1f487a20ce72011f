//! Runs the [`Engine`] on one dedicated thread and feeds it jobs.
//!
//! One thread owns the engine because QEMU is started with `PR_SET_PDEATHSIG`, which fires when
//! the *thread* that forked it ends: the thread that launches QEMU must live as long as the
//! daemon. It also serialises every operation on the VM. `status` is answered from a shared copy
//! the engine publishes, so it works even while a long rollback runs.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use backstop_control::{Progress, Request, Response, StatusView};

use crate::engine::{random_id, Caller, Ctx, Engine};
use crate::error::EngineError;
use crate::Config;

/// The result a job's submitter receives: a response, or a (code, message) failure.
pub type JobResult = Result<Response, (String, String)>;

pub struct Job {
    pub request: Request,
    pub caller: Caller,
    pub progress: Box<dyn FnMut(Progress) + Send>,
    pub reply: mpsc::Sender<JobResult>,
}

enum Msg {
    Job(Job),
    /// A host trigger: runs before any queued job; an in-flight capture abandons for it.
    Urgent(Job),
    /// A peer the control socket turned away; journaled.
    Refused {
        uid: u32,
        pid: i32,
    },
    Shutdown,
}

pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
    preempt: Arc<std::sync::atomic::AtomicBool>,
    status: Arc<Mutex<StatusView>>,
    thread: Option<JoinHandle<()>>,
}

/// How often the engine looks at the VM when no job is waiting.
const TICK: Duration = Duration::from_millis(250);

impl EngineHandle {
    /// Starts the engine thread and waits until the engine has started (and reconciled).
    pub fn spawn(cfg: Config) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let mut engine = match Engine::start(cfg) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let status = Arc::new(Mutex::new(engine.status()));
                engine.status_out = Some(Arc::clone(&status));
                let _ = ready_tx.send(Ok((status, Arc::clone(&engine.preempt))));
                run(engine, rx);
            })
            .map_err(|source| EngineError::Io {
                step: "spawn engine thread",
                source,
            })?;
        let (status, preempt) = ready_rx.recv().map_err(|_| EngineError::Io {
            step: "start engine",
            source: std::io::Error::other("engine thread died"),
        })??;
        Ok(EngineHandle {
            tx,
            preempt,
            status,
            thread: Some(thread),
        })
    }

    /// Queues a job; its reply arrives on `job.reply`.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.tx
            .send(Msg::Job(job))
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
        let (reply, rx) = mpsc::channel();
        let urgent = matches!(request, Request::Trigger { .. });
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
                .send(Msg::Urgent(job))
                .map_err(|_| EngineError::ShuttingDown)
        } else {
            self.submit(job)
        };
        sent.map_err(|e| (e.code().to_string(), e.to_string()))?;
        rx.recv()
            .unwrap_or_else(|_| Err(("ERR_SHUTTING_DOWN".into(), "the engine stopped".into())))
    }

    /// Records a connection the control socket refused (journaled as `control.refused`).
    pub fn note_refused(&self, uid: u32, pid: i32) {
        let _ = self.tx.send(Msg::Refused { uid, pid });
    }

    pub fn status(&self) -> StatusView {
        match self.status.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Stops the engine: the VM is ended and the thread joined.
    pub fn shutdown(mut self) {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Takes the next message: urgent jobs first, then in arrival order.
fn next_message(
    rx: &mpsc::Receiver<Msg>,
    pending: &mut std::collections::VecDeque<Msg>,
) -> Result<Msg, RecvTimeoutError> {
    if pending.is_empty() {
        pending.push_back(rx.recv_timeout(TICK)?);
    }
    while let Ok(m) = rx.try_recv() {
        pending.push_back(m);
    }
    let pos = pending
        .iter()
        .position(|m| matches!(m, Msg::Urgent(_) | Msg::Shutdown))
        .unwrap_or(0);
    pending.remove(pos).ok_or(RecvTimeoutError::Timeout)
}

/// Longest an idle engine leaves the published status unrefreshed (scheduled snapshots and
/// similar background changes show up within this).
const STATUS_REFRESH: Duration = Duration::from_secs(2);

fn run(mut engine: Engine, rx: mpsc::Receiver<Msg>) {
    let mut pending = std::collections::VecDeque::new();
    let mut last_publish = std::time::Instant::now();
    loop {
        match next_message(&rx, &mut pending) {
            Ok(Msg::Urgent(job)) => {
                // Whatever it preempted has stopped; the flag must not outlive this job (even
                // if the job is refused, e.g. while HALTED).
                engine
                    .preempt
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                serve(&mut engine, job);
            }
            Ok(Msg::Job(job)) => serve(&mut engine, job),
            Ok(Msg::Refused { uid, pid }) => engine.note_refused(uid, pid),
            Ok(Msg::Shutdown) | Err(RecvTimeoutError::Disconnected) => {
                engine.shutdown();
                return;
            }
            Err(RecvTimeoutError::Timeout) => {
                // A status lists and checks every manifest: refresh it when the tick changed
                // the VM's state or epoch, otherwise at most every STATUS_REFRESH (jobs publish
                // on their own when they finish).
                let before = (engine.state, engine.vm.epoch);
                engine.tick();
                if (engine.state, engine.vm.epoch) != before
                    || last_publish.elapsed() >= STATUS_REFRESH
                {
                    engine.publish();
                    last_publish = std::time::Instant::now();
                }
            }
        }
    }
}

/// Runs one job on the engine thread and sends its reply.
fn serve(engine: &mut Engine, mut job: Job) {
    let mut ctx = Ctx {
        caller: job.caller.clone(),
        trace_id: random_id(),
        progress: &mut *job.progress,
    };
    let span = tracing::info_span!("request", op = job.request.name(), trace_id = %ctx.trace_id, by = %ctx.caller.label());
    let _g = span.enter();
    let result = engine.handle(job.request, &mut ctx).map_err(|e| {
        if e.code() == "ERR_VM_HALTED" || e.code().starts_with("ERR_BAD") {
            tracing::warn!(code = e.code(), error = %e, "request refused");
        } else {
            tracing::error!(code = e.code(), error = %e, "request failed");
        }
        (e.code().to_string(), e.to_string())
    });
    engine.publish();
    let _ = job.reply.send(result);
}
