//! A kernel's stdout and stderr, forwarded to the broker's log line by line (bounded), and
//! the last lines of stderr kept to explain a kernel that died or a launch that failed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use uuid::Uuid;

use crate::sandbox::LogFilter;
use crate::sync::lock;

/// Longest line of kernel output forwarded to the log; the rest is cut.
const MAX_LOG_LINE: usize = 2048;
/// Lines of kernel stderr logged at WARN before the rest goes to DEBUG.
const MAX_WARN_LINES: usize = 200;
/// Lines of stderr kept to explain a failed launch.
pub(super) const STDERR_TAIL_LINES: usize = 20;

/// The last lines a kernel wrote to stderr.
#[derive(Clone, Default)]
pub(super) struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        lock(&self.0).iter().cloned().collect()
    }

    fn push(&self, line: String) {
        let mut tail = lock(&self.0);
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
}

/// Which stream of the kernel a line came from.
#[derive(Clone, Copy)]
pub(super) enum Stream {
    Stdout,
    Stderr,
}

/// Forwards a kernel's stdout or stderr to the log, line by line, lines cut at
/// [`MAX_LOG_LINE`]. Ends when the kernel closes the stream.
pub(super) async fn forward_output<R: AsyncRead + Unpin>(
    stream: R,
    session: Uuid,
    which: Stream,
    tail: Option<Tail>,
    filter: Option<LogFilter>,
) {
    let emit_line = |line: &[u8], cut: bool, count: &mut usize| {
        emit_line(
            line,
            cut,
            (session, which),
            count,
            tail.as_ref(),
            filter.as_ref(),
        )
    };
    let mut reader = BufReader::new(stream);
    let mut line: Vec<u8> = Vec::new();
    let mut cut = false;
    let mut count = 0usize;
    loop {
        let (consumed, complete) = match reader.fill_buf().await {
            Ok([]) | Err(_) => {
                if !line.is_empty() {
                    emit_line(&line, cut, &mut count);
                }
                return;
            }
            Ok(buf) => {
                let (chunk, consumed, complete) = match buf.iter().position(|b| *b == b'\n') {
                    Some(pos) => (&buf[..pos], pos + 1, true),
                    None => (buf, buf.len(), false),
                };
                let room = MAX_LOG_LINE.saturating_sub(line.len());
                if chunk.len() > room {
                    cut = true;
                }
                line.extend_from_slice(&chunk[..chunk.len().min(room)]);
                (consumed, complete)
            }
        };
        reader.consume(consumed);
        if complete {
            emit_line(&line, cut, &mut count);
            line.clear();
            cut = false;
        }
    }
}

fn emit_line(
    line: &[u8],
    cut: bool,
    (session, which): (Uuid, Stream),
    count: &mut usize,
    tail: Option<&Tail>,
    filter: Option<&LogFilter>,
) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end_matches('\r');
    let filtered;
    let text = match filter {
        Some(f) => {
            filtered = f.apply(text);
            filtered.as_str()
        }
        None => text,
    };
    let marker = if cut { " [cut]" } else { "" };
    match which {
        Stream::Stdout => tracing::debug!(%session, "kernel stdout: {text}{marker}"),
        Stream::Stderr => {
            *count += 1;
            if *count <= MAX_WARN_LINES {
                tracing::warn!(%session, "kernel stderr: {text}{marker}");
            } else {
                if *count == MAX_WARN_LINES + 1 {
                    tracing::warn!(%session, "kernel stderr is noisy; further lines are logged at DEBUG");
                }
                tracing::debug!(%session, "kernel stderr: {text}{marker}");
            }
        }
    }
    if let Some(tail) = tail {
        tail.push(format!("{text}{marker}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stderr_lines_are_cut_and_the_tail_keeps_the_last_ones() {
        let mut text = String::new();
        for i in 0..30 {
            text.push_str(&format!("line {i}\n"));
        }
        text.push_str(&"x".repeat(MAX_LOG_LINE + 10));
        text.push_str("\r\nlast");
        let tail = Tail::default();
        forward_output(
            text.as_bytes(),
            Uuid::nil(),
            Stream::Stderr,
            Some(tail.clone()),
            None,
        )
        .await;
        let lines = tail.lines();
        assert_eq!(lines.len(), STDERR_TAIL_LINES);
        assert_eq!(lines[0], "line 12");
        assert_eq!(
            lines[STDERR_TAIL_LINES - 2],
            format!("{} [cut]", "x".repeat(MAX_LOG_LINE))
        );
        assert_eq!(lines[STDERR_TAIL_LINES - 1], "last");
    }

    #[tokio::test]
    async fn lines_pass_the_filter_before_the_tail_and_the_log() {
        let tail = Tail::default();
        let filter = LogFilter(Arc::new(|l: &str| l.replace("s3cret", "[secret:K]")));
        forward_output(
            &b"key s3cret\n"[..],
            Uuid::nil(),
            Stream::Stderr,
            Some(tail.clone()),
            Some(filter),
        )
        .await;
        assert_eq!(tail.lines(), ["key [secret:K]"]);
    }
}
