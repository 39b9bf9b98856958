//! A command run in a session's sandbox beside its kernel (E2B's `process.Process/Start`):
//! isolated and limited as the session's kernels are, as the session's user, with the
//! session's kernel limits. The api layer asks for it here and never names the sandbox.
//! Its start and its end are reported to the recording as the session's events; the end
//! with what the command printed, bounded ([`Captured`]: the first and last
//! [`KEPT_OUTPUT`] bytes of each stream, and how many there were).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use async_trait::async_trait;
use tokio::io::{AsyncRead, ReadBuf};

use super::error::SessionError;
use super::handle::Session;
use super::lifecycle::{CommandOutput, LifecycleEvent};
use super::registry::Registry;
use crate::sandbox::command::CommandSpec;
use crate::sync::lock;

pub use crate::sandbox::command::{
    CommandControl, CommandExit, PtySize, ResizeError, RunningCommand,
};
pub use crate::sandbox::environ::{check_user_env, EnvRefused};

/// What to run in a session's sandbox.
pub struct CommandRequest {
    /// The program and its arguments, as the sandbox sees them (`["/bin/bash", "-c", "ls"]`).
    pub argv: Vec<String>,
    /// Environment added to the kernels' own (checked with [`check_user_env`] first).
    pub env: Vec<(String, String)>,
    /// The working directory inside the sandbox (`None`: the workspace).
    pub cwd: Option<String>,
    /// Run it on a pseudo-terminal of this size (`None`: pipes).
    pub pty: Option<PtySize>,
}

impl Registry {
    /// Starts `request` in `session`'s sandbox, as its user and within its kernel limits.
    pub async fn run_command(
        &self,
        session: &Arc<Session>,
        request: CommandRequest,
    ) -> Result<RunningCommand, SessionError> {
        let (argv, cwd) = (request.argv.clone(), request.cwd.clone());
        let spec = CommandSpec {
            user: session.user.clone(),
            argv: request.argv,
            env: request.env,
            cwd: request.cwd,
            limits: session.limits,
            pty: request.pty,
            own_workspace: session.own_workspace,
        };
        let mut running = self.sandbox().run_command(spec).await.map_err(|source| {
            SessionError::CommandNotStarted {
                session: session.id,
                source,
            }
        })?;
        let pid = running.pid;
        self.report(session, &LifecycleEvent::CommandStarted { pid, argv, cwd });
        let (stdout, stderr) = (Arc::default(), Arc::default());
        running.stdout = Box::new(Tee {
            inner: running.stdout,
            into: Arc::clone(&stdout),
        });
        running.stderr = Box::new(Tee {
            inner: running.stderr,
            into: Arc::clone(&stderr),
        });
        running.control = Arc::new(Reported {
            inner: running.control,
            registry: self.clone(),
            session: session.clone(),
            pid,
            started: Instant::now(),
            ended: AtomicBool::new(false),
            output: [stdout, stderr],
        });
        Ok(running)
    }
}

/// A command's control that reports the command's end, once, the first time it is seen.
/// It holds the sandbox's control and nothing else of the command: dropping it kills the
/// command as dropping the sandbox's would.
struct Reported {
    inner: Arc<dyn CommandControl>,
    registry: Registry,
    session: Arc<Session>,
    pid: u32,
    started: Instant,
    ended: AtomicBool,
    /// What the command printed on stdout and stderr, as its reader read it.
    output: [Arc<Mutex<Captured>>; 2],
}

#[async_trait]
impl CommandControl for Reported {
    async fn signal(&self, signal: i32) {
        self.inner.signal(signal).await
    }

    async fn kill(&self) {
        self.inner.kill().await
    }

    async fn resize(&self, size: PtySize) -> Result<(), ResizeError> {
        self.inner.resize(size).await
    }

    async fn wait(&self) -> CommandExit {
        let exit = self.inner.wait().await;
        if !self.ended.swap(true, Ordering::AcqRel) {
            // The command's reader reads both pipes to their end before it waits (E2B's
            // process API does), so this is all the command printed.
            let [stdout, stderr] = self.output.each_ref().map(|c| lock(c).output());
            let event = LifecycleEvent::CommandEnded {
                pid: self.pid,
                exit_code: exit.code,
                signal: exit.signal,
                seconds: self.started.elapsed().as_secs_f64(),
                stdout,
                stderr,
            };
            self.registry.report(&self.session, &event);
        }
        exit
    }
}

/// The most of each of a command's streams its `command_ended` event keeps, at its start and
/// again at its end (a command may print without bound; its last lines say most).
pub const KEPT_OUTPUT: usize = 8 << 10;

/// What a command printed on one stream, bounded: its first and last [`KEPT_OUTPUT`] bytes,
/// and how many bytes it printed in all.
#[derive(Debug, Default)]
struct Captured {
    head: Vec<u8>,
    tail: Vec<u8>,
    total: u64,
}

impl Captured {
    fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let room = KEPT_OUTPUT - self.head.len();
        let into_head = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..into_head]);
        bytes = &bytes[into_head..];
        if bytes.len() >= KEPT_OUTPUT {
            self.tail.clear();
            bytes = &bytes[bytes.len() - KEPT_OUTPUT..];
        }
        let over = (self.tail.len() + bytes.len()).saturating_sub(KEPT_OUTPUT);
        self.tail.drain(..over);
        self.tail.extend_from_slice(bytes);
    }

    /// The stream as text (invalid UTF-8 replaced), with what was left out in the middle said.
    fn output(&self) -> CommandOutput {
        let kept = (self.head.len() + self.tail.len()) as u64;
        let mut text = String::from_utf8_lossy(&self.head).into_owned();
        if kept < self.total {
            text.push_str(&format!(
                "\n[... {} bytes not kept ...]\n",
                self.total - kept
            ));
        }
        text.push_str(&String::from_utf8_lossy(&self.tail));
        CommandOutput {
            text,
            bytes: self.total,
        }
    }
}

/// A command's stream, read through: what passes is kept in a [`Captured`].
struct Tee {
    inner: Box<dyn AsyncRead + Send + Unpin>,
    into: Arc<Mutex<Captured>>,
}

impl AsyncRead for Tee {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            lock(&self.into).push(&buf.filled()[before..]);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    #[test]
    fn a_stream_is_kept_whole_up_to_twice_the_bound_then_its_start_and_end() {
        let mut c = Captured::default();
        c.push(b"hi\n");
        c.push(b"oops\n");
        assert_eq!(c.output().text, "hi\noops\n");
        let mut c = Captured::default();
        let line = |i: usize| format!("line {i:07}\n");
        let all: String = (0..100_000).map(line).collect();
        for chunk in all.as_bytes().chunks(3000) {
            c.push(chunk);
        }
        let out = c.output();
        assert_eq!(out.bytes, all.len() as u64);
        assert!(out.text.starts_with(&all[..KEPT_OUTPUT]));
        assert!(out.text.ends_with(&all[all.len() - KEPT_OUTPUT..]));
        let left = all.len() - 2 * KEPT_OUTPUT;
        assert!(out
            .text
            .contains(&format!("[... {left} bytes not kept ...]")));
        assert!(out.text.len() < 2 * KEPT_OUTPUT + 64);
    }

    #[tokio::test]
    async fn the_reader_reads_through_the_tee_unchanged() {
        let into = Arc::new(Mutex::new(Captured::default()));
        let mut tee = Tee {
            inner: Box::new(&b"bytes\xff\n"[..]),
            into: into.clone(),
        };
        let mut read = Vec::new();
        tee.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"bytes\xff\n");
        let out = lock(&into).output();
        assert_eq!((out.text.as_str(), out.bytes), ("bytes\u{fffd}\n", 7));
    }
}
