//! The job controller's tokio server: accepts agent connections, feeds the [`Controller`] from
//! them and from a ticker, and delivers what it outputs (messages to agents, closed
//! connections of fenced nodes, [`Notice`]s to whoever runs the job).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
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
    /// Bound on one write to an agent and on waiting for a first `Register`.
    pub io_timeout_ms: u64,
}

/// Why the job controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("invalid job configuration: {0}")]
    Config(#[from] JobConfigError),
    #[error("tick_ms and io_timeout_ms must be at least 1")]
    ZeroPeriod,
}

struct Shared {
    controller: Controller,
    outboxes: HashMap<u32, mpsc::UnboundedSender<ToAgent>>,
}

struct Ctx {
    shared: Mutex<Shared>,
    start: Instant,
    notices: mpsc::UnboundedSender<Notice>,
    io_timeout: Duration,
}

impl Ctx {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
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
                    if let Some(tx) = g.outboxes.get(&id) {
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
}

/// Runs the job controller on `listener` until the job is over or `shutdown` turns `true`
/// (then every agent is told to shut down). Notices go to `notices`; returns the checksums of
/// the workers that stopped cleanly. `on_start` gets a [`JobHandle`] before serving.
pub async fn run_job(
    listener: TcpListener,
    server: ServerConfig,
    params: JobParams,
    notices: mpsc::UnboundedSender<Notice>,
    mut shutdown: watch::Receiver<bool>,
    on_start: impl FnOnce(JobHandle),
) -> Result<Vec<Checksums>, JobError> {
    if server.tick_ms == 0 || server.io_timeout_ms == 0 {
        return Err(JobError::ZeroPeriod);
    }
    let ctx = Arc::new(Ctx {
        shared: Mutex::new(Shared {
            controller: Controller::new(params)?,
            outboxes: HashMap::new(),
        }),
        start: Instant::now(),
        notices,
        io_timeout: Duration::from_millis(server.io_timeout_ms),
    });
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
            accepted = listener.accept() => if let Ok((stream, _)) = accepted {
                let _ = stream.set_nodelay(true);
                conns.spawn(serve_conn(stream, ctx.clone()));
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    // Tell every connected agent to stop, then give the connections a moment to drain.
    {
        let g = ctx.lock();
        for tx in g.outboxes.values() {
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

async fn serve_conn(stream: TcpStream, ctx: Arc<Ctx>) {
    let mut framed = proto::framed(stream);
    let _ = serve(&mut framed, &ctx).await;
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

async fn serve(framed: &mut Framed, ctx: &Ctx) -> Result<(), ProtoError> {
    let reg = match proto::read_register(framed, ctx.io_timeout).await? {
        proto::FirstFrame::Register(r) => r,
        proto::FirstFrame::Closed => return Ok(()),
        proto::FirstFrame::Reject(reason) => return reject(ctx, framed, reason).await,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Register and install the outbox under one lock, so the first command is not lost.
    let registered = {
        let now = ctx.now_ms();
        let mut g = ctx.lock();
        let mut out = Vec::new();
        let r = g.controller.register(&reg, now, &mut out);
        if let Ok(id) = r {
            g.outboxes.insert(id, tx);
            drop(g);
            ctx.with(|_, _, o| o.extend(out));
        }
        r
    };
    let node_id = match registered {
        Ok(id) => id,
        Err(reason) => return reject(ctx, framed, reason.to_string()).await,
    };
    write(ctx, framed, &ToAgent::Registered { node_id }).await?;
    let why = session(framed, ctx, node_id, &mut rx).await;
    ctx.lock().outboxes.remove(&node_id);
    ctx.with(|c, now, out| c.gone(node_id, &why, now, out));
    Ok(())
}

/// Relays between the agent and the controller until the connection ends; returns why.
async fn session(
    framed: &mut Framed,
    ctx: &Ctx,
    node_id: u32,
    rx: &mut mpsc::UnboundedReceiver<ToAgent>,
) -> String {
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
                        if !ctx.with(|c, now, out| c.heartbeat(node_id, now, out)) {
                            let _ = reject(ctx, framed, format!("node {node_id} expired")).await;
                            return "expired".into();
                        }
                    }
                    Ok(ToController::Worker { node_id: id, line }) if id == node_id => {
                        ctx.with(|c, now, out| c.line(node_id, &line, now, out));
                    }
                    Ok(ToController::Bye { node_id: id }) if id == node_id => {
                        return "said goodbye".into();
                    }
                    Ok(_) => {
                        let _ = reject(ctx, framed, format!("node {node_id} fenced: unexpected message")).await;
                        return "protocol violation".into();
                    }
                    Err(e) => {
                        let _ = reject(ctx, framed, format!("node {node_id} fenced: {e}")).await;
                        return format!("protocol violation: {e}");
                    }
                }
            }
        }
    }
}
