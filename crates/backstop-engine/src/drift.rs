//! Drift detection (spec/002 §3): whether the running VM is still the VM the engine believes it
//! runs. This file is the pure core — the invariants (stable id, severity, action, which backends
//! can observe them), the check of what was observed against what the engine expects, the book of
//! open and resolved drift, and the incremental re-verification plan — all functions of their
//! inputs, unit-tested without QEMU. Observing (QMP, the store, the journal, statvfs), journaling
//! and acting is the shell, [`shell`], run by the actor.
//!
//! Three strategies feed the same check: invariant-based (cheap invariants after every state
//! change of the VM), active (a reconciliation pass every `drift.reconcile_minutes`, which also
//! re-verifies snapshots a slice at a time) and passive (a snapshot read that fails
//! verification). A facet a backend cannot observe is *not checked*, never passed.
//!
//! It must never resolve a drift it did not look at again, and never act on a check it could
//! not make.

pub(crate) mod shell;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use backstop_hypervisor::{ActiveLayer, LinkState};

/// How bad a drift is. HIGH and CRITICAL act (see [`InvariantId::action`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Severity {
    Low,
    Medium,
    High,
    Critical,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Low => "LOW",
            Severity::Medium => "MEDIUM",
            Severity::High => "HIGH",
            Severity::Critical => "CRITICAL",
        }
    }
}

/// What the engine does about a violation, beyond journaling it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriftAction {
    /// Journal (and show) only.
    Record,
    /// Emergency rollback (a fresh QEMU with the configured devices only); HALT if it fails.
    Rollback,
    /// Mark the snapshot unusable (persisted, never a rollback target), quarantine its damaged
    /// chunks, and take a fresh snapshot at once.
    MarkUnusable,
}

impl DriftAction {
    pub fn as_str(self) -> &'static str {
        match self {
            DriftAction::Record => "record",
            DriftAction::Rollback => "emergency rollback, HALT if it fails",
            DriftAction::MarkUnusable => "mark unusable, fresh snapshot",
        }
    }
}

/// The strategy that found a drift: spec/002's `drift_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Checked after a state change of the VM (snapshot, rollback, grant/revoke, resume).
    InvariantViolation,
    /// Found by the periodic reconciliation pass.
    ActiveReconciliation,
    /// Found when a snapshot was read (list, show, verify, a rollback's candidate).
    PassiveRead,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::InvariantViolation => "invariant_violation",
            Strategy::ActiveReconciliation => "active_reconciliation",
            Strategy::PassiveRead => "passive_read",
        }
    }
}

/// The invariants, each with a stable id (journaled, asserted by tests, documented in
/// docs/drift.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum InvariantId {
    /// Each captured disk's writable top layer in the running hypervisor is the one the engine
    /// set.
    DiskActiveLayer,
    /// The devices the hypervisor reports are the launched shape plus the ledger's grants.
    DeviceSet,
    /// No NIC's link is up unless it was up at launch or is granted.
    LinkState,
    /// The hypervisor process is the one launched, alive, with the launched shape's fingerprint.
    ProcessIdentity,
    /// Each snapshot checked (the newest usable one at least) verifies.
    SnapshotVerifies,
    /// The audit journal on disk ends where its sealed head file says.
    JournalHead,
    /// The state directory has more free space than `daemon.min_free_mib`.
    StateDirSpace,
}

/// Whether a backend can observe an invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    Checked,
    /// Not observable there; the reason is shown.
    NotChecked(&'static str),
}

impl InvariantId {
    pub const ALL: [InvariantId; 7] = [
        InvariantId::DiskActiveLayer,
        InvariantId::DeviceSet,
        InvariantId::LinkState,
        InvariantId::ProcessIdentity,
        InvariantId::SnapshotVerifies,
        InvariantId::JournalHead,
        InvariantId::StateDirSpace,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InvariantId::DiskActiveLayer => "disk.active_layer",
            InvariantId::DeviceSet => "device.set",
            InvariantId::LinkState => "nic.link",
            InvariantId::ProcessIdentity => "process.identity",
            InvariantId::SnapshotVerifies => "snapshot.verifies",
            InvariantId::JournalHead => "journal.head",
            InvariantId::StateDirSpace => "state_dir.free_space",
        }
    }

    pub fn parse(s: &str) -> Option<InvariantId> {
        InvariantId::ALL.into_iter().find(|i| i.as_str() == s)
    }

    pub fn severity(self) -> Severity {
        match self {
            // A device the ledger does not allow is hardware access nobody granted.
            InvariantId::DeviceSet => Severity::Critical,
            // A disk writing a layer the engine did not set breaks every later snapshot's
            // chain; a dead or swapped process is a VM the engine does not control.
            InvariantId::DiskActiveLayer | InvariantId::ProcessIdentity => Severity::High,
            // A rollback target that does not verify is no rollback target.
            InvariantId::SnapshotVerifies => Severity::High,
            InvariantId::JournalHead => Severity::High,
            InvariantId::LinkState | InvariantId::StateDirSpace => Severity::Medium,
        }
    }

    /// What is done about a violation (HIGH/CRITICAL invariants with a safe remedy act; the
    /// others are journaled and shown for a person).
    pub fn action(self) -> DriftAction {
        match self {
            InvariantId::DeviceSet => DriftAction::Rollback,
            InvariantId::SnapshotVerifies => DriftAction::MarkUnusable,
            // The watchdog already rolls back a dead process; a layer or a journal head
            // changed by hand is for a person to look at (a rollback would hide it).
            _ => DriftAction::Record,
        }
    }

    /// One line saying what the invariant asserts.
    pub fn what(self) -> &'static str {
        match self {
            InvariantId::DiskActiveLayer => {
                "each captured disk's top layer in the hypervisor is the layer the engine set"
            }
            InvariantId::DeviceSet => {
                "the hypervisor's devices are the launched shape plus the ledger's grants"
            }
            InvariantId::LinkState => {
                "no NIC link is up that was down at launch and is not granted"
            }
            InvariantId::ProcessIdentity => {
                "the hypervisor process is the one launched, alive, with its config fingerprint"
            }
            InvariantId::SnapshotVerifies => {
                "snapshots pass their integrity checks (signature, every chunk and layer checksum)"
            }
            InvariantId::JournalHead => "the journal ends where its sealed head file says",
            InvariantId::StateDirSpace => {
                "the state directory has more than daemon.min_free_mib free"
            }
        }
    }

    /// Cheap enough for the check after every state change (the rest run in the periodic pass).
    pub fn cheap(self) -> bool {
        self != InvariantId::SnapshotVerifies
    }

    /// Whether backend `kind` can observe this invariant.
    pub fn coverage(self, kind: &str) -> Coverage {
        use Coverage::*;
        match (self, kind) {
            (
                InvariantId::SnapshotVerifies
                | InvariantId::JournalHead
                | InvariantId::StateDirSpace,
                _,
            ) => Checked,
            (_, "qemu") => Checked,
            (InvariantId::ProcessIdentity | InvariantId::DiskActiveLayer, "libvirt") => Checked,
            (InvariantId::DeviceSet | InvariantId::LinkState, "libvirt") => {
                NotChecked("the libvirt backend cannot list the domain's devices")
            }
            (InvariantId::DeviceSet, "kvm") => Checked,
            (InvariantId::DiskActiveLayer, "kvm") => {
                NotChecked("the embedded KVM backend has no layer chain to query")
            }
            (InvariantId::LinkState, "kvm") => NotChecked("the embedded KVM backend has no NIC"),
            (InvariantId::ProcessIdentity, "kvm") => {
                NotChecked("the embedded KVM VM runs inside backstopd itself")
            }
            _ => NotChecked("unknown backend"),
        }
    }
}

/// One invariant that does not hold, for one node (VM, disk, device, NIC, snapshot, file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: InvariantId,
    pub node_id: String,
    /// The invariant's severity, or lower for a case that needs no action (a grant the
    /// hypervisor no longer holds).
    pub severity: Severity,
    pub details: String,
}

impl Violation {
    /// What to do about it: the invariant's action when HIGH or CRITICAL, else record only.
    pub fn action(&self) -> DriftAction {
        if self.severity >= Severity::High {
            self.invariant.action()
        } else {
            DriftAction::Record
        }
    }
}

/// What the engine launched: recorded at the first observation of a new hypervisor instance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Launched {
    pub pid: Option<u32>,
    pub fingerprint: String,
    /// sha256 of the process's command line at launch: a pid reused by another program after
    /// the hypervisor ended reads differently.
    pub cmdline: Option<String>,
    /// Devices (by id) the instance had besides the ledger's grants: its configured shape.
    /// `None` until the devices could be read once (a failed read is no empty shape).
    pub devices: Option<BTreeSet<String>>,
    /// Each NIC's link as first read on this instance.
    pub links: BTreeMap<String, bool>,
}

/// What the engine expects now.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// Each captured disk's top layer as the engine set it.
    pub disks: Vec<(String, PathBuf)>,
    /// Ids of the ledger's grants that put a device into the VM (revocations in flight
    /// included: their deadline is the ledger's to enforce).
    pub granted_devices: Vec<String>,
    /// NICs whose link is granted.
    pub granted_links: BTreeSet<String>,
    pub launched: Option<Launched>,
    pub min_free_mib: u64,
}

/// The hypervisor process as seen now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSeen {
    pub pid: Option<u32>,
    /// `/proc/<pid>` exists and is not a zombie.
    pub alive: bool,
    pub fingerprint: String,
    /// sha256 of `/proc/<pid>/cmdline` now.
    pub cmdline: Option<String>,
}

/// One snapshot's verification result (only snapshots actually checked are listed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotSeen {
    pub snapshot_id: String,
    /// Why it failed; `None`: it verified.
    pub failure: Option<String>,
}

/// What was observed. `None` for a facet: not observed (not checked) this time.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub disks: Option<Vec<ActiveLayer>>,
    /// Device ids the hypervisor reports.
    pub devices: Option<Vec<String>>,
    pub links: Option<Vec<LinkState>>,
    pub process: Option<ProcessSeen>,
    pub snapshots: Option<Vec<SnapshotSeen>>,
    /// `Some(None)`: the head matches; `Some(Some(why))`: it does not.
    pub journal_head: Option<Option<String>>,
    pub free_mib: Option<u64>,
}

/// What a check looked at, per invariant: every node, or only these (snapshots checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    All,
    Nodes(BTreeSet<String>),
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub violations: Vec<Violation>,
    pub checked: BTreeMap<InvariantId, Scope>,
}

/// Whether device `id` (as the hypervisor names it) belongs to grant `grant`: backends name a
/// granted device `grant-<id>`, and its helpers `grant-<id>-<what>`.
pub fn grant_owns(grant: &str, id: &str) -> bool {
    id.strip_prefix("grant-")
        .and_then(|rest| rest.strip_prefix(grant))
        .is_some_and(|tail| tail.is_empty() || tail.starts_with('-'))
}

/// The check: what was observed against what the engine expects.
pub fn check(expected: &Expected, observed: &Observed) -> Report {
    let mut out: Vec<Violation> = Vec::new();
    let mut bad = |invariant: InvariantId, node_id: &str, details: String| {
        out.push(violation(invariant, node_id, details))
    };
    let mut checked = BTreeMap::new();

    if let Some(seen) = &observed.disks {
        checked.insert(InvariantId::DiskActiveLayer, Scope::All);
        for (disk, want) in &expected.disks {
            // A disk the hypervisor does not list under its device is not observed (the UEFI
            // variables' flash), not drifted.
            if let Some(l) = seen.iter().find(|l| &l.disk == disk) {
                if &l.active != want {
                    bad(
                        InvariantId::DiskActiveLayer,
                        disk,
                        format!(
                            "writes {} but the engine set {}",
                            l.active.display(),
                            want.display()
                        ),
                    );
                }
            }
        }
    }

    let launched = expected.launched.as_ref();
    let mut bad_low = Vec::new();
    let shape = launched.and_then(|l| l.devices.as_ref());
    if let (Some(seen), Some(shape)) = (&observed.devices, shape) {
        checked.insert(InvariantId::DeviceSet, Scope::All);
        for id in seen {
            let granted = expected.granted_devices.iter().any(|g| grant_owns(g, id));
            if !shape.contains(id) && !granted {
                bad(
                    InvariantId::DeviceSet,
                    id,
                    format!(
                        "the hypervisor holds device {id}, which the device ledger does not allow"
                    ),
                );
            }
        }
        for g in &expected.granted_devices {
            if !seen.iter().any(|id| grant_owns(g, id)) {
                // The guest lost a grant: no access gained, nothing to undo.
                let mut v = violation(
                    InvariantId::DeviceSet,
                    &format!("grant-{g}"),
                    format!("the ledger grants {g} but the hypervisor does not hold it"),
                );
                v.severity = Severity::Low;
                bad_low.push(v);
            }
        }
    }

    if let (Some(seen), Some(l)) = (&observed.links, launched) {
        checked.insert(InvariantId::LinkState, Scope::All);
        for link in seen {
            let allowed = l.links.get(&link.nic).copied().unwrap_or(false)
                || expected.granted_links.contains(&link.nic);
            if link.up == Some(true) && !allowed {
                bad(
                    InvariantId::LinkState,
                    &link.nic,
                    format!(
                        "link of {} is up: neither up at launch nor granted",
                        link.nic
                    ),
                );
            }
        }
    }

    if let (Some(p), Some(l)) = (&observed.process, launched) {
        checked.insert(InvariantId::ProcessIdentity, Scope::All);
        let node = l.pid.map_or("vm".to_string(), |p| format!("pid:{p}"));
        if p.pid != l.pid {
            bad(
                InvariantId::ProcessIdentity,
                &node,
                format!("the backend reports pid {:?}, launched {:?}", p.pid, l.pid),
            );
        } else if !p.alive {
            bad(
                InvariantId::ProcessIdentity,
                &node,
                "the launched process is gone or a zombie".into(),
            );
        } else if l.cmdline.is_some() && p.cmdline != l.cmdline {
            bad(
                InvariantId::ProcessIdentity,
                &node,
                "the launched pid now runs another command line".into(),
            );
        } else if p.fingerprint != l.fingerprint {
            bad(
                InvariantId::ProcessIdentity,
                &node,
                format!(
                    "config fingerprint {} differs from the launched {}",
                    p.fingerprint, l.fingerprint
                ),
            );
        }
    }

    if let Some(snaps) = &observed.snapshots {
        checked.insert(
            InvariantId::SnapshotVerifies,
            Scope::Nodes(snaps.iter().map(|s| s.snapshot_id.clone()).collect()),
        );
        for s in snaps {
            if let Some(why) = &s.failure {
                bad(InvariantId::SnapshotVerifies, &s.snapshot_id, why.clone());
            }
        }
    }

    if let Some(head) = &observed.journal_head {
        checked.insert(InvariantId::JournalHead, Scope::All);
        if let Some(why) = head {
            bad(InvariantId::JournalHead, "audit/journal.jsonl", why.clone());
        }
    }

    if let Some(free) = observed.free_mib {
        checked.insert(InvariantId::StateDirSpace, Scope::All);
        if free <= expected.min_free_mib {
            bad(
                InvariantId::StateDirSpace,
                "state_dir",
                format!("{free} MiB free, floor {} MiB", expected.min_free_mib),
            );
        }
    }
    out.extend(bad_low);
    Report {
        violations: out,
        checked,
    }
}

fn violation(invariant: InvariantId, node_id: &str, details: String) -> Violation {
    Violation {
        invariant,
        node_id: node_id.to_string(),
        severity: invariant.severity(),
        details,
    }
}

/// A drift that holds now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenDrift {
    pub invariant: InvariantId,
    pub node_id: String,
    pub severity: Severity,
    pub strategy: Strategy,
    pub details: String,
    pub detected_at: String,
}

/// A drift that ended, and how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedDrift {
    pub drift: OpenDrift,
    pub resolved_at: String,
    pub resolution: String,
}

/// What a check changed in the book: drift to journal as detected, and as resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub detected: Vec<OpenDrift>,
    pub cleared: Vec<OpenDrift>,
}

/// How many resolved drifts are kept for `backstop drift`.
pub const RESOLVED_KEPT: usize = 50;

/// Open drift by (invariant, node), and the recently resolved.
#[derive(Debug, Clone, Default)]
pub struct DriftBook {
    open: BTreeMap<(InvariantId, String), OpenDrift>,
    resolved: VecDeque<ResolvedDrift>,
}

impl DriftBook {
    /// Folds one check into the book: a violation not open yet is detected (once, however
    /// many passes it persists); an open drift whose invariant and node this check looked at
    /// and found holding is cleared. Open drift the check did not look at stays open.
    pub fn apply(&mut self, report: &Report, strategy: Strategy, now: &str) -> Changes {
        let mut changes = Changes::default();
        let violated: BTreeSet<(InvariantId, String)> = report
            .violations
            .iter()
            .map(|v| (v.invariant, v.node_id.clone()))
            .collect();
        for v in &report.violations {
            let key = (v.invariant, v.node_id.clone());
            if self.open.contains_key(&key) {
                continue;
            }
            let d = OpenDrift {
                invariant: v.invariant,
                node_id: v.node_id.clone(),
                severity: v.severity,
                strategy,
                details: v.details.clone(),
                detected_at: now.to_string(),
            };
            self.open.insert(key, d.clone());
            changes.detected.push(d);
        }
        let cleared: Vec<(InvariantId, String)> = self
            .open
            .keys()
            .filter(|k| !violated.contains(*k))
            .filter(|(inv, node)| match report.checked.get(inv) {
                Some(Scope::All) => true,
                Some(Scope::Nodes(nodes)) => nodes.contains(node),
                None => false,
            })
            .cloned()
            .collect();
        for k in cleared {
            if let Some(d) = self.open.remove(&k) {
                changes.cleared.push(d);
            }
        }
        changes
    }

    /// Ends an open drift (an action resolved it, or a check cleared it) and keeps the record.
    pub fn resolve(&mut self, drift: OpenDrift, resolution: &str, now: &str) -> ResolvedDrift {
        self.open.remove(&(drift.invariant, drift.node_id.clone()));
        let r = ResolvedDrift {
            drift,
            resolved_at: now.to_string(),
            resolution: resolution.to_string(),
        };
        self.resolved.push_back(r.clone());
        while self.resolved.len() > RESOLVED_KEPT {
            self.resolved.pop_front();
        }
        r
    }

    pub fn get(&self, invariant: InvariantId, node: &str) -> Option<&OpenDrift> {
        self.open.get(&(invariant, node.to_string()))
    }

    /// Open drift, by invariant then node.
    pub fn open(&self) -> impl Iterator<Item = &OpenDrift> {
        self.open.values()
    }

    /// Recently resolved drift, oldest first.
    pub fn resolved(&self) -> impl Iterator<Item = &ResolvedDrift> {
        self.resolved.iter()
    }
}

/// How many chunks one periodic pass re-verifies so that every chunk of `total_chunks` is read
/// at least once every `reverify_days`, with a pass every `period_min` minutes: the work spread
/// evenly over the passes (at least one chunk a pass while there are any).
pub fn chunks_per_pass(total_chunks: u64, period_min: u64, reverify_days: u64) -> u64 {
    if total_chunks == 0 {
        return 0;
    }
    let passes = (reverify_days.saturating_mul(24 * 60) / period_min.max(1)).max(1);
    total_chunks.div_ceil(passes)
}

/// The slice of `total` chunks a pass reads from `cursor` (wrapping), and the next cursor.
pub fn next_window(cursor: u64, total: u64, budget: u64) -> (Vec<u64>, u64) {
    if total == 0 {
        return (Vec::new(), 0);
    }
    let start = cursor % total;
    let n = budget.min(total);
    let window = (0..n).map(|i| (start + i) % total).collect();
    (window, (start + n) % total)
}

#[cfg(test)]
mod tests;
