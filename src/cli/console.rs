//! `kernel-broker console SESSION`: an interactive prompt attached to a live session, as
//! `jupyter console --existing` is to a kernel. It speaks the agent stream
//! (`/v1/sessions/{id}/stream`, docs/API.md): each cell goes out as an `execute` frame and
//! its output is printed as it arrives; `input()` in the code prompts here; Ctrl-C while a
//! cell runs interrupts it (at the prompt it drops what was typed); charts are saved to
//! files whose paths are printed; Ctrl-D (the end of input) leaves, the session lives on.
//!
//! A cell is one line, or more: a line ending in `:`, `\` or with brackets left open starts
//! a block that ends with an empty line (as IPython's console does for an incomplete
//! statement).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use super::{error_text, resolve_session, save_chart, CliError, Client, ClientArgs};

/// What `console` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// A session of yours (its id, or the start of it).
    pub session: String,
    /// Where charts are saved.
    #[arg(long, default_value = ".")]
    pub charts: PathBuf,
}

pub async fn console(args: &ConsoleArgs) -> Result<(), CliError> {
    let client = Client::new(&args.client)?;
    let id = resolve_session(&client, &args.session).await?;
    let url = format!(
        "{}/v1/sessions/{id}/stream",
        client.base.replacen("http", "ws", 1)
    );
    let mut request = url
        .into_client_request()
        .map_err(|e| CliError::Local(format!("--url {:?}: {e}", client.base)))?;
    let bearer = format!("Bearer {}", client.token)
        .parse()
        .map_err(|_| CliError::Local("the token cannot be sent in a header".into()))?;
    request.headers_mut().insert("authorization", bearer);
    let (ws, _) = tokio_tungstenite::connect_async(request)
        .await
        .map_err(|e| CliError::Local(format!("cannot attach to session {id}: {e}")))?;
    let (mut to_broker, mut from_broker) = ws.split();
    let mut lines = stdin_lines();
    let mut interrupts = Box::pin(ctrl_c_stream());
    println!("kernel-broker console: session {id} (Ctrl-C interrupts, Ctrl-D leaves; the session lives on)");
    let mut cell = 0u64;
    let mut saved = 0u64;
    'prompt: loop {
        let Some(code) = read_cell(&mut lines, &mut interrupts).await else {
            println!();
            break;
        };
        if code.trim().is_empty() {
            continue;
        }
        cell += 1;
        let frame = json!({"type": "execute", "id": cell, "code": code});
        send(&mut to_broker, &frame).await?;
        loop {
            tokio::select! {
                message = from_broker.next() => {
                    let Some(Ok(message)) = message else {
                        return Err(CliError::Local("the broker closed the stream".into()));
                    };
                    let Message::Text(text) = message else { continue };
                    let Ok(frame) = serde_json::from_str::<Value>(text.as_str()) else { continue };
                    if frame["id"] != json!(cell) {
                        print_status(&frame);
                        continue;
                    }
                    match show(&frame, cell, &args.charts, &mut saved) {
                        Shown::Done => continue 'prompt,
                        Shown::Input { prompt } => {
                            print!("{prompt}");
                            let _ = std::io::stdout().flush();
                            let value = lines.recv().await.unwrap_or_default();
                            send(&mut to_broker, &json!({"type": "input_reply", "id": cell, "value": value})).await?;
                        }
                        Shown::More => {}
                    }
                }
                Some(()) = interrupts.next() => {
                    send(&mut to_broker, &json!({"type": "interrupt"})).await?;
                }
            }
        }
    }
    Ok(())
}

/// Lines of standard input, read on a thread of their own (the terminal blocks).
fn stdin_lines() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Ctrl-C presses (SIGINT).
fn ctrl_c_stream() -> impl futures::Stream<Item = ()> {
    futures::stream::unfold((), |()| async {
        tokio::signal::ctrl_c().await.ok()?;
        Some(((), ()))
    })
}

/// One cell from the prompt, or `None` at the end of input.
async fn read_cell(
    lines: &mut mpsc::Receiver<String>,
    interrupts: &mut (impl futures::Stream<Item = ()> + Unpin),
) -> Option<String> {
    let mut cell: Vec<String> = Vec::new();
    loop {
        print!("{}", if cell.is_empty() { ">>> " } else { "... " });
        let _ = std::io::stdout().flush();
        tokio::select! {
            line = lines.recv() => {
                let line = line?;
                if cell.is_empty() && !opens_block(&line) {
                    return Some(line);
                }
                if !cell.is_empty() && line.trim().is_empty() {
                    return Some(cell.join("\n"));
                }
                cell.push(line);
            }
            Some(()) = interrupts.next() => {
                // At the prompt, Ctrl-C drops what was typed.
                println!("^C");
                cell.clear();
            }
        }
    }
}

/// Whether a first line starts a block that goes on until an empty line.
fn opens_block(line: &str) -> bool {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    let mut code_end = line.len();
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '#') => {
                code_end = i;
                break;
            }
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') => depth -= 1,
            _ => {}
        }
    }
    let code = line[..code_end].trim_end();
    depth > 0 || code.ends_with(':') || code.ends_with('\\') || code.starts_with('@')
}

async fn send<S>(to: &mut S, frame: &Value) -> Result<(), CliError>
where
    S: futures::Sink<Message> + Unpin,
    S::Error: std::fmt::Display,
{
    to.send(Message::text(frame.to_string()))
        .await
        .map_err(|e| CliError::Local(format!("the stream broke: {e}")))
}

enum Shown {
    More,
    Input { prompt: String },
    Done,
}

/// Prints one frame of the running cell.
fn show(frame: &Value, cell: u64, charts: &std::path::Path, saved: &mut u64) -> Shown {
    let text = |k: &str| frame[k].as_str().unwrap_or_default().to_string();
    match frame["type"].as_str() {
        Some("stdout") => {
            print!("{}", text("text"));
            let _ = std::io::stdout().flush();
        }
        Some("stderr") => eprint!("{}", text("text")),
        Some("display" | "result") => {
            let data = &frame["data"];
            if let Some(png) = data["image/png"].as_str() {
                *saved += 1;
                let path = charts.join(format!("chart-{cell}-{saved}.png"));
                match save_chart(png, &path) {
                    Ok(()) => println!("[chart saved: {}]", path.display()),
                    Err(e) => eprintln!("[{e}]"),
                }
            } else if let Some(t) = data["text/plain"].as_str() {
                println!("{t}");
            }
        }
        Some("error") => eprintln!("{}", error_text(frame)),
        Some("input_request") => {
            return Shown::Input {
                prompt: text("prompt"),
            }
        }
        Some("done") => return Shown::Done,
        Some("protocol_error") => eprintln!("[the broker refused the cell: {}]", text("message")),
        _ => {}
    }
    Shown::More
}

/// A change of the session's state worth saying (it died, ended).
fn print_status(frame: &Value) {
    if frame["type"] == "status" {
        if let Some(state @ ("dead" | "expired" | "closed")) = frame["state"].as_str() {
            eprintln!("[the session is {state}]");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::opens_block;

    #[test]
    fn blocks_are_opened_by_colons_open_brackets_and_backslashes() {
        for line in [
            "for i in range(3):",
            "def f(x):  ",
            "x = [1,",
            "f(1,",
            "a = 1 + \\",
            "@decorator",
        ] {
            assert!(opens_block(line), "{line}");
        }
        for line in [
            "x = 1",
            "print('a:')",
            "d = {'a': 1}",
            "x = 1  # note:",
            "s = '(('",
        ] {
            assert!(!opens_block(line), "{line}");
        }
    }
}
