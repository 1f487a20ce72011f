//! The command line: what a person types, and the request it becomes.

use std::path::PathBuf;

use backstop_control::{Request, TriggerKind};
use clap::{Parser, Subcommand};

/// Where backstopd listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/backstop/control.sock";

const AFTER_HELP: &str = "\
Exit status:
  0  the operation succeeded
  1  the operation failed (any error not listed below)
  2  usage error
  3  cannot reach backstopd, or permission denied
  4  the VM is halted (ERR_VM_HALTED, or ERR_ROLLBACK_FAILED_HALTED: the rollback
     failed and halted it); a person clears it with `backstop halt clear`
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

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the guarded VM's state.
    Status,
    /// Create, list, show and verify snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Roll the VM back to a verified snapshot.
    Rollback {
        /// Snapshot id (or unique prefix); default: the newest verified snapshot.
        #[arg(long, value_name = "ID", value_parser = non_empty)]
        to: Option<String>,
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// Emergency rollback: never blocked by the restore policy gate.
        #[arg(long)]
        emergency: bool,
    },
    /// Clear a HALTED VM (restores the newest verified snapshot).
    #[command(subcommand)]
    Halt(HaltCommand),
    /// Read and verify the audit journal.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Send a host trigger (spec/000 §6), as the host policy engine does: force_rollback,
    /// post_promotion_validation_failed, tier0_violation, sandbox_contradiction,
    /// undefined_behaviour. It overrides whatever is in flight.
    Trigger {
        /// The trigger.
        #[arg(value_parser = trigger_kind)]
        kind: TriggerKind,
        /// Why; recorded in the audit journal (never shown to the guest).
        #[arg(long, value_parser = non_empty)]
        reason: String,
        /// Action ids the trigger concerns (repeatable).
        #[arg(long = "action-id", value_name = "ID")]
        action_ids: Vec<String>,
    },
    /// Grant, revoke and list the devices declared in the daemon's config.
    #[command(subcommand)]
    Device(DeviceCommand),
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
pub enum SnapshotCommand {
    /// Take a snapshot now.
    Create {
        /// Why; recorded in the manifest and the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
    },
    /// List published snapshots, oldest first.
    List,
    /// Show one snapshot's summary and manifest.
    Show {
        /// Snapshot id or unique prefix.
        #[arg(value_parser = non_empty)]
        id: String,
    },
    /// Verify a snapshot completely without touching the VM.
    Verify {
        /// Snapshot id or unique prefix.
        #[arg(value_parser = non_empty)]
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum HaltCommand {
    /// Clear HALTED (a person's decision).
    Clear {
        /// Why; recorded in the audit journal.
        #[arg(long, value_parser = non_empty)]
        reason: String,
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
    /// Verify the whole hash chain.
    Verify,
}

impl Command {
    /// The request this command sends.
    pub fn request(&self) -> Request {
        match self {
            Command::Status => Request::Status,
            Command::Snapshot(SnapshotCommand::Create { reason }) => Request::SnapshotCreate {
                reason: reason.clone(),
            },
            Command::Snapshot(SnapshotCommand::List) => Request::SnapshotList,
            Command::Snapshot(SnapshotCommand::Show { id }) => {
                Request::SnapshotShow { id: id.clone() }
            }
            Command::Snapshot(SnapshotCommand::Verify { id }) => {
                Request::SnapshotVerify { id: id.clone() }
            }
            Command::Rollback {
                to,
                reason,
                emergency,
            } => Request::Rollback {
                to: to.clone(),
                reason: reason.clone(),
                emergency: *emergency,
            },
            Command::Halt(HaltCommand::Clear { reason }) => Request::HaltClear {
                reason: reason.clone(),
            },
            Command::Audit(AuditCommand::Tail { count }) => Request::AuditTail { count: *count },
            Command::Audit(AuditCommand::Verify) => Request::AuditVerify,
            Command::Trigger {
                kind,
                reason,
                action_ids,
            } => Request::Trigger {
                kind: *kind,
                reason: reason.clone(),
                action_ids: action_ids.clone(),
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
        }
    }
}

/// A lease: `300`, `300s`, `10m`, `2h` → seconds (at least 1).
fn lease(value: &str) -> Result<u64, String> {
    let v = value.trim();
    let (num, unit) = match v.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| "a duration like 300, 90s, 10m or 2h".to_string())?;
    let factor = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err("the unit must be s, m or h".into()),
    };
    match n.checked_mul(factor) {
        Some(0) => Err("must be at least 1 s".into()),
        Some(s) => Ok(s),
        None => Err("too long".into()),
    }
}

fn trigger_kind(value: &str) -> Result<TriggerKind, String> {
    TriggerKind::parse(value).ok_or_else(|| {
        let names: Vec<&str> = TriggerKind::ALL.iter().map(|k| k.as_str()).collect();
        format!("unknown trigger; one of: {}", names.join(", "))
    })
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
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn commands_become_requests() {
        assert_eq!(request(&["status"]), Request::Status);
        assert_eq!(
            request(&["snapshot", "create", "--reason", "before update"]),
            Request::SnapshotCreate {
                reason: "before update".into()
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
            Request::Rollback {
                to: None,
                reason: "r".into(),
                emergency: false
            }
        );
        assert_eq!(
            request(&["rollback", "--to", "ab", "--reason", "r", "--emergency"]),
            Request::Rollback {
                to: Some("ab".into()),
                reason: "r".into(),
                emergency: true
            }
        );
        assert_eq!(
            request(&["halt", "clear", "--reason", "ok"]),
            Request::HaltClear {
                reason: "ok".into()
            }
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
}
