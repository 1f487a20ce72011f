//! The control protocol: one JSON object per line over a Unix stream socket.
//!
//! A client sends exactly one [`Request`] line. The daemon answers with zero or more
//! [`Reply::Progress`] lines, then exactly one [`Reply::Done`] or [`Reply::Failed`], then closes.
//! Every line is bounded by [`MAX_LINE_BYTES`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest line either side accepts. Longer lines are refused, never buffered whole.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Version of this protocol; a client and daemon with different majors refuse each other.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a client asks of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", from = "StrictRequest")]
pub enum Request {
    /// State of the guarded VM. Always answered, even when HALTED.
    Status,
    /// Take a snapshot now (spec/001 `snapshot create`, `scope=full`), optionally named
    /// (`backstop_common::names`; unique among the VM's live snapshots).
    SnapshotCreate {
        reason: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// Delete one snapshot (`id`: an id, a name or a unique prefix), as retention removes one;
    /// refused, with nothing changed, when the VM stands on it, a retention rule keeps it, it is
    /// the only verified one, another snapshot or the running VM needs its disk layers, or it
    /// is a forensic snapshot within its keep period. Console only.
    SnapshotDelete { id: String, reason: String },
    /// Every published snapshot, oldest first (spec/001 `snapshot list`).
    SnapshotList,
    /// The snapshots' lineage as a tree (spec/004), with the VM's current position. Read-only:
    /// answered while HALTED.
    SnapshotTree,
    /// One snapshot's manifest and capture figures. `id` may be a unique prefix.
    SnapshotShow { id: String },
    /// [`Request::SnapshotShow`] of the snapshot the VM stands on now (the one it was last
    /// snapshotted or restored at). Read-only: answered while HALTED.
    SnapshotCurrent,
    /// Full verification (signature, fields, versions, every checksum) without touching the VM.
    SnapshotVerify { id: String },
    /// Off-host replication: fetch snapshot `id` that host `from` replicated, check its ed25519
    /// signature against the fleet trust file and every chunk and layer, and publish it into this
    /// VM's store. The daemon's own (needs `[offsite]`). Console only. `for_start`: the VM is to
    /// run here from it: refused (`ERR_OFFSITE_LEASE_HELD`, nothing fetched) while another host
    /// holds a live lease on the VM; otherwise this host takes the lease (an expired one is taken
    /// over) and the VM is rolled back to the pulled snapshot.
    SnapshotPull {
        id: String,
        from: String,
        #[serde(default, skip_serializing_if = "is_false")]
        for_start: bool,
    },
    /// Remote retention and GC now (`[offsite.retention]`): this host's snapshots the rule
    /// drops are deleted from the bucket, then the chunks and layers no manifest of any host
    /// references and older than the grace period. `dry_run`: only say what would go. The
    /// daemon's own (needs `[offsite]`). Console only.
    OffsiteGc {
        #[serde(default, skip_serializing_if = "is_false")]
        dry_run: bool,
    },
    /// Roll the VM back (spec/000 §5): see [`RollbackArgs`].
    Rollback(RollbackArgs),
    /// A person clears HALTED; the VM is then restored from the newest verified snapshot
    /// (or cold-booted when there is none).
    HaltClear { reason: String },
    /// A person clears HALTED and chooses the snapshot it is restored from (a session rollback:
    /// anything but the newest verified snapshot needs reviewer evidence, as for `rollback`).
    /// Refused before anything changes: the VM stays HALTED.
    HaltClearTo {
        reason: String,
        to: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reviewer_token: Option<Value>,
        /// Leave the restored guest stopped (never `cont`ed): the heartbeat watchdog and
        /// snapshots wait until a person continues it with [`Request::Resume`].
        #[serde(default, skip_serializing_if = "is_false")]
        paused: bool,
    },
    /// Continue a guest that `halt clear --paused` left stopped (journaled `vm.continued`).
    Resume { reason: String },
    /// The last `count` audit entries.
    AuditTail { count: usize },
    /// Walk the whole audit chain.
    AuditVerify,
    /// A host trigger (spec/000 §6), normally from the host policy engine. Overrides whatever is
    /// in flight: a snapshot being taken is abandoned and never published.
    Trigger {
        kind: HostTrigger,
        reason: String,
        /// The action(s) the trigger concerns, recorded in the journal (spec/000 §11).
        #[serde(default)]
        action_ids: Vec<String>,
        /// The trigger's identity: a repeat of one already executed is a journaled no-op that
        /// answers with the first one's outcome. Without it, a trigger naming action ids is
        /// identified by its kind and those ids; one naming none has no identity (every such
        /// trigger rolls back).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trigger_id: Option<String>,
    },
    /// Give the guest devices declared in config, after a pre-action snapshot, for a lease
    /// (`None`: each device's `max_lease_s`). Console only.
    DeviceGrant {
        ids: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_s: Option<u64>,
        reason: String,
    },
    /// Take a granted device back now.
    DeviceRevoke { id: String, reason: String },
    /// The configured devices, their grants, and the hypervisor's own view of the VM's devices.
    DeviceList,
    /// The pre-action gate (spec/000 §4.2, §10.1): an Action Descriptor from the host broker.
    /// Blocked when it declares no rollback support; a snapshot is taken first when the action
    /// needs one, and if that fails the action is blocked. The descriptor is parsed strictly by
    /// the daemon (unknown fields refused).
    ActionBegin { descriptor: Value },
    /// The action is over: `ok` closes it; `failed` rolls the VM back to the action's
    /// pre-action snapshot (a micro rollback).
    ActionEnd {
        action_id: String,
        result: ActionResult,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// The open actions.
    ActionList,
    /// Apply the retention policy now (it also runs after every scheduled snapshot).
    SnapshotPrune,
    /// Every VM this daemon guards (answered by the daemon, for any VM).
    Vms,
    /// Re-read the VM files (`daemon.vms_dir`): start new VMs, stop removed ones; the others
    /// are not disturbed (answered by the daemon).
    Reload,
    /// Add a VM (answered by the daemon, console only): `text` is the VM file `file_name`
    /// (`NAME.toml`), checked exactly as a reload would load it from `daemon.vms_dir`, written
    /// there atomically (never over a file), and the VM started as a reload starts a new one.
    /// With `from_snapshot` and `from` (needs `[offsite]`): the VM starts from that snapshot of
    /// host `from`, never cold-booted first — refused (`ERR_OFFSITE_LEASE_HELD`, nothing
    /// written) while another host holds a live lease on it; otherwise fetched and verified
    /// into the new VM's store, the lease taken, then the VM added.
    VmAdd {
        file_name: String,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from_snapshot: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<String>,
    },
    /// Start a VM whose state is damaged (a broken journal, say) on a new chain (answered by
    /// the daemon, console only; the VM must not run): its state directory is moved aside
    /// whole as evidence (never deleted), a new journal begins with `vm.reset` naming the old
    /// head (seq and hash) and the evidence, and the VM starts as a reload starts a new one,
    /// with a fresh baseline. Files outside the state directory are not touched.
    VmReset { name: String, reason: String },
    /// Check a VM file against the host and the VM it names, changing nothing (answered by the
    /// daemon, console only): the file parsed as a load would, and for an adopted libvirt
    /// domain libvirt asked — every problem at once, each with its fix, and what adoption
    /// would choose (heartbeat, capture mode).
    VmCheck { file_name: String, text: String },
    /// Verify the daemon journal, and that every VM journal still holds the entries the daemon
    /// journal anchored (answered by the daemon).
    DaemonAuditVerify,
    /// Drift detection (spec/002 §3): the open and recently resolved drift, and which
    /// invariants this VM's backend can check.
    DriftList,
    /// spec/003 replay of this VM's journal: every signature first, then every recorded
    /// decision recomputed from the recorded inputs and compared. Read-only but for the
    /// `REPLAY_*` entries it appends.
    AuditReplay(ReplayAsk),
    /// Subscribe to notifications (spec/004's notification scope): snapshot published, rollback
    /// started/completed/halted, VM halted, halt cleared, in journal order, each with its VM's
    /// journal `seq`. `since`: deliver what came after that seq first (a subscriber that
    /// reconnects misses nothing); without it, only what happens from now. `types`: only
    /// these (empty: all). `follow`: keep the connection open and deliver as they happen;
    /// otherwise end with [`Response::Events`] once caught up. Without `vm` in the envelope:
    /// every VM (then `since` is refused: it is one VM's sequence).
    Events {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<u64>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        types: Vec<String>,
        #[serde(default, skip_serializing_if = "is_false")]
        follow: bool,
    },
}

/// The notification types of [`Request::Events`], in the order they are listed.
pub const NOTIFICATION_TYPES: [&str; 6] = [
    "snapshot_published",
    "rollback_started",
    "rollback_completed",
    "rollback_halted",
    "vm_halted",
    "halt_cleared",
];

/// One notification: what happened to a VM, as its journal recorded it. The guest is never
/// told any of this (it learns its epoch only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    pub vm: String,
    /// The VM journal's `seq` of the entry: increasing per VM (not contiguous: other entries
    /// lie between); what `since` takes back.
    pub seq: u64,
    /// When it was journaled (RFC 3339).
    pub ts: String,
    /// One of [`NOTIFICATION_TYPES`] (`kind` is taken by the reply's tag).
    pub event: String,
    pub snapshot_id: Option<String>,
    /// The entry's fields that matter to a subscriber (epoch, trigger, rollback_type, code…).
    pub details: Value,
}

/// What `audit replay` is asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayAsk {
    /// `audit` (default), `production` or `reexecute`.
    #[serde(default = "default_replay_mode")]
    pub mode: String,
    /// Compare decisions from this journal seq on (state is still rebuilt from seq 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_seq: Option<u64>,
    /// Continue past a divergence: needs `reviewer_token` naming the divergence's digest.
    #[serde(default, skip_serializing_if = "is_false")]
    pub force_continue: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reviewer_token: Option<Value>,
    /// `reexecute`: the snapshot restored into the sandbox VM (default: the newest verified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Step cap (journal entries); default 5,000,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// Time cap in seconds; default 120.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

/// What `rollback` is asked (spec/000 §5): the one shape the console's flags are read into,
/// the wire carries and the engine decides on. Without a type: `emergency` (or neither `to` nor
/// `before`) is an emergency rollback to the newest verified snapshot; `to` or `before` is a
/// session rollback. A session rollback to anything but the newest verified snapshot needs
/// `reviewer_token` (spec/001 governance); `allow_newer_minor` is spec/001's explicit
/// compatibility mode. Micro rollbacks are `action_end` with result `failed`.
///
/// Decoded strictly (unknown fields refused) here, as a newtype variant's struct: the enum's
/// own `deny_unknown_fields` does not reach into it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackArgs {
    pub to: Option<String>,
    pub reason: String,
    #[serde(default)]
    pub emergency: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_type: Option<RollbackType>,
    /// Session rollback: the newest snapshot created at or before this RFC 3339 time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<String>,
    /// A reviewer token (see [`crate::evidence`]), as read from its file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reviewer_token: Option<Value>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub allow_newer_minor: bool,
    /// A forensic snapshot holding RAM may be the named target (`--include-forensic`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub include_forensic: bool,
}

fn default_replay_mode() -> String {
    "audit".into()
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// spec/000 §5's rollback types (the shared vocabulary's; the same strings on the wire).
pub use backstop_common::RollbackType;

/// How an action ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionResult {
    Ok,
    Failed,
}

impl ActionResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionResult::Ok => "ok",
            ActionResult::Failed => "failed",
        }
    }
}

/// The host triggers of spec/000 §6 that arrive over the control socket. (The watchdog and the
/// console are triggers too, but they have their own paths.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostTrigger {
    /// The policy engine's `FORCE_ROLLBACK`.
    #[serde(alias = "FORCE_ROLLBACK")]
    ForceRollback,
    /// Post-promotion validation failed.
    PostPromotionValidationFailed,
    /// The AI violated a Tier 0 law.
    Tier0Violation,
    /// A sandbox result contradicts the declared effects.
    SandboxContradiction,
    /// The host detected undefined behaviour.
    UndefinedBehaviour,
}

impl HostTrigger {
    pub const ALL: [HostTrigger; 5] = [
        HostTrigger::ForceRollback,
        HostTrigger::PostPromotionValidationFailed,
        HostTrigger::Tier0Violation,
        HostTrigger::SandboxContradiction,
        HostTrigger::UndefinedBehaviour,
    ];

    /// The trigger as the journal names it.
    pub fn kind(self) -> backstop_common::TriggerKind {
        use backstop_common::TriggerKind as K;
        match self {
            HostTrigger::ForceRollback => K::ForceRollback,
            HostTrigger::PostPromotionValidationFailed => K::PostPromotionValidationFailed,
            HostTrigger::Tier0Violation => K::Tier0Violation,
            HostTrigger::SandboxContradiction => K::SandboxContradiction,
            HostTrigger::UndefinedBehaviour => K::UndefinedBehaviour,
        }
    }

    /// The name on the wire and in the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            HostTrigger::ForceRollback => "force_rollback",
            HostTrigger::PostPromotionValidationFailed => "post_promotion_validation_failed",
            HostTrigger::Tier0Violation => "tier0_violation",
            HostTrigger::SandboxContradiction => "sandbox_contradiction",
            HostTrigger::UndefinedBehaviour => "undefined_behaviour",
        }
    }

    /// The rollback type each trigger calls for (spec/000 §5): failed promotions and sandbox
    /// contradictions are a single action gone wrong (micro); the rest are full emergencies.
    pub fn rollback_type(self) -> RollbackType {
        match self {
            HostTrigger::PostPromotionValidationFailed | HostTrigger::SandboxContradiction => {
                RollbackType::Micro
            }
            HostTrigger::ForceRollback
            | HostTrigger::Tier0Violation
            | HostTrigger::UndefinedBehaviour => RollbackType::Emergency,
        }
    }

    pub fn parse(name: &str) -> Option<HostTrigger> {
        HostTrigger::ALL.into_iter().find(|k| {
            k.as_str() == name || (name == "FORCE_ROLLBACK" && *k == HostTrigger::ForceRollback)
        })
    }
}

/// The wire form of [`Request`], decoded strictly.
///
/// serde ignores `deny_unknown_fields` for the *unit* variants of an internally tagged enum
/// (`{"op":"status","x":1}` would pass), so requests are decoded through this mirror whose
/// variants are all structs, then converted. The wire format is the same.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum StrictRequest {
    Status {},
    SnapshotCreate {
        reason: String,
        #[serde(default)]
        name: Option<String>,
    },
    SnapshotDelete {
        id: String,
        reason: String,
    },
    SnapshotList {},
    SnapshotTree {},
    SnapshotCurrent {},
    SnapshotShow {
        id: String,
    },
    SnapshotVerify {
        id: String,
    },
    SnapshotPull {
        id: String,
        from: String,
        #[serde(default)]
        for_start: bool,
    },
    OffsiteGc {
        #[serde(default)]
        dry_run: bool,
    },
    Rollback(RollbackArgs),
    HaltClear {
        reason: String,
    },
    HaltClearTo {
        reason: String,
        to: String,
        #[serde(default)]
        reviewer_token: Option<Value>,
        #[serde(default)]
        paused: bool,
    },
    Resume {
        reason: String,
    },
    AuditTail {
        count: usize,
    },
    AuditVerify {},
    Trigger {
        kind: HostTrigger,
        reason: String,
        #[serde(default)]
        action_ids: Vec<String>,
        #[serde(default)]
        trigger_id: Option<String>,
    },
    DeviceGrant {
        ids: Vec<String>,
        #[serde(default)]
        lease_s: Option<u64>,
        reason: String,
    },
    DeviceRevoke {
        id: String,
        reason: String,
    },
    DeviceList {},
    ActionBegin {
        descriptor: Value,
    },
    ActionEnd {
        action_id: String,
        result: ActionResult,
        #[serde(default)]
        reason: Option<String>,
    },
    ActionList {},
    SnapshotPrune {},
    Vms {},
    Reload {},
    VmAdd {
        file_name: String,
        text: String,
        #[serde(default)]
        from_snapshot: Option<String>,
        #[serde(default)]
        from: Option<String>,
    },
    VmReset {
        name: String,
        reason: String,
    },
    VmCheck {
        file_name: String,
        text: String,
    },
    DaemonAuditVerify {},
    AuditReplay(ReplayAsk),
    Events {
        #[serde(default)]
        since: Option<u64>,
        #[serde(default)]
        types: Vec<String>,
        #[serde(default)]
        follow: bool,
    },
    DriftList {},
}

impl From<StrictRequest> for Request {
    fn from(wire: StrictRequest) -> Request {
        match wire {
            StrictRequest::Status {} => Request::Status,
            StrictRequest::SnapshotCreate { reason, name } => {
                Request::SnapshotCreate { reason, name }
            }
            StrictRequest::SnapshotDelete { id, reason } => Request::SnapshotDelete { id, reason },
            StrictRequest::SnapshotList {} => Request::SnapshotList,
            StrictRequest::SnapshotTree {} => Request::SnapshotTree,
            StrictRequest::SnapshotCurrent {} => Request::SnapshotCurrent,
            StrictRequest::SnapshotShow { id } => Request::SnapshotShow { id },
            StrictRequest::SnapshotVerify { id } => Request::SnapshotVerify { id },
            StrictRequest::SnapshotPull {
                id,
                from,
                for_start,
            } => Request::SnapshotPull {
                id,
                from,
                for_start,
            },
            StrictRequest::OffsiteGc { dry_run } => Request::OffsiteGc { dry_run },
            StrictRequest::Rollback(args) => Request::Rollback(args),
            StrictRequest::HaltClear { reason } => Request::HaltClear { reason },
            StrictRequest::HaltClearTo {
                reason,
                to,
                reviewer_token,
                paused,
            } => Request::HaltClearTo {
                reason,
                to,
                reviewer_token,
                paused,
            },
            StrictRequest::Resume { reason } => Request::Resume { reason },
            StrictRequest::AuditTail { count } => Request::AuditTail { count },
            StrictRequest::AuditVerify {} => Request::AuditVerify,
            StrictRequest::Trigger {
                kind,
                reason,
                action_ids,
                trigger_id,
            } => Request::Trigger {
                kind,
                reason,
                action_ids,
                trigger_id,
            },
            StrictRequest::DeviceGrant {
                ids,
                lease_s,
                reason,
            } => Request::DeviceGrant {
                ids,
                lease_s,
                reason,
            },
            StrictRequest::DeviceRevoke { id, reason } => Request::DeviceRevoke { id, reason },
            StrictRequest::DeviceList {} => Request::DeviceList,
            StrictRequest::ActionBegin { descriptor } => Request::ActionBegin { descriptor },
            StrictRequest::ActionEnd {
                action_id,
                result,
                reason,
            } => Request::ActionEnd {
                action_id,
                result,
                reason,
            },
            StrictRequest::ActionList {} => Request::ActionList,
            StrictRequest::SnapshotPrune {} => Request::SnapshotPrune,
            StrictRequest::Vms {} => Request::Vms,
            StrictRequest::Reload {} => Request::Reload,
            StrictRequest::VmAdd {
                file_name,
                text,
                from_snapshot,
                from,
            } => Request::VmAdd {
                file_name,
                text,
                from_snapshot,
                from,
            },
            StrictRequest::VmReset { name, reason } => Request::VmReset { name, reason },
            StrictRequest::VmCheck { file_name, text } => Request::VmCheck { file_name, text },
            StrictRequest::DaemonAuditVerify {} => Request::DaemonAuditVerify,
            StrictRequest::AuditReplay(ask) => Request::AuditReplay(ask),
            StrictRequest::Events {
                since,
                types,
                follow,
            } => Request::Events {
                since,
                types,
                follow,
            },
            StrictRequest::DriftList {} => Request::DriftList,
        }
    }
}

impl Request {
    /// Short name used in logs, the journal and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::SnapshotCreate { .. } => "snapshot create",
            Request::SnapshotDelete { .. } => "snapshot delete",
            Request::SnapshotList => "snapshot list",
            Request::SnapshotTree => "snapshot tree",
            Request::SnapshotCurrent => "snapshot current",
            Request::SnapshotShow { .. } => "snapshot show",
            Request::SnapshotVerify { .. } => "snapshot verify",
            Request::SnapshotPull { .. } => "snapshot pull",
            Request::OffsiteGc { .. } => "offsite gc",
            Request::Rollback(_) => "rollback",
            Request::HaltClear { .. } | Request::HaltClearTo { .. } => "halt clear",
            Request::Resume { .. } => "resume",
            Request::AuditTail { .. } => "audit tail",
            Request::AuditVerify => "audit verify",
            Request::Trigger { .. } => "trigger",
            Request::DeviceGrant { .. } => "device grant",
            Request::DeviceRevoke { .. } => "device revoke",
            Request::DeviceList => "device list",
            Request::ActionBegin { .. } => "action begin",
            Request::ActionEnd { .. } => "action end",
            Request::ActionList => "action list",
            Request::SnapshotPrune => "snapshot prune",
            Request::Vms => "vms",
            Request::Reload => "reload",
            Request::VmAdd { .. } => "vm add",
            Request::VmReset { .. } => "vm reset",
            Request::VmCheck { .. } => "vm check",
            Request::DaemonAuditVerify => "audit verify --daemon",
            Request::AuditReplay(_) => "audit replay",
            Request::Events { .. } => "events",
            Request::DriftList => "drift",
        }
    }
}

/// One line from the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// One reply value lives per connection for a moment: its size does not matter, boxing would
// only add noise at every construction site.
#[allow(clippy::large_enum_variant)]
pub enum Reply {
    /// A step of a long operation has started or advanced.
    Progress(Progress),
    /// The operation succeeded.
    Done(Response),
    /// The operation failed. `code` is a stable string (the spec's where it has one).
    Failed { code: String, message: String },
    /// One notification of an `events` subscription.
    Event(Notification),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Machine-readable step name, e.g. `verify`, `capture`, `revoke`, `restore`.
    pub step: String,
    /// Human text for the step.
    pub message: String,
    /// Bytes done so far in this step, where that means something.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// The successful result of a request.
// One response per request, serialised at once: the size of the largest variant (a status
// with its live view) costs nothing worth boxing every constructor for.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Status(StatusView),
    Snapshot(SnapshotView),
    SnapshotList {
        snapshots: Vec<SnapshotSummary>,
    },
    Verified(VerifyReport),
    /// `snapshot pull`: what was published here.
    SnapshotPulled(PullReport),
    /// `offsite gc`: what remote retention and GC deleted (or would).
    OffsiteGc(OffsiteGcReport),
    RolledBack(RollbackReport),
    HaltCleared {
        epoch: u64,
        restored_from: Option<String>,
    },
    AuditEntries {
        entries: Vec<Value>,
    },
    AuditVerified(AuditVerifyReport),
    /// The answer to `device grant`, `device revoke` and `device list`.
    Devices(DevicesView),
    /// The answer to `action begin` and `action end`.
    Action(ActionView),
    /// The open actions.
    Actions {
        actions: Vec<ActionView>,
    },
    /// What retention removed and kept.
    Pruned(PruneView),
    /// Every VM this daemon guards.
    Vms {
        vms: Vec<VmSummary>,
    },
    /// What a reload changed.
    Reloaded(ReloadReport),
    /// `vm add`: the VM added and how it started.
    VmAdded(VmAddReport),
    /// `vm reset`: where the evidence went, the old chain's head, and the VM as it runs now.
    VmReset(VmResetReport),
    VmChecked(VmCheckReport),
    /// How `audit replay` ended.
    Replayed(ReplayReport),
    /// The lineage tree (`snapshot tree`).
    SnapshotTree {
        /// Every snapshot ever published that the lineage book or the store knows, oldest
        /// first; a node's children are those naming it as parent.
        nodes: Vec<TreeNode>,
        /// The snapshot the running VM descends from (`None` right after a cold boot).
        current: Option<String>,
    },
    /// The end of an `events` request that does not follow: how many were delivered, and the
    /// last seq seen of each VM (what to pass as `since` next time).
    Events {
        delivered: u64,
        last_seq: std::collections::BTreeMap<String, u64>,
    },
    /// Open and recently resolved drift.
    Drift(DriftReport),
    /// What `snapshot delete` removed.
    SnapshotDeleted(DeleteView),
}

/// What `snapshot delete` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteView {
    pub snapshot_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The reason given (journaled with who asked).
    pub reason: String,
    /// Chunk files no remaining snapshot referred to.
    pub chunks_removed: u64,
    /// Disk layer files no remaining snapshot nor the running VM used.
    pub layers_removed: u64,
}

/// One drift (spec/002 §3): an invariant that does not hold (or no longer fails) for a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftView {
    /// `disk.active_layer`, `device.set`, `snapshot.verifies`, ... (docs/drift.md).
    pub invariant_id: String,
    /// What it concerns: a disk, device, NIC, snapshot id, file.
    pub node_id: String,
    /// `LOW`, `MEDIUM`, `HIGH` or `CRITICAL`.
    pub severity: String,
    /// The strategy that found it: `invariant_violation`, `active_reconciliation`,
    /// `passive_read`.
    pub drift_type: String,
    pub details: String,
    pub detected_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_at: Option<String>,
    /// How it ended (an action taken, or the condition cleared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolution: Option<String>,
}

/// One invariant as this VM's backend covers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvariantView {
    pub invariant_id: String,
    pub severity: String,
    pub what: String,
    pub action: String,
    /// `checked`, or `not checked: <why>` (never shown as a pass).
    pub coverage: String,
}

/// The answer to `drift`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftReport {
    pub vm: String,
    pub open: Vec<DriftView>,
    /// Recently resolved, oldest first.
    pub resolved: Vec<DriftView>,
    pub invariants: Vec<InvariantView>,
    /// When the last active reconciliation pass ran (RFC 3339), if one has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reconcile_at: Option<String>,
    /// Snapshots marked unusable (never a rollback target), by id.
    #[serde(default)]
    pub unusable_snapshots: Vec<String>,
}

/// One snapshot in the lineage tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeNode {
    pub snapshot_id: String,
    /// `None`: a root (first after a cold boot); unknown for snapshots from before lineage
    /// (`parent_known` false).
    pub parent: Option<String>,
    pub parent_known: bool,
    pub epoch: u64,
    pub created_at: String,
    /// The snapshot's name, if it has one (read from its manifest: present snapshots only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `present`: in the store; `pruned`: removed by retention or `snapshot delete` (kept in
    /// the book);
    /// `corrupt`: in the store but its manifest does not check out.
    pub state: String,
    pub rolled_back: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trigger: String,
}

/// The report of `audit replay` (spec/003). `code` is `None` when every decision reproduced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    pub vm: String,
    pub mode: String,
    pub code: Option<String>,
    pub detail: String,
    /// `false` for audit and reexecute modes, live look-ups, or a forced divergence.
    pub authoritative: bool,
    pub decisions_checked: u64,
    pub entries_read: u64,
    pub from_seq: u64,
    pub through_seq: u64,
    pub stopped_at_seq: Option<u64>,
    pub divergences: Vec<ReplayDivergence>,
    pub live_calls: Vec<String>,
    pub non_authoritative_because: Vec<String>,
    /// `reexecute`: what the sandbox VM showed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Value>,
    /// The journal seq of the `REPLAY_RESULT` entry.
    pub result_seq: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayDivergence {
    pub decision: String,
    pub at_seq: u64,
    /// Canonical JSON (spec/003 §4) of `{"computed","decision","recorded","seq"}`.
    pub diff: String,
    /// What a force-continue token names (`backstop review sign --divergence DIGEST`).
    pub digest: String,
    pub forced_by: Option<String>,
}

/// One action of the pre-action gate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionView {
    pub action_id: String,
    /// `open`, `closed` (ended ok) or `rolled_back` (ended failed, micro rollback done).
    pub state: String,
    pub tier: u8,
    /// `filesystem_bulk_change`, `package_install`, ... (not `kind`: replies use that tag).
    pub action_kind: String,
    pub risk_level: String,
    /// The snapshot a micro rollback of this action returns to.
    pub snapshot_id: Option<String>,
    /// Whether `snapshot_id` was taken for this action (spec/000 §4.2 required one), or is the
    /// newest snapshot at the time it began (it did not).
    pub snapshot_taken: bool,
    pub opened_at: String,
    pub opened_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<Box<RollbackReport>>,
}

/// What `snapshot prune` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PruneView {
    pub removed: Vec<PrunedSnapshot>,
    pub kept: Vec<KeptSnapshot>,
    pub chunks_removed: u64,
    pub layers_removed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrunedSnapshot {
    pub snapshot_id: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptSnapshot {
    pub snapshot_id: String,
    pub reasons: Vec<String>,
}

/// A snapshot left off the current line by a rollback to an older one (spec/004 soft rollback).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolledBackMark {
    pub at: String,
    /// The snapshot the VM was rolled back to.
    pub rollback_to: String,
    pub rollback_type: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusView {
    pub vm: String,
    /// `stopped`, `booting`, `running`, `snapshotting`, `rolling_back` or `halted`.
    pub state: String,
    /// Rollback epoch the guest was last told.
    pub epoch: u64,
    pub backend: String,
    pub accel: String,
    pub pid: Option<u32>,
    pub snapshots: usize,
    pub newest_snapshot: Option<String>,
    /// The newest snapshot's name, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_snapshot_name: Option<String>,
    pub halted: Option<HaltView>,
    pub session_id: String,
    /// When the newest snapshot was taken (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_snapshot_at: Option<String>,
    /// How long ago the guest agent's last valid heartbeat arrived (none yet: `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_age_ms: Option<u64>,
    /// What the backend says about itself (libvirt: `domain`, `capture_mode`, `reconnects`).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub backend_details: serde_json::Map<String, serde_json::Value>,
    /// How many drifts are open now (spec/002 §3; `backstop drift` has the history).
    #[serde(default)]
    pub drift_open: usize,
    /// The open drifts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drift: Vec<DriftView>,
    /// The newest rollback this daemon ran for the VM (the start-up resume counts), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rollback: Option<LastRollbackView>,
    /// Rollbacks completed since the daemon started, by trigger (`console`, `watchdog`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rollbacks_by_trigger: BTreeMap<String, u64>,
    /// Times the VM entered HALTED since the daemon started (a HALTED state found at start-up
    /// is not counted again).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub halts: u64,
    /// The guest pause of the newest snapshot, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_snapshot_pause_us: Option<u64>,
    /// What the held snapshots stored (the sum of their `bytes_stored`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub store_bytes: u64,
    /// Each NIC's link as the guest reads it (read while the VM runs; empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkView>,
    /// Ids of the devices granted to the guest now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub granted_devices: Vec<String>,
    /// The guest is stopped since `halt clear --paused` (the VM is restored and its state
    /// `running`, but no guest code runs until `backstop resume`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub guest_paused: bool,
    /// The VM is not started because its baseline snapshot cannot be taken (no room for it
    /// yet): it never runs without a rollback target, and it starts by itself as soon as the
    /// baseline can be taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for_baseline: Option<HaltView>,
    /// Why a VM this daemon guards does not run at all (`state` `config_invalid` or
    /// `start_failed`): its code and reason, as `vms` shows them (`since` is empty: the daemon
    /// keeps no time for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_running: Option<HaltView>,
    /// The guest is paused by someone other than backstop (an operator's `virsh suspend`), and
    /// why: the heartbeat watchdog does not judge it until it runs again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_paused_outside: Option<String>,
    /// The daemon's off-host upload queue, when it has an `[offsite]` target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offsite: Option<OffsiteView>,
}

/// The newest rollback of a VM, for `status` and the metrics endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastRollbackView {
    pub snapshot_id: String,
    /// When it completed (RFC 3339).
    pub at: String,
    /// What set it off (`console`, `watchdog`, `host_trigger`, `daemon_resume`, …).
    pub trigger: String,
    pub rollback_type: String,
    pub duration_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What `backstop reload` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadReport {
    /// VMs started (new files, or files that were refused before and are good now).
    pub added: Vec<String>,
    /// VMs whose file is gone: stopped cleanly (final snapshot) and no longer guarded.
    pub removed: Vec<String>,
    /// Running VMs whose change was not applied, kept running as they were: a changed shape
    /// (memory, disks, devices, …: their snapshots cannot restore into it), or for an adopted
    /// domain a change of what is guarded (domain, connection, layers directory: a new
    /// adoption). `not_applied_why` says which, and what applying it takes.
    pub changed_not_applied: Vec<String>,
    /// Why each of `changed_not_applied` was not applied, and what applying it takes.
    #[serde(default)]
    pub not_applied_why: Vec<(String, String)>,
    /// Running VMs whose file changed anything else (watchdog, retention, schedule, …): stopped
    /// cleanly and started again on the new file, resuming from that final snapshot (an
    /// adopted domain: re-attached as it runs, no snapshot and no rollback).
    #[serde(default)]
    pub applied: Vec<String>,
    /// Files refused (name, reason); a VM already running under that name keeps running.
    pub refused: Vec<(String, String)>,
}

/// What `vm reset` did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmResetReport {
    /// The VM's line of `vms` once started again.
    pub vm: VmSummary,
    /// Where the damaged state directory was moved (whole, as it was).
    pub evidence: String,
    /// The old journal's last whole entry (seq and hash), as the new chain's first entry names it.
    pub old_head_seq: Option<u64>,
    pub old_head_hash: Option<String>,
}

/// What `vm check` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmCheckReport {
    pub vm: String,
    pub backend: String,
    /// Each thing to change before the VM can be guarded, with its fix; empty: ready.
    pub problems: Vec<String>,
    /// What guarding it would choose and cost (heartbeat source, capture mode and its pause).
    pub notes: Vec<String>,
}

/// The largest VM file `vm add` takes (a VM file is a few KiB).
pub const VM_FILE_MAX_BYTES: usize = 1 << 20;

/// What `vm add` did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmAddReport {
    /// The VM's line of `vms` once started.
    pub vm: VmSummary,
    /// The VM file written (`daemon.vms_dir/NAME.toml`).
    pub file: String,
    /// `--from-snapshot`: what was pulled, the lease taken, how the VM started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<AddedFromSnapshot>,
    pub total_ms: u64,
}

/// How `vm add --from-snapshot` started the VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AddedFromSnapshot {
    /// The snapshot's id in this host's store (the VM's first start restored it).
    pub snapshot_id: String,
    pub from: String,
    pub remote_snapshot_id: String,
    pub bytes_fetched: u64,
    /// Fetching and checking it, milliseconds.
    pub fetch_ms: u64,
    /// The lease now names this host until then (RFC 3339).
    pub lease_expires_at: String,
    /// The host whose expired lease was taken over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_over_from: Option<String>,
    /// Reading and writing the lease, milliseconds.
    pub lease_ms: u64,
    /// Starting the VM (its actor's start: the restore of the snapshot), milliseconds.
    pub start_ms: u64,
}

/// One line of `backstop vms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSummary {
    pub name: String,
    /// `qemu`, `kvm`, … (empty for a VM whose config was refused).
    pub backend: String,
    /// The lifecycle state, or `config_invalid` / `start_failed` for a VM that does not run.
    pub state: String,
    pub epoch: u64,
    pub snapshots: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_snapshot_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_age_ms: Option<u64>,
    /// Why it does not run (`config_invalid`, `start_failed`) or why it is HALTED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The last rollback: when, what set it off, how long it took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rollback: Option<LastRollbackView>,
    /// The guest's NIC links as it reads them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkView>,
    /// Devices granted to the guest now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub granted_devices: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaltView {
    pub reason: String,
    pub code: String,
    pub since: String,
}

/// One row of `snapshot list` (spec/001's required list fields plus capture figures).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSummary {
    pub snapshot_id: String,
    /// What a person called it (`snapshot create --name`), if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub created_at: String,
    pub created_by: String,
    pub schema_version: String,
    pub index_version: String,
    pub scope: String,
    pub reason: String,
    /// Guest pause during capture, microseconds.
    pub pause_us: u64,
    /// Bytes this snapshot added to the store (after deduplication).
    pub bytes_stored: u64,
    /// What took it: `schedule`, `pre_action`, `console`, `baseline`, ...
    #[serde(default)]
    pub trigger: String,
    /// Set when a rollback to an older snapshot left this one off the current line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<Box<RolledBackMark>>,
    /// The snapshot the running VM descends from: the newest one taken since the last rollback,
    /// or that rollback's target. At most one per list; none while the VM is HALTED.
    #[serde(default, skip_serializing_if = "is_false")]
    pub current: bool,
    /// Set when drift detection found it no longer verifies: never a rollback target again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unusable: Option<String>,
    /// Its off-host replication, when the daemon has an `[offsite]` target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationView>,
}

/// One snapshot's off-host replication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicationView {
    /// `pending` (not tried yet), `uploading`, `retrying` (an attempt failed) or `uploaded`.
    pub state: String,
    pub attempts: u32,
    /// Bytes sent by the attempt that completed (objects already in the bucket are not sent).
    pub bytes_uploaded: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_at: Option<String>,
}

/// The daemon's upload queue, in `status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsiteView {
    /// This host's name in the fleet.
    pub host: String,
    pub endpoint: String,
    pub bucket: String,
    /// Snapshots waiting for an upload (retries included).
    pub pending: u64,
    pub uploaded: u64,
    /// `vm/snapshot_id` being uploaded now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploading: Option<String>,
    /// The newest failure of a snapshot still pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Bytes sent since the daemon started.
    pub bytes_uploaded_total: u64,
    /// How long the oldest pending snapshot has waited, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_s: Option<u64>,
    /// It has waited longer than `lag_threshold_s` (`snapshot.replication.lagging`).
    #[serde(default)]
    pub lagging: bool,
    #[serde(default)]
    pub lag_threshold_s: u64,
    /// The leases of the VMs this daemon runs (`leases/<vm>.json`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<LeaseView>,
}

/// One VM's lease as the daemon last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseView {
    pub vm: String,
    /// `held` (by this host), `held_elsewhere`, `unreadable` or `renew_failing`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Wall time of the last successful lease write, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_write_ms: Option<u64>,
}

/// What `offsite gc` deleted from the bucket (or, `dry_run`, would delete).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsiteGcReport {
    pub host: String,
    pub dry_run: bool,
    /// This host's snapshots removed by remote retention (or abandoned uploads).
    pub snapshots_pruned: Vec<OffsitePruned>,
    /// This host's complete snapshots the bucket keeps.
    pub snapshots_kept: u64,
    /// Chunks and layers some manifest of some host needs.
    pub objects_referenced: u64,
    /// Unreferenced but younger than the grace period: kept.
    pub objects_in_grace: u64,
    pub objects_swept: u64,
    pub bytes_swept: u64,
    pub total_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsitePruned {
    pub snapshot_id: String,
    /// `retention` or `abandoned` (an upload that never finished).
    pub reason: String,
    pub objects: u64,
    pub bytes: u64,
}

/// What `snapshot pull` published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PullReport {
    /// The snapshot's id in this host's store.
    pub snapshot_id: String,
    pub from: String,
    /// Its id on the host that took it.
    pub remote_snapshot_id: String,
    pub bytes_fetched: u64,
    pub total_ms: u64,
    pub summary: SnapshotSummary,
    /// `--for-start`: the lease taken and the rollback that started the VM from the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<StartedHere>,
}

/// What `snapshot pull --for-start` did after publishing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartedHere {
    /// The lease now names this host until then (RFC 3339).
    pub lease_expires_at: String,
    /// The host whose expired lease was taken over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_over_from: Option<String>,
    /// Reading and writing the lease, milliseconds.
    pub lease_ms: u64,
    pub rollback: RollbackReport,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotView {
    pub summary: SnapshotSummary,
    /// The manifest exactly as stored.
    pub manifest: Value,
    /// Wall time of the capture, milliseconds.
    pub capture_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub snapshot_id: String,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub disk_layers_checked: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollbackReport {
    pub snapshot_id: String,
    /// `micro`, `session` or `emergency` (spec/000 §5).
    pub rollback_type: String,
    pub trigger: String,
    pub epoch: u64,
    /// Newer snapshots that failed verification and were skipped, with their codes.
    pub skipped: Vec<SkippedSnapshot>,
    /// What was taken away from the guest before the restore.
    pub revoked: Vec<String>,
    /// Request to guest running again, milliseconds.
    pub total_ms: u64,
    /// Time to load RAM and device state into the fresh VM, milliseconds.
    pub restore_ms: u64,
    /// Where the time went, in order: `choose` (list and verify the target), `gate`, `revoke`,
    /// `end`, `overlays`, `launch`, `load`, `check`, `resume`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseTime>,
    /// This answers a repeated trigger: nothing was rolled back now; this is the outcome of
    /// the first one, whose trace id this is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_of: Option<String>,
    /// The forensic snapshot keeping the disks this rollback abandoned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forensic_snapshot_id: Option<String>,
}

/// One phase of an operation and how long it took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTime {
    pub phase: String,
    pub ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedSnapshot {
    pub snapshot_id: String,
    pub code: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditVerifyReport {
    pub entries: u64,
    /// `None` when the whole chain verifies.
    pub first_bad: Option<AuditFault>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditFault {
    /// 1-based line number in the journal file.
    pub line: u64,
    /// `seq` of the entry, when it could be read.
    pub seq: Option<u64>,
    pub reason: String,
}

/// The configured devices, their grants, and what the hypervisor itself reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicesView {
    pub devices: Vec<DeviceView>,
    /// What this request changed, one line each (`granted tablet`, `revoked mic`).
    #[serde(default)]
    pub changed: Vec<String>,
    /// What the grantee of this request needs (the display's address and password). Only in
    /// the answer to the grant itself; never journaled, never listed again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub access: Vec<DeviceAccessView>,
    /// The running VM's devices as the hypervisor reports them (`None` when no VM runs).
    pub hypervisor: Option<HypervisorDevicesView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceView {
    pub id: String,
    /// `gpu`, `usb`, `audio`, `network` or `display`.
    pub class: String,
    /// What it is: `qemu usb-tablet`, `vfio 0000:01:00.0 (host driver nvidia)`, `nic net0`, `vnc`.
    pub source: String,
    pub max_lease_s: u64,
    pub grant: Option<GrantView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantView {
    /// `granted`, or `revoking` while the guest has not let go yet.
    pub state: String,
    pub granted_at: String,
    pub granted_by: String,
    pub lease_s: u64,
    pub expires_at: String,
    /// The snapshot taken before the grant: the rollback target while it lasts.
    pub pre_action_snapshot: String,
    /// Reasons the hypervisor refuses to migrate (snapshot) the VM that this grant added.
    pub migration_blockers: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAccessView {
    pub id: String,
    pub how: String,
    pub secret: String,
}

/// The hypervisor's own view of the VM's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HypervisorDevicesView {
    /// Devices added by id, with their type (QEMU: `/machine/peripheral`).
    pub peripherals: Vec<PeripheralView>,
    pub pci: Vec<PciFunctionView>,
    pub usb: Vec<UsbDeviceView>,
    pub display: Option<DisplayView>,
    pub links: Vec<LinkView>,
    pub migration_blockers: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeripheralView {
    pub id: String,
    pub device_type: String,
    pub grantable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunctionView {
    /// `bus:slot.function`, hex.
    pub address: String,
    pub vendor_id: u64,
    pub device_id: u64,
    pub class: u64,
    pub qdev_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsbDeviceView {
    pub port: String,
    pub product: String,
    pub id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisplayView {
    pub enabled: bool,
    pub auth: String,
    pub clients: usize,
    pub service: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkView {
    pub nic: String,
    /// As the guest reads it; `None` when it cannot be read now.
    pub up: Option<bool>,
}

#[cfg(test)]
mod rollback_tests;

#[cfg(test)]
mod device_request_tests {
    use super::*;

    #[test]
    fn device_requests_round_trip_and_are_strict() {
        let all = [
            Request::DeviceGrant {
                ids: vec!["tablet".into(), "mic".into()],
                lease_s: Some(60),
                reason: "r".into(),
            },
            Request::DeviceGrant {
                ids: vec!["gpu".into()],
                lease_s: None,
                reason: "r".into(),
            },
            Request::DeviceRevoke {
                id: "gpu".into(),
                reason: "r".into(),
            },
            Request::DeviceList,
        ];
        for r in all {
            let line = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r, "{line}");
        }
        assert_eq!(
            serde_json::to_string(&Request::DeviceList).unwrap(),
            r#"{"op":"device_list"}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"device_grant","ids":["a"],"reason":"r"}"#)
                .unwrap(),
            Request::DeviceGrant {
                ids: vec!["a".into()],
                lease_s: None,
                reason: "r".into()
            }
        );
        for bad in [
            r#"{"op":"device_list","x":1}"#,
            r#"{"op":"device_grant","ids":["a"],"reason":"r","host":"0000:01:00.0"}"#,
            r#"{"op":"device_grant","ids":"a","reason":"r"}"#,
            r#"{"op":"device_revoke","id":"a"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        assert_eq!(Request::DeviceList.name(), "device list");
    }

    #[test]
    fn a_devices_response_round_trips() {
        let view = DevicesView {
            devices: vec![DeviceView {
                id: "tablet".into(),
                class: "usb".into(),
                source: "qemu usb-tablet".into(),
                max_lease_s: 600,
                grant: Some(GrantView {
                    state: "granted".into(),
                    granted_at: "t".into(),
                    granted_by: "console:uid=0".into(),
                    lease_s: 60,
                    expires_at: "u".into(),
                    pre_action_snapshot: "abc".into(),
                    migration_blockers: vec![],
                }),
            }],
            changed: vec!["granted tablet".into()],
            access: vec![],
            hypervisor: Some(HypervisorDevicesView::default()),
        };
        let r = Response::Devices(view);
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains("access"), "{line}");
        assert_eq!(serde_json::from_str::<Response>(&line).unwrap(), r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_through_their_wire_form() {
        let r = Request::Rollback(RollbackArgs {
            to: Some("ab".into()),
            reason: "x".into(),
            emergency: true,
            rollback_type: None,
            before: None,
            reviewer_token: None,
            allow_newer_minor: false,
            include_forensic: false,
        });
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"op":"rollback","to":"ab","reason":"x","emergency":true}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
    }

    #[test]
    fn unknown_fields_and_ops_are_refused() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"status","x":1}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"audit_verify","x":1}"#).is_err());
        assert!(
            serde_json::from_str::<Request>(r#"{"op":"halt_clear","reason":"r","x":1}"#).is_err()
        );
        assert!(
            serde_json::from_str::<Request>(r#"{"op":"rollback","reason":"r","emergency":1}"#)
                .is_err()
        );
    }

    #[test]
    fn every_request_round_trips_and_optional_fields_may_be_omitted() {
        let all = [
            Request::Status,
            Request::SnapshotCreate {
                reason: "r".into(),
                name: None,
            },
            Request::SnapshotCreate {
                reason: "r".into(),
                name: Some("v1".into()),
            },
            Request::SnapshotDelete {
                id: "v1".into(),
                reason: "r".into(),
            },
            Request::SnapshotList,
            Request::SnapshotShow { id: "a".into() },
            Request::SnapshotVerify { id: "a".into() },
            Request::Rollback(RollbackArgs {
                to: None,
                reason: "r".into(),
                emergency: false,
                rollback_type: Some(RollbackType::Session),
                before: Some("2026-01-01T00:00:00Z".into()),
                reviewer_token: Some(serde_json::json!({"reviewer": "r"})),
                allow_newer_minor: true,
                include_forensic: false,
            }),
            Request::HaltClear { reason: "r".into() },
            Request::ActionBegin {
                descriptor: serde_json::json!({"action_id": "a"}),
            },
            Request::ActionEnd {
                action_id: "a".into(),
                result: ActionResult::Failed,
                reason: None,
            },
            Request::ActionList,
            Request::SnapshotPrune,
            Request::AuditTail { count: 20 },
            Request::AuditVerify,
            Request::DriftList,
            Request::OffsiteGc { dry_run: true },
            Request::OffsiteGc { dry_run: false },
        ];
        for r in all {
            let line = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r, "{line}");
        }
        assert_eq!(
            serde_json::to_string(&Request::Status).unwrap(),
            r#"{"op":"status"}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"offsite_gc"}"#).unwrap(),
            Request::OffsiteGc { dry_run: false }
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"rollback","reason":"r"}"#).unwrap(),
            Request::Rollback(RollbackArgs {
                to: None,
                reason: "r".into(),
                emergency: false,
                rollback_type: None,
                before: None,
                reviewer_token: None,
                allow_newer_minor: false,
                include_forensic: false,
            })
        );
    }

    #[test]
    fn policy_requests_are_strict() {
        for bad in [
            r#"{"op":"snapshot_prune","x":1}"#,
            r#"{"op":"action_list","x":1}"#,
            r#"{"op":"action_end","action_id":"a","result":"maybe"}"#,
            r#"{"op":"action_end","action_id":"a"}"#,
            r#"{"op":"action_begin"}"#,
            r#"{"op":"rollback","reason":"r","rollback_type":"partial"}"#,
            r#"{"op":"rollback","reason":"r","allow_newer_minor":"yes"}"#,
            r#"{"op":"rollback","reason":"r","scope":"guest_chosen"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        assert_eq!(
            serde_json::to_string(&Request::SnapshotPrune).unwrap(),
            r#"{"op":"snapshot_prune"}"#
        );
        assert_eq!(RollbackType::parse("micro"), Ok(RollbackType::Micro));
        assert!(RollbackType::parse("full").is_err());
        assert_eq!(Request::SnapshotPrune.name(), "snapshot prune");
        assert_eq!(
            serde_json::to_string(&Request::DriftList).unwrap(),
            r#"{"op":"drift_list"}"#
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"drift_list","vm":1}"#).is_err());
        // Replies are tagged `kind` and responses `type`: an action view must survive both.
        let view = ActionView {
            action_id: "a".into(),
            state: "open".into(),
            tier: 2,
            action_kind: "package_install".into(),
            risk_level: "HIGH".into(),
            snapshot_id: None,
            snapshot_taken: false,
            opened_at: "t".into(),
            opened_by: "c".into(),
            rollback: None,
        };
        for r in [
            Response::Action(view.clone()),
            Response::Actions {
                actions: vec![view],
            },
            Response::Pruned(PruneView {
                removed: vec![],
                kept: vec![],
                chunks_removed: 0,
                layers_removed: 0,
            }),
        ] {
            let line = serde_json::to_string(&Reply::Done(r.clone())).unwrap();
            assert_eq!(
                serde_json::from_str::<Reply>(&line).unwrap(),
                Reply::Done(r),
                "{line}"
            );
        }
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn names_and_delete_on_the_wire() {
        // A request from an older console (no name) still decodes; an unnamed one sends none.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"snapshot_create","reason":"r"}"#).unwrap(),
            Request::SnapshotCreate {
                reason: "r".into(),
                name: None
            }
        );
        let unnamed = Request::SnapshotCreate {
            reason: "r".into(),
            name: None,
        };
        assert_eq!(
            serde_json::to_string(&unnamed).unwrap(),
            r#"{"op":"snapshot_create","reason":"r"}"#
        );
        for bad in [
            r#"{"op":"snapshot_delete","id":"a"}"#,
            r#"{"op":"snapshot_delete","id":"a","reason":"r","force":true}"#,
            r#"{"op":"snapshot_create","reason":"r","name":1}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Request::SnapshotDelete {
                id: "a".into(),
                reason: "r".into()
            }
            .name(),
            "snapshot delete"
        );
        let r = Response::SnapshotDeleted(DeleteView {
            snapshot_id: "a".into(),
            name: Some("v1".into()),
            reason: "r".into(),
            chunks_removed: 3,
            layers_removed: 1,
        });
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Response>(&line).unwrap(), r);
    }
}
