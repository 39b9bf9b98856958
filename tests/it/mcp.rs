//! MCP at `/mcp` (issue 14) against a real broker with real kernels, spoken as raw HTTP so
//! every error path is seen on the wire: authentication, MCP session ownership (another
//! user's session id answers exactly as an unknown one), malformed and oversized messages,
//! unknown tools and methods, arguments that do not fit, code over the limit, foreign and
//! malformed broker session ids; the MCP session's own broker session (an ordinary one,
//! gone with the MCP session); resumption of an interrupted SSE stream with `Last-Event-ID`;
//! open streams ending when the broker stops. The official SDKs drive the happy paths in
//! protocol-tests/test_mcp*.py.

use crate::common;

use common::{within, Broker, ALICE, BOB};
use serde_json::{json, Value};

/// A raw Streamable HTTP client: one MCP session of one user.
struct Mcp {
    http: reqwest::Client,
    url: String,
    token: String,
    session: Option<String>,
    next_id: u64,
}

/// One server-sent event: its id and its data.
#[derive(Debug)]
struct Event {
    id: Option<String>,
    data: String,
}

/// The SSE events in `text` (complete ones only).
fn events(text: &str) -> Vec<Event> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut id = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.trim_start().to_string());
                }
            }
            Event {
                id,
                data: data.join("\n"),
            }
        })
        .collect()
}

/// The JSON-RPC messages among `events`.
fn messages(events: &[Event]) -> Vec<Value> {
    events
        .iter()
        .filter_map(|e| serde_json::from_str(&e.data).ok())
        .collect()
}

impl Mcp {
    fn new(broker: &Broker, token: &str) -> Self {
        Self {
            http: reqwest::Client::new(),
            url: broker.url("/mcp"),
            token: token.into(),
            session: None,
            next_id: 1,
        }
    }

    fn request(&self, method: reqwest::Method) -> reqwest::RequestBuilder {
        let mut r = self
            .http
            .request(method, &self.url)
            .bearer_auth(&self.token)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json");
        if let Some(s) = &self.session {
            r = r
                .header("mcp-session-id", s)
                .header("mcp-protocol-version", "2025-11-25");
        }
        r
    }

    async fn post(&self, body: &Value) -> reqwest::Response {
        self.request(reqwest::Method::POST)
            .body(body.to_string())
            .send()
            .await
            .unwrap()
    }

    /// The whole body of an answer, read as SSE (or JSON) into JSON-RPC messages.
    async fn read_all(r: reqwest::Response) -> Vec<Value> {
        let json = r
            .headers()
            .get("content-type")
            .is_some_and(|v| v.to_str().unwrap().starts_with("application/json"));
        let text = within(120, "the MCP answer", r.text()).await.unwrap();
        if json {
            vec![serde_json::from_str(&text).unwrap()]
        } else {
            messages(&events(&text))
        }
    }

    /// Initialize and send `initialized`; keeps the session id.
    async fn initialize(&mut self) -> Value {
        let r = self
            .post(
                &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "tests/it/mcp.rs", "version": "1"}}}),
            )
            .await;
        assert_eq!(r.status(), 200);
        self.session = Some(r.headers()["mcp-session-id"].to_str().unwrap().to_string());
        let init = Self::read_all(r).await.remove(0);
        let r = self
            .post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        assert_eq!(r.status(), 202);
        init
    }

    /// A request and its answer (the response message; notifications before it dropped).
    async fn rpc(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let r = self
            .post(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        assert_eq!(r.status(), 200, "{method}");
        Self::read_all(r)
            .await
            .into_iter()
            .find(|m| m["id"] == json!(id))
            .unwrap_or_else(|| panic!("no answer to {method}"))
    }

    async fn call_tool(&mut self, name: &str, arguments: Value) -> Value {
        self.rpc("tools/call", json!({"name": name, "arguments": arguments}))
            .await
    }
}

/// The text blocks of a tool result.
fn texts(answer: &Value) -> Vec<String> {
    answer["result"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("not a tool result: {answer}"))
        .iter()
        .filter_map(|c| c["text"].as_str().map(str::to_string))
        .collect()
}

fn is_error(answer: &Value) -> bool {
    answer["result"]["isError"] == json!(true)
}

#[tokio::test]
async fn tokens_and_mcp_sessions_are_the_users() {
    let broker = Broker::start("local", |_| {}).await;
    let http = reqwest::Client::new();
    // No token, or a bad one: 401 like everywhere.
    for auth in [None, Some("Bearer nope")] {
        let mut r = http.post(broker.url("/mcp")).body("{}");
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401);
    }
    let mut alice = Mcp::new(&broker, ALICE);
    let init = alice.initialize().await;
    assert_eq!(init["result"]["protocolVersion"], "2025-11-25");
    assert_eq!(init["result"]["serverInfo"]["name"], "kernel-broker");
    let tools = alice.rpc("tools/list", json!({})).await;
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    for want in [
        "run_python",
        "upload_file",
        "read_file",
        "list_files",
        "restart_session",
        "interrupt_session",
        "list_sessions",
        "fork_session",
        "checkpoint",
        "list_checkpoints",
        "rewind",
        "pause_session",
        "resume_session",
    ] {
        assert!(names.contains(&want), "{names:?}");
    }

    // Bob with alice's MCP session id is answered as with an id that never existed.
    let mut bob = Mcp::new(&broker, BOB);
    bob.session = alice.session.clone();
    let mut stranger = Mcp::new(&broker, BOB);
    stranger.session = Some(uuid::Uuid::new_v4().to_string());
    let list = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/list"});
    for m in [&bob, &stranger] {
        let r = m.post(&list).await;
        assert_eq!(r.status(), 404);
        assert_eq!(r.text().await.unwrap(), "Not Found: Session not found");
        for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
            let r = m.request(method).send().await.unwrap();
            assert_eq!(r.status(), 404);
            assert_eq!(r.text().await.unwrap(), "Not Found: Session not found");
        }
    }
    // Bob's attempts did not end alice's session.
    let tools = alice.rpc("tools/list", json!({})).await;
    assert!(tools["result"]["tools"].is_array());
    // A request other than initialize without a session is refused.
    let mut nobody = Mcp::new(&broker, ALICE);
    nobody.session = None;
    let r = nobody.post(&list).await;
    assert!(r.status().is_client_error(), "{}", r.status());
    broker.stop().await;
}

#[tokio::test]
async fn bad_input_is_answered_with_what_is_wrong() {
    let broker = Broker::start("local", |a| {
        a.max_code_bytes = Some(1000);
        a.max_file_bytes = Some(3000);
    })
    .await;
    let mut mcp = Mcp::new(&broker, ALICE);
    mcp.initialize().await;

    // Not JSON, not JSON-RPC: JSON-RPC errors, the session carries on.
    let r = mcp
        .request(reqwest::Method::POST)
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    let body = r.text().await.unwrap();
    assert!(body.contains("deserialize"), "{body}");
    // The sessionless revision 2026-07-28 is not spoken: the answer names the ones that are.
    let r = reqwest::Client::new()
        .post(broker.url("/mcp"))
        .bearer_auth(ALICE)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "server/discover")
        .json(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], -32022, "{v}");
    assert_eq!(
        v["error"]["data"]["supported"],
        json!(["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"])
    );
    // Over the message limit (the upload limit as base64 plus room): 413.
    let huge = "x".repeat(200_000);
    let r = mcp
        .post(&json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "run_python", "arguments": {"code": huge}}}))
        .await;
    assert_eq!(r.status(), 413);
    // An unknown method and an unknown tool.
    let a = mcp.rpc("no/such/method", json!({})).await;
    assert_eq!(a["error"]["code"], -32601, "{a}");
    let a = mcp.call_tool("run_pyhton", json!({"code": "1"})).await;
    assert_eq!(a["error"]["code"], -32602, "{a}");
    let m = a["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("\"run_pyhton\"") && m.contains("run_python"),
        "{m}"
    );
    // Arguments that do not fit the schema: tool errors that say which.
    for (args, needle) in [
        (
            json!({"code": 42}),
            "invalid type: integer `42`, expected a string",
        ),
        (json!({}), "missing field `code`"),
        (
            json!({"code": "1", "sesion_id": "x"}),
            "unknown field `sesion_id`",
        ),
    ] {
        let a = mcp.call_tool("run_python", args).await;
        assert!(is_error(&a), "{a}");
        assert!(texts(&a)[0].contains(needle), "{a}");
    }
    // Code over the broker's limit, a bad timeout.
    let a = mcp
        .call_tool("run_python", json!({"code": "#".repeat(1001)}))
        .await;
    assert!(is_error(&a));
    assert_eq!(
        texts(&a)[0],
        "the code has 1001 bytes; the limit is 1000: run it in smaller parts, or upload it as a file and exec it"
    );
    let a = mcp
        .call_tool("run_python", json!({"code": "1", "timeout_seconds": -1}))
        .await;
    assert_eq!(texts(&a), ["timeout_seconds must be a positive number"]);
    // Another user's session reads as a missing one; a malformed id says what ids are.
    let bob = broker.api(BOB).create().await;
    let missing = uuid::Uuid::new_v4().to_string();
    for id in [&bob, &missing] {
        for tool in [
            "run_python",
            "restart_session",
            "interrupt_session",
            "list_files",
        ] {
            let a = mcp
                .call_tool(
                    tool,
                    json!({"code": "1", "session_id": id})
                        .as_object()
                        .map(|o| {
                            let mut o = o.clone();
                            if tool != "run_python" {
                                o.remove("code");
                            }
                            Value::Object(o)
                        })
                        .unwrap(),
                )
                .await;
            assert!(is_error(&a), "{a}");
            assert_eq!(texts(&a), [format!("no session {id}")], "{tool}");
        }
    }
    let a = mcp
        .call_tool("delete_session", json!({"session_id": bob}))
        .await;
    assert_eq!(texts(&a), [format!("no session {bob}")]);
    assert_eq!(
        broker.api(BOB).get(&format!("/v1/sessions/{bob}")).await.0,
        200
    );
    let a = mcp
        .call_tool("run_python", json!({"code": "1", "session_id": "abc"}))
        .await;
    assert_eq!(
        texts(&a),
        ["no session \"abc\" (session ids are UUIDs; see list_sessions)"]
    );
    // Nothing to interrupt before the connection has a session.
    let a = mcp.call_tool("interrupt_session", json!({})).await;
    assert!(
        is_error(&a) && texts(&a)[0].contains("no session yet"),
        "{a}"
    );
    // Files: bad base64, too large, a path that climbs out, a missing file.
    let a = mcp
        .call_tool(
            "upload_file",
            json!({"path": "a.txt", "content_base64": "***"}),
        )
        .await;
    assert!(
        texts(&a)[0].starts_with("content_base64 is not valid base64"),
        "{a}"
    );
    let big = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [0u8; 3001]);
    let a = mcp
        .call_tool(
            "upload_file",
            json!({"path": "a.bin", "content_base64": big}),
        )
        .await;
    assert!(is_error(&a) && texts(&a)[0].contains("limit"), "{a}");
    let a = mcp
        .call_tool(
            "upload_file",
            json!({"path": "../etc/x", "content_base64": "eA=="}),
        )
        .await;
    assert!(is_error(&a), "{a}");
    let a = mcp
        .call_tool("read_file", json!({"path": "missing.csv"}))
        .await;
    assert!(is_error(&a), "{a}");
    // Resources that do not exist, another user's notebook included.
    for uri in [
        format!("kernel-broker://sessions/{bob}/notebook.ipynb"),
        "kernel-broker://workspace/../x".to_string(),
        "file:///etc/passwd".to_string(),
    ] {
        let a = mcp.rpc("resources/read", json!({"uri": uri})).await;
        assert_eq!(a["error"]["code"], -32002, "{a}");
        assert!(
            a["error"]["message"].as_str().unwrap().contains(&uri),
            "{a}"
        );
    }
    broker.api(BOB).delete(&format!("/v1/sessions/{bob}")).await;
    broker.stop().await;
}

#[tokio::test]
async fn the_mcp_sessions_own_session_is_a_broker_session() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let mut mcp = Mcp::new(&broker, ALICE);
    mcp.initialize().await;
    let a = mcp.call_tool("run_python", json!({"code": "x = 41"})).await;
    assert!(!is_error(&a), "{a}");
    let a = mcp.call_tool("run_python", json!({"code": "x + 1"})).await;
    assert_eq!(texts(&a), ["42"]);
    let (_, sessions) = api.get("/v1/sessions").await;
    let sessions = sessions.as_array().unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    let id = sessions[0]["id"].as_str().unwrap().to_string();
    // Executions through MCP are the session's like any other.
    assert_eq!(sessions[0]["execution_count"], 2, "{sessions:?}");
    // A second session, named explicitly, keeps its own state.
    let made = mcp.call_tool("create_session", json!({})).await;
    let other: Value = serde_json::from_str(&texts(&made)[0]).unwrap();
    let other = other["id"].as_str().unwrap().to_string();
    let a = mcp
        .call_tool(
            "run_python",
            json!({"code": "'x' in globals()", "session_id": other}),
        )
        .await;
    assert_eq!(texts(&a), ["False"]);
    let a = mcp
        .call_tool("delete_session", json!({"session_id": other}))
        .await;
    assert!(!is_error(&a), "{a}");
    // Restart clears the state.
    let a = mcp.call_tool("restart_session", json!({})).await;
    assert!(!is_error(&a), "{a}");
    let a = mcp.call_tool("run_python", json!({"code": "x"})).await;
    assert!(is_error(&a));
    assert!(
        texts(&a)
            .last()
            .unwrap()
            .starts_with("NameError: name 'x' is not defined"),
        "{a}"
    );
    // Ending the MCP session ends its session; its id is then unknown.
    let r = mcp.request(reqwest::Method::DELETE).send().await.unwrap();
    assert_eq!(r.status(), 204);
    within(10, "the session's end", async {
        while api.get(&format!("/v1/sessions/{id}")).await.0 == 200 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    let r = mcp
        .post(&json!({"jsonrpc": "2.0", "id": 99, "method": "tools/list"}))
        .await;
    assert_eq!(r.status(), 404);
    // Its recording stays: the notebook has both cells.
    let (status, nb) = api.get(&format!("/v1/sessions/{id}/notebook")).await;
    assert_eq!(status, 200);
    let sources: Vec<String> = nb["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["source"].to_string())
        .collect();
    assert!(sources.iter().any(|s| s.contains("x = 41")), "{sources:?}");
    broker.stop().await;
}

#[tokio::test]
async fn an_interrupted_stream_resumes_and_open_streams_end_at_stop() {
    let broker = Broker::start("local", |_| {}).await;
    let mut mcp = Mcp::new(&broker, ALICE);
    mcp.initialize().await;
    // Warm the kernel up, so the run below is what takes time.
    mcp.call_tool("run_python", json!({"code": "1"})).await;
    let mut r = mcp
        .post(
            &json!({"jsonrpc": "2.0", "id": 50, "method": "tools/call", "params": {
            "name": "run_python",
            "arguments": {"code": "import time\ntime.sleep(1.5)\nprint('after the break')"}}}),
        )
        .await;
    assert_eq!(r.status(), 200);
    // Read up to the first event that has an id (the stream's priming event), then drop
    // the connection, as a network break would.
    let mut seen = String::new();
    let last_id = within(10, "the priming event", async {
        loop {
            let chunk = r.chunk().await.unwrap().expect("the stream ended early");
            seen.push_str(&String::from_utf8_lossy(&chunk));
            if let Some(id) = events(&seen).iter().rev().find_map(|e| e.id.clone()) {
                return id;
            }
        }
    })
    .await;
    drop(r);
    // Resume with Last-Event-ID: the result arrives on the new stream.
    let r = mcp
        .request(reqwest::Method::GET)
        .header("last-event-id", &last_id)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "resume after {last_id}");
    let mut r = r;
    let mut text = String::new();
    let answer = within(30, "the resumed result", async {
        loop {
            let chunk = r.chunk().await.unwrap().expect("the resumed stream ended");
            text.push_str(&String::from_utf8_lossy(&chunk));
            if let Some(m) = messages(&events(&text)).into_iter().find(|m| m["id"] == 50) {
                return m;
            }
        }
    })
    .await;
    drop(r);
    assert_eq!(texts(&answer), ["after the break\n"], "{answer}");

    // The session's standalone stream stays open until the broker stops; the stop does
    // not wait for it.
    let mut standalone = mcp.request(reqwest::Method::GET).send().await.unwrap();
    assert_eq!(standalone.status(), 200);
    let reader = tokio::spawn(async move { while let Ok(Some(_)) = standalone.chunk().await {} });
    within(30, "a stop with an open MCP stream", broker.stop()).await;
    within(10, "the stream's end", reader).await.unwrap();
}

#[tokio::test]
async fn running_code_is_interrupted_by_the_tool_or_a_cancel_and_long_output_is_cut() {
    let broker = Broker::start("local", |a| a.output_limit = Some(1000)).await;
    let mut mcp = Mcp::new(&broker, ALICE);
    mcp.initialize().await;
    let a = mcp
        .call_tool("run_python", json!({"code": "kept = 7"}))
        .await;
    assert!(!is_error(&a), "{a}");

    // interrupt_session from a second request while run_python runs.
    let running = {
        let request = mcp.request(reqwest::Method::POST).body(
            json!({"jsonrpc": "2.0", "id": 70, "method": "tools/call", "params": {
                "name": "run_python",
                "arguments": {"code": "import time\nfor i in range(600):\n    time.sleep(0.1)"}}})
            .to_string(),
        );
        tokio::spawn(async move { Mcp::read_all(request.send().await.unwrap()).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let a = mcp.call_tool("interrupt_session", json!({})).await;
    assert!(!is_error(&a), "{a}");
    let answer = within(30, "the interrupted run", running).await.unwrap();
    let answer = answer.into_iter().find(|m| m["id"] == 70).unwrap();
    assert!(is_error(&answer), "{answer}");
    assert!(
        texts(&answer)
            .last()
            .unwrap()
            .starts_with("the run was interrupted"),
        "{answer}"
    );

    // A call the client cancels interrupts its code; the state stays.
    let started = std::time::Instant::now();
    let request = mcp.request(reqwest::Method::POST).body(
        json!({"jsonrpc": "2.0", "id": 71, "method": "tools/call", "params": {
            "name": "run_python",
            "arguments": {"code": "import time\ntime.sleep(60)"}}})
        .to_string(),
    );
    let cancelled = tokio::spawn(async move {
        let _ = request.send().await.map(|r| r.text());
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let r = mcp
        .post(
            &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": 71, "reason": "the user changed their mind"}}),
        )
        .await;
    assert_eq!(r.status(), 202);
    let a = within(
        30,
        "the run after the cancel",
        mcp.call_tool("run_python", json!({"code": "kept"})),
    )
    .await;
    assert_eq!(texts(&a), ["7"], "{a}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    cancelled.abort();

    // Output past the limit is cut, and the result says so.
    let a = mcp
        .call_tool("run_python", json!({"code": "print('x' * 5000)"}))
        .await;
    assert!(!is_error(&a), "{a}");
    let t = texts(&a);
    assert!(t[0].len() <= 1100, "{}", t[0].len());
    assert!(
        t.last()
            .unwrap()
            .starts_with("[output truncated: the broker keeps at most 1000 characters"),
        "{t:?}"
    );
    broker.stop().await;
}
