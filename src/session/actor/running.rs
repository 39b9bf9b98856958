//! The execution in flight, seen from the actor: sending the queued request to the kernel,
//! gathering the iopub output and replies that belong to it, its deadlines (timeout →
//! interrupt → restart after the grace) and its completion, which needs both the
//! `execute_reply` and the kernel's `status: idle` for it (output on iopub can trail the
//! reply), or the reply and [`IDLE_AFTER_REPLY`] when the idle status never comes.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{record_send, Actor};
use crate::session::execution::Execution;
use crate::session::execution::{failed, Collector, ExecutionError, ExecutionStatus, OutputEvent};
use crate::session::hooks::KernelHooks;
use crate::session::lifecycle::LifecycleEvent;
use crate::session::recorder::Direction;
use crate::wire::{Channel, Message};

pub(super) enum Phase {
    Running,
    /// Past the deadline and interrupted; the kernel is restarted at `restart_at` unless the
    /// execution ends first.
    TimedOut {
        restart_at: Instant,
    },
}

pub(super) struct Running {
    pub(super) msg_id: String,
    pub(super) collector: Collector,
    pub(super) started: Instant,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) phase: Phase,
    pub(super) user_interrupted: bool,
    pub(super) reply_status: Option<String>,
    /// After the reply, how long to wait for the idle status that ends the output.
    pub(super) idle_by: Option<Instant>,
    pub(super) idle_seen: bool,
    pub(super) input_parent: Option<Bytes>,
    pub(super) stream: Option<mpsc::Sender<OutputEvent>>,
    pub(super) done: tokio::sync::oneshot::Sender<Execution>,
    /// Variables were asked for this execution: its reply must acknowledge them.
    pub(super) env_asked: bool,
    /// The code that puts the variables back, sent once the reply has come.
    pub(super) env_restore: Option<String>,
    /// The kernel announced this execution (`execute_input`): ipykernel has put its SIGINT
    /// handler in place by then, and ignores SIGINT before (between messages).
    pub(super) announced: bool,
    /// An interrupt asked before the announcement: sent with it, or at this instant for a
    /// kernel that does not announce it (a silent execution, one waiting in the kernel
    /// behind another client's).
    pub(super) interrupt_by: Option<Instant>,
}

/// How long an interrupt asked before its execution began waits for the kernel to announce
/// it (`Running::interrupt_by`).
pub(super) const INTERRUPT_UNANNOUNCED: Duration = Duration::from_secs(2);

/// What an execution answers when its code could not reach the kernel.
fn not_sent(e: crate::kernel::KernelError) -> Execution {
    failed(
        ExecutionStatus::Dead,
        "KernelDied",
        format!("could not send the code to the kernel: {e}"),
    )
}

/// A silent execution of `code` (no output, no history, no count): the code that sets
/// and puts back an execution's variables in a kernel without the hooks.
fn silent_request(client: &crate::kernel::KernelClient, code: &str) -> Message {
    client.request(
        "execute_request",
        &serde_json::json!({
            "code": code,
            "silent": true,
            "store_history": false,
            "user_expressions": {},
            "allow_stdin": false,
            "stop_on_error": false,
        }),
    )
}

/// How long to wait for the closing idle status after the execute_reply arrived. Output
/// travels on iopub and can lag the reply by seconds after a flood of output.
pub(super) const IDLE_AFTER_REPLY: Duration = Duration::from_secs(10);

impl Actor {
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let r = self.running.as_ref()?;
        let phase_deadline = match r.phase {
            Phase::Running => r.deadline,
            Phase::TimedOut { restart_at } => restart_at,
        };
        Some(
            [r.idle_by, r.interrupt_by]
                .into_iter()
                .flatten()
                .fold(phase_deadline, Instant::min),
        )
    }

    /// Start the next queued execution if the kernel is free.
    pub(super) async fn start_next(&mut self) {
        if self.running.is_some() {
            return;
        }
        // Executions the policy refuses are answered here, and the next one taken.
        let (queued_at, req) = loop {
            let Some((queued_at, req)) = self.queue.pop_front() else {
                return;
            };
            self.session.pending_dec();
            match self.refusal_of(&req) {
                Some(refusal) => {
                    self.record_refusal(None, &refusal);
                    let refused = super::guard::refused_execution(&refusal);
                    // A streaming client sees it as a kernel's error is seen, then the end.
                    if let (Some(tx), Some(e)) = (&req.stream, &refused.error) {
                        let _ = tx.try_send(OutputEvent::Error(e.clone()));
                    }
                    let _ = req.done.send(refused);
                }
                None => break (queued_at, req),
            }
        };
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
        let req_code = self
            .session
            .secrets
            .masker()
            .mask_str(&req.code)
            .into_owned();
        let content = serde_json::json!({
            "code": req.code,
            "silent": false,
            "store_history": true,
            "user_expressions": {},
            "allow_stdin": req.allow_stdin,
            "stop_on_error": true,
        });
        let mut m = k.client.request("execute_request", &content);
        if let Some(hooks) = &req.hooks {
            m.metadata = hooks.metadata();
        }
        // Without the hooks, code of the kernel's language sets the variables first (the
        // kernel runs requests in order) and puts them back after the reply.
        let env_restore = match &req.env_code {
            Some(code) => {
                let set = silent_request(&k.client, &code.set);
                let set_id = set.msg_id.clone();
                if let Err(e) = self.to_shell(&k.client, &set).await {
                    let _ = req.done.send(not_sent(e));
                    return;
                }
                self.remember_agent_id(set_id);
                Some(code.restore.clone())
            }
            None => None,
        };
        let Some(k) = &self.kernel else { return };
        let env_asked =
            env_restore.is_none() && req.hooks.as_ref().is_some_and(|h| !h.env.is_empty());
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
            env_asked,
            env_restore,
            announced: false,
            interrupt_by: None,
        };
        if let Err(e) = self.to_shell(&k.client, &m).await {
            let _ = running.done.send(not_sent(e));
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

    pub(super) fn finish(&mut self, status: ExecutionStatus, note: Option<ExecutionError>) {
        let Some(r) = self.running.take() else { return };
        self.remember_agent_id(r.msg_id.clone());
        let ms = r.started.elapsed().as_secs_f64() * 1000.0;
        let exec = r.collector.finish(status, note, ms);
        if exec.status == ExecutionStatus::Ok {
            self.execution_ok();
        }
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
                output_limit: self.config.output_limit,
                result_limit: self.config.result_limit,
            },
        );
        // Acknowledge only once the recording holds everything up to here.
        let barrier = self.recorder.barrier();
        tokio::spawn(async move {
            barrier.await;
            let _ = r.done.send(exec);
        });
    }

    pub(super) fn on_iopub(&mut self, m: Message) {
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
            if let Some(r) = self.running.as_mut() {
                if m.parent_msg_id.as_deref() == Some(r.msg_id.as_str()) {
                    r.announced = true;
                }
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

    /// An output message over the kernel-message limit, cut by the kernel client (its
    /// content now says so): recorded with an `output_cut` event saying how big it was, and
    /// the execution it belongs to is marked truncated; otherwise it is output like any.
    pub(super) fn on_output_cut(&mut self, m: Message, bytes: u64) {
        self.recorder
            .message(&self.session, Direction::FromKernel, Channel::Iopub, &m);
        self.recorder.event(
            &self.session,
            &LifecycleEvent::OutputCut {
                msg_id: m.msg_id.clone(),
                parent_msg_id: m.parent_msg_id.clone(),
                msg_type: m.msg_type.clone(),
                bytes,
            },
        );
        if let Some(r) = self.running.as_mut() {
            if m.parent_msg_id.as_deref() == Some(r.msg_id.as_str()) {
                r.collector.mark_truncated();
            }
        }
        self.on_iopub(m);
    }

    /// Sends `m` to the kernel's shell, recorded.
    async fn to_shell(
        &self,
        client: &crate::kernel::KernelClient,
        m: &Message,
    ) -> Result<(), crate::kernel::KernelError> {
        record_send(&*self.recorder, &self.session, client, Channel::Shell, m).await
    }

    /// An agent execution's msg_id (its late iopub is still the agent's).
    fn remember_agent_id(&mut self, msg_id: String) {
        if self.recent_agent_ids.len() >= 16 {
            self.recent_agent_ids.pop_front();
        }
        self.recent_agent_ids.push_back(msg_id);
    }

    /// After the reply of an execution whose variables code set: the code that puts them
    /// back, sent silently (a kernel that has gone is restarted without them anyway).
    pub(super) async fn restore_env_if_due(&mut self) {
        let Some(code) = self.env_restore_due.take() else {
            return;
        };
        let Some(k) = &self.kernel else { return };
        let m = silent_request(&k.client, &code);
        let id = m.msg_id.clone();
        if let Err(e) = self.to_shell(&k.client, &m).await {
            tracing::warn!(session = %self.session.id, error = %e, "could not put an execution's variables back");
        }
        self.remember_agent_id(id);
    }

    pub(super) fn on_reply(&mut self, channel: Channel, m: Message) {
        let parent = m.parent_msg_id.clone();
        if let Some(r) = self.running.as_mut() {
            if parent.as_deref() == Some(r.msg_id.as_str()) {
                if channel == Channel::Shell && m.msg_type == "execute_reply" {
                    if r.env_asked && !KernelHooks::env_acknowledged(&m.content) {
                        // A kernel without the hooks ran the code without the variables:
                        // said on stderr, where the client reads output.
                        let note = serde_json::json!({"name": "stderr", "text": ENV_NOT_APPLIED});
                        let note = serde_json::to_vec(&note).unwrap_or_default();
                        if let Some(out) = r.collector.on_iopub("stream", &note) {
                            if let Some(tx) = &r.stream {
                                let _ = tx.try_send(out);
                            }
                        }
                    }
                    let restore = r.env_restore.take();
                    r.reply_status = Some(r.collector.on_reply(&m.content));
                    r.idle_by = Some(Instant::now() + IDLE_AFTER_REPLY);
                    self.env_restore_due = restore;
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
    pub(super) fn check_complete(&mut self) {
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

    pub(super) fn complete(&mut self, reply_status: String) {
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

    /// Interrupts the running execution for a client: at once once the kernel has
    /// announced it, else when it does (`Running::interrupt_by`): an interrupt that reaches
    /// ipykernel before the execution begins is ignored, and the code would run on.
    pub(super) async fn interrupt_execution(
        &mut self,
    ) -> Result<(), crate::session::error::SessionError> {
        if self.kernel.is_some() {
            if let Some(r) = self.running.as_mut().filter(|r| !r.announced) {
                r.interrupt_by
                    .get_or_insert(Instant::now() + INTERRUPT_UNANNOUNCED);
                return Ok(());
            }
        }
        self.interrupt().await
    }

    /// Sends an interrupt held for the execution's announcement, once it has come (or its
    /// wait is over).
    pub(super) async fn interrupt_if_due(&mut self) {
        let Some(r) = self.running.as_mut() else {
            return;
        };
        let due = r
            .interrupt_by
            .is_some_and(|by| r.announced || Instant::now() >= by);
        if due {
            r.interrupt_by = None;
            if let Err(e) = self.interrupt().await {
                tracing::warn!(session = %self.session.id, error = %e, "interrupt failed");
            }
        }
    }

    pub(super) async fn on_deadline(&mut self) {
        self.interrupt_if_due().await;
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
}

/// What an execution's output says when its kernel ran it without the variables asked.
const ENV_NOT_APPLIED: &str = "[kernel-broker: the environment variables for this execution were not applied: this kernel cannot take them (a Java kernel's environment is fixed once the JVM runs; a Python kernel without kernel-broker's execution hooks, or whose code removed them, ignores them)]\n";

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

pub(super) fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{} s", s as u64)
    } else {
        format!("{s:.1} s")
    }
}
