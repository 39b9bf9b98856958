//! The backend-independent half of fork-server starts (issue 12): talking to a template
//! (`kernels/kernel_broker_boot.py template`) and finding the kernels it forks.
//!
//! Both backends run a template per user and kernel spec inside the user's sandbox (local:
//! a bwrap sandbox of its own, `local/template.rs`; Docker: an exec in the user's container,
//! `docker/template.rs`) and differ only in how its stdin and stdout reach the broker (pipes
//! of a child process; the Docker API's attached exec) and where a forked kernel's leaf
//! lives. What is the same is here, written once:
//!
//! - [`ForkServer`]: the protocol client. Requests (`fork`, `go`, `drop`) are JSON lines on
//!   the template's stdin; one reader task hands each answer (`forked`, `released`,
//!   `exited`, `error`)
//!   to whoever waits for it. The template's output is untrusted (user code runs in its
//!   sandbox, same uid): lines are bounded ([`read_line`]) and anything not understood
//!   breaks the template (it is not used again) rather than being guessed at.
//! - [`find_child`]: the host pid of the template's child that has a given pid inside the
//!   sandbox, with a pidfd opened on it and re-checked after opening, so the pidfd is that
//!   process and not a reuse of its pid; the procfs readings it rests on
//!   ([`children_of`], [`namespace_pid`], [`parent_of`]).
//! - [`forked_status`]: a forked kernel's end, seen through its pidfd (it is the template's
//!   child, not the broker's), with the raw wait status its template reports.
//!
//! procfs is read by hand: the few fields needed (`task/<tid>/children`, the last `NSpid`
//! of `status`, the parent in `stat`) do not justify a procfs crate, and `NSpid` is what
//! ties a pid inside the sandbox to the host's.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::sync::lock;

/// How long a template may take to import its modules and say it is ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a fork may take to be answered.
pub const FORK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a template that failed is left alone before the next try.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);
/// The longest line the broker reads from a template (they are short JSON objects).
pub const MAX_LINE: usize = 16 * 1024;
/// How long a forked kernel's status may take to arrive from its template after the
/// kernel ended (the template reaps at once; only a dead template never reports).
pub const FORKED_STATUS_TIMEOUT: Duration = Duration::from_secs(2);

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

/// Reads a template's first line (within [`READY_TIMEOUT`]); it must say it is ready.
pub async fn read_ready<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Ready, String> {
    let ready = match timeout(READY_TIMEOUT, read_line(reader)).await {
        Ok(Ok(Some(line))) => serde_json::from_slice::<Ready>(&line)
            .map_err(|e| format!("its first line is not understood: {e}"))?,
        Ok(Ok(None)) => return Err("it ended before it was ready".to_string()),
        Ok(Err(e)) => return Err(format!("reading it failed: {e}")),
        Err(_) => return Err(format!("not ready within {READY_TIMEOUT:?}")),
    };
    if !ready.ready {
        return Err("it said it is not ready".to_string());
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
    forks: HashMap<String, oneshot::Sender<Result<i32, String>>>,
    releases: HashMap<String, oneshot::Sender<Result<(), String>>>,
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

    async fn send(&self, request: serde_json::Value) -> Result<(), String> {
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
            Ok(Err(e)) => Err(format!("cannot write to the template: {e}")),
            Err(_) => Err("the template does not read its requests".to_string()),
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
    ) -> Result<Child, String> {
        let mut request = kernel_request(args, env, connection_file);
        request["op"] = json!("fork");
        request["id"] = json!(id);
        self.fork_request(id, request).await
    }

    /// Asks for a child that is told what kernel to become only when it is released
    /// ([`Self::go_as`]): a stem, forked and placed ahead of need.
    pub async fn fork_stem(&self, id: &str) -> Result<Child, String> {
        self.fork_request(id, json!({"op": "fork", "id": id})).await
    }

    async fn fork_request(&self, id: &str, request: serde_json::Value) -> Result<Child, String> {
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
                Err("the template ended".into())
            }
            Err(_) => {
                self.forget(id);
                self.set_broken();
                Err(format!("no answer within {FORK_TIMEOUT:?}"))
            }
        }
    }

    /// Releases child `id`: it becomes the kernel.
    pub async fn go(&self, id: &str) -> Result<(), String> {
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
    ) -> Result<(), String> {
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
            Ok(Err(_)) => Err("the template ended".into()),
            Err(_) => {
                lock(&self.waiting).releases.remove(id);
                self.set_broken();
                Err(format!("no answer within {FORK_TIMEOUT:?}"))
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
                            let _ = tx.send(Err(error));
                        } else if let Some(tx) = waiting.releases.remove(&id) {
                            let _ = tx.send(Err(error));
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

/// The host pid of the template's child that is `inner` in the sandbox, with a pidfd
/// opened on it and checked after opening (so the pidfd is that process, not a reuse).
pub fn find_child(template: i32, inner: i32) -> Option<(i32, OwnedFd)> {
    let pid = children_of(template)
        .into_iter()
        .find(|pid| namespace_pid(*pid) == Some(inner))?;
    let fd = pidfd_open(pid).ok()?;
    let still = namespace_pid(pid) == Some(inner) && parent_of(pid) == Some(template);
    still.then_some((pid, fd))
}

/// A pidfd of host process `pid` (non-blocking: it polls readable once the process ended).
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by pidfd_open and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` to the process of `pidfd` (never to a process that reused its pid).
pub fn pidfd_signal(pidfd: &OwnedFd, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with a valid descriptor, a null siginfo and no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A forked kernel's end: its pidfd turns readable when it has ended; its template reaps it
/// and reports the raw status (within [`FORKED_STATUS_TIMEOUT`]).
pub async fn forked_status(
    pidfd: &AsyncFd<OwnedFd>,
    status: &mut oneshot::Receiver<i32>,
) -> io::Result<ExitStatus> {
    let _ready = pidfd.readable().await?;
    match timeout(FORKED_STATUS_TIMEOUT, status).await {
        Ok(Ok(raw)) => Ok(ExitStatus::from_raw(raw)),
        _ => Err(io::Error::other(
            "its exit status is unknown (its template did not report it)",
        )),
    }
}

/// The children of `pid` (of its main thread): `/proc/<pid>/task/<pid>/children`, or a
/// scan of `/proc` where the kernel does not provide that file.
pub fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| children_by_scan(pid))
}

/// Children of `pid` by scanning `/proc` (when `/proc/<pid>/task/<pid>/children` is missing).
fn children_by_scan(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_parent(&stat)
}

/// `pid (comm) state ppid ...`; comm may contain spaces and parentheses.
fn parse_parent(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The state letter of `pid` (`R`, `S`, `T` stopped, `Z` ended, ...), if it exists.
pub fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_state(&stat)
}

fn parse_state(stat: &str) -> Option<char> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next()?.chars().next()
}

/// The innermost pid of a process (the last `NSpid` field), if the kernel reports it.
pub fn namespace_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_namespace_pid(&status)
}

fn parse_namespace_pid(status: &str) -> Option<i32> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    #[test]
    fn procfs_fields_parse() {
        assert_eq!(parse_parent("42 (a b) c) S 7 42 42 0"), Some(7));
        assert_eq!(parse_parent("garbage"), None);
        assert_eq!(parse_state("42 (a b) c) T 7 42 42 0"), Some('T'));
        assert_eq!(parse_state("garbage"), None);
        assert!(matches!(
            state_of(std::process::id() as i32),
            Some('R' | 'S')
        ));
        let status = "Name:\tpython\nNSpid:\t12345\t57\nPPid:\t3\n";
        assert_eq!(parse_namespace_pid(status), Some(57));
        assert_eq!(parse_namespace_pid("NSpid:\t9\n"), Some(9));
        assert_eq!(parse_namespace_pid("Name:\tx\n"), None);
        // This process: its own pid in its own namespace is what getpid says when the test
        // runs in the init namespace; in any case its parent is known.
        let me = std::process::id() as i32;
        assert!(namespace_pid(me).is_some());
        assert!(parent_of(me).is_some());
    }

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
            let e = read_ready(&mut BufReader::new(bad)).await.unwrap_err();
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
        assert_eq!(refused.err().as_deref(), Some("bad request"));
        // Something not understood: the template is broken, waiters hear it ended.
        let fork = server.fork("s3", &args, &env, "c");
        let garbage = async {
            says.write_all(b"[1, 2]\n").await.unwrap();
        };
        let (ended, ()) = tokio::join!(fork, garbage);
        assert_eq!(ended.err().as_deref(), Some("the template ended"));
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
        assert_eq!(released, Ok(()));
        // A release the template refuses (its child is gone) fails the launch at once.
        let go = server.go_as("8", &args, &env, "c");
        let refuse = async {
            read_line(&mut requests).await.unwrap().unwrap();
            says.write_all(b"{\"error\": \"no kernel named for '8'\", \"id\": \"8\"}\n")
                .await
                .unwrap();
        };
        let (refused, ()) = tokio::join!(go, refuse);
        assert!(refused.unwrap_err().contains("no kernel named"));
        // A template that ends while a release waits fails it too.
        let go = server.go_as("9", &args, &env, "c");
        let end = async {
            read_line(&mut requests).await.unwrap().unwrap();
            drop(says);
        };
        let (ended, ()) = tokio::join!(go, end);
        assert_eq!(ended.err().as_deref(), Some("the template ended"));
        assert!(!server.usable());
    }
}
