//! The managed worker: one training process under a controller, in one of three explicit
//! phases — idle (waiting for the controller), reconfiguring (applying a new membership and
//! plan), training (one atomic step at a time) — until [`Command::Stop`].

use std::net::{IpAddr, TcpListener};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use anyhow::{Result, anyhow, bail, ensure};

use super::abort::AbortSlot;
use super::migrate::reconfigure;
use super::protocol::{
    Checksums, Command, JobSpec, Reconfigure, StateSource, StepLine, WorkerEvent,
};
use super::state::{Snapshot, State, train_step, write_checkpoint};
use crate::model::Corpus;
use crate::runtime::DistributedExperts;

/// Where the worker is.
enum Phase {
    /// No mesh; waiting for the controller's next command.
    Idle,
    /// Applying this reconfiguration next.
    Reconfiguring(Box<Reconfigure>),
    /// Training on this epoch's mesh.
    Training(Box<DistributedExperts>),
    /// Told to stop.
    Stopped,
}

/// Waits for the job, then runs the managed worker of the [worker docs](super) until
/// [`Command::Stop`]. `abort` is shared with the thread that reads `commands`, which aborts
/// the current epoch's communicator on [`Command::Abort`]. `emit` gets every output line
/// (JSON).
pub fn run_managed_worker(
    commands: &Receiver<Command>,
    abort: &AbortSlot,
    emit: impl FnMut(&str) -> Result<()>,
) -> Result<Checksums> {
    let job = match commands.recv() {
        Ok(Command::Job(job)) => job,
        Ok(other) => bail!("the first command must be Job, got {other:?}"),
        Err(_) => bail!("control channel closed before the job arrived"),
    };
    job.config
        .validate()
        .map_err(|e| anyhow!("model config: {e}"))?;
    let listener = TcpListener::bind(job.listen)
        .map_err(|e| anyhow!("binding the data-plane listener {}: {e}", job.listen))?;
    let mut w = Worker {
        st: State::fresh(&job.config)?,
        job,
        listener,
        abort,
        emit,
        corpus: Corpus::embedded(),
        rank: 0,
        replicas: Vec::new(),
        snapshot: None,
        step: 0,
        epoch: 0,
        pause_pending: false,
    };
    let mut addr = w.listener.local_addr()?;
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    w.event(&WorkerEvent::Ready { addr })?;
    let mut phase = Phase::Idle;
    loop {
        phase = match phase {
            Phase::Idle => w.idle(commands)?,
            Phase::Reconfiguring(cmd) => w.reconfigure(&cmd)?,
            Phase::Training(dist) => w.train(dist, commands)?,
            Phase::Stopped => return w.finish(),
        };
    }
}

struct Worker<'a, E> {
    job: JobSpec,
    st: State,
    listener: TcpListener,
    abort: &'a AbortSlot,
    emit: E,
    corpus: Corpus,
    rank: usize,
    /// `[layer][expert][rank]` of the plan in force.
    replicas: Vec<Vec<Vec<u32>>>,
    /// The state before the last step's update, to roll one step back.
    snapshot: Option<(u64, Snapshot)>,
    /// The next step to train.
    step: u64,
    epoch: u64,
    pause_pending: bool,
}

impl<E: FnMut(&str) -> Result<()>> Worker<'_, E> {
    fn event(&mut self, ev: &WorkerEvent) -> Result<()> {
        (self.emit)(&serde_json::to_string(ev)?)
    }

    fn held(&self) -> Vec<(usize, usize)> {
        self.st.store.replicas()
    }

    /// Reports that the step or reconfiguration at `self.step` failed; back to idle.
    fn failed(&mut self, e: &anyhow::Error) -> Result<Phase> {
        let ev = WorkerEvent::Failed {
            epoch: self.epoch,
            step: self.step,
            error: error_text(e),
            held: self.held(),
        };
        self.event(&ev)?;
        Ok(Phase::Idle)
    }

    fn idle(&mut self, commands: &Receiver<Command>) -> Result<Phase> {
        let cmd = commands
            .recv()
            .map_err(|_| anyhow!("control channel closed while waiting for a command"))?;
        Ok(match cmd {
            Command::Job(_) => bail!("a second Job command"),
            // Idle already: the controller has (or will get) this worker's idle report.
            Command::Pause | Command::Abort { .. } => Phase::Idle,
            Command::Stop => Phase::Stopped,
            Command::Reconfigure(cmd) => Phase::Reconfiguring(Box::new(cmd)),
        })
    }

    /// Applies `cmd`; training on success, idle (with a `Failed` report) otherwise.
    fn reconfigure(&mut self, cmd: &Reconfigure) -> Result<Phase> {
        let t = Instant::now();
        self.pause_pending = false;
        self.epoch = cmd.epoch;
        if cmd.source == StateSource::Fresh && (self.step != 0 || !self.st.store.is_empty()) {
            // A start that did not complete everywhere is redone from scratch.
            self.st = State::fresh(&self.job.config)?;
            self.step = cmd.resume_step;
            self.snapshot = None;
        }
        let restoring = matches!(cmd.source, StateSource::Checkpoint { .. });
        if !restoring && cmd.resume_step + 1 == self.step {
            let Some((s, snap)) = self.snapshot.take().filter(|(s, _)| *s == cmd.resume_step)
            else {
                bail!("no snapshot of step {} to roll back to", cmd.resume_step);
            };
            snap.restore(&mut self.st.opt, &mut self.st.store)?;
            self.step = s;
        }
        let joining = matches!(&cmd.source,
            StateSource::Peers { dense_to, .. } if dense_to.contains(&cmd.rank));
        if joining || restoring {
            // The dense state and the step counter come from a peer or the checkpoint.
            self.step = cmd.resume_step;
            self.snapshot = None;
        }
        ensure!(
            cmd.resume_step == self.step,
            "asked to resume at step {} but this worker is at step {}",
            cmd.resume_step,
            self.step
        );
        match reconfigure(
            cmd,
            &mut self.st,
            &self.listener,
            self.job.timeout_ms,
            self.abort,
        ) {
            Ok((dist, bytes_in)) => {
                self.rank = cmd.rank;
                self.replicas = cmd.replicas.clone();
                // A fresh start checkpoints its initial state, so that losing every replica
                // of an expert before the first periodic checkpoint is still recoverable.
                if cmd.source == StateSource::Fresh {
                    self.checkpoint_if_due()?;
                }
                let ev = WorkerEvent::Migrated {
                    epoch: cmd.epoch,
                    rank: self.rank,
                    world: cmd.peers.len(),
                    resume_step: self.step,
                    bytes_in,
                    ms: ms_since(t),
                };
                self.event(&ev)?;
                Ok(Phase::Training(Box::new(dist)))
            }
            Err(e) => self.failed(&e),
        }
    }

    /// Writes this worker's checkpoint parts if one is due after `self.step` steps. A part that
    /// cannot be written (full or read-only directory, non-finite state) fails the checkpoint,
    /// not this worker: it is reported and training goes on (the next one is a fresh try).
    fn checkpoint_if_due(&mut self) -> Result<()> {
        let Some(spec) = self.job.checkpoint.clone().filter(|c| c.every_steps > 0) else {
            return Ok(());
        };
        if !self.step.is_multiple_of(spec.every_steps) {
            return Ok(());
        }
        let (epoch, step) = (self.epoch, self.step);
        let ev = match write_checkpoint(&spec, step, &self.st, &self.replicas, self.rank) {
            Ok(parts) => WorkerEvent::Checkpointed { epoch, step, parts },
            Err(e) => WorkerEvent::CheckpointFailed {
                epoch,
                step,
                error: error_text(&e),
            },
        };
        self.event(&ev)
    }

    /// Takes the commands that arrived while training; `Stopped` on `Stop`.
    fn poll_commands(&mut self, commands: &Receiver<Command>) -> Result<Option<Phase>> {
        loop {
            match commands.try_recv() {
                Ok(Command::Pause) => self.pause_pending = true,
                // The command reader aborted the communicator; the step below fails.
                Ok(Command::Abort { .. }) => {}
                Ok(Command::Stop) => return Ok(Some(Phase::Stopped)),
                Ok(other) => bail!("unexpected command while training: {other:?}"),
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => bail!("control channel closed while training"),
            }
        }
    }

    /// One atomic step (or the end of training); reports it and says what comes next.
    fn train(
        &mut self,
        mut dist: Box<DistributedExperts>,
        commands: &Receiver<Command>,
    ) -> Result<Phase> {
        if self.step >= self.job.steps {
            let (epoch, step, held) = (self.epoch, self.step, self.held());
            self.event(&WorkerEvent::Finished { epoch, step, held })?;
            return Ok(Phase::Idle);
        }
        if let Some(next) = self.poll_commands(commands)? {
            return Ok(next);
        }
        let t0 = Instant::now();
        let cfg = &self.job.config;
        let res = self
            .corpus
            .batch(
                cfg.seed,
                self.step,
                self.job.shard,
                cfg.batch,
                cfg.seq_len + 1,
                &self.st.dev,
            )
            .map_err(anyhow::Error::from)
            .and_then(|tokens| {
                let st = &mut self.st;
                train_step(
                    &st.model,
                    &mut st.opt,
                    &mut st.store,
                    &mut dist,
                    &tokens,
                    self.pause_pending,
                )
            });
        let done = match res {
            Ok(r) => r,
            // Discard the step and the broken communicator, then wait for the controller.
            Err(e) => return self.failed(&e),
        };
        let pause = done.pause;
        self.snapshot = Some((self.step, done.snapshot));
        let line = StepLine {
            step: self.step,
            epoch: self.epoch,
            loss: done.loss,
            tokens: (cfg.batch * cfg.seq_len) as u64,
            ms: ms_since(t0),
            routing: done.stats.counts,
            nonfinite: done.nonfinite,
        };
        (self.emit)(&serde_json::to_string(&line)?)?;
        self.step += 1;
        self.checkpoint_if_due()?;
        if pause {
            self.pause_pending = false;
            let (epoch, step, held) = (self.epoch, self.step, self.held());
            self.event(&WorkerEvent::Paused { epoch, step, held })?;
            return Ok(Phase::Idle);
        }
        Ok(Phase::Training(dist))
    }

    fn finish(mut self) -> Result<Checksums> {
        let world = self
            .replicas
            .first()
            .and_then(|l| l.first())
            .map_or(0, Vec::len);
        let mut sums =
            Checksums::collect(self.rank, world, self.step, &self.st.model, &self.st.store)?;
        sums.node = Some(self.job.node_id);
        if let Some(dir) = &self.job.out {
            sums.write_named(dir, &format!("node{}.json", self.job.node_id))?;
        }
        self.event(&WorkerEvent::Done(sums.clone()))?;
        Ok(sums)
    }
}

/// An error with its causes on one line.
fn error_text(e: &anyhow::Error) -> String {
    e.chain()
        .map(|c| c.to_string().lines().next().unwrap_or("").to_owned())
        .collect::<Vec<_>>()
        .join(": ")
}

/// Elapsed milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
