//! backstop-dist: renders the man pages and shell completions of `backstop` and `backstopd` from
//! their clap definitions (`backstop_cli::command`, `backstopd::command`) into a directory, for
//! `scripts/package.sh`. A build tool: never installed, never talks to a daemon.
//!
//! ```text
//! OUT/man/backstop.1, backstop-<subcommand>[-<subcommand>].1, backstopd.8
//! OUT/completions/backstop.bash, _backstop, backstop.fish (and the same for backstopd)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use clap_complete::Shell;
use clap_mangen::Man;

#[derive(Parser)]
#[command(about = "Write the man pages and shell completions of backstop and backstopd")]
struct Args {
    /// Directory to write into (`man/` and `completions/` are created in it).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match write_all(&args.out) {
        Ok(files) => {
            println!(
                "backstop-dist: wrote {} files into {}",
                files.len(),
                args.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("backstop-dist: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the daemon's page says beyond its options: where the packaged files are, and how it
/// stops (SIGTERM and SIGINT are the signals `backstopd` waits for).
const BACKSTOPD_FILES: &[(&str, &str)] = &[
    (
        "/etc/backstop/backstopd.toml",
        "The daemon file of the packaged service ([daemon]; daemon.vms_dir names the VM directory).",
    ),
    (
        "/etc/backstop/vms.d/NAME.toml",
        "One guarded VM per file ([vm] and its tables, no [daemon]); the file stem is the VM's name. Only *.toml files are read (hidden ones are skipped); backstop reload applies a change.",
    ),
    (
        "/var/lib/backstop",
        "State: snapshot store, audit journals, disk layers, the host key (keys/host.key).",
    ),
    (
        "/run/backstop/control.sock",
        "The control socket backstop talks to.",
    ),
];

const BACKSTOPD_SIGNALS: &str =
    "SIGTERM and SIGINT stop the daemon cleanly: each running guest backstopd \
booted is paused and a final snapshot taken, and the next start resumes it from exactly there; \
an adopted libvirt domain is left running and recorded, and the next start re-attaches to it as \
it runs when it finds it unchanged (else it goes back to its newest verified snapshot).";

/// Writes every page and completion script; returns the files written.
fn write_all(out: &Path) -> std::io::Result<Vec<PathBuf>> {
    let man_dir = out.join("man");
    let completions_dir = out.join("completions");
    std::fs::create_dir_all(&man_dir)?;
    std::fs::create_dir_all(&completions_dir)?;
    let mut written = Vec::new();

    let mut console = backstop_cli::command().disable_help_subcommand(true);
    console.build();
    for (name, roff) in console_pages(&console)? {
        written.push(write_file(&man_dir.join(name), &roff)?);
    }
    let daemon = backstopd::command();
    let page = render_page(
        &daemon,
        "8",
        &Extra {
            files: BACKSTOPD_FILES,
            signals: Some(BACKSTOPD_SIGNALS),
            see_also: &["backstop(1)"],
        },
    )?;
    written.push(write_file(&man_dir.join("backstopd.8"), &page)?);

    for (bin, cmd) in [
        ("backstop", backstop_cli::command()),
        ("backstopd", backstopd::command()),
    ] {
        for (shell, file) in [
            (Shell::Bash, format!("{bin}.bash")),
            (Shell::Zsh, format!("_{bin}")),
            (Shell::Fish, format!("{bin}.fish")),
        ] {
            let mut cmd = cmd.clone();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, bin, &mut script);
            written.push(write_file(&completions_dir.join(file), &script)?);
        }
    }
    Ok(written)
}

fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    std::fs::write(path, bytes)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    Ok(path.to_path_buf())
}

/// Sections of a page that clap does not describe.
struct Extra<'a> {
    files: &'a [(&'a str, &'a str)],
    signals: Option<&'a str>,
    see_also: &'a [&'a str],
}

/// `backstop.1`, then one page per subcommand at every depth (`backstop-snapshot.1`,
/// `backstop-snapshot-create.1`, …), each pointing back at its parent. `console` is built.
fn console_pages(console: &clap::Command) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    fn walk(
        cmd: &clap::Command,
        parent: Option<&str>,
        pages: &mut Vec<(String, Vec<u8>)>,
    ) -> std::io::Result<()> {
        let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
        let parent_ref = parent.map(|p| format!("{p}(1)"));
        let mut see_also: Vec<&str> = parent_ref.iter().map(String::as_str).collect();
        see_also.push("backstopd(8)");
        let extra = Extra {
            files: &[],
            signals: None,
            see_also: &see_also,
        };
        pages.push((format!("{name}.1"), render_page(cmd, "1", &extra)?));
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, Some(&name), pages)?;
        }
        Ok(())
    }
    let mut pages = Vec::new();
    walk(console, None, &mut pages)?;
    Ok(pages)
}

/// One man page: clap_mangen's sections, then `after_help` kept as written (its tables stay
/// tables: no-fill), then the sections in `extra`.
fn render_page(cmd: &clap::Command, section: &str, extra: &Extra) -> std::io::Result<Vec<u8>> {
    let man = Man::new(cmd.clone()).section(section);
    let mut w = Vec::new();
    man.render_title(&mut w)?;
    man.render_name_section(&mut w)?;
    man.render_synopsis_section(&mut w)?;
    man.render_description_section(&mut w)?;
    man.render_options_section(&mut w)?;
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(&mut w)?;
    }
    if let Some(after) = cmd.get_after_long_help().or(cmd.get_after_help()) {
        let text = after.to_string();
        let (heading, body) = match text.strip_prefix("Exit status:\n") {
            Some(rest) => ("EXIT STATUS", rest.to_string()),
            None => ("NOTES", text),
        };
        section_heading(&mut w, heading)?;
        writeln!(w, ".nf")?;
        for line in body.lines() {
            writeln!(w, "{}", roff_line(line))?;
        }
        writeln!(w, ".fi")?;
    }
    if let Some(signals) = extra.signals {
        section_heading(&mut w, "SIGNALS")?;
        writeln!(w, "{}", roff_line(signals))?;
    }
    if !extra.files.is_empty() {
        section_heading(&mut w, "FILES")?;
        for (path, what) in extra.files {
            writeln!(w, ".TP\n\\fB{}\\fR\n{}", roff_escape(path), roff_line(what))?;
        }
    }
    if cmd.get_version().is_some() {
        man.render_version_section(&mut w)?;
    }
    if !extra.see_also.is_empty() {
        section_heading(&mut w, "SEE ALSO")?;
        let refs: Vec<String> = extra
            .see_also
            .iter()
            .map(|r| match r.split_once('(') {
                Some((page, sec)) => format!("\\fB{}\\fR({sec}", roff_escape(page)),
                None => roff_escape(r),
            })
            .collect();
        writeln!(w, "{}", refs.join(",\n"))?;
    }
    Ok(preamble_once(w))
}

/// clap_mangen starts every section it renders with the same two-line string definition
/// (`Aq`, the apostrophe); a page needs it once, at the top.
fn preamble_once(page: Vec<u8>) -> Vec<u8> {
    const PREAMBLE: &str = ".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n";
    let text = String::from_utf8_lossy(&page);
    match text.split_once(PREAMBLE) {
        Some((head, rest)) => {
            format!("{head}{PREAMBLE}{}", rest.replace(PREAMBLE, "")).into_bytes()
        }
        None => page,
    }
}

fn section_heading(w: &mut Vec<u8>, heading: &str) -> std::io::Result<()> {
    writeln!(w, ".SH \"{heading}\"")
}

/// Backslashes and hyphens as roff wants them in running text.
fn roff_escape(text: &str) -> String {
    text.replace('\\', "\\e").replace('-', "\\-")
}

/// One line of text: escaped, and kept from being read as a request (`.`, `'` first).
fn roff_line(text: &str) -> String {
    let escaped = roff_escape(text);
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_text(pages: &[(String, Vec<u8>)], name: &str) -> String {
        let (_, roff) = pages
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no page {name}"));
        String::from_utf8(roff.clone()).unwrap()
    }

    #[test]
    fn every_console_subcommand_gets_a_page_and_help_gets_none() {
        let mut console = backstop_cli::command().disable_help_subcommand(true);
        console.build();
        let pages = console_pages(&console).unwrap();
        let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
        for want in [
            "backstop.1",
            "backstop-status.1",
            "backstop-snapshot.1",
            "backstop-snapshot-create.1",
            "backstop-rollback.1",
            "backstop-review-sign.1",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("help")), "{names:?}");
        let create = page_text(&pages, "backstop-snapshot-create.1");
        assert!(create.contains("\\-\\-reason"), "{create}");
        assert!(
            create.contains("\\fBbackstop\\-snapshot\\fR(1)"),
            "{create}"
        );
    }

    #[test]
    fn the_console_page_carries_the_exit_status_table_as_a_table() {
        let mut console = backstop_cli::command().disable_help_subcommand(true);
        console.build();
        let pages = console_pages(&console).unwrap();
        let top = page_text(&pages, "backstop.1");
        let exit = top
            .split(".SH \"EXIT STATUS\"\n.nf\n")
            .nth(1)
            .expect("an EXIT STATUS section in no-fill mode");
        for status in ["  0  ", "  3  ", "  4  ", "  5  "] {
            assert!(exit.contains(status), "{status:?} missing: {exit}");
        }
    }

    #[test]
    fn the_daemon_page_is_section_8_with_its_files() {
        let page = render_page(
            &backstopd::command(),
            "8",
            &Extra {
                files: BACKSTOPD_FILES,
                signals: Some(BACKSTOPD_SIGNALS),
                see_also: &["backstop(1)"],
            },
        )
        .unwrap();
        let text = String::from_utf8(page).unwrap();
        assert!(text.contains("\n.TH backstopd 8 "), "{text}");
        assert!(text.contains("\\-\\-check\\-config"), "{text}");
        assert!(text.contains("/etc/backstop/vms.d"), "{text}");
        assert_eq!(text.matches(".ds Aq").count(), 2, "one preamble: {text}");
        assert!(text.starts_with(".ie "), "{text}");
    }

    #[test]
    fn a_line_starting_with_a_dot_is_not_a_request() {
        assert_eq!(roff_line(".toml"), "\\&.toml");
        assert_eq!(roff_line("a-b \\ c"), "a\\-b \\e c");
    }

    #[test]
    fn write_all_writes_pages_and_completions() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_all(dir.path()).unwrap();
        for f in [
            "man/backstop.1",
            "man/backstopd.8",
            "completions/backstop.bash",
            "completions/_backstop",
            "completions/backstop.fish",
            "completions/backstopd.bash",
        ] {
            let path = dir.path().join(f);
            assert!(files.contains(&path), "{f} not reported");
            assert!(std::fs::metadata(&path).unwrap().len() > 0, "{f} empty");
        }
    }
}
