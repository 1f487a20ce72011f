//! QEMU's background-snapshot thread, watched from outside: how much CPU it has used since
//! `migrate` (Linux `/proc/<pid>/task/<tid>/schedstat`).
//!
//! Why: with `migrate` sent before `stop` (`version::SetupTimes`), backstop's `stop` must land
//! while that thread still pre-faults guest RAM. The pre-fault is CPU work of a nearly fixed
//! size per guest, but its *wall* time stretches with the host's load (2-9x between consecutive
//! captures on a loaded 2-core host), so a lead in wall time is either too short (QEMU's setup
//! left inside the pause) or too long (a lost race). The thread's CPU time tracks its progress
//! whatever the load (4.7-7.6 ms at `active` over 9 captures of a 1 GiB guest under load,
//! `bench/pause_probe.py --cpu-stop`).
//!
//! QEMU names its threads only with `-name ...,debug-threads=on` (set by `cmdline.rs`): 7.2
//! calls this one `bg_snapshot`, 9.0 and later `mig/snapshot`. Where it cannot be found (another
//! name, no `/proc`), captures fall back to the lead in wall time.
//!
//! `schedstat` alone is too coarse for this: the kernel adds a *running* thread's CPU time to
//! it only at a scheduler tick or when the thread stops running, so on a kernel with
//! `CONFIG_HZ=250` (this host's) it moves in 4 ms steps, about a whole setup's CPU at 1 GiB
//! (3-4 ms). Where the kernel lets backstop open one (root, `perf_event_open`), a task-clock
//! counter on the thread ([`TaskClock`]) reads its CPU time to the µs, the counting kernel
//! bringing a running thread's figure up to date on each read.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::pause::PauseClock;

/// The names QEMU gives its background-snapshot thread (`comm`, at most 15 bytes).
const NAMES: &[&str] = &["bg_snapshot", "mig/snapshot"];

/// How often the CPU time is read while a capture's setup runs.
const EVERY: Duration = Duration::from_micros(200);

/// The thread's `schedstat` file (its first field: CPU time used, in ns), and a task clock on
/// it where one could be opened.
#[derive(Debug, Clone)]
pub(crate) struct SnapshotThread {
    schedstat: PathBuf,
    clock: Option<Arc<TaskClock>>,
}

impl SnapshotThread {
    /// Looks for QEMU `pid`'s background-snapshot thread for up to `wait` (QEMU creates it
    /// while it handles `migrate`).
    pub(crate) fn find(pid: u32, wait: Duration) -> Option<SnapshotThread> {
        let deadline = Instant::now() + wait;
        loop {
            let tasks = PathBuf::from(format!("/proc/{pid}/task"));
            for entry in std::fs::read_dir(&tasks).ok()?.flatten() {
                let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                if NAMES.contains(&comm.trim_end()) {
                    return SnapshotThread::at(&entry.path());
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(EVERY);
        }
    }

    /// The thread whose `/proc/<pid>/task/<tid>` directory is `task`.
    fn at(task: &std::path::Path) -> Option<SnapshotThread> {
        let schedstat = task.join("schedstat");
        let tid = task.file_name()?.to_str()?.parse().ok()?;
        let clock = TaskClock::open(tid, &schedstat).map(Arc::new);
        Some(SnapshotThread { schedstat, clock })
    }

    /// CPU time the thread has used, in ns; `None` once it is gone.
    pub(crate) fn cpu_ns(&self) -> Option<u64> {
        self.cpu_and_wait_ns().map(|(cpu, _)| cpu)
    }

    /// CPU time the thread has used and time it spent runnable but waiting for a CPU, in ns:
    /// the CPU time from the task clock where there is one (`schedstat`'s when that is more,
    /// as it is, exactly, once the thread has stopped running), the wait from `schedstat`.
    fn cpu_and_wait_ns(&self) -> Option<(u64, u64)> {
        let (stat_ns, wait_ns) =
            parse_schedstat_wait(&std::fs::read_to_string(&self.schedstat).ok()?)?;
        let clock_ns = self.clock.as_ref().and_then(|c| c.read_ns()).unwrap_or(0);
        Some((stat_ns.max(clock_ns), wait_ns))
    }

    /// Whether the CPU time comes from a task clock (to the µs) rather than `schedstat` alone.
    pub(crate) fn precise(&self) -> bool {
        self.clock.is_some()
    }

    /// The thread's minor page faults so far (`stat` field 10), for the debug log only.
    fn minor_faults(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(self.schedstat.with_file_name("stat")).ok()?;
        // Fields after the `(comm)`, which may hold spaces, start at field 3.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(7)?
            .parse()
            .ok()
    }
}

/// A `perf_event_open` task-clock counter on one thread of another process: its CPU time from
/// when the counter was opened, to the µs, plus what `schedstat` showed then (the thread's
/// time before, as far as the kernel had added it up).
#[derive(Debug)]
struct TaskClock {
    fd: OwnedFd,
    base_ns: u64,
}

/// `struct perf_event_attr` as of its first version (`PERF_ATTR_SIZE_VER0`, 64 bytes), which
/// every kernel with `perf_event_open` takes: the flags all 0 (counting from the start, the
/// kernel's time included, this thread only).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    bp_addr: u64,
}

impl TaskClock {
    const PERF_TYPE_SOFTWARE: u32 = 1;
    const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
    const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;

    /// `None` where the kernel refuses (not root, `perf_event_paranoid`, no perf events).
    fn open(tid: libc::pid_t, schedstat: &std::path::Path) -> Option<TaskClock> {
        let attr = PerfEventAttr {
            kind: Self::PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: Self::PERF_COUNT_SW_TASK_CLOCK,
            ..PerfEventAttr::default()
        };
        // SAFETY: `attr` is a valid `perf_event_attr` of the size it states, alive for the
        // call; the other arguments are plain integers (any CPU, no group).
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                tid,
                -1 as libc::c_int,
                -1 as libc::c_int,
                Self::PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "no task clock on QEMU's snapshot thread: its CPU time read from schedstat alone"
            );
            return None;
        }
        // SAFETY: a new descriptor the kernel just returned, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let base_ns = parse_schedstat(&std::fs::read_to_string(schedstat).ok()?)?;
        Some(TaskClock { fd, base_ns })
    }

    /// The thread's CPU time, in ns; `None` if the counter cannot be read.
    fn read_ns(&self) -> Option<u64> {
        let mut value = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a buffer of 8 that lives through the call.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                value.as_mut_ptr().cast::<libc::c_void>(),
                value.len(),
            )
        };
        (n == 8).then(|| self.base_ns.saturating_add(u64::from_ne_bytes(value)))
    }
}

/// The first field of a `schedstat` line (`<ns on CPU> <ns waiting> <timeslices>`).
fn parse_schedstat(line: &str) -> Option<u64> {
    parse_schedstat_wait(line).map(|(cpu, _)| cpu)
}

/// The first two fields of a `schedstat` line: CPU time and time waiting for a CPU, in ns.
fn parse_schedstat_wait(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_whitespace().map(str::parse::<u64>);
    Some((f.next()?.ok()?, f.next()?.ok()?))
}

/// Reads the thread's CPU time every [`EVERY`] on a thread of its own, from `migrate` until
/// [`CpuTrace::finish`]: the latest value (a fallback for a capture waiting to send `stop`,
/// which reads the thread itself: [`CpuTrace::read_now_ns`]), and every
/// (time on the pause clock, CPU ns) pair to find what the thread had used by QEMU's `active`.
pub(crate) struct CpuTrace {
    thread: SnapshotThread,
    latest: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    /// (time on the pause clock, CPU ns, ns spent runnable but waiting for a CPU): the wait
    /// only for the debug log, to tell a setup that waited for a CPU from one that waited for
    /// QEMU.
    samples: Arc<Mutex<Vec<(u64, u64, u64)>>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl CpuTrace {
    /// At most this long (a setup that runs longer is not learnt from).
    const LIMIT: Duration = Duration::from_secs(2);

    pub(crate) fn start(thread: SnapshotThread, clock: PauseClock) -> CpuTrace {
        let latest = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::with_capacity(256)));
        let (l, d, s) = (latest.clone(), done.clone(), samples.clone());
        let watched = thread.clone();
        let handle = std::thread::Builder::new()
            .name("snapshot-cpu".into())
            .spawn(move || {
                let started = Instant::now();
                while !d.load(Ordering::Relaxed) && started.elapsed() < Self::LIMIT {
                    let Some((ns, wait_ns)) = thread.cpu_and_wait_ns() else {
                        break;
                    };
                    l.store(ns, Ordering::Relaxed);
                    if let Ok(mut v) = s.lock() {
                        v.push((clock.now_us(), ns, wait_ns));
                    }
                    std::thread::sleep(EVERY);
                }
            })
            .ok();
        CpuTrace {
            thread: watched,
            latest,
            done,
            samples,
            handle,
        }
    }

    /// The thread's CPU time at the last reading, in ns (0 before the first).
    pub(crate) fn latest_ns(&self) -> u64 {
        self.latest.load(Ordering::Relaxed)
    }

    /// The thread's CPU time read now, by the caller (the sampling thread's latest value can
    /// be a scheduling delay old on a busy host), in ns; the latest sample if it is gone.
    pub(crate) fn read_now_ns(&self) -> u64 {
        match self.thread.cpu_ns() {
            Some(ns) => ns.max(self.latest_ns()),
            None => self.latest_ns(),
        }
    }

    /// Stops reading; returns the CPU time the thread had used by `at_us` (on the pause clock:
    /// QEMU's `active` timestamp), in µs, if a reading was taken before it and one after (a
    /// reading after shows the trace was still running then).
    pub(crate) fn finish(mut self, at_us: u64) -> Option<u64> {
        self.done.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        let samples = self.samples.lock().ok()?;
        if tracing::enabled!(tracing::Level::DEBUG) {
            let waited_us = samples
                .iter()
                .rev()
                .find(|&&(t, _, _)| t <= at_us)
                .map(|&(_, _, wait_ns)| wait_ns / 1000);
            tracing::debug!(
                minflt = ?self.thread.minor_faults(),
                runnable_wait_us_by_active = ?waited_us,
                task_clock = self.thread.precise(),
                "snapshot thread faults"
            );
        }
        let cpu: Vec<(u64, u64)> = samples.iter().map(|&(t, ns, _)| (t, ns)).collect();
        cpu_at(&cpu, at_us)
    }
}

impl Drop for CpuTrace {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// How far before `active` the reading it is learnt from may be: on a loaded host the reading
/// thread itself waits for a CPU, and a reading long before `active` (seen in CI: one before
/// the snapshot thread had run at all, 0 ms) says little about the setup.
const NEAR_US: u64 = 1_000;

/// From (time µs, CPU ns) readings in time order: the CPU time (µs) of the last reading at or
/// before `at_us`, provided it is within [`NEAR_US`] of it, shows the thread ran, and some
/// reading came after it.
fn cpu_at(samples: &[(u64, u64)], at_us: u64) -> Option<u64> {
    let after = samples.iter().position(|&(t, _)| t > at_us)?;
    let &(t, ns) = samples[..after].last()?;
    (at_us - t <= NEAR_US && ns > 0).then_some(ns / 1000)
}

/// The calling thread runs under the real-time policy (`SCHED_FIFO`, lowest priority) until
/// dropped, then as before.
///
/// Why: a capture that sent `migrate` first waits a few ms for QEMU's snapshot thread before
/// it sends `stop`, and that `stop` must land before the thread's own. On a 2-core host both
/// QEMU's vCPU (TCG) and its snapshot thread keep a core busy then, and a waiting thread of
/// normal priority woke up to 4-6 ms late (traced 2026-11-29: `stop` sent at 6.9-8.9 ms of the
/// thread's CPU against a target of 1.9-3.3 ms; each of those captures lost its race). The wait
/// sleeps between readings, so the policy costs nothing while it sleeps; it is held for one
/// lead (at most a second). Without the privilege (not root, `RLIMIT_RTPRIO` 0) nothing
/// changes.
pub(crate) struct Urgent {
    previous: Option<(libc::c_int, libc::sched_param)>,
}

impl Urgent {
    pub(crate) fn begin() -> Urgent {
        // SAFETY: pid 0 is the calling thread; the structs are plain data the kernel fills.
        let previous = unsafe {
            let policy = libc::sched_getscheduler(0);
            let mut param: libc::sched_param = std::mem::zeroed();
            if policy < 0 || libc::sched_getparam(0, &mut param) != 0 {
                None
            } else {
                let fifo = libc::sched_param {
                    sched_priority: libc::sched_get_priority_min(libc::SCHED_FIFO),
                };
                (libc::sched_setscheduler(0, libc::SCHED_FIFO, &fifo) == 0)
                    .then_some((policy, param))
            }
        };
        Urgent { previous }
    }

    /// Whether the policy was applied.
    pub(crate) fn applied(&self) -> bool {
        self.previous.is_some()
    }
}

impl Drop for Urgent {
    fn drop(&mut self) {
        if let Some((policy, param)) = self.previous.take() {
            // SAFETY: as in `begin`; restores what `sched_getscheduler` returned.
            unsafe {
                libc::sched_setscheduler(0, policy, &param);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_lines_parse() {
        assert_eq!(parse_schedstat("123456 7890 12\n"), Some(123_456));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        assert_eq!(
            parse_schedstat_wait("123456 7890 12\n"),
            Some((123_456, 7_890))
        );
        assert_eq!(parse_schedstat_wait("123456"), None);
    }

    #[test]
    fn the_cpu_at_active_is_the_last_reading_before_it() {
        let s = [(100, 1_000_000), (300, 2_000_000), (500, 2_500_000)];
        assert_eq!(cpu_at(&s, 350), Some(2_000));
        assert_eq!(cpu_at(&s, 300), Some(2_000));
        assert_eq!(cpu_at(&s, 50), None, "no reading before it");
        assert_eq!(
            cpu_at(&s, 600),
            None,
            "no reading after it: the trace had stopped"
        );
        assert_eq!(cpu_at(&[], 10), None);
        // A reading long before `active` (the reader starved) or before the thread ran at all.
        let sparse = [(100, 1_000_000), (5_000, 9_000_000)];
        assert_eq!(cpu_at(&sparse, 1_100), Some(1_000));
        assert_eq!(cpu_at(&sparse, 1_200), None);
        assert_eq!(cpu_at(&[(100, 0), (400, 3_000_000)], 300), None);
    }

    #[test]
    fn this_process_threads_are_found_by_name_and_read() {
        // A thread of this test process named like QEMU 10's snapshot thread.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("mig/snapshot".into())
            .spawn(move || {
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(30) {
                    std::hint::black_box(0u64);
                }
                let _ = rx.recv();
            })
            .unwrap();
        let found = SnapshotThread::find(std::process::id(), Duration::from_secs(1))
            .expect("the named thread");
        std::thread::sleep(Duration::from_millis(40));
        let ns = found.cpu_ns().expect("its schedstat");
        assert!(ns >= 10_000_000, "it spun ~30 ms: {ns} ns");
        tx.send(()).unwrap();
        h.join().unwrap();
        assert!(
            SnapshotThread::find(std::process::id(), Duration::ZERO).is_none(),
            "gone once it ended"
        );
    }

    /// Another process's running thread, read every ~0.3 ms: no reading may have gained more
    /// CPU than the wall time since the one before (`schedstat` alone jumps by a whole
    /// scheduler tick, 4 ms at `CONFIG_HZ=250`, between two reads a fraction of that apart).
    #[test]
    fn a_running_threads_cpu_time_is_read_to_the_moment_not_by_the_tick() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let task = PathBuf::from(format!("/proc/{0}/task/{0}", child.id()));
        let thread = SnapshotThread::at(&task).expect("the child's thread");
        if !thread.precise() {
            let _ = child.kill();
            let _ = child.wait();
            eprintln!(
                "SKIPPED a_running_threads_cpu_time_is_read_to_the_moment_not_by_the_tick: \
                 perf_event_open refused here (not root, or perf_event_paranoid)"
            );
            return;
        }
        // (wall time before the read, wall time after it, CPU ns)
        let mut readings = Vec::new();
        let started = Instant::now();
        loop {
            let before = Instant::now();
            let ns = thread.cpu_ns().expect("the child runs");
            readings.push((before, Instant::now(), ns));
            let gained = ns - readings[0].2;
            if (readings.len() >= 200 && gained >= 20_000_000)
                || started.elapsed() > Duration::from_secs(5)
            {
                break;
            }
            std::thread::sleep(Duration::from_micros(300));
        }
        let _ = child.kill();
        let _ = child.wait();
        let gained = readings.last().unwrap().2 - readings[0].2;
        assert!(gained >= 10_000_000, "the child spun: {gained} ns");
        for pair in readings.windows(2) {
            let (before, _, from) = pair[0];
            let (_, after, to) = pair[1];
            let wall = after.duration_since(before).as_nanos() as u64;
            assert!(
                to - from <= wall,
                "{} µs of CPU gained in {} µs of wall time",
                (to - from) / 1000,
                wall / 1000
            );
        }
    }

    #[test]
    fn urgent_restores_the_threads_policy() {
        // SAFETY: reads the calling thread's policy.
        let policy = || unsafe { libc::sched_getscheduler(0) };
        std::thread::spawn(move || {
            let before = policy();
            let urgent = Urgent::begin();
            if urgent.applied() {
                assert_eq!(policy(), libc::SCHED_FIFO);
            } else {
                assert_eq!(policy(), before, "not permitted here: nothing changed");
            }
            drop(urgent);
            assert_eq!(policy(), before);
        })
        .join()
        .unwrap();
    }
}
