//! `kernel-broker exec SESSION CODE|-`: runs code in a session of the caller's (or in a new
//! one: `new`) and prints what it gave: stdout to stdout, stderr and the error's traceback to
//! stderr, each result's text to stdout, charts (`image/png`) saved to files whose paths are
//! printed. The exit status says how the execution ended (0: `ok`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{error_text, resolve_session, save_chart, CliError, Client, ClientArgs};

/// What `exec` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct ExecArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// A session of yours (its id, or the start of it), or `new` for a new session.
    pub session: String,
    /// The code, or `-` to read it from standard input.
    pub code: String,
    /// Seconds before the execution is interrupted [default: the broker's]
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Where charts are saved.
    #[arg(long, default_value = ".")]
    pub charts: PathBuf,
    /// With `new`: give the new session the secret NAME, its value read from this
    /// command's own environment variable NAME (never from the command line, which other
    /// users can see); repeat for more. Its output shows `[secret:NAME]` for the value.
    #[arg(long = "secret", value_name = "NAME")]
    pub secrets: Vec<String>,
}

/// The secrets `names` asks for, each valued from the environment (`env`).
fn secrets_from(
    names: &[String],
    env: impl Fn(&str) -> Option<String>,
) -> Result<serde_json::Map<String, serde_json::Value>, CliError> {
    names
        .iter()
        .map(|n| match env(n) {
            Some(v) => Ok((n.clone(), serde_json::Value::String(v))),
            None => Err(CliError::Local(format!(
                "--secret {n}: set the environment variable {n} to its value (it is read \
                 from there, never from the command line)"
            ))),
        })
        .collect()
}

pub async fn exec(args: &ExecArgs) -> Result<(), CliError> {
    let client = Client::new(&args.client)?;
    let code = if args.code == "-" {
        let mut code = String::new();
        std::io::stdin()
            .read_to_string(&mut code)
            .map_err(|e| CliError::Local(format!("cannot read the code from stdin: {e}")))?;
        code
    } else {
        args.code.clone()
    };
    if !args.secrets.is_empty() && args.session != "new" {
        return Err(CliError::Local(
            "--secret gives a new session its secrets: use it with `new`".into(),
        ));
    }
    let secrets = secrets_from(&args.secrets, |n| std::env::var(n).ok())?;
    let id = if args.session == "new" {
        let body = if secrets.is_empty() {
            json!({})
        } else {
            json!({ "secrets": secrets })
        };
        let made = client
            .json(reqwest::Method::POST, "/v1/sessions", Some(body))
            .await?;
        let id = made["id"].as_str().unwrap_or_default().to_string();
        eprintln!("session {id}");
        id
    } else {
        resolve_session(&client, &args.session).await?
    };
    let mut body = json!({ "code": code });
    if let Some(t) = args.timeout {
        body["timeout_seconds"] = t.into();
    }
    let x = client
        .json(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/execute"),
            Some(body),
        )
        .await?;
    print_execution(&x, &args.charts)?;
    match x["status"].as_str() {
        Some("ok") => Ok(()),
        other => Err(CliError::Execution(other.unwrap_or("unknown").to_string())),
    }
}

/// Prints an Execution (docs/API.md) as a terminal shows a cell's output; charts are saved
/// in `charts` and their paths printed on stderr.
pub(crate) fn print_execution(x: &Value, charts: &Path) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let _ = out.write_all(x["stdout"].as_str().unwrap_or_default().as_bytes());
    let _ = err.write_all(x["stderr"].as_str().unwrap_or_default().as_bytes());
    let count = x["execution_count"].as_u64().unwrap_or(0);
    for (i, result) in x["results"].as_array().into_iter().flatten().enumerate() {
        let data = &result["data"];
        if let Some(png) = data["image/png"].as_str() {
            let path = charts.join(format!("chart-{count}-{}.png", i + 1));
            save_chart(png, &path)?;
            let _ = writeln!(err, "chart saved: {}", path.display());
        } else if let Some(text) = data["text/plain"].as_str() {
            let _ = writeln!(out, "{text}");
        }
    }
    if x["error"].is_object() {
        let _ = writeln!(err, "{}", error_text(&x["error"]));
    }
    if x["truncated"] == true {
        let _ = writeln!(
            err,
            "[output cut at the broker's limits; the recording keeps all of it]"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_from_the_environment_never_the_command_line() {
        let env = |n: &str| (n == "API_KEY").then(|| "value-123".to_string());
        let got = secrets_from(&["API_KEY".into()], env).unwrap();
        assert_eq!(got["API_KEY"], "value-123");
        let e = secrets_from(&["MISSING".into()], env).unwrap_err();
        assert!(
            e.to_string()
                .contains("set the environment variable MISSING"),
            "{e}"
        );
        assert!(secrets_from(&[], env).unwrap().is_empty());
    }
}
