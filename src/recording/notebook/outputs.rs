//! Kernel output messages as nbformat output objects: `stream`, `display_data`,
//! `execute_result`, `error`, with mimebundles in the shape nbformat accepts, and streams
//! merged as a notebook shows them.

use serde_json::{json, Map, Value};

pub(super) fn object(v: &Value) -> Value {
    match v {
        Value::Object(_) => v.clone(),
        _ => json!({}),
    }
}

/// A mimebundle as nbformat wants it: text values (or lists of them), JSON only for JSON types.
pub(super) fn mimebundle(v: &Value) -> Value {
    let Value::Object(m) = v else {
        return json!({});
    };
    let mut out = Map::new();
    for (k, v) in m {
        let is_json = k.starts_with("application/") && k.ends_with("json");
        let ok = is_json
            || v.is_string()
            || v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        out.insert(
            k.clone(),
            if ok {
                v.clone()
            } else {
                Value::String(v.to_string())
            },
        );
    }
    Value::Object(out)
}

fn strings(v: &Value) -> Vec<Value> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| Value::String(s.as_str().unwrap_or("").to_string()))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn output_of(msg_type: &str, c: &Value) -> Option<Value> {
    Some(match msg_type {
        "stream" => json!({
            "output_type": "stream",
            "name": if c["name"] == "stderr" { "stderr" } else { "stdout" },
            "text": c["text"].as_str().unwrap_or(""),
        }),
        "display_data" => json!({
            "output_type": "display_data",
            "data": mimebundle(&c["data"]),
            "metadata": object(&c["metadata"]),
        }),
        "execute_result" => json!({
            "output_type": "execute_result",
            "data": mimebundle(&c["data"]),
            "metadata": object(&c["metadata"]),
            "execution_count": c["execution_count"].as_u64(),
        }),
        "error" => json!({
            "output_type": "error",
            "ename": c["ename"].as_str().unwrap_or(""),
            "evalue": c["evalue"].as_str().unwrap_or(""),
            "traceback": strings(&c["traceback"]),
        }),
        _ => return None,
    })
}

/// Append an output, merging a stream into the previous one of the same name.
pub(super) fn push_output(outputs: &mut Vec<Value>, output: Value) {
    if output["output_type"] == "stream" {
        if let Some(last) = outputs.last_mut() {
            if last["output_type"] == "stream" && last["name"] == output["name"] {
                let text = format!(
                    "{}{}",
                    last["text"].as_str().unwrap_or(""),
                    output["text"].as_str().unwrap_or("")
                );
                last["text"] = Value::String(text);
                return;
            }
        }
    }
    outputs.push(output);
}
