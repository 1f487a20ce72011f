//! `backstop`: parse the command line, send one request, print the answer.

use std::io::{self, IsTerminal, Write};
use std::process::ExitCode;

use backstop_cli::cli::Cli;
use backstop_cli::progress::ProgressDisplay;
use backstop_control::ControlClient;
use clap::Parser;

fn main() -> ExitCode {
    let mut cli = Cli::parse(); // a usage error exits 2 here (exit::USAGE)
                                // `review sign --snapshot` takes a name or a prefix as every verb does: backstopd resolves
                                // it to the full id the token names (a full id needs no daemon).
    if let backstop_cli::cli::Command::Review(backstop_cli::cli::ReviewCommand::Sign {
        snapshot: Some(given),
        ..
    }) = &mut cli.command
    {
        if !backstop_cli::is_full_snapshot_id(given) {
            let ask = backstop_control::Request::SnapshotShow { id: given.clone() };
            let result = ControlClient::connect(&cli.socket)
                .and_then(|mut client| client.call_vm(cli.vm.as_deref(), &ask, &mut |_| {}));
            match result {
                Ok(backstop_control::Response::Snapshot(view)) => {
                    *given = view.summary.snapshot_id;
                }
                other => {
                    let outcome = backstop_cli::outcome(&ask, &other, cli.json);
                    let _ = io::stdout().lock().write_all(outcome.stdout.as_bytes());
                    let _ = io::stderr().lock().write_all(outcome.stderr.as_bytes());
                    return ExitCode::from(outcome.exit_code.max(1));
                }
            }
        }
    }
    if let Some((code, stdout, stderr)) = cli.command.local_as(cli.json) {
        let _ = io::stdout().lock().write_all(stdout.as_bytes());
        let _ = io::stderr().lock().write_all(stderr.as_bytes());
        return ExitCode::from(code);
    }
    let request = cli.command.request();
    if let Some(refused) = backstop_cli::precheck(&request, cli.json) {
        let _ = io::stdout().lock().write_all(refused.stdout.as_bytes());
        let _ = io::stderr().lock().write_all(refused.stderr.as_bytes());
        return ExitCode::from(refused.exit_code);
    }
    if let backstop_cli::cli::Command::Vms { watch: Some(secs) } = cli.command {
        watch(&cli, &request, secs);
    }

    let mut display = ProgressDisplay::new(cli.json);
    // Notifications of `events` are printed as they come, one line each (a follower may run
    // for days); a closed stdout ends it.
    let json = cli.json;
    let mut on_event = |n: &backstop_control::Notification| {
        let line = backstop_cli::render::notification_line(n, json);
        let mut out = io::stdout().lock();
        if out
            .write_all(line.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            std::process::exit(0);
        }
    };
    let result = ControlClient::connect(&cli.socket).and_then(|mut client| {
        client.call_vm_events(
            cli.vm.as_deref(),
            &request,
            &mut |p| display.update(p),
            &mut on_event,
        )
    });
    display.finish();

    let outcome = backstop_cli::outcome_at(&request, &result, cli.json, cli.command.detail());
    // A closed stdout or stderr (`backstop audit tail | head -1`) changes nothing: the
    // operation is already done, and the exit status still says how it went.
    let _ = io::stdout().lock().write_all(outcome.stdout.as_bytes());
    let _ = io::stderr().lock().write_all(outcome.stderr.as_bytes());
    ExitCode::from(outcome.exit_code)
}

/// `backstop vms --watch`: the view again every `secs` seconds until interrupted (SIGINT's
/// default action ends the process). Never returns.
fn watch(cli: &Cli, request: &backstop_control::Request, secs: u64) -> ! {
    let terminal = io::stdout().is_terminal();
    loop {
        let result = ControlClient::connect(&cli.socket)
            .and_then(|mut client| client.call_vm(None, request, &mut |_| {}));
        let at = backstop_common::time::now_rfc3339();
        let frame = backstop_cli::watch_frame(&result, cli.json, terminal, &at);
        if io::stdout().lock().write_all(frame.as_bytes()).is_err() {
            // stdout closed (`| head`): nothing more to show.
            std::process::exit(0);
        }
        let _ = io::stdout().flush();
        std::thread::sleep(std::time::Duration::from_secs(secs));
    }
}
