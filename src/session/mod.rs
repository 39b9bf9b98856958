//! Sessions: one kernel in a user's sandbox whose state persists between executions.
//!
//! The [`Registry`] owns every live session, enforces ownership (a user sees only its own
//! sessions; another user's session is indistinguishable from a missing one), per-user
//! quotas, and idle expiry. Each [`Session`] is a cheap handle to a task (the session
//! *actor*) that owns the kernel connection and runs executions one at a time, in the order
//! received, with a hard timeout each.
//!
//! Layout (each file uses only those listed before it, so there is no import circle; this
//! file only declares them and re-exports their public types):
//! - `memory`: the memory ledger (each kernel's reservation of its user's total) and
//!   `human_bytes`, which the error messages use.
//! - `execution`: gathering one execution's output under the limits; `lifecycle`: the typed
//!   events reported to the [`Recorder`]; `error`, `config`, `state`: [`SessionError`],
//!   [`SessionConfig`], [`SessionState`] and the [`SessionStatus`] an actor publishes;
//!   `files`: workspace files beneath a descriptor.
//! - `event`: the [`SessionEvent`]s broadcast to clients and their byte budget; `hooks`:
//!   what one execution asks of the kernel's own hooks ([`KernelHooks`]: E2B's result
//!   formats, its own variables); `command`: what a handle asks of its actor
//!   ([`ExecRequest`] among them).
//! - `kept`: the records of sessions kept across restarts (`--keep-sessions`), each
//!   session's written in order through its `RecordFile`.
//! - `handle`: the [`Session`] handle (status, activity, broadcast, command queue);
//!   `recorder`: the [`Recorder`] the layer reports to.
//! - `launch`: a kernel launched in the sandbox and connected (`Live`, `start_kernel`).
//! - `pool`: the warm pool of pre-started kernels (uses `launch` and `memory`).
//! - `actor/`: the task that owns a kernel: commands, restart and death in `mod.rs`, the
//!   execution in flight (deadlines, completion) in `running.rs`.
//! - `registry/`: create (quotas), get (ownership), delete, shutdown; idle expiry and
//!   tombstones in `expiry.rs`; [`Registry::report`] for what happens outside the actor.
//! - `egress`: the egress proxy's reports, recorded through the registry.
//! - `create`: [`CreateRequest`], the one way a front door makes a session
//!   (`Registry::create_session`).
//! - `execute`: [`ExecuteRequest`], the one way a front door runs code (limits checked
//!   once), through `Session::submit` / `Session::run`.
//! - `run_command`: a command run in a session's sandbox beside its kernel
//!   (`Registry::run_command`).
//! - `workspace`: [`Workspace`], a session's files as the front doors reach them (async,
//!   through `files`), from `Registry::workspace`.
//! - `testing/` (tests only): a scripted kernel, a fake sandbox, a sandbox where nothing runs.
//!
//! Locks: a session's status lives in a `tokio::sync::watch` its actor publishes to, so
//! readers (lists, metrics, expiry, WebSocket status) `borrow()` a copy and waiters (the
//! end of an E2B sandbox, the drain) await `changed()` instead of polling; the rest of a
//! handle's mutable state is one std `Mutex` held for a field update, never across an
//! await. The one lock held across awaits is a session's record file, which orders its
//! writes (`kept::RecordFile`).
//!
//! Architecture invariant: this layer never names a sandbox backend (it holds an
//! `Arc<dyn Sandbox>`) and knows nothing of HTTP; the API layer maps [`SessionError`] to
//! status codes.

mod actor;
mod auto_pause;
pub mod carry;
mod checkpoint;
mod clients;
mod command;
mod config;
mod create;
mod egress;
pub mod env_code;
mod error;
mod event;
mod execute;
pub mod execution;
pub mod files;
mod forking;
mod front_door;
mod handle;
mod hooks;
mod kept;
mod launch;
pub mod lifecycle;
mod memory;
mod pause;
mod pool;
mod recorder;
mod registry;
mod run_command;
pub mod secrets;
pub mod snapshot;
mod state;
#[cfg(test)]
pub(crate) mod testing;
mod workspace;

/// The sandbox's plain data the front doors name: who a session is for, and their limits.
pub use crate::sandbox::{KernelLimits, SandboxUser, UserLimits};
pub use checkpoint::{
    CheckpointInfo, CheckpointList, CheckpointPolicy, CheckpointUse, DroppedCheckpoint,
};
pub use clients::ConnectionGuard;
pub use command::{ExecRequest, ReplyRoute};
pub use config::{PoolConfig, SessionConfig, WorkspaceChoice};
pub use create::{CreateRequest, Room};
pub use error::{BoxError, SessionError};
pub use event::SessionEvent;
pub use execute::{ExecuteRequest, ExecutionLimits, Origin, Timeout};
pub use execution::{Execution, ExecutionStatus, OutputEvent};
pub use front_door::{EndedBy, FrontDoor, Metadata, Provenance, SessionEnd};
pub use handle::Session;
pub use hooks::KernelHooks;
pub use kept::SessionRecord;
pub use lifecycle::LifecycleEvent;
pub use memory::{human_bytes, MemoryUse};
pub use pause::{PauseInfo, PausePolicy, DEFAULT_PAUSED_TTL};
pub use recorder::{Direction, NoRecorder, Recorder, Recorders};
pub use registry::{Adopted, Closing, CreateOptions, ForkRequest, Registry, MAX_FORKS};
pub use run_command::{
    check_user_env, CommandControl, CommandExit, CommandRequest, EnvRefused, PtySize, ResizeError,
    RunningCommand,
};
pub use state::{SessionInfo, SessionState, SessionStatus};
pub use workspace::{DiskUsage, Workspace, RECORDED_FILE_MAX};
