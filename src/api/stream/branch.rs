//! Fork, checkpoint, rewind, pause and resume on the agent stream (issues 36 and 37): the
//! frames `fork`, `checkpoint`, `rewind`, `pause` and `resume`, done through the session
//! layer as the REST handlers do them (`api/sessions.rs`, `api/checkpoints.rs`,
//! `api/pause.rs`), answered with one frame tagged with the client's id: `forked`,
//! `checkpoint_taken`, `rewound`, `paused`, `resumed`, or `refused` with the status and
//! error code REST would answer.
//!
//! One such operation runs at a time per connection (a second while one runs is refused at
//! once): a client cannot pile up forks in the broker through one socket.

use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::Outbox;
use crate::api::auth::Caller;
use crate::api::checkpoints::CheckpointJson;
use crate::api::error::ApiError;
use crate::api::pause::PausedJson;
use crate::api::shapes::SessionJson;
use crate::api::AppState;
use crate::session::{CreateOptions, ForkRequest, FrontDoor, Provenance, Session};

/// What a branching frame asks.
pub(super) enum Branch {
    Fork {
        count: Option<u64>,
        checkpoint: Option<String>,
    },
    Checkpoint,
    Rewind {
        checkpoint: String,
    },
    Pause,
    Resume,
}

/// The connection's branching operations: one at a time.
pub(super) struct Brancher {
    state: AppState,
    caller: Caller,
    session: Arc<Session>,
    one: Arc<Semaphore>,
}

impl Brancher {
    pub(super) fn new(state: AppState, caller: Caller, session: Arc<Session>) -> Self {
        Self {
            state,
            caller,
            session,
            one: Arc::new(Semaphore::new(1)),
        }
    }

    /// Starts `op`; its answer frame goes to `out` when it is done.
    pub(super) async fn start(&self, out: &Outbox, id: Value, op: Branch) {
        let Ok(permit) = self.one.clone().try_acquire_owned() else {
            let refused = refused(
                &id,
                &ApiError::new(
                    axum::http::StatusCode::CONFLICT,
                    "busy",
                    "a fork, checkpoint, rewind, pause or resume of this connection is still running; wait for its answer",
                ),
            );
            let _ = out.send(refused).await;
            return;
        };
        let (state, caller, session, out) = (
            self.state.clone(),
            self.caller.clone(),
            self.session.clone(),
            out.clone(),
        );
        tokio::spawn(async move {
            let _permit = permit;
            let frame = match run(&state, &caller, &session, op).await {
                Ok(answer) => with_id(answer, &id),
                Err(e) => refused(&id, &e),
            };
            let _ = out.send(frame).await;
        });
    }
}

fn with_id(mut answer: Value, id: &Value) -> String {
    answer["id"] = id.clone();
    answer.to_string()
}

fn refused(id: &Value, e: &ApiError) -> String {
    json!({"type": "refused", "id": id, "status": e.status.as_u16(), "error": e.code, "message": e.message})
        .to_string()
}

fn checkpoint_id(cp: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(cp.trim()).map_err(|_| {
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "checkpoint_not_found",
            format!("no checkpoint {cp:?} (checkpoint ids are UUIDs)"),
        )
    })
}

async fn run(
    state: &AppState,
    caller: &Caller,
    session: &Session,
    op: Branch,
) -> Result<Value, ApiError> {
    let user = &caller.0.name;
    Ok(match op {
        Branch::Fork { count, checkpoint } => {
            let checkpoint = checkpoint.as_deref().map(checkpoint_id).transpose()?;
            let base = caller.0.create_request(CreateOptions::default());
            let room = crate::api::cluster::quota::room(state, &caller.0).await?;
            let forks = state
                .registry
                .fork(ForkRequest {
                    user: base.user,
                    max_sessions: room.max_sessions(),
                    session: session.id,
                    count: count.unwrap_or(1),
                    checkpoint,
                    provenance: Provenance::new(FrontDoor::Rest),
                })
                .await
                .map_err(|e| room.explain(e))?;
            let sessions: Vec<SessionJson> = forks.iter().map(|s| s.info().into()).collect();
            json!({"type": "forked", "sessions": sessions})
        }
        Branch::Checkpoint => {
            let info = state
                .registry
                .take_checkpoint(user, session.id, caller.0.checkpoints)
                .await?;
            json!({"type": "checkpoint_taken", "checkpoint": CheckpointJson::from(info)})
        }
        Branch::Rewind { checkpoint } => {
            let cp = checkpoint_id(&checkpoint)?;
            let rewound = state.registry.rewind(user, session.id, cp).await?;
            json!({"type": "rewound", "session": SessionJson::from(rewound.info())})
        }
        Branch::Pause => {
            let info = state.registry.pause(user, session.id).await?;
            json!({"type": "paused", "session": PausedJson::new(session.id, info)})
        }
        Branch::Resume => {
            state.registry.resume(user, session.id).await?;
            json!({"type": "resumed", "session": SessionJson::from(session.info())})
        }
    })
}
