//! How one report becomes rows: a message's four JSON parts (as received when they are
//! JSON), its parent header as a reference to the request it answers, its images and binary
//! buffers as blobs; a broker event's kind and detail. Each within the session's budgets
//! ([`super::budget`]).

use bytes::Bytes;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::budget::{Repeatable, KEPT_DETAIL_BYTES};
use super::search::Noted;
use super::{Item, SessionKey, Touched, Writer, MAX_REQUESTS};
use crate::recording::blobs::{self, Blob};
use crate::recording::db::{BlobRow, DbError, EventRow, IndexText};
use crate::recording::event::{BrokerEvent, RecordingMarker};
use crate::recording::search::MatchField;
use crate::recording::stored::StoredEvent;
use crate::session::Direction;
use crate::wire::{Channel, Message};

impl Writer {
    /// Stores one report within the session's budget (see [`super::budget`]).
    pub(super) fn insert(
        &mut self,
        key: &SessionKey,
        time: i64,
        item: Item,
    ) -> Result<(i64, Touched), DbError> {
        let sid = self.known(key)?.sid;
        match item {
            Item::Message {
                direction,
                channel,
                msg,
            } => self.insert_message(key, sid, time, direction, channel, msg),
            Item::Event(event) => self.insert_event(key, sid, time, event, None),
            Item::Done { event, limits } => self.insert_event(key, sid, time, event, Some(limits)),
        }
    }

    /// A message to or from the kernel.
    fn insert_message(
        &mut self,
        key: &SessionKey,
        sid: i64,
        time: i64,
        direction: Direction,
        channel: Channel,
        msg: Message,
    ) -> Result<(i64, Touched), DbError> {
        let mut touched = Touched::default();
        if direction == Direction::ToKernel
            && channel == Channel::Shell
            && msg.msg_type == "execute_request"
        {
            self.new_execution(sid, &msg.msg_id)?;
        }
        let raw = (msg.header.len()
            + msg.parent_header.len()
            + msg.metadata.len()
            + msg.content.len()
            + msg.buffers.iter().map(|b| b.len()).sum::<usize>()) as u64;
        let parent = msg.parent_msg_id.clone();
        let parent = match direction {
            Direction::ToKernel => Some(msg.msg_id.as_str()),
            Direction::FromKernel => parent.as_deref(),
        };
        if self.dropping(sid, parent, raw) {
            return Ok((sid, touched));
        }
        let mut content = json_text(&msg.content);
        let held = self.executions.wants(sid, direction, channel, &msg);
        // What a reader will see of the content: the text with its images put back.
        let mut seen = None;
        let mut images = Vec::new();
        if direction == Direction::FromKernel
            && channel == Channel::Iopub
            && matches!(
                msg.msg_type.as_str(),
                "display_data" | "execute_result" | "update_display_data"
            )
            && content.len() >= self.blob_threshold
        {
            if let Some((text, found, whole)) = self.extract_blobs(&content, held) {
                content = text;
                images = found;
                seen = whole;
            }
        }
        let header = json_text(&msg.header);
        let (parent_header, parent_seq) = self.parent_of(sid, direction, &msg);
        let metadata = json_text(&msg.metadata);
        let buffer_shas: Vec<String> = msg
            .buffers
            .iter()
            .map(|b| hex::encode(Sha256::digest(b)))
            .collect();
        let mut cost = header.len()
            + parent_header.as_ref().map_or(0, String::len)
            + metadata.len()
            + content.len();
        for b in &images {
            if self.blob_is_new(sid, &b.sha256)? {
                cost += b.data.len();
            }
        }
        for (sha, b) in buffer_shas.iter().zip(&msg.buffers) {
            if self.blob_is_new(sid, sha)? {
                cost += b.len();
            }
        }
        if !self.charge(key, sid, parent, time, cost as u64, raw)? {
            touched.events = 1;
            return Ok((sid, touched));
        }
        for b in &images {
            self.db.put_blob(sid, &image_row(b))?;
        }
        let buffers = if msg.buffers.is_empty() {
            None
        } else {
            for (sha, b) in buffer_shas.iter().zip(&msg.buffers) {
                let row = BlobRow {
                    sha256: sha,
                    base64: false,
                    data: b,
                    size: b.len() as i64,
                };
                self.db.put_blob(sid, &row)?;
            }
            let hashes = buffer_shas.into_iter().map(Value::String).collect();
            Some(Value::Array(hashes).to_string())
        };
        let (_, seq) = self.next_seq(key)?;
        if direction == Direction::ToKernel
            && channel == Channel::Shell
            && msg.msg_type == "execute_request"
            && !is_silent(&msg.content)
        {
            touched.cells = 1;
        }
        if direction == Direction::ToKernel {
            if let Ok(v) = serde_json::from_str::<Value>(&header) {
                self.remember_request(sid, &msg.msg_id, seq, v);
            }
        }
        let direction_name = match direction {
            Direction::ToKernel => "to_kernel",
            Direction::FromKernel => "from_kernel",
        };
        let content_seen = held.then(|| match seen {
            Some(text) => Bytes::from(text),
            None if content.as_bytes() == &msg.content[..] => msg.content.clone(),
            None => Bytes::from(content.clone()),
        });
        self.db.insert_event(&EventRow {
            sid,
            seq,
            time,
            direction: direction_name,
            channel: Some(channel.as_str()),
            msg_type: Some(&msg.msg_type),
            msg_id: Some(&msg.msg_id),
            parent_msg_id: msg.parent_msg_id.as_deref(),
            header: Some(&header),
            parent_header: parent_header.as_deref(),
            parent_seq,
            metadata: Some(&metadata),
            content: &content,
            kind: None,
            has_blobs: !images.is_empty(),
            buffers: buffers.as_deref(),
        })?;
        if let Some(content) = content_seen {
            self.executions.hold(sid, channel, &msg.msg_type, content);
        }
        let noted = self.search.message(sid, seq, direction, channel, &msg);
        self.note(noted, &mut touched)?;
        touched.events = 1;
        Ok((sid, touched))
    }

    /// A broker event: a lifecycle event of the session or a marker of the recording.
    fn insert_event(
        &mut self,
        key: &SessionKey,
        sid: i64,
        time: i64,
        event: BrokerEvent,
        limits: Option<(usize, usize)>,
    ) -> Result<(i64, Touched), DbError> {
        let mut touched = Touched::default();
        let kind = event.kind().to_string();
        let once = match (&event, limits) {
            (
                BrokerEvent::Session(StoredEvent::ExecutionDone { msg_id, execution }),
                Some(limits),
            ) => self.executions.done(sid, msg_id, execution, limits),
            _ => None,
        };
        if let BrokerEvent::Recording(RecordingMarker::RecordingGap { .. }) = &event {
            // The queue dropped reports of this session: of its execution in flight, perhaps.
            self.executions.lost(sid);
        }
        let mut detail = once.unwrap_or_else(|| event.detail());
        let raw = value_len(&detail);
        let parent = event.execution_msg_id().map(str::to_string);
        let parent = parent.as_deref();
        let execution = parent.is_some();
        let mut found = blobs::extract(&mut detail, self.blob_threshold);
        let mut text = detail.to_string();
        let mut cost = text.len();
        for b in &found {
            if self.blob_is_new(sid, &b.sha256)? {
                cost += b.data.len();
            }
        }
        let kept = if matches!(&event, BrokerEvent::Session(e) if e.is_repeatable()) {
            match self.charge_repeatable(key, sid, time, cost as u64, raw)? {
                Repeatable::Stored => true,
                Repeatable::Dropped => return Ok((sid, touched)),
                Repeatable::DroppedAtNewMarker => {
                    touched.events += 1;
                    return Ok((sid, touched));
                }
            }
        } else {
            let open = self.open_scope(sid, parent);
            let kept = match open {
                Some(_) => false,
                None if self.charge(key, sid, parent, time, cost as u64, raw)? => true,
                None => {
                    // Over a cap now: the marker is stored and counts this event.
                    touched.events += 1;
                    false
                }
            };
            if !kept {
                let scope = self.open_scope(sid, parent);
                let drop = execution && scope == Some("session");
                let cut = !drop && (execution || text.len() > KEPT_DETAIL_BYTES);
                if open.is_some() && (drop || cut) {
                    self.dropping(sid, parent, raw);
                } else if open.is_none() && !drop && !cut {
                    // The marker counted this event, but it is stored whole after all.
                    self.undrop(sid, parent, raw);
                }
                if drop {
                    return Ok((sid, touched));
                }
                if cut {
                    let mut short = json!({"recording_truncated": true, "bytes": raw});
                    if let Some(id) = parent {
                        short["msg_id"] = id.into();
                    }
                    text = short.to_string();
                    found.clear();
                }
            }
            kept
        };
        for b in &found {
            self.db.put_blob(sid, &image_row(b))?;
        }
        touched.ended = event.end_reason().map(|reason| (time, reason));
        let (_, seq) = self.next_seq(key)?;
        self.db.insert_event(&EventRow {
            has_blobs: !found.is_empty(),
            ..EventRow::broker(sid, seq, time, &kind, &text)
        })?;
        if let (true, BrokerEvent::Session(StoredEvent::ExecutionStarted { msg_id, .. })) =
            (kept, &event)
        {
            self.executions.start(sid, msg_id, seq);
        }
        let noted = self.search.event(sid, seq, &event);
        self.note(noted, &mut touched)?;
        self.note_session(sid, seq, &event)?;
        touched.events += 1;
        Ok((sid, touched))
    }

    /// Stores what the search index noted of a report.
    fn note(&mut self, noted: Noted, touched: &mut Touched) -> Result<(), DbError> {
        for row in &noted.texts {
            self.db.index_text(row)?;
        }
        touched.errors += noted.errors;
        Ok(())
    }

    /// What a lifecycle event says of the session as a whole: which front door made it,
    /// with what metadata and, for a fork, from which session (`session_created`), who or what ended it (`session_closed`'s
    /// `by`, `idle_expiry`). A recording made before they were kept has none of them.
    fn note_session(&mut self, sid: i64, seq: i64, event: &BrokerEvent) -> Result<(), DbError> {
        let BrokerEvent::Session(e) = event else {
            return Ok(());
        };
        match e {
            StoredEvent::SessionCreated {
                front_door,
                metadata,
                forked_from,
                ..
            } => {
                if let Some(parent) = forked_from {
                    let checkpoint = parent.checkpoint.map(|c| c.to_string());
                    self.db.set_forked_from(
                        sid,
                        &parent.session.to_string(),
                        i64::try_from(parent.execution_count).unwrap_or(i64::MAX),
                        checkpoint.as_deref(),
                    )?;
                }
                // The session layer bounds metadata; the row keeps at most METADATA_BYTES
                // of it anyway, whole entries.
                let mut kept = serde_json::Map::new();
                let mut bytes = 0;
                for (k, v) in metadata {
                    bytes += k.len() + v.len() + 8;
                    if bytes > METADATA_BYTES {
                        break;
                    }
                    kept.insert(k.clone(), Value::String(v.clone()));
                }
                let values: Vec<&str> = kept.values().filter_map(Value::as_str).collect();
                if !values.is_empty() {
                    self.db.index_text(&IndexText {
                        sid,
                        seq,
                        field: MatchField::Metadata,
                        text: values.join("\n"),
                    })?;
                }
                let front_door = front_door.as_deref().map(|d| capped(d, 64));
                let metadata = Value::Object(kept).to_string();
                self.db.set_origin(sid, front_door.as_deref(), &metadata)?;
            }
            StoredEvent::SessionExpired => self.db.set_ended_by(sid, "idle_expiry")?,
            StoredEvent::SessionClosed { by: Some(by) } => {
                self.db.set_ended_by(sid, &capped(by, 64))?
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether session `sid` stores no image or buffer `sha` yet (it would cost its bytes).
    fn blob_is_new(&mut self, sid: i64, sha: &str) -> Result<bool, DbError> {
        Ok(!self.db.has_blob_ref(sid, sha)?)
    }

    /// The parent header of a message from the kernel: a reference to the request's row
    /// when it is the header of a recent request of the session (as JSON), or the text
    /// itself.
    fn parent_of(
        &self,
        sid: i64,
        direction: Direction,
        msg: &Message,
    ) -> (Option<String>, Option<i64>) {
        if direction == Direction::FromKernel {
            let request = msg
                .parent_msg_id
                .as_deref()
                .and_then(|p| self.requests.get(&sid)?.get(p));
            if let Some((seq, header)) = request {
                if serde_json::from_slice::<Value>(&msg.parent_header)
                    .ok()
                    .as_ref()
                    == Some(header)
                {
                    return (None, Some(*seq));
                }
            }
        }
        (Some(json_text(&msg.parent_header)), None)
    }

    fn remember_request(&mut self, sid: i64, msg_id: &str, seq: i64, header: Value) {
        // Replies come within seconds; a bound keeps a flood of requests from piling up.
        if self.requests_len >= MAX_REQUESTS {
            self.forget_requests();
        }
        let m = self.requests.entry(sid).or_default();
        if m.insert(msg_id.to_string(), (seq, header)).is_none() {
            self.requests_len += 1;
        }
    }

    pub(super) fn forget_requests(&mut self) {
        self.requests.clear();
        self.requests_len = 0;
    }

    /// The images of a message's content, taken out (the text with references, and the
    /// blobs; with `whole`, also the text a reader gets back, the images put back in);
    /// `None` when it is not JSON or holds no image.
    fn extract_blobs(
        &self,
        content: &str,
        whole: bool,
    ) -> Option<(String, Vec<Blob>, Option<String>)> {
        let mut v = serde_json::from_str::<Value>(content).ok()?;
        let seen = whole.then(|| v.to_string());
        let found = blobs::extract(&mut v, self.blob_threshold);
        if found.is_empty() {
            return None;
        }
        Some((v.to_string(), found, seen))
    }
}

/// Metadata kept per session (as JSON) and indexed, in bytes.
const METADATA_BYTES: usize = 16 << 10;

/// `s`, at most `max` bytes of it (cut at a character's boundary).
fn capped(s: &str, max: usize) -> String {
    s[..s.floor_char_boundary(max)].to_string()
}

/// The row of an image taken out of a message or event; its size is its text's length.
fn image_row(b: &Blob) -> BlobRow<'_> {
    BlobRow {
        sha256: &b.sha256,
        base64: b.base64,
        data: &b.data,
        size: b.text().len() as i64,
    }
}

/// Bytes of a broker event's detail as JSON text.
fn value_len(v: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing to a counter cannot fail; a failure would only undercount.
    let _ = serde_json::to_writer(&mut n, v);
    n.0
}

/// A message part as JSON text: as received when it is JSON, else as a JSON string.
fn json_text(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "{}".into();
    }
    match std::str::from_utf8(bytes) {
        Ok(s) if serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok() => s.to_string(),
        _ => Value::String(String::from_utf8_lossy(bytes).into_owned()).to_string(),
    }
}

fn is_silent(content: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Req {
        #[serde(default)]
        silent: bool,
    }
    serde_json::from_slice::<Req>(content)
        .map(|r| r.silent)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_parts_are_kept_or_quoted() {
        let cases: [(&[u8], &str); 4] = [
            (b"", "{}"),
            (br#"{"a": 1}"#, r#"{"a": 1}"#),
            (b"not json", r#""not json""#),
            (b"\xff{", "\"\u{fffd}{\""),
        ];
        for (input, want) in cases {
            assert_eq!(json_text(input), want);
        }
    }

    #[test]
    fn silent_requests_are_no_cells() {
        assert!(is_silent(br#"{"code": "x", "silent": true}"#));
        assert!(!is_silent(br#"{"code": "x"}"#));
        assert!(!is_silent(b"garbage"));
    }
}
