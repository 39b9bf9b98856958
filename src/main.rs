//! The `kernel-broker` binary: parses arguments, sets up logging, runs the server until
//! SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use kernel_broker::config::{Cli, Command, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KERNEL_BROKER_LOG")
                .unwrap_or_else(|_| "info,kernel_broker=info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let settings = Settings::resolve(*args, std::env::var("KERNEL_BROKER_TOKEN").ok())
                .context("invalid configuration")?;
            kernel_broker::server::run(settings, shutdown_signal())
                .await
                .context("kernel-broker stopped with an error")?;
        }
        Command::Mcp(args) => {
            let outcome = kernel_broker::mcp_stdio::relay(&args.url, &args.token).await;
            // Exit now: stdin is read on a blocking thread, which the runtime's shutdown
            // would wait for until the host closes stdin.
            std::process::exit(match outcome {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("Error: kernel-broker mcp: {e}");
                    1
                }
            });
        }
        Command::Sessions { client, json } => {
            exit_with(kernel_broker::cli::sessions(&client, json).await)
        }
        Command::Exec(args) => exit_with(kernel_broker::cli::exec(&args).await),
        Command::Console(args) => exit_with(kernel_broker::cli::console(&args).await),
        Command::Files(args) => exit_with(kernel_broker::cli::files(&args).await),
        Command::Fork {
            client,
            session,
            count,
        } => exit_with(kernel_broker::cli::fork(&client, &session, count).await),
        Command::Kill { client, session } => {
            exit_with(kernel_broker::cli::kill(&client, &session).await)
        }
        Command::Token(args) => {
            let dir = args.data_dir.unwrap_or_else(|| ".data".into());
            match kernel_broker::kept_token::kept_token(&dir)? {
                Some(token) => println!("{token}"),
                None => anyhow::bail!(
                    "no token is kept in {}: a broker makes one there at its first start with no \
                     users file and no KERNEL_BROKER_TOKEN (give its --data-dir if it is not ./.data)",
                    dir.display()
                ),
            }
        }
    }
    Ok(())
}

/// Ends a client command: its error on stderr and its exit status.
fn exit_with(outcome: Result<(), kernel_broker::cli::CliError>) {
    if let Err(e) = outcome {
        // An execution that did not succeed printed its error already.
        if !matches!(e, kernel_broker::cli::CliError::Execution(_)) {
            eprintln!("kernel-broker: {e}");
        }
        std::process::exit(e.status());
    }
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed now, before the broker says it
/// is ready: a signal that arrives right after must stop it in order, not kill it.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (Ok(mut term), Ok(mut int)) = (term, int) else {
            tracing::warn!("cannot listen for SIGTERM/SIGINT; stop the broker with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        tracing::info!("signal received");
    }
}
