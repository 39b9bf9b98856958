//! What the writer adds to the search index (`search_text`) and to a session's row as the
//! reports go by: per execution its code (the `execute_request`), what it printed and
//! returned (stream text, the `text/plain` of results and displays) and its error (name,
//! value and traceback without ANSI escapes); per session how many executions failed.
//! Pure: it says what to write, the writer writes it.
//!
//! Bounded: a kernel's output is hostile and can be endless, so an execution's output text
//! is kept to its first [`HEAD_BYTES`] and its last [`TAIL_BYTES`] (the middle elided) and
//! written as one row when the execution goes idle (or another execution of the session
//! starts printing, or the session ends); an error's text to [`ERROR_BYTES`]. What is held
//! meanwhile is at most one execution's head and tail per session.

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

use crate::recording::db::IndexText;
use crate::recording::event::BrokerEvent;
use crate::recording::search::MatchField;
use crate::recording::stored::{StoredEvent, StoredStatus};
use crate::session::execution::strip_ansi;
use crate::session::Direction;
use crate::wire::{Channel, Message};

/// An execution's output text kept from its start, in bytes.
pub(super) const HEAD_BYTES: usize = 32 << 10;
/// An execution's output text kept from its end, in bytes.
pub(super) const TAIL_BYTES: usize = 32 << 10;
/// An error's text (name, value, traceback), or an execution's code, in bytes.
pub(super) const ERROR_BYTES: usize = 16 << 10;
/// Code indexed per execution, in bytes.
pub(super) const CODE_BYTES: usize = 64 << 10;
/// Agent executions remembered per session, so their late replies are not counted twice.
const AGENT_IDS: usize = 16;

/// What one report adds.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Noted {
    pub texts: Vec<IndexText>,
    /// Executions that ended in an error, a timeout, or with a dead kernel.
    pub errors: i64,
}

/// A result or display, as far as the index reads it.
#[derive(Default, serde::Deserialize)]
struct Shown {
    #[serde(default)]
    data: ShownData,
}

#[derive(Default, serde::Deserialize)]
struct ShownData {
    #[serde(rename = "text/plain", default)]
    plain: Option<Value>,
}

/// The output of the execution a session is printing.
struct Output {
    parent: String,
    seq: i64,
    head: String,
    tail: String,
    /// Bytes that fit neither the head nor what the tail keeps.
    elided: bool,
}

impl Output {
    fn push(&mut self, text: &str) {
        let room = HEAD_BYTES.saturating_sub(self.head.len());
        if self.tail.is_empty() && text.len() <= room {
            self.head.push_str(text);
            return;
        }
        let cut = text.floor_char_boundary(room);
        if self.tail.is_empty() {
            self.head.push_str(&text[..cut]);
        }
        let rest = if self.tail.is_empty() {
            &text[cut..]
        } else {
            text
        };
        // Only the last TAIL_BYTES of what is pushed can be kept.
        let from = rest.ceil_char_boundary(rest.len().saturating_sub(TAIL_BYTES));
        if from > 0 {
            self.elided = true;
        }
        self.tail.push_str(&rest[from..]);
        if self.tail.len() > 2 * TAIL_BYTES {
            self.trim_tail();
        }
    }

    fn trim_tail(&mut self) {
        if self.tail.len() > TAIL_BYTES {
            let from = self.tail.ceil_char_boundary(self.tail.len() - TAIL_BYTES);
            self.tail.drain(..from);
            self.elided = true;
        }
    }

    fn finish(mut self, sid: i64) -> Option<IndexText> {
        self.trim_tail();
        let mut text = self.head;
        if !self.tail.is_empty() {
            text.push_str(if self.elided { "\n[…]\n" } else { "" });
            text.push_str(&self.tail);
        }
        (!text.trim().is_empty()).then_some(IndexText {
            sid,
            seq: self.seq,
            field: MatchField::Output,
            text,
        })
    }
}

fn capped(mut s: String, max: usize) -> String {
    s.truncate(s.floor_char_boundary(max));
    s
}

/// The index being built, across batches.
#[derive(Default)]
pub(super) struct SearchIndex {
    output: HashMap<i64, Output>,
    agent_ids: HashMap<i64, VecDeque<String>>,
}

impl SearchIndex {
    /// A recorded message of session row `sid`, stored as event `seq`.
    pub fn message(
        &mut self,
        sid: i64,
        seq: i64,
        direction: Direction,
        channel: Channel,
        msg: &Message,
    ) -> Noted {
        let mut noted = Noted::default();
        let content = || serde_json::from_slice::<Value>(&msg.content).unwrap_or_default();
        match (direction, channel, msg.msg_type.as_str()) {
            (Direction::ToKernel, Channel::Shell, "execute_request") => {
                let c = content();
                let code = c.get("code").and_then(Value::as_str).unwrap_or_default();
                if !code.trim().is_empty() {
                    noted.texts.push(IndexText {
                        sid,
                        seq,
                        field: MatchField::Code,
                        text: capped(code.to_string(), CODE_BYTES),
                    });
                }
            }
            (Direction::FromKernel, Channel::Iopub, kind) => {
                let parent = msg.parent_msg_id.as_deref().unwrap_or_default();
                match kind {
                    "stream" => {
                        let c = content();
                        if let Some(text) = c.get("text").and_then(Value::as_str) {
                            self.print(sid, seq, parent, text, &mut noted);
                        }
                    }
                    "execute_result" | "display_data" | "update_display_data" => {
                        // Only the text is read: the images beside it are skipped, not
                        // built.
                        let shown: Shown = serde_json::from_slice(&msg.content).unwrap_or_default();
                        let text = match shown.data.plain {
                            Some(Value::String(s)) => s,
                            Some(Value::Array(lines)) => {
                                lines.iter().filter_map(Value::as_str).collect()
                            }
                            _ => String::new(),
                        };
                        if !text.is_empty() {
                            self.print(sid, seq, parent, &(text + "\n"), &mut noted);
                        }
                    }
                    "error" => {
                        let c = content();
                        let s = |k: &str| c.get(k).and_then(Value::as_str).unwrap_or_default();
                        let traceback: Vec<&str> = c
                            .get("traceback")
                            .and_then(Value::as_array)
                            .map(|t| t.iter().filter_map(Value::as_str).collect())
                            .unwrap_or_default();
                        noted.texts.push(error_text(
                            sid,
                            seq,
                            s("ename"),
                            s("evalue"),
                            &traceback.join("\n"),
                        ));
                    }
                    "status" => {
                        let c = content();
                        let idle = c.get("execution_state").and_then(Value::as_str) == Some("idle");
                        if idle && self.output.get(&sid).is_some_and(|o| o.parent == parent) {
                            noted.texts.extend(self.flush(sid));
                        }
                    }
                    _ => {}
                }
            }
            (Direction::FromKernel, Channel::Shell, "execute_reply") => {
                // An agent's execution is counted by its `execution_done`; one of Jupyter's
                // by its reply.
                let parent = msg.parent_msg_id.as_deref().unwrap_or_default();
                let agent = self
                    .agent_ids
                    .get(&sid)
                    .is_some_and(|ids| ids.iter().any(|id| id == parent));
                let c = content();
                if !agent && c.get("status").and_then(Value::as_str) == Some("error") {
                    noted.errors += 1;
                }
            }
            _ => {}
        }
        noted
    }

    /// A broker event of session row `sid`, stored as event `seq`.
    pub fn event(&mut self, sid: i64, seq: i64, event: &BrokerEvent) -> Noted {
        let mut noted = Noted::default();
        let BrokerEvent::Session(e) = event else {
            return noted;
        };
        match e {
            StoredEvent::ExecutionStarted { msg_id, .. } => {
                let ids = self.agent_ids.entry(sid).or_default();
                if ids.len() >= AGENT_IDS {
                    ids.pop_front();
                }
                ids.push_back(msg_id.clone());
            }
            StoredEvent::ExecutionDone { msg_id, execution } => {
                if self.output.get(&sid).is_some_and(|o| &o.parent == msg_id) {
                    noted.texts.extend(self.flush(sid));
                }
                let failed = matches!(
                    execution.status,
                    StoredStatus::Error | StoredStatus::Timeout | StoredStatus::Dead
                );
                if failed {
                    noted.errors += 1;
                }
                // The broker's own error (a timeout, a dead kernel) is in no message.
                if let (StoredStatus::Timeout | StoredStatus::Dead, Some(err)) =
                    (execution.status, &execution.error)
                {
                    noted.texts.push(error_text(
                        sid,
                        seq,
                        &err.ename,
                        &err.evalue,
                        &err.traceback.join("\n"),
                    ));
                }
            }
            _ => {}
        }
        if event.end_reason().is_some() {
            noted.texts.extend(self.end(sid));
        }
        noted
    }

    /// Session row `sid` ended (or the writer lets go of it): what it still held.
    pub fn end(&mut self, sid: i64) -> Option<IndexText> {
        self.agent_ids.remove(&sid);
        self.flush(sid)
    }

    /// A batch was lost with its commit: what was held may refer to lost events.
    pub fn clear(&mut self) {
        self.output.clear();
    }

    fn flush(&mut self, sid: i64) -> Option<IndexText> {
        self.output.remove(&sid)?.finish(sid)
    }

    /// Output text of execution `parent` (message `seq`).
    fn print(&mut self, sid: i64, seq: i64, parent: &str, text: &str, noted: &mut Noted) {
        if self.output.get(&sid).is_some_and(|o| o.parent != parent) {
            noted.texts.extend(self.flush(sid));
        }
        self.output
            .entry(sid)
            .or_insert_with(|| Output {
                parent: parent.to_string(),
                seq,
                head: String::new(),
                tail: String::new(),
                elided: false,
            })
            .push(text);
    }
}

fn error_text(sid: i64, seq: i64, ename: &str, evalue: &str, traceback: &str) -> IndexText {
    let mut text = format!("{ename}: {evalue}");
    let traceback = strip_ansi(traceback);
    if !traceback.is_empty() {
        text.push('\n');
        text.push_str(&traceback);
    }
    IndexText {
        sid,
        seq,
        field: MatchField::Error,
        text: capped(text, ERROR_BYTES),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::stored::{StoredError, StoredExecution};
    use serde_json::json;

    fn msg(msg_type: &str, parent: &str, content: Value) -> Message {
        let mut m = Message::new(msg_type, &content, None, "s", "u");
        m.parent_msg_id = Some(parent.to_string());
        m
    }

    fn out(ix: &mut SearchIndex, seq: i64, m: &Message) -> Noted {
        ix.message(1, seq, Direction::FromKernel, Channel::Iopub, m)
    }

    fn idle(parent: &str) -> Message {
        msg("status", parent, json!({"execution_state": "idle"}))
    }

    #[test]
    fn an_execution_is_indexed_as_code_output_and_error() {
        let mut ix = SearchIndex::default();
        let mut req = Message::new(
            "execute_request",
            &json!({"code": "print('hi')"}),
            None,
            "s",
            "u",
        );
        req.msg_id = "r1".into();
        let n = ix.message(1, 1, Direction::ToKernel, Channel::Shell, &req);
        assert_eq!(n.texts[0].field, MatchField::Code);
        assert_eq!(n.texts[0].text, "print('hi')");
        assert!(
            out(&mut ix, 2, &msg("stream", "r1", json!({"text": "hi\n"})))
                .texts
                .is_empty()
        );
        let r = msg(
            "execute_result",
            "r1",
            json!({"data": {"text/plain": "42"}}),
        );
        assert!(out(&mut ix, 3, &r).texts.is_empty());
        let e = msg(
            "error",
            "r1",
            json!({"ename": "ValueError", "evalue": "bad", "traceback": ["\u{1b}[31mValueError\u{1b}[0m: bad"]}),
        );
        let n = out(&mut ix, 4, &e);
        assert_eq!(n.texts[0].text, "ValueError: bad\nValueError: bad");
        let n = out(&mut ix, 5, &idle("r1"));
        assert_eq!(
            n.texts,
            vec![IndexText {
                sid: 1,
                seq: 2,
                field: MatchField::Output,
                text: "hi\n42\n".into()
            }]
        );
        // A Jupyter execution's failed reply counts; an agent's is counted by its done.
        let reply = msg("execute_reply", "r1", json!({"status": "error"}));
        let n = ix.message(1, 6, Direction::FromKernel, Channel::Shell, &reply);
        assert_eq!(n.errors, 1);
        let started = BrokerEvent::Session(StoredEvent::ExecutionStarted {
            msg_id: "a1".into(),
            code: "x".into(),
            timeout_seconds: 1.0,
            queue_wait_seconds: 0.0,
        });
        ix.event(1, 7, &started);
        let reply = msg("execute_reply", "a1", json!({"status": "error"}));
        let n = ix.message(1, 8, Direction::FromKernel, Channel::Shell, &reply);
        assert_eq!(n.errors, 0);
        let done = BrokerEvent::Session(StoredEvent::ExecutionDone {
            msg_id: "a1".into(),
            execution: StoredExecution {
                status: StoredStatus::Timeout,
                execution_count: None,
                stdout: String::new(),
                stderr: String::new(),
                results: vec![],
                error: Some(StoredError {
                    ename: "TimeoutError".into(),
                    evalue: "took too long".into(),
                    traceback: vec![],
                }),
                truncated: false,
                duration_ms: 1.0,
            },
        });
        let n = ix.event(1, 9, &done);
        assert_eq!(n.errors, 1);
        assert_eq!(n.texts[0].text, "TimeoutError: took too long");
    }

    #[test]
    fn a_flood_of_output_keeps_its_start_and_end() {
        let mut ix = SearchIndex::default();
        out(&mut ix, 1, &msg("stream", "r", json!({"text": "FIRST "})));
        let chunk = "x".repeat(10_000) + "\n";
        for i in 0..1000 {
            out(&mut ix, 2 + i, &msg("stream", "r", json!({"text": chunk})));
        }
        out(&mut ix, 5000, &msg("stream", "r", json!({"text": "LAST"})));
        let n = ix.end(1).unwrap();
        assert!(n.text.starts_with("FIRST "));
        assert!(n.text.ends_with("LAST"));
        assert!(n.text.contains("[…]"));
        assert!(
            n.text.len() <= HEAD_BYTES + TAIL_BYTES + 16,
            "{}",
            n.text.len()
        );
        // One huge message is bounded as well, multi-byte text never cut inside a char.
        let huge = "é".repeat(1 << 20);
        out(&mut ix, 6000, &msg("stream", "s", json!({"text": huge})));
        let n = ix.end(1).unwrap();
        assert!(n.text.len() <= HEAD_BYTES + TAIL_BYTES + 16);
    }

    #[test]
    fn another_execution_printing_flushes_the_first() {
        let mut ix = SearchIndex::default();
        out(&mut ix, 1, &msg("stream", "a", json!({"text": "one"})));
        let n = out(&mut ix, 2, &msg("stream", "b", json!({"text": "two"})));
        assert_eq!(n.texts[0].text, "one");
        assert_eq!(n.texts[0].seq, 1);
        // Idle of another execution flushes nothing.
        assert!(out(&mut ix, 3, &idle("a")).texts.is_empty());
        let closed = BrokerEvent::Session(StoredEvent::SessionClosed { by: None });
        let n = ix.event(1, 4, &closed);
        assert_eq!(n.texts[0].text, "two");
        assert!(ix.end(1).is_none());
    }
}
