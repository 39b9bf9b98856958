//! A kernel's `stream` messages masked as one text: the end of a chunk that begins a form
//! of a secret is held back and goes out at the front of the stream's next chunk, so a
//! value printed in two pieces (`print(k[:5], end=""); print(k[5:])`) is masked whole.
//!
//! What is held is at most one form's length less one, per stream name; it goes out with
//! the next chunk of the same stream, or on its own (a `stream` message of the held text)
//! at the end of its execution: before its `status: idle` on IOPub or its `input()` prompt
//! (not its reply, which comes on the shell socket and can overtake its last output).
//! Other messages of the execution (a display, the other stream) do not release it:
//! the execution's text output is read as one (an execution's `stdout`), so a value printed
//! in two pieces with a display between them is still one value, and the few held
//! characters go out after that display instead of before it. So streams stay streams:
//! nothing waits but those few characters, and only when they could begin a secret.

use bytes::Bytes;
use serde_json::Value;

use super::Masker;
use crate::wire::Message;

/// One stream's held text.
struct Held {
    /// The message the text came from (its header, parent and routing serve the message
    /// that carries the text later, under a msg_id of its own).
    from: Message,
    name: String,
    text: String,
}

/// The held ends of a kernel's streams.
#[derive(Default)]
pub struct StreamHold {
    held: Vec<Held>,
    flushed: u64,
}

#[derive(serde::Deserialize)]
struct StreamContent {
    name: String,
    text: String,
}

impl StreamHold {
    /// What to send for the kernel's message `m`, masked, in order: first what was held
    /// and must go out before it, then `m` itself (without the end it now holds, if any;
    /// left out when all of it is held).
    pub fn on_message(&mut self, masker: &Masker, m: Message) -> Vec<Message> {
        if m.msg_type == "stream" {
            if let Ok(c) = serde_json::from_slice::<StreamContent>(&m.content) {
                return self.on_stream(masker, m, c);
            }
        }
        let mut out = if ends_execution(&m) {
            self.flush(m.parent_msg_id.as_deref())
        } else {
            Vec::new()
        };
        out.push(mask_message(masker, m));
        out
    }

    fn on_stream(&mut self, masker: &Masker, m: Message, c: StreamContent) -> Vec<Message> {
        // This stream's held text joins the new chunk. Another execution's stays held until
        // that one ends: late output of an earlier execution (a subprocess's, which
        // ipykernel forwards from its own thread) can arrive while a later one prints.
        let mut out = Vec::new();
        let same = |h: &Held| h.from.parent_msg_id == m.parent_msg_id && h.name == c.name;
        let before = match self.held.iter().position(same) {
            Some(i) => self.held.remove(i).text,
            None => String::new(),
        };
        let whole = before + &c.text;
        let masked = masker.mask_str(&whole).into_owned();
        let keep = masker.held_suffix(&masked);
        let (send, hold) = masked.split_at(masked.len() - keep);
        if !hold.is_empty() {
            if self.held.len() >= MAX_HELD {
                // Executions whose end never came (a kernel that died): the oldest goes.
                let h = self.held.remove(0);
                out.insert(0, self.held_message(h));
            }
            self.held.push(Held {
                from: m.clone(),
                name: c.name.clone(),
                text: hold.to_string(),
            });
        }
        if !send.is_empty() {
            let mut m = mask_parts(masker, m);
            if send != c.text {
                m.content = stream_content(&c.name, send);
            }
            out.push(m);
        }
        out
    }

    /// The held text of the streams of the execution `parent` (none for a message of no
    /// execution), as messages: it has ended.
    pub fn flush(&mut self, parent: Option<&str>) -> Vec<Message> {
        let Some(parent) = parent else {
            return Vec::new();
        };
        if self.held.is_empty() {
            return Vec::new();
        }
        let (go, stay): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.from.parent_msg_id.as_deref() == Some(parent));
        self.held = stay;
        go.into_iter().map(|h| self.held_message(h)).collect()
    }

    /// Whether anything is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    fn held_message(&mut self, h: Held) -> Message {
        self.flushed += 1;
        let mut m = h.from;
        let msg_id = format!("{}-held-{}", m.msg_id, self.flushed);
        if let Ok(mut header) = serde_json::from_slice::<Value>(&m.header) {
            header["msg_id"] = Value::String(msg_id.clone());
            if let Ok(b) = serde_json::to_vec(&header) {
                m.header = Bytes::from(b);
                m.msg_id = msg_id;
            }
        }
        m.content = stream_content(&h.name, &h.text);
        m.buffers.clear();
        m
    }
}

/// Held texts at most (streams of executions whose end has not come).
const MAX_HELD: usize = 16;

/// Whether `m` is its execution's last iopub message (`status: idle`).
fn ends_execution(m: &Message) -> bool {
    #[derive(serde::Deserialize)]
    struct Status<'a> {
        execution_state: &'a str,
    }
    m.msg_type == "status"
        && serde_json::from_slice::<Status>(&m.content).is_ok_and(|s| s.execution_state == "idle")
}

fn stream_content(name: &str, text: &str) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({"name": name, "text": text})).unwrap_or_default(),
    )
}

/// `m` with its metadata, content and buffers masked.
pub fn mask_message(masker: &Masker, m: Message) -> Message {
    let mut m = mask_parts(masker, m);
    if let Some(c) = masker.mask_json(&m.content) {
        m.content = Bytes::from(c);
    }
    m
}

/// `m` with its metadata and buffers masked (not its content).
fn mask_parts(masker: &Masker, mut m: Message) -> Message {
    if masker.is_empty() {
        return m;
    }
    if let Some(md) = masker.mask_json(&m.metadata) {
        m.metadata = Bytes::from(md);
    }
    for b in m.buffers.iter_mut() {
        if let Some(masked) = masker.mask_bytes(b) {
            *b = Bytes::from(masked);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secrets::{Named, Patterns};
    use std::sync::Arc;

    fn masker() -> Masker {
        Masker::new(
            &[Named {
                name: "K".into(),
                value: "abcdefgh".into(),
            }],
            Arc::new(Patterns::none()),
        )
    }

    fn parent() -> Message {
        Message::new("execute_request", &serde_json::json!({}), None, "s", "u")
    }

    fn stream(p: &Message, name: &str, text: &str) -> Message {
        Message::new(
            "stream",
            &serde_json::json!({"name": name, "text": text}),
            Some(&p.header),
            "s",
            "u",
        )
    }

    fn texts(ms: &[Message]) -> Vec<String> {
        ms.iter()
            .map(|m| {
                let v: Value = serde_json::from_slice(&m.content).unwrap();
                v["text"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| m.msg_type.clone())
            })
            .collect()
    }

    #[test]
    fn a_value_split_between_two_chunks_is_masked_whole() {
        let (m, p) = (masker(), parent());
        let mut h = StreamHold::default();
        assert_eq!(
            texts(&h.on_message(&m, stream(&p, "stdout", "key: abc"))),
            ["key: "]
        );
        assert!(!h.is_empty());
        assert_eq!(
            texts(&h.on_message(&m, stream(&p, "stdout", "defgh!\n"))),
            ["[secret:K]!\n"]
        );
        assert!(h.is_empty());
    }

    #[test]
    fn a_held_start_that_was_not_the_value_goes_out_at_the_executions_end() {
        let (m, p) = (masker(), parent());
        let mut h = StreamHold::default();
        assert!(h.on_message(&m, stream(&p, "stdout", "ab")).is_empty());
        // A display, or a message of no execution, does not release it.
        let display = Message::new(
            "display_data",
            &serde_json::json!({"data": {"text/plain": "x"}, "metadata": {}}),
            Some(&p.header),
            "s",
            "u",
        );
        assert_eq!(h.on_message(&m, display).len(), 1);
        let orphan = Message::new(
            "status",
            &serde_json::json!({"execution_state": "idle"}),
            None,
            "s",
            "u",
        );
        assert_eq!(h.on_message(&m, orphan).len(), 1);
        assert!(!h.is_empty());
        let idle = Message::new(
            "status",
            &serde_json::json!({"execution_state": "idle"}),
            Some(&p.header),
            "s",
            "u",
        );
        let out = h.on_message(&m, idle);
        assert_eq!(texts(&out), ["ab", "status"]);
        assert_ne!(out[0].msg_id, out[1].msg_id);
        let v: Value = serde_json::from_slice(&out[0].header).unwrap();
        assert_eq!(v["msg_id"], out[0].msg_id.as_str());
    }

    #[test]
    fn streams_and_executions_are_held_apart() {
        let (m, p, q) = (masker(), parent(), parent());
        let mut h = StreamHold::default();
        h.on_message(&m, stream(&p, "stdout", "x abcd"));
        assert_eq!(
            texts(&h.on_message(&m, stream(&p, "stderr", "y abc"))),
            ["y "]
        );
        assert_eq!(
            texts(&h.on_message(&m, stream(&p, "stderr", "defgh"))),
            ["[secret:K]"]
        );
        // Another execution's output does not release p's held text, nor join it.
        assert_eq!(
            texts(&h.on_message(&m, stream(&q, "stdout", "efgh!"))),
            ["efgh!"]
        );
        assert_eq!(
            texts(&h.on_message(&m, stream(&p, "stdout", "efgh"))),
            ["[secret:K]"]
        );
        assert!(h.is_empty());
    }

    #[test]
    fn other_messages_are_masked_whole() {
        let (m, p) = (masker(), parent());
        let err = Message::new(
            "error",
            &serde_json::json!({"ename": "KeyError", "evalue": "'abcdefgh'", "traceback": ["abcdefgh"]}),
            Some(&p.header),
            "s",
            "u",
        );
        let out = StreamHold::default().on_message(&m, err);
        let v: Value = serde_json::from_slice(&out[0].content).unwrap();
        assert_eq!(v["evalue"], "'[secret:K]'");
        assert_eq!(v["traceback"][0], "[secret:K]");
    }
}

/// A command's output (a byte stream) masked as it is read: what could begin a form of a
/// value at the end of a read is held until the next read, or the end.
pub struct MaskedRead<R> {
    inner: R,
    masker: std::sync::Arc<Masker>,
    held: Vec<u8>,
    out: Vec<u8>,
    at: usize,
    ended: bool,
}

impl<R> MaskedRead<R> {
    pub fn new(inner: R, masker: std::sync::Arc<Masker>) -> Self {
        Self {
            inner,
            masker,
            held: Vec::new(),
            out: Vec::new(),
            at: 0,
            ended: false,
        }
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for MaskedRead<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.at < this.out.len() {
                let n = (this.out.len() - this.at).min(buf.remaining());
                buf.put_slice(&this.out[this.at..this.at + n]);
                this.at += n;
                return Poll::Ready(Ok(()));
            }
            if this.ended {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut rb = tokio::io::ReadBuf::new(&mut chunk);
            match std::pin::Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let read = rb.filled();
                    let mut data = std::mem::take(&mut this.held);
                    if read.is_empty() {
                        this.ended = true;
                    } else {
                        data.extend_from_slice(read);
                    }
                    let masked = this.masker.mask_bytes(&data).unwrap_or(data);
                    let keep = if this.ended {
                        0
                    } else {
                        this.masker.held_suffix_bytes(&masked)
                    };
                    let split = masked.len() - keep;
                    this.held = masked[split..].to_vec();
                    this.out = masked[..split].to_vec();
                    this.at = 0;
                }
            }
        }
    }
}

/// What masking costs per message (BENCHMARKS.md "Masking"):
/// `cargo test --release --lib masking_cost -- --ignored --nocapture`.
#[cfg(test)]
mod cost {
    use super::*;
    use crate::secrets::{Credentials, Named, Patterns};
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn masking_cost() {
        let creds = Credentials {
            values: vec![Named {
                name: "broker-token".into(),
                value: "bench-token-0123456789abcdef".into(),
            }],
            patterns: Arc::new(Patterns::new(&[], true).unwrap()),
        };
        let secrets = (0..4)
            .map(|i| {
                (
                    format!("KEY_{i}"),
                    format!("bench-secret-{i}-{}", "x7Q".repeat(8)),
                )
            })
            .collect();
        let masker = creds.masker(&secrets, &["0123456789abcdef0123456789abcdef".into()]);
        let p = Message::new("execute_request", &serde_json::json!({}), None, "s", "u");
        let messages = [
            ("status", serde_json::json!({"execution_state": "busy"})),
            (
                "execute_input",
                serde_json::json!({"code": "1 + 1", "execution_count": 1}),
            ),
            (
                "execute_result",
                serde_json::json!({"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}),
            ),
            (
                "stream",
                serde_json::json!({"name": "stdout", "text": "abcdefghij".repeat(1000)}),
            ),
            (
                "stream",
                serde_json::json!({"name": "stdout", "text": format!("{}\n", secrets["KEY_0"])}),
            ),
        ];
        for (kind, content) in messages {
            let m = Message::new(kind, &content, Some(&p.header), "s", "u");
            let n = 20_000;
            let mut hold = StreamHold::default();
            let start = Instant::now();
            for _ in 0..n {
                std::hint::black_box(hold.on_message(&masker, m.clone()));
            }
            let per = start.elapsed() / n;
            println!(
                "{kind:>15} {:>6} bytes: {per:?} per message",
                m.content.len()
            );
        }
    }
}

#[cfg(test)]
mod read_tests {
    use super::*;
    use crate::secrets::{Named, Patterns};
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_command_output_is_masked_across_reads() {
        let masker = Arc::new(Masker::new(
            &[Named {
                name: "K".into(),
                value: "abcdefgh".into(),
            }],
            Arc::new(Patterns::none()),
        ));
        let (mut tx, rx) = tokio::io::duplex(4);
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for piece in ["x=ab", "cdef", "gh\nab"] {
                tx.write_all(piece.as_bytes()).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
        let mut out = String::new();
        MaskedRead::new(rx, masker)
            .read_to_string(&mut out)
            .await
            .unwrap();
        writer.await.unwrap();
        assert_eq!(out, "x=[secret:K]\nab");
    }
}
