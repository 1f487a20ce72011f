//! Every stable error code backstop emits, with the console's exit status and a one-line
//! meaning. Error types carry one of these (`fn code(&self) -> ErrorCode`); the console, the
//! journal and the tests see the exact string (`as_str`), which never changes once published.

use std::fmt;

/// How the console exits for a code (also listed in `backstop --help`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// 1: the operation failed, for any reason not listed below.
    Failed,
    /// 2: usage error: the request's arguments are wrong (found by the daemon, as clap finds
    /// the console's own); nothing changed.
    Usage,
    /// 3: backstopd cannot be reached, or this user may not use it.
    Unreachable,
    /// 4: the VM is HALTED; a person must clear it.
    Halted,
    /// 5: a snapshot or the audit journal failed verification.
    Integrity,
}

impl ExitStatus {
    pub fn code(self) -> u8 {
        match self {
            ExitStatus::Failed => 1,
            ExitStatus::Usage => 2,
            ExitStatus::Unreachable => 3,
            ExitStatus::Halted => 4,
            ExitStatus::Integrity => 5,
        }
    }
}

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $variant:ident = $text:literal, $exit:ident, $meaning:literal; )*) => {
        /// A stable error code. Serialised as its exact string.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $( $(#[$doc])* #[doc = $meaning] $variant, )*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The exact string (spec/001, spec/003 or backstop's own).
            pub const fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $text,)* }
            }

            /// What the console's exit status is when a request fails with this code.
            pub fn exit_status(self) -> ExitStatus {
                match self { $(ErrorCode::$variant => ExitStatus::$exit,)* }
            }

            /// One line saying what the code means.
            pub fn meaning(self) -> &'static str {
                match self { $(ErrorCode::$variant => $meaning,)* }
            }

            /// The code with this exact string, if backstop knows it.
            pub fn parse(s: &str) -> Option<ErrorCode> {
                match s { $($text => Some(ErrorCode::$variant),)* _ => None }
            }
        }
    };
}

error_codes! {
    // spec/001 (Memory Snapshot Architecture).
    SnapshotIntegrityCheckFailed = "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED", Integrity,
        "a checksum or signature of a snapshot does not match: it cannot be trusted";
    SnapshotManifestInvalid = "ERR_SNAPSHOT_MANIFEST_INVALID", Integrity,
        "a snapshot's manifest is missing a field, malformed or not canonical";
    SnapshotCompatibilityBlocked = "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED", Integrity,
        "the snapshot's schema/index version or VM shape is not one this VM can load";
    SnapshotRestorePolicyBlocked = "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED", Failed,
        "the restore gate refused the rollback (reviewer evidence missing or not valid)";
    // spec/003 (Replay Constraints).
    MissingSnapshot = "MISSING_SNAPSHOT", Integrity,
        "the snapshot asked for does not exist (no snapshot has that id, name or prefix, or a prefix fits several)";
    IntegrityFailure = "INTEGRITY_FAILURE", Integrity,
        "replay: a signature over recorded data does not match";
    MissingPersistedAgentOutput = "MISSING_PERSISTED_AGENT_OUTPUT", Failed,
        "replay: an input the decision needed was not recorded";
    ResultMismatch = "RESULT_MISMATCH", Failed,
        "replay: the recomputed result differs from the recorded one";
    ReplayDivergence = "REPLAY_DIVERGENCE", Failed,
        "replay: an intermediate decision differs from the recorded one";
    ForceContinueRequired = "FORCE_CONTINUE_REQUIRED", Failed,
        "replay: continuing past a divergence needs an explicit, signed approval";
    ReplayTimeout = "REPLAY_TIMEOUT", Failed,
        "replay: stopped at its time or step cap before the end of the journal";
    // Snapshots (backstop's own).
    SnapshotCreateFailed = "ERR_SNAPSHOT_CREATE_FAILED", Failed,
        "a snapshot could not be taken; nothing was published";
    SnapshotCaptureFailed = "ERR_SNAPSHOT_CAPTURE_FAILED", Failed,
        "the hypervisor could not capture the VM's state";
    SnapshotAbandoned = "ERR_SNAPSHOT_ABANDONED", Failed,
        "a snapshot in flight was abandoned because a rollback overrides it (host trigger, emergency, watchdog)";
    VerifyPreempted = "ERR_VERIFY_PREEMPTED", Failed,
        "a verification (`snapshot verify`, drift detection) stopped because a rollback was waiting: ask again";
    SnapshotStalled = "ERR_SNAPSHOT_STALLED", Failed,
        "the store was too slow: the capture was abandoned so the guest would not stay stalled";
    BaselineSnapshotFailed = "ERR_BASELINE_SNAPSHOT_FAILED", Halted,
        "the first snapshot after a cold boot failed every try: the VM is HALTED rather than run with nothing to roll back to";
    SnapshotGuestUnhealthy = "ERR_SNAPSHOT_GUEST_UNHEALTHY", Failed,
        "the guest was not healthy when this snapshot was taken: a rollback passes it over while a healthy one verifies";
    SnapshotDeferred = "ERR_SNAPSHOT_DEFERRED", Failed,
        "a snapshot was not taken now and will be taken later";
    SnapshotDeferredDeviceGranted = "ERR_SNAPSHOT_DEFERRED_DEVICE_GRANTED", Failed,
        "the VM holds a passthrough device, which cannot be snapshotted: deferred until revoked";
    PreActionSnapshotFailed = "ERR_PRE_ACTION_SNAPSHOT_FAILED", Failed,
        "the pre-action snapshot failed, so the action is blocked (law 8)";
    StoreIo = "ERR_STORE_IO", Failed,
        "the snapshot store could not read or write a file";
    HostResourceExhausted = "ERR_HOST_RESOURCE_EXHAUSTED", Failed,
        "the host ran out of descriptors or memory: nothing was changed and no snapshot was judged; retry";
    // Rollback and the VM's lifecycle.
    VmHalted = "ERR_VM_HALTED", Halted,
        "the VM is HALTED: only `status`, `audit` and `halt clear` are accepted";
    VmBusy = "ERR_VM_BUSY", Failed,
        "the VM is in a state where this cannot be done now";
    NoVerifiedSnapshot = "ERR_NO_VERIFIED_SNAPSHOT", Failed,
        "no snapshot of the current line verifies, so the request was refused; nothing was changed and the VM runs on";
    NoVerifiedSnapshotHalted = "ERR_NO_VERIFIED_SNAPSHOT_HALTED", Halted,
        "a rollback found no snapshot that verifies to go to, so the VM is HALTED";
    RollbackFailedHalted = "ERR_ROLLBACK_FAILED_HALTED", Halted,
        "a rollback failed after the VM was touched, so the VM is HALTED";
    RollbackInterrupted = "ERR_ROLLBACK_INTERRUPTED", Halted,
        "a rollback never finished (the daemon stopped mid-rollback), so the VM is HALTED";
    RollbackStorm = "ERR_ROLLBACK_STORM", Halted,
        "the guest kept failing after repeated emergency rollbacks, so the VM is HALTED";
    VmEndedOutside = "ERR_VM_ENDED_OUTSIDE", Halted,
        "the VM was shut off outside backstop (e.g. `virsh destroy`), so it is HALTED until `halt clear` restores it";
    VmActorPanicked = "ERR_VM_ACTOR_PANICKED", Halted,
        "the VM's actor panicked: its guest was ended and the VM is HALTED (the others run on)";
    VmActorWedged = "ERR_VM_ACTOR_WEDGED", Halted,
        "the VM's actor stopped answering (wedged): its guest was ended and the VM is HALTED (the others run on)";
    VmNotFound = "ERR_VM_NOT_FOUND", Failed,
        "no VM of that name is guarded by this daemon (`backstop vms` lists them)";
    VmNotNamed = "ERR_VM_NOT_NAMED", Failed,
        "this daemon guards more than one VM: name one with --vm";
    VmExists = "ERR_VM_EXISTS", Failed,
        "a VM of that name is already configured on this daemon (`vm add` never replaces one)";
    VmNotRunning = "ERR_VM_NOT_RUNNING", Failed,
        "the VM does not run: its config was refused or it could not start";
    SnapshotNameInvalid = "ERR_SNAPSHOT_NAME_INVALID", Usage,
        "the snapshot name breaks the naming rule (letters, digits, '.', '_', '-'; not only hex digits); nothing changed";
    SnapshotNameTaken = "ERR_SNAPSHOT_NAME_TAKEN", Usage,
        "another live snapshot of the VM has this name already; nothing changed";
    SnapshotDeleteRefused = "ERR_SNAPSHOT_DELETE_REFUSED", Failed,
        "the snapshot cannot be deleted (the message names why: current, retention, only verified, a chain needs its layers, forensic hold); nothing changed";
    DriftDiskActiveLayer = "ERR_DRIFT_DISK_ACTIVE_LAYER", Failed,
        "a captured disk's top layer in the hypervisor is not the one backstop set (switched outside backstop): snapshots are refused until it is again";
    LayerExists = "ERR_LAYER_EXISTS", Failed,
        "a disk layer file backstop was about to create is already there: it was left as it was and nothing was changed";
    VmAlreadyGuarded = "ERR_VM_ALREADY_GUARDED", Failed,
        "another guardian (a VM file of this daemon, another daemon, or another host) holds this domain: nothing on it was changed";
    SnapshotNoSpace = "ERR_SNAPSHOT_NO_SPACE", Failed,
        "the VM's state directory has less free space than min_free_mib: the snapshot is refused";
    // Host actions and devices.
    ActionAlreadyOpen = "ERR_ACTION_ALREADY_OPEN", Failed,
        "an action with this id is already open";
    ActionDescriptorInvalid = "ERR_ACTION_DESCRIPTOR_INVALID", Failed,
        "the Action Descriptor is missing a field or has a bad value";
    ActionNotOpen = "ERR_ACTION_NOT_OPEN", Failed,
        "no open action has this id";
    ActionRollbackUnsupported = "ERR_ACTION_ROLLBACK_UNSUPPORTED", Failed,
        "the action declares it cannot be rolled back, which backstop does not allow";
    DeviceAlreadyGranted = "ERR_DEVICE_ALREADY_GRANTED", Failed,
        "the device is granted to the guest already";
    DeviceGrantFailed = "ERR_DEVICE_GRANT_FAILED", Failed,
        "the hypervisor could not give the device to the guest";
    DeviceHostBindFailed = "ERR_DEVICE_HOST_BIND_FAILED", Failed,
        "the host device could not be bound to vfio-pci";
    DeviceHostReleaseFailed = "ERR_DEVICE_HOST_RELEASE_FAILED", Failed,
        "the host device could not be reset or given back to its host driver";
    DeviceLeaseTooLong = "ERR_DEVICE_LEASE_TOO_LONG", Failed,
        "the lease asked for is longer than the device's configured maximum";
    DeviceNotConfigured = "ERR_DEVICE_NOT_CONFIGURED", Failed,
        "no device with this id is configured";
    DeviceNotGranted = "ERR_DEVICE_NOT_GRANTED", Failed,
        "the device is not granted to the guest";
    DeviceRevokeFailed = "ERR_DEVICE_REVOKE_FAILED", Failed,
        "the device could not be taken away from the guest";
    PolicyRecordsUnreadable = "ERR_POLICY_RECORDS_UNREADABLE", Failed,
        "the durable policy records (schedule, actions, marks) cannot be read";
    // Backends.
    Backend = "ERR_BACKEND", Failed,
        "the hypervisor backend failed a command";
    BackendLaunch = "ERR_BACKEND_LAUNCH", Failed,
        "the hypervisor process could not be started";
    BackendRestoreCheck = "ERR_BACKEND_RESTORE_CHECK", Failed,
        "a restored VM failed its checks before resume";
    BackendTimeout = "ERR_BACKEND_TIMEOUT", Failed,
        "the hypervisor did not answer in time";
    KvmConfigInvalid = "ERR_KVM_CONFIG_INVALID", Failed,
        "the embedded KVM backend's configuration is not valid";
    KvmRestoreFailed = "ERR_KVM_RESTORE_FAILED", Failed,
        "the embedded KVM backend could not restore a state file";
    KvmVm = "ERR_KVM_VM", Failed,
        "a KVM ioctl on the VM failed";
    LibvirtConnect = "ERR_LIBVIRT_CONNECT", Failed,
        "libvirt cannot be reached at the configured URI";
    LibvirtDomainNotFound = "ERR_LIBVIRT_DOMAIN_NOT_FOUND", Failed,
        "no libvirt domain has the configured name or UUID";
    LibvirtDomainUnsuitable = "ERR_LIBVIRT_DOMAIN_UNSUITABLE", Failed,
        "the libvirt domain lacks what backstop needs to guard it (the message names what to add)";
    LibvirtNoUserfaultfd = "ERR_LIBVIRT_NO_USERFAULTFD", Failed,
        "libvirt's QEMU cannot take background snapshots (vm.unprivileged_userfaultfd is 0)";
    VfioConfig = "ERR_VFIO_CONFIG", Failed,
        "a VFIO device address or driver name is not valid";
    VfioSysfs = "ERR_VFIO_SYSFS", Failed,
        "a sysfs write for VFIO bind, unbind or reset failed";
    // Audit journal.
    AuditChainBroken = "ERR_AUDIT_CHAIN_BROKEN", Failed,
        "the audit journal's hash chain or seal does not verify";
    AuditInvalidEntry = "ERR_AUDIT_INVALID_ENTRY", Failed,
        "an audit entry to be written is not valid (event name, fields)";
    AuditIo = "ERR_AUDIT_IO", Failed,
        "the audit journal could not be read or written";
    AuditLocked = "ERR_AUDIT_LOCKED", Failed,
        "another process holds the audit journal";
    // Control socket and console.
    ControlPermissionDenied = "ERR_CONTROL_PERMISSION_DENIED", Unreachable,
        "this caller may not do that (peer credentials or role)";
    ControlBadRequest = "ERR_CONTROL_BAD_REQUEST", Failed,
        "the request is not valid on the wire";
    ControlRequestTimeout = "ERR_CONTROL_REQUEST_TIMEOUT", Failed,
        "the request did not arrive whole in time";
    ControlUnavailable = "ERR_CONTROL_UNAVAILABLE", Unreachable,
        "backstopd is not running or its socket cannot be reached";
    ControlDisconnected = "ERR_CONTROL_DISCONNECTED", Failed,
        "backstopd closed the connection before answering";
    ControlBadReply = "ERR_CONTROL_BAD_REPLY", Failed,
        "backstopd's answer is not valid on the wire";
    ControlSocketSetup = "ERR_CONTROL_SOCKET_SETUP", Failed,
        "the control socket or its directory could not be set up";
    ControlAlreadyListening = "ERR_CONTROL_ALREADY_LISTENING", Failed,
        "another backstopd listens on the control socket";
    ControlAccept = "ERR_CONTROL_ACCEPT", Failed,
        "accepting a connection on the control socket failed";
    ControlAlreadyAnswered = "ERR_CONTROL_ALREADY_ANSWERED", Failed,
        "a request was answered twice (a bug)";
    ControlInternal = "ERR_CONTROL_INTERNAL", Failed,
        "the control server failed internally";
    ControlTooManyClients = "ERR_CONTROL_TOO_MANY_CLIENTS", Failed,
        "backstopd already serves its maximum of connections: retry when one ends";
    ConsoleEncode = "ERR_CONSOLE_ENCODE", Failed,
        "the console could not encode its output";
    // Off-host replication.
    OffsiteNotConfigured = "ERR_OFFSITE_NOT_CONFIGURED", Failed,
        "this daemon has no [offsite] target (or no fleet trust file for a pull)";
    OffsiteUnreachable = "ERR_OFFSITE_UNREACHABLE", Failed,
        "the off-host object store did not answer as expected (down, refused, or an error status)";
    OffsiteLeaseHeld = "ERR_OFFSITE_LEASE_HELD", Failed,
        "another host holds a live lease on this VM (it runs there): not started here";
    OffsiteDenied = "ERR_OFFSITE_DENIED", Failed,
        "the off-host object store refused this host's credentials or permissions (HTTP 403)";
    OffsiteQuotaExceeded = "ERR_OFFSITE_QUOTA_EXCEEDED", Failed,
        "the off-host bucket (or its owner) is over its storage quota: nothing more is accepted until it is raised or space is freed";
    // Everything else.
    BadRequest = "ERR_BAD_REQUEST", Failed,
        "the request's arguments are not valid; nothing changed";
    ConfigInvalid = "ERR_CONFIG_INVALID", Failed,
        "the configuration is not valid; nothing was started";
    Io = "ERR_IO", Failed,
        "a file the daemon needs could not be read or written";
    ShuttingDown = "ERR_SHUTTING_DOWN", Failed,
        "the daemon is shutting down";
}

impl ErrorCode {
    /// A snapshot that was put off, not failed: the slot it was for is journaled as deferred
    /// (both the general code and the passthrough-device one).
    pub fn is_deferral(self) -> bool {
        matches!(
            self,
            ErrorCode::SnapshotDeferred | ErrorCode::SnapshotDeferredDeviceGranted
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<ErrorCode> for &str {
    fn eq(&self, other: &ErrorCode) -> bool {
        *self == other.as_str()
    }
}

impl serde::Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// The exit status for a code string received over the wire; codes this console does not know
/// (a newer daemon) are plain failures.
pub fn exit_status_of(code: &str) -> ExitStatus {
    ErrorCode::parse(code).map_or(ExitStatus::Failed, ErrorCode::exit_status)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn strings_are_distinct_and_round_trip() {
        let mut seen = HashSet::new();
        for c in ErrorCode::ALL {
            assert!(seen.insert(c.as_str()), "{c} twice");
            assert_eq!(ErrorCode::parse(c.as_str()), Some(*c));
            assert!(!c.meaning().is_empty() && !c.meaning().contains('\n'));
            assert!(
                c.as_str().starts_with("ERR_")
                    || c.as_str()
                        .chars()
                        .all(|ch| ch.is_ascii_uppercase() || ch == '_'),
                "{c}"
            );
        }
        assert_eq!(ErrorCode::parse("ERR_NOT_A_CODE"), None);
    }

    #[test]
    fn the_spec_strings_are_exact() {
        assert_eq!(
            ErrorCode::SnapshotIntegrityCheckFailed.as_str(),
            "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED"
        );
        assert_eq!(
            ErrorCode::SnapshotManifestInvalid.as_str(),
            "ERR_SNAPSHOT_MANIFEST_INVALID"
        );
        assert_eq!(
            ErrorCode::SnapshotCompatibilityBlocked.as_str(),
            "ERR_SNAPSHOT_COMPATIBILITY_BLOCKED"
        );
        assert_eq!(
            ErrorCode::SnapshotRestorePolicyBlocked.as_str(),
            "ERR_SNAPSHOT_RESTORE_POLICY_BLOCKED"
        );
        for s in [
            "MISSING_SNAPSHOT",
            "INTEGRITY_FAILURE",
            "MISSING_PERSISTED_AGENT_OUTPUT",
            "RESULT_MISMATCH",
            "REPLAY_DIVERGENCE",
            "FORCE_CONTINUE_REQUIRED",
        ] {
            assert!(ErrorCode::parse(s).is_some(), "{s}");
        }
    }

    #[test]
    fn exit_statuses() {
        assert_eq!(exit_status_of("ERR_VM_HALTED"), ExitStatus::Halted);
        assert_eq!(
            exit_status_of("ERR_ROLLBACK_FAILED_HALTED"),
            ExitStatus::Halted
        );
        assert_eq!(exit_status_of("MISSING_SNAPSHOT"), ExitStatus::Integrity);
        // No verified snapshot: a halt when a rollback found none, a plain refusal otherwise.
        assert_eq!(
            exit_status_of("ERR_NO_VERIFIED_SNAPSHOT_HALTED"),
            ExitStatus::Halted
        );
        assert_eq!(
            exit_status_of("ERR_NO_VERIFIED_SNAPSHOT"),
            ExitStatus::Failed
        );
        assert_eq!(
            exit_status_of("ERR_CONTROL_UNAVAILABLE"),
            ExitStatus::Unreachable
        );
        assert_eq!(exit_status_of("ERR_SOMETHING_NEW"), ExitStatus::Failed);
        assert_eq!(ExitStatus::Integrity.code(), 5);
        // Usage errors the daemon finds exit as clap's do.
        assert_eq!(exit_status_of("ERR_SNAPSHOT_NAME_INVALID").code(), 2);
        assert_eq!(exit_status_of("ERR_SNAPSHOT_NAME_TAKEN").code(), 2);
        assert_eq!(exit_status_of("ERR_SNAPSHOT_DELETE_REFUSED").code(), 1);
    }
}
