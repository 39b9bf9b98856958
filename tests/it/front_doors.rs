//! The front door that made a session owns its life (issue 34, item 1): a Jupyter client
//! shutting down a session the agent API made only lets go of it, while a kernel the Jupyter
//! API made ends as before; every end of a session and every detach is recorded with who
//! did it; the metadata a client gives a session at creation is kept, shown and bounded.

use futures::StreamExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::common::*;

/// The broker events of session `id`, kind and detail.
async fn broker_events(api: &Api, id: &str) -> Vec<(String, Value)> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?channel=broker"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().expect("a broker event").to_string(),
                e["detail"].clone(),
            )
        })
        .collect()
}

/// The broker events of a session that was ended, once its close is among them: the
/// recording is written behind the sessions (a batch writer), so the close may be read a
/// moment after the request that ended it was answered (at most 10 s).
async fn events_once_closed(api: &Api, id: &str) -> Vec<(String, Value)> {
    let mut events = broker_events(api, id).await;
    for _ in 0..100 {
        if !of_kind(&events, "session_closed").is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        events = broker_events(api, id).await;
    }
    events
}

fn of_kind<'a>(events: &'a [(String, Value)], kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(k, _)| k == kind)
        .map(|(_, d)| d)
        .collect()
}

/// A Jupyter client's `shutdown_request` on the control channel, answered on the socket.
async fn shutdown_over_channels(broker: &Broker, id: &str) -> Value {
    let mut ws = jupyter_channels(broker, id, "lab-1").await;
    let content = json!({"restart": false});
    let msg_id = jupyter_send(&mut ws, "lab-1", ("control", "shutdown_request"), content).await;
    let reply = within(30, "shutdown_reply", async {
        loop {
            if let WsMessage::Text(t) = ws.next().await.unwrap().unwrap() {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["msg_type"] == "shutdown_reply" {
                    return v;
                }
            }
        }
    })
    .await;
    assert_eq!(reply["parent_header"]["msg_id"], msg_id.as_str());
    reply
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jupyter_lets_go_of_an_agents_session_and_ends_only_its_own() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let (status, made) = api
        .post(
            "/v1/sessions",
            json!({"metadata": {"agent": "analyst", "run": "7"}}),
        )
        .await;
    assert_eq!(status, 201, "{made}");
    let id = made["id"].as_str().unwrap().to_string();
    assert_eq!(made["front_door"], "rest");
    assert_eq!(made["metadata"], json!({"agent": "analyst", "run": "7"}));
    assert_eq!(api.execute(&id, "kept = 41").await["status"], "ok");

    // JupyterLab stopping: a shutdown_request on the channels, then DELETE /api/kernels.
    let reply = shutdown_over_channels(&broker, &id).await;
    assert_eq!(reply["channel"], "control");
    assert_eq!(reply["content"]["status"], "ok");
    let (status, body) = api.delete(&format!("/api/kernels/{id}")).await;
    assert_eq!(status, 204, "{body}");

    // The agent's session lives on, with its variables.
    let (status, info) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["state"], "idle", "{info}");
    let x = api.execute(&id, "print(kept + 1)").await;
    assert_eq!(x["stdout"], "42\n", "{x}");

    // A kernel the Jupyter API made ends when Jupyter asks.
    let (status, kernel) = api.post("/api/kernels", json!({})).await;
    assert_eq!(status, 201, "{kernel}");
    let jid = kernel["id"].as_str().unwrap().to_string();
    let (_, jinfo) = api.get(&format!("/v1/sessions/{jid}")).await;
    assert_eq!(jinfo["front_door"], "jupyter");
    let (status, _) = api.delete(&format!("/api/kernels/{jid}")).await;
    assert_eq!(status, 204);
    let (status, _) = api.get(&format!("/api/kernels/{jid}")).await;
    assert_eq!(status, 404, "a Jupyter kernel ends when Jupyter deletes it");

    // The agent's own API ends its session.
    let (status, _) = api.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);

    // The recordings say who made, detached and ended each.
    let events = events_once_closed(&api, &id).await;
    let created = of_kind(&events, "session_created");
    assert_eq!(created.len(), 1, "{events:?}");
    assert_eq!(created[0]["front_door"], "rest");
    assert_eq!(created[0]["metadata"]["agent"], "analyst");
    let detached = of_kind(&events, "session_detached");
    assert_eq!(
        detached,
        vec![&json!({"by": "jupyter"}), &json!({"by": "jupyter"})],
        "one for the shutdown_request, one for the DELETE: {events:?}"
    );
    assert_eq!(
        of_kind(&events, "session_closed"),
        vec![&json!({"by": "rest"})]
    );
    let jevents = events_once_closed(&api, &jid).await;
    assert_eq!(
        of_kind(&jevents, "session_created")[0]["front_door"],
        "jupyter"
    );
    assert_eq!(
        of_kind(&jevents, "session_closed"),
        vec![&json!({"by": "jupyter"})]
    );
    assert!(of_kind(&jevents, "session_detached").is_empty());
    // And the notebook export says it in words.
    let (_, nb) = api.get(&format!("/v1/sessions/{id}/notebook")).await;
    let text = nb.to_string();
    assert!(text.contains("jupyter let go of the session"), "{text}");
    assert!(text.contains("The session was closed by rest"), "{text}");
    broker.stop().await;
}

/// Metadata is bounded and typed: what is outside the bounds is refused with the reason,
/// and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_metadata_beyond_its_bounds_is_refused() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (metadata, says) in [
        (Value::Object(many), "33 entries; at most 32"),
        (json!({"k".repeat(65): "v"}), "keys are 1 to 64 bytes"),
        (json!({"": "v"}), "keys are 1 to 64 bytes"),
        (json!({"k": "v".repeat(1025)}), "at most 1024"),
        (json!({"bad\u{7}key": "v"}), "control character"),
        (json!({"n": 1}), "expected a string"),
        (json!(["a"]), "expected a map"),
    ] {
        let (status, body) = api
            .post("/v1/sessions", json!({ "metadata": metadata }))
            .await;
        assert_eq!(status, 400, "{metadata}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{says:?} in {body}");
    }
    let (_, list) = api.get("/v1/sessions").await;
    assert_eq!(list, json!([]), "nothing was created");
    // Another user never sees alice's metadata.
    let (status, made) = api
        .post("/v1/sessions", json!({"metadata": {"secret": "alice's"}}))
        .await;
    assert_eq!(status, 201);
    let (_, bobs) = broker.api(BOB).get("/v1/sessions").await;
    assert_eq!(bobs, json!([]), "{made}");
    broker.stop().await;
}
