//! The replay core: a pure walk over a VM's journal that recomputes every decision the engine
//! recorded and compares it with what was recorded (spec/003 §6, adapted to VMs; the mapping is
//! in docs/replay.md). Nothing here touches QEMU, the store's files or the clock: the store is
//! seen through [`StoreView`], reviewer approval through a closure, and the final records are
//! handed in. The shell (`replay/mod.rs`) journals what this returns.
//!
//! Decisions checked, each by the same pure function the engine uses where one exists (the
//! rollback target and the restore gate: `backstop-decide`, fed here with what the journal
//! recorded):
//!
//! | decision | recorded in | recomputed from |
//! |---|---|---|
//! | `rollback_target` | `snapshot.restore.policy_decision.snapshot_id`, or a refusal for want of one | the published, unpruned, unmarked snapshots and the verification outcomes recorded for this rollback |
//! | `restore_gate` | `snapshot.restore.policy_decision.decision` | `governed`, the target's mark, newer verified snapshots, the recorded reviewer |
//! | `epoch` | `rollback.completed.epoch` | the previous epoch, +1 unless it is the clean-stop resume |
//! | `soft_rollback_marks` | `snapshot.marked_rolled_back` | the snapshots after the target on the current line |
//! | `storm_guard` | `rollback.triggered` (`decision`, `storm_recent_ms`) | [`crate::watchdog::storm_decision`] over the same daemon session's earlier unattended rollbacks |
//! | `state_transition` | `vm.state_changed` | [`VmState::transition`] |
//! | `id_provenance` | every `trace_id`/`session_id` of a session | the session's journaled `id_seed` |
//!
//! Persisted outputs (backend results a decision used) are `snapshot.verify.passed` /
//! `snapshot.verify.skipped`, `snapshot.create.completed` and the reviewer named in a gate
//! decision. One a decision needs but the journal lacks is `MISSING_PERSISTED_AGENT_OUTPUT` in
//! production mode; audit mode asks the store instead (a live call) and marks the report
//! non-authoritative.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Map, Value};

use backstop_common::ids::seeded_id;
use backstop_common::ErrorCode;
use backstop_decide::{Candidate, Evidence, GateInput, LiveSnapshot, Need, Resolved};

use crate::lifecycle::{Transition, VmState};

/// spec/003 §2's modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayMode {
    /// Read-only reconstruction; a missing recorded result is looked up live (non-authoritative).
    Audit,
    /// Strict: every input must have been recorded; nothing is looked up live.
    Production,
    /// Audit, then a named snapshot restored into a sandbox VM (non-authoritative).
    Reexecute,
}

impl ReplayMode {
    pub fn parse(s: &str) -> Option<ReplayMode> {
        match s {
            "audit" => Some(ReplayMode::Audit),
            "production" => Some(ReplayMode::Production),
            "reexecute" => Some(ReplayMode::Reexecute),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayMode::Audit => "audit",
            ReplayMode::Production => "production",
            ReplayMode::Reexecute => "reexecute",
        }
    }
}

/// A snapshot's manifest as the store holds it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestLook {
    Missing,
    /// Present, but its signature does not match the host key (or it cannot be read).
    Forged(String),
    Present {
        sha256: String,
    },
}

/// What replay may ask of the store: read-only.
pub trait StoreView {
    fn manifest(&mut self, id: &str) -> ManifestLook;
    /// Audit mode's live call: does `id` verify now? `Err(code)` if not.
    fn verify_live(&mut self, id: &str) -> Result<(), String>;
}

/// The records on disk at the end of the journal: spec/003's "final answer".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FinalRecords {
    pub epoch: u64,
    pub marked: BTreeSet<String>,
    pub halted: bool,
}

/// One journal entry, as replay reads it.
#[derive(Debug, Clone)]
pub struct ReplayEntry {
    pub seq: u64,
    pub event: String,
    pub fields: Map<String, Value>,
}

/// A decision recomputed differently from how it was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Divergence {
    pub decision: String,
    pub at_seq: u64,
    /// Canonical JSON of `{"computed","decision","recorded","seq"}`.
    pub diff: String,
    /// First 32 hex digits of sha256 of `diff`: what a reviewer's force-continue token names.
    pub digest: String,
    /// Continued past with reviewer evidence (who).
    pub forced_by: Option<String>,
}

/// How a replay ended.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// `None`: every decision reproduced (or was forced past with evidence).
    pub code: Option<&'static str>,
    pub detail: String,
    pub authoritative: bool,
    pub decisions_checked: u64,
    pub entries_read: u64,
    pub divergences: Vec<Divergence>,
    /// Audit mode's live look-ups (what was not recorded), one line each.
    pub live_calls: Vec<String>,
    /// Why the report is not authoritative, one line each.
    pub non_authoritative_because: Vec<String>,
    /// Where it stopped (the seq of the entry that decided the outcome).
    pub stopped_at_seq: Option<u64>,
}

impl Outcome {
    /// Nothing read or decided yet; authoritative only in production mode.
    pub fn empty(mode: ReplayMode) -> Outcome {
        Outcome {
            code: None,
            detail: String::new(),
            authoritative: mode == ReplayMode::Production,
            decisions_checked: 0,
            entries_read: 0,
            divergences: Vec::new(),
            live_calls: Vec::new(),
            non_authoritative_because: Vec::new(),
            stopped_at_seq: None,
        }
    }
}

/// The longest `--timeout` a replay may be given: it runs on the VM's actor thread, so a host
/// trigger that arrives meanwhile waits for it at most this long.
pub const MAX_REPLAY_TIME: Duration = Duration::from_secs(600);

/// Limits (spec/003 §12).
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub max_steps: u64,
    pub max_time: Duration,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            max_steps: 5_000_000,
            max_time: Duration::from_secs(120),
        }
    }
}

/// Ids a session may draw before the provenance check gives up looking (each tick may draw one
/// that is never journaled).
const ID_LOOKAHEAD: u64 = 200_000;

/// A reviewer's approval of one divergence: `Ok(reviewer)` or `Err(why not)`.
pub type Approver<'a> = dyn FnMut(&str) -> Result<String, String> + 'a;

/// Why the walk stopped early.
struct Stop {
    code: ErrorCode,
    detail: String,
    seq: u64,
}

#[derive(Debug, Clone, PartialEq)]
enum Verified {
    Passed,
    Skipped,
}

/// One rollback in progress, keyed by its trace id.
#[derive(Debug, Default)]
struct Episode {
    requested_seq: u64,
    to: Option<String>,
    governed: bool,
    /// Only snapshots created before this are candidates (a trigger naming actions).
    before: Option<String>,
    /// The temporal bound applies (asked for on the control socket).
    bounded: bool,
    resume: bool,
    outcomes: HashMap<String, Verified>,
    target: Option<String>,
    expected_marks: Option<(Vec<String>, bool)>,
}

struct Session {
    seed: Option<String>,
    /// id → k for the ids drawn so far, and the next k to draw.
    drawn: HashMap<String, u64>,
    next_k: u64,
    session_id: Option<String>,
}

impl Session {
    fn new(seed: Option<String>) -> Session {
        Session {
            seed,
            drawn: HashMap::new(),
            next_k: 0,
            session_id: None,
        }
    }

    /// Whether `id` is one of the seeded ids of the daemon session being replayed (drawing more
    /// as needed).
    fn derives(&mut self, id: &str) -> bool {
        let Some(seed) = &self.seed else { return true };
        if self.drawn.contains_key(id) {
            return true;
        }
        let limit = self.next_k + ID_LOOKAHEAD;
        while self.next_k < limit {
            let k = self.next_k;
            self.next_k += 1;
            let drawn = seeded_id(seed, k);
            let hit = drawn == id;
            self.drawn.insert(drawn, k);
            if hit {
                return true;
            }
        }
        // Not found: give the lookahead back so one bad id does not hide the next good ones.
        self.next_k = limit - ID_LOOKAHEAD;
        false
    }
}

/// The walk's state: what the engine knew when it decided.
pub struct Replayer<'a> {
    mode: ReplayMode,
    from_seq: u64,
    view: &'a mut dyn StoreView,
    approve: &'a mut Approver<'a>,
    /// Published, in publication order.
    published: Vec<String>,
    pruned: BTreeSet<String>,
    marked: BTreeSet<String>,
    epoch: Option<u64>,
    vm_state: Option<VmState>,
    halted: bool,
    storm: Vec<i64>,
    session: Session,
    episodes: HashMap<String, Episode>,
    /// Each published snapshot's recorded parent (`None`: not recorded, before lineage).
    parents: HashMap<String, Option<Option<String>>>,
    /// Each published snapshot's recorded creation time.
    created: HashMap<String, String>,
    /// Each named snapshot's recorded name (`snapshot create --name`).
    names: HashMap<String, String>,
    /// Published snapshots of an unhealthy guest.
    unhealthy: std::collections::HashSet<String>,
    /// Forensic snapshots (never rollback targets).
    forensic: std::collections::HashSet<String>,
    /// Snapshots drift detection found failing (never rollback targets again).
    unusable: std::collections::HashSet<String>,
    out: Outcome,
}

fn s<'v>(f: &'v Map<String, Value>, k: &str) -> Option<&'v str> {
    f.get(k).and_then(Value::as_str)
}

/// A recorded manifest digest against the store's manifest (`RESULT_MISMATCH` if they differ;
/// a manifest not in the store is the missing-snapshot check's business).
fn digest_matches(
    looks: &HashMap<String, ManifestLook>,
    id: &str,
    rec: &str,
    seq: u64,
) -> Result<(), Stop> {
    match looks.get(id) {
        Some(ManifestLook::Present { sha256 }) if sha256 != rec => Err(Stop {
            code: ErrorCode::ResultMismatch,
            detail: format!(
                "snapshot {id}: the journal recorded manifest sha256 {rec} at seq {seq}; the store holds {sha256}"
            ),
            seq,
        }),
        _ => Ok(()),
    }
}

fn canonical(v: &Value) -> String {
    backstop_integrity::canonical::to_string(v).unwrap_or_default()
}

impl<'a> Replayer<'a> {
    pub fn new(
        mode: ReplayMode,
        from_seq: u64,
        view: &'a mut dyn StoreView,
        approve: &'a mut Approver<'a>,
    ) -> Replayer<'a> {
        Replayer {
            mode,
            from_seq,
            view,
            approve,
            published: Vec::new(),
            names: HashMap::new(),
            pruned: BTreeSet::new(),
            marked: BTreeSet::new(),
            epoch: None,
            vm_state: None,
            halted: false,
            storm: Vec::new(),
            session: Session::new(None),
            episodes: HashMap::new(),
            parents: HashMap::new(),
            created: HashMap::new(),
            unhealthy: Default::default(),
            forensic: Default::default(),
            unusable: Default::default(),
            out: Outcome::empty(mode),
        }
    }

    /// Runs spec/003 §6 over `entries` (already verified: the shell checks the chain first):
    /// referenced snapshots present (else `MISSING_SNAPSHOT`), their signatures (else
    /// `INTEGRITY_FAILURE`), every decision, then the final records (else `RESULT_MISMATCH`).
    pub fn run(mut self, entries: &[ReplayEntry], last: &FinalRecords, caps: Caps) -> Outcome {
        if self.mode != ReplayMode::Production {
            self.out.authoritative = false;
            self.out
                .non_authoritative_because
                .push(format!("{} mode", self.mode.as_str()));
        }
        match self.walk(entries, last, caps) {
            Ok(()) => {
                self.out.detail = format!(
                    "{} decisions over {} entries reproduced{}",
                    self.out.decisions_checked,
                    self.out.entries_read,
                    if self.out.divergences.is_empty() {
                        String::new()
                    } else {
                        format!(
                            "; {} divergence(s) forced past with reviewer evidence",
                            self.out.divergences.len()
                        )
                    }
                );
            }
            Err(stop) => {
                self.out.code = Some(stop.code.as_str());
                self.out.detail = stop.detail;
                self.out.stopped_at_seq = Some(stop.seq);
            }
        }
        self.out
    }

    fn walk(
        &mut self,
        entries: &[ReplayEntry],
        last: &FinalRecords,
        caps: Caps,
    ) -> Result<(), Stop> {
        // §6 step 2: every snapshot the journal still references must exist.
        let mut referenced: BTreeMap<String, u64> = BTreeMap::new();
        for e in entries {
            match e.event.as_str() {
                "snapshot.create.completed" if s(&e.fields, "result") == Some("ok") => {
                    if let Some(id) = s(&e.fields, "snapshot_id") {
                        referenced.entry(id.to_string()).or_insert(e.seq);
                    }
                }
                // Removed by retention or by a person (`snapshot delete`): gone on purpose.
                "snapshot.pruned" | "snapshot.deleted" => {
                    if let Some(id) = s(&e.fields, "snapshot_id") {
                        referenced.remove(id);
                    }
                }
                _ => {}
            }
        }
        let mut looks = HashMap::new();
        for (id, seq) in &referenced {
            let look = self.view.manifest(id);
            if look == ManifestLook::Missing {
                return Err(Stop {
                    code: ErrorCode::MissingSnapshot,
                    detail: format!(
                        "snapshot {id} (published at seq {seq}, never pruned) is not in the store"
                    ),
                    seq: *seq,
                });
            }
            looks.insert(id.clone(), look);
        }
        // §6 step 3: and carry a valid signature.
        for (id, look) in &looks {
            if let ManifestLook::Forged(why) = look {
                return Err(Stop {
                    code: ErrorCode::IntegrityFailure,
                    detail: format!("snapshot {id}: {why}"),
                    seq: referenced.get(id).copied().unwrap_or(0),
                });
            }
        }
        let started = Instant::now();
        for (n, e) in entries.iter().enumerate() {
            if n as u64 >= caps.max_steps || started.elapsed() > caps.max_time {
                return Err(Stop {
                    code: ErrorCode::ReplayTimeout,
                    detail: format!(
                        "stopped after {n} entries and {} ms (caps: {} entries, {} s)",
                        started.elapsed().as_millis(),
                        caps.max_steps,
                        caps.max_time.as_secs()
                    ),
                    seq: e.seq,
                });
            }
            self.out.entries_read += 1;
            self.entry(e, &looks)?;
        }
        let end_seq = entries.last().map(|e| e.seq).unwrap_or(0);
        self.close_episodes()?;
        // §6 step 9: the final answer.
        let computed = FinalRecords {
            epoch: self.epoch.unwrap_or(last.epoch),
            marked: self.marked.clone(),
            halted: self.halted,
        };
        if &computed != last {
            return Err(Stop {
                code: ErrorCode::ResultMismatch,
                detail: format!(
                    "the records on disk differ from what the journal leads to: {}",
                    canonical(&json!({"computed": computed, "recorded": last}))
                ),
                seq: end_seq,
            });
        }
        Ok(())
    }

    fn checking(&self, seq: u64) -> bool {
        seq >= self.from_seq
    }

    /// Compares one decision; a divergence stops the walk unless a reviewer approved it.
    fn compare(
        &mut self,
        decision: &str,
        seq: u64,
        recorded: Value,
        computed: Value,
    ) -> Result<(), Stop> {
        if !self.checking(seq) {
            return Ok(());
        }
        self.out.decisions_checked += 1;
        if recorded == computed {
            return Ok(());
        }
        let diff = canonical(&json!({
            "computed": computed, "decision": decision, "recorded": recorded, "seq": seq,
        }));
        let digest = backstop_integrity::sha256_hex(diff.as_bytes())[..32].to_string();
        let mut d = Divergence {
            decision: decision.to_string(),
            at_seq: seq,
            diff: diff.clone(),
            digest: digest.clone(),
            forced_by: None,
        };
        match (self.approve)(&digest) {
            Ok(reviewer) => {
                d.forced_by = Some(reviewer.clone());
                self.out.divergences.push(d);
                self.out.authoritative = false;
                self.out.non_authoritative_because.push(format!(
                    "divergence {digest} at seq {seq} forced past by {reviewer}"
                ));
                Ok(())
            }
            Err(why) => {
                self.out.divergences.push(d);
                let (code, detail) = if why.is_empty() {
                    (
                        ErrorCode::ReplayDivergence,
                        format!("{decision} at seq {seq}: {diff}"),
                    )
                } else {
                    (
                        ErrorCode::ForceContinueRequired,
                        format!(
                            "{decision} at seq {seq} diverges ({diff}); cannot continue: {why}"
                        ),
                    )
                };
                Err(Stop { code, detail, seq })
            }
        }
    }

    /// A recorded result a decision needs is missing.
    fn missing(
        &mut self,
        seq: u64,
        what: String,
        live: impl FnOnce(&mut Self) -> bool,
    ) -> Result<bool, Stop> {
        if self.mode == ReplayMode::Production {
            return Err(Stop {
                code: ErrorCode::MissingPersistedAgentOutput,
                detail: format!("{what} was never recorded; production replay makes no live call"),
                seq,
            });
        }
        let r = live(self);
        self.out
            .live_calls
            .push(format!("seq {seq}: {what} (looked up live: {r})"));
        Ok(r)
    }

    fn entry(
        &mut self,
        e: &ReplayEntry,
        looks: &HashMap<String, ManifestLook>,
    ) -> Result<(), Stop> {
        let f = &e.fields;
        let trace = s(f, "trace_id").map(str::to_string);
        if e.event != "daemon.started" {
            self.check_ids(e)?;
        }
        match e.event.as_str() {
            "daemon.started" => {
                self.close_episodes()?;
                let seed = s(f, "id_seed").map(str::to_string);
                if seed.is_none() || f.get("config").is_none() {
                    self.missing(
                        e.seq,
                        "the session's id seed and config in force".into(),
                        |_| true,
                    )?;
                }
                self.session = Session::new(seed);
                self.session.session_id = s(f, "session_id").map(str::to_string);
                if let Some(sid) = self.session.session_id.clone() {
                    let computed = self.session.seed.as_ref().map(|seed| seeded_id(seed, 0));
                    if computed.is_some() {
                        self.session.derives(&sid);
                        self.compare("id_provenance", e.seq, json!(sid), json!(computed))?;
                    }
                }
                self.storm.clear();
                self.vm_state = Some(VmState::Stopped);
            }
            "snapshot.create.completed" if s(f, "result") == Some("ok") => {
                let Some(id) = s(f, "snapshot_id") else {
                    return Ok(());
                };
                if let Some(rec) = s(f, "manifest_sha256") {
                    digest_matches(looks, id, rec, e.seq)?;
                }
                if !self.published.iter().any(|p| p == id) {
                    self.published.push(id.to_string());
                }
                let parent = f.get("parent").map(|p| p.as_str().map(str::to_string));
                self.parents.insert(id.to_string(), parent);
                if let Some(c) = s(f, "created_at") {
                    self.created.insert(id.to_string(), c.to_string());
                }
                if let Some(n) = s(f, "name") {
                    self.names.insert(id.to_string(), n.to_string());
                }
                if f.get("healthy") == Some(&Value::Bool(false)) {
                    self.unhealthy.insert(id.to_string());
                }
                if s(f, "trigger") == Some(crate::forensic::FORENSIC) {
                    self.forensic.insert(id.to_string());
                }
            }
            "snapshot.pruned" | "snapshot.deleted" => {
                if let Some(id) = s(f, "snapshot_id") {
                    self.pruned.insert(id.to_string());
                    self.marked.remove(id);
                }
            }
            "snapshot.restore.requested" => {
                let Some(trace) = trace else { return Ok(()) };
                let (governed, resume) = match (f.get("governed"), f.get("resume")) {
                    (Some(Value::Bool(g)), Some(Value::Bool(r))) => (*g, *r),
                    _ => {
                        // Journals from before these were recorded: inferred (non-authoritative).
                        let ty = s(f, "rollback_type").unwrap_or_default();
                        let trig = s(f, "trigger").unwrap_or_default();
                        self.missing(
                            e.seq,
                            "whether the restore gate governed this rollback".into(),
                            |_| true,
                        )?;
                        (
                            ty == "session" && trig != "daemon_resume",
                            trig == "daemon_resume",
                        )
                    }
                };
                self.episodes.insert(
                    trace,
                    Episode {
                        requested_seq: e.seq,
                        to: s(f, "snapshot_id").map(str::to_string),
                        governed,
                        before: s(f, "before").map(str::to_string),
                        bounded: f.get("bounded").and_then(Value::as_bool).unwrap_or(false),
                        resume,
                        ..Default::default()
                    },
                );
            }
            "snapshot.verify.passed" | "snapshot.verify.skipped" => {
                let (Some(trace), Some(id)) = (trace, s(f, "snapshot_id")) else {
                    return Ok(());
                };
                let passed = e.event == "snapshot.verify.passed";
                if let (true, Some(rec)) = (passed, s(f, "manifest_sha256")) {
                    digest_matches(looks, id, rec, e.seq)?;
                }
                // Passed over for the guest's health, not verified: not a verification result.
                if s(f, "code") == Some(ErrorCode::SnapshotGuestUnhealthy.as_str()) {
                    return Ok(());
                }
                if let Some(ep) = self.episodes.get_mut(&trace) {
                    ep.outcomes.insert(
                        id.to_string(),
                        if passed {
                            Verified::Passed
                        } else {
                            Verified::Skipped
                        },
                    );
                }
            }
            "snapshot.restore.policy_decision" => {
                let Some(trace) = trace else { return Ok(()) };
                let Some(mut ep) = self.episodes.remove(&trace) else {
                    return Ok(());
                };
                let recorded = s(f, "snapshot_id").map(str::to_string);
                let computed = self.target(&mut ep, e.seq)?;
                self.compare("rollback_target", e.seq, json!(recorded), json!(computed))?;
                let target = recorded.clone().unwrap_or_default();
                let gate = self.gate(&mut ep, &target, f, e.seq)?;
                self.compare("restore_gate", e.seq, json!(s(f, "decision")), json!(gate))?;
                ep.target = recorded;
                self.episodes.insert(trace, ep);
            }
            "snapshot.restore.failed" => {
                let Some(trace) = trace else { return Ok(()) };
                if s(f, "result") == Some("refused")
                    && f.get("vm_halted") == Some(&Value::Bool(true))
                {
                    // Refused for want of a verified snapshot: there must have been none.
                    if let Some(mut ep) = self.episodes.remove(&trace) {
                        let computed = self.target(&mut ep, e.seq)?;
                        self.compare("rollback_target", e.seq, Value::Null, json!(computed))?;
                    }
                } else if s(f, "result") == Some("refused") {
                    self.episodes.remove(&trace);
                }
            }
            "rollback.completed" => {
                let Some(trace) = trace else { return Ok(()) };
                let recorded = f.get("epoch").and_then(Value::as_u64);
                let Some(mut ep) = self.episodes.remove(&trace) else {
                    return Ok(());
                };
                if let Some(prev) = self.epoch {
                    let computed = if ep.resume { prev } else { prev + 1 };
                    self.compare("epoch", e.seq, json!(recorded), json!(computed))?;
                }
                self.epoch = recorded.or(self.epoch);
                let target = s(f, "snapshot_id")
                    .map(str::to_string)
                    .or(ep.target.clone());
                if let Some(target) = target {
                    let after = self
                        .published
                        .iter()
                        .position(|p| *p == target)
                        .map_or(0, |i| i + 1);
                    let listed: Vec<String> = self.published[after..]
                        .iter()
                        .filter(|p| !self.pruned.contains(*p))
                        .cloned()
                        .collect();
                    let parents = &self.parents;
                    let parent_of = |id: &str| parents.get(id).cloned().flatten();
                    let marked: Vec<String> =
                        crate::policy::lineage::left_behind(&target, &listed, &parent_of)
                            .into_iter()
                            .filter(|p| !self.marked.contains(p))
                            .collect();
                    let unmarked = self.marked.contains(&target);
                    for m in &marked {
                        self.marked.insert(m.clone());
                    }
                    self.marked.remove(&target);
                    if !marked.is_empty() || unmarked {
                        ep.expected_marks = Some((marked, unmarked));
                        ep.requested_seq = e.seq;
                        self.episodes.insert(trace, ep);
                    }
                }
            }
            "snapshot.marked_rolled_back" => {
                let Some(trace) = trace else { return Ok(()) };
                let recorded_marked: Vec<String> = f
                    .get("marked")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let recorded_unmarked = f
                    .get("target_unmarked")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let expected = self
                    .episodes
                    .remove(&trace)
                    .and_then(|ep| ep.expected_marks)
                    .unwrap_or_default();
                self.compare(
                    "soft_rollback_marks",
                    e.seq,
                    json!({"marked": recorded_marked, "target_unmarked": recorded_unmarked}),
                    json!({"marked": expected.0, "target_unmarked": expected.1}),
                )?;
                // Carry on from what was recorded, so each decision is judged on its own.
                for m in &expected.0 {
                    self.marked.remove(m);
                }
                for m in recorded_marked {
                    self.marked.insert(m);
                }
                if let Some(t) = s(f, "snapshot_id") {
                    if recorded_unmarked {
                        self.marked.remove(t);
                    }
                }
            }
            "rollback.triggered" if f.contains_key("decision") => {
                let now = f.get("decided_at_ms").and_then(Value::as_i64).unwrap_or(0);
                let d = crate::watchdog::storm_decision(&self.storm, now);
                let computed = json!({"decision": if d.halt { "halt" } else { "rollback" }, "recent_ms": d.recent});
                let recorded =
                    json!({"decision": f.get("decision"), "recent_ms": f.get("storm_recent_ms")});
                self.compare("storm_guard", e.seq, recorded, computed)?;
                self.storm = d.recent;
                if s(f, "decision") == Some("rollback") {
                    self.storm.push(now);
                }
            }
            "vm.state_changed" => {
                let from = s(f, "from").and_then(VmState::parse);
                let to = s(f, "to").and_then(VmState::parse);
                let t = s(f, "transition").and_then(Transition::parse);
                if let (Some(from), Some(to), Some(t)) = (from, to, t) {
                    let start = self.vm_state.unwrap_or(from);
                    let computed = start.transition(t).map(VmState::as_str).ok();
                    self.compare(
                        "state_transition",
                        e.seq,
                        json!({"from": from.as_str(), "to": to.as_str()}),
                        json!({"from": start.as_str(), "to": computed}),
                    )?;
                    self.vm_state = Some(to);
                }
            }
            "vm.started" | "vm.resumed" | "vm.adopted" => {
                if let Some(ep) = f.get("epoch").and_then(Value::as_u64) {
                    if let Some(prev) = self.epoch {
                        self.compare("epoch", e.seq, json!(ep), json!(prev))?;
                    }
                    self.epoch = Some(ep);
                }
            }
            // Drift detection marks a snapshot that no longer verifies unusable, until a full
            // verification passes again (`usable_again`).
            "DriftDetectedEvent" if s(f, "invariant_id") == Some("snapshot.verifies") => {
                if let Some(id) = s(f, "node_id") {
                    self.unusable.insert(id.to_string());
                }
            }
            "DriftResolvedEvent"
                if s(f, "invariant_id") == Some("snapshot.verifies")
                    && f.get("usable_again").and_then(Value::as_bool) == Some(true) =>
            {
                if let Some(id) = s(f, "node_id") {
                    self.unusable.remove(id);
                }
            }
            "vm.halted" => self.halted = true,
            "vm.halt_cleared" => self.halted = false,
            _ => {}
        }
        Ok(())
    }

    /// Every id an entry of the daemon session being replayed carries must derive from its seed.
    fn check_ids(&mut self, e: &ReplayEntry) -> Result<(), Stop> {
        let Some(sid) = self.session.session_id.clone() else {
            return Ok(());
        };
        // Entries written by others (the supervisor) carry other session ids.
        if s(&e.fields, "session_id") != Some(sid.as_str()) {
            return Ok(());
        }
        if let Some(trace) = s(&e.fields, "trace_id") {
            if !self.session.derives(trace) {
                self.compare(
                    "id_provenance",
                    e.seq,
                    json!(trace),
                    json!(format!(
                        "an id derived from the session's seed (first {} draws)",
                        self.session.next_k + ID_LOOKAHEAD
                    )),
                )?;
            }
        }
        Ok(())
    }

    /// A published snapshot as the decisions see it, from what the journal recorded.
    fn candidate(&self, id: &str) -> Candidate {
        Candidate {
            created_at: self.created.get(id).cloned(),
            healthy: !self.unhealthy.contains(id),
            marked: self.marked.contains(id),
            forensic: self.forensic.contains(id),
            unusable: self.unusable.contains(id),
            ..Candidate::new(id)
        }
    }

    /// The published snapshots not pruned, in publication order.
    fn live(&self) -> Vec<&String> {
        self.published
            .iter()
            .filter(|p| !self.pruned.contains(*p))
            .collect()
    }

    /// The target as the engine chose it ([`backstop_decide::choose_target`] over the
    /// recorded snapshots, answered with this rollback's recorded verification outcomes) — or
    /// for a named target, the one [`backstop_decide::resolve`] finds (if its pass was
    /// recorded).
    fn target(&mut self, ep: &mut Episode, seq: u64) -> Result<Option<String>, Stop> {
        if let Some(to) = ep.to.clone() {
            let live: Vec<LiveSnapshot<'_>> = self
                .live()
                .into_iter()
                .map(|id| LiveSnapshot {
                    id,
                    name: self.names.get(id).map(String::as_str),
                })
                .collect();
            let Resolved::Found { id, .. } = backstop_decide::resolve(&to, &live) else {
                return Ok(None);
            };
            return Ok(self.verified(ep, &id, seq)?.then_some(id));
        }
        let candidates: Vec<Candidate> = self
            .live()
            .into_iter()
            .rev()
            .map(|id| self.candidate(id))
            .collect();
        let before = ep.before.clone();
        let mut recorded = |id: &str| self.verified(ep, id, seq);
        let choice = backstop_decide::choose_target(&candidates, before.as_deref(), &mut recorded)?;
        Ok(choice.target)
    }

    /// Whether `id` verified in this rollback: the recorded outcome, or (audit) a live call.
    fn verified(&mut self, ep: &mut Episode, id: &str, seq: u64) -> Result<bool, Stop> {
        match ep.outcomes.get(id) {
            Some(v) => Ok(*v == Verified::Passed),
            None => {
                let idc = id.to_string();
                let r = self.missing(
                    seq,
                    format!("the verification of snapshot {id} this rollback's decision used"),
                    |me| me.view.verify_live(&idc).is_ok(),
                )?;
                ep.outcomes.insert(
                    id.to_string(),
                    if r {
                        Verified::Passed
                    } else {
                        Verified::Skipped
                    },
                );
                Ok(r)
            }
        }
    }

    /// The restore gate's decision for `target` ([`backstop_decide::restore_gate`]), from the
    /// recorded inputs: `governed` and `bounded` from the request, the target's age and the
    /// bound from the decision entry, the marks, newer snapshots' recorded verification
    /// outcomes, and the reviewer the decision named.
    fn gate(
        &mut self,
        ep: &mut Episode,
        target: &str,
        f: &Map<String, Value>,
        seq: u64,
    ) -> Result<&'static str, Stop> {
        let input = GateInput {
            governed: ep.governed,
            bounded: ep.bounded,
            // The target's age is a clock reading at decision time: a recorded input.
            target_age_s: f.get("target_age_s").and_then(Value::as_u64),
            temporal_bound_s: f.get("temporal_bound_s").and_then(Value::as_u64),
            target_marked: self.marked.contains(target),
        };
        let reviewer = f.get("reviewer").filter(|r| !r.is_null()).map(|r| match r {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        });
        let mut recorded = RecordedGate {
            replayer: self,
            ep,
            target,
            reviewer,
            seq,
        };
        Ok(backstop_decide::restore_gate(&input, &mut recorded)?.as_str())
    }

    /// Rollbacks whose soft-rollback marks were expected but never journaled.
    fn close_episodes(&mut self) -> Result<(), Stop> {
        let mut open: Vec<(u64, Episode)> = self
            .episodes
            .drain()
            .filter(|(_, ep)| ep.expected_marks.is_some())
            .map(|(_, ep)| (ep.requested_seq, ep))
            .collect();
        open.sort_by_key(|(s, _)| *s);
        for (at, ep) in open {
            let (m, u) = ep.expected_marks.unwrap_or_default();
            self.compare(
                "soft_rollback_marks",
                at,
                Value::Null,
                json!({"marked": m, "target_unmarked": u}),
            )?;
        }
        Ok(())
    }
}

/// The gate's questions, answered from the record: newer snapshots as the journal published
/// them, their verification outcomes as this rollback recorded them, and the reviewer the
/// decision named (replay cannot check a token again; the live gate did).
struct RecordedGate<'r, 'a> {
    replayer: &'r mut Replayer<'a>,
    ep: &'r mut Episode,
    target: &'r str,
    reviewer: Option<String>,
    seq: u64,
}

impl backstop_decide::Verifier for RecordedGate<'_, '_> {
    type Error = Stop;
    fn verifies(&mut self, id: &str) -> Result<bool, Stop> {
        self.replayer.verified(self.ep, id, self.seq)
    }
}

impl backstop_decide::GateInputs for RecordedGate<'_, '_> {
    fn newer(&mut self) -> Result<Vec<Candidate>, Stop> {
        let r = &*self.replayer;
        let Some(i) = r.published.iter().position(|p| p == self.target) else {
            return Ok(Vec::new());
        };
        Ok(r.published[i + 1..]
            .iter()
            .rev()
            .filter(|p| !r.pruned.contains(*p))
            .map(|p| r.candidate(p))
            .collect())
    }

    fn evidence(&mut self, _need: &Need) -> Result<Evidence, String> {
        self.reviewer
            .clone()
            .map(|reviewer| Evidence {
                reviewer,
                expires_at: None,
            })
            .ok_or_else(|| "no reviewer recorded".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store as a map: id → manifest look; `live_ok` answers audit mode's live calls.
    struct FakeStore {
        looks: HashMap<String, ManifestLook>,
        live_ok: bool,
        live_calls: u32,
    }

    impl StoreView for FakeStore {
        fn manifest(&mut self, id: &str) -> ManifestLook {
            self.looks.get(id).cloned().unwrap_or(ManifestLook::Missing)
        }
        fn verify_live(&mut self, _id: &str) -> Result<(), String> {
            self.live_calls += 1;
            if self.live_ok {
                Ok(())
            } else {
                Err("ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED".into())
            }
        }
    }

    fn store(ids: &[&str]) -> FakeStore {
        FakeStore {
            looks: ids
                .iter()
                .map(|i| {
                    (
                        i.to_string(),
                        ManifestLook::Present {
                            sha256: format!("sha-{i}"),
                        },
                    )
                })
                .collect(),
            live_ok: true,
            live_calls: 0,
        }
    }

    const SEED: &str = "seed-1";

    fn id(k: u64) -> String {
        seeded_id(SEED, k)
    }

    /// A journal: a session start, three snapshots (a, b, c) and one emergency rollback whose
    /// candidate c failed verification, so it went to b, marking c.
    fn journal() -> Vec<ReplayEntry> {
        let sid = id(0);
        let mut seq = 0;
        let mut e = |event: &str, f: Value| {
            seq += 1;
            let mut fields = f.as_object().cloned().unwrap_or_default();
            fields.entry("session_id").or_insert(json!(sid));
            ReplayEntry {
                seq,
                event: event.into(),
                fields,
            }
        };
        let rb = id(4);
        vec![
            e("daemon.started", json!({"id_seed": SEED, "config": {}})),
            e("vm.started", json!({"trace_id": id(1), "epoch": 0})),
            e(
                "snapshot.create.completed",
                json!({"trace_id": id(1), "snapshot_id": "a", "result": "ok", "manifest_sha256": "sha-a"}),
            ),
            e(
                "snapshot.create.completed",
                json!({"trace_id": id(2), "snapshot_id": "b", "result": "ok", "manifest_sha256": "sha-b"}),
            ),
            e(
                "snapshot.create.completed",
                json!({"trace_id": id(3), "snapshot_id": "c", "result": "ok"}),
            ),
            e(
                "rollback.triggered",
                json!({"trace_id": rb, "decision": "rollback", "decided_at_ms": 1_000, "storm_recent_ms": []}),
            ),
            e(
                "snapshot.restore.requested",
                json!({"trace_id": rb, "snapshot_id": null, "governed": false, "resume": false}),
            ),
            e(
                "snapshot.verify.skipped",
                json!({"trace_id": rb, "snapshot_id": "c", "code": "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"}),
            ),
            e(
                "snapshot.verify.passed",
                json!({"trace_id": rb, "snapshot_id": "b", "manifest_sha256": "sha-b"}),
            ),
            e(
                "snapshot.restore.policy_decision",
                json!({"trace_id": rb, "snapshot_id": "b", "decision": "override"}),
            ),
            e(
                "vm.state_changed",
                json!({"trace_id": rb, "from": "stopped", "to": "rolling_back", "transition": "begin_rollback"}),
            ),
            e(
                "vm.state_changed",
                json!({"trace_id": rb, "from": "rolling_back", "to": "running", "transition": "rolled_back"}),
            ),
            e(
                "rollback.completed",
                json!({"trace_id": rb, "snapshot_id": "b", "epoch": 1}),
            ),
            e(
                "snapshot.marked_rolled_back",
                json!({"trace_id": rb, "snapshot_id": "b", "marked": ["c"], "target_unmarked": false}),
            ),
        ]
    }

    fn last() -> FinalRecords {
        FinalRecords {
            epoch: 1,
            marked: ["c".to_string()].into(),
            halted: false,
        }
    }

    fn run(
        entries: &[ReplayEntry],
        view: &mut FakeStore,
        mode: ReplayMode,
        force: Option<&str>,
    ) -> Outcome {
        let mut approve = |digest: &str| match force {
            Some(d) if d == digest => Ok("reviewer".to_string()),
            Some(_) => Err("token names another divergence".to_string()),
            None => Err(String::new()),
        };
        Replayer::new(mode, 1, view, &mut approve).run(entries, &last(), Caps::default())
    }

    /// A production replay of `j` over a store holding a, b and c.
    fn prod(j: &[ReplayEntry]) -> Outcome {
        run(
            j,
            &mut store(&["a", "b", "c"]),
            ReplayMode::Production,
            None,
        )
    }

    fn set(entries: &mut [ReplayEntry], seq: u64, key: &str, v: Value) {
        entries[(seq - 1) as usize].fields.insert(key.into(), v);
    }

    /// Drift detection's records of snapshot c, folded in one by one: whether c is a candidate
    /// after each.
    fn c_unusable_after(records: &[(&str, Value)]) -> Vec<bool> {
        let mut view = store(&["c"]);
        let mut approve = |_: &str| Err(String::new());
        let mut r = Replayer::new(ReplayMode::Production, 1, &mut view, &mut approve);
        let looks = HashMap::new();
        records
            .iter()
            .enumerate()
            .map(|(k, (event, f))| {
                let mut fields = f.as_object().cloned().unwrap_or_default();
                fields.insert("invariant_id".into(), json!("snapshot.verifies"));
                fields.insert("node_id".into(), json!("c"));
                let e = ReplayEntry {
                    seq: k as u64 + 1,
                    event: event.to_string(),
                    fields,
                };
                assert!(r.entry(&e, &looks).is_ok());
                r.candidate("c").unusable
            })
            .collect()
    }

    /// A snapshot drift detection marked unusable stays so through a resolution by a fresh
    /// snapshot, and is a candidate again once a verification that passed cleared the mark
    /// (`usable_again`), as in the engine.
    #[test]
    fn the_unusable_mark_lasts_until_a_resolution_clears_it() {
        let detected = (
            "DriftDetectedEvent",
            json!({"drift_type": "passive_read", "snapshot_id": "c"}),
        );
        let fresh = (
            "DriftResolvedEvent",
            json!({"snapshot_id": "c", "resolution": "marked unusable (never a rollback target); fresh snapshot d taken"}),
        );
        let cleared = (
            "DriftResolvedEvent",
            json!({"snapshot_id": "c", "resolution": "verified whole again", "usable_again": true}),
        );
        assert_eq!(
            c_unusable_after(&[detected.clone(), fresh, cleared, detected]),
            [true, true, false, true]
        );
    }

    #[test]
    fn a_named_target_resolves_as_the_store_does() {
        // b was named `vb` when taken, and the rollback asked for it by that name.
        let mut j = journal();
        set(&mut j, 4, "name", json!("vb"));
        set(&mut j, 7, "snapshot_id", json!("vb"));
        let o = prod(&j);
        assert_eq!(o.code, None, "{o:?}");
        // Unrecorded, the name names nothing: the recorded target is not reproduced.
        let mut j = journal();
        set(&mut j, 7, "snapshot_id", json!("vb"));
        assert_eq!(prod(&j).code, Some("REPLAY_DIVERGENCE"));
    }

    #[test]
    fn a_faithful_journal_reproduces() {
        let o = run(
            &journal(),
            &mut store(&["a", "b", "c"]),
            ReplayMode::Production,
            None,
        );
        assert_eq!(o.code, None, "{o:?}");
        assert!(o.authoritative);
        // session id, storm guard, target, gate, 2 transitions, epoch, marks, ids of 11 entries.
        assert!(o.decisions_checked >= 8, "{o:?}");
    }

    #[test]
    fn a_changed_target_diverges_with_a_canonical_diff() {
        let mut j = journal();
        set(&mut j, 10, "snapshot_id", json!("a"));
        let o = prod(&j);
        assert_eq!(o.code, Some("REPLAY_DIVERGENCE"));
        assert_eq!(
            o.divergences[0].diff,
            r#"{"computed":"b","decision":"rollback_target","recorded":"a","seq":10}"#
        );
        assert_eq!(o.stopped_at_seq, Some(10));
    }

    #[test]
    fn force_continue_needs_the_divergence_named_and_is_non_authoritative() {
        let mut j = journal();
        set(&mut j, 13, "epoch", json!(7));
        let first = prod(&j);
        assert_eq!(first.code, Some("REPLAY_DIVERGENCE"));
        let digest = first.divergences[0].digest.clone();
        let wrong = run(
            &j,
            &mut store(&["a", "b", "c"]),
            ReplayMode::Production,
            Some("0000"),
        );
        assert_eq!(wrong.code, Some("FORCE_CONTINUE_REQUIRED"));
        // Forced past the epoch; the final records then disagree with the journal (epoch 7).
        let forced = run(
            &j,
            &mut store(&["a", "b", "c"]),
            ReplayMode::Production,
            Some(&digest),
        );
        assert_eq!(forced.divergences[0].forced_by.as_deref(), Some("reviewer"));
        assert!(!forced.authoritative);
        assert_eq!(forced.code, Some("RESULT_MISMATCH"));
    }

    #[test]
    fn a_missing_verification_fails_production_and_is_looked_up_in_audit() {
        let mut j = journal();
        j.remove(8); // snapshot.verify.passed of b
        let mut s = store(&["a", "b", "c"]);
        let o = run(&j, &mut s, ReplayMode::Production, None);
        assert_eq!(o.code, Some("MISSING_PERSISTED_AGENT_OUTPUT"));
        assert_eq!(s.live_calls, 0, "production never calls the store live");
        let o = run(&j, &mut s, ReplayMode::Audit, None);
        assert_eq!(o.code, None, "{o:?}");
        assert!(!o.authoritative);
        assert_eq!(s.live_calls, 1);
        assert_eq!(o.live_calls.len(), 1);
    }

    #[test]
    fn store_problems_come_first_in_spec_order() {
        let o = run(
            &journal(),
            &mut store(&["a", "c"]),
            ReplayMode::Production,
            None,
        );
        assert_eq!(o.code, Some("MISSING_SNAPSHOT"));
        assert_eq!(o.decisions_checked, 0);
        let mut s = store(&["a", "b", "c"]);
        s.looks.insert(
            "a".into(),
            ManifestLook::Forged("signature mismatch".into()),
        );
        let o = run(&journal(), &mut s, ReplayMode::Production, None);
        assert_eq!(o.code, Some("INTEGRITY_FAILURE"));
        let mut s = store(&["a", "b", "c"]);
        s.looks.insert(
            "b".into(),
            ManifestLook::Present {
                sha256: "other".into(),
            },
        );
        let o = run(&journal(), &mut s, ReplayMode::Production, None);
        assert_eq!(o.code, Some("RESULT_MISMATCH"));
    }

    #[test]
    fn a_pruned_snapshot_is_not_missing() {
        let mut j = journal();
        let n = j.len() as u64;
        j.push(ReplayEntry {
            seq: n + 1,
            event: "snapshot.pruned".into(),
            fields: json!({"session_id": id(0), "trace_id": id(5), "snapshot_id": "a"})
                .as_object()
                .cloned()
                .unwrap(),
        });
        let o = run(&j, &mut store(&["b", "c"]), ReplayMode::Production, None);
        assert_eq!(o.code, None, "{o:?}");
    }

    #[test]
    fn the_storm_guard_and_transitions_and_ids_are_checked() {
        let mut j = journal();
        set(&mut j, 6, "decision", json!("halt"));
        let o = prod(&j);
        assert_eq!(o.divergences[0].decision, "storm_guard");
        let mut j = journal();
        set(&mut j, 11, "from", json!("running"));
        set(&mut j, 11, "to", json!("halted"));
        let o = prod(&j);
        assert_eq!(o.divergences[0].decision, "state_transition");
        let mut j = journal();
        set(
            &mut j,
            4,
            "trace_id",
            json!("0123456789abcdef0123456789abcdef"),
        );
        let o = prod(&j);
        assert_eq!(o.divergences[0].decision, "id_provenance");
    }

    #[test]
    fn the_final_records_must_match_and_caps_stop_a_long_replay() {
        let mut v = store(&["a", "b", "c"]);
        let mut approve = |_: &str| Err(String::new());
        let wrong = FinalRecords {
            epoch: 1,
            marked: BTreeSet::new(),
            halted: false,
        };
        let o = Replayer::new(ReplayMode::Production, 1, &mut v, &mut approve).run(
            &journal(),
            &wrong,
            Caps::default(),
        );
        assert_eq!(o.code, Some("RESULT_MISMATCH"));
        let mut approve = |_: &str| Err(String::new());
        let caps = Caps {
            max_steps: 3,
            max_time: Duration::from_secs(60),
        };
        let o = Replayer::new(ReplayMode::Production, 1, &mut v, &mut approve).run(
            &journal(),
            &last(),
            caps,
        );
        assert_eq!(o.code, Some("REPLAY_TIMEOUT"));
        assert_eq!(o.entries_read, 3);
    }

    #[test]
    fn decisions_before_from_seq_are_applied_not_compared() {
        let mut j = journal();
        set(&mut j, 10, "snapshot_id", json!("a"));
        let mut v = store(&["a", "b", "c"]);
        let mut approve = |_: &str| Err(String::new());
        let all = Replayer::new(ReplayMode::Production, 1, &mut v, &mut approve).run(
            &j,
            &last(),
            Caps::default(),
        );
        let mut approve = |_: &str| Err(String::new());
        let late = Replayer::new(ReplayMode::Production, 12, &mut v, &mut approve).run(
            &j,
            &last(),
            Caps::default(),
        );
        assert_eq!(all.code, Some("REPLAY_DIVERGENCE"));
        assert!(late.decisions_checked > 0);
        assert_eq!(late.code, None, "{late:?}");
    }
}
