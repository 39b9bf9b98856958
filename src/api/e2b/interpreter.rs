//! E2B's code interpreter (port 49999 behind `E2B_SANDBOX_URL`): `POST /execute` answers
//! newline-delimited JSON as the code runs (`stdout`, `stderr`, `result`, `error`, then
//! `number_of_executions` and `end_of_execution`), in a context (`contexts.rs`). The SDK's own timeout closes the connection: a client
//! that goes away mid-execution has the kernel interrupted, as E2B's server does. When the
//! sandbox ends mid-execution (killed, or at its deadline) the body fails instead of ending,
//! so the connection drops as E2B's does and the SDKs raise "the sandbox was killed".
//!
//! Results are E2B's: `text` as its server makes it ([`e2b_text`]), and `chart`, `data`
//! from the `e2b/chart` and `e2b/data` entries the kernel's own hooks add to a display
//! (`kernels/kernel_broker_e2b.py`). Every execution through this route asks for those
//! hooks, with `env_vars` as the execution's own variables (`ExecuteRequest::e2b`); the
//! bundles are forwarded as the kernel made them, never parsed beyond that mapping.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::SandboxCaller;
use super::contexts::{context_session, default_context, kernel_for, language_of};
use super::documented::SandboxErrors;
use super::{E2bError, E2bResult};
use crate::api::extract::{parse_json, read_limited};
use crate::api::output_budget::{CutQueue, Held};
use crate::api::AppState;
use crate::session::{ExecuteRequest, ExecutionStatus, Origin, OutputEvent, Timeout};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(execute))
}

#[derive(Deserialize)]
struct ExecuteBody {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<Map<String, Value>>,
}

/// `env_vars`: names to text values (anything else is a 400, as E2B's server refuses it);
/// the names and values themselves are checked by the session layer.
fn env_vars(given: Option<Map<String, Value>>) -> E2bResult<BTreeMap<String, String>> {
    given
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            _ => Err(E2bError::bad_request(format!(
                "env_vars: the value of {:?} is not a string",
                k.chars().take(64).collect::<String>()
            ))),
        })
        .collect()
}

/// `text/plain` as E2B's code interpreter reports it: one pair of enclosing quotes, single
/// or double, taken off (the repr of a string becomes the string: `'abc'` → `abc`); its
/// server does this to every result's text, displays too.
fn e2b_text(text: &str) -> &str {
    let quoted = |q: char| text.starts_with(q) && text.ends_with(q);
    if quoted('\'') || quoted('"') {
        // Both ends are one-byte characters; a lone quote becomes "" as in Python's [1:-1].
        text.get(1..text.len().saturating_sub(1).max(1))
            .unwrap_or("")
    } else {
        text
    }
}

/// A Jupyter MIME bundle as E2B's result fields.
fn result_line(data: &Value, is_main: bool) -> Value {
    let mut out = Map::new();
    out.insert("type".into(), "result".into());
    let mut extra = Map::new();
    if let Some(bundle) = data.as_object() {
        for (mime, value) in bundle {
            let key = match mime.as_str() {
                // What the kernel's E2B formatters make (kernels/kernel_broker_e2b.py): an
                // object, passed on as the kernel made it (the SDKs read it); anything
                // else is not E2B's shape and is left out.
                "e2b/chart" | "e2b/data" => {
                    if value.is_object() {
                        let key = if mime == "e2b/chart" { "chart" } else { "data" };
                        out.insert(key.into(), value.clone());
                    }
                    continue;
                }
                "text/plain" => "text",
                "text/html" => "html",
                "text/markdown" => "markdown",
                "image/svg+xml" => "svg",
                "image/png" => "png",
                "image/jpeg" => "jpeg",
                "application/pdf" => "pdf",
                "text/latex" => "latex",
                "application/json" => "json",
                "application/javascript" => "javascript",
                _ => {
                    extra.insert(mime.clone(), value.clone());
                    continue;
                }
            };
            let value = match (key, value) {
                // Base64 in Jupyter may be wrapped; E2B's is one line.
                ("png" | "jpeg" | "pdf", Value::String(s)) => Value::String(s.replace('\n', "")),
                ("text", Value::String(s)) => Value::String(e2b_text(s).to_string()),
                (_, v) => v.clone(),
            };
            out.insert(key.into(), value);
        }
    }
    if !extra.is_empty() {
        out.insert("extra".into(), Value::Object(extra));
    }
    out.insert("is_main_result".into(), is_main.into());
    Value::Object(out)
}

fn now_nanos() -> i64 {
    chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0)
}

fn event_line(ev: OutputEvent) -> Option<Value> {
    Some(match ev {
        OutputEvent::Stdout(text) => {
            json!({"type": "stdout", "text": text, "timestamp": now_nanos()})
        }
        OutputEvent::Stderr(text) => {
            json!({"type": "stderr", "text": text, "timestamp": now_nanos()})
        }
        OutputEvent::Display { data, .. } => result_line(&data, false),
        OutputEvent::Result { data, .. } => result_line(&data, true),
        OutputEvent::Error(e) => json!({
            "type": "error", "name": e.ename, "value": e.evalue,
            "traceback": e.traceback.join("\n"),
        }),
        OutputEvent::InputRequest { .. } => return None,
    })
}

/// The line that stands for `n` lines a client did not read in time (on stderr, where
/// E2B's SDKs show it to the user).
fn left_out(n: u64) -> Bytes {
    line(&json!({
        "type": "stderr",
        "text": format!(
            "[kernel-broker: {n} output(s) of this execution were not sent: the client did not \
             read them in time and its user's unread output reached the broker's limit]\n"
        ),
        "timestamp": now_nanos(),
    }))
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

/// Run code (E2B's code interpreter): NDJSON as it runs
#[utoipa::path(post, operation_id = "e2b_execute", path = "/e2b/sandbox/execute", tag = "e2b", security(()),
    responses((status = 200, description = "newline-delimited JSON: stdout, stderr, result, error, number_of_executions, end_of_execution", content_type = "application/x-ndjson", body = String), SandboxErrors))]
async fn execute(
    State(state): State<AppState>,
    caller: SandboxCaller,
    body: Body,
) -> E2bResult<Response> {
    let bytes = read_limited(
        body,
        state.limits.max_code_bytes + (64 << 10),
        "request body",
    )
    .await?;
    let req: ExecuteBody = parse_json(&bytes, "request body")?;
    let kernel = kernel_for(&state.kernelspecs, req.language.as_deref())?;
    if req.context_id.is_some() && req.language.is_some() {
        return Err(E2bError::bad_request(
            "give a context or a language, not both",
        ));
    }
    let env = env_vars(req.env_vars)?;
    // `envs` of names the sandbox declared secret are masked from now on (the kernel gets
    // them for this execution, as any).
    let secret: std::collections::BTreeMap<String, String> = caller
        .e2b
        .with(caller.session.id, |m| {
            super::control::declared_secrets(Some(&m.metadata))
        })
        .map(|declared| {
            env.iter()
                .filter(|(k, _)| declared.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    // The SDK sends no execution timeout (it enforces its own by closing the
    // connection); the broker's maximum is the backstop. E2B's result formats and the
    // execution's own variables are the kernel's hooks' (kernels/kernel_broker_e2b.py).
    let request = ExecuteRequest::new(
        req.code,
        Timeout::Maximum,
        Origin::E2b,
        &state.execution_limits(),
    )?
    .e2b(env)?;
    // A language runs in its default context: the sandbox's own for its kernel (Python),
    // else one made for that language at its first use, as E2B's code interpreter has one
    // per language.
    let session = match kernel {
        Some(k) if k != caller.session.kernel_name => default_context(&state, &caller, &k).await?,
        _ => context_session(&state, &caller, req.context_id.as_deref())?,
    };
    session
        .secrets
        .add(&secret)
        .map_err(|e| E2bError::bad_request(format!("envs: {e}")))?;
    let request = request.in_language(&language_of(&state.kernelspecs, &session));
    let (out_tx, mut out_rx) = mpsc::channel::<OutputEvent>(256);
    let mut done_rx = session.submit(request.streaming(out_tx))?;
    // The lines wait for the client in a queue under the user's execution-output budget,
    // cut with a marker past it (never waited on: the actor does not wait on a client
    // either, and a wait here would only move the loss into its queue, unmarked).
    let budgets = &caller.e2b.execution_output;
    let (mut lines, line_rx) = CutQueue::new(
        budgets.of(&caller.session.user.name),
        super::state::EXECUTION_OUTPUT_BUDGET,
    );
    // Set when the sandbox ended under the execution: the body then fails instead of
    // ending, so the connection drops as it does when E2B's sandbox goes away mid-request,
    // and the SDKs (which then find `/health` answering 502) raise their "the sandbox was
    // killed" error instead of returning a cut execution as if it were whole.
    let dropped = Arc::new(AtomicBool::new(false));
    let (e2b, sandbox, registry) = (
        caller.e2b.clone(),
        caller.session.clone(),
        state.registry.clone(),
    );
    let drop_flag = dropped.clone();
    let gone = move || super::process::sandbox_gone(&registry, &e2b, &sandbox);
    tokio::spawn(async move {
        let mut open = true;
        let finished = loop {
            tokio::select! {
                biased;
                ev = out_rx.recv(), if open => match ev {
                    Some(ev) => {
                        if let Some(v) = event_line(ev) {
                            lines.push(line(&v), left_out);
                        }
                    }
                    None => open = false,
                },
                exec = &mut done_rx => break exec.ok(),
                _ = lines.closed() => {
                    // The client went away mid-execution: interrupt it, as E2B does.
                    let _ = session.interrupt().await;
                    return;
                }
            }
        };
        // Output sent before the end is in the channel already.
        while let Ok(ev) = out_rx.try_recv() {
            if let Some(v) = event_line(ev) {
                lines.push(line(&v), left_out);
            }
        }
        if gone() {
            drop_flag.store(true, Ordering::SeqCst);
            return;
        }
        let Some(exec) = finished else { return };
        // Lines the stream missed (a slow client's events are dropped, never awaited)
        // are not repeated; the end says how it went.
        let mut last = Vec::new();
        if matches!(
            exec.status,
            ExecutionStatus::Timeout | ExecutionStatus::Dead
        ) {
            if let Some(e) = &exec.error {
                let v = json!({"type": "error", "name": e.ename, "value": e.evalue, "traceback": e.traceback.join("\n")});
                last.push(line(&v));
            }
        }
        if let Some(n) = exec.execution_count {
            last.push(line(
                &json!({"type": "number_of_executions", "execution_count": n}),
            ));
        }
        last.push(line(&json!({"type": "end_of_execution"})));
        lines.finish(last, left_out);
    });
    // A line's budget is let go when the connection takes it.
    let stream = futures::stream::unfold(Some(line_rx), move |rx| {
        let dropped = dropped.clone();
        async move {
            let mut rx = rx?;
            match rx.recv().await {
                Some(Held(b, _budget)) => Some((Ok(b), Some(rx))),
                None if dropped.load(Ordering::SeqCst) => Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the sandbox ended during the execution",
                    )),
                    None,
                )),
                None => None,
            }
        }
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jupyter_bundles_become_e2b_results() {
        let v = result_line(
            &json!({"text/plain": "<Figure>", "image/png": "iVBO\nRw0K", "application/x-custom": 1}),
            false,
        );
        assert_eq!(v["type"], "result");
        assert_eq!(v["text"], "<Figure>");
        assert_eq!(v["png"], "iVBORw0K");
        assert_eq!(v["extra"]["application/x-custom"], 1);
        assert_eq!(v["is_main_result"], false);
        let e = event_line(OutputEvent::Error(
            crate::session::execution::ExecutionError {
                ename: "KeyError".into(),
                evalue: "'price'".into(),
                traceback: vec!["a".into(), "b".into()],
            },
        ))
        .unwrap();
        assert_eq!(e["traceback"], "a\nb");
        assert_eq!(e["name"], "KeyError");
    }

    #[test]
    fn text_is_e2bs_one_pair_of_quotes_off() {
        for (given, want) in [
            ("'abc'", "abc"),
            ("\"abc\"", "abc"),
            ("'it\\'s'", "it\\'s"),
            ("42", "42"),
            ("'", ""),
            ("''", ""),
            ("\"", ""),
            ("'a\"", "'a\""),
            ("'é'", "é"),
            ("", ""),
            ("   a  b\n0  1  2", "   a  b\n0  1  2"),
        ] {
            assert_eq!(e2b_text(given), want, "{given:?}");
        }
        let v = result_line(&json!({"text/plain": "'abc'"}), true);
        assert_eq!(v["text"], "abc");
    }

    #[test]
    fn the_kernels_chart_and_data_become_fields_and_anything_else_is_left_out() {
        let chart = json!({"type": "line", "title": null, "elements": []});
        let data = json!({"a": [1, 2]});
        let v = result_line(
            &json!({"image/png": "iVBO", "e2b/chart": chart, "e2b/data": data}),
            false,
        );
        assert_eq!(v["chart"], chart);
        assert_eq!(v["data"], data);
        assert_eq!(v["png"], "iVBO");
        assert!(v.get("extra").is_none(), "{v}");
        // A hostile kernel's malformed values: dropped, the rest of the result kept.
        for bad in [json!("x"), json!([1]), json!(null), json!(3)] {
            let v = result_line(
                &json!({"text/plain": "t", "e2b/chart": bad, "e2b/data": bad}),
                true,
            );
            assert!(v.get("chart").is_none() && v.get("data").is_none(), "{v}");
            assert!(v.get("extra").is_none(), "{v}");
            assert_eq!(v["text"], "t");
        }
    }

    #[test]
    fn env_vars_must_be_text() {
        let m = |v: Value| v.as_object().cloned();
        assert_eq!(
            env_vars(m(json!({"A": "1"}))).unwrap(),
            BTreeMap::from([("A".to_string(), "1".to_string())])
        );
        assert!(env_vars(None).unwrap().is_empty());
        for bad in [json!({"A": 1}), json!({"A": null}), json!({"A": ["x"]})] {
            let e = env_vars(m(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
    }
}
