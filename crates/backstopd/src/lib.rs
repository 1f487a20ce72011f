//! backstopd's command line, kept apart from `main.rs` so that `backstop-dist` renders the
//! daemon's man page and shell completions from the very definition the daemon parses; and
//! [`metrics`], the OpenMetrics endpoint that serves what the engine's actors publish. Nothing
//! else belongs here: the daemon's logic lives in `backstop-engine`.

pub mod metrics;

use std::path::PathBuf;

use clap::{CommandFactory, Parser};

#[derive(Parser)]
#[command(
    name = "backstopd",
    version,
    about = "backstop daemon: live snapshots and atomic rollback of the VMs a host runs"
)]
pub struct Args {
    /// Daemon config file (TOML): `[daemon]`, and a `[vm]` of its own and/or `daemon.vms_dir`
    /// with one `NAME.toml` per VM. Without it, the embedded default config
    /// (vmm-config/default.toml, one VM).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Print the embedded default config and exit.
    #[arg(long)]
    pub print_default_config: bool,
    /// Load and validate the config, then exit.
    #[arg(long)]
    pub check_config: bool,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long)]
    pub log_json: bool,
}

/// The daemon's command line as clap sees it (for its man page and completions).
pub fn command() -> clap::Command {
    Args::command()
}
