//! Replay: a recording's code cells run again, in order, in a new session of the same user
//! and kernel, and each cell's output compared with what was recorded.
//!
//! What is compared, per cell: stdout, stderr, each result and display in order (its
//! `text/plain`, its images by presence and size class only, other MIME types by presence),
//! and the error's `ename: evalue`. Tracebacks, execution counts and timings are not
//! compared. Both sides are rendered as text (see [`render`]), normalised, and compared;
//! where they differ, `diff` is a unified diff of the two renderings.
//!
//! Normalisation rules, applied in this order to every compared text:
//! 1. UUIDs (`8-4-4-4-12` hex) become `<uuid>`.
//! 2. ISO 8601 date-times (`2024-05-01T12:03:04.123+00:00`, `2024-05-01 12:03:04`) become
//!    `<datetime>`; dates alone `<date>`; times of day (`12:03:04.5`) `<time>`.
//! 3. Hexadecimal numbers of 6 or more digits (`0x7f3a2c1b9e80`, memory addresses in
//!    reprs) become `0x<addr>`.
//! 4. Temporary paths (under `/tmp`, `/var/tmp`, `/dev/shm`, `/var/folders`) and tempfile
//!    names (`tmpk3j2_x9a`) become `<tmp>`.
//! 5. Durations (a number with `ns`, `µs`, `us`, `ms`, `s`, `sec`, `second(s)`, `min`,
//!    `minute(s)`: `1.23 s`, `123ms`) become `<duration>`.
//! 6. Integers of 12 or more digits (`id()` values, epoch times in ms, µs or ns) become
//!    `<number>`; numbers whose integer part has 10 digits between 1500000000 and
//!    2100000000 (epoch seconds, with or without a fraction) become `<timestamp>`.
//! 7. Images: `image/*` values are shown as `<N KB class>`, by decoded size: under 1 KB,
//!    1-10 KB, 10-100 KB, 100 KB-1 MB, over 1 MB.
//!
//! What is not normalised, and so shows as a difference: random numbers, small integers
//! that vary (process ids, ports), dates in other formats, and set or dict orders that
//! depend on hashing.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use regex::Regex;
use serde_json::Value;
use uuid::Uuid;

use super::notebook::{self, RecordedCell};
use super::{RecordingError, RecordingStore};
use crate::sandbox::SandboxUser;
use crate::session::{CreateOptions, Execution, ExecutionStatus, Registry, Session};

/// One replayed cell.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayCell {
    /// Position among the recording's code cells, from 0.
    pub index: usize,
    pub code: String,
    /// How the replayed execution ended.
    pub status: ExecutionStatus,
    /// How the recorded one ended, when the recording has its Execution.
    pub recorded_status: Option<ExecutionStatus>,
    pub same_output: bool,
    /// Unified diff of the normalised outputs (recorded, then replayed); empty when same.
    pub diff: String,
}

/// The outcome of a replay: the new session (left running) and each cell.
pub struct Replay {
    pub session: Arc<Session>,
    pub cells: Vec<ReplayCell>,
}

macro_rules! re {
    ($name:ident, $pattern:expr) => {
        // The patterns are constants, checked by the unit tests: compiling cannot fail.
        #[allow(clippy::unwrap_used)]
        static $name: LazyLock<Regex> = LazyLock::new(|| Regex::new($pattern).unwrap());
    };
}

re!(
    UUID,
    r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
);
re!(
    DATETIME,
    r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
);
re!(DATE, r"\b\d{4}-\d{2}-\d{2}\b");
re!(TIME, r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b");
re!(HEX, r"\b0x[0-9a-fA-F]{6,}\b");
re!(
    TMP_PATH,
    r#"(?:/private)?(?:/tmp|/var/tmp|/dev/shm|/var/folders)/[^\s'"`)\]}>,;:]*"#
);
re!(TMP_NAME, r"\btmp[a-z0-9_]{6,}\b");
re!(
    DURATION,
    r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|secs|seconds?|min|mins|minutes?)\b"
);
re!(NUMBER, r"\d+(?:\.\d+)?");

/// Apply the normalisation rules (see the module documentation) to `text`.
pub fn normalise(text: &str) -> String {
    let t = UUID.replace_all(text, "<uuid>");
    let t = DATETIME.replace_all(&t, "<datetime>");
    let t = DATE.replace_all(&t, "<date>");
    let t = TIME.replace_all(&t, "<time>");
    let t = HEX.replace_all(&t, "0x<addr>");
    let t = TMP_PATH.replace_all(&t, "<tmp>");
    let t = TMP_NAME.replace_all(&t, "<tmp>");
    let t = DURATION.replace_all(&t, "<duration>");
    let t = NUMBER.replace_all(&t, |c: &regex::Captures<'_>| {
        let m = &c[0];
        let int = m.split('.').next().unwrap_or(m);
        if int.len() == 10 && ("1500000000".."2100000000").contains(&int) {
            "<timestamp>".to_string()
        } else if int.len() >= 12 && !m.contains('.') {
            "<number>".to_string()
        } else {
            m.to_string()
        }
    });
    t.into_owned()
}

/// The size class of a base64 image.
fn size_class(b64: &str) -> &'static str {
    let bytes = b64.len() / 4 * 3;
    match bytes {
        0..1_000 => "<1 KB",
        1_000..10_000 => "1-10 KB",
        10_000..100_000 => "10-100 KB",
        100_000..1_000_000 => "100 KB-1 MB",
        _ => ">1 MB",
    }
}

/// What one cell produced, in the comparable form.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Observed {
    pub stdout: String,
    pub stderr: String,
    /// (is_main_result, data)
    pub results: Vec<(bool, Value)>,
    /// (ename, evalue)
    pub error: Option<(String, String)>,
}

impl Observed {
    pub fn of_execution(x: &Execution) -> Self {
        Self {
            stdout: x.stdout.clone(),
            stderr: x.stderr.clone(),
            results: x
                .results
                .iter()
                .map(|r| (r.is_main_result, r.data.clone()))
                .collect(),
            error: x
                .error
                .as_ref()
                .map(|e| (e.ename.clone(), e.evalue.clone())),
        }
    }

    /// From nbformat outputs, streams cut at `limit` characters each as an Execution's are.
    pub fn of_outputs(outputs: &[Value], limit: usize) -> Self {
        let mut o = Observed::default();
        for out in outputs {
            match out["output_type"].as_str() {
                Some("stream") => {
                    let text = out["text"].as_str().unwrap_or("");
                    if out["name"] == "stderr" {
                        o.stderr.push_str(text);
                    } else {
                        o.stdout.push_str(text);
                    }
                }
                Some(t @ ("display_data" | "execute_result")) => {
                    o.results.push((t == "execute_result", out["data"].clone()));
                }
                Some("error") => {
                    o.error = Some((
                        out["ename"].as_str().unwrap_or("").into(),
                        out["evalue"].as_str().unwrap_or("").into(),
                    ));
                }
                _ => {}
            }
        }
        o.stdout = o.stdout.chars().take(limit).collect();
        o.stderr = o.stderr.chars().take(limit).collect();
        o
    }
}

fn section(out: &mut String, title: &str, body: &str) {
    out.push_str("--- ");
    out.push_str(title);
    out.push('\n');
    out.push_str(body);
    if !body.ends_with('\n') {
        out.push('\n');
    }
}

/// The normalised text form of what a cell produced.
pub fn render(o: &Observed) -> String {
    let mut out = String::new();
    if !o.stdout.is_empty() {
        section(&mut out, "stdout", &normalise(&o.stdout));
    }
    if !o.stderr.is_empty() {
        section(&mut out, "stderr", &normalise(&o.stderr));
    }
    for (main, data) in &o.results {
        let title = if *main { "result" } else { "display" };
        let mut body = String::new();
        if let Value::Object(m) = data {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            for k in keys {
                let v = &m[k];
                if k == "text/plain" {
                    let text = match v {
                        Value::String(s) => s.clone(),
                        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                        other => other.to_string(),
                    };
                    body.push_str(&format!("text/plain:\n{}", normalise(&text)));
                    if !body.ends_with('\n') {
                        body.push('\n');
                    }
                } else if k.starts_with("image/") && k != "image/svg+xml" {
                    body.push_str(&format!("{k}: {}\n", size_class(v.as_str().unwrap_or(""))));
                } else {
                    body.push_str(&format!("{k}: present\n"));
                }
            }
        }
        section(&mut out, title, &body);
    }
    if let Some((ename, evalue)) = &o.error {
        section(&mut out, "error", &normalise(&format!("{ename}: {evalue}")));
    }
    out
}

/// Whether two cells' outputs are the same after normalisation, and the diff if not.
pub fn compare(recorded: &Observed, replayed: &Observed) -> (bool, String) {
    let a = render(recorded);
    let b = render(replayed);
    if a == b {
        return (true, String::new());
    }
    let diff = similar::TextDiff::from_lines(&a, &b)
        .unified_diff()
        .context_radius(3)
        .header("recorded", "replayed")
        .to_string();
    (false, diff)
}

/// Compare one recorded cell with its replayed execution.
pub fn compare_cell(cell: &RecordedCell, replayed: &Execution, output_limit: usize) -> ReplayCell {
    let recorded = match &cell.execution {
        Some(x) => Observed::of_execution(x),
        None => Observed::of_outputs(&cell.outputs, output_limit),
    };
    let (same_output, diff) = compare(&recorded, &Observed::of_execution(replayed));
    ReplayCell {
        index: cell.index,
        code: cell.code.clone(),
        status: replayed.status,
        recorded_status: cell.execution.as_ref().map(|x| x.status),
        same_output,
        diff,
    }
}

/// Run session `id`'s recorded cells again in a new session of `user`. The caller has
/// checked that the recording is `user`'s.
pub async fn replay(
    store: &RecordingStore,
    registry: &Registry,
    user: &SandboxUser,
    max_sessions: usize,
    id: Uuid,
) -> Result<Replay, RecordingError> {
    let info = store.info(id).await?.ok_or(RecordingError::NotFound(id))?;
    let events = store.all_events(id).await?;
    let cells = notebook::cells(&events);
    let session = registry
        .create(
            user,
            max_sessions,
            CreateOptions {
                kernel: Some(info.kernel.clone()),
                ..Default::default()
            },
        )
        .await?;
    tracing::info!(source = %id, session = %session.id, cells = cells.len(), "replaying a recording");
    let config = registry.config();
    let mut out = Vec::with_capacity(cells.len());
    for cell in &cells {
        let timeout = cell
            .timeout_seconds
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(config.execution_timeout)
            .min(config.max_execution_timeout);
        let x = session.execute_wait(cell.code.clone(), timeout).await?;
        out.push(compare_cell(cell, &x, config.output_limit));
    }
    Ok(Replay {
        session,
        cells: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn normalisation_rules() {
        let cases = [
            (
                "<object object at 0x7f3a2c1b9e80>",
                "<object object at 0x<addr>>",
            ),
            ("0x10 stays", "0x10 stays"),
            ("140234567890123\n", "<number>\n"),
            ("0.8444218515250481", "0.8444218515250481"),
            ("42", "42"),
            (
                "took 1.23 s and 123 ms, 5µs, 3 minutes",
                "took <duration> and <duration>, <duration>, <duration>",
            ),
            ("Wall time: 12.5ms", "Wall time: <duration>"),
            ("id 3f2b8c1e-9a4d-4e6f-8b2a-1c3d5e7f9a0b", "id <uuid>"),
            ("at 2024-05-01T12:03:04.123456+00:00.", "at <datetime>."),
            ("2024-05-01 12:03:04", "<datetime>"),
            ("on 2024-05-01", "on <date>"),
            ("at 12:03:04.5", "at <time>"),
            ("wrote /tmp/tmpab3k_9xz/out.csv", "wrote <tmp>"),
            ("file tmpab3k_9xz.txt", "file <tmp>.txt"),
            ("t=1718000000.123", "t=<timestamp>"),
            ("1718000000", "<timestamp>"),
            ("ms=1718000000123", "ms=<number>"),
            ("3 items in 2 sets", "3 items in 2 sets"),
        ];
        for (input, want) in cases {
            assert_eq!(normalise(input), want, "{input:?}");
        }
    }

    fn exec(stdout: &str, results: Vec<(bool, Value)>, error: Option<(&str, &str)>) -> Observed {
        Observed {
            stdout: stdout.into(),
            stderr: String::new(),
            results,
            error: error.map(|(a, b)| (a.into(), b.into())),
        }
    }

    #[test]
    fn comparisons() {
        let png = |n: usize| Value::String("A".repeat(n));
        let same = [
            (exec("a\n", vec![], None), exec("a\n", vec![], None)),
            (
                exec(
                    "",
                    vec![(true, json!({"text/plain": "140234567890123"}))],
                    None,
                ),
                exec(
                    "",
                    vec![(true, json!({"text/plain": "139876543210987"}))],
                    None,
                ),
            ),
            (
                exec(
                    "",
                    vec![(
                        false,
                        json!({"image/png": png(40_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                    )],
                    None,
                ),
                exec(
                    "",
                    vec![(
                        false,
                        json!({"image/png": png(44_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                    )],
                    None,
                ),
            ),
            (
                exec("", vec![], Some(("KeyError", "'x'"))),
                exec("", vec![], Some(("KeyError", "'x'"))),
            ),
        ];
        for (a, b) in same {
            assert_eq!(compare(&a, &b), (true, String::new()));
        }
        let different = [
            (
                exec(
                    "",
                    vec![(true, json!({"text/plain": "0.8444218515250481"}))],
                    None,
                ),
                exec(
                    "",
                    vec![(true, json!({"text/plain": "0.7579544029403025"}))],
                    None,
                ),
                "-0.8444218515250481",
            ),
            (exec("a\n", vec![], None), exec("b\n", vec![], None), "+b"),
            (
                exec("", vec![(false, json!({"image/png": png(400)}))], None),
                exec("", vec![(false, json!({"image/png": png(40_000)}))], None),
                "+image/png: 10-100 KB",
            ),
            (
                exec("", vec![], None),
                exec("", vec![], Some(("NameError", "name 'x' is not defined"))),
                "+NameError",
            ),
        ];
        for (a, b, needle) in different {
            let (same, diff) = compare(&a, &b);
            assert!(!same);
            assert!(
                diff.contains("--- recorded") && diff.contains("+++ replayed"),
                "{diff}"
            );
            assert!(diff.contains(needle), "{needle} not in\n{diff}");
        }
    }

    #[test]
    fn outputs_are_observed_like_executions() {
        let outputs = vec![
            json!({"output_type": "stream", "name": "stdout", "text": "abcdef"}),
            json!({"output_type": "stream", "name": "stderr", "text": "w"}),
            json!({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}, "execution_count": 1}),
            json!({"output_type": "error", "ename": "E", "evalue": "v", "traceback": []}),
        ];
        let o = Observed::of_outputs(&outputs, 3);
        assert_eq!(o.stdout, "abc");
        assert_eq!(o.stderr, "w");
        assert_eq!(o.results, vec![(true, json!({"text/plain": "1"}))]);
        assert_eq!(o.error, Some(("E".into(), "v".into())));
    }
}
