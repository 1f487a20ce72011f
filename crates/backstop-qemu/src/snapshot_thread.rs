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
//! A known limit: the kernel adds a *running* thread's CPU time to `schedstat` only at a
//! scheduler tick or when the thread stops running, so on a kernel with `CONFIG_HZ=250` (this
//! host's) the figure moves in 4 ms steps, about a whole setup's CPU at 1 GiB (3-4 ms); one
//! setup learnt here read 0.3 ms where its neighbours read 3.4 ms. A perf task clock on the
//! thread (`perf_event_open`, `PERF_COUNT_SW_TASK_CLOCK`) reads it to the µs on an idle host
//! (25-40 µs per read), but in the bench (QEMU 10.0, 1 GiB) its reads came ~3.5 ms apart instead of
//! every 200 µs, the first one 7-11 ms after QEMU's `active`, so no setup's CPU was learnt at all,
//! and QEMU's device save and write-protection start took 12.7 ms (median) against 7.2 ms without
//! it in the same hour. It is not used.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::pause::PauseClock;

/// The names QEMU gives its background-snapshot thread (`comm`, at most 15 bytes).
const NAMES: &[&str] = &["bg_snapshot", "mig/snapshot"];

/// How often the CPU time is read while a capture's setup runs.
const EVERY: Duration = Duration::from_micros(200);

/// The thread's `schedstat` file (its first field: CPU time used, in ns).
#[derive(Debug, Clone)]
pub(crate) struct SnapshotThread {
    schedstat: PathBuf,
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
                    return Some(SnapshotThread {
                        schedstat: entry.path().join("schedstat"),
                    });
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(EVERY);
        }
    }

    /// CPU time the thread has used, in ns; `None` once it is gone.
    pub(crate) fn cpu_ns(&self) -> Option<u64> {
        parse_schedstat(&std::fs::read_to_string(&self.schedstat).ok()?)
    }

    /// CPU time the thread has used and time it spent runnable but waiting for a CPU, in ns.
    fn cpu_and_wait_ns(&self) -> Option<(u64, u64)> {
        parse_schedstat_wait(&std::fs::read_to_string(&self.schedstat).ok()?)
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
                samples = samples.len(),
                first_sample_before_active_us =
                    ?samples.first().map(|&(t, _, _)| at_us as i64 - t as i64),
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
/// dropped, then under the policy it had before.
///
/// Why: a capture that sent `migrate` first waits a few ms for QEMU's snapshot thread before
/// it sends `stop`, and that `stop` must land before the thread's own. On a 2-core host both
/// QEMU's vCPU (TCG) and its snapshot thread keep a core busy then, and a waiting thread of
/// normal priority woke up to 4-6 ms late (traced: `stop` sent at 6.9-8.9 ms of the thread's CPU
/// against a target of 1.9-3.3 ms; each of those captures lost its race). The wait sleeps between
/// readings, so the policy costs nothing while it sleeps; it is held for one lead (at most a
/// second). Without the privilege (not root, `RLIMIT_RTPRIO` 0) nothing changes.
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
