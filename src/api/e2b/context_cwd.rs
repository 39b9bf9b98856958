//! A code-interpreter context's working directory (`create_code_context(cwd=...)`): any
//! directory the sandbox can see, as E2B's server allows. The path is one of the
//! sandbox's: it is handed to the context's own kernel, which changes to it
//! (`os.chdir`, as E2B's server runs `%cd` in the kernel), and never looked up on the host.
//! A directory that is not there (or not one, or not the kernel's to enter) answers E2B's
//! server's error for it: 500, "Failed to set working directory".

use axum::http::StatusCode;

use super::{E2bError, E2bResult, WORKDIR, WORKSPACE_ALIAS};
use crate::api::AppState;
use crate::session::Session;

/// The longest working directory taken (Linux's `PATH_MAX`).
const MAX_CWD: usize = 4096;

/// The context's working directory: `None` when it is the kernel's own already (none
/// given, empty, or the sandbox's home); refused (400) with a NUL byte or past
/// [`MAX_CWD`] bytes.
pub(super) fn asked(cwd: Option<&str>) -> E2bResult<Option<String>> {
    let Some(cwd) = cwd.filter(|c| !c.is_empty()) else {
        return Ok(None);
    };
    if cwd.contains('\0') {
        return Err(E2bError::bad_request("cwd contains a NUL byte"));
    }
    if cwd.len() > MAX_CWD {
        return Err(E2bError::bad_request(format!(
            "cwd is longer than {MAX_CWD} bytes"
        )));
    }
    let home = [WORKDIR, WORKSPACE_ALIAS]
        .iter()
        .any(|d| cwd.trim_end_matches('/') == *d);
    Ok((!home).then(|| cwd.to_string()))
}

/// The Python that changes the kernel's working directory to `cwd`: the path as a string
/// literal (a JSON string is one in Python), so nothing of it is code.
fn chdir_code(cwd: &str) -> String {
    let literal = serde_json::Value::String(cwd.to_string()).to_string();
    format!("__import__('os').chdir({literal})")
}

/// Changes `session`'s kernel to `cwd`; E2B's error when it cannot.
pub(super) async fn apply(state: &AppState, session: &Session, cwd: &str) -> E2bResult<()> {
    let run = session
        .execute_wait(chdir_code(cwd), state.limits.execution_timeout)
        .await?;
    match run.error {
        None => Ok(()),
        Some(e) => Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Failed to set working directory: {}: {}", e.ename, e.evalue),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_directories_are_checked_and_quoted() {
        assert_eq!(asked(None).unwrap(), None);
        assert_eq!(asked(Some("")).unwrap(), None);
        assert_eq!(asked(Some("/home/user/")).unwrap(), None);
        assert_eq!(asked(Some("/workspace")).unwrap(), None);
        assert_eq!(asked(Some("/tmp")).unwrap(), Some("/tmp".into()));
        assert_eq!(asked(Some("../../etc")).unwrap(), Some("../../etc".into()));
        assert_eq!(
            asked(Some("a\0b")).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let long = "/x".repeat(MAX_CWD);
        assert_eq!(
            asked(Some(&long)).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            chdir_code("/tmp/it's \"x\"\n"),
            r#"__import__('os').chdir("/tmp/it's \"x\"\n")"#
        );
    }
}
