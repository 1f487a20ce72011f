//! The command line: what a person types, and the request it becomes.

use std::path::PathBuf;

use backstop_control::{ActionResult, HostTrigger, Request, RollbackArgs, RollbackType};
use clap::{Parser, Subcommand};
use serde_json::Value;

/// Where backstopd listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/backstop/control.sock";

const AFTER_HELP: &str = "\
Exit status:
  0  the operation succeeded
  1  the operation failed (any error not listed below)
  2  usage error
  3  cannot reach backstopd, or permission denied
  4  the VM is halted (ERR_VM_HALTED; ERR_ROLLBACK_FAILED_HALTED: the rollback
     failed and halted it; ERR_NO_VERIFIED_SNAPSHOT_HALTED: the rollback found no
     snapshot that verifies and halted it); a person clears it with `backstop halt clear`
  5  integrity or verification failure (ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED,
     ERR_SNAPSHOT_MANIFEST_INVALID, ERR_SNAPSHOT_COMPATIBILITY_BLOCKED,
     MISSING_SNAPSHOT, or `audit verify` finding a bad entry)

With --json the result is printed on stdout as one pretty-printed JSON document (the
daemon's response), or {\"error\":{\"code\":..,\"message\":..}} on failure. Errors are also
printed as one line on stderr: `backstop: <CODE>: <message>`.";

/// backstop: the console of backstopd, which keeps a VM reversible.
#[derive(Debug, Parser)]
#[command(name = "backstop", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// Control socket of backstopd.
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "BACKSTOP_SOCKET",
        default_value = DEFAULT_SOCKET
    )]
    pub socket: PathBuf,

    /// Print the response as JSON on stdout (no progress output).
    #[arg(long, global = true)]
    pub json: bool,

    /// The VM the command is for (required when backstopd guards more than one; `backstop vms`
    /// lists them).
    #[arg(long, global = true, value_name = "NAME", env = "BACKSTOP_VM")]
    pub vm: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the guarded VM's state.
    Status,
    /// List every VM backstopd guards: backend, state, epoch, newest snapshot and heartbeat age.
    Vms {
        /// Keep the view live, redrawn every SECS seconds (default 2) until interrupted; with
        /// --json, one JSON line per refresh. A daemon that goes away is shown, not fatal.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2",
              value_parser = clap::value_parser!(u64).range(1..=3600))]
        watch: Option<u64>,
    },
    /// Re-read the VM files (daemon.vms_dir): start new VMs, stop removed ones cleanly; the
    /// other VMs are not disturbed.
    Reload,
    /// Add a VM to the daemon (daemon.vms_dir).
    #[command(subcommand)]
    Vm(VmCommand),
    /// Notifications, in journal order: snapshot_published, rollback_started,
    /// rollback_completed, rollback_halted, vm_halted, halt_cleared — each with its VM's
    /// journal seq. Without --vm: every VM.
    Events {
        /// Deliver what came after this seq of the VM's journal first (the last seq you saw:
        /// nothing is missed across a reconnect). Without it: only what happens from now.
        #[arg(long, value_name = "SEQ")]
        since: Option<u64>,
        /// Only these types (repeatable).
        #[arg(long = "type", value_name = "TYPE", value_parser = notification_type)]
        types: Vec<String>,
        /// Keep following (until interrupted); otherwise stop once caught up.
        #[arg(long)]
        follow: bool,
    },
    /// Drift: what changed behind backstop's back — the open and recently resolved drift of the
    /// VM (--vm NAME), and which invariants its backend checks (docs/drift.md).
    Drift,
    /// Create, list, show and verify snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// The off-host bucket (`[offsite]`).
    #[command(subcommand)]
    Offsite(OffsiteCommand),
    /// Roll the VM back to a verified snapshot. Emergency (the default without --to/--before):
    /// the newest verified snapshot, never blocked. Session: --to ID, the newest snapshot at or
    /// before --before TIME, or where this daemon session started; anything but the newest
    /// verified snapshot, or a target older than [restore_gate] max_target_age_hours (7 days),
    /// needs --reviewer-token. (Undoing one action: `action end ID --result failed`.)
    Rollback {
        /// Snapshot id, name or unique prefix of a session rollback.
        #[arg(long, value_name = "ID", value_parser = non_empty)]
        to: Option<String>,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// Emergency rollback (same as --type emergency).
        #[arg(long)]
        emergency: bool,
        /// micro, session or emergency.
        #[arg(long = "type", value_name = "TYPE", value_parser = rollback_type)]
        rollback_type: Option<RollbackType>,
        /// Session rollback to the newest snapshot created at or before this time: RFC 3339, or
        /// `YYYY-MM-DD HH:MM:SS` in UTC as `snapshot list` prints it.
        #[arg(long, value_name = "TIME", value_parser = time_arg)]
        before: Option<String>,
        /// Reviewer evidence: a token file made with `backstop review sign`.
        #[arg(long = "reviewer-token", value_name = "FILE", value_parser = json_file)]
        reviewer_token: Option<Value>,
        /// Accept a snapshot written by a newer minor version of backstop's snapshot format.
        #[arg(long)]
        compat: bool,
        /// Allow --to to name a forensic snapshot that kept RAM: the guest continues from
        /// where it was before the rollback that abandoned it.
        #[arg(long = "include-forensic")]
        include_forensic: bool,
    },
    /// Clear a HALTED VM (restores the newest verified snapshot).
    #[command(subcommand)]
    Halt(HaltCommand),
    /// Continue a guest that `halt clear --to ID --paused` left paused.
    Resume {
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
    /// Read and verify the audit journal.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Send a host trigger, as the host policy engine does: force_rollback,
    /// post_promotion_validation_failed, tier0_violation, sandbox_contradiction,
    /// undefined_behaviour. It overrides whatever is in flight.
    Trigger {
        /// The trigger.
        #[arg(value_parser = trigger_kind)]
        kind: HostTrigger,
        /// Why; recorded in the audit journal (never shown to the guest).
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// Action ids the trigger concerns (repeatable).
        #[arg(long = "action-id", value_name = "ID")]
        action_ids: Vec<String>,
        /// The trigger's identity: sending it again is a no-op answered with the first one's
        /// outcome. Default: the kind and the action ids (none without action ids).
        #[arg(long = "trigger-id", value_name = "ID")]
        trigger_id: Option<String>,
    },
    /// Grant, revoke and list the devices declared in the daemon's config.
    #[command(subcommand)]
    Device(DeviceCommand),
    /// The pre-action gate: begin and end actions described by Action Descriptors.
    #[command(subcommand)]
    Action(ActionCommand),
    /// Reviewer evidence for restores (runs here, without the daemon).
    #[command(subcommand)]
    Review(ReviewCommand),
}

#[derive(Debug, Subcommand)]
pub enum ActionCommand {
    /// Submit an Action Descriptor (JSON file). A snapshot is taken first when the action's tier
    /// or risk asks for one; the action is blocked if it fails or if the action declares no
    /// rollback.
    Begin {
        /// The descriptor: {action_id, tier, kind, risk_level, declared_effects, rollback}.
        #[arg(value_name = "FILE", value_parser = json_file)]
        descriptor: Value,
    },
    /// End an open action: ok closes it; failed rolls the VM back to its pre-action snapshot.
    End {
        #[arg(value_name = "ID", value_parser = non_empty)]
        action_id: String,
        /// ok or failed.
        #[arg(long, value_parser = action_result)]
        result: ActionResult,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: Option<String>,
    },
    /// The open actions.
    List,
}

#[derive(Debug, Subcommand)]
pub enum ReviewCommand {
    /// Create a new reviewer key (32 random bytes, mode 0600); never overwrites one.
    Keygen {
        #[arg(value_name = "FILE")]
        key: PathBuf,
    },
    /// Sign a reviewer token allowing a restore of one snapshot; prints it (JSON) on stdout.
    Sign {
        /// The reviewer key (the daemon's `[restore_gate] reviewer_key`).
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// The snapshot the restore may go to: its full id, or a name or unique prefix that
        /// backstopd resolves to the full id (the token names the full id).
        #[arg(long, value_name = "ID", value_parser = non_empty, required_unless_present = "divergence", conflicts_with = "divergence")]
        snapshot: Option<String>,
        /// Or: the digest of a replay divergence `audit replay --force-continue` may continue
        /// past (printed by `audit replay`).
        #[arg(long, value_name = "DIGEST", value_parser = non_empty)]
        divergence: Option<String>,
        /// Who reviewed it.
        #[arg(long, value_parser = non_empty)]
        reviewer: String,
        /// How long the token is valid (90s, 10m, 2h, 7d, "1h 30m"; at most 7 days).
        #[arg(long = "expires-in", value_name = "DURATION", default_value = "1h", value_parser = expiry)]
        expires_in: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeviceCommand {
    /// Give the guest devices (a pre-action snapshot is taken first; if it fails, nothing is
    /// granted). Devices that are hot-plugged into the VM must be granted together: no
    /// snapshot can be taken while one is held.
    Grant {
        /// Device ids from the config.
        #[arg(required = true, value_parser = non_empty)]
        ids: Vec<String>,
        /// How long: seconds, or with a unit (90s, 10m, 2h). Default: the devices' max_lease_s.
        #[arg(long, value_name = "DURATION", value_parser = lease)]
        lease: Option<u64>,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
    /// Take a granted device back now.
    Revoke {
        /// Device id.
        #[arg(value_parser = non_empty)]
        id: String,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
    /// The configured devices, their grants, and QEMU's own view of the VM's devices.
    List,
}

#[derive(Debug, Subcommand)]
pub enum OffsiteCommand {
    /// Remote retention and garbage collection now (it also runs every
    /// `[offsite.retention] gc_interval_s`): this host's snapshots that the bucket's own rule
    /// drops are deleted (signature first), then the chunks and layers no manifest of any host
    /// references and older than `gc_grace_s`. Prints what was deleted: counts and bytes.
    Gc {
        /// Only say what would be deleted.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Take a snapshot now.
    Create {
        /// Why; recorded in the manifest and the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// A name for it, usable wherever a snapshot id is: 1-63 letters, digits, '.', '_'
        /// or '-', starting with a letter or digit, not made of hex digits (0-9, a-f) alone
        /// (it would read as an id); unique among the VM's snapshots.
        #[arg(long, value_name = "NAME", allow_hyphen_values = true)]
        name: Option<String>,
    },
    /// List published snapshots, oldest first.
    List,
    /// Show the snapshots' lineage as a tree, with the VM's current position (works while
    /// HALTED).
    Tree,
    /// Show the snapshot the VM stands on now (the one it was last snapshotted or restored at):
    /// its summary, as `snapshot show` (works while HALTED).
    Current {
        /// And its whole manifest (`--json` always has it).
        #[arg(long)]
        full: bool,
    },
    /// Show one snapshot's summary (`--full`: and its whole manifest; `--json` always has it).
    Show {
        /// Snapshot id, name or unique prefix.
        #[arg(value_parser = non_empty)]
        id: String,
        /// Print the whole manifest after the summary.
        #[arg(long)]
        full: bool,
    },
    /// Verify a snapshot completely without touching the VM.
    Verify {
        /// Snapshot id, name or unique prefix.
        #[arg(value_parser = non_empty)]
        id: String,
    },
    /// Fetch a snapshot another host replicated off-host (`[offsite]`), verify it (its
    /// ed25519 signature against the fleet trust file, then every chunk and disk layer) and
    /// publish it into this VM's store; `rollback --to` then restores the VM from it.
    Pull {
        /// The snapshot's full id on the host that took it.
        #[arg(value_parser = non_empty)]
        id: String,
        /// That host's name in the fleet (the trust file's key).
        #[arg(long, value_parser = non_empty)]
        from: String,
        /// Run the VM here from it: refused (ERR_OFFSITE_LEASE_HELD, nothing pulled) while
        /// another host holds a live lease on the VM; otherwise this host takes the lease and
        /// the VM is rolled back to the pulled snapshot.
        #[arg(long)]
        for_start: bool,
    },
    /// Apply the retention policy now (it also runs after every scheduled snapshot).
    Prune,
    /// Delete one snapshot as retention would (journaled with the reason and who asked).
    /// Refused, with nothing changed, when the VM stands on it, another snapshot or the running
    /// VM needs its disk layers, or retention keeps it (one of the last N, hourly, daily, rolled
    /// back within the grace, the newest verified, an open action's, a forensic snapshot within
    /// keep_forensic_hours); the error names the reason.
    Delete {
        /// Snapshot id, name or unique prefix.
        #[arg(value_name = "ID|NAME", value_parser = non_empty)]
        id: String,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum HaltCommand {
    /// Clear HALTED (a person's decision).
    Clear {
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// Restore this snapshot (an id, name or unique prefix) instead of the newest verified one;
        /// anything but the newest verified snapshot needs --reviewer-token. Refused: the VM
        /// stays HALTED.
        #[arg(long, value_name = "ID", value_parser = non_empty)]
        to: Option<String>,
        /// Reviewer evidence for --to: a token file made with `backstop review sign`.
        #[arg(long = "reviewer-token", value_name = "FILE", value_parser = json_file, requires = "to")]
        reviewer_token: Option<Value>,
        /// Leave the restored guest paused (never continued): `status` shows it; no heartbeat
        /// watchdog and no snapshot until `backstop resume --reason R` continues it.
        #[arg(long, requires = "to")]
        paused: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Show the last entries of the audit journal.
    Tail {
        /// How many entries.
        #[arg(short = 'n', long = "count", value_name = "N", default_value_t = 20)]
        count: usize,
    },
    /// Verify the whole hash chain (of the VM; with --daemon, of the daemon journal and of
    /// every VM chain head it anchored, so a truncated VM journal shows).
    Verify {
        #[arg(long)]
        daemon: bool,
    },
    /// Replay the VM's journal: verify every signature, then recompute every
    /// recorded decision (rollback target, restore gate, epoch, soft-rollback marks, storm
    /// guard, state transitions, id provenance) from the recorded inputs and compare. Exit 0
    /// when all reproduce; the report's code (INTEGRITY_FAILURE, MISSING_SNAPSHOT,
    /// MISSING_PERSISTED_AGENT_OUTPUT, RESULT_MISMATCH, REPLAY_DIVERGENCE,
    /// FORCE_CONTINUE_REQUIRED, REPLAY_TIMEOUT) otherwise.
    Replay {
        /// audit: look up what was not recorded (non-authoritative); production: strict, no
        /// live call; reexecute: audit, then restore a snapshot into a sandbox VM.
        #[arg(long, value_enum, default_value = "audit")]
        mode: ReplayModeArg,
        /// Compare decisions from this journal seq on.
        #[arg(long = "from", value_name = "SEQ")]
        from_seq: Option<u64>,
        /// Continue past a divergence (needs --reviewer-token naming it; the report is then
        /// not authoritative).
        #[arg(long = "force-continue")]
        force_continue: bool,
        /// Reviewer evidence for --force-continue: `backstop review sign --divergence DIGEST`.
        #[arg(long = "reviewer-token", value_name = "FILE", value_parser = json_file)]
        reviewer_token: Option<Value>,
        /// reexecute: the snapshot the sandbox VM restores (default: the newest verified).
        #[arg(long, value_name = "ID")]
        snapshot: Option<String>,
        /// Stop after this many journal entries (REPLAY_TIMEOUT).
        #[arg(long = "max-steps", value_name = "N")]
        max_steps: Option<u64>,
        /// Stop after this long (REPLAY_TIMEOUT), e.g. 30s, 2m.
        #[arg(long, value_name = "DURATION", value_parser = duration_s)]
        timeout: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum VmCommand {
    /// Check FILE (NAME.toml) as backstopd loads a VM file, write it into daemon.vms_dir
    /// (atomically, never over a file) and start the VM as `reload` would. With
    /// --from-snapshot ID --from HOST ([offsite]): the VM starts from that snapshot of HOST,
    /// never cold-booted first (refused while another host holds a live lease on it; fetched
    /// and verified before anything is written; this host takes the lease).
    Add {
        /// The VM file (NAME.toml: `[vm]` and its tables, no `[daemon]`).
        #[arg(value_parser = vm_file)]
        file: VmFileArg,
        /// The snapshot's full id on the host that took it.
        #[arg(long, value_name = "ID", value_parser = non_empty)]
        from_snapshot: Option<String>,
        /// That host's name in the fleet (the trust file's key).
        #[arg(long, value_name = "HOST", value_parser = non_empty)]
        from: Option<String>,
    },
    /// Start VM NAME, whose state is damaged (a broken journal: ERR_AUDIT_CHAIN_BROKEN), on a
    /// new chain. Its state directory is moved aside whole as evidence (never deleted); the new
    /// journal opens with vm.reset naming the old head (seq, hash) and where the evidence is;
    /// the VM starts with a fresh baseline. Refused while the VM runs. Console only.
    Reset {
        /// The VM's name.
        #[arg(value_parser = non_empty)]
        name: String,
        /// Why; recorded as the new chain's first entry.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
    /// Check a VM file against this host, changing nothing: parsed as a load parses it, and for
    /// an adopted libvirt domain libvirt asked. Lists every problem at once, each with its fix
    /// (the XML to attach, the host setting), and what guarding it would choose (heartbeat,
    /// capture mode, the pause to expect). Exits 1 when there is anything to fix.
    Check {
        /// The VM file (NAME.toml), in vms.d or anywhere.
        #[arg(value_parser = vm_file)]
        file: VmFileArg,
    },
}

/// A VM file as read by the console: its file name and text (sent whole: the daemon may not
/// see the console's files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmFileArg {
    pub file_name: String,
    pub text: String,
}

fn vm_file(path: &str) -> Result<VmFileArg, String> {
    use std::io::Read;
    let max = backstop_control::VM_FILE_MAX_BYTES;
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let mut bytes = Vec::new();
    f.take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {path}: {e}"))?;
    if bytes.len() > max {
        return Err(format!("{path} is larger than {max} bytes"));
    }
    let text = String::from_utf8(bytes).map_err(|_| format!("{path} is not UTF-8 text"))?;
    let file_name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| format!("{path} names no file"))?;
    Ok(VmFileArg { file_name, text })
}

/// `audit replay --mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReplayModeArg {
    Audit,
    Production,
    Reexecute,
}

impl ReplayModeArg {
    fn as_str(self) -> &'static str {
        match self {
            ReplayModeArg::Audit => "audit",
            ReplayModeArg::Production => "production",
            ReplayModeArg::Reexecute => "reexecute",
        }
    }
}

/// `--timeout`: a [`seconds`] duration, at least one second and at most ten minutes (the
/// daemon's bound: a replay holds the VM's other work while it runs).
fn duration_s(s: &str) -> Result<u64, String> {
    let t = seconds(s)?.max(1);
    if t > 600 {
        return Err(format!("{s}: at most 10m"));
    }
    Ok(t)
}

impl Command {
    /// How much of the answer a person sees (`snapshot show --full`).
    pub fn detail(&self) -> crate::render::Detail {
        match self {
            Command::Snapshot(
                SnapshotCommand::Show { full: false, .. }
                | SnapshotCommand::Current { full: false },
            ) => crate::render::Detail::Summary,
            _ => crate::render::Detail::Full,
        }
    }

    /// The request this command sends.
    pub fn request(&self) -> Request {
        match self {
            Command::Status => Request::Status,
            Command::Vms { .. } => Request::Vms,
            Command::Reload => Request::Reload,
            Command::Vm(VmCommand::Add {
                file,
                from_snapshot,
                from,
            }) => Request::VmAdd {
                file_name: file.file_name.clone(),
                text: file.text.clone(),
                from_snapshot: from_snapshot.clone(),
                from: from.clone(),
            },
            Command::Vm(VmCommand::Reset { name, reason }) => Request::VmReset {
                name: name.clone(),
                reason: reason.clone(),
            },
            Command::Vm(VmCommand::Check { file }) => Request::VmCheck {
                file_name: file.file_name.clone(),
                text: file.text.clone(),
            },
            Command::Events {
                since,
                types,
                follow,
            } => Request::Events {
                since: *since,
                types: types.clone(),
                follow: *follow,
            },
            Command::Drift => Request::DriftList,
            Command::Snapshot(SnapshotCommand::Create { reason, name }) => {
                Request::SnapshotCreate {
                    reason: reason.clone(),
                    name: name.clone(),
                }
            }
            Command::Snapshot(SnapshotCommand::Delete { id, reason }) => Request::SnapshotDelete {
                id: id.clone(),
                reason: reason.clone(),
            },
            Command::Snapshot(SnapshotCommand::List) => Request::SnapshotList,
            Command::Snapshot(SnapshotCommand::Tree) => Request::SnapshotTree,
            Command::Snapshot(SnapshotCommand::Current { .. }) => Request::SnapshotCurrent,
            Command::Snapshot(SnapshotCommand::Show { id, .. }) => {
                Request::SnapshotShow { id: id.clone() }
            }
            Command::Snapshot(SnapshotCommand::Verify { id }) => {
                Request::SnapshotVerify { id: id.clone() }
            }
            Command::Snapshot(SnapshotCommand::Prune) => Request::SnapshotPrune,
            Command::Offsite(OffsiteCommand::Gc { dry_run }) => {
                Request::OffsiteGc { dry_run: *dry_run }
            }
            Command::Snapshot(SnapshotCommand::Pull {
                id,
                from,
                for_start,
            }) => Request::SnapshotPull {
                id: id.clone(),
                from: from.clone(),
                for_start: *for_start,
            },
            Command::Rollback {
                to,
                reason,
                emergency,
                rollback_type,
                before,
                reviewer_token,
                compat,
                include_forensic,
            } => Request::Rollback(RollbackArgs {
                to: to.clone(),
                reason: reason.clone(),
                emergency: *emergency,
                rollback_type: *rollback_type,
                before: before.clone(),
                reviewer_token: reviewer_token.clone(),
                allow_newer_minor: *compat,
                include_forensic: *include_forensic,
            }),
            Command::Halt(HaltCommand::Clear {
                reason, to: None, ..
            }) => Request::HaltClear {
                reason: reason.clone(),
            },
            Command::Halt(HaltCommand::Clear {
                reason,
                to: Some(to),
                reviewer_token,
                paused,
            }) => Request::HaltClearTo {
                reason: reason.clone(),
                to: to.clone(),
                reviewer_token: reviewer_token.clone(),
                paused: *paused,
            },
            Command::Resume { reason } => Request::Resume {
                reason: reason.clone(),
            },
            Command::Audit(AuditCommand::Tail { count }) => Request::AuditTail { count: *count },
            Command::Audit(AuditCommand::Verify { daemon: false }) => Request::AuditVerify,
            Command::Audit(AuditCommand::Verify { daemon: true }) => Request::DaemonAuditVerify,
            Command::Audit(AuditCommand::Replay {
                mode,
                from_seq,
                force_continue,
                reviewer_token,
                snapshot,
                max_steps,
                timeout,
            }) => Request::AuditReplay(backstop_control::ReplayAsk {
                mode: mode.as_str().into(),
                from_seq: *from_seq,
                force_continue: *force_continue,
                reviewer_token: reviewer_token.clone(),
                snapshot: snapshot.clone(),
                max_steps: *max_steps,
                timeout_s: *timeout,
            }),
            Command::Trigger {
                kind,
                reason,
                action_ids,
                trigger_id,
            } => Request::Trigger {
                kind: *kind,
                reason: reason.clone(),
                action_ids: action_ids.clone(),
                trigger_id: trigger_id.clone(),
            },
            Command::Device(DeviceCommand::Grant { ids, lease, reason }) => Request::DeviceGrant {
                ids: ids.clone(),
                lease_s: *lease,
                reason: reason.clone(),
            },
            Command::Device(DeviceCommand::Revoke { id, reason }) => Request::DeviceRevoke {
                id: id.clone(),
                reason: reason.clone(),
            },
            Command::Device(DeviceCommand::List) => Request::DeviceList,
            Command::Action(ActionCommand::Begin { descriptor }) => Request::ActionBegin {
                descriptor: descriptor.clone(),
            },
            Command::Action(ActionCommand::End {
                action_id,
                result,
                reason,
            }) => Request::ActionEnd {
                action_id: action_id.clone(),
                result: *result,
                reason: reason.clone(),
            },
            Command::Action(ActionCommand::List) => Request::ActionList,
            // Never sent: `review` runs locally (see `local`); status is harmless if it were.
            Command::Review(_) => Request::Status,
        }
    }

    /// Commands that run here without the daemon: `Some((exit code, stdout, stderr))`.
    pub fn local(&self) -> Option<(u8, String, String)> {
        self.local_as(false)
    }

    /// [`Self::local`], with `--json` honoured: the result as one JSON document on stdout, a
    /// failure as `{"error":{..}}` too (the stderr line is the same).
    pub fn local_as(&self, json: bool) -> Option<(u8, String, String)> {
        let Command::Review(review) = self else {
            return None;
        };
        let done = match review {
            ReviewCommand::Keygen { key } => {
                backstop_control::evidence::create_key(key).map(|()| {
                    if json {
                        let doc = serde_json::json!({"reviewer_key": key.display().to_string()});
                        serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
                    } else {
                        format!("reviewer key written to {}\n", key.display())
                    }
                })
            }
            ReviewCommand::Sign {
                key,
                snapshot,
                divergence,
                reviewer,
                expires_in,
            } => backstop_control::evidence::load_key(key).and_then(|k| {
                // Exactly one is given (clap); both are 32 hex digits, signed alike.
                let subject = snapshot
                    .as_deref()
                    .or(divergence.as_deref())
                    .unwrap_or_default();
                let secs = i64::try_from(*expires_in).unwrap_or(i64::MAX);
                let until = time::OffsetDateTime::now_utc()
                    .checked_add(time::Duration::seconds(secs))
                    .unwrap_or(time::OffsetDateTime::now_utc());
                let t = backstop_control::evidence::sign(&k, subject, reviewer, until)?;
                Ok(serde_json::to_string_pretty(&t).unwrap_or_default() + "\n")
            }),
        };
        Some(match done {
            Ok(out) => (crate::exit::OK, out, String::new()),
            Err(e) => (
                crate::exit::FAILED,
                if json {
                    crate::render::error_json("ERR_REVIEWER_EVIDENCE", &e.to_string())
                } else {
                    String::new()
                },
                format!("backstop: ERR_REVIEWER_EVIDENCE: {e}\n"),
            ),
        })
    }
}

/// Largest JSON file the console reads (descriptors, tokens).
const JSON_FILE_MAX_BYTES: u64 = 64 * 1024;

/// Reads and parses a small JSON file named on the command line.
fn json_file(path: &str) -> Result<Value, String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let mut bytes = Vec::new();
    f.take(JSON_FILE_MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {path}: {e}"))?;
    if bytes.len() as u64 > JSON_FILE_MAX_BYTES {
        return Err(format!("{path} is larger than {JSON_FILE_MAX_BYTES} bytes"));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{path} is not JSON: {e}"))
}

fn rollback_type(value: &str) -> Result<RollbackType, String> {
    RollbackType::parse(value).map_err(|_| "one of: micro, session, emergency".to_string())
}

fn action_result(value: &str) -> Result<ActionResult, String> {
    match value {
        "ok" => Ok(ActionResult::Ok),
        "failed" => Ok(ActionResult::Failed),
        _ => Err("ok or failed".into()),
    }
}

/// Every duration the console takes, in whole seconds: bare digits are seconds, anything else
/// is humantime's (`90s`, `10m`, `2h`, `7d`, `1h 30m`).
fn seconds(value: &str) -> Result<u64, String> {
    let v = value.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return v.parse::<u64>().map_err(|_| "too long".to_string());
    }
    humantime::parse_duration(v)
        .map(|d| d.as_secs())
        .map_err(|e| format!("a duration like 90s, 10m, 2h or 7d ({e})"))
}

/// A [`seconds`] duration of at least one second.
fn at_least_one_second(value: &str) -> Result<u64, String> {
    match seconds(value)? {
        0 => Err("must be at least 1 s".into()),
        s => Ok(s),
    }
}

/// A lease: `300`, `300s`, `10m`, `2h` → seconds (at least 1). One number with a unit of
/// seconds, minutes or hours: a device lease is not written in days.
fn lease(value: &str) -> Result<u64, String> {
    let unit = value
        .trim()
        .trim_start_matches(|c: char| c.is_ascii_digit());
    if !matches!(unit, "" | "s" | "m" | "h") {
        return Err("a duration like 300, 90s, 10m or 2h (the unit must be s, m or h)".into());
    }
    at_least_one_second(value)
}

/// `--expires-in`: a [`seconds`] duration from 1 s to the 7 days a reviewer token may live.
fn expiry(value: &str) -> Result<u64, String> {
    const MAX: u64 = 7 * 86_400;
    match at_least_one_second(value)? {
        s if s > MAX => Err("at most 7 days".into()),
        s => Ok(s),
    }
}

/// `--before`: an RFC 3339 time, or `YYYY-MM-DD HH:MM:SS` / `YYYY-MM-DDTHH:MM:SS` taken as UTC
/// (what `snapshot list` prints); sent to the daemon as RFC 3339.
fn time_arg(value: &str) -> Result<String, String> {
    use time::format_description::well_known::Rfc3339;
    let v = value.trim();
    if let Some(t) = backstop_common::time::parse_rfc3339(v) {
        return t.format(&Rfc3339).map_err(|e| e.to_string());
    }
    let t_sep = time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]");
    time::PrimitiveDateTime::parse(v, crate::render::SHORT_TIME)
        .or_else(|_| time::PrimitiveDateTime::parse(v, &t_sep))
        .map_err(|_| {
            "a time like 2026-05-01T12:00:00Z, or 2026-05-01 12:00:00 (UTC) as `snapshot list` prints"
                .to_string()
        })
        .and_then(|t| t.assume_utc().format(&Rfc3339).map_err(|e| e.to_string()))
}

fn trigger_kind(value: &str) -> Result<HostTrigger, String> {
    HostTrigger::parse(value).ok_or_else(|| {
        let names: Vec<&str> = HostTrigger::ALL.iter().map(|k| k.as_str()).collect();
        format!("unknown trigger; one of: {}", names.join(", "))
    })
}

fn notification_type(value: &str) -> Result<String, String> {
    if backstop_control::NOTIFICATION_TYPES.contains(&value) {
        Ok(value.to_string())
    } else {
        Err(format!(
            "unknown event type; one of: {}",
            backstop_control::NOTIFICATION_TYPES.join(", ")
        ))
    }
}

/// Refuses an empty or blank value (a reason must say something).
fn non_empty(value: &str) -> Result<String, String> {
    if value.trim().is_empty() {
        Err("must not be empty".to_string())
    } else {
        Ok(value.to_string())
    }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("backstop").chain(args.iter().copied()))
    }

    fn request(args: &[&str]) -> Request {
        parse(args).unwrap().command.request()
    }

    #[test]
    fn vm_add_sends_the_file_whole_and_from_snapshot_needs_from() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("web.toml");
        std::fs::write(&file, "[vm]\nname = \"web\"\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(
            request(&["vm", "add", path]),
            Request::VmAdd {
                file_name: "web.toml".into(),
                text: "[vm]\nname = \"web\"\n".into(),
                from_snapshot: None,
                from: None,
            }
        );
        let id = "a".repeat(32);
        let both = request(&[
            "vm",
            "add",
            path,
            "--from-snapshot",
            &id,
            "--from",
            "host-a",
        ]);
        assert!(crate::precheck(&both, false).is_none());
        for args in [
            vec!["vm", "add", path, "--from-snapshot", id.as_str()],
            vec!["vm", "add", path, "--from", "host-a"],
        ] {
            let out = crate::precheck(&request(&args), false).unwrap();
            assert!(
                out.stderr.starts_with("backstop: ERR_BAD_REQUEST: "),
                "{}",
                out.stderr
            );
            assert_eq!(out.stderr.trim().lines().count(), 1);
            assert_ne!(out.exit_code, 0);
        }
        // A file that cannot be read is a usage error before anything is sent.
        assert!(parse(&["vm", "add", "/nonexistent-backstop/web.toml"]).is_err());
    }

    #[test]
    fn snapshot_show_is_a_summary_unless_full() {
        use crate::render::Detail;
        let detail = |args: &[&str]| parse(args).unwrap().command.detail();
        assert_eq!(detail(&["snapshot", "show", "ab12"]), Detail::Summary);
        assert_eq!(
            detail(&["snapshot", "show", "--full", "ab12"]),
            Detail::Full
        );
        assert_eq!(detail(&["snapshot", "list"]), Detail::Full);
        // The request is the same either way: the daemon always sends the whole manifest.
        assert_eq!(
            request(&["snapshot", "show", "ab12", "--full"]),
            Request::SnapshotShow { id: "ab12".into() }
        );
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn commands_become_requests() {
        assert_eq!(request(&["status"]), Request::Status);
        assert_eq!(request(&["vms"]), Request::Vms);
        assert_eq!(request(&["vms", "--watch"]), Request::Vms);
        for (args, want) in [
            (&["vms"][..], None),
            (&["vms", "--watch"], Some(2)),
            (&["vms", "--watch", "5"], Some(5)),
        ] {
            match parse(args).unwrap().command {
                Command::Vms { watch } => assert_eq!(watch, want, "{args:?}"),
                other => panic!("{other:?}"),
            }
        }
        for bad in [&["vms", "--watch", "0"][..], &["vms", "--watch", "x"]] {
            assert_eq!(parse(bad).unwrap_err().exit_code(), 2, "{bad:?}");
        }
        assert_eq!(request(&["reload"]), Request::Reload);
        assert_eq!(
            request(&["vm", "reset", "db1", "--reason", "edited journal"]),
            Request::VmReset {
                name: "db1".into(),
                reason: "edited journal".into(),
            }
        );
        assert_eq!(
            request(&["offsite", "gc", "--dry-run"]),
            Request::OffsiteGc { dry_run: true }
        );
        assert_eq!(
            request(&["offsite", "gc"]),
            Request::OffsiteGc { dry_run: false }
        );
        assert_eq!(
            request(&["audit", "verify", "--daemon"]),
            Request::DaemonAuditVerify
        );
        let cli = parse(&["--vm", "web1", "snapshot", "list"]).unwrap();
        assert_eq!(cli.vm.as_deref(), Some("web1"));
        let cli = parse(&["snapshot", "list", "--vm", "web2"]).unwrap();
        assert_eq!(cli.vm.as_deref(), Some("web2"));
        assert_eq!(
            request(&["snapshot", "create", "--reason", "before update"]),
            Request::SnapshotCreate {
                reason: "before update".into(),
                name: None,
            }
        );
        assert_eq!(request(&["snapshot", "list"]), Request::SnapshotList);
        assert_eq!(
            request(&["snapshot", "show", "ab12"]),
            Request::SnapshotShow { id: "ab12".into() }
        );
        assert_eq!(
            request(&["snapshot", "verify", "ab12"]),
            Request::SnapshotVerify { id: "ab12".into() }
        );
        assert_eq!(
            request(&["rollback", "--reason", "r"]),
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
        assert_eq!(
            request(&["rollback", "--to", "ab", "--reason", "r", "--emergency"]),
            Request::Rollback(RollbackArgs {
                to: Some("ab".into()),
                reason: "r".into(),
                emergency: true,
                rollback_type: None,
                before: None,
                reviewer_token: None,
                allow_newer_minor: false,
                include_forensic: false,
            })
        );
        assert_eq!(
            request(&["halt", "clear", "--reason", "ok"]),
            Request::HaltClear {
                reason: "ok".into()
            }
        );
        assert_eq!(
            request(&["halt", "clear", "--reason", "ok", "--to", "ab12"]),
            Request::HaltClearTo {
                reason: "ok".into(),
                to: "ab12".into(),
                reviewer_token: None,
                paused: false,
            }
        );
        // Evidence only goes with a chosen snapshot.
        assert_eq!(
            parse(&["halt", "clear", "--reason", "ok", "--reviewer-token", "/x"])
                .unwrap_err()
                .exit_code(),
            2
        );
        assert_eq!(
            request(&["audit", "tail"]),
            Request::AuditTail { count: 20 }
        );
        assert_eq!(
            request(&["audit", "tail", "-n", "5"]),
            Request::AuditTail { count: 5 }
        );
        assert_eq!(request(&["audit", "verify"]), Request::AuditVerify);
    }

    #[test]
    fn global_flags_go_anywhere_and_default_sensibly() {
        let cli = parse(&["status"]).unwrap();
        if std::env::var_os("BACKSTOP_SOCKET").is_none() {
            assert_eq!(cli.socket, PathBuf::from(DEFAULT_SOCKET));
        }
        assert!(!cli.json);
        let cli = parse(&["audit", "verify", "--json", "--socket", "/tmp/s"]).unwrap();
        assert!(cli.json);
        assert_eq!(cli.socket, PathBuf::from("/tmp/s"));
    }

    #[test]
    fn a_reason_is_required_and_must_say_something() {
        for args in [
            &["snapshot", "create"][..],
            &["snapshot", "create", "--reason", ""],
            &["rollback"],
            &["rollback", "--reason", "   "],
            &["rollback", "--to", "", "--reason", "r"],
            &["halt", "clear"],
            &["halt", "clear", "--reason", ""],
            &["snapshot", "show", ""],
            &["audit", "tail", "-n", "many"],
            &["format-disk"],
        ] {
            let err = parse(args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{args:?}");
            assert_ne!(err.kind(), ErrorKind::DisplayHelp, "{args:?}");
        }
    }

    #[test]
    fn help_documents_the_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("Exit status:"), "{help}");
        assert!(help.contains("4  the VM is halted"), "{help}");
    }

    #[test]
    fn policy_commands_become_requests() {
        let d = tempfile::tempdir().unwrap();
        let desc = d.path().join("action.json");
        std::fs::write(&desc, r#"{"action_id":"a1","tier":2}"#).unwrap();
        let token = d.path().join("token.json");
        std::fs::write(&token, r#"{"reviewer":"alice"}"#).unwrap();
        let desc_s = desc.to_str().unwrap();
        let token_s = token.to_str().unwrap();
        assert_eq!(
            request(&["action", "begin", desc_s]),
            Request::ActionBegin {
                descriptor: serde_json::json!({"action_id": "a1", "tier": 2})
            }
        );
        assert_eq!(
            request(&["action", "end", "a1", "--result", "failed"]),
            Request::ActionEnd {
                action_id: "a1".into(),
                result: ActionResult::Failed,
                reason: None
            }
        );
        assert_eq!(request(&["action", "list"]), Request::ActionList);
        assert_eq!(request(&["drift"]), Request::DriftList);
        assert_eq!(request(&["--vm", "web1", "drift"]), Request::DriftList);
        assert_eq!(request(&["snapshot", "prune"]), Request::SnapshotPrune);
        assert_eq!(
            request(&[
                "rollback",
                "--type",
                "session",
                "--before",
                "2026-05-01T12:00:00Z",
                "--reviewer-token",
                token_s,
                "--compat",
                "--reason",
                "r",
            ]),
            Request::Rollback(RollbackArgs {
                to: None,
                reason: "r".into(),
                emergency: false,
                rollback_type: Some(RollbackType::Session),
                before: Some("2026-05-01T12:00:00Z".into()),
                reviewer_token: Some(serde_json::json!({"reviewer": "alice"})),
                allow_newer_minor: true,
                include_forensic: false,
            })
        );
        let missing = d.path().join("none.json");
        let not_json = d.path().join("bad.json");
        std::fs::write(&not_json, "{").unwrap();
        for args in [
            &["action", "begin", missing.to_str().unwrap()][..],
            &["action", "begin", not_json.to_str().unwrap()],
            &["action", "end", "a1", "--result", "maybe"],
            &["action", "end", "a1"],
            &["rollback", "--type", "partial", "--reason", "r"],
            &["review", "sign", "--key", "k", "--reviewer", "a"],
        ] {
            assert_eq!(parse(args).unwrap_err().exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn review_keygen_and_sign_run_locally() {
        let d = tempfile::tempdir().unwrap();
        let key = d.path().join("reviewer.key");
        let key_s = key.to_str().unwrap();
        let (code, out, _) = parse(&["review", "keygen", key_s])
            .unwrap()
            .command
            .local()
            .unwrap();
        assert_eq!(code, 0, "{out}");
        let id = "0123456789abcdef0123456789abcdef";
        let cli = parse(&[
            "review",
            "sign",
            "--key",
            key_s,
            "--snapshot",
            id,
            "--reviewer",
            "alice",
        ])
        .unwrap();
        let (code, out, err) = cli.command.local().unwrap();
        assert_eq!(code, 0, "{err}");
        let token: Value = serde_json::from_str(&out).unwrap();
        let k = backstop_control::evidence::load_key(&key).unwrap();
        let now = time::OffsetDateTime::now_utc();
        assert_eq!(
            backstop_control::evidence::verify(&k, &token, id, now)
                .unwrap()
                .reviewer,
            "alice"
        );
        // A short id cannot be signed; a second keygen does not overwrite.
        let cli = parse(&[
            "review",
            "sign",
            "--key",
            key_s,
            "--snapshot",
            "0123",
            "--reviewer",
            "a",
        ])
        .unwrap();
        let (code, _, err) = cli.command.local().unwrap();
        assert_eq!(code, 1);
        assert!(
            err.starts_with("backstop: ERR_REVIEWER_EVIDENCE: "),
            "{err}"
        );
        assert_eq!(
            parse(&["review", "keygen", key_s])
                .unwrap()
                .command
                .local()
                .unwrap()
                .0,
            1
        );
        assert!(parse(&["status"]).unwrap().command.local().is_none());
    }

    #[test]
    fn device_commands_become_requests() {
        assert_eq!(
            request(&["device", "grant", "tablet", "mic", "--lease", "10m", "--reason", "demo"]),
            Request::DeviceGrant {
                ids: vec!["tablet".into(), "mic".into()],
                lease_s: Some(600),
                reason: "demo".into()
            }
        );
        assert_eq!(
            request(&["device", "grant", "gpu", "--reason", "r"]),
            Request::DeviceGrant {
                ids: vec!["gpu".into()],
                lease_s: None,
                reason: "r".into()
            }
        );
        assert_eq!(
            request(&["device", "revoke", "gpu", "--reason", "done"]),
            Request::DeviceRevoke {
                id: "gpu".into(),
                reason: "done".into()
            }
        );
        assert_eq!(request(&["device", "list"]), Request::DeviceList);
        for (text, secs) in [("90", 90), ("90s", 90), ("2m", 120), ("1h", 3600)] {
            assert_eq!(lease(text), Ok(secs), "{text}");
        }
        // The token's lifetime reads like its help text.
        for (text, secs) in [
            ("7d", 604_800),
            ("1h 30m", 5_400),
            ("90", 90),
            ("2h", 7_200),
        ] {
            assert_eq!(expiry(text), Ok(secs), "{text}");
        }
        for bad in ["8d", "0", "0s", "soon", "", "-1h"] {
            assert!(expiry(bad).is_err(), "{bad}");
        }
        // `--before` takes back what `snapshot list` prints (UTC), and RFC 3339 with any offset.
        for (text, want) in [
            ("2026-05-01 12:00:03", "2026-05-01T12:00:03Z"),
            ("2026-05-01T12:00:03", "2026-05-01T12:00:03Z"),
            ("2026-05-01T14:00:03+02:00", "2026-05-01T14:00:03+02:00"),
            ("2026-05-01T12:00:03.5Z", "2026-05-01T12:00:03.5Z"),
        ] {
            assert_eq!(time_arg(text).as_deref(), Ok(want), "{text}");
        }
        for bad in ["yesterday", "2026-13-01 00:00:00", "", "2026-05-01"] {
            assert!(time_arg(bad).is_err(), "{bad}");
        }
        assert_eq!(
            crate::render::short_time(&time_arg("2026-05-01 12:00:03").unwrap()),
            "2026-05-01 12:00:03",
            "list -> --before -> list is the identity"
        );
        for args in [
            &["device", "grant", "--reason", "r"][..],
            &["device", "grant", "gpu"],
            &["device", "grant", "gpu", "--reason", "r", "--lease", "0"],
            &["device", "grant", "gpu", "--reason", "r", "--lease", "5d"],
            &["device", "grant", "gpu", "--reason", "r", "--lease", "-1"],
            &["device", "grant", "", "--reason", "r"],
            &["device", "revoke", "gpu"],
            &["device", "list", "gpu"],
        ] {
            let err = parse(args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn names_and_delete_on_the_command_line() {
        assert_eq!(
            request(&["snapshot", "create", "--reason", "r", "--name", "v1.2_rc-1"]),
            Request::SnapshotCreate {
                reason: "r".into(),
                name: Some("v1.2_rc-1".into()),
            }
        );
        assert_eq!(
            request(&["snapshot", "delete", "v1", "--reason", "done"]),
            Request::SnapshotDelete {
                id: "v1".into(),
                reason: "done".into(),
            }
        );
        // A bad name is a one-line usage error (exit 2) before anything is sent: see
        // `crate::precheck`. Missing arguments are clap's.
        for bad in [
            &["snapshot", "delete", "v1"][..],
            &["snapshot", "delete", "--reason", "r"],
        ] {
            assert_eq!(parse(bad).unwrap_err().exit_code(), 2, "{bad:?}");
        }
        for bad in ["cafe", "-x", "a b", "", "naïve"] {
            let req = request(&["snapshot", "create", "--reason", "r", "--name", bad]);
            let out = crate::precheck(&req, false).unwrap();
            assert_eq!(out.exit_code, 2, "{bad:?}");
            assert!(
                out.stderr
                    .starts_with("backstop: ERR_SNAPSHOT_NAME_INVALID: "),
                "{}",
                out.stderr
            );
            assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
            let json = crate::precheck(&req, true).unwrap();
            let doc: Value = serde_json::from_str(&json.stdout).unwrap();
            assert_eq!(doc["error"]["code"], "ERR_SNAPSHOT_NAME_INVALID");
        }
        let good = request(&["snapshot", "create", "--reason", "r", "--name", "v1"]);
        assert!(crate::precheck(&good, false).is_none());
        assert!(crate::precheck(&Request::SnapshotList, false).is_none());
        // halt clear --to ID --paused, and the verb that continues the guest.
        assert_eq!(
            request(&["halt", "clear", "--reason", "ok", "--to", "v1", "--paused"]),
            Request::HaltClearTo {
                reason: "ok".into(),
                to: "v1".into(),
                reviewer_token: None,
                paused: true,
            }
        );
        assert_eq!(
            request(&["resume", "--reason", "go"]),
            Request::Resume {
                reason: "go".into()
            }
        );
        for bad in [
            &["halt", "clear", "--reason", "ok", "--paused"][..],
            &["resume"],
        ] {
            assert_eq!(parse(bad).unwrap_err().exit_code(), 2, "{bad:?}");
        }
        assert!(crate::is_full_snapshot_id(
            "0123456789abcdef0123456789abcdef"
        ));
        for short in ["0123", "v1", "0123456789ABCDEF0123456789ABCDEF"] {
            assert!(!crate::is_full_snapshot_id(short), "{short}");
        }
    }

    #[test]
    fn review_keygen_honours_json() {
        let d = tempfile::tempdir().unwrap();
        let key = d.path().join("reviewer.key");
        let key_s = key.to_str().unwrap();
        let (code, out, err) = parse(&["review", "keygen", key_s, "--json"])
            .unwrap()
            .command
            .local_as(true)
            .unwrap();
        assert_eq!(code, 0, "{err}");
        let doc: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(doc["reviewer_key"], key_s);
        // A second keygen fails, as JSON too.
        let (code, out, err) = parse(&["review", "keygen", key_s])
            .unwrap()
            .command
            .local_as(true)
            .unwrap();
        assert_eq!(code, 1);
        let doc: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(doc["error"]["code"], "ERR_REVIEWER_EVIDENCE");
        assert!(
            err.starts_with("backstop: ERR_REVIEWER_EVIDENCE: "),
            "{err}"
        );
    }

    /// One parser for every duration; each option keeps its own bounds and units.
    #[test]
    fn durations_share_one_parser_and_keep_their_bounds() {
        for (text, secs) in [
            ("90", 90),
            (" 90s ", 90),
            ("10m", 600),
            ("2h", 7_200),
            ("1h 30m", 5_400),
            ("7d", 604_800),
            ("0", 0),
            ("500ms", 0),
        ] {
            assert_eq!(seconds(text), Ok(secs), "{text}");
        }
        for bad in ["", "soon", "-1h", "5x", "99999999999999999999999"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        // Leases: seconds, minutes or hours, at least one second.
        assert_eq!(lease("300"), Ok(300));
        assert_eq!(lease("48h"), Ok(172_800));
        for bad in ["0", "0s", "500ms", "1d", "1h 30m", "h", "-1", " "] {
            assert!(lease(bad).is_err(), "{bad}");
        }
        // Token lifetimes: up to 7 days exactly.
        assert_eq!(expiry("168h"), Ok(604_800));
        assert!(expiry("604801").is_err());
        // `--timeout`: anything shorter than a second is one second.
        assert_eq!(duration_s("500ms"), Ok(1));
        assert_eq!(duration_s("2m"), Ok(120));
        assert!(duration_s("soon").is_err());
        assert_eq!(duration_s("10m"), Ok(600));
        assert!(duration_s("601").is_err());
    }

    /// What `snapshot list` shows reads back through `--before` as the same second, leap days
    /// and times before the epoch included.
    #[test]
    fn shown_times_read_back_as_the_same_second() {
        for (rfc, shown) in [
            ("2024-02-29T23:59:59.999Z", "2024-02-29 23:59:59"),
            ("2024-03-01T00:59:59+01:00", "2024-02-29 23:59:59"),
            ("1969-12-31T23:59:59Z", "1969-12-31 23:59:59"),
        ] {
            assert_eq!(crate::render::short_time(rfc), shown, "{rfc}");
            let back = time_arg(shown).unwrap();
            assert_eq!(back, format!("{}Z", shown.replace(' ', "T")), "{rfc}");
        }
        assert_eq!(crate::render::short_time("not a time"), "not a time");
        assert!(time_arg("2023-02-29 00:00:00").is_err());
    }
}
