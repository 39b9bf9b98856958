//! The backend-independent half of fork-server starts (issue 12): talking to a template
//! (`kernels/kernel_broker_boot.py template`) and finding the kernels it forks.
//!
//! Both backends run a template per user and kernel spec inside the user's sandbox (local:
//! a bwrap sandbox of its own, `local/template/`; Docker: an exec in the user's container,
//! `docker/template.rs`) and differ only in how its stdin and stdout reach the broker (pipes
//! of a child process; the Docker API's attached exec) and where a forked kernel's leaf
//! lives. What is the same is here, written once:
//!
//! - `protocol.rs`: [`ForkServer`], the protocol client. Requests are JSON lines on the
//!   template's stdin; one reader task hands each answer to whoever waits for it. The
//!   template's output is untrusted: lines are bounded ([`protocol::read_line`]) and anything not
//!   understood breaks the template rather than being guessed at.
//! - [`find_child`]: the host pid of the template's child that has a given pid inside the
//!   sandbox, with a pidfd opened on it and re-checked after opening, so the pidfd is that
//!   process and not a reuse of its pid (on the procfs readings of `sandbox/procfs.rs`).
//! - [`forked_status`]: a forked kernel's end, seen through its pidfd (it is the template's
//!   child, not the broker's), with the raw wait status its template reports.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::sandbox::pidfd;
use crate::sandbox::procfs::{child_with_namespace_pid, namespace_pid, parent_of};

mod protocol;

pub use protocol::{read_ready, Child, ForkServer, NotReady, Ready, RequestFailed};

/// How long a template that failed is left alone before the next try.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);
/// How long a forked kernel's status may take to arrive from its template after the
/// kernel ended (the template reaps at once; only a dead template never reports).
pub const FORKED_STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// The host pid of the template's child that is `inner` in the sandbox, with a pidfd
/// opened on it and checked after opening (so the pidfd is that process, not a reuse).
pub fn find_child(template: i32, inner: i32) -> Option<(i32, OwnedFd)> {
    let pid = child_with_namespace_pid(template, inner)?;
    let fd = pidfd::open(pid).ok()?;
    let still = namespace_pid(pid) == Some(inner) && parent_of(pid) == Some(template);
    still.then_some((pid, fd))
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
