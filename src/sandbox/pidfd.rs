//! Process descriptors (pidfds): a handle on one process that never names another one
//! after its pid is reused. The broker watches forked kernels, Podman execs and kept
//! kernels through them and signals through them (an interrupt or a kill never reaches a
//! process that took a dead kernel's pid).
//!
//! Built on rustix's `pidfd_open`, `pidfd_send_signal` and `poll`, so this file holds no
//! `unsafe`.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags};

pub use rustix::process::Signal;

/// A pidfd of host process `pid` (non-blocking: it polls readable once the process ended).
pub fn open(pid: i32) -> io::Result<OwnedFd> {
    // A pid that is not positive names no one process (and rustix asks for one that is).
    let pid =
        Pid::from_raw(pid.max(0)).ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok(pidfd_open(pid, PidfdFlags::NONBLOCK)?)
}

/// A pidfd for `pid` if it still is the process that started at `start`
/// (`procfs::start_time`): opened first and checked after, so the pidfd cannot refer to a
/// process that reused the pid.
pub fn open_started(pid: i32, start: u64) -> Option<OwnedFd> {
    if pid <= 0 {
        return None;
    }
    let fd = open(pid).ok()?;
    super::procfs::is_same_process(pid, start).then_some(fd)
}

/// Sends `signal` to the process of `pidfd` (never to a process that reused its pid).
pub fn signal(pidfd: impl AsFd, signal: Signal) -> io::Result<()> {
    Ok(pidfd_send_signal(pidfd, signal)?)
}

/// Whether the process of `pidfd` exists still (running, or ended and not yet reaped):
/// signal 0 through the pidfd, which fails with `ESRCH` once it was reaped.
pub fn exists(pidfd: impl AsFd) -> bool {
    use std::os::fd::AsRawFd;
    let fd = pidfd.as_fd().as_raw_fd();
    // SAFETY: pidfd_send_signal(2) with signal 0, no siginfo and no flags reads nothing
    // from this process's memory; `fd` is a descriptor borrowed for the call.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) == 0
    }
}

/// Whether the process of `pidfd` has ended (its pidfd polls readable then), without
/// waiting.
pub fn ended(pidfd: impl AsFd) -> io::Result<bool> {
    let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let n = poll(&mut fds, Some(&now))?;
    let ready = PollFlags::IN | PollFlags::HUP | PollFlags::ERR;
    Ok(n > 0 && fds[0].revents().intersects(ready))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_known_by_pid_and_start_time() {
        use crate::sandbox::procfs::{is_same_process, start_time};
        let me = std::process::id() as i32;
        let start = start_time(me).unwrap();
        assert!(is_same_process(me, start));
        assert!(!is_same_process(me, start + 1));
        assert!(open_started(me, start).is_some());
        assert!(open_started(me, start + 1).is_none());
        assert!(start_time(-1).is_none());
        assert!(open_started(-1, start).is_none());
    }

    #[test]
    fn a_pidfd_polls_readable_once_its_process_ended() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = open(child.id() as i32).unwrap();
        assert!(!ended(&fd).unwrap());
        signal(&fd, Signal::KILL).unwrap();
        child.wait().unwrap();
        assert!(ended(&fd).unwrap());
        assert!(open(0).is_err());
        assert!(open(-1).is_err());
    }
}
