//! The pre-action gate (spec/000 §4.2, §10.1).
//!
//! The host broker submits an Action Descriptor before it lets an action run:
//!
//! ```json
//! {"action_id": "pkg-42", "tier": 2, "kind": "package_install", "risk_level": "HIGH",
//!  "declared_effects": ["installs nginx"], "rollback": {"supported": true, "scope": "full"}}
//! ```
//!
//! It is parsed strictly (unknown fields refused, size and lengths bounded). An action that
//! declares no rollback support is blocked. A snapshot is taken first whenever §4.2 requires
//! one — tier 2 or more, a filesystem bulk change, a package install or removal, a configuration
//! change, or `risk_level` HIGH or CRITICAL — and if it fails the action is blocked. Open actions
//! are durable (`<state_dir>/policy/actions.json`). `action end ID --result failed` rolls the VM
//! back to the action's snapshot (a micro rollback, spec/000 §5.1); `ok` closes the action.
//! The system chose that target, so if it cannot be used (spec/000 §12) the rollback falls back
//! to the newest verified snapshot taken before the action began, and with none the VM is
//! HALTED; the action is closed either way, and its `action.ended` entry says what happened.
//! An action §4.2 does not require a snapshot for is bounded by the newest snapshot at the time
//! it began, and that is where its micro rollback goes.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_control::{ActionResult, ActionView, Response, RollbackReport, SkippedSnapshot};
use backstop_store::ListEntry;

use backstop_common::time::now_rfc3339;
use backstop_common::{AuditEvent, ErrorCode, Role, RollbackType, TriggerKind};

use crate::actor::{Ctx, VmActor};
use crate::error::EngineError;
use crate::policy::PolicyError;
use crate::rollback::RollbackPlan;

/// Largest descriptor accepted, in bytes of JSON.
pub const DESCRIPTOR_MAX_BYTES: usize = 16 * 1024;
const MAX_EFFECTS: usize = 64;
const MAX_TEXT: usize = 256;
/// Highest tier a descriptor may name.
pub const MAX_TIER: u8 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    FilesystemBulkChange,
    PackageInstall,
    PackageRemove,
    ConfigurationChange,
    Other,
}

impl ActionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::FilesystemBulkChange => "filesystem_bulk_change",
            ActionKind::PackageInstall => "package_install",
            ActionKind::PackageRemove => "package_remove",
            ActionKind::ConfigurationChange => "configuration_change",
            ActionKind::Other => "other",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum RiskLevel {
    Low,
    Medium,
    High,
    Critical,
}

impl RiskLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            RiskLevel::Low => "LOW",
            RiskLevel::Medium => "MEDIUM",
            RiskLevel::High => "HIGH",
            RiskLevel::Critical => "CRITICAL",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackDeclaration {
    pub supported: bool,
    pub scope: String,
}

/// An Action Descriptor, as parsed by [`ActionDescriptor::parse`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionDescriptor {
    pub action_id: String,
    pub tier: u8,
    pub kind: ActionKind,
    pub risk_level: RiskLevel,
    pub declared_effects: Vec<String>,
    pub rollback: RollbackDeclaration,
}

fn text_ok(s: &str) -> bool {
    !s.trim().is_empty() && s.len() <= MAX_TEXT && !s.chars().any(char::is_control)
}

impl ActionDescriptor {
    /// Strict parse: size, shape (unknown fields refused), then each field's bounds.
    pub fn parse(v: &Value) -> Result<ActionDescriptor, PolicyError> {
        let bad = |m: String| PolicyError::DescriptorInvalid(m);
        let len = serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX);
        if len > DESCRIPTOR_MAX_BYTES {
            return Err(bad(format!("larger than {DESCRIPTOR_MAX_BYTES} bytes")));
        }
        let d: ActionDescriptor =
            serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?;
        if d.action_id.is_empty()
            || d.action_id.len() > 64
            || !d
                .action_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
        {
            return Err(bad(
                "action_id: use 1-64 characters from [A-Za-z0-9._:-]".into()
            ));
        }
        if d.tier > MAX_TIER {
            return Err(bad(format!("tier: must be between 0 and {MAX_TIER}")));
        }
        if d.declared_effects.len() > MAX_EFFECTS {
            return Err(bad(format!("declared_effects: at most {MAX_EFFECTS}")));
        }
        if let Some(i) = d.declared_effects.iter().position(|e| !text_ok(e)) {
            return Err(bad(format!(
                "declared_effects[{i}]: 1-{MAX_TEXT} printable characters"
            )));
        }
        if !text_ok(&d.rollback.scope) {
            return Err(bad(format!(
                "rollback.scope: 1-{MAX_TEXT} printable characters"
            )));
        }
        Ok(d)
    }

    /// Why spec/000 §4.2 requires a snapshot before this action (empty: it does not).
    pub fn snapshot_required_by(&self) -> Vec<&'static str> {
        let mut why = Vec::new();
        if self.tier >= 2 {
            why.push("tier 2 or higher");
        }
        match self.kind {
            ActionKind::FilesystemBulkChange => why.push("filesystem bulk change"),
            ActionKind::PackageInstall | ActionKind::PackageRemove => {
                why.push("package install or removal")
            }
            ActionKind::ConfigurationChange => why.push("configuration change"),
            ActionKind::Other => {}
        }
        if self.risk_level >= RiskLevel::High {
            why.push("risk_level HIGH or above");
        }
        why
    }
}

/// An open action (`actions.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAction {
    pub action_id: String,
    pub tier: u8,
    pub kind: ActionKind,
    pub risk_level: RiskLevel,
    pub declared_effects: Vec<String>,
    pub rollback_scope: String,
    /// Where a micro rollback of this action goes.
    pub snapshot_id: Option<String>,
    /// Taken for this action (§4.2), or the newest snapshot when it began.
    pub snapshot_taken: bool,
    pub opened_at: String,
    pub opened_by: String,
    pub trace_id: String,
}

impl OpenAction {
    fn view(&self, state: &str, rollback: Option<RollbackReport>) -> ActionView {
        ActionView {
            action_id: self.action_id.clone(),
            state: state.into(),
            tier: self.tier,
            action_kind: self.kind.as_str().into(),
            risk_level: self.risk_level.as_str().into(),
            snapshot_id: self.snapshot_id.clone(),
            snapshot_taken: self.snapshot_taken,
            opened_at: self.opened_at.clone(),
            opened_by: self.opened_by.clone(),
            rollback: rollback.map(Box::new),
        }
    }
}

fn host_only(ctx: &Ctx) -> Result<(), EngineError> {
    match ctx.caller.role {
        Role::Console | Role::Policy => Ok(()),
        _ => Err(EngineError::NotPermitted(
            "actions come from the host broker or the console".into(),
        )),
    }
}

impl VmActor {
    fn action_refused(
        &mut self,
        ctx: &Ctx,
        action_id: Option<&str>,
        e: &PolicyError,
    ) -> Result<(), EngineError> {
        let sid = self.session_id.clone();
        self.journal(AuditEvent::ActionRefused, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "refused",
            "action_id": action_id, "code": e.code(), "error": e.to_string(), "requested_by": ctx.caller.label(),
        }))
    }

    /// `action begin`.
    pub(crate) fn action_begin(
        &mut self,
        ctx: &mut Ctx,
        descriptor: Value,
    ) -> Result<Response, EngineError> {
        host_only(ctx)?;
        self.policy.check_records()?;
        let d = match ActionDescriptor::parse(&descriptor) {
            Ok(d) => d,
            Err(e) => {
                let id = descriptor
                    .get("action_id")
                    .and_then(Value::as_str)
                    .map(|s| s.chars().take(64).collect::<String>());
                self.action_refused(ctx, id.as_deref(), &e)?;
                return Err(e.into());
            }
        };
        if self.policy.actions.contains_key(&d.action_id) {
            let e = PolicyError::AlreadyOpen(d.action_id.clone());
            self.action_refused(ctx, Some(&d.action_id), &e)?;
            return Err(e.into());
        }
        let sid = self.session_id.clone();
        let trace = ctx.trace_id.clone();
        let base = json!({
            "session_id": sid, "trace_id": trace, "action_id": d.action_id, "tier": d.tier,
            "kind": d.kind.as_str(), "risk_level": d.risk_level.as_str(),
            "declared_effects": d.declared_effects, "rollback_scope": d.rollback.scope,
            "requested_by": ctx.caller.label(),
        });
        let with = |extra: Value| {
            let mut v = base.clone();
            if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
                m.extend(x);
            }
            v
        };
        // spec/000 §10.1: an action that cannot be rolled back does not run.
        if !d.rollback.supported {
            let e = PolicyError::RollbackUnsupported {
                action_id: d.action_id.clone(),
            };
            self.journal(AuditEvent::ActionBlocked, with(json!({
                "snapshot_id": Value::Null, "result": "blocked", "code": e.code(), "error": e.to_string(),
            })))?;
            warn!(action_id = %d.action_id, "action blocked: no rollback support");
            return Err(e.into());
        }
        let required = d.snapshot_required_by();
        let (snapshot_id, taken) = if required.is_empty() {
            // Not required: the action is bounded by the newest snapshot of the current line.
            let newest = self.store.list().ok().and_then(|l| {
                l.into_iter().rev().find_map(|e| match e {
                    ListEntry::Valid(m) if !self.policy.is_rolled_back(&m.snapshot_id) => {
                        Some(m.snapshot_id)
                    }
                    _ => None,
                })
            });
            (newest, false)
        } else {
            ctx.step(
                "snapshot",
                format!("pre-action snapshot for action {}", d.action_id),
                None,
            );
            let reason = format!(
                "pre-action snapshot for action {} ({}, risk {}, tier {})",
                d.action_id,
                d.kind.as_str(),
                d.risk_level.as_str(),
                d.tier
            );
            match self.create_snapshot(ctx, &reason, "pre_action") {
                Ok(m) => (Some(m.snapshot_id), true),
                Err(cause) => {
                    // spec/000 §4.2: if the snapshot fails, the action is blocked.
                    let e = PolicyError::PreActionSnapshotFailed {
                        action_id: d.action_id.clone(),
                        code: cause.code().to_string(),
                        message: cause.to_string(),
                    };
                    self.journal(AuditEvent::ActionBlocked, with(json!({
                        "snapshot_id": Value::Null, "result": "blocked", "code": e.code(),
                        "cause_code": cause.code(), "error": cause.to_string(), "snapshot_required_by": required,
                    })))?;
                    warn!(action_id = %d.action_id, cause = %cause.code(), "action blocked: pre-action snapshot failed");
                    return Err(e.into());
                }
            }
        };
        let action = OpenAction {
            action_id: d.action_id.clone(),
            tier: d.tier,
            kind: d.kind,
            risk_level: d.risk_level,
            declared_effects: d.declared_effects.clone(),
            rollback_scope: d.rollback.scope.clone(),
            snapshot_id: snapshot_id.clone(),
            snapshot_taken: taken,
            opened_at: now_rfc3339(),
            opened_by: ctx.caller.label(),
            trace_id: trace.clone(),
        };
        self.policy
            .actions
            .insert(d.action_id.clone(), action.clone());
        if let Err(e) = self.policy.save_actions() {
            self.policy.actions.remove(&d.action_id);
            return Err(e.into());
        }
        // Kept after the action ends: a later trigger naming it rolls back to before it began.
        if let Err(e) = self
            .policy
            .note_action_begun(&d.action_id, &action.opened_at)
        {
            warn!(action_id = %d.action_id, error = %e, "could not record when the action began");
        }
        self.journal(
            AuditEvent::ActionBegun,
            with(json!({
                "snapshot_id": snapshot_id, "result": "ok", "snapshot_taken": taken,
                "snapshot_required_by": required,
            })),
        )?;
        info!(action_id = %d.action_id, snapshot_id = ?snapshot_id, taken, "action open");
        Ok(Response::Action(action.view("open", None)))
    }

    /// `action end`: `ok` closes; `failed` is a micro rollback to the action's snapshot (or its
    /// fallback, see [`VmActor::micro_rollback`]).
    pub(crate) fn action_end(
        &mut self,
        ctx: &mut Ctx,
        action_id: String,
        result: ActionResult,
        reason: Option<String>,
    ) -> Result<Response, EngineError> {
        host_only(ctx)?;
        self.policy.check_records()?;
        let Some(action) = self.policy.actions.get(&action_id).cloned() else {
            let e = PolicyError::NotOpen(action_id.chars().take(64).collect());
            self.action_refused(
                ctx,
                Some(&action_id.chars().take(64).collect::<String>()),
                &e,
            )?;
            return Err(e.into());
        };
        let reason = reason
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| format!("action {action_id} reported {}", result.as_str()));
        if reason.len() > 1024 {
            return Err(EngineError::BadRequest(
                "--reason is longer than 1024 bytes".into(),
            ));
        }
        let sid = self.session_id.clone();
        let (undone, fallback) = match result {
            ActionResult::Ok => (None, None),
            ActionResult::Failed => {
                let (undone, fallback) = self.micro_rollback(ctx, &action, &reason);
                (Some(undone), fallback)
            }
        };
        // A rollback that halted the VM ends the action too: what it changed is gone with the
        // VM, and a person decides what runs next. Any other failure changed nothing (a busy
        // VM, a host out of resources): the action stays open for the broker to retry.
        let (report, halted) = match undone {
            None => (None, None),
            Some(Ok(report)) => (Some(report), None),
            Some(Err(error))
                if matches!(
                    error,
                    EngineError::NoVerifiedSnapshotHalted | EngineError::RollbackHalted(_)
                ) =>
            {
                (None, Some(error))
            }
            Some(Err(error)) => return Err(error),
        };
        self.policy.actions.remove(&action_id);
        match (self.policy.save_actions(), &halted) {
            (Ok(()), _) => {}
            (Err(e), None) => return Err(e.into()),
            // The halt is the answer; the record of open actions is read again at `halt clear`.
            (Err(e), Some(_)) => {
                warn!(action_id = %action_id, error = %e, "could not record the action as ended")
            }
        }
        let state = match (&report, &halted) {
            (_, Some(_)) => "halted",
            (Some(_), None) => "rolled_back",
            (None, None) => "closed",
        };
        let (refused_id, refused_code, refused_error) = match &fallback {
            Some(f) => (f.snapshot_id.clone(), f.code, Some(f.error.clone())),
            None => (None, None, None),
        };
        self.journal(AuditEvent::ActionEnded, json!({
            "snapshot_id": action.snapshot_id, "session_id": sid, "trace_id": ctx.trace_id, "result": result.as_str(),
            "action_id": action_id, "state": state, "reason": reason, "ended_by": ctx.caller.label(),
            "rolled_back_to": report.as_ref().map(|r| r.snapshot_id.clone()),
            "fallback": fallback.is_some(), "refused_snapshot_id": refused_id,
            "refused_code": refused_code, "refused_error": refused_error,
            "code": halted.as_ref().map(EngineError::code),
            "error": halted.as_ref().map(ToString::to_string),
        }))?;
        if let Some(e) = halted {
            return Err(e);
        }
        Ok(Response::Action(action.view(state, report)))
    }

    /// The micro rollback of a failed action (spec/000 §5.1): to the action's own snapshot. The
    /// system chose that target, so when it cannot be used (absent, failing verification,
    /// marked unusable, of another shape) the rollback still happens (spec/000 §12): to the
    /// newest verified snapshot of the current line taken before the action began, or, with
    /// none, the VM is HALTED. Nothing was touched when the first target was refused. Returns
    /// the outcome, and why the action's own snapshot was refused when it went to the fallback.
    fn micro_rollback(
        &mut self,
        ctx: &mut Ctx,
        action: &OpenAction,
        reason: &str,
    ) -> (Result<RollbackReport, EngineError>, Option<Refusal>) {
        let action_id = &action.action_id;
        let plan = |to: Option<String>, reason: String, before: Option<String>| RollbackPlan {
            to,
            reason,
            trigger: TriggerKind::ActionFailed,
            rollback_type: RollbackType::Micro,
            action_ids: vec![action_id.clone()],
            gate: Default::default(),
            resume: false,
            before,
        };
        let refused = match action.snapshot_id.clone() {
            Some(target) => {
                ctx.step(
                    "rollback",
                    format!("micro rollback of action {action_id} to {target}"),
                    None,
                );
                match self.rollback(ctx, plan(Some(target.clone()), reason.to_string(), None)) {
                    Ok(report) => return (Ok(report), None),
                    Err(e) if target_refused(&e) => Refusal {
                        snapshot_id: Some(target),
                        code: Some(e.code()),
                        error: e.to_string(),
                    },
                    Err(error) => return (Err(error), None),
                }
            }
            // Bounded by no snapshot when it began (none was required, none existed).
            None => Refusal {
                snapshot_id: None,
                code: None,
                error: format!("action {action_id} recorded no snapshot to roll back to"),
            },
        };
        let first = refused.snapshot_id.as_deref().unwrap_or("none recorded");
        let code = refused.code.map_or("none", ErrorCode::as_str);
        warn!(action_id = %action_id, refused = first, code,
            "the action's snapshot cannot be used: falling back to the newest verified snapshot before it began");
        ctx.step(
            "rollback",
            format!(
                "micro rollback of action {action_id}: its snapshot ({first}) was refused ({code}); falling back to the newest verified snapshot taken before it began"
            ),
            None,
        );
        let why = format!(
            "{reason} (fallback: the action's snapshot {first} was refused with {code}: {})",
            refused.error
        );
        // The pre-action snapshot is taken before the action's begin time, so it is itself a
        // candidate by time: drift detection marked it unusable when it failed, which keeps
        // it out, and one that was only absent is not listed.
        let result = match self.rollback(ctx, plan(None, why, Some(action.opened_at.clone()))) {
            Ok(mut report) => {
                if let (Some(id), Some(code)) = (&refused.snapshot_id, refused.code) {
                    report.skipped.insert(
                        0,
                        SkippedSnapshot {
                            snapshot_id: id.clone(),
                            code: code.as_str().to_string(),
                        },
                    );
                }
                Ok(report)
            }
            Err(error) => Err(error),
        };
        (result, Some(refused))
    }

    /// `action list`.
    pub(crate) fn action_list(&self) -> Result<Response, EngineError> {
        Ok(Response::Actions {
            actions: self
                .policy
                .actions
                .values()
                .map(|a| a.view("open", None))
                .collect(),
        })
    }
}

/// Why the action's own snapshot was not the target: refused with a code, or none recorded.
struct Refusal {
    snapshot_id: Option<String>,
    code: Option<ErrorCode>,
    error: String,
}

/// Whether a rollback to a named target was refused because of the target itself (absent,
/// failing verification, marked unusable, of another shape), before the VM was touched.
fn target_refused(e: &EngineError) -> bool {
    match e {
        EngineError::Verify { .. }
        | EngineError::SnapshotUnusable { .. }
        | EngineError::ShapeMismatch { .. } => true,
        EngineError::Store(s) => s.code() == ErrorCode::MissingSnapshot,
        _ => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn good() -> Value {
        json!({
            "action_id": "pkg-42", "tier": 1, "kind": "other", "risk_level": "LOW",
            "declared_effects": ["writes /tmp/x"], "rollback": {"supported": true, "scope": "full"},
        })
    }

    #[test]
    fn descriptors_parse_strictly() {
        let d = ActionDescriptor::parse(&good()).unwrap();
        assert_eq!(d.kind, ActionKind::Other);
        assert!(d.snapshot_required_by().is_empty());
        type Change = fn(&mut Value);
        let cases: [(&str, Change); 12] = [
            ("unknown field", |v| v["guest_says"] = json!("skip")),
            ("unknown rollback field", |v| {
                v["rollback"]["skip_snapshot"] = json!(true)
            }),
            ("missing rollback", |v| {
                v.as_object_mut().unwrap().remove("rollback");
            }),
            ("bad kind", |v| v["kind"] = json!("kernel_patch")),
            ("lower-case risk", |v| v["risk_level"] = json!("high")),
            ("tier too high", |v| v["tier"] = json!(7)),
            ("negative tier", |v| v["tier"] = json!(-1)),
            ("bad id", |v| v["action_id"] = json!("a b")),
            ("empty id", |v| v["action_id"] = json!("")),
            ("empty effect", |v| v["declared_effects"] = json!([" "])),
            ("empty scope", |v| v["rollback"]["scope"] = json!("")),
            ("huge", |v| {
                v["declared_effects"] = json!(vec!["x".repeat(200); 100])
            }),
        ];
        for (what, change) in cases {
            let mut v = good();
            change(&mut v);
            let err = ActionDescriptor::parse(&v).unwrap_err();
            assert_eq!(err.code(), "ERR_ACTION_DESCRIPTOR_INVALID", "{what}: {err}");
        }
        assert!(ActionDescriptor::parse(&json!("pkg-42")).is_err());
    }

    /// Only a refusal of the target itself, before the VM was touched, sends a failed action's
    /// rollback to the fallback; a busy VM or a host out of resources is answered as it is.
    #[test]
    fn the_fallback_is_for_a_target_that_cannot_be_used() {
        use backstop_store::StoreError;
        let id = || "0123456789abcdef0123456789abcdef".to_string();
        let falls_back = [
            EngineError::Verify {
                snapshot_id: id(),
                source: StoreError::SignatureMismatch { id: id() },
            },
            EngineError::SnapshotUnusable {
                snapshot_id: id(),
                reason: "drift".into(),
            },
            EngineError::ShapeMismatch { snapshot_id: id() },
            EngineError::Store(StoreError::MissingSnapshot { given: id() }),
        ];
        for e in &falls_back {
            assert!(target_refused(e), "{e}");
        }
        let answered = [
            EngineError::ResourceExhausted {
                step: "verify",
                detail: "EMFILE".into(),
            },
            EngineError::NoVerifiedSnapshotHalted,
            EngineError::ShuttingDown,
            EngineError::Store(StoreError::Random("no entropy".into())),
        ];
        for e in &answered {
            assert!(!target_refused(e), "{e}");
        }
    }

    #[test]
    fn spec_000_4_2_decides_when_a_snapshot_comes_first() {
        let with = |field: &str, value: Value| {
            let mut v = good();
            v[field] = value;
            ActionDescriptor::parse(&v).unwrap().snapshot_required_by()
        };
        assert_eq!(with("tier", json!(2)), ["tier 2 or higher"]);
        assert_eq!(with("tier", json!(0)), Vec::<&str>::new());
        assert_eq!(
            with("kind", json!("filesystem_bulk_change")),
            ["filesystem bulk change"]
        );
        assert_eq!(
            with("kind", json!("package_install")),
            ["package install or removal"]
        );
        assert_eq!(
            with("kind", json!("package_remove")),
            ["package install or removal"]
        );
        assert_eq!(
            with("kind", json!("configuration_change")),
            ["configuration change"]
        );
        assert_eq!(with("risk_level", json!("MEDIUM")), Vec::<&str>::new());
        assert_eq!(
            with("risk_level", json!("HIGH")),
            ["risk_level HIGH or above"]
        );
        assert_eq!(
            with("risk_level", json!("CRITICAL")),
            ["risk_level HIGH or above"]
        );
    }
}
