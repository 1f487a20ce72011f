//! vCPU threads: one thread per vCPU runs `KVM_RUN` and the device model; the VM's control
//! thread pauses it (a flag plus a signal that makes `KVM_RUN` return `EINTR`), reads or writes
//! its state while it is parked, and resumes it.
//!
//! A parked thread holds neither the vCPU nor the device lock, so state ioctls from the control
//! thread never race `KVM_RUN`. A paused vCPU never resumes on its own: only [`VcpuRunner::resume`]
//! releases it.

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::{Devices, IoAction};

/// How often a pause re-sends its kick while waiting for the vCPU to park (covers a signal that
/// landed just before the thread entered `KVM_RUN`).
const KICK_INTERVAL: Duration = Duration::from_millis(2);
/// A vCPU that does not park within this bound is reported, never waited on forever.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

extern "C" fn kick_handler(_: libc::c_int) {}

fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed `sigaction` is a valid "no flags, empty mask" value; the handler is an
        // `extern "C"` function that does nothing (async-signal-safe). No SA_RESTART, so a
        // `KVM_RUN` interrupted by the signal returns EINTR to its caller.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = kick_handler as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(kick_signal(), &action, std::ptr::null_mut());
        }
    });
}

/// Called on the vCPU thread when its vCPU stops by itself.
pub type StopCallback = Arc<dyn Fn(u32, &VcpuStop) + Send + Sync>;

/// Why a vCPU stopped running by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuStop {
    /// The guest wrote the exit port.
    GuestExit(u8),
    /// KVM reported something this VMM cannot continue from (shutdown, failed entry, ...).
    Fault(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Run,
    Pause,
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Parked,
    Running,
    Stopped,
}

#[derive(Debug)]
struct Ctl {
    want: Want,
    status: Status,
    stop: Option<VcpuStop>,
}

#[derive(Debug)]
struct Control {
    ctl: Mutex<Ctl>,
    cv: Condvar,
    run: AtomicBool,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Locks a mutex, carrying on with the data if another thread panicked while holding it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One vCPU and its thread.
#[derive(Debug)]
pub struct VcpuRunner {
    index: u32,
    fd: Arc<Mutex<VcpuFd>>,
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl VcpuRunner {
    /// Starts the thread, parked: the vCPU does not run until [`resume`](Self::resume).
    pub fn spawn(
        index: u32,
        fd: VcpuFd,
        devices: Arc<Mutex<Devices>>,
        on_stop: StopCallback,
    ) -> std::io::Result<Self> {
        install_kick_handler();
        let fd = Arc::new(Mutex::new(fd));
        let control = Arc::new(Control {
            ctl: Mutex::new(Ctl {
                want: Want::Pause,
                status: Status::Parked,
                stop: None,
            }),
            cv: Condvar::new(),
            run: AtomicBool::new(false),
        });
        let thread = {
            let (fd, control) = (fd.clone(), control.clone());
            std::thread::Builder::new()
                .name(format!("kvm-vcpu{index}"))
                .spawn(move || vcpu_loop(index, &fd, &control, &devices, &*on_stop))?
        };
        Ok(Self {
            index,
            fd,
            control,
            thread: Some(thread),
        })
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    /// The vCPU, for state ioctls: only call while paused (the lock would otherwise wait for the
    /// next exit).
    pub fn fd(&self) -> MutexGuard<'_, VcpuFd> {
        lock(&self.fd)
    }

    pub fn is_running(&self) -> bool {
        self.control.lock().status == Status::Running
    }

    /// Lets the vCPU run (no effect once it stopped by itself).
    pub fn resume(&self) {
        let mut ctl = self.control.lock();
        if ctl.stop.is_some() || ctl.want == Want::Stop {
            return;
        }
        ctl.want = Want::Run;
        self.control.run.store(true, Ordering::Release);
        self.control.cv.notify_all();
    }

    /// Parks the vCPU and waits until it is out of `KVM_RUN`.
    pub fn pause(&self) -> Result<(), Duration> {
        self.settle(Want::Pause)
    }

    fn settle(&self, want: Want) -> Result<(), Duration> {
        {
            let mut ctl = self.control.lock();
            if ctl.want != Want::Stop {
                ctl.want = want;
            }
            self.control.run.store(false, Ordering::Release);
            self.control.cv.notify_all();
        }
        let start = Instant::now();
        let mut ctl = self.control.lock();
        loop {
            let done = match want {
                Want::Stop => ctl.status == Status::Stopped,
                _ => ctl.status != Status::Running,
            };
            if done {
                return Ok(());
            }
            if start.elapsed() > PAUSE_TIMEOUT {
                return Err(start.elapsed());
            }
            self.kick();
            ctl = self
                .control
                .cv
                .wait_timeout(ctl, KICK_INTERVAL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn kick(&self) {
        if let Some(thread) = &self.thread {
            // SAFETY: the pthread_t belongs to a thread this runner spawned and has not joined
            // (join happens only in `stop`, after the last kick), so it is a live thread id.
            // The signal's handler is installed and does nothing.
            unsafe {
                libc::pthread_kill(thread.as_pthread_t(), kick_signal());
            }
        }
    }

    /// Ends the thread. Idempotent.
    pub fn stop(&mut self) {
        if self.thread.is_none() {
            return;
        }
        let _ = self.settle(Want::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for VcpuRunner {
    fn drop(&mut self) {
        self.stop();
    }
}

fn vcpu_loop(
    index: u32,
    fd: &Mutex<VcpuFd>,
    control: &Control,
    devices: &Mutex<Devices>,
    on_stop: &(dyn Fn(u32, &VcpuStop) + Send + Sync),
) {
    loop {
        {
            let mut ctl = control.lock();
            if ctl.status != Status::Parked {
                ctl.status = Status::Parked;
                control.cv.notify_all();
            }
            while ctl.want == Want::Pause {
                ctl = control.cv.wait(ctl).unwrap_or_else(PoisonError::into_inner);
            }
            if ctl.want == Want::Stop {
                ctl.status = Status::Stopped;
                control.cv.notify_all();
                return;
            }
            ctl.status = Status::Running;
        }
        let stop = run_until_interrupted(fd, &control.run, devices);
        if let Some(stop) = stop {
            on_stop(index, &stop);
            let mut ctl = control.lock();
            ctl.stop = Some(stop);
            if ctl.want == Want::Run {
                ctl.want = Want::Pause;
            }
            control.run.store(false, Ordering::Release);
        }
    }
}

/// Runs until the run flag drops (`None`) or the vCPU stops by itself.
fn run_until_interrupted(
    fd: &Mutex<VcpuFd>,
    run: &AtomicBool,
    devices: &Mutex<Devices>,
) -> Option<VcpuStop> {
    let mut fd = lock(fd);
    while run.load(Ordering::Acquire) {
        match fd.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                if let IoAction::GuestExited(status) = lock(devices).io_out(port, data) {
                    return Some(VcpuStop::GuestExit(status));
                }
            }
            Ok(VcpuExit::IoIn(port, data)) => lock(devices).io_in(port, data),
            Ok(VcpuExit::MmioRead(_, data)) => data.fill(0xff),
            Ok(VcpuExit::MmioWrite(..)) | Ok(VcpuExit::Intr) => {}
            Ok(VcpuExit::Hlt) => {
                // Only without an in-kernel irqchip: nothing can wake the vCPU again.
                return Some(VcpuStop::Fault("guest halted with interrupts off".into()));
            }
            Ok(other) => return Some(VcpuStop::Fault(format!("vCPU exit {other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
            Err(e) => return Some(VcpuStop::Fault(format!("KVM_RUN: {e}"))),
        }
    }
    None
}
