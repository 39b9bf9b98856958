//! The command line client: `kernel-broker sessions`, `exec`, `console`, `files`, `kill` against a
//! running broker's agent API (`/v1`, docs/API.md), as the user of a token. The URL and the
//! token come from flags or `KERNEL_BROKER_URL` / `KERNEL_BROKER_TOKEN`; without a token the
//! one a broker keeps in `./.data` (`kernel-broker token`) is used when there is one.
//!
//! Each command is a thin translation of the API: what it prints is what the API answered,
//! and an error says what went wrong and what to do (start a broker, give the token, name a
//! session of yours). Exit status: 0 on success, 1 when the code or the request failed (an
//! execution's `error`, `timeout`, `interrupted` or `dead`; an API error), 2 when the broker
//! cannot be reached or refused the token.

mod console;
mod exec;
mod files;
mod sessions;

use std::path::PathBuf;

use serde_json::Value;

pub use console::{console, ConsoleArgs};
pub use exec::{exec, ExecArgs};
pub use files::{files, FilesAction, FilesArgs};
pub use sessions::{fork, kill, sessions};

/// Where the broker is and who the caller is (flags of every client command).
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// The broker's address.
    #[arg(
        long,
        env = "KERNEL_BROKER_URL",
        default_value = "http://127.0.0.1:8888"
    )]
    pub url: String,
    /// The caller's token [default: the one a broker keeps in ./.data, if any]
    #[arg(long, env = "KERNEL_BROKER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Why a command failed; its exit status with [`CliError::status`].
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("no broker answers at {url} ({source}); start one (scripts/serve) or give its address with --url or KERNEL_BROKER_URL")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("no token: give --token or KERNEL_BROKER_TOKEN (`kernel-broker token` prints the one a broker keeps in its data directory)")]
    NoToken,
    #[error("the broker refused the token (401): give the right one with --token or KERNEL_BROKER_TOKEN")]
    Unauthorized,
    #[error("{message} ({status} {code})")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    #[error("{0}")]
    Local(String),
    /// The code ran and did not succeed (already printed).
    #[error("the execution ended {0}")]
    Execution(String),
}

impl CliError {
    /// The process's exit status for this error.
    pub fn status(&self) -> i32 {
        match self {
            CliError::Unreachable { .. } | CliError::NoToken | CliError::Unauthorized => 2,
            _ => 1,
        }
    }
}

/// A broker, as the caller reaches it.
pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    pub(crate) fn new(args: &ClientArgs) -> Result<Self, CliError> {
        let token = match &args.token {
            Some(t) if !t.is_empty() => t.clone(),
            _ => crate::kept_token::kept_token(&PathBuf::from(".data"))
                .ok()
                .flatten()
                .ok_or(CliError::NoToken)?,
        };
        Ok(Self {
            http: reqwest::Client::new(),
            base: args.url.trim_end_matches('/').to_string(),
            token,
        })
    }

    /// `method path` with an optional JSON body; the answer's status and body.
    pub(crate) async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, CliError> {
        let response = request
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|source| CliError::Unreachable {
                url: self.base.clone(),
                source,
            })?;
        let status = response.status().as_u16();
        if status == 401 {
            return Err(CliError::Unauthorized);
        }
        if status >= 400 {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let error = &body["error"];
            return Err(CliError::Api {
                status,
                code: error["code"].as_str().unwrap_or("error").to_string(),
                message: error["message"]
                    .as_str()
                    .unwrap_or("the broker answered with an error")
                    .to_string(),
            });
        }
        Ok(response)
    }

    pub(crate) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    /// A request to the path of these segments, each percent-encoded (a workspace path's
    /// components may hold spaces, `?` or `#`).
    pub(crate) fn request_to(
        &self,
        method: reqwest::Method,
        segments: &[&str],
    ) -> Result<reqwest::RequestBuilder, CliError> {
        let mut url = reqwest::Url::parse(&self.base)
            .map_err(|e| CliError::Local(format!("--url {:?} is not a URL: {e}", self.base)))?;
        url.path_segments_mut()
            .map_err(|()| CliError::Local(format!("--url {:?} cannot have a path", self.base)))?
            .pop_if_empty()
            .extend(segments);
        Ok(self.http.request(method, url))
    }

    /// A JSON answer of `method path` (with `body`).
    pub(crate) async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, CliError> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = self.send(request).await?;
        if response.status() == reqwest::StatusCode::NO_CONTENT {
            return Ok(Value::Null);
        }
        response
            .json()
            .await
            .map_err(|e| CliError::Local(format!("the broker's answer is not JSON: {e}")))
    }
}

/// Writes a chart (`image/png`, base64, as the API gives it) to `path`.
pub(crate) fn save_chart(png: &str, path: &std::path::Path) -> Result<(), CliError> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png.trim())
        .map_err(|e| CliError::Local(format!("a chart that is not base64: {e}")))?;
    std::fs::write(path, bytes)
        .map_err(|e| CliError::Local(format!("cannot save the chart to {}: {e}", path.display())))
}

/// What an error shows: its traceback, or `ename: evalue` when it has none (an
/// Execution's `error`, or the stream's `error` frame: both have these fields).
pub(crate) fn error_text(error: &Value) -> String {
    let traceback: Vec<&str> = error["traceback"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if traceback.is_empty() {
        format!(
            "{}: {}",
            error["ename"].as_str().unwrap_or("Error"),
            error["evalue"].as_str().unwrap_or("")
        )
    } else {
        traceback.join("\n")
    }
}

/// A session id as the user typed it: a whole id, or the start of one of theirs (as the
/// session browser shows 8 characters).
pub(crate) async fn resolve_session(client: &Client, given: &str) -> Result<String, CliError> {
    if uuid::Uuid::parse_str(given).is_ok() {
        return Ok(given.to_string());
    }
    let list = client
        .json(reqwest::Method::GET, "/v1/sessions", None)
        .await?;
    let ids: Vec<&str> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str())
        .filter(|id| !given.is_empty() && id.starts_with(given))
        .collect();
    match ids.as_slice() {
        [one] => Ok(one.to_string()),
        [] => Err(CliError::Local(format!(
            "no session of yours starts with {given:?} (`kernel-broker sessions` lists them)"
        ))),
        _ => Err(CliError::Local(format!(
            "{} of your sessions start with {given:?}: give more of the id",
            ids.len()
        ))),
    }
}
