//! Running the job server (the controller) and handling its notices.

use std::collections::BTreeSet;

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{JobHandle, JobParams, Notice, ServerConfig, run_job};
use lazarus_executor::metrics::StepRecord;
use tokio::sync::{mpsc as tmpsc, watch};

use crate::report::Report;

/// The tokio runtime of the controller and of an agent.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

/// What whoever runs the job does when the controller reports something (`lzrun local`
/// injects its faults); an error ends the job.
pub trait Hooks {
    /// After every completed step (once per step).
    fn on_step(&mut self, _rec: &StepRecord, _job: &JobHandle) -> Result<()> {
        Ok(())
    }

    /// With the name of every node the controller fenced.
    fn on_fenced(&mut self, _name: &str) {}

    /// When the job starts waiting for nodes to join.
    fn on_waiting(&mut self, _job: &JobHandle) -> Result<()> {
        Ok(())
    }
}

/// No hooks: a controller whose nodes come and go on their own.
pub struct NoHooks;

impl Hooks for NoHooks {}

/// Runs the job server and handles its notices until the job is over (or Ctrl-C), calling
/// `hooks` on the way.
pub async fn drive(
    listener: tokio::net::TcpListener,
    server_cfg: ServerConfig,
    params: JobParams,
    report: &mut Report,
    hooks: &mut impl Hooks,
) -> Result<()> {
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let (stop_tx, stop_rx) = watch::channel(false);
    let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(run_job(
        listener,
        server_cfg,
        params,
        tx,
        stop_rx,
        move |h| {
            let _ = handle_tx.send(h);
        },
    ));
    let handle = match handle_rx.await {
        Ok(h) => h,
        Err(_) => {
            return match server.await {
                Ok(Err(e)) => Err(anyhow!("{e}")),
                _ => Err(anyhow!("the job server did not start")),
            };
        }
    };
    let mut outcome: Result<()> = Err(anyhow!("the job server stopped unexpectedly"));
    let mut seen = BTreeSet::new();
    loop {
        tokio::select! {
            n = rx.recv() => match n {
                Some(Notice::Step(r)) => {
                    let first = seen.insert(r.step);
                    let rec = r.clone();
                    report.step(r);
                    if first && let Err(e) = hooks.on_step(&rec, &handle) {
                        outcome = Err(e);
                        break;
                    }
                }
                Some(Notice::Reconfigured(r)) => report.reconfigured(r),
                Some(Notice::Log(l)) => report.say(&format!("[controller] {l}")),
                Some(Notice::WaitingForNodes { live, reason }) => {
                    report.say(&format!("[controller] waiting for nodes ({live} live): {reason}"));
                    if let Err(e) = hooks.on_waiting(&handle) {
                        outcome = Err(e);
                        break;
                    }
                }
                Some(Notice::Fenced { name, reason }) => {
                    report.say(&format!("[controller] node {name} fenced: {reason}"));
                    hooks.on_fenced(&name);
                }
                Some(Notice::Finished(r)) => {
                    outcome = r.map_err(|e| anyhow!(e));
                    break;
                }
                None => break,
            },
            _ = tokio::signal::ctrl_c() => {
                outcome = Err(anyhow!("interrupted (Ctrl-C): every node was told to stop"));
                break;
            }
        }
    }
    let _ = stop_tx.send(true);
    match server.await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(anyhow!("{e}")),
        Err(e) => return Err(anyhow!("the job server crashed: {e}")),
    }
    outcome
}
