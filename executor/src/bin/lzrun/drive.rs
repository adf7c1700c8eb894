//! Running the job server (the controller) and handling its notices; with a [`Failover`], a
//! controller that dies (killed by the fault schedule, or a panic) is replaced by one rebuilt
//! from its saved state, on the same listening socket.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{Controller, JobHandle, Notice, ServerConfig, serve_controller};
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
        let task = tokio::spawn(serve_controller(
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
///
/// Also notes the signal for [`stop_requested`] as soon as it arrives (a task of the runtime
/// watches for it), for loops that run between two polls of the returned future.
pub fn stop_signals() -> Result<impl std::future::Future<Output = &'static str>> {
    let first = any_stop_signal()?;
    let watcher = any_stop_signal()?;
    tokio::spawn(async move {
        let name = watcher.await;
        let _ = STOP_REQUESTED.set(name);
    });
    Ok(first)
}

/// The stop signals as one future (each call has streams of its own: tokio delivers a signal
/// to every stream registered for it).
fn any_stop_signal() -> Result<impl std::future::Future<Output = &'static str>> {
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

static STOP_REQUESTED: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The stop signal received, if any: work that may take long between two notices of the
/// controller (starting the processes of many scheduled joins) checks it and ends the job as
/// the signal would ([`Interrupted`]), so SIGTERM is honoured within moments whatever the
/// fault schedule.
pub fn stop_requested() -> Option<&'static str> {
    STOP_REQUESTED.get().copied()
}

/// The test failpoint `LZRUN_TEST_KILL_CONTROLLER_AHEAD=N`: a controller kill due after step
/// S waits until the controller has counted step S + N, reading none of its notices meanwhile
/// (at most a minute), as a launcher busy with its faults lags behind its controller. The
/// records of steps S + 1 ..= S + N are then counted and saved, and not yet delivered, when the
/// controller dies. Only tests set it.
fn kill_ahead_failpoint() -> Result<Option<u64>> {
    const VAR: &str = "LZRUN_TEST_KILL_CONTROLLER_AHEAD";
    let Some(v) = std::env::var_os(VAR) else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    v.trim()
        .parse()
        .map(Some)
        .map_err(|_| anyhow!("{VAR}={v}: expected a number of steps, e.g. 5"))
}

/// What the drive loop does next.
enum Next {
    Go,
    /// Replace the controller (why, for the log).
    Restart(String),
    /// The job is over, with this outcome.
    End(Result<()>),
}

/// What `drive` remembers across controller incarnations.
#[derive(Default)]
struct Supervision {
    /// Steps already passed to the hooks (a step is redone after a rollback, and a controller
    /// that takes the job back from a state older than what it reported counts some again).
    seen: BTreeSet<u64>,
    /// The sequence number of the last step or reconfiguration record reported: a restarted
    /// controller hands out again the records its predecessor may not have delivered, and
    /// those up to this one are skipped (each record is reported once, in order).
    delivered: u64,
    /// Controllers replaced after a panic.
    crashes: usize,
    /// The last controller kill: when, after which step; cleared at the first step counted after.
    killed: Option<(Instant, u64)>,
}

impl Supervision {
    /// Reports a notice of the controller and calls the hooks it concerns.
    fn on_notice(
        &mut self,
        notice: Notice,
        job: &JobHandle,
        report: &mut Report,
        hooks: &mut impl Hooks,
    ) -> Next {
        match notice {
            Notice::Step { seq, .. } | Notice::Reconfigured { seq, .. }
                if seq <= self.delivered =>
            {
                Next::Go
            }
            Notice::Step {
                seq,
                record: r,
                again,
            } => {
                self.delivered = seq;
                let first = self.seen.insert(r.step);
                if let Some((t, after)) = self.killed.filter(|(_, s)| !again && r.step > *s) {
                    self.killed = None;
                    report.say(&format!(
                        "lzrun local: the restarted controller counted step {} {} ms after the \
                         kill (after step {after}; the workers trained on meanwhile)",
                        r.step,
                        t.elapsed().as_millis()
                    ));
                }
                let rec = r.clone();
                report.step(*r);
                job.delivered(seq);
                if first && let Err(e) = hooks.on_step(&rec, job) {
                    return Next::End(Err(e));
                }
                if hooks.take_controller_kill() {
                    self.killed = Some((Instant::now(), rec.step));
                    return Next::Restart(format!("killed after step {}", rec.step));
                }
                Next::Go
            }
            Notice::Reconfigured { seq, record, .. } => {
                self.delivered = seq;
                report.reconfigured(record);
                job.delivered(seq);
                Next::Go
            }
            Notice::Log(l) => {
                report.say(&format!("[controller] {l}"));
                Next::Go
            }
            Notice::WaitingForNodes {
                live,
                needed,
                reason,
            } => {
                report.say(&format!(
                    "[controller] waiting for nodes ({live} live): {reason}"
                ));
                match hooks.on_waiting(job, live, needed) {
                    Ok(()) => Next::Go,
                    Err(e) => Next::End(Err(e)),
                }
            }
            Notice::Fenced { name, reason } => {
                report.say(&format!("[controller] node {name} fenced: {reason}"));
                hooks.on_fenced(&name);
                Next::Go
            }
            Notice::Finished(r) => {
                // A controller that took the job back never saw step 0's record.
                if let Some(loss) = job.initial_loss() {
                    report.set_initial_loss(loss);
                }
                Next::End(r.map_err(|e| anyhow!(e)))
            }
        }
    }

    /// The controller's notices ended without `Finished`: a panic is replaced (with a
    /// failover, a few times at most); anything else ends the job.
    async fn on_controller_end(&mut self, inc: &mut Incarnation, failover: bool) -> Next {
        match inc.task.take().expect("awaited once").await {
            Err(e) if e.is_panic() && failover && self.crashes < MAX_CRASH_RESTARTS => {
                self.crashes += 1;
                Next::Restart(format!("crashed ({e})"))
            }
            Ok(Err(e)) => Next::End(Err(anyhow!("{e}"))),
            Err(e) => Next::End(Err(anyhow!("the job server crashed: {e}"))),
            Ok(Ok(_)) => Next::End(Err(anyhow!("the job server stopped unexpectedly"))),
        }
    }
}

/// Where `drive` serves its controllers.
struct Serving<'a> {
    listener: &'a std::net::TcpListener,
    server_cfg: ServerConfig,
    stop_rx: watch::Receiver<bool>,
}

impl Serving<'_> {
    async fn start(&self, controller: Controller) -> Result<Incarnation> {
        Incarnation::start(
            self.listener,
            self.server_cfg,
            controller,
            self.stop_rx.clone(),
        )
        .await
    }

    /// Replaces the controller of `inc` (as a SIGKILL would: no goodbye, no last save; its
    /// sockets close) by one rebuilt from its saved state, after the failover's down time when
    /// it was killed (`killed`: after which step). A controller to be killed whose job is
    /// already over (its last notices sent, not all read yet) is left to end. A stop signal
    /// meanwhile ends the job.
    async fn restart(
        &self,
        why: &str,
        f: &Failover,
        killed: Option<u64>,
        inc: &mut Incarnation,
        report: &mut Report,
        stop: &mut (impl std::future::Future<Output = &'static str> + Unpin),
    ) -> Result<Next> {
        if let Some(after) = killed {
            if let Some(ahead) = kill_ahead_failpoint()? {
                let deadline = Instant::now() + Duration::from_secs(60);
                while inc.handle.next_step() <= after + ahead
                    && !inc.handle.is_over()
                    && Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            if inc.handle.is_over() {
                report.say(&format!(
                    "lzrun local: the controller to be killed after step {after} is done: \
                     the job is over, it is left to end"
                ));
                return Ok(Next::Go);
            }
        }
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
            name = stop => return Ok(Next::End(Err(Interrupted(name).into()))),
        }
        let controller = Controller::recover(&f.state_dir, &f.token)
            .map_err(|e| anyhow!("restarting the controller: {e}"))?;
        *inc = self.start(controller).await?;
        Ok(Next::Go)
    }
}

/// Runs the job server and handles its notices until the job is over (or a stop signal:
/// [`stop_signals`], then the error is [`Interrupted`]), calling `hooks` on the way. With
/// `failover`, a controller that dies is replaced from its saved state (see the module docs).
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
    let serving = Serving {
        listener: &listener,
        server_cfg,
        stop_rx,
    };
    let mut inc = serving.start(controller).await?;
    let mut sup = Supervision::default();
    let outcome = loop {
        let next = tokio::select! {
            n = inc.notices.recv() => match n {
                Some(n) => sup.on_notice(n, &inc.handle, report, hooks),
                None => sup.on_controller_end(&mut inc, failover.is_some()).await,
            },
            name = &mut stop => Next::End(Err(Interrupted(name).into())),
        };
        let next = match (next, failover.as_ref()) {
            (Next::Restart(why), Some(f)) => {
                let killed = sup.killed.map(|(_, after)| after);
                serving
                    .restart(&why, f, killed, &mut inc, report, &mut stop)
                    .await?
            }
            (next, _) => next,
        };
        if let Next::End(outcome) = next {
            break outcome;
        }
        // Nobody reads the log any more (`| head`), or it cannot be written: stop the job as
        // on Ctrl-C rather than train on unseen.
        if let Some(e) = stdout_failure() {
            break Err(e.into());
        }
    };
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
