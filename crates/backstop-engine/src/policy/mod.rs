//! Snapshot policy: when snapshots are taken, which are kept, and which restores are allowed.
//!
//! * [`schedule`]: a snapshot every `[snapshots] schedule_minutes` (default 30) from the newest
//!   snapshot of any kind; a slot that passes without one (daemon down, VM halted, snapshot
//!   deferred or failed) is journaled as `snapshot.schedule.missed`, never skipped silently.
//! * [`retention`]: the host's `[retention]` policy (last N, hourly, daily, rolled-back grace),
//!   applied after each scheduled snapshot and on `snapshot prune`. The newest verified snapshot
//!   and the pre-action snapshot of every open action are never removed; nothing a kept snapshot
//!   depends on (chunks, disk layers) is removed either (see `backstop_store::prune`).
//! * [`actions`]: the pre-action gate (spec/000 §4.2, §10.1) for Action Descriptors from the host
//!   broker; a failed action is undone by a micro rollback to its pre-action snapshot.
//! * [`restore_gate`]: spec/001's restore gate — compatibility (by the store's verification,
//!   with the explicit compatibility mode), governance (reviewer evidence for a console restore
//!   to anything but the newest verified snapshot) — and spec/004's soft rollback marks.
//!
//! Durable records live in `<state_dir>/policy/` (never in the store, whose manifests are
//! immutable): `actions.json` (open actions) and `rolled-back.json` (soft-rollback marks).
//! Nothing here is reachable from the guest channel: every input arrives on the control socket.

use backstop_common::ErrorCode;
pub mod actions;
pub mod delete;
pub mod lineage;
pub mod restore_gate;
pub mod retention;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;

use crate::config::{Config, ConfigError};

pub use actions::{ActionDescriptor, ActionKind, OpenAction, RiskLevel};

/// `[snapshots]`: scheduled snapshots are always on; only their interval is configurable.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsConfig {
    /// Minutes between scheduled snapshots, counted from the newest snapshot of any kind.
    #[serde(default = "default_schedule_minutes")]
    pub schedule_minutes: u64,
    /// Overrides `schedule_minutes` with seconds (tests and demos; at least 5).
    #[serde(default)]
    pub schedule_seconds: Option<u64>,
    /// How long a scheduled slot of an unhealthy guest may be put off before it is taken
    /// anyway, marked unhealthy (never more than half the interval; 0: taken at once).
    #[serde(default = "default_unhealthy_defer_max_s")]
    pub unhealthy_defer_max_s: u64,
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        Self {
            schedule_minutes: default_schedule_minutes(),
            schedule_seconds: None,
            unhealthy_defer_max_s: default_unhealthy_defer_max_s(),
        }
    }
}

impl SnapshotsConfig {
    /// How an unhealthy guest's scheduled slot is put off (see `backstop_decide::schedule`).
    pub fn health_rule(&self) -> backstop_decide::schedule::HealthRule {
        backstop_decide::schedule::HealthRule::new(
            self.interval(),
            Duration::from_secs(self.unhealthy_defer_max_s),
        )
    }

    pub fn interval(&self) -> Duration {
        Duration::from_secs(
            self.schedule_seconds
                .unwrap_or(self.schedule_minutes.saturating_mul(60)),
        )
    }
}

fn default_schedule_minutes() -> u64 {
    30
}

fn default_unhealthy_defer_max_s() -> u64 {
    120
}

/// `[retention]`: which snapshots are kept (spec/000 §4.1 "host-defined").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// The newest N snapshots of the current line.
    #[serde(default = "default_keep_last")]
    pub keep_last: u32,
    /// Plus the newest snapshot of each of the last H hours that have one.
    #[serde(default = "default_hourly")]
    pub hourly: u32,
    /// Plus the newest snapshot of each of the last D days that have one.
    #[serde(default = "default_daily")]
    pub daily: u32,
    /// Snapshots a rollback left behind stay listed (marked) this long, then are deleted.
    #[serde(default = "default_rolled_back_hours")]
    pub keep_rolled_back_hours: u64,
    /// Forensic snapshots (the state a rollback abandoned) are kept this long, by this rule
    /// alone (default 72: three days).
    #[serde(default = "default_forensic_hours")]
    pub keep_forensic_hours: u64,
}

/// Three days: the evidence of what a rollback undid (spec/004: the state before a rollback can
/// be rebuilt from its record) must outlive the next retention pass, long enough for a person
/// to examine it after a weekend. 0 keeps them only until the next retention pass.
fn default_forensic_hours() -> u64 {
    72
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            keep_last: default_keep_last(),
            hourly: default_hourly(),
            daily: default_daily(),
            keep_rolled_back_hours: default_rolled_back_hours(),
            keep_forensic_hours: default_forensic_hours(),
        }
    }
}

impl RetentionConfig {
    pub fn policy(&self) -> backstop_store::RetentionPolicy {
        backstop_store::RetentionPolicy {
            keep_last: self.keep_last,
            hourly: self.hourly,
            daily: self.daily,
            keep_rolled_back_s: self.keep_rolled_back_hours.saturating_mul(3600),
        }
    }
}

fn default_keep_last() -> u32 {
    10
}
fn default_hourly() -> u32 {
    24
}
fn default_daily() -> u32 {
    7
}
fn default_rolled_back_hours() -> u64 {
    24
}

/// `[restore_gate]`: reviewer evidence for console restores (spec/001 governance).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreGateConfig {
    /// 32-byte HMAC key (mode 0600) that reviewer tokens are signed with. Without it, a console
    /// restore can only go to the newest verified snapshot.
    pub reviewer_key: Option<PathBuf>,
    /// The temporal bound (spec/004): a rollback asked for on the control socket to a snapshot
    /// older than this needs reviewer evidence even with `--emergency`. Unattended rollbacks
    /// (watchdog, crash, host triggers) are never blocked; the bound is journaled for all.
    #[serde(default = "default_max_target_age_hours")]
    pub max_target_age_hours: u64,
    /// Overrides `max_target_age_hours` with seconds (tests and demos; at least 5).
    #[serde(default)]
    pub max_target_age_seconds: Option<u64>,
}

impl RestoreGateConfig {
    /// The temporal bound in seconds.
    pub fn max_target_age_s(&self) -> u64 {
        self.max_target_age_seconds
            .unwrap_or(self.max_target_age_hours.saturating_mul(3600))
    }
}

impl Default for RestoreGateConfig {
    fn default() -> Self {
        RestoreGateConfig {
            reviewer_key: None,
            max_target_age_hours: default_max_target_age_hours(),
            max_target_age_seconds: None,
        }
    }
}

fn default_max_target_age_hours() -> u64 {
    7 * 24
}

/// Bounds of `[snapshots]`, `[retention]` and `[restore_gate]`, each refusal naming its key.
pub fn validate_config(cfg: &Config) -> Result<(), ConfigError> {
    let bad = |key: &str, message: String| {
        Err(ConfigError::Invalid {
            key: key.into(),
            message,
        })
    };
    let s = &cfg.snapshots;
    if !(1..=1440).contains(&s.schedule_minutes) {
        return bad(
            "snapshots.schedule_minutes",
            "must be between 1 and 1440; scheduled snapshots cannot be turned off (spec/000 §4.1)"
                .into(),
        );
    }
    if let Some(secs) = s.schedule_seconds {
        if !(5..=86_400).contains(&secs) {
            return bad(
                "snapshots.schedule_seconds",
                "must be between 5 and 86400; scheduled snapshots cannot be turned off".into(),
            );
        }
    }
    if s.unhealthy_defer_max_s > 3600 {
        return bad(
            "snapshots.unhealthy_defer_max_s",
            "must be at most 3600; an unhealthy guest's slot is taken anyway after it".into(),
        );
    }
    let r = &cfg.retention;
    if !(1..=10_000).contains(&r.keep_last) {
        return bad(
            "retention.keep_last",
            "must be between 1 and 10000 (the newest verified snapshot is always kept)".into(),
        );
    }
    for (key, v) in [("retention.hourly", r.hourly), ("retention.daily", r.daily)] {
        if v > 10_000 {
            return bad(key, "must be at most 10000".into());
        }
    }
    if r.keep_forensic_hours > 8760 {
        return bad(
            "retention.keep_forensic_hours",
            "must be at most 8760".into(),
        );
    }
    if r.keep_rolled_back_hours > 8760 {
        return bad(
            "retention.keep_rolled_back_hours",
            "must be at most 8760".into(),
        );
    }
    if !(1..=87_600).contains(&cfg.restore_gate.max_target_age_hours) {
        return bad(
            "restore_gate.max_target_age_hours",
            "must be between 1 and 87600 (the bound cannot be turned off)".into(),
        );
    }
    if cfg
        .restore_gate
        .max_target_age_seconds
        .is_some_and(|s| s < 5)
    {
        return bad(
            "restore_gate.max_target_age_seconds",
            "must be at least 5".into(),
        );
    }
    if let Some(k) = &cfg.restore_gate.reviewer_key {
        if !k.is_absolute() {
            return bad(
                "restore_gate.reviewer_key",
                "must be an absolute path".into(),
            );
        }
        if *k == cfg.key_path() {
            return bad(
                "restore_gate.reviewer_key",
                "must not be the host key: reviewers sign with their own key".into(),
            );
        }
        if k.starts_with(cfg.daemon.state_dir.join("store")) {
            return bad(
                "restore_gate.reviewer_key",
                "must not be inside the snapshot store (spec/000 §3.2)".into(),
            );
        }
    }
    Ok(())
}

/// Errors of the snapshot policy, each with its stable code.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("action descriptor refused: {0}")]
    DescriptorInvalid(String),
    #[error("action {action_id} declares no rollback support: blocked (spec/000 §10.1)")]
    RollbackUnsupported { action_id: String },
    #[error("action {action_id} blocked: its pre-action snapshot failed ({code}: {message})")]
    PreActionSnapshotFailed {
        action_id: String,
        code: String,
        message: String,
    },
    #[error("action {0} is already open")]
    AlreadyOpen(String),
    #[error("no open action {0}")]
    NotOpen(String),
    #[error("restore of snapshot {snapshot_id} blocked by the restore policy: {reason}")]
    RestoreBlocked { snapshot_id: String, reason: String },
    #[error("policy records in {path} cannot be used: {reason}")]
    Records { path: String, reason: String },
}

impl PolicyError {
    pub fn code(&self) -> ErrorCode {
        match self {
            PolicyError::DescriptorInvalid(_) => ErrorCode::ActionDescriptorInvalid,
            PolicyError::RollbackUnsupported { .. } => ErrorCode::ActionRollbackUnsupported,
            PolicyError::PreActionSnapshotFailed { .. } => ErrorCode::PreActionSnapshotFailed,
            PolicyError::AlreadyOpen(_) => ErrorCode::ActionAlreadyOpen,
            PolicyError::NotOpen(_) => ErrorCode::ActionNotOpen,
            PolicyError::RestoreBlocked { .. } => ErrorCode::SnapshotRestorePolicyBlocked,
            PolicyError::Records { .. } => ErrorCode::PolicyRecordsUnreadable,
        }
    }
}

impl From<PolicyError> for crate::EngineError {
    fn from(e: PolicyError) -> Self {
        crate::EngineError::Policy(Box::new(e))
    }
}

/// A soft-rollback mark (`rolled-back.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mark {
    /// RFC 3339.
    pub at: String,
    pub rollback_to: String,
    pub rollback_type: String,
    pub trace_id: String,
}

/// What the console asked of the rollback in progress; read by the restore gate.
#[derive(Debug, Clone, Default)]
pub(crate) struct RestoreRequest {
    /// A session rollback from the console: spec/001 governance applies.
    pub governed: bool,
    /// Asked for on the control socket (console or policy engine, any type but micro): the
    /// temporal bound applies.
    pub bounded: bool,
    pub reviewer_token: Option<Value>,
    pub allow_newer_minor: bool,
    /// `--include-forensic`: a forensic snapshot holding RAM may be the named target.
    pub include_forensic: bool,
}

/// The engine's policy state (one field of [`crate::VmActor`]).
pub struct Policy {
    dir: PathBuf,
    pub(crate) actions: BTreeMap<String, OpenAction>,
    pub(crate) marks: BTreeMap<String, Mark>,
    /// Set when a record file could not be read: mutations and pruning are refused.
    pub(crate) records_error: Option<String>,
    pub(crate) schedule: schedule::Schedule,
    /// When this daemon session started (the default point of a session rollback).
    pub(crate) session_started: OffsetDateTime,
    /// Host triggers already executed, by trigger id (`triggers.json`): a repeat is a no-op.
    pub(crate) triggers: BTreeMap<String, TriggerRecord>,
    /// Every snapshot's parent and epoch (`lineage.json`, never pruned).
    pub(crate) lineage: lineage::Book,
    /// When each action began (`actions-begun.json`, open and closed, the newest
    /// [`ACTIONS_REMEMBERED`]): a trigger naming actions rolls back to before the earliest.
    pub(crate) actions_begun: BTreeMap<String, String>,
}

/// How many actions' begin times are remembered.
pub const ACTIONS_REMEMBERED: usize = 10_000;

/// A host trigger that ran (`triggers.json`), kept so a repeat answers with its outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerRecord {
    /// RFC 3339.
    pub at: String,
    pub trace_id: String,
    pub outcome: TriggerOutcome,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TriggerOutcome {
    RolledBack(backstop_control::RollbackReport),
    Failed { code: String, message: String },
}

/// How many executed triggers are remembered (the oldest are forgotten first).
pub const TRIGGERS_KEPT: usize = 1000;

const ACTIONS_FILE: &str = "actions.json";
const MARKS_FILE: &str = "rolled-back.json";
const TRIGGERS_FILE: &str = "triggers.json";
const LINEAGE_FILE: &str = "lineage.json";
const ACTIONS_BEGUN_FILE: &str = "actions-begun.json";

impl Policy {
    /// Loads the durable records from `<state_dir>/policy/`. An unreadable record is not fatal
    /// here (the daemon must still be able to roll back); it is journaled at the first tick and
    /// refuses the operations that depend on it.
    pub fn new(cfg: &Config) -> Policy {
        let dir = cfg.daemon.state_dir.join("policy");
        let mut errors = Vec::new();
        let actions = read_record(&dir.join(ACTIONS_FILE)).unwrap_or_else(|e| {
            errors.push(e);
            BTreeMap::new()
        });
        let marks = read_record(&dir.join(MARKS_FILE)).unwrap_or_else(|e| {
            errors.push(e);
            BTreeMap::new()
        });
        let triggers = read_record(&dir.join(TRIGGERS_FILE)).unwrap_or_else(|e| {
            errors.push(e);
            BTreeMap::new()
        });
        let lineage = read_record(&dir.join(LINEAGE_FILE)).unwrap_or_else(|e| {
            errors.push(e);
            BTreeMap::new()
        });
        let actions_begun = read_record(&dir.join(ACTIONS_BEGUN_FILE)).unwrap_or_else(|e| {
            errors.push(e);
            BTreeMap::new()
        });
        Policy {
            dir,
            actions,
            marks,
            records_error: (!errors.is_empty()).then(|| errors.join("; ")),
            // One VM of many (a vms_dir): its first slot lands at a phase of its own.
            schedule: match cfg.daemon.vms_dir {
                Some(_) => schedule::Schedule::new(cfg.snapshots.interval())
                    .with_phase(schedule::name_phase(&cfg.vm.name, cfg.snapshots.interval())),
                None => schedule::Schedule::new(cfg.snapshots.interval()),
            },
            session_started: OffsetDateTime::now_utc(),
            triggers,
            lineage,
            actions_begun,
        }
    }

    pub fn is_rolled_back(&self, snapshot_id: &str) -> bool {
        self.marks.contains_key(snapshot_id)
    }

    pub(crate) fn check_records(&self) -> Result<(), PolicyError> {
        match &self.records_error {
            Some(reason) => Err(PolicyError::Records {
                path: self.dir.display().to_string(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn save_actions(&self) -> Result<(), PolicyError> {
        self.check_records()?;
        write_record(&self.dir.join(ACTIONS_FILE), &self.actions)
    }

    /// Remembers an executed trigger (forgetting the oldest beyond [`TRIGGERS_KEPT`]).
    pub(crate) fn record_trigger(
        &mut self,
        id: String,
        rec: TriggerRecord,
    ) -> Result<(), PolicyError> {
        self.triggers.insert(id, rec);
        while self.triggers.len() > TRIGGERS_KEPT {
            let oldest = self
                .triggers
                .iter()
                .min_by(|a, b| a.1.at.cmp(&b.1.at))
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.triggers.remove(&k),
                None => break,
            };
        }
        self.check_records()?;
        write_record(&self.dir.join(TRIGGERS_FILE), &self.triggers)
    }

    /// Remembers when an action began (forgetting the earliest beyond [`ACTIONS_REMEMBERED`]).
    pub(crate) fn note_action_begun(&mut self, id: &str, at: &str) -> Result<(), PolicyError> {
        self.actions_begun.insert(id.to_string(), at.to_string());
        while self.actions_begun.len() > ACTIONS_REMEMBERED {
            let oldest = self
                .actions_begun
                .iter()
                .min_by(|a, b| a.1.cmp(b.1))
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.actions_begun.remove(&k),
                None => break,
            };
        }
        self.check_records()?;
        write_record(&self.dir.join(ACTIONS_BEGUN_FILE), &self.actions_begun)
    }

    pub(crate) fn save_lineage(&self) -> Result<(), PolicyError> {
        self.check_records()?;
        write_record(&self.dir.join(LINEAGE_FILE), &self.lineage)
    }

    pub(crate) fn save_marks(&self) -> Result<(), PolicyError> {
        self.check_records()?;
        write_record(&self.dir.join(MARKS_FILE), &self.marks)
    }
}

fn read_record<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> Result<T, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn write_record<T: Serialize>(path: &Path, value: &T) -> Result<(), PolicyError> {
    let err = |reason: String| PolicyError::Records {
        path: path.display().to_string(),
        reason,
    };
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| err(e.to_string()))?;
    backstop_common::durable::write_atomic(path, &bytes).map_err(|e| err(e.to_string()))
}

/// Times as the journal writes them (RFC 3339, UTC, milliseconds) and reads them back.
pub(crate) use backstop_common::time::{parse_rfc3339 as parse_time, rfc3339};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::DEFAULT_CONFIG;
    use crate::Config;

    /// The default config without its policy tables (they are at its end), plus `extra`.
    fn with(extra: &str) -> Result<Config, String> {
        let base = DEFAULT_CONFIG
            .find("\n[snapshots]")
            .map_or(DEFAULT_CONFIG, |i| &DEFAULT_CONFIG[..i]);
        Config::parse(&format!("{base}\n{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_the_spec_s_thirty_minutes() {
        let shipped = Config::parse(DEFAULT_CONFIG).unwrap();
        assert_eq!(shipped.snapshots.interval().as_secs(), 1800);
        assert_eq!(
            (
                shipped.retention.keep_last,
                shipped.retention.hourly,
                shipped.retention.daily
            ),
            (10, 24, 7)
        );
        let cfg = with("").unwrap();
        assert_eq!(cfg.snapshots.interval().as_secs(), 1800);
        assert_eq!(cfg.retention.keep_last, 10);
        assert!(cfg.restore_gate.reviewer_key.is_none());
        let cfg = with("[snapshots]\nschedule_minutes = 5\n").unwrap();
        assert_eq!(cfg.snapshots.interval().as_secs(), 300);
        let cfg = with("[snapshots]\nschedule_seconds = 7\n").unwrap();
        assert_eq!(cfg.snapshots.interval().as_secs(), 7);
    }

    #[test]
    fn the_schedule_cannot_be_turned_off_and_bounds_name_their_key() {
        for (extra, key) in [
            (
                "[snapshots]\nschedule_minutes = 0",
                "snapshots.schedule_minutes",
            ),
            (
                "[snapshots]\nschedule_minutes = 100000",
                "snapshots.schedule_minutes",
            ),
            (
                "[snapshots]\nschedule_seconds = 1",
                "snapshots.schedule_seconds",
            ),
            ("[snapshots]\nenabled = false", "snapshots.enabled"),
            ("[snapshots]\ndisabled = true", "snapshots.disabled"),
            ("[retention]\nkeep_last = 0", "retention.keep_last"),
            ("[retention]\ndaily = 99999", "retention.daily"),
            (
                "[retention]\nkeep_rolled_back_hours = 99999",
                "retention.keep_rolled_back_hours",
            ),
            (
                "[restore_gate]\nreviewer_key = \"relative.key\"",
                "restore_gate.reviewer_key",
            ),
            (
                "[restore_gate]\nreviewer_key = \"/var/lib/backstop/keys/host.key\"",
                "restore_gate.reviewer_key",
            ),
            (
                "[restore_gate]\nreviewer_key = \"/var/lib/backstop/store/k\"",
                "restore_gate.reviewer_key",
            ),
            ("[retention]\ncolour = 1", "colour"),
        ] {
            let err = with(extra).unwrap_err();
            assert!(err.contains(key), "{extra}: {err}");
        }
        with("[restore_gate]\nreviewer_key = \"/etc/backstop/reviewer.key\"").unwrap();
    }
}
