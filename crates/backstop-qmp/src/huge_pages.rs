//! Gives a QEMU's guest RAM its transparent huge pages back after a background snapshot.
//!
//! Why: QEMU's background snapshot write-protects guest RAM with userfaultfd and lifts the
//! protection page by page as it saves each 4 KiB page. Lifting it from one small page of a
//! huge page makes the kernel split that huge page's mapping into 512 small ones, so after one
//! snapshot none of the guest's RAM is mapped huge any more, and nothing maps it huge again soon
//! (khugepaged scans a few MiB every 10 s). The next snapshot's write protection, which QEMU
//! starts inside the guest's pause, then walks 512 times as many entries: with a bare QMP client
//! (1 GiB guest, 400 MiB resident, TCG) the guest's pause went from 16-18 ms for a QEMU's first
//! snapshot to 50-59 ms for every later one on QEMU 10.0, and 18 → 50-73 ms on 7.2, with
//! `AnonHugePages` of the guest's RAM at 0 kB after the first; collapsing it before each
//! snapshot brought the later ones back to 16 ms (10.0) and 11-16 ms (7.2).
//!
//! What: after a capture, a thread asks the kernel to collapse (`process_madvise` with
//! `MADV_COLLAPSE`, Linux ≥ 6.1) every 2 MiB range of QEMU's large anonymous mappings whose
//! 512 pages are all resident and QEMU's own ([`collapsible`]). A range with a hole or with the
//! shared zero page in it is left alone: collapsing it would allocate memory the guest never
//! touched. So QEMU's resident memory does not grow, no byte the guest sees changes, and a kernel
//! that refuses leaves everything as it was. The next capture stops the thread ([`Regather::stop`])
//! before its pause begins, so it never competes with one. Until then it looks again every
//! [`REPEAT`]: memory the guest writes for the first time after a capture is mapped small too
//! (see below), and a later look collapses it before the next capture's pause walks it.
//!
//! That leaves the guest RAM the guest never wrote. QEMU's snapshot reads one byte of every
//! page of it before it starts (its pre-fault), which maps the shared zero page there page by
//! page, and after the first snapshot those ranges stay mapped by 512 small entries each; the
//! write protection walks them all inside the pause. Traced on QEMU 10.0 (1 GiB guest, the
//! backend test's idle guest): the write-protection start took 4.0-4.7 ms of every later
//! pause, against 0.04-0.1 ms when every range was mapped huge. [`HugePages::All`] (config
//! `vm.huge_pages = "all"`) collapses those ranges too: the guest's whole RAM becomes resident
//! (as with QEMU's `-mem-prealloc`), which is why it is not the default.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A huge page on x86-64, and what `MADV_COLLAPSE` works in.
const HUGE: u64 = 2 << 20;
const PAGE: u64 = 4096;
const PAGES_PER_HUGE: usize = (HUGE / PAGE) as usize;
/// `MADV_COLLAPSE` (include/uapi/asm-generic/mman-common.h; not in the libc crate yet).
const MADV_COLLAPSE: libc::c_int = 25;
/// Only mappings at least this large are looked at: guest RAM, not QEMU's own heap and stacks.
pub const MIN_MAPPING_BYTES: u64 = 64 << 20;
/// Ranges collapsed per `process_madvise` call; the stop flag is looked at between calls, so
/// this bounds how long [`Regather::stop`] (and so the next capture) can wait: ~0.5 ms per
/// range copied here, ~5 ms per range `all` allocates (its first pass: 2.5 s for 1 GiB).
const RANGES_PER_CALL: usize = 4;

/// `/proc/PID/pagemap` entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAP: u64 = 1 << 62;
const PM_EXCLUSIVE: u64 = 1 << 56;

/// Which ranges of guest RAM are mapped huge again after a capture (`vm.huge_pages`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HugePages {
    /// Only ranges whose pages the guest has all written ([`collapsible`]): QEMU's resident
    /// memory never grows.
    #[default]
    Resident,
    /// Every range that is not swapped out ([`fillable`]), the never-written ones too: the
    /// shortest pause, at the cost of the guest's whole RAM being resident.
    All,
}

impl HugePages {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::All => "all",
        }
    }

    /// The mode in effect for a capture whose pause does (`false`) or does not (`true`) hold
    /// QEMU's pre-fault of guest RAM. `All` pays only where the pre-fault runs before the pause
    /// (the QEMU backend on ≥ 9.0, `migrate` sent before `stop`): where it runs inside the
    /// pause, reading one byte of every page of a wholly resident RAM costs more than the
    /// write-protection start saves (bench, QEMU 7.2, 1 GiB: QEMU's setup 10-41 ms against 6-25
    /// ms with `resident`, the rest of the pause 2 ms shorter). There it falls back to
    /// `Resident`.
    pub fn effective(self, pre_fault_before_pause: bool) -> Self {
        match self {
            Self::All if !pre_fault_before_pause => Self::Resident,
            mode => mode,
        }
    }

    /// Whether a 2 MiB range with these 512 pagemap entries is collapsed in this mode.
    pub fn takes(self, entries: &[u64]) -> bool {
        match self {
            Self::Resident => collapsible(entries),
            Self::All => fillable(entries),
        }
    }
}

/// Whether a 2 MiB range, given its 512 pagemap entries, may be collapsed under
/// [`HugePages::All`]: any range none of whose pages is swapped out (a hole or the shared zero
/// page becomes zeroed memory of the guest's own; swapped pages stay where the host put them).
pub fn fillable(entries: &[u64]) -> bool {
    entries.len() == PAGES_PER_HUGE && entries.iter().all(|&e| e & PM_SWAP == 0)
}

/// Whether a 2 MiB range, given its 512 pagemap entries, can be collapsed without growing the
/// process: every page present in RAM (not swapped, not missing) and mapped by this process
/// alone. The shared zero page, which a read of never-written memory maps, is never exclusive,
/// so a range holding it is left alone as a range with a hole is.
pub fn collapsible(entries: &[u64]) -> bool {
    entries.len() == PAGES_PER_HUGE
        && entries
            .iter()
            .all(|&e| e & PM_PRESENT != 0 && e & PM_SWAP == 0 && e & PM_EXCLUSIVE != 0)
}

/// A mapping worth looking at, from `/proc/PID/smaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Resident and already huge-mapped bytes.
    pub rss: u64,
    pub anon_huge: u64,
}

/// One mapping of `/proc/PID/smaps`, with what decides whether it is looked at.
#[derive(Debug, Clone)]
struct SmapsEntry {
    mapping: Mapping,
    perms: String,
    path: String,
    thp_eligible: bool,
}

impl SmapsEntry {
    /// Private anonymous, readable and writable but not executable, and at least
    /// `min_bytes`: what guest RAM looks like. Not executable: under TCG, QEMU's translated
    /// code lives in a private anonymous `rwx` mapping as large as guest RAM (1 GiB here, huge
    /// pages advised), which is not the guest's memory; `all` would fill it with up to 1 GiB of
    /// memory of its own (seen on QEMU 10.0: its collapse failed part way, `EINVAL`).
    fn is_guest_ram_like(&self, min_bytes: u64) -> bool {
        let m = &self.mapping;
        m.end.saturating_sub(m.start) >= min_bytes && self.perms == "rw-p" && self.path.is_empty()
    }
}

/// Every mapping in the text of `/proc/PID/smaps`; lines that do not parse are skipped, never
/// guessed at.
fn parse_smaps(smaps: &str) -> Vec<SmapsEntry> {
    let mut out: Vec<SmapsEntry> = Vec::new();
    for line in smaps.lines() {
        if let Some((start, end, perms, path)) = mapping_header(line) {
            out.push(SmapsEntry {
                mapping: Mapping {
                    start,
                    end,
                    rss: 0,
                    anon_huge: 0,
                },
                perms: perms.to_string(),
                path: path.to_string(),
                thp_eligible: false,
            });
            continue;
        }
        let (Some(e), Some((key, value))) = (out.last_mut(), line.split_once(':')) else {
            continue;
        };
        let value = value.trim();
        match key {
            "Rss" => e.mapping.rss = kib(value),
            "AnonHugePages" => e.mapping.anon_huge = kib(value),
            "THPeligible" => e.thp_eligible = value == "1",
            _ => {}
        }
    }
    out
}

/// The private anonymous writable mappings of at least `min_bytes` that may hold huge pages
/// (`THPeligible: 1`) and hold memory that is not mapped huge: resident memory, or under
/// [`HugePages::All`] any of the mapping.
pub fn candidate_mappings(smaps: &str, min_bytes: u64, mode: HugePages) -> Vec<Mapping> {
    parse_smaps(smaps)
        .into_iter()
        .filter(|e| {
            let m = &e.mapping;
            e.is_guest_ram_like(min_bytes)
                && e.thp_eligible
                && match mode {
                    HugePages::Resident => m.rss > m.anon_huge,
                    HugePages::All => m.end - m.start > m.anon_huge,
                }
        })
        .map(|e| e.mapping)
        .collect()
}

/// Resident and huge-mapped bytes of `pid`'s guest-RAM-like mappings (private anonymous
/// writable, at least [`MIN_MAPPING_BYTES`]), summed; `None` if `/proc` cannot be read. For
/// the debug log only: reading `smaps` walks the page tables (0.4-1 ms of CPU at 1 GiB).
pub fn guest_ram_residency(pid: u32) -> Option<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let sum = parse_smaps(&smaps)
        .into_iter()
        .filter(|e| e.is_guest_ram_like(MIN_MAPPING_BYTES))
        .fold((0, 0), |(rss, huge), e| {
            (rss + e.mapping.rss, huge + e.mapping.anon_huge)
        });
    Some(sum)
}

/// `start-end perms offset dev inode [path]` → (start, end, perms, path).
fn mapping_header(line: &str) -> Option<(u64, u64, &str, &str)> {
    let mut f = line.splitn(6, ' ');
    let (range, perms) = (f.next()?, f.next()?);
    let (_offset, dev, _inode) = (f.next()?, f.next()?, f.next()?);
    // Field lines ("Rss:   12 kB") have no range; a device is "fd:01".
    let (a, b) = range.split_once('-')?;
    if !dev.contains(':') || perms.len() != 4 {
        return None;
    }
    let start = u64::from_str_radix(a, 16).ok()?;
    let end = u64::from_str_radix(b, 16).ok()?;
    Some((start, end, perms, f.next().unwrap_or("").trim()))
}

fn kib(value: &str) -> u64 {
    value
        .strip_suffix("kB")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(0, |k| k * 1024)
}

/// The 2 MiB-aligned ranges inside `[start, end)`, grouped into runs of adjacent ones `mode`
/// takes, given a way to fill a slice with the pagemap entries of the pages from an address.
fn collapsible_ranges(
    start: u64,
    end: u64,
    mode: HugePages,
    mut read: impl FnMut(u64, &mut [u64]) -> std::io::Result<()>,
) -> std::io::Result<Vec<(u64, u64)>> {
    let first = start.div_ceil(HUGE) * HUGE;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    // 64 huge pages' entries (256 KiB of pagemap) per read.
    const WINDOWS: usize = 64;
    let mut buf = vec![0u64; PAGES_PER_HUGE * WINDOWS];
    let mut at = first;
    while at + HUGE <= end {
        let n = (((end - at) / HUGE) as usize).min(WINDOWS);
        let entries = &mut buf[..n * PAGES_PER_HUGE];
        read(at, entries)?;
        for (i, w) in entries.chunks(PAGES_PER_HUGE).enumerate() {
            if !mode.takes(w) {
                continue;
            }
            let addr = at + i as u64 * HUGE;
            match runs.last_mut() {
                Some((s, len)) if *s + *len == addr => *len += HUGE,
                _ => runs.push((addr, HUGE)),
            }
        }
        at += n as u64 * HUGE;
    }
    Ok(runs)
}

/// How long a running [`Regather`] waits between passes, after its first. Memory the guest
/// writes for the first time after a capture lands in ranges QEMU's pre-fault mapped page by
/// page (the shared zero page), so it is mapped small too, and stays so until a pass collapses
/// it. Traced on QEMU 10.0 (bench, 1 GiB guest): a guest that wrote 400 MiB after the daemon's
/// first capture had 430 MiB of it mapped small at its next capture, which paused the guest 22-32
/// ms against 12-17 ms for the one after it, taken once a pass had collapsed it. A pass that finds
/// no more small memory than the last one left reads nothing else (its `smaps` read: 0.4-1 ms of
/// CPU for a 1 GiB mapping held by small entries, measured here).
pub const REPEAT: Duration = Duration::from_secs(5);

/// What one pass did, or all passes of a [`Regather`] together.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// Bytes in ranges that qualified, and bytes the kernel reported advised.
    pub eligible_bytes: u64,
    pub collapsed_bytes: u64,
    /// Passes that looked at the pagemap (a pass with nothing new to collapse does not).
    pub passes: u32,
    /// Stopped early by [`Regather::stop`].
    pub stopped: bool,
    pub elapsed: Duration,
    /// Why the pass ended before its end (unreadable `/proc`, a kernel without the call, ...).
    pub error: Option<String>,
}

impl Outcome {
    fn add(&mut self, pass: &Outcome) {
        self.eligible_bytes += pass.eligible_bytes;
        self.collapsed_bytes += pass.collapsed_bytes;
        self.passes += pass.passes;
        self.stopped |= pass.stopped;
        self.elapsed += pass.elapsed;
        if pass.error.is_some() {
            self.error.clone_from(&pass.error);
        }
    }
}

/// Passes over a process's memory on their own thread: one, or (from [`Regather::start`]) one
/// and then another every [`REPEAT`] until stopped.
pub struct Regather {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Outcome>>,
}

impl Regather {
    /// Passes over `pid`'s mappings of at least [`MIN_MAPPING_BYTES`], one now and one every
    /// [`REPEAT`] until [`Self::stop`]ped (or the process is gone).
    pub fn start(pid: u32, mode: HugePages) -> Self {
        Self::spawn(pid, MIN_MAPPING_BYTES, mode, Some(REPEAT))
    }

    /// One pass over `pid`'s mappings of at least [`MIN_MAPPING_BYTES`] ([`Self::wait`] for it).
    pub fn once(pid: u32, mode: HugePages) -> Self {
        Self::spawn(pid, MIN_MAPPING_BYTES, mode, None)
    }

    /// One pass over `pid`'s mappings of at least `min_bytes`.
    pub fn start_with(pid: u32, min_bytes: u64, mode: HugePages) -> Self {
        Self::spawn(pid, min_bytes, mode, None)
    }

    fn spawn(pid: u32, min_bytes: u64, mode: HugePages, repeat: Option<Duration>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("huge-pages".into())
            .spawn(move || passes(pid, min_bytes, mode, repeat, &flag))
            .ok();
        Self { stop, thread }
    }

    /// Asks the passes to stop after the current call and waits for them (one call: a few ms).
    pub fn stop(mut self) -> Outcome {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
        self.join()
    }

    /// Stops the passes held in `slot`, if any (both backends keep one per QEMU), and logs what
    /// they did.
    pub fn stop_in(slot: &mut Option<Regather>) {
        if let Some(pass) = slot.take() {
            let outcome = pass.stop();
            tracing::debug!(?outcome, "huge-page pass stopped");
        }
    }

    /// Waits for a single pass ([`Self::once`], [`Self::start_with`]) to end by itself.
    pub fn wait(mut self) -> Outcome {
        self.join()
    }

    fn join(&mut self) -> Outcome {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(o)) => o,
            Some(Err(_)) => Outcome {
                error: Some("the huge-pages thread panicked".into()),
                ..Outcome::default()
            },
            None => Outcome {
                error: Some("the huge-pages thread could not be started".into()),
                ..Outcome::default()
            },
        }
    }
}

impl Drop for Regather {
    fn drop(&mut self) {
        // Never blocks a drop on it: the thread ends at its next look at the flag.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

/// The body of a [`Regather`]'s thread: its passes, until one fails, it is stopped, or (with
/// no `repeat`) after the first. The process is held by a pidfd from the start, so a pid
/// reused after QEMU's exit is never advised: the call fails and the passes end.
fn passes(
    pid: u32,
    min_bytes: u64,
    mode: HugePages,
    repeat: Option<Duration>,
    stop: &AtomicBool,
) -> Outcome {
    let mut total = Outcome::default();
    let pidfd = match pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            total.error = Some(format!("pidfd_open({pid}): {e}"));
            log(pid, &total, true);
            return total;
        }
    };
    // Bytes not mapped huge that the last pass left (it could not collapse them).
    let mut left_small = None;
    for first in std::iter::once(true).chain(std::iter::repeat(false)) {
        let t0 = Instant::now();
        let mut o = Outcome::default();
        match pass(pid, &pidfd, min_bytes, mode, stop, &mut o, left_small) {
            Ok(small) => left_small = Some(small.saturating_sub(o.collapsed_bytes)),
            Err(e) => o.error = Some(e),
        }
        o.elapsed = t0.elapsed();
        if first || o.collapsed_bytes > 0 || o.error.is_some() {
            log(pid, &o, first);
        }
        total.add(&o);
        let Some(every) = repeat.filter(|_| o.error.is_none() && !o.stopped) else {
            break;
        };
        let until = Instant::now() + every;
        while !stop.load(Ordering::SeqCst) {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            std::thread::park_timeout(left);
        }
        if stop.load(Ordering::SeqCst) {
            total.stopped = true;
            break;
        }
    }
    total
}

/// A kernel that cannot do it is said once per daemon, not at every snapshot.
static WARNED: AtomicBool = AtomicBool::new(false);

/// One pass's outcome; a failure is a warning (once) only for a first pass: a later one fails
/// when QEMU has exited, which its owner reports.
fn log(pid: u32, o: &Outcome, first: bool) {
    let mib = |b: u64| b >> 20;
    match &o.error {
        Some(e) if first && !WARNED.swap(true, Ordering::SeqCst) => tracing::warn!(
            pid,
            error = %e,
            "cannot collapse the guest RAM's huge pages again after a snapshot; later snapshots \
             pause the guest longer (said once)"
        ),
        Some(e) => tracing::debug!(pid, error = %e, "huge-page pass failed"),
        None => tracing::debug!(
            pid,
            eligible_mib = mib(o.eligible_bytes),
            collapsed_mib = mib(o.collapsed_bytes),
            stopped = o.stopped,
            elapsed_ms = o.elapsed.as_millis() as u64,
            first,
            "huge-page pass done"
        ),
    }
}

/// The bytes of a candidate mapping a pass could map huge: resident ones not mapped huge, or
/// under [`HugePages::All`] any not mapped huge.
fn not_huge(m: &Mapping, mode: HugePages) -> u64 {
    match mode {
        HugePages::Resident => m.rss.saturating_sub(m.anon_huge),
        HugePages::All => (m.end - m.start).saturating_sub(m.anon_huge),
    }
}

/// One pass; the bytes its candidates held not mapped huge when it began. With `left_small`
/// (what the last pass could not collapse), a pass that finds less than one huge page more
/// than that reads no pagemap.
fn pass(
    pid: u32,
    pidfd: &OwnedFd,
    min_bytes: u64,
    mode: HugePages,
    stop: &AtomicBool,
    out: &mut Outcome,
    left_small: Option<u64>,
) -> Result<u64, String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .map_err(|e| format!("read /proc/{pid}/smaps: {e}"))?;
    let mappings = candidate_mappings(&smaps, min_bytes, mode);
    let small: u64 = mappings.iter().map(|m| not_huge(m, mode)).sum();
    if mappings.is_empty() || left_small.is_some_and(|left| small < left + HUGE) {
        return Ok(small);
    }
    out.passes += 1;
    let mut pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| format!("open /proc/{pid}/pagemap: {e}"))?;
    for m in mappings {
        let runs = collapsible_ranges(m.start, m.end, mode, |addr, entries| {
            read_pagemap(&mut pagemap, addr, entries)
        })
        .map_err(|e| format!("read /proc/{pid}/pagemap: {e}"))?;
        let ranges: Vec<(u64, u64)> = runs
            .iter()
            .flat_map(|&(s, len)| (0..len / HUGE).map(move |i| (s + i * HUGE, HUGE)))
            .collect();
        out.eligible_bytes += ranges.len() as u64 * HUGE;
        for batch in ranges.chunks(RANGES_PER_CALL) {
            if stop.load(Ordering::SeqCst) {
                out.stopped = true;
                return Ok(small);
            }
            match collapse(pidfd, batch) {
                Ok(n) => out.collapsed_bytes += n,
                // A page busy or locked at that moment: the next pass tries again.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
                // A range that changed under us (freed, remapped): skip it.
                Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {}
                Err(e) => return Err(format!("process_madvise(MADV_COLLAPSE): {e}")),
            }
        }
    }
    Ok(small)
}

fn read_pagemap(f: &mut File, addr: u64, entries: &mut [u64]) -> std::io::Result<()> {
    let mut bytes = vec![0u8; entries.len() * 8];
    f.seek(SeekFrom::Start(addr / PAGE * 8))?;
    f.read_exact(&mut bytes)?;
    for (e, b) in entries.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(b);
        *e = u64::from_ne_bytes(word);
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new file descriptor or -1; no
    // memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// `process_madvise(MADV_COLLAPSE)` over `ranges` of the process behind `pidfd`; the bytes
/// advised.
fn collapse(pidfd: &OwnedFd, ranges: &[(u64, u64)]) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let iov: Vec<libc::iovec> = ranges
        .iter()
        .map(|&(s, len)| libc::iovec {
            iov_base: s as *mut libc::c_void,
            iov_len: len as usize,
        })
        .collect();
    // SAFETY: process_madvise(2) reads `iov.len()` iovecs from `iov`, which lives until the call
    // returns; the addresses in them are the other process's and are never dereferenced here.
    let n = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            pidfd.as_raw_fd(),
            iov.as_ptr(),
            iov.len(),
            MADV_COLLAPSE,
            0u32,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: u64 = PM_PRESENT | PM_EXCLUSIVE | 0x1234;

    #[test]
    fn only_wholly_resident_private_ranges_collapse() {
        assert!(collapsible(&[OWN; PAGES_PER_HUGE]));
        let mut hole = [OWN; PAGES_PER_HUGE];
        hole[511] = 0;
        assert!(!collapsible(&hole), "a missing page");
        let mut zero = [OWN; PAGES_PER_HUGE];
        zero[7] = PM_PRESENT | 0x99; // the shared zero page: present, not exclusive
        assert!(!collapsible(&zero), "the zero page");
        let mut swapped = [OWN; PAGES_PER_HUGE];
        swapped[0] = PM_PRESENT | PM_SWAP | PM_EXCLUSIVE;
        assert!(!collapsible(&swapped), "a swapped page");
        assert!(!collapsible(&[OWN; 511]), "not a whole huge page");
    }

    const SMAPS: &str = "\
55d0c0a00000-55d0c0b00000 r-xp 00000000 fd:01 1234                       /usr/bin/qemu-system-x86_64
Size:               1024 kB
Rss:                1024 kB
AnonHugePages:         0 kB
THPeligible:    0
7f74d3e00000-7f7513e00000 rw-p 00000000 00:00 0 
Size:            1048576 kB
Rss:              518144 kB
AnonHugePages:         0 kB
THPeligible:    1
7f7600000000-7f7604000000 rw-p 00000000 00:00 0 
Size:              65536 kB
Rss:               65536 kB
AnonHugePages:     65536 kB
THPeligible:    1
7f7700000000-7f7708000000 rw-s 00000000 00:01 77                         /memfd:ram (deleted)
Size:             131072 kB
Rss:              131072 kB
AnonHugePages:         0 kB
THPeligible:    1
7f7800000000-7f7801000000 rw-p 00000000 00:00 0 
Size:              16384 kB
Rss:               16384 kB
AnonHugePages:         0 kB
THPeligible:    1
7f7900000000-7f7910000000 rw-p 00000000 00:00 0 
Size:             262144 kB
Rss:              262144 kB
AnonHugePages:         0 kB
THPeligible:    0
";

    #[test]
    fn guest_ram_is_the_candidate() {
        let m = candidate_mappings(SMAPS, MIN_MAPPING_BYTES, HugePages::Resident);
        // Not: the binary (file, r-x), the all-huge one, the shared memfd, the small one, the
        // one the kernel would not give huge pages.
        assert_eq!(
            m,
            vec![Mapping {
                start: 0x7f74d3e00000,
                end: 0x7f7513e00000,
                rss: 518144 * 1024,
                anon_huge: 0,
            }]
        );
        assert!(candidate_mappings("garbage\n: :\n1-2 x\n", 0, HugePages::Resident).is_empty());
        // `all` looks at the same mappings here (the all-huge one has nothing left to do).
        assert_eq!(
            candidate_mappings(SMAPS, MIN_MAPPING_BYTES, HugePages::All),
            m
        );
    }

    /// QEMU 10.0 under TCG (smaps of a bench run): guest RAM, and the translated code's buffer of
    /// nearly the same size, executable, huge pages advised.
    #[test]
    fn tcgs_code_buffer_is_not_guest_ram() {
        let smaps = "\
7f6743e00000-7f6783e00000 rw-p 00000000 00:00 0 
Size:            1048576 kB
Rss:              516436 kB
AnonHugePages:    296960 kB
THPeligible:           1
VmFlags: rd wr mr mw me uw dc ac hg mg
7f6784000000-7f67c3fff000 rwxp 00000000 00:00 0 
Size:            1048572 kB
Rss:               57344 kB
AnonHugePages:         0 kB
THPeligible:           1
VmFlags: rd wr ex mr mw me ac hg
";
        for mode in [HugePages::Resident, HugePages::All] {
            let m = candidate_mappings(smaps, MIN_MAPPING_BYTES, mode);
            assert_eq!(m.len(), 1, "{mode:?}: {m:?}");
            assert_eq!(m[0].start, 0x7f6743e00000, "{mode:?}");
        }
    }

    #[test]
    fn all_takes_holes_and_the_zero_page_but_never_swapped_pages() {
        let mut mixed = [OWN; PAGES_PER_HUGE];
        mixed[3] = 0; // a hole
        mixed[9] = PM_PRESENT | 0x99; // the shared zero page
        assert!(fillable(&mixed) && HugePages::All.takes(&mixed));
        assert!(!HugePages::Resident.takes(&mixed));
        assert!(fillable(&[0; PAGES_PER_HUGE]), "never touched at all");
        let mut swapped = [OWN; PAGES_PER_HUGE];
        swapped[100] = PM_SWAP;
        assert!(!fillable(&swapped), "a swapped page stays swapped");
        assert!(!fillable(&[0; 511]), "not a whole huge page");
        assert!(HugePages::Resident.takes(&[OWN; PAGES_PER_HUGE]));
        assert_eq!(HugePages::default(), HugePages::Resident);
        // `all` only where QEMU's pre-fault runs before the pause.
        assert_eq!(HugePages::All.effective(true), HugePages::All);
        assert_eq!(HugePages::All.effective(false), HugePages::Resident);
        assert_eq!(HugePages::Resident.effective(true), HugePages::Resident);
    }

    #[test]
    fn a_mapping_with_no_resident_small_pages_is_a_candidate_only_under_all() {
        let smaps = "\
7f74d3e00000-7f7513e00000 rw-p 00000000 00:00 0 
Size:            1048576 kB
Rss:              524288 kB
AnonHugePages:    524288 kB
THPeligible:    1
";
        assert!(candidate_mappings(smaps, MIN_MAPPING_BYTES, HugePages::Resident).is_empty());
        assert_eq!(
            candidate_mappings(smaps, MIN_MAPPING_BYTES, HugePages::All).len(),
            1
        );
    }

    #[test]
    fn runs_of_collapsible_ranges_from_the_pagemap() {
        // An unaligned mapping of 6 huge pages plus change: windows 1, 2 and 4 qualify.
        let start = 3 * HUGE - PAGE;
        let end = 9 * HUGE + PAGE;
        let good = [3 * HUGE, 4 * HUGE, 6 * HUGE];
        let mut reads = 0;
        let runs = collapsible_ranges(start, end, HugePages::Resident, |addr, entries| {
            reads += 1;
            for (i, e) in entries.iter_mut().enumerate() {
                let page = addr + i as u64 * PAGE;
                let window = page / HUGE * HUGE;
                *e = if good.contains(&window) { OWN } else { 0 };
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(runs, vec![(3 * HUGE, 2 * HUGE), (6 * HUGE, HUGE)]);
        assert_eq!(reads, 1);
    }

    /// A fresh private anonymous mapping of `len` bytes plus one huge page, and its first
    /// 2 MiB boundary, from which `len` bytes are advised huge; `None` (the test skips) where
    /// transparent huge pages are off. The caller unmaps `len + HUGE` bytes at the base.
    fn huge_advised(len: usize) -> Option<(*mut libc::c_void, u64)> {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !thp.contains("[always]") && !thp.contains("[madvise]") {
            eprintln!("SKIPPED: transparent huge pages are off on this host ({thp:?})");
            return None;
        }
        // SAFETY: a fresh private anonymous mapping, nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + HUGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let aligned = (base as u64).div_ceil(HUGE) * HUGE;
        // SAFETY: madvise(2) on [aligned, aligned + len), inside the mapping above.
        let advised = unsafe { libc::madvise(aligned as *mut _, len, libc::MADV_HUGEPAGE) };
        assert_eq!(advised, 0);
        Some((base, aligned))
    }

    /// Splits the mapping of each of the `n` huge pages from `aligned`: the write right of its
    /// small page `page` taken and given back (what lifting a userfaultfd write protection page
    /// by page does).
    fn split_each(aligned: u64, n: u64, page: u64) {
        for i in 0..n {
            let p = (aligned + i * HUGE + page * PAGE) as *mut libc::c_void;
            // SAFETY: one page inside a mapping made by `huge_advised`.
            unsafe {
                assert_eq!(libc::mprotect(p, PAGE as usize, libc::PROT_READ), 0);
                assert_eq!(
                    libc::mprotect(p, PAGE as usize, libc::PROT_READ | libc::PROT_WRITE),
                    0
                );
            }
        }
    }

    /// Against the running kernel: memory of this process whose huge pages were split is
    /// collapsed again, and a range with a hole is not filled in.
    #[test]
    fn a_split_huge_page_is_collapsed_and_a_hole_is_not_filled() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let len = 16 * HUGE as usize;
        let Some((base, aligned)) = huge_advised(len) else {
            return;
        };
        // SAFETY: [aligned, aligned + len) lies inside the mapping `huge_advised` made; it is
        // unmapped at the end of the test and only touched through `mem` within its length.
        let mem = unsafe { std::slice::from_raw_parts_mut(aligned as *mut u8, len) };
        // Every huge page written whole, then the second half of the last one given back to
        // the kernel: a hole (a write fault in a huge-page mapping takes a whole huge page).
        let written = len - HUGE as usize / 2;
        mem.fill(0x5a);
        let hole = (aligned + written as u64) as *mut libc::c_void;
        // SAFETY: madvise(2) on the last MiB of the mapping above; `mem` is not read there
        // until the end, where it reads zero as a discarded anonymous page does.
        let discarded = unsafe { libc::madvise(hole, HUGE as usize / 2, libc::MADV_DONTNEED) };
        assert_eq!(discarded, 0);
        // Split every huge page's mapping: take the write right from one small page of each
        // and give it back (what lifting a userfaultfd write protection page by page does).
        split_each(aligned, 16, 5);
        let ours = |smaps: &str| {
            parse_smaps(smaps)
                .into_iter()
                .map(|e| e.mapping)
                .find(|m| m.start <= aligned && aligned < m.end)
        };
        let me = std::process::id();
        let before = ours(&std::fs::read_to_string("/proc/self/smaps").unwrap())
            .expect("our mapping, split");
        assert!(
            before.anon_huge < 15 * HUGE,
            "the mprotect round trip should have split the huge pages: {before:?}"
        );
        assert_eq!(before.rss, len as u64 - HUGE / 2, "the hole: {before:?}");
        let outcome = Regather::start_with(me, 8 * HUGE, HugePages::Resident).wait();
        assert_eq!(outcome.eligible_bytes, 15 * HUGE, "{outcome:?}");
        if let Some(e) = outcome
            .error
            .as_deref()
            .filter(|e| e.contains("EPERM") || e.contains("not permitted"))
        {
            eprintln!("SKIPPED: process_madvise needs CAP_SYS_NICE (run as root): {e}");
            return;
        }
        assert_eq!(outcome.error, None, "{outcome:?}");
        let after = ours(&std::fs::read_to_string("/proc/self/smaps").unwrap()).expect("mapping");
        assert!(
            after.anon_huge >= 15 * HUGE,
            "the 15 whole huge pages should be huge again: {after:?} ({outcome:?})"
        );
        assert!(
            after.rss <= before.rss,
            "collapsing must not fill the hole: {before:?} -> {after:?}"
        );
        assert!(mem[..written].iter().all(|&b| b == 0x5a), "contents kept");
        assert!(
            mem[written..].iter().all(|&b| b == 0),
            "the hole still reads zero"
        );
        // `all` fills the last huge page too: all 16 mapped huge, nothing the process sees
        // changed.
        let outcome = Regather::start_with(me, 8 * HUGE, HugePages::All).wait();
        assert_eq!(outcome.error, None, "{outcome:?}");
        let filled = ours(&std::fs::read_to_string("/proc/self/smaps").unwrap()).expect("mapping");
        assert_eq!(filled.anon_huge, 16 * HUGE, "{filled:?} ({outcome:?})");
        assert!(mem[..written].iter().all(|&b| b == 0x5a), "contents kept");
        assert!(
            mem[written..].iter().all(|&b| b == 0),
            "the hole reads zero"
        );
        // SAFETY: the mapping made above, no reference into it left.
        unsafe { libc::munmap(base, len + HUGE as usize) };
    }

    /// The tests that collapse this process's own memory, one at a time: a pass takes every
    /// large mapping, another test's too, and could collapse what that test split on purpose.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A running regather looks again every so often: small pages that appear after its first
    /// pass (memory the guest writes for the first time, in ranges QEMU's pre-fault mapped
    /// small) are collapsed by a later pass, and stopping it does not wait out its period.
    #[test]
    fn a_running_regather_collapses_small_pages_that_appear_after_its_first_pass() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let len = 8 * HUGE as usize;
        let Some((base, aligned)) = huge_advised(len) else {
            return;
        };
        // SAFETY: [aligned, aligned + len) lies inside the mapping `huge_advised` made; it is
        // unmapped at the end of the test and only touched through `mem` within its length.
        let mem = unsafe { std::slice::from_raw_parts_mut(aligned as *mut u8, len) };
        let ours = || {
            parse_smaps(&std::fs::read_to_string("/proc/self/smaps").unwrap())
                .into_iter()
                .map(|e| e.mapping)
                .find(|m| m.start <= aligned && aligned < m.end)
                .expect("our mapping")
        };
        let me = std::process::id();
        // Started on memory that holds nothing yet, looking again every 10 ms (soon enough that
        // khugepaged, which may collapse the same memory on its own scan, seldom comes first:
        // once in a CI run at 50 ms, when no look of the regather's found anything to do).
        let running = Regather::spawn(
            me,
            4 * HUGE,
            HugePages::Resident,
            Some(Duration::from_millis(10)),
        );
        std::thread::sleep(Duration::from_millis(200));
        // Now written, and every huge page's mapping split (one small page's write right
        // taken and given back, as lifting a write protection page by page does).
        mem.fill(0x33);
        split_each(aligned, 8, 7);
        let split = ours();
        let t0 = Instant::now();
        let mut now = split.clone();
        while now.anon_huge < 8 * HUGE && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
            now = ours();
        }
        let stopping = Instant::now();
        let outcome = running.stop();
        let stop_took = stopping.elapsed();
        if let Some(e) = outcome
            .error
            .as_deref()
            .filter(|e| e.contains("EPERM") || e.contains("not permitted"))
        {
            eprintln!("SKIPPED: process_madvise needs CAP_SYS_NICE (run as root): {e}");
            return;
        }
        assert_eq!(outcome.error, None, "{outcome:?}");
        assert!(
            split.anon_huge < 8 * HUGE,
            "the mprotect round trip should have split the huge pages: {split:?}"
        );
        assert!(
            now.anon_huge >= 8 * HUGE,
            "a later pass should have collapsed them within 10 s: {split:?} -> {now:?} \
             ({outcome:?})"
        );
        assert!(outcome.stopped, "{outcome:?}");
        assert!(
            outcome.collapsed_bytes >= 8 * HUGE,
            "the collapse should be the regather's: {outcome:?}"
        );
        assert!(
            stop_took < Duration::from_secs(2),
            "stopping waited {stop_took:?}"
        );
        assert!(mem.iter().all(|&b| b == 0x33), "contents kept");
        // A pass that waits an hour between looks still stops at once.
        let idle = Regather::spawn(
            me,
            4 * HUGE,
            HugePages::Resident,
            Some(Duration::from_secs(3600)),
        );
        std::thread::sleep(Duration::from_millis(100));
        let stopping = Instant::now();
        let outcome = idle.stop();
        assert!(
            stopping.elapsed() < Duration::from_secs(2),
            "stopping an idle regather waited {:?} ({outcome:?})",
            stopping.elapsed()
        );
        // SAFETY: the mapping made above, no reference into it left.
        unsafe { libc::munmap(base, len + HUGE as usize) };
    }
}
