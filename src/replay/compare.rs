//! Comparing a recorded cell with its replay: both sides are brought to one form
//! ([`Observed`]), rendered as normalised text ([`render`]) and compared line by line.

use serde_json::Value;

use super::normalise::{normalise, size_class};
use super::ReplayCell;
use crate::recording::notebook::RecordedCell;
use crate::session::Execution;

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
