//! The job controller's tokio server: accepts agent connections, feeds the [`Controller`] from
//! them and from a ticker, and delivers what it outputs (messages to agents, closed
//! connections of fenced nodes, [`Notice`]s to whoever runs the job).
//!
//! # Limits on what a peer can make the controller hold
//! Anyone who can reach the port can connect, so until a connection has registered (shown
//! the token) it is kept cheap and short: its first frame may be at most
//! [`proto::MAX_REGISTER_FRAME_BYTES`] (a longer length prefix closes it at once, before
//! anything is allocated for it), that frame must be complete within `io_timeout_ms` however
//! slowly it trickles in (and within [`ServerConfig::MAX_HANDSHAKE_MS`]), and at most
//! `max_pending_conns` such connections exist at a time, `max_pending_per_addr` of them from
//! one IP address (a flood from one address leaves room for the others; agents that find no
//! room retry, see [`super::agent::Agent::register`]).
//! Only after registration does the frame cap rise to [`proto::MAX_FRAME_BYTES`]; a registered
//! node that stops sending whole frames stops heartbeating and is fenced. `max_conns` bounds
//! all connections together. A connection over either limit is closed as soon as it is
//! accepted.
//!
//! # Fail-over
//! A connection may also start with `Reattach` (an agent that lost its controller, see
//! [`proto`]): once the controller accepts it, it replaces whatever connection the node had,
//! and the old connection's end no longer counts as the node leaving. Each heartbeat is
//! answered with an `Ack` when the saved state includes more of the node's lines.
//! [`serve_controller`] serves a given (e.g. recovered) [`Controller`]; its clock goes on from
//! [`Controller::clock_start_ms`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use super::controller::{Controller, JobParams, Notice, Output};
use super::proto::{self, Framed, ProtoError, ToAgent, ToController};
use super::shutdown_signal;
use crate::worker::Checksums;
use lazarus_planner::job::JobConfigError;

/// How the server talks to agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConfig {
    /// Period of the ticker (expiries and timeouts of the job machine).
    pub tick_ms: u64,
    /// Bound on one write to an agent and on waiting for a first `Register` (the whole frame).
    pub io_timeout_ms: u64,
    /// Connections that have not registered yet, at most (more are closed when accepted).
    pub max_pending_conns: usize,
    /// Connections in all, registered or not, at most (more are closed when accepted).
    pub max_conns: usize,
    /// Unregistered connections from one IP address at most (more from it are closed when
    /// accepted): a flood of idle connections from one address cannot take every pending slot
    /// and lock the real agents out.
    pub max_pending_per_addr: usize,
}

impl ServerConfig {
    /// Room for a burst of agents registering at once; a flood of idle connections can hold at
    /// most this many sockets, each for at most `io_timeout_ms`.
    pub const DEFAULT_MAX_PENDING_CONNS: usize = 64;
    /// A thousand nodes and the pending ones, below the common 1024-descriptor limit of the
    /// process together with its files.
    pub const DEFAULT_MAX_CONNS: usize = 1_000;
    /// A quarter of the pending slots: agents of one host (`lzrun local`'s all come from
    /// 127.0.0.1) registering at once still fit, and retry when they do not.
    pub const DEFAULT_MAX_PENDING_PER_ADDR: usize = 16;
    /// The most a connection may take to send its whole first frame (less when
    /// `io_timeout_ms` is less): a `Register` is a few hundred bytes, so an idle connection
    /// holds a pending slot for at most this long.
    pub const MAX_HANDSHAKE_MS: u64 = 1_000;

    /// The given periods and the default connection limits.
    pub fn new(tick_ms: u64, io_timeout_ms: u64) -> Self {
        Self {
            tick_ms,
            io_timeout_ms,
            max_pending_conns: Self::DEFAULT_MAX_PENDING_CONNS,
            max_conns: Self::DEFAULT_MAX_CONNS,
            max_pending_per_addr: Self::DEFAULT_MAX_PENDING_PER_ADDR,
        }
    }
}

/// Pause of the accept loop after a failed `accept` (typically out of file descriptors): the
/// listener stays readable, so retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Why the job controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("invalid job configuration: {0}")]
    Config(#[from] JobConfigError),
    #[error("tick_ms and io_timeout_ms must be at least 1")]
    ZeroPeriod,
    #[error("max_pending_conns and max_conns must be at least 1")]
    ZeroConns,
}

struct Shared {
    controller: Controller,
    /// Per node: the connection that serves it now (its number) and its queue.
    outboxes: HashMap<u32, (u64, mpsc::UnboundedSender<ToAgent>)>,
    /// The number of the next connection.
    next_conn: u64,
}

struct Ctx {
    shared: Mutex<Shared>,
    start: Instant,
    /// The controller's clock at `start`.
    base_ms: u64,
    notices: mpsc::UnboundedSender<Notice>,
    io_timeout: Duration,
    /// Bound on receiving a connection's first frame ([`ServerConfig::MAX_HANDSHAKE_MS`]).
    handshake_timeout: Duration,
}

/// Unregistered connections per IP address, and the cap.
struct PendingByAddr {
    counts: Mutex<HashMap<std::net::IpAddr, usize>>,
    cap: usize,
}

/// What an unregistered connection holds until it registers (or ends): a pending slot, and
/// one of its address's.
struct Unregistered {
    _permit: OwnedSemaphorePermit,
    addr: std::net::IpAddr,
    by_addr: Arc<PendingByAddr>,
}

impl PendingByAddr {
    /// A slot of `addr`'s, unless it holds `cap` already.
    fn take(
        self: &Arc<Self>,
        addr: std::net::IpAddr,
        permit: OwnedSemaphorePermit,
    ) -> Option<Unregistered> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let n = counts.entry(addr).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(Unregistered {
            _permit: permit,
            addr,
            by_addr: self.clone(),
        })
    }
}

impl Drop for Unregistered {
    fn drop(&mut self) {
        let mut counts = self
            .by_addr
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.addr);
            }
        }
    }
}

impl Ctx {
    fn now_ms(&self) -> u64 {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.base_ms.saturating_add(ms)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the controller and delivers what it outputs, under one lock (so outputs
    /// are delivered in the order the controller produced them).
    fn with<T>(&self, f: impl FnOnce(&mut Controller, u64, &mut Vec<Output>) -> T) -> T {
        let now = self.now_ms();
        let mut g = self.lock();
        let mut out = Vec::new();
        let r = f(&mut g.controller, now, &mut out);
        for o in out {
            match o {
                Output::Send(id, msg) => {
                    if let Some((_, tx)) = g.outboxes.get(&id) {
                        let _ = tx.send(msg);
                    }
                }
                // Dropping the sender ends the connection's session once its queue is sent.
                Output::Close(id) => {
                    g.outboxes.remove(&id);
                }
                Output::Notice(n) => {
                    let _ = self.notices.send(n);
                }
            }
        }
        r
    }
}

/// A handle to tell the running job that a fault was injected (for the detection clock).
#[derive(Clone)]
pub struct JobHandle {
    ctx: Arc<Ctx>,
}

impl JobHandle {
    pub fn fault_injected(&self) {
        self.ctx.with(|c, now, out| c.fault_injected(now, out));
    }

    /// The rank node `name` holds in the plan in force (`None`: not a member).
    pub fn rank_of(&self, name: &str) -> Option<usize> {
        self.ctx.with(|c, _, _| c.rank_of(name))
    }

    /// The loss of step 0, also when a controller before a fail-over counted it.
    pub fn initial_loss(&self) -> Option<f64> {
        self.ctx.with(|c, _, _| c.initial_loss())
    }

    /// Whoever runs the job has the step and reconfiguration records numbered up to `seq`
    /// ([`Controller::delivered`]).
    pub fn delivered(&self, seq: u64) {
        self.ctx.with(|c, _, _| c.delivered(seq));
    }

    /// The job is over (its last notices are sent).
    pub fn is_over(&self) -> bool {
        self.ctx.with(|c, _, _| c.is_over())
    }

    /// The steps counted so far (the machine's next step).
    pub fn next_step(&self) -> u64 {
        self.ctx.with(|c, _, _| c.machine().next_step())
    }
}

/// Runs the job controller on `listener` until the job is over or `shutdown` turns `true`
/// (then every agent is told to shut down). Notices go to `notices`; returns the checksums of
/// the workers that stopped cleanly. `on_start` gets a [`JobHandle`] before serving.
pub async fn run_job(
    listener: TcpListener,
    server: ServerConfig,
    params: JobParams,
    notices: mpsc::UnboundedSender<Notice>,
    shutdown: watch::Receiver<bool>,
    on_start: impl FnOnce(JobHandle),
) -> Result<Vec<Checksums>, JobError> {
    let controller = Controller::new(params)?;
    serve_controller(listener, server, controller, notices, shutdown, on_start).await
}

/// [`run_job`] with a controller built by the caller: one that saves its state
/// ([`Controller::save_to`]) or one rebuilt from a saved state ([`Controller::recover`]),
/// which takes the job back before serving ([`Controller::start`]).
pub async fn serve_controller(
    listener: TcpListener,
    server: ServerConfig,
    controller: Controller,
    notices: mpsc::UnboundedSender<Notice>,
    mut shutdown: watch::Receiver<bool>,
    on_start: impl FnOnce(JobHandle),
) -> Result<Vec<Checksums>, JobError> {
    if server.tick_ms == 0 || server.io_timeout_ms == 0 {
        return Err(JobError::ZeroPeriod);
    }
    if server.max_pending_conns == 0 || server.max_conns == 0 || server.max_pending_per_addr == 0 {
        return Err(JobError::ZeroConns);
    }
    let pending = Arc::new(Semaphore::new(server.max_pending_conns));
    let by_addr = Arc::new(PendingByAddr {
        counts: Mutex::new(HashMap::new()),
        cap: server.max_pending_per_addr,
    });
    let all = Arc::new(Semaphore::new(server.max_conns));
    let ctx = Arc::new(Ctx {
        start: Instant::now(),
        base_ms: controller.clock_start_ms(),
        shared: Mutex::new(Shared {
            controller,
            outboxes: HashMap::new(),
            next_conn: 0,
        }),
        notices,
        io_timeout: Duration::from_millis(server.io_timeout_ms),
        handshake_timeout: Duration::from_millis(
            server.io_timeout_ms.min(ServerConfig::MAX_HANDSHAKE_MS),
        ),
    });
    ctx.with(|c, now, out| c.start(now, out));
    on_start(JobHandle { ctx: ctx.clone() });
    let mut ticker = tokio::time::interval(Duration::from_millis(server.tick_ms));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut conns = JoinSet::new();
    loop {
        if ctx.lock().controller.is_over() {
            break;
        }
        tokio::select! {
            _ = shutdown_signal(&mut shutdown) => break,
            _ = ticker.tick() => ctx.with(|c, now, out| c.tick(now, out)),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Over a limit: dropping the stream closes it at once.
                    let (Ok(slot), Ok(unregistered)) = (
                        all.clone().try_acquire_owned(),
                        pending.clone().try_acquire_owned(),
                    ) else {
                        continue;
                    };
                    let Some(unregistered) = by_addr.take(peer.ip(), unregistered) else {
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_conn(stream, ctx.clone(), slot, unregistered));
                }
                Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
            },
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                // A connection task panicked while it held the controller (a planner bug, or
                // a job it cannot plan): the controller's state is suspect and the node it
                // served hangs. Crash this task as if the panic were its own, so whoever runs
                // the job sees it (`lzrun local` restarts the controller from its saved state,
                // a few times at most, then exits 2) instead of serving a job that never moves.
                if let Err(e) = done
                    && e.is_panic()
                {
                    conns.abort_all();
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
    }
    // Tell every connected agent to stop, then give the connections a moment to drain.
    {
        let g = ctx.lock();
        for (_, tx) in g.outboxes.values() {
            let _ = tx.send(ToAgent::Shutdown);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
    let sums = ctx.lock().controller.checksums().to_vec();
    Ok(sums)
}

/// Serves one connection; `_slot` counts it against `max_conns` until it ends, `unregistered`
/// against `max_pending_conns` until it has registered.
async fn serve_conn(
    stream: TcpStream,
    ctx: Arc<Ctx>,
    _slot: OwnedSemaphorePermit,
    unregistered: Unregistered,
) {
    let mut framed = proto::framed_with_cap(stream, proto::MAX_REGISTER_FRAME_BYTES);
    let _ = serve(&mut framed, &ctx, unregistered).await;
}

async fn write(ctx: &Ctx, framed: &mut Framed, msg: &ToAgent) -> Result<(), ProtoError> {
    let frame: Bytes = proto::encode(msg)?;
    match tokio::time::timeout(ctx.io_timeout, framed.send(frame)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => Err(ProtoError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

async fn reject(ctx: &Ctx, framed: &mut Framed, reason: String) -> Result<(), ProtoError> {
    write(ctx, framed, &ToAgent::Rejected { reason }).await?;
    let _ = tokio::time::timeout(ctx.io_timeout, SinkExt::<Bytes>::close(framed)).await;
    Ok(())
}

async fn serve(
    framed: &mut Framed,
    ctx: &Ctx,
    unregistered: Unregistered,
) -> Result<(), ProtoError> {
    // A first frame over the cap is an error here: the connection closes without an answer.
    let first = match proto::read_register(framed, ctx.handshake_timeout).await? {
        proto::FirstFrame::Closed => return Ok(()),
        proto::FirstFrame::Reject(reason) => return reject(ctx, framed, reason).await,
        first => first,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Register (or reattach) and install the outbox under one lock, so the first command is
    // not lost.
    let admitted = {
        let now = ctx.now_ms();
        let mut g = ctx.lock();
        let mut out = Vec::new();
        let r = match &first {
            proto::FirstFrame::Register(reg) => g
                .controller
                .register(reg, now, &mut out)
                .map(|id| (id, ToAgent::Registered { node_id: id })),
            proto::FirstFrame::Reattach(r) => {
                g.controller
                    .reattach(r, now, &mut out)
                    .map(|(id, acked_seq)| {
                        let answer = ToAgent::Reattached {
                            node_id: id,
                            acked_seq,
                        };
                        (id, answer)
                    })
            }
            proto::FirstFrame::Closed | proto::FirstFrame::Reject(_) => unreachable!("above"),
        };
        let conn = g.next_conn;
        g.next_conn += 1;
        if let Ok((id, _)) = &r {
            // A reattaching node's old connection (if still open) no longer serves it.
            g.outboxes.insert(*id, (conn, tx));
        }
        drop(g);
        ctx.with(|_, _, o| o.extend(out));
        r.map(|(id, answer)| (id, answer, conn))
    };
    let (node_id, answer, conn) = match admitted {
        Ok(a) => a,
        Err(reason) => return reject(ctx, framed, reason.to_string()).await,
    };
    // Authenticated: full-size frames (plans) from now on, and no longer a pending connection.
    framed
        .codec_mut()
        .set_max_frame_length(proto::MAX_FRAME_BYTES);
    drop(unregistered);
    write(ctx, framed, &answer).await?;
    let why = session(framed, ctx, node_id, &mut rx).await;
    // Only the connection that serves the node now speaks for it: after a reattach the old
    // one's end is not the node leaving.
    let replaced = {
        let mut g = ctx.lock();
        let replaced = g.outboxes.get(&node_id).is_some_and(|(c, _)| *c != conn);
        if !replaced {
            g.outboxes.remove(&node_id);
        }
        replaced
    };
    if !replaced {
        ctx.with(|c, now, out| c.gone(node_id, &why, now, out));
    }
    Ok(())
}

/// Relays between the agent and the controller until the connection ends; returns why.
async fn session(
    framed: &mut Framed,
    ctx: &Ctx,
    node_id: u32,
    rx: &mut mpsc::UnboundedReceiver<ToAgent>,
) -> String {
    let mut acked = 0u64;
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(m) => {
                    let stop = matches!(m, ToAgent::Shutdown | ToAgent::Rejected { .. });
                    if write(ctx, framed, &m).await.is_err() {
                        return "connection lost".into();
                    }
                    if stop {
                        return "shut down".into();
                    }
                }
                None => return "fenced".into(),
            },
            frame = framed.next() => {
                let Some(Ok(frame)) = frame else {
                    // The agent process is gone (a reconnecting agent registers anew).
                    return "connection closed".into();
                };
                match proto::decode::<ToController>(&frame) {
                    Ok(ToController::Heartbeat { node_id: id, .. }) if id == node_id => {
                        let alive = ctx.with(|c, now, out| {
                            c.heartbeat(node_id, now, out).then(|| c.acked(node_id))
                        });
                        let Some(ack) = alive else {
                            let name = ctx.with(|c, _, _| c.name_of(node_id));
                            let _ = reject(ctx, framed, format!("node {name} expired")).await;
                            return "expired".into();
                        };
                        if ack > acked {
                            acked = ack;
                            if write(ctx, framed, &ToAgent::Ack { seq: ack }).await.is_err() {
                                return "connection lost".into();
                            }
                        }
                    }
                    Ok(ToController::Worker { node_id: id, seq, line }) if id == node_id => {
                        ctx.with(|c, now, out| c.worker_line(node_id, seq, &line, now, out));
                    }
                    Ok(ToController::Bye { node_id: id }) if id == node_id => {
                        return "said goodbye".into();
                    }
                    Ok(_) => {
                        let name = ctx.with(|c, _, _| c.name_of(node_id));
                        let _ = reject(ctx, framed, format!("node {name} fenced: unexpected message")).await;
                        return "protocol violation".into();
                    }
                    Err(e) => {
                        let name = ctx.with(|c, _, _| c.name_of(node_id));
                        let _ = reject(ctx, framed, format!("node {name} fenced: {e}")).await;
                        return format!("protocol violation: {e}");
                    }
                }
            }
        }
    }
}
