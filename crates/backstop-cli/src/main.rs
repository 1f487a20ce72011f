//! `backstop`: parse the command line, send one request, print the answer.

use std::io::{self, Write};
use std::process::ExitCode;

use backstop_cli::cli::Cli;
use backstop_cli::progress::ProgressDisplay;
use backstop_control::ControlClient;
use clap::Parser;

fn main() -> ExitCode {
    let cli = Cli::parse(); // a usage error exits 2 here (exit::USAGE)
    if let Some((code, stdout, stderr)) = cli.command.local() {
        let _ = io::stdout().lock().write_all(stdout.as_bytes());
        let _ = io::stderr().lock().write_all(stderr.as_bytes());
        return ExitCode::from(code);
    }
    let request = cli.command.request();

    let mut display = ProgressDisplay::new(cli.json);
    let result = ControlClient::connect(&cli.socket)
        .and_then(|mut client| client.call(&request, &mut |p| display.update(p)));
    display.finish();

    let outcome = backstop_cli::outcome(&request, &result, cli.json);
    // A closed stdout or stderr (`backstop audit tail | head -1`) changes nothing: the
    // operation is already done, and the exit status still says how it went.
    let _ = io::stdout().lock().write_all(outcome.stdout.as_bytes());
    let _ = io::stderr().lock().write_all(outcome.stderr.as_bytes());
    ExitCode::from(outcome.exit_code)
}
