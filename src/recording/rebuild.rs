//! An execution stored once (version 2 of `execution_done`, see [`super::stored`]): its
//! output is in its recorded messages, and `execution_done` keeps only its outcome. Here the
//! execution is rebuilt from the two with the session layer's own [`Collector`], so it reads
//! back as the session gathered it; and here the writer asks whether an execution can be
//! stored so: only when its messages rebuild exactly what the session answered. Pure.

use super::stored::{StoredExecution, StoredOutcome, StoredStatus};
use crate::session::execution::{Collector, ExecutionError};

/// One recorded message from the kernel whose parent is the execution's request, as the
/// rebuild reads it (the collector reads iopub output and the `execute_reply`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Part<'a> {
    pub channel: &'a str,
    pub msg_type: &'a str,
    pub content: &'a [u8],
}

/// The execution that its outcome and its messages (in the order recorded) make: what the
/// session's actor gathered, fed the same messages under the same limits.
pub(super) fn rebuild<'a>(
    outcome: &StoredOutcome,
    messages: impl IntoIterator<Item = Part<'a>>,
) -> StoredExecution {
    let limit = |l: Option<u64>| l.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
    let mut collector = Collector::new(limit(outcome.output_limit), limit(outcome.result_limit));
    for m in messages {
        match (m.channel, m.msg_type) {
            ("iopub", msg_type) => {
                collector.on_iopub(msg_type, m.content);
            }
            ("shell", "execute_reply") => {
                collector.on_reply(m.content);
            }
            _ => {}
        }
    }
    let note = outcome.error.clone().map(ExecutionError::from);
    let mut x =
        StoredExecution::from(collector.finish(outcome.status.into(), note, outcome.duration_ms));
    // Also what no message says: a message cut before the collector (`output_cut`), and a
    // count the session took from elsewhere.
    x.execution_count = outcome.execution_count;
    x.truncated = outcome.truncated;
    x
}

/// The outcome to store instead of `execution`, if `messages` (those the writer recorded
/// since its `execution_started`, at `started_seq`) rebuild it exactly; `limits` are the
/// output and result limits it was gathered under.
pub(super) fn outcome_of<'a>(
    execution: &StoredExecution,
    started_seq: i64,
    limits: (usize, usize),
    messages: impl IntoIterator<Item = Part<'a>>,
) -> Option<StoredOutcome> {
    let cut = execution.truncated;
    let mut outcome = StoredOutcome {
        status: execution.status,
        started_seq,
        execution_count: execution.execution_count,
        truncated: execution.truncated,
        duration_ms: execution.duration_ms,
        error: None,
        output_limit: cut.then_some(limits.0 as u64),
        result_limit: cut.then_some(limits.1 as u64),
    };
    let rebuilt = rebuild(&outcome, messages);
    if rebuilt == *execution {
        return Some(outcome);
    }
    // The broker's own error (a timeout, say) took the place of the kernel's.
    let noted = StoredExecution {
        error: execution.error.clone(),
        ..rebuilt
    };
    if execution.status != StoredStatus::Ok && execution.error.is_some() && noted == *execution {
        outcome.error = execution.error.clone();
        return Some(outcome);
    }
    None
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::session::ExecutionStatus;

    /// (channel, msg_type, content) as recorded.
    fn parts<'a>(messages: &'a [(&'static str, &'static str, String)]) -> Vec<Part<'a>> {
        messages
            .iter()
            .map(|(channel, msg_type, content)| Part {
                channel,
                msg_type,
                content: content.as_bytes(),
            })
            .collect()
    }

    /// What the session's collector answers for `messages` under `limits`.
    fn gathered(
        messages: &[(&'static str, &'static str, String)],
        limits: (usize, usize),
        status: ExecutionStatus,
        note: Option<ExecutionError>,
    ) -> StoredExecution {
        let mut c = Collector::new(limits.0, limits.1);
        for (channel, msg_type, content) in messages {
            match *channel {
                "iopub" => {
                    c.on_iopub(msg_type, content.as_bytes());
                }
                _ if *msg_type == "execute_reply" => {
                    c.on_reply(content.as_bytes());
                }
                _ => {}
            }
        }
        c.finish(status, note, 7.5).into()
    }

    fn stream(name: &str, text: &str) -> (&'static str, &'static str, String) {
        (
            "iopub",
            "stream",
            json!({"name": name, "text": text}).to_string(),
        )
    }

    fn messages() -> Vec<(&'static str, &'static str, String)> {
        vec![
            (
                "iopub",
                "status",
                json!({"execution_state": "busy"}).to_string(),
            ),
            stream("stdout", "hello "),
            stream("stderr", "careful\n"),
            stream("stdout", "world\n"),
            (
                "iopub",
                "display_data",
                json!({"data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
                       "metadata": {"image/png": {"width": 4}}})
                .to_string(),
            ),
            (
                "iopub",
                "execute_result",
                json!({"data": {"text/plain": "42"}, "metadata": {}, "execution_count": 4})
                    .to_string(),
            ),
            (
                "iopub",
                "error",
                json!({"ename": "ValueError", "evalue": "no", "traceback": ["\u{1b}[31mValueError\u{1b}[0m"]})
                    .to_string(),
            ),
            (
                "shell",
                "execute_reply",
                json!({"status": "error", "execution_count": 4, "ename": "ValueError", "evalue": "no", "traceback": []})
                    .to_string(),
            ),
            (
                "stdin",
                "input_request",
                json!({"prompt": "?"}).to_string(),
            ),
        ]
    }

    #[test]
    fn what_the_messages_rebuild_is_stored_as_its_outcome() {
        let timeout = ExecutionError {
            ename: "TimeoutError".into(),
            evalue: "too long".into(),
            traceback: Vec::new(),
        };
        // (messages, limits, status, the broker's note, whether a limit cut the output)
        let cases = [
            (
                messages(),
                (10_000, 1 << 20),
                ExecutionStatus::Error,
                None,
                false,
            ),
            (messages(), (8, 1 << 20), ExecutionStatus::Error, None, true),
            (messages(), (10_000, 30), ExecutionStatus::Error, None, true),
            (
                messages(),
                (10_000, 1 << 20),
                ExecutionStatus::Timeout,
                Some(timeout),
                false,
            ),
            (
                vec![stream("stdout", "ok")],
                (5, 5),
                ExecutionStatus::Ok,
                None,
                false,
            ),
            (Vec::new(), (5, 5), ExecutionStatus::Dead, None, false),
        ];
        for (messages, limits, status, note, cut) in cases {
            let x = gathered(&messages, limits, status, note.clone());
            assert_eq!(x.truncated, cut, "{x:?}");
            let outcome = outcome_of(&x, 3, limits, parts(&messages))
                .unwrap_or_else(|| panic!("not stored once: {x:?}"));
            assert_eq!(outcome.error.is_some(), note.is_some(), "{outcome:?}");
            assert_eq!(outcome.output_limit.is_some(), cut, "{outcome:?}");
            assert_eq!(rebuild(&outcome, parts(&messages)), x);
        }
    }

    #[test]
    fn an_execution_its_messages_do_not_rebuild_is_stored_whole() {
        let all = messages();
        let x = gathered(&all, (10_000, 1 << 20), ExecutionStatus::Error, None);
        // A message missing, or one more than the session saw.
        for recorded in [&all[..3], &all[2..]] {
            assert_eq!(outcome_of(&x, 1, (10_000, 1 << 20), parts(recorded)), None);
        }
        let mut more = all.clone();
        more.push(stream("stdout", "late"));
        assert_eq!(outcome_of(&x, 1, (10_000, 1 << 20), parts(&more)), None);
        // An execution that says ok but carries an error is no collector's.
        let odd = StoredExecution {
            status: StoredStatus::Ok,
            ..x.clone()
        };
        assert_eq!(outcome_of(&odd, 1, (10_000, 1 << 20), parts(&all)), None);
    }
}
