//! How often the broker logs a kernel's bad messages: a few lines a minute, then a count.

use std::time::Duration;

use tokio::time::Instant;

/// Rate limit for the warnings about one kernel's bad messages: a flood of malformed or
/// forged messages costs a summary line a minute, not a line each.
pub(super) struct LogLimit {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
}

const LOG_WINDOW: Duration = Duration::from_secs(60);
const LOG_PER_WINDOW: u32 = 10;

impl Drop for LogLimit {
    fn drop(&mut self) {
        self.report_suppressed();
    }
}

impl LogLimit {
    pub(super) fn new() -> Self {
        Self {
            window_start: Instant::now(),
            logged: 0,
            suppressed: 0,
        }
    }

    /// The summary line for what was not logged, if anything was not.
    fn report_suppressed(&mut self) {
        if self.suppressed > 0 {
            tracing::warn!(
                suppressed = self.suppressed,
                "more messages from the kernel were dropped (not logged each)"
            );
            self.suppressed = 0;
        }
    }

    /// Whether to log this occurrence; when a window with suppressed lines ends, says so
    /// first.
    pub(super) fn allow(&mut self) -> bool {
        let now = Instant::now();
        if now.duration_since(self.window_start) >= LOG_WINDOW {
            self.report_suppressed();
            self.window_start = now;
            self.logged = 0;
        }
        if self.logged < LOG_PER_WINDOW {
            self.logged += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bad_message_warnings_are_rate_limited_per_minute() {
        let mut limit = LogLimit::new();
        let allowed = (0..25).filter(|_| limit.allow()).count();
        assert_eq!(allowed, LOG_PER_WINDOW as usize);
        assert_eq!(limit.suppressed, 15);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(!limit.allow(), "still the same minute");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(limit.allow(), "a new minute logs again");
        assert_eq!(limit.suppressed, 0, "the summary was given");
    }
}
