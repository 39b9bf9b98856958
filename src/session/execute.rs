//! The one way a front door runs code: an [`ExecuteRequest`] made from what the client sent
//! (checked once here: the code's size, the timeout asked for against the broker's
//! maximum), given to [`Session::submit`] with where its output streams and who asked.
//! The agent REST API, its WebSocket, E2B's interpreter and MCP's `run_python` each
//! translate their protocol into one and the answer back; none checks limits itself.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::command::ExecRequest;
use super::error::SessionError;
use super::execution::{Execution, OutputEvent};
use super::handle::Session;
use super::hooks::KernelHooks;
use crate::sandbox::environ::check_user_env;

/// The bounds every execution is checked against.
#[derive(Debug, Clone, Copy)]
pub struct ExecutionLimits {
    /// Bytes of code an execution may have.
    pub max_code_bytes: usize,
    /// The timeout of a request that asks for none.
    pub default_timeout: Duration,
    /// The most a request may ask for (more is capped to it).
    pub max_timeout: Duration,
}

/// The timeout a request asks for.
#[derive(Debug, Clone, Copy)]
pub enum Timeout {
    /// Seconds the client asked for (`None`: the default); capped by the maximum.
    Asked(Option<f64>),
    /// The broker's maximum (a client that enforces its own timeout).
    Maximum,
}

/// Which front door asked (logged with the execution).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `POST /v1/sessions/{id}/execute`.
    Rest,
    /// The agent WebSocket (`/v1/sessions/{id}/stream`).
    WebSocket,
    /// E2B's code interpreter (`/execute`).
    E2b,
    /// MCP's `run_python` tool.
    Mcp,
}

/// Code to run, checked against the limits.
pub struct ExecuteRequest {
    code: String,
    timeout: Duration,
    origin: Origin,
    allow_stdin: bool,
    stream: Option<mpsc::Sender<OutputEvent>>,
    hooks: Option<KernelHooks>,
    env_code: Option<super::env_code::EnvCode>,
}

impl ExecuteRequest {
    /// `code` to run within `timeout`, refused when the code is over the limit
    /// ([`SessionError::CodeTooLarge`]) or the timeout is not a positive number
    /// ([`SessionError::InvalidTimeout`]), in that order.
    pub fn new(
        code: String,
        timeout: Timeout,
        origin: Origin,
        limits: &ExecutionLimits,
    ) -> Result<Self, SessionError> {
        if code.len() > limits.max_code_bytes {
            return Err(SessionError::CodeTooLarge {
                bytes: code.len(),
                limit: limits.max_code_bytes,
            });
        }
        let timeout = match timeout {
            Timeout::Maximum => limits.max_timeout,
            Timeout::Asked(None) => limits.default_timeout,
            Timeout::Asked(Some(s)) if s.is_finite() && s > 0.0 => {
                Duration::from_secs_f64(s.min(limits.max_timeout.as_secs_f64()))
            }
            Timeout::Asked(Some(seconds)) => return Err(SessionError::InvalidTimeout { seconds }),
        };
        Ok(Self {
            code,
            timeout,
            origin,
            allow_stdin: false,
            stream: None,
            hooks: None,
            env_code: None,
        })
    }

    /// Runs with E2B's result formats, and `env` set for this execution alone (checked as
    /// a sandbox's variables are, [`check_user_env`]: a refusal is
    /// [`SessionError::InvalidEnv`]).
    pub fn e2b(mut self, env: BTreeMap<String, String>) -> Result<Self, SessionError> {
        check_user_env(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(|source| SessionError::InvalidEnv { source })?;
        self.hooks = Some(KernelHooks { e2b: true, env });
        Ok(self)
    }

    /// For a kernel of `language` (its spec's): its variables ([`Self::e2b`]) are set and
    /// put back by code of that language when the kernel has no hooks to apply them
    /// ([`super::env_code`]).
    pub fn in_language(mut self, language: &str) -> Self {
        if let Some(hooks) = &self.hooks {
            if !super::env_code::applied_by_kernel(language) {
                self.env_code = super::env_code::for_language(language, &hooks.env);
            }
        }
        self
    }

    /// Output events as they happen go to `sink`; dropped (never awaited) when the client
    /// falls behind: the result still has them all.
    pub fn streaming(mut self, sink: mpsc::Sender<OutputEvent>) -> Self {
        self.stream = Some(sink);
        self
    }

    /// `input()` may ask the client (only a streaming client that can answer).
    pub fn with_stdin(mut self) -> Self {
        self.allow_stdin = true;
        self
    }

    /// The timeout the execution runs with (capped).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Session {
    /// Queues `request`; its result comes on the receiver once it finished (and was
    /// recorded). A full queue is [`SessionError::ExecutionsWaiting`].
    pub fn submit(
        &self,
        request: ExecuteRequest,
    ) -> Result<oneshot::Receiver<Execution>, SessionError> {
        let (done, result) = oneshot::channel();
        tracing::debug!(session = %self.id, origin = ?request.origin, bytes = request.code.len(), "execution queued");
        self.execute(ExecRequest {
            code: request.code,
            timeout: request.timeout,
            allow_stdin: request.allow_stdin,
            stream: request.stream,
            hooks: request.hooks,
            env_code: request.env_code,
            checked: true,
            done,
        })?;
        Ok(result)
    }

    /// Runs `request` and waits for its result.
    pub async fn run(&self, request: ExecuteRequest) -> Result<Execution, SessionError> {
        let result = self.submit(request)?;
        result.await.map_err(|_| SessionError::Closed(self.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    const LIMITS: ExecutionLimits = ExecutionLimits {
        max_code_bytes: 10,
        default_timeout: Duration::from_secs(60),
        max_timeout: Duration::from_secs(600),
    };

    fn timeout_of(t: Timeout) -> Result<Duration, String> {
        ExecuteRequest::new("1".into(), t, Origin::Rest, &LIMITS)
            .map(|r| r.timeout())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn timeouts_are_resolved_and_capped() {
        for (asked, want) in [
            (Timeout::Asked(None), Ok(Duration::from_secs(60))),
            (Timeout::Asked(Some(1.5)), Ok(Duration::from_millis(1500))),
            (Timeout::Asked(Some(1e9)), Ok(Duration::from_secs(600))),
            (Timeout::Maximum, Ok(Duration::from_secs(600))),
            (
                Timeout::Asked(Some(0.0)),
                Err("timeout_seconds must be a positive number".to_string()),
            ),
            (
                Timeout::Asked(Some(f64::NAN)),
                Err("timeout_seconds must be a positive number".to_string()),
            ),
        ] {
            assert_eq!(timeout_of(asked), want, "{asked:?}");
        }
    }

    #[test]
    fn an_executions_variables_are_checked_like_a_sandboxs() {
        let req =
            || ExecuteRequest::new("1".into(), Timeout::Maximum, Origin::E2b, &LIMITS).unwrap();
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let ok = req().e2b(env(&[("API_KEY", "s3cret")])).unwrap();
        assert_eq!(
            ok.hooks.as_ref().unwrap().metadata(),
            Bytes::from_static(br#"{"kernel_broker":{"e2b":true,"env":{"API_KEY":"s3cret"}}}"#)
        );
        let plain = req().e2b(BTreeMap::new()).unwrap();
        assert_eq!(
            plain.hooks.unwrap().metadata(),
            Bytes::from_static(br#"{"kernel_broker":{"e2b":true}}"#)
        );
        let huge = "x".repeat(1 << 20);
        for bad in [
            env(&[("LD_PRELOAD", "/tmp/x.so")]),
            env(&[("1BAD", "x")]),
            env(&[("A B", "x")]),
            env(&[("", "x")]),
            env(&[("NUL", "a\0b")]),
            env(&[("BIG", huge.as_str())]),
        ] {
            let e = req().e2b(bad).err().unwrap();
            assert!(matches!(e, SessionError::InvalidEnv { .. }), "{e}");
            assert!(e.to_string().starts_with("envs: "), "{e}");
        }
    }

    #[test]
    fn a_reply_acknowledges_the_variables_only_with_the_kernels_word() {
        assert!(KernelHooks::env_acknowledged(
            br#"{"status": "ok", "kernel_broker_env": "restored"}"#
        ));
        for no in [
            &br#"{"status": "ok"}"#[..],
            br#"{"kernel_broker_env": 1}"#,
            br#"{"kernel_broker_env": "no"}"#,
            b"not json",
        ] {
            assert!(!KernelHooks::env_acknowledged(no));
        }
    }

    #[test]
    fn code_over_the_limit_is_refused_before_the_timeout_is_read() {
        let e = ExecuteRequest::new(
            "x".repeat(11),
            Timeout::Asked(Some(-1.0)),
            Origin::Mcp,
            &LIMITS,
        )
        .err()
        .unwrap();
        assert!(matches!(
            e,
            SessionError::CodeTooLarge {
                bytes: 11,
                limit: 10
            }
        ));
        assert_eq!(e.to_string(), "the code has 11 bytes; the limit is 10");
    }
}
