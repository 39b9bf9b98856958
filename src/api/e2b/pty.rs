//! Pseudo-terminals of envd's process service, as E2B's SDKs use them (`sandbox.pty`):
//! `Start` with `pty: {size: {rows, cols}}` runs the command (the SDKs ask for `/bin/bash -i
//! -l` with `TERM`, `LANG`, `LC_ALL`) on a terminal whose master the broker holds; its output
//! comes as `pty` data events, `SendInput` with `input.pty` writes to it, `Update` with a
//! `pty` size resizes it, `SendSignal` kills it, `Connect` attaches another client. How the
//! sandbox makes the terminal is its own (`sandbox/local/terminal.rs`, Docker's `Tty`).
//!
//! Bounds: rows and columns 1 to [`MAX_CELLS`] (envd takes any `uint32` and truncates it to
//! 16 bits); input at most one Connect message (`connect::MAX_MESSAGE`), and a write waits
//! at most [`INPUT_WAIT`] for a terminal whose program does not read.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::command::Command;
use super::connect::ConnectError;
use crate::session::{PtySize, ResizeError};

/// The most rows or columns a terminal may have.
pub const MAX_CELLS: u32 = 1000;
/// How long input waits for room in a terminal (its program is not reading).
const INPUT_WAIT: Duration = Duration::from_secs(10);

/// The `pty` message of `Start` and `Update`.
#[derive(Deserialize, Default)]
pub(super) struct PtyReq {
    size: Option<SizeReq>,
}

#[derive(Deserialize, Default)]
struct SizeReq {
    #[serde(default)]
    rows: u32,
    #[serde(default)]
    cols: u32,
}

impl PtyReq {
    /// The size asked for, within bounds.
    pub(super) fn size(&self) -> Result<PtySize, ConnectError> {
        let size = self.size.as_ref().ok_or_else(|| {
            ConnectError::invalid("pty.size is missing: a terminal needs rows and cols")
        })?;
        let check = |what: &str, n: u32| {
            if (1..=MAX_CELLS).contains(&n) {
                // Within 1..=1000: fits in 16 bits.
                Ok(n as u16)
            } else {
                Err(ConnectError::invalid(format!(
                    "pty.size.{what} must be between 1 and {MAX_CELLS}; got {n}"
                )))
            }
        };
        Ok(PtySize {
            rows: check("rows", size.rows)?,
            cols: check("cols", size.cols)?,
        })
    }
}

/// Writes `data` to `cmd`'s terminal (its line discipline echoes and edits it as a
/// keyboard's).
pub(super) async fn write(cmd: &Command, data: &[u8]) -> Result<Value, ConnectError> {
    let mut stdin = cmd.stdin.lock().await;
    let master = stdin
        .as_mut()
        .ok_or_else(|| ConnectError::new("failed_precondition", "the terminal is closed"))?;
    let written = tokio::time::timeout(INPUT_WAIT, async {
        master.write_all(data).await?;
        master.flush().await
    })
    .await;
    match written {
        Ok(Ok(())) => Ok(json!({})),
        Ok(Err(e)) => Err(ConnectError::new(
            "internal",
            format!("error writing to tty: {e}"),
        )),
        Err(_) => Err(ConnectError::new(
            "deadline_exceeded",
            format!(
                "error writing to tty: the terminal took no input for {} s (its program is not reading)",
                INPUT_WAIT.as_secs()
            ),
        )),
    }
}

/// Resizes `cmd`'s terminal.
pub(super) async fn resize(cmd: &Command, size: PtySize) -> Result<(), ConnectError> {
    match cmd.control.resize(size).await {
        Ok(()) => Ok(()),
        Err(ResizeError::NotATerminal) => Err(not_a_terminal("resizing tty")),
        Err(e) => Err(ConnectError::new(
            "internal",
            format!("error resizing tty: {e}"),
        )),
    }
}

/// What envd answers terminal input or a resize for a command without a terminal.
pub(super) fn not_a_terminal(doing: &str) -> ConnectError {
    ConnectError::new(
        "internal",
        format!("error {doing}: tty not assigned to process"),
    )
}

/// What envd answers stdin input for a command on a terminal.
pub(super) fn stdin_of_a_terminal() -> ConnectError {
    ConnectError::new(
        "internal",
        "error writing to stdin: tty assigned to process — input should be written to the pty, not the stdin",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bounded() {
        let req = |v: Value| serde_json::from_value::<PtyReq>(v).unwrap().size();
        let ok = req(json!({"size": {"rows": 24, "cols": 80}})).unwrap();
        assert_eq!(ok, PtySize { rows: 24, cols: 80 });
        assert!(req(json!({"size": {"rows": 1000, "cols": 1}})).is_ok());
        for bad in [
            json!({}),
            json!({"size": {}}),
            json!({"size": {"rows": 0, "cols": 80}}),
            json!({"size": {"rows": 24, "cols": 1001}}),
            json!({"size": {"rows": 65536, "cols": 80}}),
            json!({"size": {"rows": 4294967295u32, "cols": 80}}),
        ] {
            let e = req(bad.clone()).expect_err("refused");
            assert_eq!(e.code, "invalid_argument", "{bad}");
        }
        // Beyond 32 bits, or negative, the message does not parse at all.
        assert!(serde_json::from_value::<PtyReq>(json!({"size": {"rows": -1}})).is_err());
        assert!(serde_json::from_value::<PtyReq>(json!({"size": {"rows": 1u64 << 40}})).is_err());
    }
}
