//! The agent: one per node. It registers with the controller, heartbeats, starts the node's
//! worker process and relays the controller's commands to it and its output lines back.
//!
//! Heartbeats come from the agent, a separate process from the worker, so heavy compute in
//! the worker cannot starve them; the worker heartbeats too, from a thread of its own (its
//! `Alive` lines, relayed like any other). A node whose agent or worker stops heartbeating is
//! gone (the agent, the worker process, the host or the network); one that heartbeats but does
//! not finish its step is slow, and is waited for up to the step deadline before it is fenced
//! as stuck (see [`lazarus_planner::deadline`]).
//!
//! # When the controller goes away
//! A closed or broken controller connection does not end the node (with
//! `reconnect_grace_ms > 0`): the worker keeps training with its peers (a step needs no
//! controller), the agent keeps its output lines, and reconnects with [`Backoff`] (exponential,
//! jittered, bounded) for at most `reconnect_grace_ms`, sending `Reattach` with what its worker
//! holds. Once the (restarted) controller accepts, the agent sends the lines the controller's
//! saved state does not include, in order, and goes on. Lines are numbered; the controller
//! acknowledges the ones its saved state includes, and the agent forgets those. While the
//! controller is away at most [`PAUSE_AFTER_LINES`] lines are kept before the agent pauses its
//! worker (every member stops at one step boundary, see the worker's pause vote), and the agent
//! gives up at [`MAX_KEPT_LINES`]. When the grace period ends without a controller, the agent
//! kills its worker and exits with an error.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use lazarus_planner::job::reconcile::{WorkerProcess, WorkerReport};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use super::proto::{
    self, Framed, MAX_REGISTER_FRAME_BYTES, PROTOCOL_VERSION, ProtoError, ToAgent, ToController,
};
use super::{printable, shutdown_signal};

/// While the controller is away, the agent pauses its worker once it holds this many lines the
/// controller has not acknowledged (training stops at a step boundary; its memory stays bounded).
pub const PAUSE_AFTER_LINES: usize = 4_096;

/// Most unacknowledged lines an agent keeps: beyond it, away from the controller, it gives up;
/// connected (a controller that does not save its state), it forgets the oldest.
pub const MAX_KEPT_LINES: usize = 65_536;

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
    /// The physical host this node shares with the other nodes (GPUs) of one agent process;
    /// empty: a host of its own (see `ToController::Register`).
    pub host: String,
    /// Heartbeat period; keep it well below the controller's heartbeat timeout.
    pub heartbeat_every_ms: u64,
    /// Bound on connecting and on waiting for the controller's answer to `Register`.
    pub register_timeout_ms: u64,
    /// Protocol version announced at registration ([`PROTOCOL_VERSION`]; another value only to
    /// test the controller's version check).
    pub protocol_version: u16,
    /// How long the agent keeps its worker and tries to reconnect after losing the controller
    /// (0: it gives up at once, killing its worker).
    pub reconnect_grace_ms: u64,
    /// First and largest delay between reconnection attempts ([`Backoff`]).
    pub reconnect_initial_ms: u64,
    pub reconnect_max_ms: u64,
}

impl AgentConfig {
    /// Heartbeat every second, 10 s to register, 30 s to reconnect (attempts 50 ms apart at
    /// first, doubling up to 1 s).
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
            host: String::new(),
            heartbeat_every_ms: 1_000,
            register_timeout_ms: 10_000,
            protocol_version: PROTOCOL_VERSION,
            reconnect_grace_ms: DEFAULT_RECONNECT_GRACE_MS,
            reconnect_initial_ms: 50,
            reconnect_max_ms: 1_000,
        }
    }
}

/// How long an agent keeps its worker while the controller is away, by default (30 s): long
/// enough for a supervisor to restart a controller, short enough that a controller gone for
/// good does not leave workers training for nobody.
pub const DEFAULT_RECONNECT_GRACE_MS: u64 = 30_000;

/// Delays between reconnection attempts: the first `initial_ms`, then doubling up to `max_ms`;
/// each drawn uniformly from the upper half of that (`[d/2, d]`), so agents that lost the
/// controller together do not all knock at once. Never longer than `max_ms`. The jitter comes
/// from a seeded generator (per process in `run_agent`, fixed in tests).
#[derive(Debug)]
pub struct Backoff {
    initial_ms: u64,
    max_ms: u64,
    next_ms: u64,
    rng: StdRng,
}

impl Backoff {
    pub fn new(initial_ms: u64, max_ms: u64, seed: u64) -> Self {
        let initial_ms = initial_ms.max(1);
        let max_ms = max_ms.max(initial_ms);
        Self {
            initial_ms,
            max_ms,
            next_ms: initial_ms,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next_ms;
        self.next_ms = d.saturating_mul(2).min(self.max_ms);
        Duration::from_millis(self.rng.random_range(d.div_ceil(2)..=d))
    }

    /// After a success: the next loss starts from `initial_ms` again.
    pub fn reset(&mut self) {
        self.next_ms = self.initial_ms;
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
    #[error(
        "lost the controller at {addr} ({why}) and it did not come back within {grace_ms} ms \
         (--reconnect-grace-ms); the worker was stopped"
    )]
    ControllerGone {
        addr: String,
        why: String,
        grace_ms: u64,
    },
    #[error(
        "{lines} worker lines are waiting for the controller, more than the {MAX_KEPT_LINES} \
         kept; the worker was stopped"
    )]
    TooManyLines { lines: usize },
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
    /// Connects and registers, trying again with [`Backoff`] (as reconnecting does) while
    /// the controller cannot be reached or closes the connection unanswered (it is not up yet,
    /// or its slots for unregistered connections are full, e.g. under a flood of idle
    /// connections), for `register_timeout_ms` in all. A refusal (token, version, name) ends
    /// it at once; after the time is up, the last failure is the error.
    pub async fn register(cfg: &AgentConfig) -> Result<Self, AgentError> {
        if cfg.heartbeat_every_ms == 0 {
            return Err(AgentError::ZeroHeartbeat);
        }
        let register = ToController::Register {
            version: cfg.protocol_version,
            token: cfg.token.clone(),
            node: cfg.node.clone(),
            devices: cfg.devices,
            host: cfg.host.clone(),
        };
        let deadline = Instant::now() + Duration::from_millis(cfg.register_timeout_ms);
        let seed = u64::from(std::process::id()) << 32 ^ fnv(&cfg.node);
        let mut backoff = Backoff::new(cfg.reconnect_initial_ms, cfg.reconnect_max_ms, seed);
        let (framed, answer) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let err = match first_exchange_within(cfg, &register, left).await {
                Ok((framed, Some(answer))) => break (framed, Some(answer)),
                Ok((_, None)) => AgentError::ControllerClosed,
                Err(e @ (AgentError::Connect { .. } | AgentError::Proto(_))) => e,
                Err(e) => return Err(e),
            };
            let delay = backoff.next_delay();
            if Instant::now() + delay >= deadline {
                return Err(err);
            }
            tokio::time::sleep(delay).await;
        };
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
            Some(ToAgent::Ack { .. } | ToAgent::Reattached { .. }) => {
                Err(AgentError::Unexpected("an answer to another request"))
            }
            None => Err(AgentError::ControllerClosed),
        }
    }

    /// The id the controller gave this node.
    pub fn node_id(&self) -> u32 {
        self.node_id
    }
}

/// A per-name seed for the registration back-off's jitter.
fn fnv(s: &str) -> u64 {
    crate::checkpoint::fnv64(s.as_bytes())
}

/// Connects to the controller and sends `first` (a `Register` or a `Reattach`); returns the
/// connection and the answer. Both are bounded by `register_timeout_ms`.
async fn first_exchange(
    cfg: &AgentConfig,
    first: &ToController,
) -> Result<(Framed, Option<ToAgent>), AgentError> {
    first_exchange_within(cfg, first, Duration::from_millis(cfg.register_timeout_ms)).await
}

/// [`first_exchange`], each stage bounded by `limit`.
async fn first_exchange_within(
    cfg: &AgentConfig,
    first: &ToController,
    limit: Duration,
) -> Result<(Framed, Option<ToAgent>), AgentError> {
    {
        let register = first;
        // The controller would just close the connection; say why here instead.
        let bytes = proto::encode(&register)?.len();
        if bytes > MAX_REGISTER_FRAME_BYTES {
            return Err(AgentError::RegisterTooLarge { bytes });
        }
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
            proto::send(&mut framed, register).await?;
            proto::recv::<ToAgent>(&mut framed).await
        })
        .await
        .map_err(|_| timed_out())??;
        Ok((framed, answer))
    }
}

/// Comes back to the controller as node `node_id` after losing it: returns the connection and
/// the sequence number of the last line the controller has.
async fn reattach(
    cfg: &AgentConfig,
    node_id: u32,
    last_seq: u64,
    worker: WorkerReport,
) -> Result<(Framed, u64), AgentError> {
    let msg = ToController::Reattach {
        version: cfg.protocol_version,
        token: cfg.token.clone(),
        node: cfg.node.clone(),
        devices: cfg.devices,
        node_id,
        last_seq,
        worker,
    };
    match first_exchange(cfg, &msg).await? {
        (
            framed,
            Some(ToAgent::Reattached {
                node_id: id,
                acked_seq,
            }),
        ) if id == node_id => Ok((framed, acked_seq)),
        (_, Some(ToAgent::Rejected { reason })) => Err(rejected(&reason)),
        (_, None) => Err(AgentError::ControllerClosed),
        (_, Some(_)) => Err(AgentError::Unexpected("answer to Reattach")),
    }
}

/// How an agent runs its node's worker process under a job controller.
#[derive(Debug, Clone)]
pub struct WorkerLaunch {
    /// The `lzrun` executable; the worker is `<exe> worker --managed`.
    pub exe: std::path::PathBuf,
    /// Data-plane address the worker listens on (port 0: any free port).
    pub listen: std::net::SocketAddr,
    /// Extra environment of the worker process (e.g. its CUDA device ordinal).
    pub env: Vec<(String, String)>,
}

/// The agent's worker process and its pipes.
#[derive(Default)]
struct Worker {
    child: Option<tokio::process::Child>,
    stdin: Option<tokio::process::ChildStdin>,
    lines: Option<tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>>,
    /// What a reattaching agent reports about it.
    report: WorkerReport,
    /// How it exited, once it did.
    exit: Option<Result<std::process::ExitStatus, String>>,
}

impl Worker {
    fn spawn(&mut self, launch: &WorkerLaunch) -> Result<(), AgentError> {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let mut c = tokio::process::Command::new(&launch.exe)
            .args(["worker", "--managed"])
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| AgentError::WorkerSpawn {
                exe: launch.exe.display().to_string(),
                source,
            })?;
        self.stdin = c.stdin.take();
        self.lines = c.stdout.take().map(|o| BufReader::new(o).lines());
        self.child = Some(c);
        self.report.process = WorkerProcess::Running;
        Ok(())
    }

    /// Writes one command line to the worker (a worker that exited shows up through its exit).
    async fn send(&mut self, text: &str) {
        use tokio::io::AsyncWriteExt;
        if let Some(w) = self.stdin.as_mut() {
            let _ = w.write_all(text.as_bytes()).await;
            let _ = w.write_all(b"\n").await;
            let _ = w.flush().await;
        }
    }

    /// Notes what a command tells the worker (the epoch and plan it was told).
    fn commanded(&mut self, cmd: &crate::worker::Command) {
        if let crate::worker::Command::Reconfigure(r) = cmd {
            self.report.epoch = r.epoch;
            self.report.plan_version = r.plan_version;
        }
    }

    /// Notes where the worker is from one of its output lines.
    fn reported(&mut self, line: &str) {
        use crate::worker::{WorkerEvent, WorkerLine};
        let next = match WorkerLine::parse(line) {
            Some(WorkerLine::Step(s)) => {
                // After an FSEP layout switch the worker trains on a later plan of its epoch.
                if s.epoch == self.report.epoch && s.layout_version > self.report.plan_version {
                    self.report.plan_version = s.layout_version;
                }
                s.step + 1
            }
            Some(WorkerLine::Event(
                WorkerEvent::Failed { step, .. }
                | WorkerEvent::Paused { step, .. }
                | WorkerEvent::Finished { step, .. },
            )) => step,
            Some(WorkerLine::Event(WorkerEvent::Migrated { resume_step, .. })) => resume_step,
            _ => return,
        };
        self.report.next_step = next;
    }

    async fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill().await;
        }
    }
}

/// Lines of the worker the controller has not acknowledged yet, with their sequence numbers.
#[derive(Default)]
struct Unacked {
    lines: VecDeque<(u64, String)>,
    last_seq: u64,
}

impl Unacked {
    fn push(&mut self, line: String) -> u64 {
        self.last_seq += 1;
        self.lines.push_back((self.last_seq, line));
        self.last_seq
    }

    fn ack(&mut self, seq: u64) {
        while self.lines.front().is_some_and(|(s, _)| *s <= seq) {
            self.lines.pop_front();
        }
    }
}

/// The controller is away: since when, until when the agent tries, and when next.
struct Away {
    why: String,
    deadline: Instant,
    next_try: Instant,
    /// The worker was paused to bound the lines kept.
    paused: bool,
}

type Attempt<'a> = Pin<Box<dyn Future<Output = Result<(Framed, u64), AgentError>> + Send + 'a>>;

/// What woke the agent's loop.
enum Wake {
    /// The local shutdown signal fired.
    Shutdown,
    /// A message (or the end, or an error) on the controller connection.
    Message(Result<Option<ToAgent>, ProtoError>),
    /// Time to heartbeat.
    Beat,
    /// An output line of the worker, or the end of its stdout.
    Line(std::io::Result<Option<String>>),
    /// The worker process exited.
    Exited(std::io::Result<std::process::ExitStatus>),
    /// Away from the controller: time for the next reattach attempt.
    Retry,
    /// A reattach attempt ended.
    Attempted(Result<(Framed, u64), AgentError>),
}

/// What the loop does after handling a wake-up.
enum Flow {
    Go,
    /// The controller connection broke (why).
    Broken(String),
    /// The agent ends without error.
    Exit(AgentExit),
}

/// The state of a registered agent's main loop (see [`run_agent`]).
struct AgentLoop<'a> {
    cfg: &'a AgentConfig,
    launch: &'a WorkerLaunch,
    node_id: u32,
    /// The controller connection; `None` while it is away.
    conn: Option<Framed>,
    heartbeat: tokio::time::Interval,
    worker: Worker,
    unacked: Unacked,
    /// Highest step the worker reported (sent with heartbeats).
    step: u64,
    away: Option<Away>,
    attempt: Option<Attempt<'a>>,
    backoff: Backoff,
}

impl<'a> AgentLoop<'a> {
    fn new(cfg: &'a AgentConfig, launch: &'a WorkerLaunch, agent: Agent) -> Self {
        let every = agent.heartbeat_every;
        let mut heartbeat = tokio::time::interval_at(Instant::now() + every, every);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let seed = u64::from(std::process::id()) << 32 ^ u64::from(agent.node_id);
        Self {
            cfg,
            launch,
            node_id: agent.node_id,
            conn: Some(agent.framed),
            heartbeat,
            worker: Worker::default(),
            unacked: Unacked::default(),
            step: 0,
            away: None,
            attempt: None,
            backoff: Backoff::new(cfg.reconnect_initial_ms, cfg.reconnect_max_ms, seed),
        }
    }

    fn say(&self, line: &str) {
        eprintln!("agent {}: {line}", printable(&self.cfg.node, 64));
    }

    /// Waits for the next thing to handle. Each source is armed only when it can fire (a
    /// connection to read, a worker to reap once its stdout is drained so no line is lost, a
    /// retry while away with no attempt running).
    async fn next_wake(&mut self, shutdown: &mut watch::Receiver<bool>) -> Wake {
        let Self {
            conn,
            heartbeat,
            worker,
            away,
            attempt,
            ..
        } = self;
        let reading = worker.lines.is_some();
        let reaped = worker.exit.is_some();
        let exited = async {
            match worker.child.as_mut() {
                Some(c) if !reading && !reaped => c.wait().await,
                _ => std::future::pending().await,
            }
        };
        let next_line = async {
            match worker.lines.as_mut() {
                Some(l) => l.next_line().await,
                None => std::future::pending().await,
            }
        };
        let connected = conn.is_some();
        let msg = async {
            match conn.as_mut() {
                Some(f) => proto::recv::<ToAgent>(f).await,
                None => std::future::pending().await,
            }
        };
        let beat = async {
            match connected {
                true => heartbeat.tick().await,
                false => std::future::pending().await,
            }
        };
        let next_try = away
            .as_ref()
            .map(|a| a.next_try)
            .filter(|_| attempt.is_none());
        let retry = async {
            match next_try {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let attempted = async {
            match attempt.as_mut() {
                Some(a) => a.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown_signal(shutdown) => Wake::Shutdown,
            m = msg => Wake::Message(m),
            _ = beat => Wake::Beat,
            l = next_line => Wake::Line(l),
            s = exited => Wake::Exited(s),
            _ = retry => Wake::Retry,
            a = attempted => Wake::Attempted(a),
        }
    }

    async fn handle(&mut self, wake: Wake) -> Result<Flow, AgentError> {
        match wake {
            Wake::Shutdown => {
                self.bye().await;
                Ok(Flow::Exit(AgentExit::LocalShutdown))
            }
            Wake::Message(Ok(Some(msg))) => self.on_message(msg).await,
            Wake::Message(Ok(None)) => Ok(Flow::Broken("it closed the connection".into())),
            Wake::Message(Err(e)) => Ok(Flow::Broken(e.to_string())),
            Wake::Beat => {
                let beat = ToController::Heartbeat {
                    node_id: self.node_id,
                    step: self.step,
                };
                Ok(match self.conn.as_mut() {
                    Some(f) => match proto::send(f, &beat).await {
                        Ok(()) => Flow::Go,
                        Err(e) => Flow::Broken(e.to_string()),
                    },
                    None => Flow::Go,
                })
            }
            Wake::Line(Ok(Some(line))) => self.on_line(line).await,
            Wake::Line(_) => {
                self.worker.lines = None;
                Ok(Flow::Go)
            }
            Wake::Exited(status) => self.on_exit(status.map_err(|e| e.to_string())).await,
            Wake::Retry => self.on_retry().await,
            Wake::Attempted(done) => {
                self.attempt = None;
                self.on_attempted(done).await
            }
        }
    }

    /// Tells the controller this node leaves (best effort).
    async fn bye(&mut self) {
        if let Some(f) = self.conn.as_mut() {
            let _ = proto::send(
                f,
                &ToController::Bye {
                    node_id: self.node_id,
                },
            )
            .await;
        }
    }

    async fn on_message(&mut self, msg: ToAgent) -> Result<Flow, AgentError> {
        match msg {
            ToAgent::Worker { line } => {
                let mut cmd: crate::worker::Command = serde_json::from_str(&line)
                    .map_err(|e| AgentError::BadCommand(format!("{e}: {line}")))?;
                if let crate::worker::Command::Job(job) = &mut cmd {
                    if self.worker.child.is_some() {
                        // Sent again by a recovered controller: the worker has it.
                        return Ok(Flow::Go);
                    }
                    job.listen = self.launch.listen;
                    self.worker.spawn(self.launch)?;
                }
                self.worker.commanded(&cmd);
                let text = serde_json::to_string(&cmd)
                    .map_err(|e| AgentError::BadCommand(e.to_string()))?;
                self.worker.send(&text).await;
                Ok(Flow::Go)
            }
            ToAgent::Ack { seq } => {
                self.unacked.ack(seq);
                Ok(Flow::Go)
            }
            ToAgent::Shutdown => {
                if let Some(mut c) = self.worker.child.take() {
                    drop(self.worker.stdin.take());
                    let grace = tokio::time::timeout(Duration::from_secs(2), c.wait()).await;
                    if grace.is_err() {
                        let _ = c.kill().await;
                    }
                }
                Ok(Flow::Exit(AgentExit::ControllerShutdown))
            }
            ToAgent::Rejected { reason } => Err(rejected(&reason)),
            ToAgent::Registered { .. } | ToAgent::Reattached { .. } => {
                Err(AgentError::Unexpected("second Registered"))
            }
        }
    }

    /// Relays a worker line to the controller, or keeps it while the controller is away
    /// (pausing the worker past [`PAUSE_AFTER_LINES`], giving up past [`MAX_KEPT_LINES`]).
    async fn on_line(&mut self, line: String) -> Result<Flow, AgentError> {
        if let Ok(s) = serde_json::from_str::<crate::worker::StepLine>(&line) {
            self.step = self.step.max(s.step);
        }
        self.worker.reported(&line);
        let seq = self.unacked.push(line.clone());
        let kept = self.unacked.lines.len();
        if let Some(f) = self.conn.as_mut() {
            let sent = proto::send(
                f,
                &ToController::Worker {
                    node_id: self.node_id,
                    seq,
                    line,
                },
            )
            .await;
            // A controller that saves no state never acknowledges: it has them.
            while self.unacked.lines.len() > MAX_KEPT_LINES {
                self.unacked.lines.pop_front();
            }
            return Ok(match sent {
                Ok(()) => Flow::Go,
                Err(e) => Flow::Broken(e.to_string()),
            });
        }
        if kept > MAX_KEPT_LINES {
            self.worker.kill().await;
            return Err(AgentError::TooManyLines { lines: kept });
        }
        if kept > PAUSE_AFTER_LINES && self.away.as_ref().is_some_and(|a| !a.paused) {
            if let Some(a) = self.away.as_mut() {
                a.paused = true;
            }
            self.say(&format!(
                "{kept} lines wait for the controller: pausing the worker"
            ));
            self.worker.send("\"Pause\"").await;
        }
        Ok(Flow::Go)
    }

    /// The worker exited: connected, the agent says goodbye and ends as its worker did; away,
    /// it keeps trying to deliver the worker's last lines and say so.
    async fn on_exit(
        &mut self,
        status: Result<std::process::ExitStatus, String>,
    ) -> Result<Flow, AgentError> {
        self.worker.report.process = match &status {
            Ok(s) if s.success() => WorkerProcess::Stopped,
            _ => WorkerProcess::Died,
        };
        self.worker.exit = Some(status.clone());
        if self.conn.is_some() {
            self.bye().await;
            return worker_exit(status).map(Flow::Exit);
        }
        Ok(Flow::Go)
    }

    /// Away from the controller: gives up past the grace period, else starts an attempt.
    async fn on_retry(&mut self) -> Result<Flow, AgentError> {
        let a = self.away.as_ref().expect("retry only while away");
        if Instant::now() >= a.deadline {
            let gone = AgentError::ControllerGone {
                addr: self.cfg.addr.clone(),
                why: a.why.clone(),
                grace_ms: self.cfg.reconnect_grace_ms,
            };
            self.worker.kill().await;
            return Err(gone);
        }
        let attempt = reattach(
            self.cfg,
            self.node_id,
            self.unacked.last_seq,
            self.worker.report,
        );
        self.attempt = Some(Box::pin(attempt));
        Ok(Flow::Go)
    }

    /// A reattach attempt ended: back with the controller once the lines it lacks are sent
    /// again; a rejection ends the node; any other failure waits for the next attempt.
    async fn on_attempted(
        &mut self,
        done: Result<(Framed, u64), AgentError>,
    ) -> Result<Flow, AgentError> {
        let (mut framed, acked) = match done {
            Ok(back) => back,
            Err(e @ AgentError::Rejected { .. }) => {
                self.worker.kill().await;
                return Err(e);
            }
            Err(e) => {
                let delay = self.backoff.next_delay();
                if let Some(a) = self.away.as_mut() {
                    a.next_try = Instant::now() + delay;
                    if a.why.is_empty() {
                        a.why = e.to_string();
                    }
                }
                return Ok(Flow::Go);
            }
        };
        self.unacked.ack(acked);
        for (seq, line) in &self.unacked.lines {
            let msg = ToController::Worker {
                node_id: self.node_id,
                seq: *seq,
                line: line.clone(),
            };
            if let Err(e) = proto::send(&mut framed, &msg).await {
                return Ok(Flow::Broken(e.to_string()));
            }
        }
        let a = self.away.take().expect("attempts only while away");
        self.say(&format!(
            "back with the controller ({} lines sent again); it was away: {}",
            self.unacked.lines.len(),
            a.why
        ));
        self.backoff.reset();
        self.heartbeat.reset();
        self.conn = Some(framed);
        if let Some(status) = self.worker.exit.clone() {
            self.bye().await;
            return worker_exit(status).map(Flow::Exit);
        }
        Ok(Flow::Go)
    }

    /// The controller connection broke: give up at once without a grace period, else start
    /// (or, right after a reattach, continue) reconnecting.
    fn connection_lost(&mut self, why: String) -> Result<(), AgentError> {
        self.conn = None;
        if self.cfg.reconnect_grace_ms == 0 {
            return Err(AgentError::ControllerClosed);
        }
        let delay = self.backoff.next_delay();
        match self.away.as_mut() {
            // A connection that broke right after a reattach: keep the first deadline.
            Some(a) => a.next_try = Instant::now() + delay,
            None => {
                self.say(&format!(
                    "lost the controller ({why}); the worker trains on, reconnecting for up to \
                     {} ms",
                    self.cfg.reconnect_grace_ms
                ));
                let now = Instant::now();
                self.away = Some(Away {
                    why,
                    deadline: now + Duration::from_millis(self.cfg.reconnect_grace_ms),
                    next_try: now + delay,
                    paused: false,
                });
            }
        }
        Ok(())
    }
}

/// The agent ([`crate::control::controller`]): registers, heartbeats, starts its worker process on
/// the controller's `Job` command and relays, one JSON line each, the controller's commands to
/// the worker's stdin and the worker's stdout lines to the controller. When the controller goes
/// away it keeps the worker and reconnects (see the [module docs](self)). Ends with `Ok` when
/// the worker exited cleanly (after `Stop`) or the controller shut the job down, and with an
/// error when the worker failed, the controller rejected the node or did not come back within
/// `reconnect_grace_ms`. The worker dies with the agent (its stdin closes), so killing an agent
/// kills its node.
pub async fn run_agent(
    cfg: &AgentConfig,
    launch: &WorkerLaunch,
    mut shutdown: watch::Receiver<bool>,
) -> Result<AgentExit, AgentError> {
    let agent = Agent::register(cfg).await?;
    let mut state = AgentLoop::new(cfg, launch, agent);
    loop {
        let wake = state.next_wake(&mut shutdown).await;
        match state.handle(wake).await? {
            Flow::Go => {}
            Flow::Broken(why) => state.connection_lost(why)?,
            Flow::Exit(exit) => return Ok(exit),
        }
    }
}

/// How the agent ends once its worker exited.
fn worker_exit(status: Result<std::process::ExitStatus, String>) -> Result<AgentExit, AgentError> {
    match status {
        Ok(s) if s.success() => Ok(AgentExit::ControllerShutdown),
        Ok(s) => Err(AgentError::WorkerExited(s.to_string())),
        Err(e) => Err(AgentError::WorkerExited(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_bound_with_jitter_and_restarts_after_a_success() {
        let mut b = Backoff::new(50, 1_000, 7);
        let delays: Vec<u64> = (0..12).map(|_| b.next_delay().as_millis() as u64).collect();
        let nominal = [50u64, 100, 200, 400, 800, 1_000, 1_000];
        for (d, n) in delays
            .iter()
            .zip(nominal.iter().chain(std::iter::repeat(&1_000)))
        {
            assert!(
                *d >= n.div_ceil(2) && d <= n,
                "{d} ms for a nominal {n}: {delays:?}"
            );
        }
        assert!(delays.iter().all(|&d| d <= 1_000));
        // Jittered: not every capped delay is the same.
        let capped: std::collections::BTreeSet<u64> = delays[6..].iter().copied().collect();
        assert!(capped.len() > 1, "{delays:?}");
        // Seeded: the same seed gives the same delays, another seed others.
        let mut again = Backoff::new(50, 1_000, 7);
        let same: Vec<u64> = (0..12)
            .map(|_| again.next_delay().as_millis() as u64)
            .collect();
        assert_eq!(delays, same);
        let mut other = Backoff::new(50, 1_000, 8);
        let others: Vec<u64> = (0..12)
            .map(|_| other.next_delay().as_millis() as u64)
            .collect();
        assert_ne!(delays, others);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(50));
        // Degenerate bounds stay sane.
        let mut z = Backoff::new(0, 0, 1);
        assert!(z.next_delay() <= Duration::from_millis(1));
    }

    #[test]
    fn acknowledged_lines_are_forgotten_in_order() {
        let mut u = Unacked::default();
        for i in 0..5 {
            assert_eq!(u.push(format!("l{i}")), i + 1);
        }
        u.ack(3);
        let left: Vec<u64> = u.lines.iter().map(|(s, _)| *s).collect();
        assert_eq!(left, vec![4, 5]);
        u.ack(1);
        assert_eq!(u.lines.len(), 2);
        u.ack(99);
        assert!(u.lines.is_empty());
        assert_eq!(u.push("x".into()), 6);
    }

    #[test]
    fn the_report_follows_commands_and_lines() {
        let mut w = Worker::default();
        assert_eq!(w.report.process, WorkerProcess::NotStarted);
        w.reported(r#"{"step":4,"epoch":2,"loss":1.0,"tokens":1,"ms":1.0}"#);
        assert_eq!(w.report.next_step, 5);
        let paused = serde_json::to_string(&crate::worker::WorkerEvent::Paused {
            epoch: 2,
            step: 7,
            held: vec![],
        })
        .unwrap();
        w.reported(&paused);
        assert_eq!(w.report.next_step, 7);
        w.reported("not json");
        assert_eq!(w.report.next_step, 7);
    }
}
