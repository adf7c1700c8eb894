//! Running the job server (the controller) and handling its notices; with a [`Failover`], a
//! controller that dies (killed by the fault schedule, or a panic) is replaced by one rebuilt
//! from its saved state, on the same listening socket.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{Controller, JobHandle, Notice, ServerConfig, run_controller};
use lazarus_executor::metrics::StepRecord;
use lazarus_executor::worker::Checksums;
use tokio::sync::{mpsc as tmpsc, watch};
use tokio::task::JoinHandle;

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

    /// When the job starts waiting for nodes: `live` are registered (not all ready yet), the
    /// job needs `needed` ready ones.
    fn on_waiting(&mut self, _job: &JobHandle, _live: usize, _needed: usize) -> Result<()> {
        Ok(())
    }

    /// Whether the controller is to be killed now (asked once after each `on_step`).
    fn take_controller_kill(&mut self) -> bool {
        false
    }
}

/// How `drive` replaces a controller that died: from the state it saved in `state_dir`.
pub struct Failover {
    pub state_dir: PathBuf,
    pub token: String,
    /// How long a killed controller stays down before its replacement starts.
    pub down: Duration,
}

/// Controllers replaced after a panic, at most (a bug that panics at once would loop).
const MAX_CRASH_RESTARTS: usize = 3;

/// One controller's run: its task, its notices, its handle.
struct Incarnation {
    /// Taken when awaited (a task is awaited once).
    task: Option<JoinHandle<Result<Vec<Checksums>, lazarus_executor::control::JobError>>>,
    notices: tmpsc::UnboundedReceiver<Notice>,
    handle: JobHandle,
}

impl Incarnation {
    /// Serves `controller` on (a clone of) `listener`.
    async fn start(
        listener: &std::net::TcpListener,
        server_cfg: ServerConfig,
        controller: Controller,
        stop: watch::Receiver<bool>,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::from_std(
            listener
                .try_clone()
                .context("sharing the listening socket")?,
        )
        .context("listening")?;
        let (tx, notices) = tmpsc::unbounded_channel();
        let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(run_controller(
            listener,
            server_cfg,
            controller,
            tx,
            stop,
            move |h| {
                let _ = handle_tx.send(h);
            },
        ));
        match handle_rx.await {
            Ok(handle) => Ok(Self {
                task: Some(task),
                notices,
                handle,
            }),
            Err(_) => match task.await {
                Ok(Err(e)) => Err(anyhow!("{e}")),
                _ => Err(anyhow!("the job server did not start")),
            },
        }
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
/// [`stop_signals`], then the error is [`Interrupted`]), calling `hooks` on the way. With
/// `failover`, a controller that dies is replaced from its saved state (see the module docs).
#[allow(clippy::too_many_arguments)]
pub async fn drive(
    listener: std::net::TcpListener,
    server_cfg: ServerConfig,
    controller: Controller,
    failover: Option<Failover>,
    report: &mut Report,
    hooks: &mut impl Hooks,
    stop: impl std::future::Future<Output = &'static str>,
) -> Result<()> {
    if let Some(e) = stdout_failure() {
        return Err(e.into());
    }
    tokio::pin!(stop);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut inc = Incarnation::start(&listener, server_cfg, controller, stop_rx.clone()).await?;
    let mut outcome: Result<()> = Err(anyhow!("the job server stopped unexpectedly"));
    let mut seen = BTreeSet::new();
    let mut crashes = 0;
    // The last controller kill: when, after which step; cleared at the first step counted after.
    let mut killed: Option<(Instant, u64)> = None;
    loop {
        let mut restart: Option<String> = None;
        tokio::select! {
            n = inc.notices.recv() => match n {
                Some(Notice::Step(r)) => {
                    let first = seen.insert(r.step);
                    if let Some((t, after)) = killed.filter(|(_, s)| r.step > *s) {
                        killed = None;
                        report.say(&format!(
                            "lzrun local: the restarted controller counted step {} {} ms after \
                             the kill (after step {after}; the workers trained on meanwhile)",
                            r.step,
                            t.elapsed().as_millis()
                        ));
                    }
                    let rec = r.clone();
                    report.step(r);
                    if first && let Err(e) = hooks.on_step(&rec, &inc.handle) {
                        outcome = Err(e);
                        break;
                    }
                    if hooks.take_controller_kill() {
                        restart = Some(format!("killed after step {}", rec.step));
                        killed = Some((Instant::now(), rec.step));
                    }
                }
                Some(Notice::Reconfigured(r)) => report.reconfigured(r),
                Some(Notice::Log(l)) => report.say(&format!("[controller] {l}")),
                Some(Notice::WaitingForNodes {
                    live,
                    needed,
                    reason,
                }) => {
                    report.say(&format!("[controller] waiting for nodes ({live} live): {reason}"));
                    if let Err(e) = hooks.on_waiting(&inc.handle, live, needed) {
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
                // The controller ended without finishing the job.
                None => match inc.task.take().expect("awaited once").await {
                    Err(e) if e.is_panic() && failover.is_some() && crashes < MAX_CRASH_RESTARTS => {
                        crashes += 1;
                        restart = Some(format!("crashed ({e})"));
                    }
                    Ok(Err(e)) => {
                        outcome = Err(anyhow!("{e}"));
                        break;
                    }
                    Err(e) => {
                        outcome = Err(anyhow!("the job server crashed: {e}"));
                        break;
                    }
                    Ok(Ok(_)) => break,
                },
            },
            name = &mut stop => {
                outcome = Err(Interrupted(name).into());
                break;
            }
        }
        if let (Some(why), Some(f)) = (restart, failover.as_ref()) {
            // As a SIGKILL would: no goodbye, no last save; its sockets close.
            if let Some(task) = inc.task.take() {
                task.abort();
                let _ = task.await;
            }
            let down = if killed.is_some() {
                f.down
            } else {
                Duration::ZERO
            };
            report.say(&format!(
                "lzrun local: controller {why}; restarting it from {} in {} ms",
                f.state_dir.display(),
                down.as_millis()
            ));
            tokio::select! {
                _ = tokio::time::sleep(down) => {}
                name = &mut stop => {
                    outcome = Err(Interrupted(name).into());
                    break;
                }
            }
            let controller = Controller::recover(&f.state_dir, &f.token)
                .map_err(|e| anyhow!("restarting the controller: {e}"))?;
            inc = Incarnation::start(&listener, server_cfg, controller, stop_rx.clone()).await?;
        }
        // Nobody reads the log any more (`| head`), or it cannot be written: stop the job as
        // on Ctrl-C rather than train on unseen.
        if let Some(e) = stdout_failure() {
            outcome = Err(e.into());
            break;
        }
    }
    let _ = stop_tx.send(true);
    if let Some(task) = inc.task.take() {
        match task.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(anyhow!("{e}")),
            Err(e) => return Err(anyhow!("the job server crashed: {e}")),
        }
    }
    outcome
}
