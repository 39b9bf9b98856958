//! Why a launch failed, as [`super::SandboxError::Launch`] and
//! [`super::SandboxError::LaunchFailed`] carry it: a [`LaunchRefusal`] when nothing else
//! went wrong (the request or the sandbox's state rules the launch out), or a
//! [`StepFailed`] naming the step whose own error is kept as the source.

use std::borrow::Cow;
use std::path::PathBuf;

use uuid::Uuid;

/// A launch ruled out by what was asked or by the sandbox's state, with no error beneath.
#[derive(Debug, thiserror::Error)]
pub enum LaunchRefusal {
    #[error("the command is empty")]
    EmptyCommand,
    #[error("session {0} already has a kernel")]
    SessionHasKernel(Uuid),
    #[error("the user name {0:?} is not usable as a directory name")]
    UserNameNotADirectory(String),
    #[error(
        "the user name {0:?} is not usable in a container name (letters, digits, `_`, `.`, `-`)"
    )]
    UserNameNotAContainer(String),
    #[error("uid_base + user index overflows a uid")]
    UidOverflow,
    #[error("no kernel spec named {name:?} in {dir} (found: {found})", dir = dir.display())]
    UnknownKernel {
        name: String,
        dir: PathBuf,
        /// The specs that are there, comma-separated.
        found: String,
    },
    #[error("the docker sandbox offers no kernel {0:?} (its kernels are python3 and the specs of the kernels directory)")]
    KernelNotInImage(String),
    #[error("the broker is shutting down")]
    ShuttingDown,
    #[error("the user's container is not running (no session)")]
    NoContainer,
    #[error("the command's exec did not attach")]
    ExecNotAttached,
    #[error("the command's standard streams are missing")]
    NoStandardStreams,
    /// The backend does not do this at all.
    #[error("the {backend} sandbox cannot run {what}")]
    CannotRun {
        backend: &'static str,
        what: &'static str,
    },
}

/// A launch step that failed with an error of its own.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct StepFailed {
    /// What was being done, e.g. "preparing files failed", "cannot start /usr/bin/bwrap".
    pub step: Cow<'static, str>,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}
