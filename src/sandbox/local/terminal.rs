//! A pseudo-terminal for a command in the local sandbox (E2B's `pty`): allocated on the
//! host, the master held by the broker, the slave passed to bwrap as the command's stdin,
//! stdout and stderr. Inside, `setsid --ctty` makes the slave the controlling terminal of
//! a session of the command's own (bwrap's `--new-session` already cut it from any
//! terminal of the broker's), so job control and `SIGWINCH` work as on E2B.
//!
//! The slave is opened from the master (`TIOCGPTPEER`), never by a path under `/dev/pts`,
//! and without `O_NOCTTY` never becomes the broker's controlling terminal. The sandbox has
//! a `/dev/pts` of its own (bwrap's `--dev`): a command sees no other terminal, and what
//! it injects into its own (`TIOCSTI`) is read only by its own processes.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{fcntl_setfl, OFlags};
use rustix::pty::{grantpt, ioctl_tiocgptpeer, openpt, unlockpt, OpenptFlags};
use rustix::termios::{tcsetwinsize, Winsize};
use tokio::net::unix::pipe;

use crate::sandbox::command::{PtySize, ResizeError};

/// Where `setsid` is inside the sandbox (the host's `/usr`, bound read-only).
pub(super) const SETSID: &str = "/usr/bin/setsid";

/// A terminal's two ends, before the command starts.
pub(super) struct Terminal {
    master: OwnedFd,
    slave: OwnedFd,
}

/// The broker's end once the command runs: its output, its input, and its size.
pub(super) struct Master {
    pub output: pipe::Receiver,
    pub input: pipe::Sender,
    pub resize: Arc<Resizer>,
}

/// Sets a terminal's size through a master descriptor of its own.
pub(super) struct Resizer(OwnedFd);

impl Resizer {
    pub(super) fn resize(&self, size: PtySize) -> Result<(), ResizeError> {
        set_size(&self.0, size).map_err(|e| ResizeError::Failed(Box::new(e)))
    }
}

fn set_size(fd: impl AsFd, size: PtySize) -> io::Result<()> {
    tcsetwinsize(
        fd,
        Winsize {
            ws_row: size.rows,
            ws_col: size.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok(())
}

impl Terminal {
    /// A new terminal of `size`.
    pub(super) fn open(size: PtySize) -> io::Result<Self> {
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        let slave = ioctl_tiocgptpeer(
            &master,
            OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC,
        )?;
        set_size(&master, size)?;
        Ok(Self { master, slave })
    }

    /// The slave, three times: the command's stdin, stdout and stderr.
    pub(super) fn slave_stdio(&self) -> io::Result<[OwnedFd; 3]> {
        Ok([
            self.slave.try_clone()?,
            self.slave.try_clone()?,
            self.slave.try_clone()?,
        ])
    }

    /// The broker's end, non-blocking, once the command holds the slave (the broker's copy
    /// of the slave is closed here, so the master reads end of file, `EIO`, when the
    /// command's last process lets go of it). Must be called inside the runtime.
    pub(super) fn into_master(self) -> io::Result<Master> {
        drop(self.slave);
        fcntl_setfl(&self.master, OFlags::NONBLOCK)?;
        let input = self.master.try_clone()?;
        let resize = self.master.try_clone()?;
        Ok(Master {
            output: pipe::Receiver::from_owned_fd_unchecked(self.master)?,
            input: pipe::Sender::from_owned_fd_unchecked(input)?,
            resize: Arc::new(Resizer(resize)),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn what_the_master_writes_the_slave_reads_and_the_size_is_set() {
        let t = Terminal::open(PtySize { rows: 24, cols: 80 }).unwrap();
        let [stdin, stdout, _] = t.slave_stdio().unwrap();
        let size = rustix::termios::tcgetwinsize(&stdin).unwrap();
        assert_eq!((size.ws_row, size.ws_col), (24, 80));
        let mut m = t.into_master().unwrap();
        m.resize
            .resize(PtySize {
                rows: 50,
                cols: 132,
            })
            .unwrap();
        let size = rustix::termios::tcgetwinsize(&stdin).unwrap();
        assert_eq!((size.ws_row, size.ws_col), (50, 132));
        std::fs::File::from(stdout).write_all(b"out").unwrap();
        let mut buf = [0u8; 16];
        let n = m.output.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"out");
        m.input.write_all(b"in\n").await.unwrap();
        // The slave's line discipline echoes the input back to the master.
        let n = m.output.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"in"), "{:?}", &buf[..n]);
        drop(stdin);
    }
}
