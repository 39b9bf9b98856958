//! A command run in a session's sandbox beside its kernel (E2B's `process.Process/Start`):
//! isolated and limited as the session's kernels are, as the session's user, with the
//! session's kernel limits. The api layer asks for it here and never names the sandbox.
//! Its start and its end are reported to the recording as the session's events; the end
//! with what the command printed, bounded ([`Captured`]: the first and last
//! [`KEPT_OUTPUT`] bytes of each stream, and how many there were).

use std::io;
use std::pin::Pin;
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
use crate::secrets::stream::MaskedRead;
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
        // The session's secrets are the command's environment too, under the request's.
        let mut env: Vec<(String, String)> = session
            .secrets
            .values()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend(request.env);
        let spec = CommandSpec {
            user: session.user.clone(),
            argv: request.argv,
            env,
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
        let masker = session.secrets.masker();
        let argv = argv
            .iter()
            .map(|a| masker.mask_str(a).into_owned())
            .collect();
        self.report(session, &LifecycleEvent::CommandStarted { pid, argv, cwd });
        let (registry, reported_session) = (self.clone(), session.clone());
        let ending = Arc::new(Ending {
            report: Box::new(move |event| registry.report(&reported_session, event)),
            pid,
            started: Instant::now(),
            state: Mutex::default(),
        });
        // Masked before anything reads or records it (issue 39).
        let (out, err) = (
            MaskedRead::new(running.stdout, masker.clone()),
            MaskedRead::new(running.stderr, masker),
        );
        running.stdout = Box::new(Tee::new(Box::new(out), &ending, 0));
        running.stderr = Box::new(Tee::new(Box::new(err), &ending, 1));
        running.control = Arc::new(Reported {
            inner: running.control,
            ending,
        });
        Ok(running)
    }
}

/// A command's end, reported once when both are known: how it exited (the first `wait`
/// that returns, whoever calls it: the reader, a deadline's watcher) and that both of its
/// streams were read to their end or dropped unread. Reported at its exit alone, the event
/// missed what was still in the pipes when a watcher saw the exit before the reader had
/// read them.
struct Ending {
    /// Where the end goes: the session's recording.
    report: Box<dyn Fn(&LifecycleEvent) + Send + Sync>,
    pid: u32,
    started: Instant,
    state: Mutex<EndingState>,
}

#[derive(Default)]
struct EndingState {
    /// How the command exited and its run time, once seen.
    exit: Option<(CommandExit, f64)>,
    /// What each stream carried, and whether it ended (end of file, or its reader dropped).
    output: [Captured; 2],
    closed: [bool; 2],
    reported: bool,
}

impl Ending {
    fn exited(&self, exit: CommandExit) {
        let mut state = lock(&self.state);
        if state.exit.is_none() {
            state.exit = Some((exit, self.started.elapsed().as_secs_f64()));
        }
        self.report_if_done(state);
    }

    fn closed(&self, stream: usize) {
        let mut state = lock(&self.state);
        state.closed[stream] = true;
        self.report_if_done(state);
    }

    fn report_if_done(&self, mut state: std::sync::MutexGuard<'_, EndingState>) {
        let Some((exit, seconds)) = state.exit else {
            return;
        };
        if state.reported || !state.closed.iter().all(|c| *c) {
            return;
        }
        state.reported = true;
        let [stdout, stderr] = state.output.each_ref().map(Captured::output);
        drop(state);
        let event = LifecycleEvent::CommandEnded {
            pid: self.pid,
            exit_code: exit.code,
            signal: exit.signal,
            seconds,
            stdout,
            stderr,
        };
        (self.report)(&event);
    }
}

/// A command's control that notes the command's exit for its [`Ending`].
/// It holds the sandbox's control and nothing else of the command: dropping it kills the
/// command as dropping the sandbox's would.
struct Reported {
    inner: Arc<dyn CommandControl>,
    ending: Arc<Ending>,
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
        self.ending.exited(exit);
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

/// A command's stream, read through: what passes is kept in its [`Ending`], which learns
/// when the stream ends (end of file, or the reader dropping it).
struct Tee {
    inner: Box<dyn AsyncRead + Send + Unpin>,
    ending: Arc<Ending>,
    stream: usize,
}

impl Tee {
    fn new(inner: Box<dyn AsyncRead + Send + Unpin>, ending: &Arc<Ending>, stream: usize) -> Self {
        Tee {
            inner,
            ending: ending.clone(),
            stream,
        }
    }
}

impl AsyncRead for Tee {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let asked = buf.remaining() > 0;
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let read = &buf.filled()[before..];
            if read.is_empty() && asked {
                self.ending.closed(self.stream);
            } else {
                lock(&self.ending.state).output[self.stream].push(read);
            }
        }
        polled
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        self.ending.closed(self.stream);
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

    /// An [`Ending`] whose reports are collected.
    fn ending() -> (Arc<Ending>, Arc<Mutex<Vec<LifecycleEvent>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let into = seen.clone();
        let ending = Arc::new(Ending {
            report: Box::new(move |e: &LifecycleEvent| lock(&into).push(e.clone())),
            pid: 7,
            started: Instant::now(),
            state: Mutex::default(),
        });
        (ending, seen)
    }

    fn ended(e: &LifecycleEvent) -> (Option<i32>, String, u64, String) {
        match e {
            LifecycleEvent::CommandEnded {
                exit_code,
                stdout,
                stderr,
                ..
            } => (
                *exit_code,
                stdout.text.clone(),
                stdout.bytes,
                stderr.text.clone(),
            ),
            other => panic!("not an end: {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_reader_reads_through_the_tee_unchanged() {
        let (ending, seen) = ending();
        let mut tee = Tee::new(Box::new(&b"bytes\xff\n"[..]), &ending, 0);
        let mut read = Vec::new();
        tee.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"bytes\xff\n");
        let out = lock(&ending.state).output[0].output();
        assert_eq!((out.text.as_str(), out.bytes), ("bytes\u{fffd}\n", 7));
        assert!(lock(&seen).is_empty(), "no end before the exit");
    }

    /// The exit seen first (a deadline's watcher waits beside the reader): the end waits for
    /// the streams, and carries all they held.
    #[tokio::test]
    async fn the_end_is_reported_once_the_exit_and_both_streams_are_known() {
        let (ending, seen) = ending();
        let mut out = Tee::new(Box::new(&b"all of it\n"[..]), &ending, 0);
        let err = Tee::new(Box::new(&b""[..]), &ending, 1);
        ending.exited(CommandExit {
            code: Some(0),
            signal: None,
        });
        assert!(lock(&seen).is_empty());
        let mut read = Vec::new();
        out.read_to_end(&mut read).await.unwrap();
        assert!(lock(&seen).is_empty(), "stderr not yet ended");
        drop(err);
        ending.exited(CommandExit {
            code: Some(1),
            signal: None,
        });
        drop(out);
        let seen = lock(&seen);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(
            ended(&seen[0]),
            (Some(0), "all of it\n".into(), 10, String::new())
        );
    }

    /// Streams ended first, then the exit: reported at the exit.
    #[tokio::test]
    async fn streams_read_before_the_exit_report_at_the_exit() {
        let (ending, seen) = ending();
        let mut out = Tee::new(Box::new(&b"x"[..]), &ending, 0);
        let mut err = Tee::new(Box::new(&b"e"[..]), &ending, 1);
        let mut read = Vec::new();
        out.read_to_end(&mut read).await.unwrap();
        err.read_to_end(&mut read).await.unwrap();
        assert!(lock(&seen).is_empty());
        ending.exited(CommandExit {
            code: None,
            signal: Some(9),
        });
        assert_eq!(lock(&seen).len(), 1);
        assert_eq!(ended(&lock(&seen)[0]).3, "e");
    }
}
