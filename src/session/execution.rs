//! What one execution produced, gathered from the kernel's iopub stream and its
//! `execute_reply`: stdout and stderr (cut at the output limit), results and displays (refused
//! past the result limit), and the error. Pure data: no I/O, unit-tested.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionStatus {
    Ok,
    Error,
    Timeout,
    Interrupted,
    Dead,
}

/// A display_data or execute_result.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResultItem {
    pub data: Value,
    pub metadata: Value,
    pub is_main_result: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecutionError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

/// The Execution object of the API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Execution {
    pub status: ExecutionStatus,
    pub execution_count: Option<u64>,
    pub stdout: String,
    pub stderr: String,
    pub results: Vec<ResultItem>,
    pub error: Option<ExecutionError>,
    pub truncated: bool,
    pub duration_ms: f64,
}

/// One piece of output as it happens (streamed to WebSocket clients).
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Stdout(String),
    Stderr(String),
    Display { data: Value, metadata: Value },
    Result { data: Value, metadata: Value },
    Error(ExecutionError),
    InputRequest { prompt: String, password: bool },
}

/// Remove ANSI escape sequences (colours, cursor moves) from kernel text.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            // CSI: ESC [ params... final byte in @..~
            Some('[') => {
                chars.next();
                for n in chars.by_ref() {
                    if ('@'..='~').contains(&n) {
                        break;
                    }
                }
            }
            // OSC: ESC ] ... BEL or ESC \
            Some(']') => {
                chars.next();
                while let Some(n) = chars.next() {
                    if n == '\u{7}' {
                        break;
                    }
                    if n == '\u{1b}' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            Some(_) => {
                chars.next();
            }
            None => {}
        }
    }
    out
}

/// Append at most `room` characters of `text` to `buf`; returns the part appended and
/// whether anything was cut.
fn append_capped<'a>(
    buf: &mut String,
    used: &mut usize,
    limit: usize,
    text: &'a str,
) -> (&'a str, bool) {
    let room = limit.saturating_sub(*used);
    if room == 0 {
        return ("", !text.is_empty());
    }
    let cut_at = text.char_indices().nth(room).map(|(i, _)| i);
    let part = match cut_at {
        Some(i) => &text[..i],
        None => text,
    };
    *used += part.chars().count();
    buf.push_str(part);
    (part, cut_at.is_some())
}

#[derive(Deserialize)]
struct StreamContent<'a> {
    name: &'a str,
    #[serde(borrow)]
    text: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct DataContent<'a> {
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    #[serde(default)]
    execution_count: Option<u64>,
}

#[derive(Deserialize)]
struct ErrorContent {
    #[serde(default)]
    ename: String,
    #[serde(default)]
    evalue: String,
    #[serde(default)]
    traceback: Vec<String>,
}

/// Gathers one execution's output under the configured limits.
#[derive(Debug)]
pub struct Collector {
    output_limit: usize,
    result_limit: usize,
    stdout: String,
    stdout_chars: usize,
    stderr: String,
    stderr_chars: usize,
    result_bytes: usize,
    results: Vec<ResultItem>,
    error: Option<ExecutionError>,
    truncated: bool,
    execution_count: Option<u64>,
}

fn raw_to_value(raw: Option<&RawValue>) -> Value {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
        .unwrap_or_else(|| Value::Object(Default::default()))
}

impl Collector {
    pub fn new(output_limit: usize, result_limit: usize) -> Self {
        Self {
            output_limit,
            result_limit,
            stdout: String::new(),
            stdout_chars: 0,
            stderr: String::new(),
            stderr_chars: 0,
            result_bytes: 0,
            results: Vec::new(),
            error: None,
            truncated: false,
            execution_count: None,
        }
    }

    /// Take one iopub message of this execution; returns what to stream, if anything.
    pub fn on_iopub(&mut self, msg_type: &str, content: &[u8]) -> Option<OutputEvent> {
        match msg_type {
            "stream" => {
                if self.stdout_chars >= self.output_limit && self.stderr_chars >= self.output_limit
                {
                    // Both are full: skip parsing what would be thrown away.
                    self.truncated = true;
                    return None;
                }
                let c: StreamContent = serde_json::from_slice(content).ok()?;
                let (buf, used) = if c.name == "stderr" {
                    (&mut self.stderr, &mut self.stderr_chars)
                } else {
                    (&mut self.stdout, &mut self.stdout_chars)
                };
                let (part, cut) = append_capped(buf, used, self.output_limit, &c.text);
                self.truncated |= cut;
                if part.is_empty() {
                    return None;
                }
                Some(if c.name == "stderr" {
                    OutputEvent::Stderr(part.to_string())
                } else {
                    OutputEvent::Stdout(part.to_string())
                })
            }
            "display_data" | "execute_result" => {
                let main = msg_type == "execute_result";
                let c: DataContent = serde_json::from_slice(content).ok()?;
                if main {
                    self.execution_count = c.execution_count.or(self.execution_count);
                }
                let size = c.data.map(|d| d.get().len()).unwrap_or(0);
                let (data, metadata) = if self.result_bytes + size > self.result_limit {
                    self.truncated = true;
                    (
                        serde_json::json!({"text/plain": format!(
                            "[kernel-broker: this output of {} bytes was refused: the results of one execution may hold at most {} bytes]",
                            size, self.result_limit)}),
                        serde_json::json!({}),
                    )
                } else {
                    self.result_bytes += size;
                    (raw_to_value(c.data), raw_to_value(c.metadata))
                };
                self.results.push(ResultItem {
                    data: data.clone(),
                    metadata: metadata.clone(),
                    is_main_result: main,
                });
                Some(if main {
                    OutputEvent::Result { data, metadata }
                } else {
                    OutputEvent::Display { data, metadata }
                })
            }
            "error" => {
                let c: ErrorContent = serde_json::from_slice(content).ok()?;
                let e = ExecutionError {
                    ename: c.ename,
                    evalue: c.evalue,
                    traceback: c.traceback.iter().map(|l| strip_ansi(l)).collect(),
                };
                self.error = Some(e.clone());
                Some(OutputEvent::Error(e))
            }
            "clear_output" => None,
            _ => None,
        }
    }

    /// Take the `execute_reply`; returns the reply's status (`ok`, `error`, `aborted`).
    pub fn on_reply(&mut self, content: &[u8]) -> String {
        #[derive(Deserialize)]
        struct Reply {
            #[serde(default)]
            status: String,
            #[serde(default)]
            execution_count: Option<u64>,
            #[serde(default)]
            ename: Option<String>,
            #[serde(default)]
            evalue: Option<String>,
            #[serde(default)]
            traceback: Option<Vec<String>>,
        }
        let Ok(r) = serde_json::from_slice::<Reply>(content) else {
            return "error".into();
        };
        self.execution_count = r.execution_count.or(self.execution_count);
        if r.status == "error" && self.error.is_none() {
            self.error = Some(ExecutionError {
                ename: r.ename.unwrap_or_default(),
                evalue: r.evalue.unwrap_or_default(),
                traceback: r
                    .traceback
                    .unwrap_or_default()
                    .iter()
                    .map(|l| strip_ansi(l))
                    .collect(),
            });
        }
        r.status
    }

    /// Some output of this execution was cut before it reached the collector (a message
    /// over the kernel-message limit).
    pub fn mark_truncated(&mut self) {
        self.truncated = true;
    }

    pub fn error(&self) -> Option<&ExecutionError> {
        self.error.as_ref()
    }

    /// Finish with `status`; `note` replaces the error (for timeout, death and the like).
    pub fn finish(
        self,
        status: ExecutionStatus,
        note: Option<ExecutionError>,
        duration_ms: f64,
    ) -> Execution {
        let error = match status {
            ExecutionStatus::Ok => None,
            _ => note.or(self.error),
        };
        Execution {
            status,
            execution_count: self.execution_count,
            stdout: self.stdout,
            stderr: self.stderr,
            results: self.results,
            error,
            truncated: self.truncated,
            duration_ms,
        }
    }
}

/// The output event of one iopub message on its own (for output of executions that other
/// clients started), or `None` when it carries no output.
pub fn output_event(msg_type: &str, content: &[u8]) -> Option<OutputEvent> {
    Collector::new(usize::MAX, usize::MAX).on_iopub(msg_type, content)
}

/// An execution that never reached the kernel (dead or expired session, queue refused).
pub fn failed(status: ExecutionStatus, ename: &str, evalue: String) -> Execution {
    Collector::new(0, 0).finish(
        status,
        Some(ExecutionError {
            ename: ename.into(),
            evalue,
            traceback: Vec::new(),
        }),
        0.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ansi_is_stripped() {
        let cases = [
            ("\u{1b}[0;31mKeyError\u{1b}[0m: 'x'", "KeyError: 'x'"),
            ("plain", "plain"),
            ("\u{1b}]0;title\u{7}after", "after"),
            ("\u{1b}[1;32m\u{1b}[K", ""),
            ("tail\u{1b}", "tail"),
        ];
        for (input, want) in cases {
            assert_eq!(strip_ansi(input), want, "{input:?}");
        }
    }

    #[test]
    fn streams_are_capped_by_characters() {
        let mut c = Collector::new(5, 1000);
        let e = c.on_iopub("stream", br#"{"name":"stdout","text":"h\u00e9llo world"}"#);
        assert_eq!(e, Some(OutputEvent::Stdout("héllo".into())));
        assert_eq!(
            c.on_iopub("stream", br#"{"name":"stdout","text":"more"}"#),
            None
        );
        let e = c.on_iopub("stream", br#"{"name":"stderr","text":"warn"}"#);
        assert_eq!(e, Some(OutputEvent::Stderr("warn".into())));
        let x = c.finish(ExecutionStatus::Ok, None, 1.0);
        assert_eq!(x.stdout, "héllo");
        assert_eq!(x.stderr, "warn");
        assert!(x.truncated);
    }

    #[test]
    fn results_and_refused_results() {
        let mut c = Collector::new(100, 60);
        c.on_iopub(
            "display_data",
            br#"{"data":{"image/png":"iVBORw0KGgo="},"metadata":{}}"#,
        );
        c.on_iopub(
            "execute_result",
            br#"{"data":{"text/plain":"0123456789012345678901234567890123456789"},"metadata":{},"execution_count":3}"#,
        );
        let x = c.finish(ExecutionStatus::Ok, None, 1.0);
        assert_eq!(x.results.len(), 2);
        assert_eq!(x.results[0].data["image/png"], "iVBORw0KGgo=");
        assert!(!x.results[0].is_main_result);
        assert!(x.results[1].is_main_result);
        assert!(x.results[1].data["text/plain"]
            .as_str()
            .unwrap()
            .contains("was refused"));
        assert!(x.truncated);
        assert_eq!(x.execution_count, Some(3));
    }

    #[test]
    fn error_from_iopub_wins_and_is_cleaned() {
        let mut c = Collector::new(100, 100);
        c.on_iopub(
            "error",
            br#"{"ename":"KeyError","evalue":"'price'","traceback":["\u001b[0;31mKeyError\u001b[0m"]}"#,
        );
        assert_eq!(
            c.on_reply(br#"{"status":"error","execution_count":2,"ename":"Other","evalue":"","traceback":[]}"#),
            "error"
        );
        let x = c.finish(ExecutionStatus::Error, None, 2.0);
        let e = x.error.unwrap();
        assert_eq!(e.ename, "KeyError");
        assert_eq!(e.traceback, vec!["KeyError".to_string()]);
        assert_eq!(x.execution_count, Some(2));
    }

    #[test]
    fn ok_status_has_no_error() {
        let c = Collector::new(1, 1);
        let x = c.finish(ExecutionStatus::Ok, None, 0.5);
        assert!(x.error.is_none());
        let serialized = serde_json::to_value(&x).unwrap();
        assert_eq!(serialized["status"], "ok");
        assert!(serialized["error"].is_null());
    }
}
