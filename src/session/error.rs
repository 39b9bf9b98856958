//! [`SessionError`]: the session layer's one error type; each message says what the caller
//! can do, and the api layer maps each variant to a status code.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// An error from below the session layer that it passes on with its cause.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
use super::memory::human_bytes;
use crate::kernel::KernelError;
use crate::sandbox::{ExitReason, SandboxError};

/// Errors of the session layer, each with what the caller can do.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no session {0}")]
    NotFound(Uuid),
    #[error(
        "session {id} expired at {at} after {idle_secs} s without activity; create a new session"
    )]
    Expired {
        id: Uuid,
        at: DateTime<Utc>,
        idle_secs: u64,
    },
    /// The user has as many live sessions as they may.
    #[error("user {user} already has {live} sessions (the limit); delete one first")]
    TooManySessions { user: String, live: usize },
    /// The user has as many live sessions as they may, counted on every node.
    #[error(
        "user {user} already has {live} sessions across the cluster (the limit); delete one first"
    )]
    TooManySessionsInCluster { user: String, live: usize },
    /// Cluster mode: the user's sessions on the other nodes could not be counted (the
    /// cluster's database did not answer), so no session is made.
    #[error("the cluster's database does not answer, so your sessions on the other nodes cannot be counted against your quota; try again")]
    ClusterUnavailable,
    /// The user's memory total has no room for the new session's limit.
    #[error(
        "not enough memory left for a new session: {user}'s {sessions} sessions use {} of {} \
         (their memory limits; {} more held by pooled kernels) and this one asks for {}; \
         delete a session or ask for less (memory_limit_bytes)",
        human_bytes(*.used), human_bytes(*.total), human_bytes(*.pooled), human_bytes(*.asked)
    )]
    NoMemoryLeft {
        user: String,
        sessions: usize,
        /// Bytes of the user's sessions' memory limits.
        used: u64,
        /// The user's memory total.
        total: u64,
        /// Bytes held by the user's pooled kernels.
        pooled: u64,
        /// The new session's memory limit.
        asked: u64,
    },
    /// A memory limit outside what the user may ask for.
    #[error(
        "memory_limit_bytes must be between {} and {user}'s memory limit, {} ({total} bytes); \
         {asked} was asked",
        human_bytes(*.min), human_bytes(*.total)
    )]
    InvalidMemoryLimit {
        user: String,
        asked: u64,
        /// The least a session may ask for.
        min: u64,
        /// The user's memory total.
        total: u64,
    },
    /// A session's metadata outside its bounds (see `Metadata::new`).
    #[error("metadata: {0}")]
    InvalidMetadata(String),
    /// The session's execute queue is full.
    #[error(
        "session {session} already has {waiting} executions waiting (the limit); wait for some to finish"
    )]
    ExecutionsWaiting { session: Uuid, waiting: usize },
    /// The session's command queue is full.
    #[error("session {session} has too many requests waiting; wait for some to finish")]
    RequestsWaiting { session: Uuid },
    /// The broker is stopping and starts no kernel.
    #[error("could not start a kernel: the broker is shutting down")]
    ShuttingDown,
    /// The sandbox did not start the kernel in time.
    #[error("could not start a kernel: the sandbox did not start the kernel within {limit:?}")]
    LaunchTimedOut { limit: Duration },
    /// The sandbox refused or failed the launch.
    #[error("could not start a kernel: {source}")]
    LaunchFailed {
        #[source]
        source: SandboxError,
    },
    /// The kernel process ended before it answered.
    #[error("could not start a kernel: {reason} before it was ready")]
    DiedBeforeReady { reason: ExitReason },
    /// The kernel could not be connected to.
    #[error("could not start a kernel: {source}")]
    ConnectFailed {
        #[source]
        source: KernelError,
    },
    /// An interrupt with no kernel running.
    #[error("could not start a kernel: the kernel is not running")]
    KernelNotRunning,
    /// The interrupt signal could not be delivered.
    #[error("could not start a kernel: {source}")]
    InterruptFailed {
        #[source]
        source: SandboxError,
    },
    #[error("unknown kernel {0:?}; see /api/kernelspecs")]
    UnknownKernel(String),
    #[error("session {0} is shutting down")]
    Closed(Uuid),
    /// A client's path that cannot name a workspace file (absolute, `..`, NUL, empty).
    #[error("invalid file path {path:?}: {why}")]
    InvalidPath { path: String, why: &'static str },
    /// Nothing at the path.
    #[error("no file {} in the workspace", path.display())]
    NoSuchFile { path: PathBuf },
    /// The path goes through a symbolic link (the files API follows none).
    #[error(
        "{} leads through a symbolic link; the files API does not follow links",
        path.display()
    )]
    ThroughSymlink { path: PathBuf },
    /// The workspace's disk quota is used up.
    #[error(
        "{} does not fit: the workspace is full (its disk quota is used up)",
        path.display()
    )]
    WorkspaceFull { path: PathBuf },
    /// A directory where a file was meant.
    #[error("{} is a directory", path.display())]
    IsDirectory { path: PathBuf },
    /// A fifo, socket or device where a file was meant.
    #[error("{} is not a regular file", path.display())]
    NotRegularFile { path: PathBuf },
    /// A file where a directory was meant.
    #[error("{} is not a directory", path.display())]
    NotDirectory { path: PathBuf },
    /// A path with no last component to act on.
    #[error("{} names no file", path.display())]
    NamesNoFile { path: PathBuf },
    /// A file larger than the files API serves.
    #[error(
        "{} has {size} bytes, more than the {max} the files API serves",
        path.display()
    )]
    FileTooLarge {
        path: PathBuf,
        size: u64,
        max: usize,
    },
    /// A directory moved into itself.
    #[error("cannot move {} into itself ({})", from.display(), to.display())]
    MoveIntoItself { from: PathBuf, to: PathBuf },
    /// The delete of a directory that is not empty (the API never deletes a tree).
    #[error("{} is a directory that is not empty", path.display())]
    DirectoryNotEmpty { path: PathBuf },
    /// A move onto an existing path (the API never replaces).
    #[error("{} exists already", path.display())]
    DestinationExists { path: PathBuf },
    /// Any other failure of a workspace file operation.
    #[error("could not {op} {}: {source}", path.display())]
    FileIo {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A proposed session id that a session has (live or ended, of any user, here or in
    /// the recordings): ids are never reused, so one recording never holds two sessions.
    #[error("session id {id} is taken (a session id is never reused); propose another id or none")]
    IdTaken { id: Uuid },
    /// Code over the broker's limit for one execution.
    #[error("the code has {bytes} bytes; the limit is {limit}")]
    CodeTooLarge { bytes: usize, limit: usize },
    /// A timeout that is not a positive number of seconds.
    #[error("timeout_seconds must be a positive number")]
    InvalidTimeout { seconds: f64 },
    /// Variables for one execution that a sandbox may not be given.
    #[error("envs: {source}")]
    InvalidEnv {
        #[source]
        source: crate::sandbox::environ::EnvRefused,
    },
    /// The user's workspace could not be found or made (the sandbox's answer).
    #[error("could not reach the workspace of user {user}")]
    WorkspaceUnavailable {
        user: String,
        #[source]
        source: SandboxError,
    },
    /// A command could not be started in the session's sandbox (its message is the
    /// sandbox's, as the client reads it).
    #[error("{source}")]
    CommandNotStarted {
        session: Uuid,
        #[source]
        source: SandboxError,
    },
    /// Work handed to the blocking pool did not finish (it panicked).
    #[error("could not {op}: the task did not finish")]
    TaskFailed {
        op: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// Whether a proposed id is taken could not be told (the recordings could not be read):
    /// refused rather than risk a reuse.
    /// No checkpoint `checkpoint` of this session (never taken, dropped, or ended).
    #[error("session {session} has no checkpoint {checkpoint}")]
    CheckpointNotFound { session: Uuid, checkpoint: Uuid },
    /// A checkpoint or rewind asked while the session's kernel runs code.
    #[error(
        "session {session} is running code: a checkpoint or a rewind happens between \
         executions; wait for the running execution (and those queued) to end, or interrupt \
         it, then ask again"
    )]
    CheckpointBusy { session: Uuid },
    /// A checkpoint was not taken, or a rewind not made; the session goes on as it was.
    #[error("session {session}: the {action} failed: {why}")]
    CheckpointFailed {
        session: Uuid,
        action: &'static str,
        why: String,
        #[source]
        source: Option<BoxError>,
    },
    /// A fork count outside 1 ..= `max`.
    #[error("count must be between 1 and {max}; {asked} was asked")]
    InvalidForkCount { asked: u64, max: u64 },
    /// The session cannot be forked as it is; `why` says what would allow it.
    #[error("session {session} cannot be forked: {why}")]
    ForkRefused { session: Uuid, why: String },
    /// The session's kernel is running code (or has executions queued).
    #[error(
        "session {session} is running code: a fork copies a kernel between executions; wait          for the running execution (and those queued) to end, or interrupt it, then fork"
    )]
    ForkBusy { session: Uuid },
    /// The kernel refused the fork, or answered something the broker does not accept.
    #[error("session {session} was not forked: {why}")]
    ForkFailed {
        session: Uuid,
        why: String,
        #[source]
        source: Option<BoxError>,
    },
    /// A copy of the kernel (a session with a workspace of its own) would leave the broker's
    /// data file system too little room; nothing was made.
    #[error("session {session} was not forked: {why}")]
    NoRoomForCopy { session: Uuid, why: String },
    /// The session cannot be paused as it is; `why` says what would allow it.
    #[error("session {session} cannot be paused: {why}")]
    PauseRefused { session: Uuid, why: String },
    /// A pause asked while the session's kernel runs code (or has executions queued).
    #[error(
        "session {session} is running code: a pause happens between executions; wait for the \
         running execution (and those queued) to end, or interrupt it, then ask again"
    )]
    PauseBusy { session: Uuid },
    /// A pause (the session goes on running as it was) or a resume (the session is dead,
    /// `why` says why) failed.
    #[error("session {session}: the {action} failed: {why}")]
    PauseFailed {
        session: Uuid,
        action: &'static str,
        why: String,
        #[source]
        source: Option<BoxError>,
    },
    /// Cluster mode, paused sessions carried (`--carry-paused`): this node cannot resume
    /// the session now (another node took it over, or the database does not answer).
    #[error("session {session} cannot be resumed here now: {why}")]
    ResumeElsewhere { session: Uuid, why: String },
    /// A pause's images would leave the broker's data file system too little room; the
    /// session goes on running.
    #[error("session {session} was not paused: {why}")]
    NoRoomToPause { session: Uuid, why: String },
    /// No snapshot of this id is the caller's (another user's answers as a missing one).
    #[error("no snapshot {0}")]
    SnapshotNotFound(Uuid),
    /// The user has as many snapshots as they may keep.
    #[error("user {user} already has {max} snapshots (the limit); delete one first")]
    TooManySnapshots { user: String, max: usize },
    /// A snapshot cannot be taken of the session as it is (it runs code, it shares its
    /// user's workspace, the sandbox cannot); `why` says what would allow it.
    #[error("session {session} cannot be snapshotted: {why}")]
    SnapshotRefused { session: Uuid, why: String },
    /// A snapshot asked while the session's kernel runs code (or has executions queued).
    #[error(
        "session {session} is running code: a snapshot is taken between executions; wait for \
         the running execution (and those queued) to end, or interrupt it, then ask again"
    )]
    SnapshotBusy { session: Uuid },
    /// The snapshot's images would leave the broker's data file system too little room.
    #[error("session {session} was not snapshotted: {why}")]
    NoRoomForSnapshot { session: Uuid, why: String },
    /// Taking a snapshot (the session goes on as it was) or starting a session from one
    /// failed; `why` says why.
    #[error("{what} failed: {why}")]
    SnapshotFailed {
        what: String,
        why: String,
        #[source]
        source: Option<BoxError>,
    },
    /// A request that names a snapshot asks for something the snapshot is not.
    #[error("{0}")]
    SnapshotMismatch(String),
    /// The kernel did not answer the fork request in time.
    #[error("session {session} was not forked: its kernel did not answer the fork request within {limit:?}")]
    ForkTimedOut { session: Uuid, limit: Duration },
    #[error("could not check whether session id {id} was used before")]
    IdUnverified {
        id: Uuid,
        #[source]
        source: BoxError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages clients read are what they were when these variants held strings.
    #[test]
    fn messages_read_as_before() {
        let id = Uuid::nil();
        for (e, want) in [
            (
                SessionError::TooManySessions { user: "alice".into(), live: 2 },
                "user alice already has 2 sessions (the limit); delete one first",
            ),
            (
                SessionError::NoMemoryLeft {
                    user: "alice".into(),
                    sessions: 2,
                    used: 768 << 20,
                    total: 768 << 20,
                    pooled: 0,
                    asked: 256 << 20,
                },
                "not enough memory left for a new session: alice's 2 sessions use 768 MiB of 768 MiB \
                 (their memory limits; 0 MiB more held by pooled kernels) and this one asks for 256 MiB; \
                 delete a session or ask for less (memory_limit_bytes)",
            ),
            (
                SessionError::InvalidMemoryLimit {
                    user: "alice".into(),
                    asked: 1,
                    min: 16 << 20,
                    total: 1 << 30,
                },
                "memory_limit_bytes must be between 16 MiB and alice's memory limit, 1024 MiB (1073741824 bytes); 1 was asked",
            ),
            (
                SessionError::ExecutionsWaiting { session: id, waiting: 3 },
                "session 00000000-0000-0000-0000-000000000000 already has 3 executions waiting (the limit); wait for some to finish",
            ),
            (
                SessionError::LaunchTimedOut { limit: Duration::from_secs(2) },
                "could not start a kernel: the sandbox did not start the kernel within 2s",
            ),
            (
                SessionError::InvalidPath {
                    path: "../x".into(),
                    why: "names no file",
                },
                "invalid file path \"../x\": names no file",
            ),
            (
                SessionError::NoSuchFile { path: "a/b".into() },
                "no file a/b in the workspace",
            ),
            (
                SessionError::ThroughSymlink { path: "l/x".into() },
                "l/x leads through a symbolic link; the files API does not follow links",
            ),
            (
                SessionError::FileTooLarge {
                    path: "a".into(),
                    size: 5,
                    max: 3,
                },
                "a has 5 bytes, more than the 3 the files API serves",
            ),
            (
                SessionError::FileIo {
                    op: "read",
                    path: "a".into(),
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                },
                "could not read a: Input/output error (os error 5)",
            ),
            (
                SessionError::KernelNotRunning,
                "could not start a kernel: the kernel is not running",
            ),
        ] {
            assert_eq!(e.to_string(), want);
        }
    }
}
