//! Every event name the audit journal holds, each once. spec/001 names the snapshot lifecycle
//! chain (`snapshot.create.*`, `snapshot.restore.*`); spec/002's `RollbackInitiated` /
//! `RollbackCompleted` are `rollback.*`; the rest are backstop's own. Every entry also carries
//! `session_id`, `trace_id`, `snapshot_id` and `result` (spec/000 §11); [`AuditEvent::fields`]
//! lists what an event adds to those, always.

use std::fmt;

macro_rules! audit_events {
    ($( $(#[$doc:meta])* $variant:ident = $text:literal [$($field:literal),*]; )*) => {
        /// A journal event.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum AuditEvent {
            $( $(#[$doc])* $variant, )*
        }

        impl AuditEvent {
            /// Every event, in declaration order.
            pub const ALL: &'static [AuditEvent] = &[$(AuditEvent::$variant),*];

            /// The exact name written to the journal.
            pub const fn as_str(self) -> &'static str {
                match self { $(AuditEvent::$variant => $text,)* }
            }

            /// Fields this event always carries besides the four every entry has.
            pub fn fields(self) -> &'static [&'static str] {
                match self { $(AuditEvent::$variant => &[$($field),*],)* }
            }

            /// The event with this exact name, if backstop writes it.
            pub fn parse(s: &str) -> Option<AuditEvent> {
                match s { $($text => Some(AuditEvent::$variant),)* _ => None }
            }
        }
    };
}

/// Events whose journal name is the spec's exact name (spec/002's CamelCase drift events,
/// spec/003's upper-case replay records) rather than backstop's dotted lower-case style.
pub const SPEC_EXACT_NAMES: &[&str] = &[
    "DriftDetectedEvent",
    "DriftResolvedEvent",
    "REPLAY_REQUEST",
    "INTEGRITY_FAILURE",
    "REPLAY_DIVERGENCE",
    "REPLAY_TIMEOUT",
    "REPLAY_RESULT",
];

/// The fields every entry carries (spec/000 §11).
pub const COMMON_FIELDS: [&str; 4] = ["session_id", "trace_id", "snapshot_id", "result"];

audit_events! {
    /// spec/001: a snapshot was asked for.
    SnapshotCreateRequested = "snapshot.create.requested" ["reason", "trigger", "created_by", "scope"];
    /// spec/001: a snapshot was published.
    SnapshotCreateCompleted = "snapshot.create.completed" ["pause_us", "bytes_stored"];
    /// spec/001: a snapshot could not be taken.
    SnapshotCreateFailed = "snapshot.create.failed" ["code", "error"];
    /// A snapshot was put off because the VM holds a passthrough device.
    SnapshotCreateDeferred = "snapshot.create.deferred" ["code", "reason", "trigger", "devices"];
    /// A scheduled slot passed without a snapshot.
    SnapshotScheduleMissed = "snapshot.schedule.missed" [];
    /// A snapshot was removed by retention.
    SnapshotPruned = "snapshot.pruned" [];
    /// Off-host replication: every object of a published snapshot is in the `[offsite]` bucket, its
    /// manifest and ed25519 signature last (daemon journal).
    SnapshotReplicated = "snapshot.replicated" ["vm", "host", "bytes_uploaded", "objects_uploaded", "objects_present", "attempts"];
    /// An upload attempt failed; it is retried with backoff (daemon journal).
    SnapshotReplicationFailed = "snapshot.replication.failed" ["vm", "code", "error", "attempts", "retry_in_ms"];
    /// The oldest snapshot in the upload queue has waited longer than `[offsite]
    /// lag_threshold_s` (journaled once, until it catches up; daemon journal).
    SnapshotReplicationLagging = "snapshot.replication.lagging" ["vm", "oldest_wait_s", "threshold_s", "pending"];
    /// No queued snapshot waits longer than the threshold any more (daemon journal).
    SnapshotReplicationCaughtUp = "snapshot.replication.caught_up" ["lagged_s", "threshold_s"];
    /// Remote retention (`[offsite.retention]`) deleted one of this host's snapshots from the
    /// bucket: signature first, then manifest and indexes (daemon journal).
    OffsiteRetentionPruned = "offsite.retention.pruned" ["host", "reason", "objects", "bytes"];
    /// A remote GC pass deleted the chunks and layers no manifest of any host references and
    /// older than the grace period (daemon journal).
    OffsiteGcSwept = "offsite.gc.swept" ["host", "objects_swept", "bytes_swept", "objects_referenced", "objects_in_grace", "snapshots_pruned"];
    /// `snapshot pull`: another host's snapshot was verified and published here (daemon journal).
    SnapshotPulled = "snapshot.pulled" ["vm", "from", "remote_snapshot_id", "bytes_fetched"];
    /// `snapshot pull` refused or failed; nothing was published (daemon journal).
    SnapshotPullFailed = "snapshot.pull.failed" ["vm", "from", "remote_snapshot_id", "code", "error"];
    /// This host wrote the lease that says it runs the VM (`leases/<vm>.json` in the bucket):
    /// first taken, taken again after renewals failed, or taken over from another host's
    /// expired lease by `snapshot pull --for-start` (`taken_over_from`) (daemon journal).
    OffsiteLeaseAcquired = "offsite.lease.acquired" ["vm", "host", "expires_at", "ttl_s", "taken_over_from"];
    /// The lease of a VM this host runs could not be written (journaled once until it is
    /// written again); snapshots and rollbacks go on (daemon journal).
    OffsiteLeaseRenewFailed = "offsite.lease.renew_failed" ["vm", "code", "error"];
    /// Another host's lease names a VM this host runs: not taken (journaled once per holder)
    /// (daemon journal).
    OffsiteLeaseHeldElsewhere = "offsite.lease.held_elsewhere" ["vm", "holder", "expires_at"];
    /// A lease this host held was deleted (clean stop, or the VM removed) (daemon journal).
    OffsiteLeaseReleased = "offsite.lease.released" ["vm", "host"];
    /// A person deleted a snapshot (`snapshot delete`): removed as retention removes one.
    SnapshotDeleted = "snapshot.deleted" ["reason", "requested_by", "chain"];
    /// A retention pass finished.
    SnapshotPruneCompleted = "snapshot.prune.completed" [];
    /// A soft rollback left these snapshots off the current line.
    SnapshotMarkedRolledBack = "snapshot.marked_rolled_back" [];
    /// spec/001: a restore was asked for.
    SnapshotRestoreRequested = "snapshot.restore.requested" ["rollback_type", "trigger", "reason", "requested_by", "action_ids"];
    /// spec/001: the restore gate decided.
    SnapshotRestorePolicyDecision = "snapshot.restore.policy_decision" [];
    /// spec/001: a restore finished.
    SnapshotRestoreCompleted = "snapshot.restore.completed" ["epoch", "total_ms", "restore_ms"];
    /// spec/001: a restore failed.
    SnapshotRestoreFailed = "snapshot.restore.failed" ["code", "error"];
    /// A snapshot failed verification and was passed over for an older one.
    SnapshotVerifySkipped = "snapshot.verify.skipped" ["code"];
    /// A rollback candidate (or a newer snapshot the restore gate asked about) verified and fits
    /// the VM: the backend result a rollback's target decision rests on (spec/003's persisted
    /// output).
    SnapshotVerifyPassed = "snapshot.verify.passed" ["manifest_sha256"];
    /// A host trigger (or the watchdog) asked for a rollback.
    RollbackTriggered = "rollback.triggered" [];
    /// A host trigger repeated one already executed: nothing was done; the first's outcome
    /// was answered (triggers are idempotent).
    RollbackTriggerRepeated = "rollback.trigger.repeated" ["trigger_id", "first_trace_id", "first_result"];
    /// spec/002 `RollbackInitiated`.
    RollbackInitiated = "rollback.initiated" ["rollback_type", "trigger", "reason", "action_ids", "timestamp"];
    /// spec/002 `RollbackCompleted`.
    RollbackCompleted = "rollback.completed" ["rollback_type", "trigger", "reason", "action_ids", "timestamp", "revoked", "epoch"];
    /// A rollback could not complete (the VM is halted).
    RollbackFailed = "rollback.failed" ["rollback_type", "trigger", "reason", "action_ids", "timestamp", "step"];
    /// A running disk's layers were merged into its top layer (the chain was too deep).
    DiskChainFlattened = "disk.chain_flattened" ["disk", "depth_before", "depth_after"];
    /// A VM was started.
    VmStarted = "vm.started" [];
    VmStartDeferred = "vm.start_deferred" ["code", "reason"];
    /// A VM that already ran (a libvirt domain) was taken over without a restart.
    VmAdopted = "vm.adopted" ["uri", "domain", "uuid", "pid", "libvirt_version", "qemu_version", "capture_mode", "capture_mode_reason"];
    /// Files in the VM's layers directory that its record does not name were found and left
    /// untouched (a state reset, another daemon or host sharing the directory).
    LayersForeignFound = "layers.foreign_found" ["layers_dir", "files"];
    /// A guard claim whose holder is proven gone (its lock is free) was taken over.
    VmClaimTakenOver = "vm.claim_taken_over" ["claim", "previous"];
    /// The connection to the hypervisor's manager (libvirtd) was lost: the VM runs on, but
    /// nothing can be captured or restored through it until it is back.
    VmHypervisorDisconnected = "vm.hypervisor_disconnected" ["since", "error"];
    /// The connection is back (opened again, the VM found by UUID).
    VmHypervisorReconnected = "vm.hypervisor_reconnected" ["down_since", "down_ms"];
    /// A VM was brought back from the final snapshot of a clean stop (not a rollback).
    VmResumed = "vm.resumed" ["stopped_at"];
    /// The first entry of a chain started by `vm reset`: the damaged state moved aside as
    /// evidence, and the old journal's head (its last whole entry) it continues from.
    VmReset = "vm.reset" ["evidence", "old_head_seq", "old_head_hash", "reason", "requested_by"];
    /// An adopted domain left running by a clean stop was found as it was then (UUID, QEMU
    /// process, block graph, epoch) and guarded again as it runs: no rollback.
    VmReattached = "vm.reattached" ["stopped_at", "compared"];
    /// An adopted domain left running was not found as it was: what differs; the VM takes the
    /// fail-closed way (the newest verified snapshot).
    VmReattachRefused = "vm.reattach_refused" ["differs"];
    /// The VM's lifecycle moved from one state to another.
    VmStateChanged = "vm.state_changed" ["from", "to", "transition"];
    /// A VM entered HALTED.
    VmHalted = "vm.halted" ["code", "reason"];
    /// The guest was paused by someone other than backstop (`virsh suspend`): the heartbeat
    /// watchdog does not judge it while it stays paused.
    VmPausedOutside = "vm.paused_outside" ["detail"];
    /// A guest paused outside backstop runs again: the heartbeat's allowed silence counts from
    /// here.
    VmResumedOutside = "vm.resumed_outside" ["paused_ms"];
    /// A person continued a guest that `halt clear --paused` left stopped.
    VmContinued = "vm.continued" ["continued_by", "reason"];
    /// A person cleared a VM's HALTED state.
    VmHaltCleared = "vm.halt_cleared" ["cleared_by", "reason"];
    /// A passthrough device was given to the guest.
    DeviceGranted = "device.granted" [];
    /// A device grant was refused before anything changed.
    DeviceGrantRefused = "device.grant.refused" [];
    /// A device grant failed part way (what was granted is revoked).
    DeviceGrantFailed = "device.grant.failed" [];
    /// A device was taken away from the guest.
    DeviceRevoked = "device.revoked" [];
    /// A device removal was asked for and has not completed yet.
    DeviceRevokePending = "device.revoke.pending" [];
    /// A device's lease ran out.
    DeviceLeaseExpired = "device.lease_expired" [];
    /// A host action began (its pre-action snapshot was taken).
    ActionBegun = "action.begun" [];
    /// A host action was blocked (its pre-action snapshot failed).
    ActionBlocked = "action.blocked" [];
    /// A host action's descriptor was refused.
    ActionRefused = "action.refused" [];
    /// A host action ended.
    ActionEnded = "action.ended" [];
    /// The policy records could not be read; the engine runs on defaults.
    PolicyRecordsUnreadable = "policy.records_unreadable" [];
    /// A VM file was refused: that VM does not run, the others do (daemon journal).
    VmConfigInvalid = "vm.config_invalid" ["vm", "file", "code", "reason"];
    /// A VM was added by a reload (daemon journal).
    VmAdded = "vm.added" ["vm"];
    /// A VM's file was removed and the VM stopped cleanly by a reload (daemon journal).
    VmRemoved = "vm.removed" ["vm"];
    /// A VM's changed file was applied by a reload: stopped cleanly, started on the new file,
    /// resumed from the final snapshot (daemon journal).
    VmReconfigured = "vm.reconfigured" ["vm"];
    /// A VM moved from the daemon file into `vms_dir` had its single-VM state moved into its own
    /// directory, once (daemon journal and the VM's own).
    VmStateMigrated = "vm.state_migrated" ["vm", "from", "to", "moved", "layers_dir"];
    /// A VM's audit chain head at a snapshot, rollback, halt or stop (daemon journal), so a
    /// truncated VM journal is detected by the daemon's `audit verify`.
    VmChainAnchored = "vm.chain_anchored" ["vm", "seq", "hash", "anchored_event"];
    /// spec/002 §3.3 `DriftDetectedEvent` (its exact name): an invariant of the running VM
    /// does not hold (see the engine's `drift` module). Journaled once per (invariant, node)
    /// while it persists.
    DriftDetected = "DriftDetectedEvent" ["drift_type", "invariant_id", "node_id", "severity", "details"];
    /// spec/002 §3.3 `DriftResolvedEvent` (its exact name): a drift journaled before no longer
    /// holds; `resolution` says how it ended (an action taken, or the condition cleared).
    DriftResolved = "DriftResolvedEvent" ["drift_type", "invariant_id", "node_id", "severity", "details", "resolution"];
    /// The daemon started.
    DaemonStarted = "daemon.started" [];
    /// The daemon stopped cleanly.
    DaemonStopped = "daemon.stopped" [];
    /// The control socket turned away a peer whose uid is not allowed.
    ControlRefused = "control.refused" ["uid", "pid"];
    /// The journal cut off a torn last line (written by the journal itself).
    JournalTornTailRecovered = "journal.torn_tail_recovered" [];
    /// spec/003 §10: a replay was asked for.
    ReplayRequest = "REPLAY_REQUEST" ["mode", "requested_by", "from_seq", "through_seq"];
    /// spec/003 §6: a signature over recorded data (a journal entry, a manifest) did not match.
    ReplayIntegrityFailure = "INTEGRITY_FAILURE" ["detail"];
    /// spec/003 §7: a recomputed decision differs from the recorded one (canonical diff).
    ReplayDivergence = "REPLAY_DIVERGENCE" ["decision", "at_seq", "diff", "digest"];
    /// spec/003 §12: the replay ran past its time or step cap.
    ReplayTimeout = "REPLAY_TIMEOUT" ["steps", "elapsed_ms"];
    /// spec/003 §13: how a replay ended.
    ReplayResult = "REPLAY_RESULT" ["mode", "code", "authoritative", "decisions_checked"];
}

impl fmt::Display for AuditEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_are_distinct_lowercase_and_round_trip() {
        let mut seen = HashSet::new();
        for e in AuditEvent::ALL {
            assert!(seen.insert(e.as_str()), "{e} twice");
            assert_eq!(AuditEvent::parse(e.as_str()), Some(*e));
            // spec/002's drift events keep the spec's exact names (checked below).
            assert!(
                SPEC_EXACT_NAMES.contains(&e.as_str())
                    || e.as_str()
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b == b'.' || b == b'_')
            );
            for f in e.fields() {
                assert!(!COMMON_FIELDS.contains(f), "{e}: {f} is common");
            }
        }
    }

    #[test]
    fn spec_002_drift_names_are_exact() {
        assert_eq!(AuditEvent::DriftDetected.as_str(), "DriftDetectedEvent");
        assert_eq!(AuditEvent::DriftResolved.as_str(), "DriftResolvedEvent");
        for e in [AuditEvent::DriftDetected, AuditEvent::DriftResolved] {
            for f in [
                "drift_type",
                "invariant_id",
                "node_id",
                "severity",
                "details",
            ] {
                assert!(e.fields().contains(&f), "{e} lacks {f}");
            }
        }
        // The spec names and nothing else keep their capitals: two drift events (spec/002)
        // and five replay records (spec/003), each an event backstop writes.
        assert_eq!(SPEC_EXACT_NAMES.len(), 7);
        for n in SPEC_EXACT_NAMES {
            assert!(AuditEvent::parse(n).is_some(), "{n} is not an event");
        }
    }

    #[test]
    fn spec_001_chain_names_are_exact() {
        assert_eq!(
            AuditEvent::SnapshotCreateRequested.as_str(),
            "snapshot.create.requested"
        );
        assert_eq!(
            AuditEvent::SnapshotCreateCompleted.as_str(),
            "snapshot.create.completed"
        );
        assert_eq!(
            AuditEvent::SnapshotRestoreRequested.as_str(),
            "snapshot.restore.requested"
        );
        assert_eq!(
            AuditEvent::SnapshotRestorePolicyDecision.as_str(),
            "snapshot.restore.policy_decision"
        );
        assert_eq!(
            AuditEvent::SnapshotRestoreCompleted.as_str(),
            "snapshot.restore.completed"
        );
    }
}
