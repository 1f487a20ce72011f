//! Progress while waiting: a spinner on a terminal, plain lines otherwise, nothing for `--json`.

use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};

use backstop_control::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::render;

/// Where progress reports go.
#[derive(Debug)]
pub enum ProgressDisplay {
    /// `--json`: stdout is for the document, stderr for errors only.
    Silent,
    /// stderr is not a terminal: a `backstop: <step>: <message>` line when the step or message
    /// changes, and at most one byte-count update per [`PLAIN_INTERVAL`] within a step (a log
    /// file should not get a line per chunk).
    Plain {
        last: Option<(String, String)>,
        at: Option<Instant>,
    },
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
            ProgressDisplay::Plain {
                last: None,
                at: None,
            }
        }
    }

    pub fn update(&mut self, progress: &Progress) {
        match self {
            ProgressDisplay::Silent => {}
            ProgressDisplay::Plain { last, at } => {
                let key = (progress.step.clone(), progress.message.clone());
                let same = last.as_ref() == Some(&key);
                if same && at.is_some_and(|t| t.elapsed() < PLAIN_INTERVAL) {
                    return;
                }
                *last = Some(key);
                *at = Some(Instant::now());
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

/// Shortest gap between two plain lines of the same step.
pub const PLAIN_INTERVAL: Duration = Duration::from_secs(2);

fn new_spinner() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_mode_prints_step_changes_and_throttles_byte_updates() {
        let mut d = ProgressDisplay::Plain {
            last: None,
            at: None,
        };
        let p = |step: &str, msg: &str, b: u64| Progress {
            step: step.into(),
            message: msg.into(),
            bytes: Some(b),
        };
        d.update(&p("capture", "storing", 1));
        let ProgressDisplay::Plain {
            at: Some(first), ..
        } = &d
        else {
            panic!()
        };
        let first = *first;
        d.update(&p("capture", "storing", 2));
        let ProgressDisplay::Plain {
            at: Some(second), ..
        } = &d
        else {
            panic!()
        };
        assert_eq!(
            first, *second,
            "a byte update within the interval is not printed"
        );
        d.update(&p("publish", "signing", 0));
        let ProgressDisplay::Plain {
            last: Some((step, _)),
            at: Some(third),
        } = &d
        else {
            panic!()
        };
        assert_eq!(step, "publish");
        assert!(*third >= first);
    }
}
