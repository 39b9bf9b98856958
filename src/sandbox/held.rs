//! A held checkpoint's control socket (issue 36).
//!
//! A checkpoint of a live kernel is its child, *held* (`kernels/kernel_broker_fork.py`,
//! `held_checkpoint`): it keeps only its regular files, runs no thread, and waits on one
//! unix socket to the broker. Each connection the broker sends there makes it fork a kernel
//! with the state of the moment it was taken (a rewind, or a fork of the checkpoint), and
//! it answers with that child's pid; when the broker closes the socket (the checkpoint
//! dropped, its session ended, the broker gone, kill -9 included) it ends.
//!
//! The socket is the broker's, bound in a directory of the broker's (mode 0711, in the
//! kernel's fork directory: the kernels can reach it, not list or change it), and the
//! broker keeps the one connection whose peer is the held child, by the pid the kernel
//! reports (checked as every fork's is, `fork.rs`) against `SO_PEERCRED`, which the
//! connecting process cannot choose. Another process of the sandbox (the live kernel,
//! another kernel of the user) may connect too: it is closed. So a new kernel's key goes
//! to the checkpoint alone, never through a file another kernel could read. What the held
//! child answers is as untrusted as any kernel's reply: one bounded line, its pid checked
//! as a fork's.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::{timeout, Instant};

/// The socket's name in its directory.
pub(crate) const CONTROL_NAME: &str = "c";
/// How many connections that are not the held child's are closed before giving up.
const MAX_STRANGERS: usize = 16;
/// The longest answer the held child may send (a good one is about 30 bytes).
pub(crate) const MAX_ANSWER: usize = 4096;

/// Why a held checkpoint's control socket did not serve.
#[derive(Debug, thiserror::Error)]
pub enum HeldError {
    #[error("its control socket failed: {0}")]
    Socket(#[source] std::io::Error),
    #[error("it did not connect to its control socket within {0:?}")]
    NotConnected(Duration),
    #[error("{MAX_STRANGERS} other processes connected to its control socket first")]
    Strangers,
    #[error("the checkpoint could not be reached: {0}")]
    Unreachable(#[source] std::io::Error),
    #[error("the checkpoint ended before it answered")]
    Ended,
    #[error("the checkpoint answered more than it was asked")]
    TooMuch,
    #[error("the checkpoint's answer is longer than {MAX_ANSWER} bytes")]
    TooLong,
    #[error("the checkpoint did not answer within {0:?}")]
    Silent(Duration),
}

/// The broker's end, listening, until the held child connects.
#[derive(Debug)]
pub(crate) struct ControlListener {
    listener: UnixListener,
    /// The directory the socket is in (the broker's), to unlink it once taken.
    dir: OwnedFd,
}

impl ControlListener {
    /// Binds the control socket in `dir`, a directory the broker made and only it can
    /// write (so the name cannot be swapped for anything meanwhile), and lets the kernels
    /// connect to it (mode 0777: what a connect needs; the peer check is the guard).
    /// Needs a Tokio runtime.
    pub fn bind(dir: OwnedFd) -> std::io::Result<Self> {
        let path = format!("/proc/self/fd/{}/{CONTROL_NAME}", dir.as_raw_fd());
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        rustix::fs::chmodat(
            dir.as_fd(),
            CONTROL_NAME,
            rustix::fs::Mode::from_raw_mode(0o777),
            rustix::fs::AtFlags::empty(),
        )?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener: UnixListener::from_std(listener)?,
            dir,
        })
    }

    /// The held child's connection: the first whose peer is host process `pid`, within
    /// `limit`; every other is closed. The socket's name is removed either way.
    pub async fn accept_from(self, pid: i32, limit: Duration) -> Result<HeldControl, HeldError> {
        let deadline = Instant::now() + limit;
        let mut strangers = 0;
        let found = loop {
            let accepted = match timeout(
                deadline.saturating_duration_since(Instant::now()),
                self.listener.accept(),
            )
            .await
            {
                Ok(Ok((stream, _))) => stream,
                Ok(Err(e)) => break Err(HeldError::Socket(e)),
                Err(_) => break Err(HeldError::NotConnected(limit)),
            };
            match accepted.peer_cred().ok().and_then(|c| c.pid()) {
                Some(peer) if peer == pid => break Ok(HeldControl { stream: accepted }),
                _ => {
                    strangers += 1;
                    if strangers > MAX_STRANGERS {
                        break Err(HeldError::Strangers);
                    }
                }
            }
        };
        let _ = rustix::fs::unlinkat(self.dir.as_fd(), CONTROL_NAME, rustix::fs::AtFlags::empty());
        found
    }
}

/// The broker's end of a held checkpoint's control socket. Dropping it ends the checkpoint.
#[derive(Debug)]
pub struct HeldControl {
    stream: UnixStream,
}

impl HeldControl {
    /// Sends `request` (`{"connection": ...}`) and returns the held child's answer, one
    /// line of at most [`MAX_ANSWER`] bytes (a `kb_fork_reply`'s content), within `limit`.
    pub async fn wake(
        &mut self,
        request: &serde_json::Value,
        limit: Duration,
    ) -> Result<Vec<u8>, HeldError> {
        let mut line = request.to_string().into_bytes();
        line.push(b'\n');
        let exchange = async {
            self.stream
                .write_all(&line)
                .await
                .map_err(HeldError::Unreachable)?;
            let mut answer = Vec::new();
            let mut buf = [0u8; 512];
            loop {
                let n = self
                    .stream
                    .read(&mut buf)
                    .await
                    .map_err(HeldError::Unreachable)?;
                if n == 0 {
                    return Err(HeldError::Ended);
                }
                answer.extend_from_slice(&buf[..n]);
                if let Some(end) = answer.iter().position(|b| *b == b'\n') {
                    if end + 1 != answer.len() {
                        return Err(HeldError::TooMuch);
                    }
                    answer.truncate(end);
                    return Ok(answer);
                }
                if answer.len() > MAX_ANSWER {
                    return Err(HeldError::TooLong);
                }
            }
        };
        timeout(limit, exchange)
            .await
            .map_err(|_| HeldError::Silent(limit))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};

    fn dir() -> (tempfile::TempDir, OwnedFd) {
        let tmp = tempfile::tempdir().unwrap();
        let fd = crate::sandbox::fsutil::open_tree_root(tmp.path()).unwrap();
        (tmp, fd)
    }

    #[tokio::test]
    async fn only_the_named_process_is_kept_and_strangers_are_closed() {
        let (tmp, fd) = dir();
        let listener = ControlListener::bind(fd).unwrap();
        let path = tmp.path().join(CONTROL_NAME);
        let mode = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o777
        );
        // A stranger (a child process) connects first, then this process: the stranger
        // says when it is connected (a loaded machine can take seconds to start Python).
        let mut stranger = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('connected', flush=True); print(s.recv(10) == b'', flush=True)",
            ])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = std::io::BufReader::new(stranger.stdout.take().unwrap());
        let mut line = String::new();
        said.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "connected");
        let p = path.clone();
        let ours = std::thread::spawn(move || {
            let mut s = std::os::unix::net::UnixStream::connect(&p).unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            assert!(line.contains("connection"));
            s.write_all(b"{\"status\":\"ok\",\"pid\":7}\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            s.write_all(&vec![b'x'; 5000]).unwrap();
        });
        let mut control = listener
            .accept_from(std::process::id() as i32, Duration::from_secs(10))
            .await
            .unwrap();
        // The stranger was closed; the name is gone.
        line.clear();
        said.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "True");
        stranger.wait().unwrap();
        assert!(!path.exists());
        let request = serde_json::json!({"connection": {}});
        let answer = control
            .wake(&request, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(answer, b"{\"status\":\"ok\",\"pid\":7}");
        let err = control
            .wake(&request, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(matches!(err, HeldError::TooLong), "{err}");
        ours.join().unwrap();
    }

    #[tokio::test]
    async fn nobody_connecting_is_a_timeout_and_a_silent_checkpoint_too() {
        let (_tmp, fd) = dir();
        let listener = ControlListener::bind(fd).unwrap();
        let err = listener
            .accept_from(1, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, HeldError::NotConnected(_)), "{err}");
        let (a, _b) = UnixStream::pair().unwrap();
        let mut control = HeldControl { stream: a };
        let err = control
            .wake(&serde_json::json!({}), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, HeldError::Silent(_)), "{err}");
    }
}
