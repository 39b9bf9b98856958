//! [`LogFilter`]: what a line of a kernel's own output (its stdout and stderr, outside the
//! Jupyter protocol) becomes before a backend logs or keeps it. The broker masks secrets and
//! credentials with it (`secrets::book`); the sandbox knows only that lines pass through it.

use std::sync::Arc;

/// A kernel output line in, the line to log out.
#[derive(Clone)]
pub struct LogFilter(pub Arc<dyn Fn(&str) -> String + Send + Sync>);

impl LogFilter {
    /// `line` as the log may hold it.
    pub fn apply(&self, line: &str) -> String {
        (self.0)(line)
    }
}

impl std::fmt::Debug for LogFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogFilter")
    }
}
