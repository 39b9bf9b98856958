//! `kernel-broker files SESSION ls|get|put|rm ...`: the workspace of a session of the
//! caller's, through the files API (every path beneath the workspace, no symlink followed:
//! the broker's rules, docs/API.md).

use std::io::Write;
use std::path::PathBuf;

use super::{resolve_session, CliError, Client, ClientArgs};

/// What `files` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct FilesArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// A session of yours (its id, or the start of it).
    pub session: String,
    #[command(subcommand)]
    pub action: FilesAction,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum FilesAction {
    /// List the workspace's files (path, size, modified).
    Ls,
    /// Download a file: to DEST, or to standard output with `-` or no DEST.
    Get { path: String, dest: Option<PathBuf> },
    /// Upload the local file SRC as PATH (default: SRC's file name).
    Put { src: PathBuf, path: Option<String> },
    /// Delete a file (or an empty directory).
    Rm { path: String },
}

pub async fn files(args: &FilesArgs) -> Result<(), CliError> {
    let client = Client::new(&args.client)?;
    let id = resolve_session(&client, &args.session).await?;
    let file = |method: reqwest::Method, path: &str| {
        // The URL would drop `.` and `..` silently and name another file: say so instead.
        if path.split('/').any(|c| c == "." || c == "..") {
            return Err(CliError::Local(format!(
                "{path:?}: a workspace path has no `.` or `..` components"
            )));
        }
        let mut segments = vec!["v1", "sessions", id.as_str(), "files"];
        segments.extend(path.split('/').filter(|c| !c.is_empty()));
        client.request_to(method, &segments)
    };
    match &args.action {
        FilesAction::Ls => {
            let response = client
                .send(client.request(reqwest::Method::GET, &format!("/v1/sessions/{id}/files")))
                .await?;
            let cut = response
                .headers()
                .get("x-files-truncated")
                .is_some_and(|v| v == "true");
            let list: serde_json::Value = response
                .json()
                .await
                .map_err(|e| CliError::Local(format!("the broker's answer is not JSON: {e}")))?;
            for f in list.as_array().into_iter().flatten() {
                println!(
                    "{:>12}  {:<20}  {}",
                    f["size"].as_u64().unwrap_or(0),
                    f["modified"].as_str().unwrap_or("-"),
                    f["path"].as_str().unwrap_or("?")
                );
            }
            if cut {
                eprintln!("[the listing was cut short at the broker's bounds]");
            }
        }
        FilesAction::Get { path, dest } => {
            let bytes = client
                .send(file(reqwest::Method::GET, path)?)
                .await?
                .bytes()
                .await
                .map_err(|e| CliError::Local(format!("the download broke off: {e}")))?;
            match dest {
                Some(d) if d.as_os_str() != "-" => std::fs::write(d, &bytes)
                    .map_err(|e| CliError::Local(format!("cannot write {}: {e}", d.display())))?,
                _ => {
                    let _ = std::io::stdout().lock().write_all(&bytes);
                }
            }
        }
        FilesAction::Put { src, path } => {
            let name = match path {
                Some(p) => p.clone(),
                None => src
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .ok_or_else(|| CliError::Local(format!("{} names no file", src.display())))?,
            };
            let bytes = std::fs::read(src)
                .map_err(|e| CliError::Local(format!("cannot read {}: {e}", src.display())))?;
            client
                .send(file(reqwest::Method::PUT, &name)?.body(bytes))
                .await?;
            eprintln!("uploaded {name}");
        }
        FilesAction::Rm { path } => {
            client.send(file(reqwest::Method::DELETE, path)?).await?;
        }
    }
    Ok(())
}
