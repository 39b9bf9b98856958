//! The fork-server protocol: requests (`fork`, `go`, `drop`) as JSON lines on a template's
//! stdin, answers (`ready`, then `forked`, `released`, `exited`, `error`) as JSON lines on
//! its stdout. The template's output is untrusted (user code runs in its sandbox, same uid):
//! lines are bounded ([`read_line`]) and anything not understood breaks the template (it is
//! not used again) rather than being guessed at. Knows nothing of either backend: it reads
//! and writes any async byte stream.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::sync::lock;

/// How long a template may take to import its modules and say it is ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a fork may take to be answered.
pub const FORK_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest line the broker reads from a template (they are short JSON objects).
pub const MAX_LINE: usize = 16 * 1024;

/// A template's first line.
#[derive(Debug, Deserialize)]
pub struct Ready {
    pub ready: bool,
    /// Its pid inside its sandbox.
    pub pid: i32,
    #[serde(default)]
    pub modules: Vec<String>,
    #[serde(default)]
    pub threads: u64,
    #[serde(default)]
    pub seconds: f64,
}

/// Why a template did not become ready (its first line).
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    #[error("its first line is not understood: {0}")]
    NotUnderstood(#[source] serde_json::Error),
    #[error("it ended before it was ready")]
    Ended,
    #[error("reading it failed: {0}")]
    Read(#[source] io::Error),
    #[error("not ready within {:?}", READY_TIMEOUT)]
    TimedOut,
    #[error("it said it is not ready")]
    Declined,
}

/// Why a request to a template (a fork, a release) failed.
#[derive(Debug, thiserror::Error)]
pub enum RequestFailed {
    #[error("cannot write to the template: {0}")]
    Write(#[source] io::Error),
    #[error("the template does not read its requests")]
    NotRead,
    /// The template answered with an error of its own (its words).
    #[error("{0}")]
    Refused(String),
    #[error("the template ended")]
    Ended,
    #[error("no answer within {:?}", FORK_TIMEOUT)]
    NoAnswer,
}

/// Reads a template's first line (within [`READY_TIMEOUT`]); it must say it is ready.
pub async fn read_ready<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Ready, NotReady> {
    let ready = match timeout(READY_TIMEOUT, read_line(reader)).await {
        Ok(Ok(Some(line))) => {
            serde_json::from_slice::<Ready>(&line).map_err(NotReady::NotUnderstood)?
        }
        Ok(Ok(None)) => return Err(NotReady::Ended),
        Ok(Err(e)) => return Err(NotReady::Read(e)),
        Err(_) => return Err(NotReady::TimedOut),
    };
    if !ready.ready {
        return Err(NotReady::Declined);
    }
    Ok(ready)
}

/// One line from a template after its first.
#[derive(Deserialize)]
#[serde(untagged)]
enum Said {
    Forked { forked: String, pid: i32 },
    Released { released: String },
    Exited { exited: String, status: i32 },
    Error { error: String, id: Option<String> },
}

/// Answers the reader hands to waiting launches and watchers.
#[derive(Default)]
struct Waiting {
    forks: HashMap<String, oneshot::Sender<Result<i32, RequestFailed>>>,
    releases: HashMap<String, oneshot::Sender<Result<(), RequestFailed>>>,
    exits: HashMap<String, oneshot::Sender<i32>>,
}

/// The writing end of a template's stdin.
pub type Control = Box<dyn AsyncWrite + Send + Unpin>;

/// The protocol client of one running template (see the module comment).
pub struct ForkServer {
    control: tokio::sync::Mutex<Control>,
    waiting: Arc<Mutex<Waiting>>,
    next: AtomicU64,
    broken: Arc<AtomicBool>,
}

/// A child the template forked, waiting for `go`.
pub struct Child {
    /// Its pid inside the template's sandbox.
    pub inner_pid: i32,
    /// The raw wait status, once the template has reaped it; an error if the template
    /// stopped working first.
    pub status: oneshot::Receiver<i32>,
}

impl ForkServer {
    /// A client writing requests to `control` and reading answers from `answers` (after the
    /// first line, [`read_ready`]) in a task of its own until the template ends. `name`
    /// names the template in the log.
    pub fn new<R>(control: Control, answers: R, name: String) -> Self
    where
        R: AsyncBufRead + Unpin + Send + 'static,
    {
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let broken = Arc::new(AtomicBool::new(false));
        tokio::spawn(read_answers(answers, waiting.clone(), broken.clone(), name));
        Self {
            control: tokio::sync::Mutex::new(control),
            waiting,
            next: AtomicU64::new(1),
            broken,
        }
    }

    /// Whether forks may be asked of it: its reader still runs and nothing went wrong.
    pub fn usable(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
    }

    /// Marks it as not to be used again (replaced at the next launch).
    pub fn set_broken(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    /// A name no other child of this template has had (a directory name for the local
    /// backend's kernels).
    pub fn next_name(&self) -> String {
        self.next.fetch_add(1, Ordering::Relaxed).to_string()
    }

    /// Whether a child it forked has not been reported ended yet.
    pub fn has_children(&self) -> bool {
        self.children() > 0
    }

    /// How many children it forked have not been reported ended yet.
    pub fn children(&self) -> usize {
        lock(&self.waiting).exits.len()
    }

    async fn send(&self, request: serde_json::Value) -> Result<(), RequestFailed> {
        let mut line = request.to_string();
        line.push('\n');
        let mut control = self.control.lock().await;
        let sent = timeout(FORK_TIMEOUT, async {
            control.write_all(line.as_bytes()).await?;
            control.flush().await
        })
        .await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RequestFailed::Write(e)),
            Err(_) => Err(RequestFailed::NotRead),
        }
    }

    /// Asks for a child running ipykernel with `args` and `env` once released; it removes
    /// `connection_file` once it has read it. A template that does not answer is broken.
    pub async fn fork(
        &self,
        id: &str,
        args: &[String],
        env: &HashMap<&str, &str>,
        connection_file: &str,
    ) -> Result<Child, RequestFailed> {
        let mut request = kernel_request(args, env, connection_file);
        request["op"] = json!("fork");
        request["id"] = json!(id);
        self.fork_request(id, request).await
    }

    /// Asks for a child that is told what kernel to become only when it is released
    /// ([`Self::go_as`]): a stem, forked and placed ahead of need.
    pub async fn fork_stem(&self, id: &str) -> Result<Child, RequestFailed> {
        self.fork_request(id, json!({"op": "fork", "id": id})).await
    }

    async fn fork_request(
        &self,
        id: &str,
        request: serde_json::Value,
    ) -> Result<Child, RequestFailed> {
        let (fork_tx, fork_rx) = oneshot::channel();
        let (exit_tx, exit_rx) = oneshot::channel();
        {
            let mut waiting = lock(&self.waiting);
            waiting.forks.insert(id.to_string(), fork_tx);
            waiting.exits.insert(id.to_string(), exit_tx);
        }
        if let Err(e) = self.send(request).await {
            self.forget(id);
            self.set_broken();
            return Err(e);
        }
        match timeout(FORK_TIMEOUT, fork_rx).await {
            Ok(Ok(Ok(pid))) => Ok(Child {
                inner_pid: pid,
                status: exit_rx,
            }),
            Ok(Ok(Err(e))) => {
                self.forget(id);
                Err(e)
            }
            Ok(Err(_)) => {
                self.forget(id);
                Err(RequestFailed::Ended)
            }
            Err(_) => {
                self.forget(id);
                self.set_broken();
                Err(RequestFailed::NoAnswer)
            }
        }
    }

    /// Releases child `id`: it becomes the kernel.
    pub async fn go(&self, id: &str) -> Result<(), RequestFailed> {
        let sent = self.send(json!({"op": "go", "id": id})).await;
        if sent.is_err() {
            self.set_broken();
        }
        sent
    }

    /// Releases stem `id` to become the kernel of `args`, `env` and `connection_file` (as
    /// [`Self::fork`] would have made it), once the template says it did: a template that
    /// ended meanwhile fails the launch now, not after the kernel's ready timeout.
    pub async fn go_as(
        &self,
        id: &str,
        args: &[String],
        env: &HashMap<&str, &str>,
        connection_file: &str,
    ) -> Result<(), RequestFailed> {
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).releases.insert(id.to_string(), tx);
        let kernel = kernel_request(args, env, connection_file);
        let sent = self
            .send(json!({"op": "go", "id": id, "kernel": kernel}))
            .await;
        if let Err(e) = sent {
            lock(&self.waiting).releases.remove(id);
            self.set_broken();
            return Err(e);
        }
        match timeout(FORK_TIMEOUT, rx).await {
            Ok(Ok(released)) => released,
            Ok(Err(_)) => Err(RequestFailed::Ended),
            Err(_) => {
                lock(&self.waiting).releases.remove(id);
                self.set_broken();
                Err(RequestFailed::NoAnswer)
            }
        }
    }

    /// Gives child `id` up (it is killed, never released); its end is no longer awaited.
    pub async fn drop_child(&self, id: &str) {
        self.forget(id);
        let _ = self.send(json!({"op": "drop", "id": id})).await;
    }

    fn forget(&self, id: &str) {
        let mut waiting = lock(&self.waiting);
        waiting.forks.remove(id);
        waiting.releases.remove(id);
        waiting.exits.remove(id);
    }
}

/// What a child is to become: the kernel's part of a `fork` or `go` request.
fn kernel_request(
    args: &[String],
    env: &HashMap<&str, &str>,
    connection_file: &str,
) -> serde_json::Value {
    json!({"args": args, "env": env, "connection_file": connection_file})
}

/// Reads a template's lines until it ends, handing each answer to whoever waits for it.
async fn read_answers<R: AsyncBufRead + Unpin>(
    mut answers: R,
    waiting: Arc<Mutex<Waiting>>,
    broken: Arc<AtomicBool>,
    name: String,
) {
    loop {
        match read_line(&mut answers).await {
            Ok(Some(line)) => match serde_json::from_slice::<Said>(&line) {
                Ok(Said::Forked { forked, pid }) => {
                    if let Some(tx) = lock(&waiting).forks.remove(&forked) {
                        let _ = tx.send(Ok(pid));
                    }
                }
                Ok(Said::Released { released }) => {
                    if let Some(tx) = lock(&waiting).releases.remove(&released) {
                        let _ = tx.send(Ok(()));
                    }
                }
                Ok(Said::Exited { exited, status }) => {
                    if let Some(tx) = lock(&waiting).exits.remove(&exited) {
                        let _ = tx.send(status);
                    }
                }
                Ok(Said::Error { error, id }) => {
                    tracing::warn!(template = %name, %error, "the template refused a request");
                    let mut waiting = lock(&waiting);
                    if let Some(id) = id {
                        if let Some(tx) = waiting.forks.remove(&id) {
                            let _ = tx.send(Err(RequestFailed::Refused(error)));
                        } else if let Some(tx) = waiting.releases.remove(&id) {
                            let _ = tx.send(Err(RequestFailed::Refused(error)));
                        }
                    }
                }
                Err(_) => {
                    tracing::warn!(template = %name, "the template said something not understood; not used again");
                    break;
                }
            },
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(template = %name, error = %e, "reading the template failed; not used again");
                break;
            }
        }
    }
    broken.store(true, Ordering::Relaxed);
    // Waiters see their senders dropped: a fork fails, an exit is "unknown".
    let mut waiting = lock(&waiting);
    waiting.forks.clear();
    waiting.releases.clear();
    waiting.exits.clear();
}

/// One line of at most [`MAX_LINE`] bytes (without its newline); `None` at the end. The
/// limit holds before anything is kept: a template that never says a newline costs at
/// most that much.
pub async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(None);
        }
        let (take, done) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > MAX_LINE + 1 {
            return Err(io::Error::other(format!(
                "a line longer than {MAX_LINE} bytes"
            )));
        }
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if done {
            line.pop();
            return Ok(Some(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    #[tokio::test]
    async fn lines_are_bounded_before_they_are_kept() {
        let text = b"{\"a\":1}\n\nlast".to_vec();
        let mut r = BufReader::new(&text[..]);
        assert_eq!(read_line(&mut r).await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(read_line(&mut r).await.unwrap().unwrap(), b"");
        // A last line without a newline is cut off at the end: not a whole answer.
        assert_eq!(read_line(&mut r).await.unwrap(), None);
        let long = vec![b'x'; MAX_LINE + 10];
        let mut r = BufReader::with_capacity(64, &long[..]);
        assert!(read_line(&mut r).await.is_err());
        let exact = [vec![b'y'; MAX_LINE], vec![b'\n']].concat();
        let mut r = BufReader::with_capacity(64, &exact[..]);
        assert_eq!(read_line(&mut r).await.unwrap().unwrap().len(), MAX_LINE);
    }

    #[tokio::test]
    async fn a_template_must_say_it_is_ready() {
        let ok = b"{\"ready\": true, \"pid\": 57, \"modules\": [\"numpy\"]}\n".to_vec();
        let r = read_ready(&mut BufReader::new(&ok[..])).await.unwrap();
        assert_eq!((r.pid, r.modules.len()), (57, 1));
        for (bad, why) in [
            (&b"{\"ready\": false, \"pid\": 1}\n"[..], "not ready"),
            (&b"hello\n"[..], "not understood"),
            (&b""[..], "ended before"),
        ] {
            let e = read_ready(&mut BufReader::new(bad))
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[tokio::test]
    async fn answers_reach_their_waiters_and_garbage_breaks_the_template() {
        // The template's side of the pipes: what it reads, and what it says.
        let (control, mut requests) = tokio::io::duplex(4096);
        let (mut says, answers) = tokio::io::duplex(4096);
        let server = ForkServer::new(Box::new(control), BufReader::new(answers), "t".into());
        let env = HashMap::from([("A", "1")]);
        let args = vec![
            "-f".to_string(),
            "/run/kernel/1/connection.json".to_string(),
        ];
        let fork = server.fork("s1", &args, &env, "/run/kernel/1/connection.json");
        let answer = async {
            let mut r = BufReader::new(&mut requests);
            let line = read_line(&mut r).await.unwrap().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(v["op"], "fork");
            assert_eq!(v["id"], "s1");
            assert_eq!(v["env"]["A"], "1");
            assert_eq!(v["args"][1], "/run/kernel/1/connection.json");
            says.write_all(b"{\"forked\": \"s1\", \"pid\": 99}\n")
                .await
                .unwrap();
        };
        let (child, ()) = tokio::join!(fork, answer);
        let mut child = child.unwrap();
        assert_eq!(child.inner_pid, 99);
        assert!(server.has_children());
        says.write_all(b"{\"exited\": \"s1\", \"status\": 2304}\n")
            .await
            .unwrap();
        assert_eq!((&mut child.status).await.unwrap(), 2304);
        assert!(!server.has_children());
        assert!(server.usable());
        // A refusal reaches the fork that asked.
        let fork = server.fork("s2", &args, &env, "c");
        let refuse = async {
            says.write_all(b"{\"error\": \"bad request\", \"id\": \"s2\"}\n")
                .await
                .unwrap();
        };
        let (refused, ()) = tokio::join!(fork, refuse);
        assert_eq!(
            refused.err().map(|e| e.to_string()).as_deref(),
            Some("bad request")
        );
        // Something not understood: the template is broken, waiters hear it ended.
        let fork = server.fork("s3", &args, &env, "c");
        let garbage = async {
            says.write_all(b"[1, 2]\n").await.unwrap();
        };
        let (ended, ()) = tokio::join!(fork, garbage);
        assert_eq!(
            ended.err().map(|e| e.to_string()).as_deref(),
            Some("the template ended")
        );
        assert!(!server.usable());
    }

    #[tokio::test]
    async fn a_stem_is_told_its_kernel_when_it_is_released() {
        let (control, requests) = tokio::io::duplex(4096);
        let (mut says, answers) = tokio::io::duplex(4096);
        let server = ForkServer::new(Box::new(control), BufReader::new(answers), "t".into());
        let mut requests = BufReader::new(requests);
        // The fork names no kernel.
        let fork = server.fork_stem("7");
        let answer = async {
            let line = read_line(&mut requests).await.unwrap().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(v, json!({"op": "fork", "id": "7"}));
            says.write_all(b"{\"forked\": \"7\", \"pid\": 40}\n")
                .await
                .unwrap();
        };
        let (child, ()) = tokio::join!(fork, answer);
        assert_eq!(child.unwrap().inner_pid, 40);
        // The release does, and waits until the template says it released it.
        let env = HashMap::from([("B", "2")]);
        let args = vec![
            "-f".to_string(),
            "/run/kernel/7/connection.json".to_string(),
        ];
        let go = server.go_as("7", &args, &env, "/run/kernel/7/connection.json");
        let answer = async {
            let line = read_line(&mut requests).await.unwrap().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(
                (v["op"].as_str(), v["id"].as_str()),
                (Some("go"), Some("7"))
            );
            assert_eq!(v["kernel"]["args"][1], "/run/kernel/7/connection.json");
            assert_eq!(v["kernel"]["env"]["B"], "2");
            assert_eq!(
                v["kernel"]["connection_file"],
                "/run/kernel/7/connection.json"
            );
            says.write_all(b"{\"released\": \"7\"}\n").await.unwrap();
        };
        let (released, ()) = tokio::join!(go, answer);
        assert!(released.is_ok(), "{released:?}");
        // A release the template refuses (its child is gone) fails the launch at once.
        let go = server.go_as("8", &args, &env, "c");
        let refuse = async {
            read_line(&mut requests).await.unwrap().unwrap();
            says.write_all(b"{\"error\": \"no kernel named for '8'\", \"id\": \"8\"}\n")
                .await
                .unwrap();
        };
        let (refused, ()) = tokio::join!(go, refuse);
        assert!(refused.unwrap_err().to_string().contains("no kernel named"));
        // A template that ends while a release waits fails it too.
        let go = server.go_as("9", &args, &env, "c");
        let end = async {
            read_line(&mut requests).await.unwrap().unwrap();
            drop(says);
        };
        let (ended, ()) = tokio::join!(go, end);
        assert_eq!(
            ended.err().map(|e| e.to_string()).as_deref(),
            Some("the template ended")
        );
        assert!(!server.usable());
    }
}
