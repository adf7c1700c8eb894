//! Running the job server (the controller) and handling its notices.

use std::collections::BTreeSet;

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{JobHandle, JobParams, Notice, ServerConfig, run_job};
use lazarus_executor::metrics::StepRecord;
use tokio::sync::{mpsc as tmpsc, watch};

use crate::report::{Report, stdout_failure};

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

/// The job was stopped by a signal (SIGINT, SIGTERM or SIGHUP), not by a failure.
#[derive(Debug)]
pub struct Interrupted(pub &'static str);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.0 == "SIGINT" {
            "Ctrl-C, SIGINT"
        } else {
            self.0
        };
        write!(f, "interrupted ({how}): every node was told to stop")
    }
}

impl std::error::Error for Interrupted {}

/// Resolves with the name of the first stop signal received: SIGINT (Ctrl-C), SIGTERM (what
/// schedulers and `kill` send) or SIGHUP (the terminal went away). Installing the handlers is
/// what keeps these signals from killing the process outright, so call it before anything
/// that must be cleaned up.
pub fn stop_signals() -> Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut hup = signal(SignalKind::hangup()).context("handling SIGHUP")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
            _ = hup.recv() => "SIGHUP",
        }
    })
}

/// Runs the job server and handles its notices until the job is over (or a stop signal:
/// [`stop_signals`], then the error is [`Interrupted`]), calling `hooks` on the way.
pub async fn drive(
    listener: tokio::net::TcpListener,
    server_cfg: ServerConfig,
    params: JobParams,
    report: &mut Report,
    hooks: &mut impl Hooks,
    stop: impl std::future::Future<Output = &'static str>,
) -> Result<()> {
    if let Some(e) = stdout_failure() {
        return Err(e.into());
    }
    tokio::pin!(stop);
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
            name = &mut stop => {
                outcome = Err(Interrupted(name).into());
                break;
            }
        }
        // Nobody reads the log any more (`| head`), or it cannot be written: stop the job as
        // on Ctrl-C rather than train on unseen.
        if let Some(e) = stdout_failure() {
            outcome = Err(e.into());
            break;
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
