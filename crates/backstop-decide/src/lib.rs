//! The decisions, as functions of their inputs: where a lifecycle move leads
//! ([`lifecycle::VmState::transition`]), which snapshot a name the console gave means
//! ([`resolve`]), which snapshot a rollback goes to ([`choose_target`]), and whether the restore
//! gate lets it through ([`restore_gate`]).
//!
//! The live engine and `audit replay` (spec/003) both call these functions: the engine with
//! what the store, the policy records and the clock say now, replay with what the journal
//! recorded when the engine decided. Because there is one copy of each rule, replay cannot
//! silently drift from what the daemon does; a divergence it reports is a difference in the
//! inputs or in the record, never in the rule.
//!
//! What a decision needs from the outside world comes in as plain values or through a small
//! trait ([`Verifier`], [`GateInputs`]) that the caller implements: the engine verifies a
//! snapshot against the store and journals the outcome inside it, replay answers with the
//! outcome it read from the journal. This crate must never do I/O, read a clock, journal, log,
//! or know the store: everything it decides is reproducible from its arguments.
//!
//! `backstop-store` depends on this crate for [`resolve`] (its `Store::resolve` keeps a fast
//! path for an exact id that names a directory, and hands every other choice to it).

use serde::Serialize;

pub mod health;
pub mod lifecycle;
pub mod schedule;

/// Whether `created_at` is strictly before `bound` (both RFC 3339). An unreadable time is not
/// before anything: a bound that cannot be checked excludes.
pub fn created_before(created_at: &str, bound: &str) -> bool {
    use backstop_common::time::parse_rfc3339;
    matches!((parse_rfc3339(created_at), parse_rfc3339(bound)), (Some(c), Some(b)) if c < b)
}

// ---------------------------------------------------------------------------------------------
// resolve

/// A live (published, neither pruned nor deleted) snapshot as [`resolve`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveSnapshot<'a> {
    pub id: &'a str,
    /// Its name (`snapshot create --name`), if it has one and the caller knows it.
    pub name: Option<&'a str>,
}

/// Which rule of [`resolve`] matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResolvedBy {
    Id,
    Name,
    Prefix,
}

/// What a given id, name or id prefix names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolved {
    Found {
        id: String,
        by: ResolvedBy,
    },
    /// More than one snapshot matched the first rule that matched any; in the caller's order.
    Ambiguous {
        by: ResolvedBy,
        matches: Vec<String>,
    },
    NotFound,
}

/// The one snapshot `given` names among `live`, tried in this order: its exact id, its exact
/// name, the one id it is a prefix of. The first rule that matches anything decides, so a name
/// is never shadowed by a prefix. An empty `given` names nothing (it would prefix every id).
pub fn resolve(given: &str, live: &[LiveSnapshot<'_>]) -> Resolved {
    if given.is_empty() {
        return Resolved::NotFound;
    }
    if let Some(s) = live.iter().find(|s| s.id == given) {
        return Resolved::Found {
            id: s.id.to_string(),
            by: ResolvedBy::Id,
        };
    }
    for by in [ResolvedBy::Name, ResolvedBy::Prefix] {
        let mut matches: Vec<String> = live
            .iter()
            .filter(|s| match by {
                ResolvedBy::Name => s.name == Some(given),
                _ => s.id.starts_with(given),
            })
            .map(|s| s.id.to_string())
            .collect();
        match matches.len() {
            0 => continue,
            1 => {
                return Resolved::Found {
                    id: matches.remove(0),
                    by,
                }
            }
            _ => return Resolved::Ambiguous { by, matches },
        }
    }
    Resolved::NotFound
}

// ---------------------------------------------------------------------------------------------
// choosing the target

/// A snapshot a rollback to the newest might choose, with everything the choice looks at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Candidate {
    pub id: String,
    /// RFC 3339; `None` when not known (not recorded, or the manifest could not be read).
    pub created_at: Option<String>,
    /// Its manifest could not be read (the store lists it as corrupt). It stays a candidate
    /// whatever the `before` bound (its time cannot be read to exclude it): it cannot verify,
    /// and trying it records why it was skipped.
    pub unreadable: bool,
    /// Taken while the guest was healthy (an unreadable manifest counts as healthy: nothing
    /// says otherwise, and it will not verify anyway).
    pub healthy: bool,
    /// Left off the current line by an earlier rollback (soft rollback, spec/004).
    pub marked: bool,
    /// A forensic snapshot (the disks a rollback abandoned): never a rollback target.
    pub forensic: bool,
    /// Found failing by drift detection once: never a rollback target again.
    pub unusable: bool,
}

impl Candidate {
    /// A readable snapshot of a healthy guest with no flag set and no creation time.
    pub fn new(id: impl Into<String>) -> Candidate {
        Candidate {
            id: id.into(),
            created_at: None,
            unreadable: false,
            healthy: true,
            marked: false,
            forensic: false,
            unusable: false,
        }
    }
}

/// Whether `c` may be a rollback target at all: not marked rolled back, not forensic, not
/// unusable, and (with a `before` bound, the offence's begin) created strictly before it.
pub fn eligible(c: &Candidate, before: Option<&str>) -> bool {
    if c.marked || c.forensic || c.unusable {
        return false;
    }
    match before {
        None => true,
        Some(_) if c.unreadable => true,
        Some(b) => c
            .created_at
            .as_deref()
            .is_some_and(|t| created_before(t, b)),
    }
}

/// What a decision asks of the outside world about one snapshot. The engine verifies it
/// against the store (and journals the outcome); replay answers with the recorded outcome.
/// An `Err` ends the decision and is handed back to the caller as it is.
pub trait Verifier {
    type Error;
    /// Whether `id` verifies completely and fits this VM.
    fn verifies(&mut self, id: &str) -> Result<bool, Self::Error>;
    /// `id` is passed over for now, in the first pass, because it was taken while the guest was
    /// unhealthy. Called in the order the candidates are considered, between the calls of
    /// [`Verifier::verifies`]; the engine journals it there.
    fn passed_over(&mut self, id: &str) -> Result<(), Self::Error> {
        let _ = id;
        Ok(())
    }
}

impl<E, F: FnMut(&str) -> Result<bool, E>> Verifier for F {
    type Error = E;
    fn verifies(&mut self, id: &str) -> Result<bool, E> {
        self(id)
    }
}

/// Why a candidate was not chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Passed over in the first pass (taken while the guest was unhealthy).
    GuestUnhealthy,
    /// Tried and did not verify.
    DidNotVerify,
}

/// One candidate not chosen, in the order it was considered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    pub id: String,
    pub why: SkipReason,
}

/// What [`choose_target`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// `None`: no candidate verifies (the engine halts the VM).
    pub target: Option<String>,
    pub skipped: Vec<Skipped>,
    /// The target was taken while the guest was unhealthy: no snapshot of a healthy guest
    /// verified.
    pub unhealthy_fallback: bool,
}

/// The target of a rollback to the newest: among `candidates` (newest first) those
/// [`eligible`] under `before`, the first that verifies — snapshots of a healthy guest first,
/// because one of a guest whose agent was silent may hold the very hang being undone; those of
/// an unhealthy guest only when none of the others verifies.
pub fn choose_target<V: Verifier + ?Sized>(
    candidates: &[Candidate],
    before: Option<&str>,
    verifier: &mut V,
) -> Result<Choice, V::Error> {
    let eligible: Vec<&Candidate> = candidates.iter().filter(|c| eligible(c, before)).collect();
    let mut skipped = Vec::new();
    let mut skip = |id: &str, why| {
        skipped.push(Skipped {
            id: id.to_string(),
            why,
        })
    };
    for c in &eligible {
        if !c.healthy {
            verifier.passed_over(&c.id)?;
            skip(&c.id, SkipReason::GuestUnhealthy);
        } else if verifier.verifies(&c.id)? {
            return Ok(Choice {
                target: Some(c.id.clone()),
                skipped,
                unhealthy_fallback: false,
            });
        } else {
            skip(&c.id, SkipReason::DidNotVerify);
        }
    }
    for c in eligible.iter().filter(|c| !c.healthy) {
        if verifier.verifies(&c.id)? {
            return Ok(Choice {
                target: Some(c.id.clone()),
                skipped,
                unhealthy_fallback: true,
            });
        }
        skip(&c.id, SkipReason::DidNotVerify);
    }
    Ok(Choice {
        target: None,
        skipped,
        unhealthy_fallback: false,
    })
}

// ---------------------------------------------------------------------------------------------
// the restore gate

/// Whether a target `age_s` old is beyond the temporal bound `bound_s` (spec/004,
/// `[restore_gate] max_target_age_hours`). Either unknown (a journal from before they were
/// recorded): not beyond.
pub fn beyond_bound(age_s: Option<u64>, bound_s: Option<u64>) -> bool {
    matches!((age_s, bound_s), (Some(a), Some(b)) if a > b)
}

/// Why the gate needs reviewer evidence for a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Need {
    /// Older than the temporal bound (checked first, for every bounded rollback, even an
    /// emergency one).
    BeyondBound,
    /// Marked rolled back: off the current line.
    RolledBack,
    /// A newer snapshot of the current line verifies (`newer`, the newest that does).
    NotNewest { newer: String },
}

/// Reviewer evidence that checked out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Evidence {
    pub reviewer: String,
    /// When the token expires, if the caller knows (the live gate does; replay does not).
    pub expires_at: Option<String>,
}

/// The gate's decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GateDecision {
    /// Not governed (emergency, watchdog, host trigger, micro, the clean-stop resume): never
    /// blocked by governance (spec/000 wins); recorded as `override`.
    Override,
    /// The newest verified snapshot of the current line: no evidence needed.
    Allow,
    /// Evidence was needed, and given.
    Approved { need: Need, evidence: Evidence },
    /// Evidence was needed, and not given or refused (`refused`: why, as the caller put it).
    Block { need: Need, refused: String },
}

impl GateDecision {
    /// The journal's `decision` field: `override`, `allow` or `block`.
    pub fn as_str(&self) -> &'static str {
        match self {
            GateDecision::Override => "override",
            GateDecision::Allow | GateDecision::Approved { .. } => "allow",
            GateDecision::Block { .. } => "block",
        }
    }
}

/// The gate's plain inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateInput {
    /// A session rollback asked for on the control socket: governance applies.
    pub governed: bool,
    /// Asked for on the control socket: the temporal bound applies.
    pub bounded: bool,
    /// The target's age when the gate decided, and the bound, in seconds (see [`beyond_bound`]).
    pub target_age_s: Option<u64>,
    pub temporal_bound_s: Option<u64>,
    /// The target is marked rolled back.
    pub target_marked: bool,
}

/// What the gate asks of the outside world, and only when its decision turns on it.
pub trait GateInputs: Verifier {
    /// The snapshots listed after the target, newest first (filtered here by [`eligible`]).
    fn newer(&mut self) -> Result<Vec<Candidate>, Self::Error>;
    /// Checks the reviewer evidence that came with the request, for `need`: `Ok` if it holds,
    /// else why not (none given, no key, a bad or expired token), worded by the caller.
    fn evidence(&mut self, need: &Need) -> Result<Evidence, String>;
}

/// The restore gate (spec/001, spec/004), between choosing the verified target and touching the
/// VM. In this order: a bounded rollback to a target beyond the temporal bound needs evidence;
/// an ungoverned one is an override; a governed one to a marked target, or to one with a newer
/// eligible snapshot that verifies, needs evidence; otherwise it is allowed. Newer snapshots are
/// verified newest first and only until one verifies. An `Err` from `inputs` ends the decision
/// (the live gate blocks on it: it cannot tell the newest verified snapshot).
pub fn restore_gate<G: GateInputs + ?Sized>(
    input: &GateInput,
    inputs: &mut G,
) -> Result<GateDecision, G::Error> {
    let need = if input.bounded && beyond_bound(input.target_age_s, input.temporal_bound_s) {
        Need::BeyondBound
    } else if !input.governed {
        return Ok(GateDecision::Override);
    } else if input.target_marked {
        Need::RolledBack
    } else {
        let newer = inputs.newer()?;
        let mut found = None;
        for c in newer.iter().filter(|c| eligible(c, None)) {
            if inputs.verifies(&c.id)? {
                found = Some(c.id.clone());
                break;
            }
        }
        match found {
            None => return Ok(GateDecision::Allow),
            Some(newer) => Need::NotNewest { newer },
        }
    };
    Ok(match inputs.evidence(&need) {
        Ok(evidence) => GateDecision::Approved { need, evidence },
        Err(refused) => GateDecision::Block { need, refused },
    })
}

#[cfg(test)]
mod tests;
