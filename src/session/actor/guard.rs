//! What stands between a session's kernel and everyone else (issue 39), both ways:
//!
//! - Every message from the kernel is masked ([`crate::secrets`]) before the actor does
//!   anything with it: the recording, the execution's result, the broadcast to clients and
//!   the Jupyter routes all see the masked message only. `stream` chunks pass through the
//!   session's [`StreamHold`], so a value split between two chunks is masked whole.
//! - Every execution a client sends (an agent's through any front door, a Jupyter client's
//!   `execute_request`) is checked against the operator's pre-execution policy
//!   ([`crate::policy`]) before it reaches the kernel; a refusal answers as the kernel
//!   answers an error (`PolicyViolation`, naming the rule) and is recorded.

use std::sync::Arc;

use super::{Actor, Direction, ReplyRoute};
use crate::policy::Refusal;
use crate::secrets::stream::mask_message;
use crate::session::lifecycle::LifecycleEvent;
use crate::wire::{Channel, Message};

/// The `ename` of a refused execution.
pub const POLICY_VIOLATION: &str = "PolicyViolation";

impl Actor {
    /// The kernel's message `m` on `channel`, masked: the messages to handle in its place,
    /// in order (held stream text first, as iopub).
    pub(super) fn masked(&mut self, channel: Channel, m: Message) -> Vec<(Channel, Message)> {
        let masker = self.session.secrets.masker();
        if channel == Channel::Iopub {
            return self
                .hold
                .on_message(&masker, m)
                .into_iter()
                .map(|m| (Channel::Iopub, m))
                .collect();
        }
        // An `input()` prompt shows what the execution printed before. Not its reply: that
        // comes on the shell socket and can overtake the execution's last output on IOPub
        // (ipykernel's IOPub thread sends it), and released there, a held start of a value
        // would go out before the rest of it, each piece masked alone. Held text goes out
        // at the IOPub `status: idle`, which follows all of the execution's output.
        let ends = m.msg_type == "input_request";
        let held = match ends {
            true => self.hold.flush(m.parent_msg_id.as_deref()),
            false => Vec::new(),
        };
        let mut out: Vec<(Channel, Message)> =
            held.into_iter().map(|m| (Channel::Iopub, m)).collect();
        out.push((channel, mask_message(&masker, m)));
        out
    }

    /// An output message the kernel client cut (`bytes` long), masked; a cut stream after
    /// what was held of its execution's streams.
    pub(super) fn on_cut(&mut self, m: Message, bytes: u64) {
        let masker = self.session.secrets.masker();
        let held = match m.msg_type == "stream" {
            true => self.hold.flush(m.parent_msg_id.as_deref()),
            false => Vec::new(),
        };
        for held in held {
            self.recorder
                .message(&self.session, Direction::FromKernel, Channel::Iopub, &held);
            self.on_iopub(held);
        }
        self.on_output_cut(mask_message(&masker, m), bytes);
    }

    /// What the policy says of `code` in this session.
    pub(super) fn refusal(&self, code: &str) -> Option<Refusal> {
        if self.config.policy.is_empty() {
            return None;
        }
        let language = self
            .config
            .languages
            .get(&self.session.kernel_name)
            .map_or("python", String::as_str);
        self.config
            .policy
            .check(&self.session.user.name, language, code)
            .err()
    }

    /// What the policy says of a queued execution (the broker's own code is not checked).
    pub(super) fn refusal_of(&self, req: &crate::session::command::ExecRequest) -> Option<Refusal> {
        req.checked.then(|| self.refusal(&req.code)).flatten()
    }

    /// Records a refusal (`msg_id`: a Jupyter client's request).
    pub(super) fn record_refusal(&self, msg_id: Option<String>, refusal: &Refusal) {
        let masker = self.session.secrets.masker();
        self.recorder.event(
            &self.session,
            &LifecycleEvent::ExecutionRefused {
                msg_id,
                rule: refusal.rule.clone(),
                what: masker.mask_str(&refusal.to_string()).into_owned(),
            },
        );
    }

    /// A Jupyter client's `execute_request` the policy refused, answered as a kernel
    /// answers an error: `busy`, the `error`, `idle` on iopub, and an `execute_reply` with
    /// status `error` on the client's route. Nothing reaches the kernel.
    pub(super) fn refuse_forward(
        &mut self,
        request: &Message,
        route: &ReplyRoute,
        refusal: &Refusal,
    ) {
        self.record_refusal(Some(request.msg_id.clone()), refusal);
        let text = refusal.to_string();
        let count = self.session.status().execution_count;
        let error = serde_json::json!({
            "ename": POLICY_VIOLATION,
            "evalue": text,
            "traceback": [format!("{POLICY_VIOLATION}: {text}")],
        });
        let reply = |msg_type: &str, content: serde_json::Value| {
            Message::new(
                msg_type,
                &content,
                Some(&request.header),
                "kernel-broker",
                "kernel-broker",
            )
        };
        for m in [
            reply("status", serde_json::json!({"execution_state": "busy"})),
            reply("error", error.clone()),
            reply("status", serde_json::json!({"execution_state": "idle"})),
        ] {
            self.session.publish_iopub(Arc::new(m), false);
        }
        let mut content = error;
        content["status"] = "error".into();
        content["execution_count"] = count.into();
        let _ = route.try_send((Channel::Shell, Arc::new(reply("execute_reply", content))));
    }
}

/// The answer to an agent's execution the policy refused: an error, as a kernel's, with
/// the refusal's words as its traceback too.
pub(super) fn refused_execution(refusal: &Refusal) -> crate::session::execution::Execution {
    let text = refusal.to_string();
    let mut e = crate::session::execution::failed(
        crate::session::execution::ExecutionStatus::Error,
        POLICY_VIOLATION,
        text.clone(),
    );
    if let Some(err) = e.error.as_mut() {
        err.traceback = vec![format!("{POLICY_VIOLATION}: {text}")];
    }
    e
}

/// The code of a client's `execute_request` (none for any other message).
pub(super) fn code_of(channel: Channel, m: &Message) -> Option<String> {
    if channel != Channel::Shell || m.msg_type != "execute_request" {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Request {
        #[serde(default)]
        code: String,
    }
    Some(
        m.parse_content::<Request>()
            .map(|r| r.code)
            .unwrap_or_default(),
    )
}
