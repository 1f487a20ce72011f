//! Progress while waiting: a spinner on a terminal, plain lines otherwise, nothing for `--json`.

use std::io::{self, IsTerminal, Write};
use std::time::Duration;

use backstop_control::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::render;

/// Where progress reports go.
#[derive(Debug)]
pub enum ProgressDisplay {
    /// `--json`: stdout is for the document, stderr for errors only.
    Silent,
    /// stderr is not a terminal: one `backstop: <step>: <message>` line per report.
    Plain,
    /// stderr is a terminal: one spinner line, started at the first report.
    Spinner(Option<ProgressBar>),
}

impl ProgressDisplay {
    pub fn new(json: bool) -> ProgressDisplay {
        if json {
            ProgressDisplay::Silent
        } else if io::stderr().is_terminal() {
            ProgressDisplay::Spinner(None)
        } else {
            ProgressDisplay::Plain
        }
    }

    pub fn update(&mut self, progress: &Progress) {
        match self {
            ProgressDisplay::Silent => {}
            ProgressDisplay::Plain => {
                // Progress is a courtesy: a closed stderr must not end the operation.
                let _ = io::stderr()
                    .lock()
                    .write_all(render::progress_line(progress).as_bytes());
            }
            ProgressDisplay::Spinner(bar) => {
                bar.get_or_insert_with(new_spinner)
                    .set_message(render::progress_text(progress));
            }
        }
    }

    /// Removes the spinner, so the result or error is printed on a clean line.
    pub fn finish(self) {
        if let ProgressDisplay::Spinner(Some(bar)) = self {
            bar.finish_and_clear();
        }
    }
}

fn new_spinner() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
