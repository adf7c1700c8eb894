//! The agent: one per node. It registers with the controller, heartbeats, starts the node's
//! worker process and relays the controller's commands to it and its output lines back.
//!
//! Heartbeats come from the agent, a separate process from the worker, so heavy compute in
//! the worker cannot starve them; the worker heartbeats too, from a thread of its own (its
//! `Alive` lines, relayed like any other). A node whose agent or worker stops heartbeating is
//! gone (the agent, the worker process, the host or the network); one that heartbeats but does
//! not finish its step is slow, and is waited for up to the step deadline before it is fenced
//! as stuck (see [`lazarus_planner::deadline`]).

use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

use super::proto::{
    self, Framed, MAX_REGISTER_FRAME_BYTES, PROTOCOL_VERSION, ProtoError, ToAgent, ToController,
};
use super::{printable, shutdown_signal};

/// Longest rejection reason an agent prints (characters); the controller's are one line.
const MAX_REASON_CHARS: usize = 1_000;

fn rejected(reason: &str) -> AgentError {
    AgentError::Rejected {
        reason: printable(reason, MAX_REASON_CHARS),
    }
}

/// Where and as whom an agent connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Controller address, `host:port`.
    pub addr: String,
    /// Shared cluster secret.
    pub token: String,
    /// Node name, unique among live nodes.
    pub node: String,
    /// Accelerators (or worker processes) on this node.
    pub devices: usize,
    /// Heartbeat period; keep it well below the controller's heartbeat timeout.
    pub heartbeat_every_ms: u64,
    /// Bound on connecting and on waiting for the controller's answer to `Register`.
    pub register_timeout_ms: u64,
    /// Protocol version announced at registration ([`PROTOCOL_VERSION`]; another value only to
    /// test the controller's version check).
    pub protocol_version: u16,
}

impl AgentConfig {
    /// Heartbeat every second, 10 s to register.
    pub fn new(
        addr: impl Into<String>,
        token: impl Into<String>,
        node: impl Into<String>,
        devices: usize,
    ) -> Self {
        Self {
            addr: addr.into(),
            token: token.into(),
            node: node.into(),
            devices,
            heartbeat_every_ms: 1_000,
            register_timeout_ms: 10_000,
            protocol_version: PROTOCOL_VERSION,
        }
    }
}

/// How an agent ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentExit {
    /// The controller sent `Shutdown`.
    ControllerShutdown,
    /// The local shutdown signal fired; the agent said `Bye`.
    LocalShutdown,
}

/// Why an agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("heartbeat_every_ms must be at least 1")]
    ZeroHeartbeat,
    #[error("cannot connect to controller at {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("controller at {addr} did not answer Register within {ms} ms")]
    RegisterTimeout { addr: String, ms: u64 },
    /// `reason` is escaped: it comes from the other end of a network connection.
    #[error("controller rejected node: {reason}")]
    Rejected { reason: String },
    #[error(
        "the Register message is {bytes} bytes, more than the controller reads before \
         registration ({MAX_REGISTER_FRAME_BYTES}): shorten the token or the node name"
    )]
    RegisterTooLarge { bytes: usize },
    #[error("controller closed the connection")]
    ControllerClosed,
    #[error("controller sent an unexpected {0}")]
    Unexpected(&'static str),
    #[error("cannot start the worker process {exe}: {source}")]
    WorkerSpawn { exe: String, source: std::io::Error },
    #[error("the worker process exited: {0}")]
    WorkerExited(String),
    #[error("bad worker command from the controller: {0}")]
    BadCommand(String),
    #[error(transparent)]
    Proto(#[from] ProtoError),
}

/// A registered agent, before its main loop runs.
#[derive(Debug)]
pub struct Agent {
    framed: Framed,
    node_id: u32,
    heartbeat_every: Duration,
}

impl Agent {
    /// Connects and registers (both bounded by `register_timeout_ms`).
    pub async fn register(cfg: &AgentConfig) -> Result<Self, AgentError> {
        if cfg.heartbeat_every_ms == 0 {
            return Err(AgentError::ZeroHeartbeat);
        }
        let register = ToController::Register {
            version: cfg.protocol_version,
            token: cfg.token.clone(),
            node: cfg.node.clone(),
            devices: cfg.devices,
        };
        // The controller would just close the connection; say why here instead.
        let bytes = proto::encode(&register)?.len();
        if bytes > MAX_REGISTER_FRAME_BYTES {
            return Err(AgentError::RegisterTooLarge { bytes });
        }
        let limit = Duration::from_millis(cfg.register_timeout_ms);
        let timed_out = || AgentError::RegisterTimeout {
            addr: cfg.addr.clone(),
            ms: cfg.register_timeout_ms,
        };
        let stream = tokio::time::timeout(limit, TcpStream::connect(&cfg.addr))
            .await
            .map_err(|_| timed_out())?
            .map_err(|source| AgentError::Connect {
                addr: cfg.addr.clone(),
                source,
            })?;
        // Small frames, latency matters more than throughput.
        let _ = stream.set_nodelay(true);
        let mut framed = proto::framed(stream);
        let answer = tokio::time::timeout(limit, async {
            proto::send(&mut framed, &register).await?;
            proto::recv::<ToAgent>(&mut framed).await
        })
        .await
        .map_err(|_| timed_out())??;
        match answer {
            Some(ToAgent::Registered { node_id }) => Ok(Self {
                framed,
                node_id,
                heartbeat_every: Duration::from_millis(cfg.heartbeat_every_ms),
            }),
            Some(ToAgent::Rejected { reason }) => Err(rejected(&reason)),
            Some(ToAgent::Shutdown) => Err(AgentError::Unexpected("Shutdown before Registered")),
            Some(ToAgent::Worker { .. }) => {
                Err(AgentError::Unexpected("worker command before Registered"))
            }
            None => Err(AgentError::ControllerClosed),
        }
    }

    /// The id the controller gave this node.
    pub fn node_id(&self) -> u32 {
        self.node_id
    }
}

/// How an agent runs its node's worker process under a job controller.
#[derive(Debug, Clone)]
pub struct WorkerLaunch {
    /// The `lzrun` executable; the worker is `<exe> worker --managed`.
    pub exe: std::path::PathBuf,
    /// Data-plane address the worker listens on (port 0: any free port).
    pub listen: std::net::SocketAddr,
}

/// The agent ([`crate::control::controller`]): registers, heartbeats, starts its worker process on
/// the controller's `Job` command and relays, one JSON line each, the controller's commands to
/// the worker's stdin and the worker's stdout lines to the controller. Ends with `Ok` when the
/// worker exited cleanly (after `Stop`) or the controller shut the job down, and with an error
/// when the worker failed, the controller went away or rejected the node. The worker dies with
/// the agent (its stdin closes), so killing an agent kills its node.
pub async fn run_agent(
    cfg: &AgentConfig,
    launch: &WorkerLaunch,
    mut shutdown: watch::Receiver<bool>,
) -> Result<AgentExit, AgentError> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::process::Command;

    let agent = Agent::register(cfg).await?;
    let node_id = agent.node_id;
    let mut framed = agent.framed;
    let every = agent.heartbeat_every;
    let mut heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut child: Option<tokio::process::Child> = None;
    let mut stdin: Option<tokio::process::ChildStdin> = None;
    let mut lines: Option<tokio::io::Lines<BufReader<tokio::process::ChildStdout>>> = None;
    let mut step = 0u64;
    loop {
        // Reap the worker only once its stdout is drained (no line is lost).
        let reading = lines.is_some();
        let exited = async {
            match child.as_mut() {
                Some(c) if !reading => c.wait().await,
                _ => std::future::pending().await,
            }
        };
        let next_line = async {
            match lines.as_mut() {
                Some(l) => l.next_line().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown_signal(&mut shutdown) => {
                let _ = proto::send(&mut framed, &ToController::Bye { node_id }).await;
                return Ok(AgentExit::LocalShutdown);
            }
            msg = proto::recv::<ToAgent>(&mut framed) => match msg? {
                Some(ToAgent::Worker { line }) => {
                    let mut cmd: crate::worker::Command = serde_json::from_str(&line)
                        .map_err(|e| AgentError::BadCommand(format!("{e}: {line}")))?;
                    if let crate::worker::Command::Job(job) = &mut cmd {
                        job.listen = launch.listen;
                        if child.is_none() {
                            let mut c = Command::new(&launch.exe)
                                .args(["worker", "--managed"])
                                .stdin(std::process::Stdio::piped())
                                .stdout(std::process::Stdio::piped())
                                .stderr(std::process::Stdio::inherit())
                                .kill_on_drop(true)
                                .spawn()
                                .map_err(|source| AgentError::WorkerSpawn {
                                    exe: launch.exe.display().to_string(),
                                    source,
                                })?;
                            stdin = c.stdin.take();
                            lines = c.stdout.take().map(|o| BufReader::new(o).lines());
                            child = Some(c);
                        }
                    }
                    let mut text = serde_json::to_string(&cmd)
                        .map_err(|e| AgentError::BadCommand(e.to_string()))?;
                    text.push('\n');
                    if let Some(w) = stdin.as_mut() {
                        // A worker that already exited shows up through `exited`.
                        let _ = w.write_all(text.as_bytes()).await;
                        let _ = w.flush().await;
                    }
                }
                Some(ToAgent::Shutdown) => {
                    if let Some(mut c) = child.take() {
                        drop(stdin.take());
                        let grace = tokio::time::timeout(Duration::from_secs(2), c.wait()).await;
                        if grace.is_err() {
                            let _ = c.kill().await;
                        }
                    }
                    return Ok(AgentExit::ControllerShutdown);
                }
                Some(ToAgent::Rejected { reason }) => return Err(rejected(&reason)),
                Some(ToAgent::Registered { .. }) => {
                    return Err(AgentError::Unexpected("second Registered"));
                }
                None => return Err(AgentError::ControllerClosed),
            },
            _ = heartbeat.tick() => {
                proto::send(&mut framed, &ToController::Heartbeat { node_id, step }).await?;
            }
            line = next_line => match line {
                Ok(Some(line)) => {
                    if let Ok(s) = serde_json::from_str::<crate::worker::StepLine>(&line) {
                        step = step.max(s.step);
                    }
                    proto::send(&mut framed, &ToController::Worker { node_id, line }).await?;
                }
                _ => lines = None,
            },
            status = exited => {
                let _ = proto::send(&mut framed, &ToController::Bye { node_id }).await;
                return match status {
                    Ok(s) if s.success() => Ok(AgentExit::ControllerShutdown),
                    Ok(s) => Err(AgentError::WorkerExited(s.to_string())),
                    Err(e) => Err(AgentError::WorkerExited(e.to_string())),
                };
            }
        }
    }
}
