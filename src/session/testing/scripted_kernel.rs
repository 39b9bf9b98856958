//! A scripted Jupyter kernel made of real ZeroMQ sockets (an independent implementation,
//! the `zeromq` crate: ROUTERs for shell, control and stdin, a PUB for iopub, a REP echo
//! for the heartbeat) bound on `ipc://` endpoints in a directory. It needs no Python, so
//! tests of the kernel client and of the session actor run in milliseconds and do exactly
//! what the script says. Shared by the session layer's unit tests and, through `#[path]`,
//! by tests/it/kernel_client.rs; so it names the crate only as `super::broker`.
//!
//! The code of an `execute_request` is a one-word command and its argument:
//! - `set NAME VALUE`: remember a variable (the state a restart loses); `get NAME`: print
//!   it, or fail with `NameError`; `print TEXT`: `TEXT` on stdout.
//! - `sleep`: run until interrupted (an `interrupt_request` or the signal), then fail with
//!   `KeyboardInterrupt`; `hang`: run forever, deaf to interrupts; `unannounced`: as
//!   `sleep`, without the `execute_input` that announces an execution.
//! - `die CODE`: the process exits with `CODE` (see [`ScriptedKernel::exited`]).
//! - `gate TEXT`: reply at once, then wait for [`ScriptedKernel::release`] before `TEXT` on
//!   stdout and the closing `status: idle`; `noidle`: reply and never send the idle status.
//! - `split FIRST REST`: `FIRST` on stdout, then at a release the reply, then as `gate
//!   REST` (output that the reply overtakes, as ipykernel's IOPub thread lets it).
//! - `forge`: three `execute_reply`s on shell only: under a wrong key, with tampered
//!   content, then the genuine one.
//! - `big N`: on iopub, a stdout `stream` of `N` times `y`, a `display_data` whose text is
//!   `N` times `d`, and a forged `stream` (wrong key) of `N` times `f`, each one message;
//!   then `done` on stdout.
//! - anything else: `ok`, no output.
//!
//! Executions are answered one at a time, in the order received, as a real kernel does:
//! shell requests that arrive while one is running wait for it.

use std::collections::{HashMap, VecDeque};
use std::path::Path;

use bytes::Bytes;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RepSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::broker::kernel::KernelEndpoints;
use super::broker::wire::{self, Message, Signer};

/// A running scripted kernel. Dropping it stops the kernel (its sockets close).
pub struct ScriptedKernel {
    pub endpoints: KernelEndpoints,
    to_kernel: mpsc::UnboundedSender<Poke>,
    received: watch::Receiver<Vec<String>>,
    interrupts: watch::Receiver<usize>,
    exited: watch::Receiver<Option<i32>>,
    // Used by tests/it/descriptors.rs, not by the session layer's own tests.
    #[allow(dead_code)]
    heartbeat: watch::Sender<HeartbeatMode>,
    task: JoinHandle<()>,
}

/// How the heartbeat echo answers (see [`ScriptedKernel::set_heartbeat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatMode {
    /// Echo every ping at once.
    Echo,
    /// Take pings but answer none until the mode changes (a kernel too busy to answer).
    Hold,
    /// Answer every ping with more frames than a heartbeat may carry: the broker drops each
    /// such connection and must make a new one.
    Garble,
}

/// What a test (or the fake process) tells the kernel besides its sockets.
enum Poke {
    Release,
    Signal,
}

impl ScriptedKernel {
    /// Bind the five sockets in `dir` (which must exist; paths stay short for `ipc://`) and
    /// start answering, signing with `key`.
    pub async fn start(dir: &Path, key: &str) -> ScriptedKernel {
        let ep = |n: &str| format!("ipc://{}/{n}", dir.display());
        let endpoints = KernelEndpoints {
            shell: ep("shell"),
            iopub: ep("iopub"),
            stdin: ep("stdin"),
            control: ep("control"),
            hb: ep("hb"),
        };
        let mut shell = RouterSocket::new();
        shell.bind(&endpoints.shell).await.expect("bind shell");
        let mut control = RouterSocket::new();
        control
            .bind(&endpoints.control)
            .await
            .expect("bind control");
        let mut stdin = RouterSocket::new();
        stdin.bind(&endpoints.stdin).await.expect("bind stdin");
        let mut iopub = PubSocket::new();
        iopub.bind(&endpoints.iopub).await.expect("bind iopub");
        let mut hb = RepSocket::new();
        hb.bind(&endpoints.hb).await.expect("bind hb");

        let signer = Signer::new(key.as_bytes());
        let (to_kernel, pokes) = mpsc::unbounded_channel();
        let (received_tx, received) = watch::channel(Vec::new());
        let (interrupts_tx, interrupts) = watch::channel(0);
        let (exited_tx, exited) = watch::channel(None);
        let (heartbeat, mut hb_mode) = watch::channel(HeartbeatMode::Echo);
        let (shell_tx, shell_rx) = shell.split();
        let (control_tx, control_rx) = control.split();
        let kernel = Kernel {
            signer: signer.clone(),
            shell: shell_tx,
            control: control_tx,
            iopub,
            vars: HashMap::new(),
            count: 0,
            running: None,
            waiting: VecDeque::new(),
            received: received_tx,
            interrupts: interrupts_tx,
            exited: exited_tx,
        };
        let task = tokio::spawn(async move {
            let _stdin = stdin;
            let echo = AbortOnDrop(tokio::spawn(async move {
                while let Ok(m) = hb.recv().await {
                    let _ = hb_mode.wait_for(|m| *m != HeartbeatMode::Hold).await;
                    let reply = if *hb_mode.borrow_and_update() == HeartbeatMode::Garble {
                        let mut garbled = ZmqMessage::from(Bytes::from_static(b"x"));
                        for _ in 0..8 {
                            garbled.push_back(Bytes::from_static(b"x"));
                        }
                        garbled
                    } else {
                        m
                    };
                    if hb.send(reply).await.is_err() {
                        break;
                    }
                }
            }));
            let shell = read_into_queue(shell_rx, signer.clone());
            let control = read_into_queue(control_rx, signer);
            kernel.run(shell, control, pokes).await;
            drop(echo);
        });
        ScriptedKernel {
            endpoints,
            to_kernel,
            received,
            interrupts,
            exited,
            heartbeat,
            task,
        }
    }

    /// Change how the heartbeat answers from the next ping on.
    #[allow(dead_code)]
    pub fn set_heartbeat(&self, mode: HeartbeatMode) {
        let _ = self.heartbeat.send(mode);
    }

    /// Let a `gate` execution finish.
    pub fn release(&self) {
        let _ = self.to_kernel.send(Poke::Release);
    }

    /// Deliver the interrupt signal (what `KernelProcess::interrupt` does to a real one).
    pub fn signal(&self) {
        let _ = self.to_kernel.send(Poke::Signal);
    }

    /// Stop at once, as a killed process does: every socket closes.
    pub fn stop(&self) {
        self.task.abort();
    }

    /// The code of every `execute_request` received so far, in order.
    pub fn received(&self) -> Vec<String> {
        self.received.borrow().clone()
    }

    /// Wait until `n` execute requests have been received.
    pub async fn wait_received(&self, n: usize) {
        let mut rx = self.received.clone();
        let _ = rx.wait_for(|r| r.len() >= n).await;
    }

    /// `interrupt_request`s and signals received so far.
    pub fn interrupts(&self) -> usize {
        *self.interrupts.borrow()
    }

    /// Set to the exit code once the kernel exits by script (`die`).
    pub fn exited(&self) -> watch::Receiver<Option<i32>> {
        self.exited.clone()
    }
}

impl Drop for ScriptedKernel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Read a ROUTER in its own task (a socket's `recv` is not known to be cancel-safe, a
/// channel's is) and hand over every message that decodes under the key.
fn read_into_queue(
    mut socket: zeromq::RouterRecvHalf,
    signer: Signer,
) -> mpsc::UnboundedReceiver<Message> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(frames) = socket.recv().await {
            if let Ok(m) = wire::decode(frames.into_vec(), &signer) {
                if tx.send(m).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

fn zmq(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("a message has frames")
}

/// What the running execution waits for.
enum Wait {
    /// `sleep`: an interrupt.
    Interrupt,
    /// `hang`: nothing ever.
    Forever,
    /// `gate`: a release, then this text on stdout.
    Release(String),
    /// `split`: a release, then the reply, then as `gate` with this text.
    Reply(String),
}

struct Kernel {
    signer: Signer,
    shell: zeromq::RouterSendHalf,
    control: zeromq::RouterSendHalf,
    iopub: PubSocket,
    vars: HashMap<String, String>,
    count: u64,
    running: Option<(Message, Wait)>,
    /// Shell requests that arrived while an execution was running.
    waiting: VecDeque<Message>,
    received: watch::Sender<Vec<String>>,
    interrupts: watch::Sender<usize>,
    exited: watch::Sender<Option<i32>>,
}

/// How a script step ended.
enum Step {
    Continue,
    Exit,
}

impl Kernel {
    async fn run(
        mut self,
        mut shell: mpsc::UnboundedReceiver<Message>,
        mut control: mpsc::UnboundedReceiver<Message>,
        mut pokes: mpsc::UnboundedReceiver<Poke>,
    ) {
        loop {
            let step = tokio::select! {
                Some(m) = shell.recv() => {
                    self.waiting.push_back(m);
                    self.drain().await
                }
                Some(m) = control.recv() => self.on_control(m).await,
                Some(p) = pokes.recv() => match p {
                    Poke::Release => {
                        match self.running.take() {
                            Some((req, Wait::Release(text))) => {
                                self.stream(&req, &text).await;
                                self.status(&req, "idle").await;
                            }
                            Some((req, Wait::Reply(text))) => {
                                self.ok(&req).await;
                                self.running = Some((req, Wait::Release(text)));
                                continue;
                            }
                            running => self.running = running,
                        }
                        self.drain().await
                    }
                    Poke::Signal => {
                        self.interrupts.send_modify(|n| *n += 1);
                        self.interrupted().await;
                        self.drain().await
                    }
                },
                else => return,
            };
            if let Step::Exit = step {
                return;
            }
        }
    }

    /// Answer waiting shell requests until one keeps running.
    async fn drain(&mut self) -> Step {
        while self.running.is_none() {
            let Some(req) = self.waiting.pop_front() else {
                break;
            };
            if let Step::Exit = self.on_shell(req).await {
                return Step::Exit;
            }
        }
        Step::Continue
    }

    async fn on_control(&mut self, req: Message) -> Step {
        match req.msg_type.as_str() {
            "interrupt_request" => {
                self.interrupts.send_modify(|n| *n += 1);
                self.reply_on_control(&req, "interrupt_reply", json!({"status": "ok"}))
                    .await;
                self.interrupted().await;
                self.drain().await
            }
            "shutdown_request" => {
                self.reply_on_control(&req, "shutdown_reply", json!({"status": "ok"}))
                    .await;
                self.exited.send_replace(Some(0));
                Step::Exit
            }
            _ => Step::Continue,
        }
    }

    /// An interrupt ends a `sleep` with `KeyboardInterrupt`; everything else ignores it.
    async fn interrupted(&mut self) {
        if !matches!(self.running, Some((_, Wait::Interrupt))) {
            return;
        }
        let Some((req, _)) = self.running.take() else {
            return;
        };
        self.fail(&req, "KeyboardInterrupt", "").await;
        self.status(&req, "idle").await;
    }

    async fn on_shell(&mut self, req: Message) -> Step {
        match req.msg_type.as_str() {
            "kernel_info_request" => {
                self.status(&req, "busy").await;
                let info = json!({"status": "ok", "protocol_version": "5.3",
                    "implementation": "scripted", "language_info": {"name": "script"}});
                self.reply(&req, "kernel_info_reply", info).await;
                self.status(&req, "idle").await;
                Step::Continue
            }
            "execute_request" => self.execute(req).await,
            _ => Step::Continue,
        }
    }

    async fn execute(&mut self, req: Message) -> Step {
        #[derive(serde::Deserialize)]
        struct Request {
            code: String,
        }
        let code = req
            .parse_content::<Request>()
            .map(|r| r.code)
            .unwrap_or_default();
        self.received.send_modify(|r| r.push(code.clone()));
        let (command, arg) = code.split_once(' ').unwrap_or((code.as_str(), ""));
        if command == "forge" {
            self.forge(&req).await;
            return Step::Continue;
        }
        self.count += 1;
        self.status(&req, "busy").await;
        if command != "unannounced" {
            let input = json!({"code": code, "execution_count": self.count});
            self.publish(&req, "execute_input", input).await;
        }
        match command {
            "set" => {
                let (name, value) = arg.split_once(' ').unwrap_or((arg, ""));
                self.vars.insert(name.to_string(), value.to_string());
            }
            "get" => match self.vars.get(arg).cloned() {
                Some(value) => self.stream(&req, &value).await,
                None => {
                    self.fail(&req, "NameError", &format!("name '{arg}' is not defined"))
                        .await;
                    self.status(&req, "idle").await;
                    return Step::Continue;
                }
            },
            "print" => self.stream(&req, arg).await,
            "big" => {
                let n = arg.parse().unwrap_or(0);
                self.stream(&req, &"y".repeat(n)).await;
                let display = json!({"data": {"text/plain": "d".repeat(n)}, "metadata": {}});
                self.publish(&req, "display_data", display).await;
                let forged = json!({"name": "stdout", "text": "f".repeat(n)});
                let m = Message::new("stream", &forged, Some(&req.header), "kernel", "kernel");
                let frames = wire::encode(&m, &Signer::new(b"not-the-key"));
                let _ = self.iopub.send(zmq(frames)).await;
                self.stream(&req, "done").await;
            }
            "sleep" | "unannounced" => {
                self.running = Some((req, Wait::Interrupt));
                return Step::Continue;
            }
            "hang" => {
                self.running = Some((req, Wait::Forever));
                return Step::Continue;
            }
            "die" => {
                self.exited.send_replace(Some(arg.parse().unwrap_or(1)));
                return Step::Exit;
            }
            "gate" => {
                self.ok(&req).await;
                self.running = Some((req, Wait::Release(arg.to_string())));
                return Step::Continue;
            }
            "split" => {
                let (first, rest) = arg.split_once(' ').unwrap_or((arg, ""));
                self.stream(&req, first).await;
                self.running = Some((req, Wait::Reply(rest.to_string())));
                return Step::Continue;
            }
            "noidle" => {
                self.ok(&req).await;
                return Step::Continue;
            }
            _ => {}
        }
        self.ok(&req).await;
        self.status(&req, "idle").await;
        Step::Continue
    }

    /// The `forge` script: two replies that must be dropped, then the genuine one.
    async fn forge(&mut self, req: &Message) {
        let forged = Signer::new(b"not-the-key");
        let content = json!({"status": "ok", "forged": true});
        let _ = self
            .shell
            .send(zmq(reply(req, "execute_reply", content, &forged)))
            .await;
        // Tampered content under the right key is forged too.
        let content = json!({"status": "ok"});
        let mut tampered = reply(req, "execute_reply", content, &self.signer);
        let last = tampered.len() - 1;
        tampered[last] = Bytes::from_static(b"{\"status\": \"ok\", \"tampered\": true}");
        let _ = self.shell.send(zmq(tampered)).await;
        let content = json!({"status": "ok", "genuine": true});
        self.reply(req, "execute_reply", content).await;
    }

    async fn ok(&mut self, req: &Message) {
        let content = json!({"status": "ok", "execution_count": self.count,
            "user_expressions": {}});
        self.reply(req, "execute_reply", content).await;
    }

    async fn fail(&mut self, req: &Message, ename: &str, evalue: &str) {
        let error = json!({"ename": ename, "evalue": evalue, "traceback": [ename]});
        self.publish(req, "error", error).await;
        let content = json!({"status": "error", "execution_count": self.count,
            "ename": ename, "evalue": evalue, "traceback": [ename]});
        self.reply(req, "execute_reply", content).await;
    }

    async fn stream(&mut self, req: &Message, text: &str) {
        let content = json!({"name": "stdout", "text": text});
        self.publish(req, "stream", content).await;
    }

    async fn status(&mut self, req: &Message, state: &str) {
        let content = json!({"execution_state": state});
        self.publish(req, "status", content).await;
    }

    async fn publish(&mut self, parent: &Message, msg_type: &str, content: serde_json::Value) {
        let m = Message::new(msg_type, &content, Some(&parent.header), "kernel", "kernel");
        let _ = self.iopub.send(zmq(wire::encode(&m, &self.signer))).await;
    }

    async fn reply(&mut self, req: &Message, msg_type: &str, content: serde_json::Value) {
        let frames = reply(req, msg_type, content, &self.signer);
        let _ = self.shell.send(zmq(frames)).await;
    }

    async fn reply_on_control(
        &mut self,
        req: &Message,
        msg_type: &str,
        content: serde_json::Value,
    ) {
        let frames = reply(req, msg_type, content, &self.signer);
        let _ = self.control.send(zmq(frames)).await;
    }
}

/// A reply to `req` (keeping its routing identities), signed with `signer`.
fn reply(req: &Message, msg_type: &str, content: serde_json::Value, signer: &Signer) -> Vec<Bytes> {
    let mut m = Message::new(msg_type, &content, Some(&req.header), "kernel", "kernel");
    m.identities = req.identities.clone();
    wire::encode(&m, signer)
}
