//! A TCP listener opened inside another process's network namespace: how the egress
//! proxy (`crate::egress`), which runs in the broker, is reached from a sandbox whose only
//! interface is loopback.
//!
//! A socket belongs to the network namespace it was created in, whatever thread later
//! uses it. So a short-lived std thread enters the namespace (`setns`), binds
//! `127.0.0.1:<port>` there and hands the listening socket back; the thread then ends
//! (a thread that entered another namespace must not go back to a pool). The broker's
//! event loop accepts on the socket like on any other. Entering a network namespace needs
//! `CAP_SYS_ADMIN`: the broker runs as root where it runs sandboxes.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;

/// Binds `127.0.0.1:port` in the network namespace of host process `pid`.
pub(crate) async fn listen_in(pid: i32, port: u16) -> io::Result<TcpListener> {
    // Opened here, before the thread, so a failure names the process plainly.
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kb-netns".into())
        .spawn(move || {
            let _ = tx.send(bind_in(&ns, port));
        })?;
    rx.await.unwrap_or_else(|_| {
        Err(io::Error::other(
            "the namespace thread ended without an answer",
        ))
    })
}

fn bind_in(ns: &File, port: u16) -> io::Result<TcpListener> {
    // SAFETY: setns with a descriptor we own and a namespace type; it changes only this
    // thread's network namespace, and this thread ends right after binding.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // A sandbox's network namespace is new: bwrap sets its loopback up in the sandbox's
    // first process, which may still be at it when the broker learns its pid. A bind seen
    // once to fail there with EADDRNOTAVAIL (under load, in CI) is tried again, for a
    // bounded time.
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let deadline = std::time::Instant::now() + LOOPBACK_WAIT;
    let listener = loop {
        match TcpListener::bind(addr) {
            Err(e)
                if e.kind() == io::ErrorKind::AddrNotAvailable
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            bound => break bound?,
        }
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// How long a new namespace's loopback is waited for.
const LOOPBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
