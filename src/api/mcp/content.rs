//! An execution as MCP content, and workspace bytes as MCP content. Pure, table-tested.
//!
//! - stdout, stderr (`[stderr]` first) and each result's `text/plain` are text content;
//!   output the session layer cut at its output limit ends with a note saying so;
//! - each `image/png` (a matplotlib chart) is image content, once per chart; a display with
//!   an image leaves out its `text/plain` (`<Figure size ...>` says nothing to a model);
//! - an exception makes the result an error (`isError: true`) whose last text is
//!   `ename: evalue` and the traceback without ANSI colours; a timeout, an interrupt or a
//!   dead kernel are errors that say what happened.

use base64::Engine;
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};
use serde_json::Value;

use crate::session::execution::strip_ansi;
use crate::session::{Execution, ExecutionStatus, OutputEvent};

/// The images a result may carry, by MIME type, in the order they are preferred.
const IMAGE_TYPES: [&str; 3] = ["image/png", "image/jpeg", "image/gif"];

/// What a tool call that ran code answers.
pub fn execution_result(execution: &Execution, output_limit: usize) -> CallToolResult {
    let mut blocks = Vec::new();
    if !execution.stdout.is_empty() {
        blocks.push(ContentBlock::text(execution.stdout.clone()));
    }
    if !execution.stderr.is_empty() {
        blocks.push(ContentBlock::text(format!(
            "[stderr]\n{}",
            execution.stderr
        )));
    }
    for item in &execution.results {
        let image = IMAGE_TYPES.iter().find_map(|mime| {
            item.data
                .get(*mime)
                .and_then(Value::as_str)
                .map(|b64| (*mime, b64))
        });
        match image {
            // Jupyter sends images base64-encoded already, sometimes with line breaks.
            Some((mime, b64)) => blocks.push(ContentBlock::image(
                b64.chars()
                    .filter(|c| !c.is_ascii_whitespace())
                    .collect::<String>(),
                mime,
            )),
            None => {
                if let Some(t) = item.data.get("text/plain").and_then(Value::as_str) {
                    blocks.push(ContentBlock::text(t.to_string()));
                }
            }
        }
    }
    if execution.truncated {
        blocks.push(ContentBlock::text(format!(
            "[output truncated: the broker keeps at most {output_limit} characters each of stdout and stderr per run; print less, or write it to a file and read parts of it]"
        )));
    }
    let failure = match execution.status {
        ExecutionStatus::Ok => None,
        ExecutionStatus::Error => Some(match &execution.error {
            Some(e) => {
                let traceback = strip_ansi(&e.traceback.join("\n"));
                format!("{}: {}\n\nTraceback:\n{}", e.ename, e.evalue, traceback)
            }
            None => "the code raised an error".to_string(),
        }),
        ExecutionStatus::Timeout => Some(with_detail(
            "the run timed out and was interrupted (raise timeout_seconds, or make it faster)",
            execution,
        )),
        ExecutionStatus::Interrupted => Some(with_detail("the run was interrupted", execution)),
        ExecutionStatus::Dead => Some(with_detail(
            "the kernel died (e.g. out of memory); it restarts with its state lost",
            execution,
        )),
    };
    match failure {
        None => {
            if blocks.is_empty() {
                blocks.push(ContentBlock::text("(no output)"));
            }
            CallToolResult::success(blocks)
        }
        Some(f) => {
            blocks.push(ContentBlock::text(f));
            CallToolResult::error(blocks)
        }
    }
}

/// A non-`Ok` status with the error the broker recorded for it, when there is one.
fn with_detail(what: &str, execution: &Execution) -> String {
    match &execution.error {
        Some(e) if !e.evalue.is_empty() => format!("{what}: {}: {}", e.ename, e.evalue),
        Some(e) if !e.ename.is_empty() => format!("{what} ({})", e.ename),
        _ => what.to_string(),
    }
}

/// The text of a progress notification for one piece of streamed output, if it has any.
pub fn progress_message(event: &OutputEvent) -> Option<String> {
    match event {
        OutputEvent::Stdout(t) => Some(t.clone()),
        OutputEvent::Stderr(t) => Some(format!("[stderr] {t}")),
        OutputEvent::Display { data, .. } | OutputEvent::Result { data, .. } => {
            if IMAGE_TYPES.iter().any(|m| data.get(*m).is_some()) {
                Some("[a chart; it comes with the result]".into())
            } else {
                data.get("text/plain")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            }
        }
        OutputEvent::Error(e) => Some(format!("{}: {}", e.ename, e.evalue)),
        OutputEvent::InputRequest { .. } => None,
    }
}

/// The MIME type of an image file by its signature.
fn image_type(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(b"\xff\xd8\xff") {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() > 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The URI of a workspace file as a resource.
pub fn workspace_uri(path: &str) -> String {
    format!("{}{}", WORKSPACE_PREFIX, path.trim_start_matches('/'))
}

/// Workspace files are resources under this prefix.
pub const WORKSPACE_PREFIX: &str = "kernel-broker://workspace/";

/// A workspace file's bytes as what `read_file` answers: an image, text, or a blob.
pub fn file_content(path: &str, bytes: Vec<u8>) -> ContentBlock {
    if let Some(mime) = image_type(&bytes) {
        return ContentBlock::image(
            base64::engine::general_purpose::STANDARD.encode(&bytes),
            mime,
        );
    }
    match String::from_utf8(bytes) {
        Ok(text) => ContentBlock::text(text),
        Err(e) => ContentBlock::resource(
            ResourceContents::blob(
                base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
                workspace_uri(path),
            )
            .with_mime_type("application/octet-stream"),
        ),
    }
}

/// A workspace file's bytes as the contents of a resource read.
pub fn resource_contents(uri: &str, bytes: Vec<u8>) -> ResourceContents {
    if let Some(mime) = image_type(&bytes) {
        return ResourceContents::blob(
            base64::engine::general_purpose::STANDARD.encode(&bytes),
            uri,
        )
        .with_mime_type(mime);
    }
    match String::from_utf8(bytes) {
        Ok(text) => ResourceContents::text(text, uri),
        Err(e) => ResourceContents::blob(
            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            uri,
        )
        .with_mime_type("application/octet-stream"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::execution::{ExecutionError, ResultItem};
    use serde_json::json;

    fn execution(status: ExecutionStatus) -> Execution {
        Execution {
            status,
            execution_count: Some(1),
            stdout: String::new(),
            stderr: String::new(),
            results: vec![],
            error: None,
            truncated: false,
            duration_ms: 1.0,
        }
    }

    fn texts(r: &CallToolResult) -> Vec<String> {
        r.content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect()
    }

    #[test]
    fn output_charts_and_results() {
        let mut e = execution(ExecutionStatus::Ok);
        e.stdout = "hello\n".into();
        e.stderr = "careful\n".into();
        e.results = vec![
            ResultItem {
                data: json!({"image/png": "iVBO\nRw0K", "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                metadata: json!({}),
                is_main_result: false,
            },
            ResultItem {
                data: json!({"text/plain": "42"}),
                metadata: json!({}),
                is_main_result: true,
            },
        ];
        let r = execution_result(&e, 100);
        assert_eq!(r.is_error, Some(false));
        assert_eq!(texts(&r), ["hello\n", "[stderr]\ncareful\n", "42"]);
        let images: Vec<_> = r.content.iter().filter_map(|c| c.as_image()).collect();
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].data, "iVBORw0K");
        assert_eq!(images[0].mime_type, "image/png");
    }

    #[test]
    fn errors_carry_name_value_and_a_plain_traceback() {
        let mut e = execution(ExecutionStatus::Error);
        e.stdout = "before\n".into();
        e.error = Some(ExecutionError {
            ename: "KeyError".into(),
            evalue: "'price'".into(),
            traceback: vec!["\u{1b}[0;31mKeyError\u{1b}[0m".into(), "line 2".into()],
        });
        let r = execution_result(&e, 100);
        assert_eq!(r.is_error, Some(true));
        let t = texts(&r);
        assert_eq!(t[0], "before\n");
        assert_eq!(t[1], "KeyError: 'price'\n\nTraceback:\nKeyError\nline 2");
    }

    #[test]
    fn truncation_timeout_and_silence_are_said() {
        let mut e = execution(ExecutionStatus::Timeout);
        e.truncated = true;
        let r = execution_result(&e, 1024);
        assert_eq!(r.is_error, Some(true));
        let t = texts(&r);
        assert!(t[0].contains("at most 1024 characters"), "{t:?}");
        assert!(t[1].contains("timed out"), "{t:?}");
        let r = execution_result(&execution(ExecutionStatus::Ok), 1);
        assert_eq!(texts(&r), ["(no output)"]);
    }

    #[test]
    fn files_by_kind() {
        let png = b"\x89PNG\r\n\x1a\nrest".to_vec();
        assert!(file_content("a.png", png).as_image().is_some());
        let t = file_content("a.csv", b"a,b\n1,2\n".to_vec());
        assert_eq!(t.as_text().map(|t| t.text.as_str()), Some("a,b\n1,2\n"));
        assert!(file_content("a.bin", vec![0xff, 0xfe, 0])
            .as_resource()
            .is_some());
        assert_eq!(
            workspace_uri("/d/x.csv"),
            "kernel-broker://workspace/d/x.csv"
        );
    }

    #[test]
    fn progress_texts() {
        assert_eq!(
            progress_message(&OutputEvent::Stdout("row 1\n".into())).as_deref(),
            Some("row 1\n")
        );
        let chart = OutputEvent::Display {
            data: json!({"image/png": "x"}),
            metadata: json!({}),
        };
        assert!(progress_message(&chart).unwrap().contains("chart"));
        let input = OutputEvent::InputRequest {
            prompt: "?".into(),
            password: false,
        };
        assert_eq!(progress_message(&input), None);
    }
}
