//! The session actor: one task per session that owns the kernel (its process and its
//! client) and the execute queue. Everything that touches the kernel goes through its
//! command channel, so executions run one at a time, in arrival order, and no lock is ever
//! held across an await.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{sleep_until, timeout, Instant};

use super::execution::{failed, Collector, ExecutionError, ExecutionStatus, OutputEvent};
use super::pool::Pool;
use super::{
    Command, Direction, ExecRequest, LifecycleEvent, Recorder, ReplyRoute, Session, SessionError,
    SessionEvent, SessionState,
};
use crate::kernel::{KernelClient, KernelEvent, KernelEvents};
use crate::sandbox::{ExitReason, KernelProcess, LaunchSpec, Sandbox};
use crate::wire::{Channel, Message, Signer};

/// A connected kernel.
pub(crate) struct Live {
    pub client: KernelClient,
    pub events: KernelEvents,
    pub process: Arc<dyn KernelProcess>,
    /// Resolves when the process ends (fed by a watcher task, so `Live` stays `Sync`).
    exit: oneshot::Receiver<ExitReason>,
}

impl Live {
    /// Whether the kernel process has already ended.
    pub fn exited(&mut self) -> bool {
        !matches!(
            self.exit.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        )
    }
}

/// Launch a kernel in the sandbox and connect to it.
pub(crate) async fn start_kernel(
    sandbox: &Arc<dyn Sandbox>,
    spec: LaunchSpec,
    options: crate::kernel::ConnectOptions,
) -> Result<Live, SessionError> {
    let user = spec.user.name.clone();
    let key = spec.key.clone();
    let limit = sandbox.launch_timeout();
    let launched = timeout(limit, sandbox.launch(spec))
        .await
        .map_err(|_| {
            SessionError::KernelUnavailable(format!(
                "the sandbox did not start the kernel within {limit:?}"
            ))
        })?
        .map_err(|e| SessionError::KernelUnavailable(e.to_string()))?;
    let process: Arc<dyn KernelProcess> = Arc::from(launched.process);
    let connect = KernelClient::connect(&launched.endpoints, &key, &user, options, limit);
    // Fail fast if the process dies while we wait for it to become ready.
    let p = process.clone();
    let outcome = tokio::select! {
        r = connect => r.map_err(|e| SessionError::KernelUnavailable(e.to_string())),
        reason = p.wait() => Err(SessionError::KernelUnavailable(format!("{reason} before it was ready"))),
    };
    match outcome {
        Ok((client, events, _info)) => {
            let (tx, exit) = oneshot::channel();
            let p = process.clone();
            tokio::spawn(async move {
                let _ = tx.send(p.wait().await);
            });
            Ok(Live {
                client,
                events,
                process,
                exit,
            })
        }
        Err(e) => {
            process.terminate().await;
            Err(e)
        }
    }
}

enum Phase {
    Running,
    /// Past the deadline: interrupted at `since`, restart at `restart_at`.
    TimedOut {
        restart_at: Instant,
    },
}

struct Running {
    msg_id: String,
    collector: Collector,
    started: Instant,
    deadline: Instant,
    timeout: Duration,
    phase: Phase,
    user_interrupted: bool,
    reply_status: Option<String>,
    /// After the reply, how long to wait for the idle status that ends the output.
    idle_by: Option<Instant>,
    idle_seen: bool,
    input_parent: Option<Bytes>,
    stream: Option<mpsc::Sender<OutputEvent>>,
    done: tokio::sync::oneshot::Sender<super::Execution>,
}

pub(crate) struct Actor {
    pub session: Arc<Session>,
    pub sandbox: Arc<dyn Sandbox>,
    pub config: super::SessionConfig,
    pub commands: mpsc::Receiver<Command>,
    pub kernel: Option<Live>,
    /// Executions waiting for the kernel, with when each arrived.
    pub queue: VecDeque<(Instant, ExecRequest)>,
    running: Option<Running>,
    routes: HashMap<String, ReplyRoute>,
    dead_reason: Option<String>,
    recorder: Arc<dyn Recorder>,
    pool: Arc<Pool>,
    /// The last few agent executions' msg_ids: their late iopub is still theirs.
    recent_agent_ids: VecDeque<String>,
}

/// Record a message, then send it.
async fn record_send(
    recorder: &dyn Recorder,
    session: &Session,
    client: &KernelClient,
    channel: Channel,
    msg: &Message,
) -> Result<(), crate::kernel::KernelError> {
    recorder.message(session, Direction::ToKernel, channel, msg);
    client.send(channel, msg).await
}

/// How long to wait for the closing idle status after the execute_reply arrived. Output
/// travels on iopub and can lag the reply by seconds after a flood of output.
const IDLE_AFTER_REPLY: Duration = Duration::from_secs(10);

// Kernel events are nearly every value; boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
enum FromKernel {
    Event(Option<KernelEvent>),
    Exited(ExitReason),
}

/// The next thing the kernel says or does; pending forever when there is no kernel.
async fn from_kernel(kernel: &mut Option<Live>) -> FromKernel {
    match kernel {
        Some(k) => tokio::select! {
            ev = k.events.recv() => FromKernel::Event(ev),
            reason = &mut k.exit => FromKernel::Exited(
                reason.unwrap_or_else(|_| ExitReason::Lost("the process watcher ended".into())),
            ),
        },
        None => std::future::pending().await,
    }
}

impl Actor {
    pub fn new(
        session: Arc<Session>,
        sandbox: Arc<dyn Sandbox>,
        config: super::SessionConfig,
        commands: mpsc::Receiver<Command>,
        kernel: Live,
        recorder: Arc<dyn Recorder>,
        pool: Arc<Pool>,
    ) -> Self {
        Self {
            session,
            sandbox,
            config,
            commands,
            kernel: Some(kernel),
            queue: VecDeque::new(),
            running: None,
            routes: HashMap::new(),
            dead_reason: None,
            recorder,
            pool,
            recent_agent_ids: VecDeque::new(),
        }
    }

    pub async fn run(mut self) {
        self.session.set_state(SessionState::Idle);
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                cmd = self.commands.recv() => {
                    match cmd {
                        Some(Command::Shutdown { state, done }) => {
                            self.shutdown(state).await;
                            let _ = done.send(());
                            return;
                        }
                        Some(cmd) => self.on_command(cmd).await,
                        None => {
                            self.shutdown(SessionState::Closed).await;
                            return;
                        }
                    }
                }
                k = from_kernel(&mut self.kernel) => match k {
                    FromKernel::Event(Some(ev)) => self.on_kernel_event(ev).await,
                    FromKernel::Event(None) => self.on_death("the connection to the kernel closed".into()).await,
                    FromKernel::Exited(reason) => self.on_death(reason.to_string()).await,
                },
                _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    self.on_deadline().await;
                }
            }
            self.start_next().await;
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let r = self.running.as_ref()?;
        let phase_deadline = match r.phase {
            Phase::Running => r.deadline,
            Phase::TimedOut { restart_at } => restart_at,
        };
        Some(match r.idle_by {
            Some(idle_by) => idle_by.min(phase_deadline),
            None => phase_deadline,
        })
    }

    async fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Execute(req) => {
                self.session.touch();
                if let Some(reason) = &self.dead_reason {
                    self.session.pending_dec();
                    let _ = req.done.send(failed(
                        ExecutionStatus::Dead,
                        "KernelDied",
                        format!("the session's kernel is dead ({reason}); restart the session to continue"),
                    ));
                } else {
                    self.queue.push_back((Instant::now(), req));
                }
            }
            Command::InputReply(value) => {
                self.session.touch();
                let Some(r) = self.running.as_mut() else {
                    return;
                };
                let Some(parent) = r.input_parent.take() else {
                    return;
                };
                if let Some(k) = &self.kernel {
                    let m = k.client.reply_to(
                        "input_reply",
                        &serde_json::json!({"value": value}),
                        &parent,
                    );
                    if let Err(e) = record_send(
                        &*self.recorder,
                        &self.session,
                        &k.client,
                        Channel::Stdin,
                        &m,
                    )
                    .await
                    {
                        tracing::warn!(session = %self.session.id, error = %e, "input_reply not sent");
                    }
                }
            }
            Command::Interrupt(done) => {
                self.session.touch();
                self.recorder
                    .event(&self.session, &LifecycleEvent::Interrupt);
                let result = self.interrupt().await;
                if let Some(r) = self.running.as_mut() {
                    r.user_interrupted = true;
                }
                let _ = done.send(result);
            }
            Command::Restart(done) => {
                self.session.touch();
                let result = self
                    .restart(
                        ExecutionStatus::Interrupted,
                        "the kernel was restarted by request",
                    )
                    .await;
                let _ = done.send(result);
            }
            Command::Forward {
                channel,
                msg,
                route,
            } => {
                self.session.touch();
                let Some(k) = &self.kernel else { return };
                if self.routes.len() > 10_000 {
                    // Requests whose replies never came; forget the oldest half at random.
                    let keys: Vec<String> = self.routes.keys().take(5_000).cloned().collect();
                    for key in keys {
                        self.routes.remove(&key);
                    }
                }
                self.routes.insert(msg.msg_id.clone(), route);
                if let Err(e) =
                    record_send(&*self.recorder, &self.session, &k.client, channel, &msg).await
                {
                    tracing::warn!(session = %self.session.id, error = %e, "forward to kernel failed");
                }
            }
            Command::Shutdown { .. } => {}
        }
    }

    async fn interrupt(&mut self) -> Result<(), SessionError> {
        let Some(k) = &self.kernel else {
            return Err(SessionError::KernelUnavailable(
                "the kernel is not running".into(),
            ));
        };
        let m = k
            .client
            .request("interrupt_request", &serde_json::json!({}));
        if record_send(
            &*self.recorder,
            &self.session,
            &k.client,
            Channel::Control,
            &m,
        )
        .await
        .is_err()
        {
            // The control channel is gone; fall back to the signal.
            k.process
                .interrupt()
                .await
                .map_err(|e| SessionError::KernelUnavailable(e.to_string()))?;
        }
        Ok(())
    }

    /// Start the next queued execution if the kernel is free.
    async fn start_next(&mut self) {
        if self.running.is_some() {
            return;
        }
        let Some((queued_at, req)) = self.queue.pop_front() else {
            return;
        };
        self.session.pending_dec();
        let Some(k) = &self.kernel else {
            let reason = self
                .dead_reason
                .clone()
                .unwrap_or_else(|| "no kernel".into());
            let _ = req
                .done
                .send(failed(ExecutionStatus::Dead, "KernelDied", reason));
            return;
        };
        let req_code = req.code.clone();
        let content = serde_json::json!({
            "code": req.code,
            "silent": false,
            "store_history": true,
            "user_expressions": {},
            "allow_stdin": req.allow_stdin,
            "stop_on_error": true,
        });
        let m = k.client.request("execute_request", &content);
        let now = Instant::now();
        let running = Running {
            msg_id: m.msg_id.clone(),
            collector: Collector::new(self.config.output_limit, self.config.result_limit),
            started: now,
            deadline: now + req.timeout,
            timeout: req.timeout,
            phase: Phase::Running,
            user_interrupted: false,
            reply_status: None,
            idle_by: None,
            idle_seen: false,
            input_parent: None,
            stream: req.stream,
            done: req.done,
        };
        if let Err(e) = record_send(
            &*self.recorder,
            &self.session,
            &k.client,
            Channel::Shell,
            &m,
        )
        .await
        {
            let _ = running.done.send(failed(
                ExecutionStatus::Dead,
                "KernelDied",
                format!("could not send the code to the kernel: {e}"),
            ));
            return;
        }
        self.recorder.event(
            &self.session,
            &LifecycleEvent::ExecutionStarted {
                msg_id: running.msg_id.clone(),
                code: req_code,
                timeout_seconds: running.timeout.as_secs_f64(),
                queue_wait_seconds: now.saturating_duration_since(queued_at).as_secs_f64(),
            },
        );
        self.session.set_busy(true);
        self.running = Some(running);
    }

    fn finish(&mut self, status: ExecutionStatus, note: Option<ExecutionError>) {
        let Some(r) = self.running.take() else { return };
        if self.recent_agent_ids.len() >= 16 {
            self.recent_agent_ids.pop_front();
        }
        self.recent_agent_ids.push_back(r.msg_id.clone());
        let ms = r.started.elapsed().as_secs_f64() * 1000.0;
        let exec = r.collector.finish(status, note, ms);
        if let Some(n) = exec.execution_count {
            self.session.set_execution_count(n);
        }
        self.session.set_busy(false);
        self.session.touch();
        self.recorder.event(
            &self.session,
            &LifecycleEvent::ExecutionDone {
                msg_id: r.msg_id.clone(),
                execution: exec.clone(),
            },
        );
        // Acknowledge only once the recording holds everything up to here.
        let barrier = self.recorder.barrier();
        tokio::spawn(async move {
            barrier.await;
            let _ = r.done.send(exec);
        });
    }

    async fn on_kernel_event(&mut self, ev: KernelEvent) {
        if let KernelEvent::Message(channel, m) = &ev {
            self.recorder
                .message(&self.session, Direction::FromKernel, *channel, m);
        }
        match ev {
            KernelEvent::Message(Channel::Iopub, m) => self.on_iopub(m),
            KernelEvent::Message(channel, m) => self.on_reply(channel, m),
            KernelEvent::HeartbeatLost { misses } => {
                self.on_death(format!(
                    "the kernel stopped answering its heartbeat ({misses} misses)"
                ))
                .await
            }
            KernelEvent::ChannelFailed(ch, why) => {
                // A kernel that died (out of memory, say) also ends its connections, often
                // first: give the process a moment so the reason names the cause.
                let exited = match &self.kernel {
                    Some(k) => timeout(Duration::from_millis(500), k.process.wait())
                        .await
                        .ok(),
                    None => None,
                };
                let reason = match exited {
                    Some(exit) if exit != ExitReason::Terminated => exit.to_string(),
                    _ => format!("the kernel's {} channel failed: {why}", ch.as_str()),
                };
                self.on_death(reason).await
            }
        }
    }

    fn on_iopub(&mut self, m: Message) {
        let m = Arc::new(m);
        if m.msg_type == "status" {
            #[derive(serde::Deserialize)]
            struct Status<'a> {
                execution_state: &'a str,
            }
            if let Ok(s) = serde_json::from_slice::<Status>(&m.content) {
                let ours = self
                    .running
                    .as_ref()
                    .is_some_and(|r| m.parent_msg_id.as_deref() == Some(r.msg_id.as_str()));
                if ours && s.execution_state == "idle" {
                    if let Some(r) = self.running.as_mut() {
                        r.idle_seen = true;
                    }
                } else if self.running.is_none() && parent_is_execution(&m) {
                    // Only executions (a notebook's, on the same kernel) make the session
                    // busy: not kernel_info, completion or inspection requests.
                    match s.execution_state {
                        "busy" => self.session.set_kernel_busy(true),
                        "idle" => self.session.set_kernel_busy(false),
                        _ => {}
                    }
                }
            }
        } else if m.msg_type == "execute_input" {
            // Every execution (a notebook's too) announces its count here.
            #[derive(serde::Deserialize)]
            struct Input {
                execution_count: Option<u64>,
            }
            if let Ok(Input {
                execution_count: Some(n),
            }) = serde_json::from_slice(&m.content)
            {
                self.session.set_execution_count(n);
            }
        } else if let Some(r) = self.running.as_mut() {
            if m.parent_msg_id.as_deref() == Some(r.msg_id.as_str()) {
                if let Some(out) = r.collector.on_iopub(&m.msg_type, &m.content) {
                    if let Some(tx) = &r.stream {
                        // Never wait on a client: a full queue drops the streamed copy
                        // (the final Execution still has the output).
                        let _ = tx.try_send(out);
                    }
                }
            }
        }
        let agent = m.parent_msg_id.as_deref().is_some_and(|p| {
            self.running.as_ref().is_some_and(|r| r.msg_id == p)
                || self.recent_agent_ids.iter().any(|id| id == p)
        });
        self.session.publish_iopub(m, agent);
        self.check_complete();
    }

    fn on_reply(&mut self, channel: Channel, m: Message) {
        let parent = m.parent_msg_id.clone();
        if let Some(r) = self.running.as_mut() {
            if parent.as_deref() == Some(r.msg_id.as_str()) {
                if channel == Channel::Shell && m.msg_type == "execute_reply" {
                    r.reply_status = Some(r.collector.on_reply(&m.content));
                    r.idle_by = Some(Instant::now() + IDLE_AFTER_REPLY);
                    self.check_complete();
                    return;
                }
                if channel == Channel::Stdin && m.msg_type == "input_request" {
                    #[derive(serde::Deserialize)]
                    struct Input {
                        #[serde(default)]
                        prompt: String,
                        #[serde(default)]
                        password: bool,
                    }
                    let input: Input = m.parse_content().unwrap_or(Input {
                        prompt: String::new(),
                        password: false,
                    });
                    r.input_parent = Some(m.header.clone());
                    if let Some(tx) = &r.stream {
                        let _ = tx.try_send(OutputEvent::InputRequest {
                            prompt: input.prompt,
                            password: input.password,
                        });
                    }
                    return;
                }
            }
        }
        if let Some(p) = parent {
            if let Some(route) = self.routes.get(&p) {
                if route.try_send((channel, Arc::new(m))).is_err() {
                    tracing::debug!(session = %self.session.id, "a client's reply queue is full or closed");
                }
                return;
            }
        }
        tracing::debug!(session = %self.session.id, msg_type = %m.msg_type, "unrouted reply");
    }

    /// An execution is complete when its reply and its idle status have arrived.
    fn check_complete(&mut self) {
        let Some(r) = self.running.as_ref() else {
            return;
        };
        let Some(status) = r.reply_status.clone() else {
            return;
        };
        if !r.idle_seen {
            return;
        }
        self.complete(status);
    }

    fn complete(&mut self, reply_status: String) {
        let Some(r) = self.running.as_ref() else {
            return;
        };
        let (status, note) = match r.phase {
            Phase::TimedOut { .. } => (
                ExecutionStatus::Timeout,
                Some(ExecutionError {
                    ename: "TimeoutError".into(),
                    evalue: format!(
                        "the execution ran past its limit of {} and was interrupted; the kernel and its variables are kept",
                        secs(r.timeout)
                    ),
                    traceback: Vec::new(),
                }),
            ),
            Phase::Running => match reply_status.as_str() {
                "ok" => (ExecutionStatus::Ok, None),
                _ if r.user_interrupted
                    && r.collector.error().is_some_and(|e| e.ename == "KeyboardInterrupt") =>
                {
                    (ExecutionStatus::Interrupted, None)
                }
                "aborted" => (
                    ExecutionStatus::Error,
                    Some(ExecutionError {
                        ename: "Aborted".into(),
                        evalue: "the kernel aborted this execution".into(),
                        traceback: Vec::new(),
                    }),
                ),
                _ => (ExecutionStatus::Error, None),
            },
        };
        self.finish(status, note);
    }

    async fn on_deadline(&mut self) {
        let now = Instant::now();
        let Some(r) = self.running.as_mut() else {
            return;
        };
        if let Some(idle_by) = r.idle_by {
            if now >= idle_by {
                // The reply came but the idle status was lost; finish with what we have.
                let status = r.reply_status.clone().unwrap_or_default();
                self.complete(status);
                return;
            }
        }
        match r.phase {
            Phase::Running if now >= r.deadline => {
                r.phase = Phase::TimedOut {
                    restart_at: now + self.config.interrupt_grace,
                };
                tracing::info!(session = %self.session.id, "execution timed out; interrupting");
                self.recorder.event(
                    &self.session,
                    &LifecycleEvent::ExecutionTimeout {
                        msg_id: r.msg_id.clone(),
                        timeout_seconds: r.timeout.as_secs_f64(),
                    },
                );
                if let Err(e) = self.interrupt().await {
                    tracing::warn!(session = %self.session.id, error = %e, "interrupt failed");
                }
            }
            Phase::TimedOut { restart_at } if now >= restart_at => {
                let t = secs(r.timeout);
                let grace = secs(self.config.interrupt_grace);
                tracing::warn!(session = %self.session.id, "kernel ignored the interrupt; restarting");
                let msg = format!(
                    "the execution ran past its limit of {t} and did not stop within {grace} of the interrupt, so the kernel was restarted: its variables are lost"
                );
                if let Err(e) = self.restart(ExecutionStatus::Timeout, &msg).await {
                    tracing::warn!(session = %self.session.id, error = %e, "restart after timeout failed");
                }
            }
            _ => {}
        }
    }

    /// Replace the kernel with a fresh one; the running execution ends with `status`.
    async fn restart(&mut self, status: ExecutionStatus, why: &str) -> Result<(), SessionError> {
        let ename = if status == ExecutionStatus::Timeout {
            "TimeoutError"
        } else {
            "KernelRestarted"
        };
        self.finish(
            status,
            Some(ExecutionError {
                ename: ename.into(),
                evalue: why.to_string(),
                traceback: Vec::new(),
            }),
        );
        self.recorder.event(
            &self.session,
            &LifecycleEvent::KernelRestarted {
                reason: why.to_string(),
            },
        );
        self.session.set_state(SessionState::Starting);
        self.session.publish(SessionEvent::Restarted);
        if let Some(old) = self.kernel.take() {
            old.process.terminate().await;
        }
        self.routes.clear();
        let asked = Instant::now();
        let started = match self
            .pool
            .take(&self.session.user, &self.session.kernel_name)
        {
            Some((_, live)) => Ok((live, true)),
            None => {
                let spec = self.session.launch_spec(Signer::random_key());
                start_kernel(&self.sandbox, spec, self.config.kernel)
                    .await
                    .map(|live| (live, false))
            }
        };
        match started {
            Ok((live, pooled)) => {
                self.recorder.event(
                    &self.session,
                    &LifecycleEvent::KernelStarted {
                        startup_seconds: asked.elapsed().as_secs_f64(),
                        pooled,
                    },
                );
                self.kernel = Some(live);
                self.dead_reason = None;
                self.session.reset_execution_count();
                self.session.set_state(SessionState::Idle);
                Ok(())
            }
            Err(e) => {
                let reason = format!("the restart failed: {e}");
                self.mark_dead(reason);
                Err(e)
            }
        }
    }

    fn mark_dead(&mut self, reason: String) {
        tracing::warn!(session = %self.session.id, %reason, "session is dead");
        self.recorder.event(
            &self.session,
            &LifecycleEvent::KernelDied {
                reason: reason.clone(),
            },
        );
        self.dead_reason = Some(reason.clone());
        self.session.set_dead(reason.clone());
        for (_, req) in self.queue.drain(..) {
            self.session.pending_dec();
            let _ = req.done.send(failed(
                ExecutionStatus::Dead,
                "KernelDied",
                format!("the session's kernel is dead ({reason}); restart the session to continue"),
            ));
        }
    }

    async fn on_death(&mut self, reason: String) {
        let Some(k) = self.kernel.take() else { return };
        k.process.terminate().await;
        self.finish(
            ExecutionStatus::Dead,
            Some(ExecutionError {
                ename: "KernelDied".into(),
                evalue: format!("{reason}; the session is dead: restart it to continue"),
                traceback: Vec::new(),
            }),
        );
        self.mark_dead(reason);
    }

    async fn shutdown(&mut self, state: SessionState) {
        let why = match state {
            SessionState::Expired => "the session expired",
            _ => "the session was shut down",
        };
        let note = ExecutionError {
            ename: "SessionClosed".into(),
            evalue: why.into(),
            traceback: Vec::new(),
        };
        self.finish(ExecutionStatus::Dead, Some(note));
        for (_, req) in self.queue.drain(..) {
            self.session.pending_dec();
            let _ = req
                .done
                .send(failed(ExecutionStatus::Dead, "SessionClosed", why.into()));
        }
        if let Some(k) = self.kernel.take() {
            // Ask politely first so the kernel can clean up, then make sure.
            let m = k
                .client
                .request("shutdown_request", &serde_json::json!({"restart": false}));
            let _ = record_send(
                &*self.recorder,
                &self.session,
                &k.client,
                Channel::Control,
                &m,
            )
            .await;
            let _ = timeout(Duration::from_millis(500), k.process.wait()).await;
            k.process.terminate().await;
        }
        self.session.set_state(state);
        let kind = if state == SessionState::Expired {
            LifecycleEvent::SessionExpired
        } else {
            LifecycleEvent::SessionClosed
        };
        self.recorder.event(&self.session, &kind);
    }
}

/// Whether a message answers an `execute_request`.
fn parent_is_execution(m: &Message) -> bool {
    #[derive(serde::Deserialize)]
    struct Parent<'a> {
        #[serde(borrow, default)]
        msg_type: &'a str,
    }
    serde_json::from_slice::<Parent>(&m.parent_header)
        .is_ok_and(|p| p.msg_type == "execute_request")
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{} s", s as u64)
    } else {
        format!("{s:.1} s")
    }
}
