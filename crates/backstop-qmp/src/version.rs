//! Which QEMU this is and how a capture must be driven on it. Pure functions, unit-tested.
//!
//! What differs between the supported versions (read in QEMU's `migration/migration.c`,
//! measured on 7.2 and 10.0):
//! * 7.2 and 8.x: a background snapshot's thread resumes the VM with `vm_start()` once device
//!   state is saved and write tracking is on, whatever the run state was before. So `stop` →
//!   disk switch → `migrate` is resumed by QEMU itself (and a guest the operator paused is
//!   resumed too: backstop pauses it again at once).
//! * 9.0 and later: the thread calls `vm_resume(vm_old_state)`, so a VM stopped before
//!   `migrate` stays paused. backstop resumes it itself, but only once write tracking is on:
//!   the `MIGRATION` event `active` comes *before* the thread stops the VM and starts tracking,
//!   and a `cont` in that window would let the guest run between the disk switch and the RAM
//!   instant. The first RAM page counted by `query-migrate` is written after tracking started
//!   (and after the thread scheduled its own resume), so that is the signal.

use std::fmt;

/// `query-version`'s `qemu` triple.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QemuVersion {
    pub major: u64,
    pub minor: u64,
    pub micro: u64,
}

impl fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

impl QemuVersion {
    /// From `query-version`'s reply (`{"qemu": {"major": .., "minor": .., "micro": ..}, ..}`).
    pub fn from_query(reply: &serde_json::Value) -> Option<QemuVersion> {
        let q = reply.get("qemu")?;
        Some(QemuVersion {
            major: q.get("major")?.as_u64()?,
            minor: q.get("minor")?.as_u64()?,
            micro: q.get("micro")?.as_u64()?,
        })
    }
}

/// The versions backstop is built and tested against: 7.2 up to (not including) 11.0.
pub const SUPPORTED: &str = "7.2 through 10.x";

/// Who resumes a guest that backstop stopped for the capture instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// QEMU's snapshot thread resumes it (`vm_start()`, 7.2 and 8.x).
    ByQemu,
    /// QEMU keeps it paused (≥ 9.0): backstop sends `cont` once write tracking is on.
    AfterWriteTracking,
}

/// How a capture is driven on one QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapturePlan {
    pub version: QemuVersion,
    pub resume: Resume,
}

/// `vm.capture_order`: whether a capture may send `migrate` before `stop` (with the lead
/// [`SetupTimes`] learns), per QEMU version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CaptureOrder {
    /// `migrate` first where QEMU keeps a stopped guest stopped (≥ 9.0), `stop` first on
    /// 7.2/8.x.
    #[default]
    Auto,
    /// `migrate` first on every version. On 7.2/8.x QEMU's snapshot thread resumes the guest
    /// itself as soon as its write tracking is on, which may come before backstop's disk
    /// switch answered: such a capture is discarded with the switch kept
    /// ([`crate::QemuBackend`] returns `BackendError::SwitchedAfterResume`) and the caller
    /// takes it again, `stop` first.
    MigrateFirst,
    /// Never: `stop`, disk switch, `migrate` (QEMU's setup inside the pause).
    StopFirst,
}

impl CaptureOrder {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::MigrateFirst => "migrate-first",
            Self::StopFirst => "stop-first",
        }
    }

    /// Whether captures on a QEMU resumed this way may send `migrate` first.
    pub fn allows_lead(self, resume: Resume) -> bool {
        match self {
            Self::Auto => resume == Resume::AfterWriteTracking,
            Self::MigrateFirst => true,
            Self::StopFirst => false,
        }
    }
}

/// Decides the capture sequence for a QEMU from its version and its migration capabilities
/// (the names `query-migrate-capabilities` lists). An error is one line naming the version and
/// what is supported.
pub fn capture_plan(version: QemuVersion, capabilities: &[&str]) -> Result<CapturePlan, String> {
    let v = (version.major, version.minor);
    let resume = if !((7, 2)..(11, 0)).contains(&v) {
        return Err(format!(
            "QEMU {version} is not supported (backstop supports QEMU {SUPPORTED})"
        ));
    } else if v < (9, 0) {
        Resume::ByQemu
    } else {
        Resume::AfterWriteTracking
    };
    for needed in ["background-snapshot", "events"] {
        if !capabilities.contains(&needed) {
            return Err(format!(
                "QEMU {version} lacks the migration capability {needed:?} (backstop supports QEMU {SUPPORTED})"
            ));
        }
    }
    Ok(CapturePlan { version, resume })
}

/// Whether `query-migrate`'s reply shows that RAM pages are being written, which QEMU's
/// background snapshot only does after write tracking started (or that it already ended).
pub fn write_tracking_on(query_migrate: &serde_json::Value) -> bool {
    let status = query_migrate
        .get("status")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("");
    if matches!(status, "completed") {
        return true;
    }
    let ram = query_migrate.get("ram");
    let pages = |k: &str| {
        ram.and_then(|r| r.get(k))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    // Either count alone says pages are being written; adding them could overflow (a panic in
    // debug builds) on a reply claiming u64::MAX pages.
    status == "active" && (pages("normal") > 0 || pages("duplicate") > 0)
}

/// On ≥ 9.0 a guest backstop stops itself stays stopped through QEMU's snapshot (see the
/// module's notes), so `migrate` can go in *before* `stop`: QEMU's snapshot thread first reads
/// one byte of every page of guest RAM (`ram_write_tracking_prepare`, without the big lock:
/// ~8–25 ms at 1 GiB here, most of the old pause) while the guest still runs, and backstop's
/// `stop` lands during it. The pause then holds only the rest of QEMU's setup, the disk switch,
/// device state and the write-protection start. If QEMU's thread reaches its own stop first,
/// the RAM instant was taken on a running guest before the disks switched: that capture is
/// read out and discarded, and the capture runs again `stop` first.
///
/// How long after `migrate` to send `stop`: three quarters of the shortest of the last
/// [`Self::KEEP`] times from `migrate` to QEMU's `MIGRATION` `active` on this QEMU (at least
/// two of them), or half of it while one of the last [`Self::KEEP`] captures sent this way
/// lost the race; not counting
/// the QEMU's first capture (which also builds the page tables of never-touched RAM: 2–3x the
/// later ones). That time varies with the host's load (1.5–3.8 ms at 1 GiB with little RAM in
/// use, 8–25 ms with 400 MiB resident, 35–80 ms in a slow hour, measured here), and whatever
/// of it the lead leaves is inside the pause: with half, 3.8–25 ms of it stayed there in a
/// bench run. A lead that overshoots costs one discarded capture (the guest runs meanwhile,
/// then pauses for the capture taken again), so after a loss the margin widens to half until
/// that loss ages out; the lost capture's (shorter) time also shortens the next lead. Under
/// [`Self::MIN_LEAD`] (a small guest) `stop` goes first: the gain is a millisecond or two, the
/// risk the same.
#[derive(Debug, Clone, Default)]
pub struct SetupTimes {
    recent: std::collections::VecDeque<u64>,
    /// The outcome of the last captures sent `migrate` first: `true` for a lost race.
    races: std::collections::VecDeque<bool>,
    /// The QEMU's first capture was seen (and not counted).
    first_seen: bool,
    /// CPU time QEMU's snapshot thread had used by `active`, in µs, of the captures whose
    /// thread was watched (`snapshot_thread.rs`), the QEMU's first not counted.
    recent_cpu: std::collections::VecDeque<u64>,
    /// Those of captures sent `migrate` first (the guest running through QEMU's setup),
    /// won or lost: such a setup used 1.5-2.5x the CPU of one with the guest stopped (measured on
    /// QEMU 10.0, 1 GiB: 6.9-9.1 ms against 3.1-4.6 ms on the same QEMU), so a target learnt from
    /// `stop`-first captures alone sends `stop` less than half way through.
    recent_led_cpu: std::collections::VecDeque<u64>,
    /// From backstop's `stop` to QEMU's `STOP`, in µs, of the last captures: QEMU's snapshot
    /// thread runs on for that long after `stop` is sent (0.55-1.6 ms under TCG on 2 cores,
    /// measured), so the CPU figure to send `stop` at is at least that far below the least.
    recent_stop_latency: std::collections::VecDeque<u64>,
}

impl SetupTimes {
    /// How many captures' setup times are remembered.
    pub const KEEP: usize = 8;
    /// Below this a lead is not worth a discarded capture's risk.
    pub const MIN_LEAD: std::time::Duration = std::time::Duration::from_millis(3);

    /// The CPU time QEMU's snapshot thread used from `migrate` to `active` in one capture,
    /// in µs. Called before [`Self::record`] of the same capture (the QEMU's first is skipped).
    pub fn record_cpu(&mut self, cpu_us: u64) {
        if self.first_seen {
            keep_last(&mut self.recent_cpu, cpu_us);
        }
    }

    /// The remembered CPU times, oldest first, in µs.
    pub fn recent_cpu_us(&self) -> impl Iterator<Item = u64> + '_ {
        self.recent_cpu.iter().copied()
    }

    /// The CPU time QEMU's snapshot thread used from `migrate` to `active` in one capture
    /// whose `migrate` went in while the guest ran (won or lost), in µs.
    /// Counted among all captures' too ([`Self::recent_cpu_us`]); the QEMU's first capture
    /// (sent `migrate` first only where a test forces a lead) is not counted either way.
    pub fn record_led_cpu(&mut self, cpu_us: u64) {
        if self.first_seen {
            self.record_cpu(cpu_us);
            keep_last(&mut self.recent_led_cpu, cpu_us);
        }
    }

    /// The remembered CPU times of captures sent `migrate` first, oldest first, in µs.
    pub fn recent_led_cpu_us(&self) -> impl Iterator<Item = u64> + '_ {
        self.recent_led_cpu.iter().copied()
    }

    /// How much CPU QEMU's snapshot thread may use after `migrate` before the next capture
    /// sends `stop` (used instead of [`Self::lead`]'s clock where the thread can be watched):
    /// 85% of the least its setup took in the remembered captures (at least two), 60% while a
    /// race was lost among the last [`Self::KEEP`]. The setup's CPU time varies far less than
    /// its wall time (4.7-7.6 ms against 9-110 ms, 1 GiB, loaded host), so the margin can be
    /// narrower than the clock's three quarters. Learnt from the captures sent `migrate` first
    /// once there are two of them (their setups ran beside the guest, as the next one's will),
    /// else from all.
    pub fn cpu_target(&self) -> Option<std::time::Duration> {
        self.share_of_least(self.cpu_basis(), (17, 20), (6, 10))
            .map(std::time::Duration::from_micros)
    }

    /// The CPU times [`Self::cpu_target`] is learnt from.
    fn cpu_basis(&self) -> &std::collections::VecDeque<u64> {
        if self.recent_led_cpu.len() >= 2 {
            &self.recent_led_cpu
        } else {
            &self.recent_cpu
        }
    }

    /// The remembered `stop` latencies, oldest first, in µs.
    pub fn recent_stop_latency_us(&self) -> impl Iterator<Item = u64> + '_ {
        self.recent_stop_latency.iter().copied()
    }

    /// One capture's time from backstop's `stop` to QEMU's `STOP` event, in µs.
    pub fn record_stop_latency(&mut self, us: u64) {
        keep_last(&mut self.recent_stop_latency, us);
    }

    /// The CPU time of QEMU's snapshot thread at which the next capture sends `stop`:
    /// [`Self::cpu_target`], but no later than the least setup's CPU less the longest recent
    /// `stop` latency (the thread keeps running until QEMU acts on `stop`).
    pub fn cpu_stop_point(&self) -> Option<std::time::Duration> {
        let target = self.cpu_target()?.as_micros() as u64;
        let least = self.cpu_basis().iter().copied().min()?;
        let latency = self.recent_stop_latency.iter().copied().max().unwrap_or(0);
        Some(std::time::Duration::from_micros(
            target.min(least.saturating_sub(latency)),
        ))
    }

    /// `share` (numerator, denominator) of the least of `recent`, `after_loss` while a race was
    /// lost among the last [`Self::KEEP`]; `None` with fewer than two values (one is no
    /// minimum: setups scatter 2-9x between consecutive captures on a loaded host).
    fn share_of_least(
        &self,
        recent: &std::collections::VecDeque<u64>,
        share: (u64, u64),
        after_loss: (u64, u64),
    ) -> Option<u64> {
        if recent.len() < 2 {
            return None;
        }
        let least = *recent.iter().min()?;
        let (num, den) = if self.races.contains(&true) {
            after_loss
        } else {
            share
        };
        Some(least / den * num)
    }

    /// One capture's time from sending `migrate` to QEMU's `MIGRATION` `active`, in µs.
    pub fn record(&mut self, setup_us: u64) {
        if std::mem::replace(&mut self.first_seen, true) {
            keep_last(&mut self.recent, setup_us);
        }
    }

    /// A capture lost its race (`true`: sent `migrate` first, discarded), or was taken
    /// (`false`, whichever order it went in). A loss counts for the next [`Self::KEEP`]
    /// captures; a capture that went `stop` first because of it ages it too.
    pub fn raced(&mut self, lost: bool) {
        keep_last(&mut self.races, lost);
    }

    /// The remembered setup times, oldest first, in µs.
    pub fn recent_us(&self) -> impl Iterator<Item = u64> + '_ {
        self.recent.iter().copied()
    }

    /// How long after `migrate` the next capture sends `stop`; `None`: `stop` first (no
    /// capture measured yet on this QEMU, or a lead too short to matter).
    pub fn lead(&self) -> Option<std::time::Duration> {
        // At least two setup times: every race lost in the bench's runs (QEMU 10 with `auto`, 7.2
        // with `migrate-first`, even with half of it as the lead) was a QEMU's third capture, led
        // by its second capture's long setup alone.
        let lead_us = self.share_of_least(&self.recent, (3, 4), (1, 2))?;
        let lead = std::time::Duration::from_micros(lead_us);
        (lead >= Self::MIN_LEAD).then_some(lead)
    }
}

impl SetupTimes {
    /// Whether the next capture sends `migrate` first where QEMU's snapshot thread can be
    /// watched, and the lead on the clock if it cannot: [`Self::lead`], or, when that is
    /// `None` but the CPU figure to send `stop` at ([`Self::cpu_stop_point`]) is at least
    /// [`Self::MIN_LEAD`], the clock's share of the least setup however short (only a
    /// fallback). Traced: after one lost race the capture taken again (`stop` first, huge pages
    /// just collapsed) had a 5.6 ms setup, half of which is under `MIN_LEAD`, and the next 7
    /// captures went `stop` first although the CPU figure (4.6 ms) still left most of the setup
    /// outside the pause.
    pub fn early_lead(&self) -> Option<std::time::Duration> {
        if let Some(lead) = self.lead() {
            return Some(lead);
        }
        self.cpu_stop_point().filter(|p| *p >= Self::MIN_LEAD)?;
        self.share_of_least(&self.recent, (3, 4), (1, 2))
            .map(std::time::Duration::from_micros)
    }
}

/// Appends `v`, dropping the oldest beyond [`SetupTimes::KEEP`].
fn keep_last<T>(recent: &mut std::collections::VecDeque<T>, v: T) {
    if recent.len() == SetupTimes::KEEP {
        recent.pop_front();
    }
    recent.push_back(v);
}

/// With `migrate` sent before `stop`: whether backstop's `stop` paused the guest before QEMU's
/// snapshot thread reached its own stop. `events` are the run-state and migration events
/// queued when `stop` answered, in arrival order, as (name, `MIGRATION` status). QEMU's monitor
/// sends events in the order they happen, and its thread sets `active` just before it takes
/// the big lock to stop the guest: a `STOP` before any `active` is backstop's own, taken while
/// QEMU was still in its setup. Anything else (`active` first, a `RESUME`, no `STOP` at all) is
/// counted as lost, even in the few µs where backstop could still have been first. The order
/// is sound because QEMU emits `STOP` only once every vCPU is paused: its stop drops the big
/// lock while it waits for them, and QEMU's thread may take it then (and find the run state
/// already "paused"), but it sends `active` before it does, so that case reads as lost too.
pub fn stopped_before_qemu<'a>(
    events: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> bool {
    events
        .into_iter()
        .find_map(|(name, status)| decides_race(name, status))
        .unwrap_or(false)
}

/// What one run-state or migration event says of the race [`stopped_before_qemu`] reads:
/// `Some(true)`, backstop's `stop` came first (a `STOP` before any other deciding event);
/// `Some(false)`, QEMU's own stop did, or QEMU already resumed (a `MIGRATION` past `setup`, a
/// `RESUME`); `None`, it decides nothing (`setup`, any other event). The capture waits for the
/// first event for which this is `Some` before it writes the disk switch behind a won `stop`.
pub fn decides_race(name: &str, status: Option<&str>) -> Option<bool> {
    match (name, status) {
        ("STOP", _) => Some(true),
        ("MIGRATION", Some("setup")) => None,
        ("MIGRATION" | "RESUME", _) => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CAPS: &[&str] = &["xbzrle", "events", "background-snapshot"];

    fn v(major: u64, minor: u64, micro: u64) -> QemuVersion {
        QemuVersion {
            major,
            minor,
            micro,
        }
    }

    #[test]
    fn versions_map_to_who_resumes() {
        assert_eq!(
            capture_plan(v(7, 2, 22), CAPS).unwrap().resume,
            Resume::ByQemu
        );
        assert_eq!(
            capture_plan(v(8, 2, 2), CAPS).unwrap().resume,
            Resume::ByQemu
        );
        assert_eq!(
            capture_plan(v(9, 0, 0), CAPS).unwrap().resume,
            Resume::AfterWriteTracking
        );
        assert_eq!(
            capture_plan(v(10, 0, 2), CAPS).unwrap().resume,
            Resume::AfterWriteTracking
        );
        assert_eq!(
            capture_plan(v(10, 2, 0), CAPS).unwrap().resume,
            Resume::AfterWriteTracking
        );
    }

    #[test]
    fn versions_outside_the_range_are_refused_with_one_line() {
        for old_or_new in [v(7, 1, 0), v(6, 2, 0), v(11, 0, 0), v(12, 1, 3)] {
            let e = capture_plan(old_or_new, CAPS).unwrap_err();
            assert!(e.contains(&old_or_new.to_string()), "{e}");
            assert!(e.contains("7.2 through 10.x"), "{e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn a_missing_capability_is_refused() {
        let e = capture_plan(v(10, 0, 2), &["events"]).unwrap_err();
        assert!(e.contains("background-snapshot"), "{e}");
    }

    #[test]
    fn parses_query_version() {
        let reply = json!({"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian"});
        assert_eq!(QemuVersion::from_query(&reply), Some(v(10, 0, 2)));
        assert_eq!(
            QemuVersion::from_query(&json!({"qemu": {"major": 7}})),
            None
        );
        assert_eq!(v(10, 0, 2).to_string(), "10.0.2");
    }

    #[test]
    fn tracking_is_on_once_pages_are_counted() {
        assert!(!write_tracking_on(&json!({"status": "setup"})));
        assert!(!write_tracking_on(
            &json!({"status": "active", "ram": {"normal": 0, "duplicate": 0}})
        ));
        assert!(write_tracking_on(
            &json!({"status": "active", "ram": {"normal": 0, "duplicate": 3}})
        ));
        assert!(write_tracking_on(&json!({"status": "completed"})));
        assert!(!write_tracking_on(&json!({"status": "failed"})));
        // Counts near u64::MAX are not added up (that overflowed).
        assert!(write_tracking_on(
            &json!({"status": "active", "ram": {"normal": u64::MAX, "duplicate": 1}})
        ));
    }

    #[test]
    fn the_lead_is_half_the_shortest_recent_setup() {
        let mut t = SetupTimes::default();
        // Half while a recent race was lost (this test's rule; the next one has the rest).
        t.raced(true);
        assert_eq!(t.lead(), None, "no capture measured yet: stop first");
        t.record(1_000);
        assert_eq!(t.lead(), None, "a QEMU's first capture does not count");
        t.record(20_000);
        t.record(20_000);
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(10)));
        t.record(10_000);
        t.record(30_000);
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(5)));
        // Only the last KEEP count: the short one ages out.
        for _ in 0..SetupTimes::KEEP - 1 {
            t.record(16_000);
        }
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(8)));
        // A lead under MIN_LEAD is not used.
        t.record(5_000);
        assert_eq!(t.lead(), None);
        t.record(u64::MAX);
        assert_eq!(t.lead(), None, "the short one still counts; no overflow");
    }

    #[test]
    fn the_capture_order_decides_where_migrate_may_go_first() {
        use Resume::*;
        assert_eq!(CaptureOrder::default(), CaptureOrder::Auto);
        assert!(CaptureOrder::Auto.allows_lead(AfterWriteTracking));
        assert!(!CaptureOrder::Auto.allows_lead(ByQemu));
        assert!(CaptureOrder::MigrateFirst.allows_lead(ByQemu));
        assert!(CaptureOrder::MigrateFirst.allows_lead(AfterWriteTracking));
        assert!(!CaptureOrder::StopFirst.allows_lead(AfterWriteTracking));
        assert!(!CaptureOrder::StopFirst.allows_lead(ByQemu));
    }

    #[test]
    fn the_cpu_target_is_most_of_the_least_cpu_setup_and_less_after_a_loss() {
        let mut t = SetupTimes::default();
        t.record_cpu(9_000); // the QEMU's first capture: not counted
        t.record(30_000);
        assert_eq!(t.cpu_target(), None);
        t.record_cpu(6_000);
        t.record(20_000);
        assert_eq!(t.cpu_target(), None, "one CPU time alone");
        t.record_cpu(5_000);
        t.record(60_000);
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(4_250))
        );
        assert_eq!(t.recent_cpu_us().collect::<Vec<_>>(), [6_000, 5_000]);
        t.raced(true);
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(3_000))
        );
        for _ in 0..SetupTimes::KEEP {
            t.raced(false);
            t.record_cpu(8_000);
            t.record(10_000);
        }
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(6_800)),
            "the loss and the short ones aged out"
        );
    }

    #[test]
    fn one_setup_time_alone_gives_no_lead() {
        let mut t = SetupTimes::default();
        t.record(1_000); // the QEMU's first capture: not counted
        t.record(40_000);
        assert_eq!(
            t.lead(),
            None,
            "a single (possibly long) setup time: stop first"
        );
        t.record(24_000);
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(18)));
    }

    #[test]
    fn the_lead_is_three_quarters_until_a_race_is_lost_then_half_until_it_ages_out() {
        let mut t = SetupTimes::default();
        t.record(1_000); // the QEMU's first capture: not counted
        t.record(20_000);
        t.record(24_000);
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(15)));
        t.raced(false);
        assert_eq!(
            t.lead(),
            Some(std::time::Duration::from_millis(15)),
            "a win changes nothing"
        );
        t.raced(true);
        assert_eq!(
            t.lead(),
            Some(std::time::Duration::from_millis(10)),
            "after a loss: half"
        );
        for i in 1..SetupTimes::KEEP {
            t.raced(false);
            assert_eq!(
                t.lead(),
                Some(std::time::Duration::from_millis(10)),
                "the loss is still among the last {} races after {i} wins",
                SetupTimes::KEEP
            );
        }
        t.raced(false);
        assert_eq!(
            t.lead(),
            Some(std::time::Duration::from_millis(15)),
            "the loss aged out"
        );
        // Three quarters of a setup just over 4 ms is a lead over MIN_LEAD; half of it is not.
        let mut small = SetupTimes::default();
        small.record(0);
        small.record(4_200);
        small.record(4_400);
        assert_eq!(small.lead(), Some(std::time::Duration::from_micros(3_150)));
        small.raced(true);
        assert_eq!(small.lead(), None);
    }

    #[test]
    fn only_a_stop_before_qemus_active_is_backstops_own() {
        let won = [
            ("MIGRATION", Some("setup")),
            ("STOP", None),
            ("MIGRATION", Some("active")),
        ];
        assert!(stopped_before_qemu(won));
        // QEMU's thread got there first: its own STOP follows `active`.
        let lost = [
            ("MIGRATION", Some("setup")),
            ("MIGRATION", Some("active")),
            ("STOP", None),
        ];
        assert!(!stopped_before_qemu(lost));
        // ... and it may already have resumed the guest before backstop's stop.
        assert!(!stopped_before_qemu([
            ("MIGRATION", Some("active")),
            ("STOP", None),
            ("RESUME", None),
            ("STOP", None)
        ]));
        assert!(
            !stopped_before_qemu([("MIGRATION", Some("setup"))]),
            "no STOP at all"
        );
        assert!(!stopped_before_qemu([("RESUME", None), ("STOP", None)]));
        assert!(!stopped_before_qemu([
            ("MIGRATION", Some("failed")),
            ("STOP", None)
        ]));
    }

    #[test]
    fn only_stop_resume_and_migration_past_setup_decide_the_race() {
        // The early disk switch waits for the first deciding event: one that decides nothing
        // must not end its wait, and each deciding one must read as the whole race does.
        for undecided in [
            ("MIGRATION", Some("setup")),
            ("BLOCK_JOB_READY", None),
            ("NIC_RX_FILTER_CHANGED", None),
        ] {
            assert_eq!(
                decides_race(undecided.0, undecided.1),
                None,
                "{undecided:?}"
            );
        }
        assert_eq!(decides_race("STOP", None), Some(true));
        for lost in [
            ("RESUME", None),
            ("MIGRATION", Some("active")),
            ("MIGRATION", Some("failed")),
            ("MIGRATION", Some("completed")),
        ] {
            assert_eq!(decides_race(lost.0, lost.1), Some(false), "{lost:?}");
            assert!(!stopped_before_qemu([lost, ("STOP", None)]), "{lost:?}");
        }
    }

    #[test]
    fn the_cpu_target_is_learnt_from_captures_sent_migrate_first_once_two_are_known() {
        let mut t = SetupTimes::default();
        t.record_cpu(11_000); // the QEMU's first capture: not counted
        t.record(15_000);
        for cpu in [3_800, 4_000] {
            t.record_cpu(cpu);
            t.record(8_000);
        }
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(3_230)),
            "stop-first captures only"
        );
        t.record_led_cpu(7_100);
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(3_230)),
            "one led capture alone is no minimum"
        );
        t.record_led_cpu(8_000);
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(6_035)),
            "85% of the least led setup"
        );
        assert_eq!(t.recent_led_cpu_us().collect::<Vec<_>>(), [7_100, 8_000]);
        // A QEMU's first capture, sent `migrate` first by a forced lead: not counted.
        let mut forced = SetupTimes::default();
        forced.record_led_cpu(20_000);
        forced.record(30_000);
        assert_eq!(forced.recent_led_cpu_us().count(), 0);
        assert_eq!(forced.recent_cpu_us().count(), 0);
        t.raced(true);
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(4_260)),
            "60% after a loss"
        );
    }

    #[test]
    fn a_loss_ages_out_over_captures_that_went_stop_first() {
        let mut t = SetupTimes::default();
        t.record(0);
        t.record(8_000);
        t.record(8_000);
        t.raced(true);
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(4)));
        // The captures after it go `stop` first (no lead under MIN_LEAD, say), and are taken.
        for _ in 0..SetupTimes::KEEP {
            t.raced(false);
        }
        assert_eq!(t.lead(), Some(std::time::Duration::from_millis(6)));
    }

    #[test]
    fn stop_is_sent_early_enough_for_qemu_to_act_on_it_before_the_least_setup_ends() {
        let mut t = SetupTimes::default();
        t.record_cpu(11_000); // the QEMU's first capture: not counted
        t.record(15_000);
        assert_eq!(t.cpu_stop_point(), None, "nothing learnt yet");
        t.record_led_cpu(8_000);
        t.record_led_cpu(9_000);
        assert_eq!(t.cpu_stop_point(), t.cpu_target(), "no latency known");
        assert_eq!(
            t.cpu_target(),
            Some(std::time::Duration::from_micros(6_800))
        );
        t.record_stop_latency(600);
        assert_eq!(
            t.cpu_stop_point(),
            Some(std::time::Duration::from_micros(6_800)),
            "85% leaves more than the latency"
        );
        t.record_stop_latency(1_600);
        t.record_stop_latency(700);
        assert_eq!(
            t.cpu_stop_point(),
            Some(std::time::Duration::from_micros(6_400)),
            "the least less the longest latency"
        );
        t.record_stop_latency(20_000);
        assert_eq!(
            t.cpu_stop_point(),
            Some(std::time::Duration::ZERO),
            "never below zero"
        );
    }

    #[test]
    fn the_cpu_figure_keeps_migrate_first_when_the_clocks_lead_is_too_short() {
        let mut t = SetupTimes::default();
        t.record(0); // the QEMU's first capture: not counted
        for (setup, cpu) in [(11_000, 10_100), (14_000, 10_800)] {
            t.record_led_cpu(cpu);
            t.record(setup);
        }
        assert_eq!(t.early_lead(), t.lead());
        // A loss, then the capture taken again (`stop` first) with a short setup.
        t.raced(true);
        t.record_led_cpu(7_700);
        t.record(11_000);
        t.record_cpu(3_800);
        t.record(5_600);
        assert_eq!(t.lead(), None, "half of 5.6 ms is under MIN_LEAD");
        assert_eq!(
            t.cpu_stop_point(),
            Some(std::time::Duration::from_micros(4_620))
        );
        assert_eq!(
            t.early_lead(),
            Some(std::time::Duration::from_micros(2_800)),
            "still first, by the CPU; the clock's half only if the thread is not found"
        );
        // A CPU figure under MIN_LEAD: `stop` first.
        let mut small = SetupTimes::default();
        small.record(0);
        for _ in 0..2 {
            small.record_cpu(3_000);
            small.record(3_500);
        }
        assert_eq!(small.lead(), None);
        assert_eq!(small.early_lead(), None);
    }
}
