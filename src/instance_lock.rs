//! One broker per data directory: an exclusive `flock` on `<data dir>/kernel-broker.lock`,
//! held for the life of the process (the kernel releases it when the process ends, however
//! it ends, so a `kill -9` leaves no stale lock). The file names the holder (pid, listen
//! address, start time) so a second broker can say which one is running.
//!
//! Why a lock and not a guess: two brokers on one data directory would sweep each other's
//! kernels, runtime directories and cgroup leaves at start, and write one recording file
//! from two processes (issue 11).

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file's name in the data directory.
pub const LOCK_FILE: &str = "kernel-broker.lock";

/// The held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "the data directory {dir} is in use by another kernel-broker ({holder}); stop it, or give this one another --data-dir"
    )]
    Held { dir: PathBuf, holder: String },
    #[error("could not lock the data directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl InstanceLock {
    /// Take the lock of `data_dir` (which must exist), recording `listen` as this broker's
    /// address.
    pub fn acquire(data_dir: &Path, listen: &str) -> Result<Self, LockError> {
        let io_err = |source| LockError::Io {
            dir: data_dir.to_path_buf(),
            source,
        };
        let path = data_dir.join(LOCK_FILE);
        // Not truncated at open: the holder's details stay readable until we hold the lock.
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err)?;
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io_err(e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim().replace('\n', ", ");
            return Err(LockError::Held {
                dir: data_dir.to_path_buf(),
                holder: if holder.is_empty() {
                    "it has not written its details yet".into()
                } else {
                    holder
                },
            });
        }
        file.set_len(0).map_err(io_err)?;
        file.rewind().map_err(io_err)?;
        let started = chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC");
        write!(
            file,
            "pid {}\nlistening on {listen}\nstarted {started}\n",
            std::process::id()
        )
        .and_then(|()| file.flush())
        .map_err(io_err)?;
        Ok(Self { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_details() {
        let dir = tempfile::tempdir().unwrap();
        let first = InstanceLock::acquire(dir.path(), "127.0.0.1:1111").unwrap();
        // flock locks belong to the open file description: a second open, even in the same
        // process, is refused as another process would be.
        let err = InstanceLock::acquire(dir.path(), "127.0.0.1:2222").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        assert!(text.contains("listening on 127.0.0.1:1111"), "{text}");
        assert!(text.contains("another --data-dir"), "{text}");
        drop(first);
        let again = InstanceLock::acquire(dir.path(), "127.0.0.1:3333").unwrap();
        let content = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert!(content.contains("127.0.0.1:3333"), "{content}");
        assert!(!content.contains("1111"), "{content}");
        drop(again);
    }
}
