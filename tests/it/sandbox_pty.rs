//! A command on a pseudo-terminal (E2B's `pty`), on each backend through the `Sandbox`
//! trait: the terminal is the command's stdin, stdout and controlling terminal, of the size
//! asked for, resized through its control, and a command without one refuses a resize. The
//! E2B front door's side (sizes, input, other users, `TIOCSTI`) is in
//! `protocol-tests/test_e2b_pty.py`.

use crate::common::sandbox as common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use kernel_broker::sandbox::command::{CommandSpec, PtySize, ResizeError};
use kernel_broker::sandbox::UserLimits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

sandbox_contract!(a_command_on_a_terminal_is_its_controlling_terminal_and_resizes);

async fn a_command_on_a_terminal_is_its_controlling_terminal_and_resizes(backend: &'static str) {
    let Some(h) = Harness::new(backend) else {
        return;
    };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        // Docker runs commands in the user's container, which a session starts.
        let _k = start(h.sandbox(), &alice).await;
        let spec = |argv: &[&str], pty| CommandSpec {
            user: alice.clone(),
            argv: argv.iter().map(|a| a.to_string()).collect(),
            env: vec![],
            cwd: None,
            limits: alice.limits.kernel(None),
            pty,
            own_workspace: None,
        };
        let size = PtySize { rows: 24, cols: 80 };
        let mut cmd = h
            .sandbox()
            .run_command(spec(&["/bin/sh"], Some(size)))
            .await
            .expect("run a shell on a terminal");
        let screen = Arc::new(Mutex::new(String::new()));
        let mut output = cmd.stdout;
        cmd.stdout = Box::new(tokio::io::empty());
        let reader = tokio::spawn({
            let screen = screen.clone();
            async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = output.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    screen
                        .lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        let shows = |what: &'static str| {
            let screen = screen.clone();
            async move {
                let until = tokio::time::Instant::now() + Duration::from_secs(30);
                while !screen.lock().unwrap().contains(what) {
                    let now = tokio::time::Instant::now();
                    assert!(now < until, "{what:?} never showed: {:?}", screen.lock().unwrap());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        // `/dev/tty` opens only for a process with a controlling terminal.
        cmd.stdin
            .write_all(b"stty size; (exec 3</dev/tty) && echo CT''TY; [ $(id -u) != 0 ] && echo NOT''ROOT\n")
            .await
            .unwrap();
        shows("24 80\r\n").await;
        shows("CTTY\r\n").await;
        shows("NOTROOT\r\n").await;
        cmd.control
            .resize(PtySize {
                rows: 40,
                cols: 100,
            })
            .await
            .expect("resize");
        cmd.stdin.write_all(b"stty size\n").await.unwrap();
        shows("40 100\r\n").await;
        cmd.stdin.write_all(b"exit 7\n").await.unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(30), cmd.control.wait())
            .await
            .expect("the shell ends");
        assert_eq!(exit.code, Some(7), "{exit:?}\n{}", screen.lock().unwrap());
        let _ = tokio::time::timeout(Duration::from_secs(10), reader).await;

        // A command on pipes has no terminal to resize.
        let plain = h
            .sandbox()
            .run_command(spec(&["/bin/sleep", "30"], None))
            .await
            .expect("run a command on pipes");
        let refused = plain.control.resize(size).await;
        assert!(matches!(refused, Err(ResizeError::NotATerminal)), "{refused:?}");
        plain.control.kill().await;
    })
    .await;
}
