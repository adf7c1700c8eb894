//! The managed worker: one training process under a controller, in one of three explicit
//! phases — idle (waiting for the controller), reconfiguring (applying a new membership and
//! plan), training (one atomic step at a time) — until [`Command::Stop`].
//!
//! # Slow is not dead
//! From the moment the job arrives a thread of its own says [`WorkerEvent::Alive`] every
//! `alive_every_ms`: a long step (GPT-S on a CPU) does not silence it, a stopped, frozen or
//! dead process does, so the controller tells a slow worker from a gone one. Every wait on a
//! peer — forming a mesh, a migration, each collective — is bounded by the job's step deadline
//! ([`lazarus_planner::deadline`]) over this worker's own step times (the time from one
//! reported step to the next, so a checkpoint write between steps counts): the ceiling until
//! a step was measured, then a multiple of the slowest recent step, never below the floor
//! (`timeout_ms`). A peer that is gone is reported by the controller (an [`Command::Abort`])
//! long before that.
//!
//! # Layout switches without a pause (FSEP)
//! A [`Command::Relayout`] that arrives while training is staged, not applied: every step's
//! barrier carries the newest layout version each member holds ([`train_step_voting`]), and
//! after the first step at or past the command's `from_step − 1` whose barrier shows every
//! member voting it, every member installs it (`DistributedExperts::set_layout`) before the
//! next step — the same boundary everywhere, since they all read the same votes. Its step
//! lines then carry the new version. A reconfiguration drops a staged layout (its plan
//! replaces it).
//!
//! # Replica migration without a pause (replicated experts)
//! A [`Command::Relayout`] with transfers is staged and agreed the same way; at the agreed
//! boundary `b` every member starts the migration ([`Migration::start`]: the senders
//! snapshot their replicas and stream them on side connections, the receivers join the
//! experts' gradient all-reduces contributing zeros and record each step's update in a
//! [`crate::model::ShadowReplica`]). Each step, a receiver installs the copies that arrived
//! (replaying the updates since `b`) and, once all are in, votes the migration ready in its
//! own barrier slot; after the first step whose barrier shows every member ready, every
//! member switches at the next boundary ([`Migration::finish`]: the copies join the store,
//! the replicas moved away leave it, the dispatch uses the new layout). A failure, a pause or
//! a reconfiguration drops the migration (nothing of the new layout was used).

use std::net::{IpAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use lazarus_planner::deadline::StepTimes;

use super::abort::AbortSlot;
use super::background::{Mesh, Migration};
use super::migrate::reconfigure;
use super::plane::KeptPlane;
use super::protocol::{
    Checksums, Command, JobSpec, Reconfigure, StateSource, StepLine, WorkerEvent,
};
use super::state::{
    MicroBatches, Snapshot, State, StepInput, StepVotes, checkpoint_writers, eval_step,
    fingerprints, flip_one_bit, train_step_input, train_step_votes, write_checkpoint,
};
use crate::comm::MeshSecret;
use crate::dataset::{EvalData, TrainData};
use crate::model::Corpus;
use crate::runtime::DistributedExperts;
use candle_core::Tensor;
use lazarus_planner::job::StepData;

/// A [`Command::Relayout`] this worker holds and does not train on yet.
struct StagedLayout {
    version: u64,
    from_step: u64,
    replicas: Vec<Vec<Vec<u32>>>,
    /// Replicated experts: `(layer, expert, src rank, dst rank)` copies to make first.
    transfers: Vec<(usize, usize, usize, usize)>,
}

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

/// A test hook: the worker of node `node` sleeps `ms` at the start of each of its steps, as a
/// slow device would compute, while its heartbeat thread goes on. `lzrun worker --managed`
/// takes it from `LZRUN_TEST_STEP_DELAY=NODE:MS`; only tests set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDelay {
    pub node: u32,
    pub ms: u64,
}

/// A test failpoint: after step `step`'s update, the worker of node `node` flips one bit of
/// one replica or shard copy (a silent fault the step fingerprints must catch at that step).
/// `lzrun worker --managed` takes it from `LZRUN_TEST_FLIP_BIT=NODE:STEP`; only tests set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlipBit {
    pub node: u32,
    pub step: u64,
}

/// A test failpoint: the held-out evaluation after step `step`'s update fails on the worker of
/// node `node`, the first time only (as a peer lost mid-eval would fail it; the step is then
/// redone and evaluated again). `lzrun worker --managed` takes it from
/// `LZRUN_TEST_EVAL_FAIL=NODE:STEP`; only tests set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalFail {
    pub node: u32,
    pub step: u64,
}

/// The test hooks of a managed worker; none outside tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TestHooks {
    pub delay: Option<StepDelay>,
    pub flip_bit: Option<FlipBit>,
    pub eval_fail: Option<EvalFail>,
}

/// Says [`WorkerEvent::Alive`] every `every_ms` from a thread that does nothing else, until
/// dropped (or until a line cannot be written: nobody listens any more).
struct Heartbeat(Arc<AtomicBool>);

impl Heartbeat {
    fn start<E>(every_ms: u64, emit: E) -> Result<Self>
    where
        E: Fn(&str) -> Result<()> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let line = serde_json::to_string(&WorkerEvent::Alive)?;
        let every = Duration::from_millis(every_ms.max(1));
        thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) && emit(&line).is_ok() {
                    thread::sleep(every);
                }
            })
            .context("starting the heartbeat thread")?;
        Ok(Self(stop))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Waits for the job, then runs the managed worker of the [worker docs](super) until
/// [`Command::Stop`]. `abort` is shared with the thread that reads `commands`, which aborts
/// the current epoch's communicator on [`Command::Abort`]. `emit` gets every output line
/// (JSON), from this thread and from the heartbeat thread (one whole line per call).
/// `hooks` are for tests ([`TestHooks`]).
pub fn run_managed_worker<E>(
    commands: &Receiver<Command>,
    abort: &AbortSlot,
    emit: E,
    hooks: TestHooks,
) -> Result<Checksums>
where
    E: Fn(&str) -> Result<()> + Clone + Send + 'static,
{
    let job = match commands.recv() {
        Ok(Command::Job(job)) => job,
        Ok(other) => bail!("the first command must be Job, got {other:?}"),
        Err(_) => bail!("control channel closed before the job arrived"),
    };
    // Before the model is built: that may take long too.
    let _heartbeat = Heartbeat::start(job.alive_every_ms, emit.clone())?;
    job.config
        .validate()
        .map_err(|e| anyhow!("model config: {e}"))?;
    let listener = TcpListener::bind(job.listen)
        .map_err(|e| anyhow!("binding the data-plane listener {}: {e}", job.listen))?;
    let window = job.step_deadline.map_or(1, |d| d.window_steps);
    let delay = hooks
        .delay
        .filter(|d| d.node == job.node_id)
        .map(|d| Duration::from_millis(d.ms));
    let flip_bit_at = hooks
        .flip_bit
        .filter(|f| f.node == job.node_id)
        .map(|f| f.step);
    let eval_fail_at = hooks
        .eval_fail
        .filter(|f| f.node == job.node_id)
        .map(|f| f.step);
    let mut w = Worker {
        st: fresh_state(&job)?,
        peer_timeout_ms: job.timeout_ms,
        job,
        step_times: StepTimes::new(window),
        last_step_end: None,
        delay,
        flip_bit_at,
        eval_fail_at,
        listener,
        abort,
        emit,
        corpus: Corpus::embedded(),
        data: None,
        eval_data: None,
        data_cursor: 0,
        rank: 0,
        replicas: Vec::new(),
        snapshot: None,
        step: 0,
        epoch: 0,
        pause_pending: false,
        layout_version: 0,
        staged: None,
        migration: None,
        peers: Vec::new(),
        secret: MeshSecret::unset(),
        kept_plane: KeptPlane::default(),
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
    /// The global sample order over `--data` (or the embedded corpus with a global batch);
    /// opened at the first step that needs it.
    data: Option<TrainData>,
    /// The held-out eval dataset (`JobSpec::eval`), opened at the first evaluation.
    eval_data: Option<EvalData>,
    /// A global batch: the position of the next step's first sequence (from the
    /// reconfiguration, advanced by `B` per step).
    data_cursor: u64,
    rank: usize,
    /// `[layer][expert][rank]` of the plan in force.
    replicas: Vec<Vec<Vec<u32>>>,
    /// The state before the last step's update, to roll one step back.
    snapshot: Option<(u64, Snapshot)>,
    /// The next step to train.
    step: u64,
    epoch: u64,
    pause_pending: bool,
    /// The plan version of the layout in force (the epoch's, or a later switch's).
    layout_version: u64,
    /// A layout switch waiting for every member to hold it.
    staged: Option<StagedLayout>,
    /// Replicated: a replica migration started and not switched to yet.
    migration: Option<Migration>,
    /// The epoch's data-plane addresses (rank order) and mesh secret.
    peers: Vec<std::net::SocketAddr>,
    secret: MeshSecret,
    /// The last epoch's NCCL communicator, which the next epoch may shrink (`worker::plane`).
    kept_plane: KeptPlane,
    /// Times from one reported step to the next (the step deadline's measure).
    step_times: StepTimes,
    /// When the last step of this epoch was reported.
    last_step_end: Option<Instant>,
    /// The communicator's current timeout.
    peer_timeout_ms: u64,
    /// [`StepDelay`], if it names this worker.
    delay: Option<Duration>,
    /// [`FlipBit`]'s step, if it names this worker.
    flip_bit_at: Option<u64>,
    /// [`EvalFail`]'s step, if it names this worker and has not fired.
    eval_fail_at: Option<u64>,
}

impl<E: Fn(&str) -> Result<()>> Worker<'_, E> {
    /// How long one wait on a peer may last now: the step deadline over this worker's step
    /// times, or the fixed `timeout_ms` without one.
    fn step_limit_ms(&self) -> u64 {
        self.job
            .step_deadline
            .map_or(self.job.timeout_ms, |rule| rule.limit(&self.step_times).ms)
    }

    fn event(&mut self, ev: &WorkerEvent) -> Result<()> {
        (self.emit)(&serde_json::to_string(ev)?)
    }

    fn held(&self) -> Vec<(usize, usize)> {
        if self.st.shards.is_some() {
            // FSEP: the experts the layout has this rank compute (it holds a shard of all).
            return super::held_replicas(&self.replicas, self.rank);
        }
        self.st.store.replicas()
    }

    /// Reports that the step or reconfiguration at `self.step` failed; back to idle.
    fn failed(&mut self, e: &anyhow::Error) -> Result<Phase> {
        // Nothing of a migration in flight was used: its copies go.
        self.migration = None;
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
            // Idle already: the controller has (or will get) this worker's idle report. A
            // layout switch is superseded by the reconfiguration that comes next.
            Command::Pause | Command::Abort { .. } | Command::Relayout { .. } => Phase::Idle,
            Command::Stop => Phase::Stopped,
            Command::Reconfigure(cmd) => Phase::Reconfiguring(Box::new(cmd)),
        })
    }

    /// Applies `cmd`; training on success, idle (with a `Failed` report) otherwise.
    fn reconfigure(&mut self, cmd: &Reconfigure) -> Result<Phase> {
        let t = Instant::now();
        self.pause_pending = false;
        self.epoch = cmd.epoch;
        self.staged = None;
        self.migration = None;
        self.layout_version = cmd.plan_version;
        if cmd.source == StateSource::Fresh && (self.step != 0 || !self.st.store.is_empty()) {
            // A start that did not complete everywhere is redone from scratch.
            self.st = fresh_state(&self.job)?;
            self.step = cmd.resume_step;
            self.snapshot = None;
        }
        let restoring = matches!(cmd.source, StateSource::Checkpoint { .. });
        if !restoring && cmd.resume_step + 1 == self.step {
            let Some((s, snap)) = self.snapshot.take().filter(|(s, _)| *s == cmd.resume_step)
            else {
                bail!("no snapshot of step {} to roll back to", cmd.resume_step);
            };
            snap.restore_state(&mut self.st)?;
            self.step = s;
        }
        if let Some(c) = cmd.data_cursor {
            self.data_cursor = c;
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
        let timeout_ms = self.step_limit_ms();
        let reconfigured = reconfigure(
            cmd,
            &mut self.st,
            &self.listener,
            timeout_ms,
            self.abort,
            &mut self.kept_plane,
        );
        match reconfigured {
            Ok((mut dist, bytes_in)) => {
                self.peer_timeout_ms = timeout_ms;
                self.last_step_end = None;
                self.rank = cmd.rank;
                self.replicas = cmd.replicas.clone();
                self.peers = cmd.peers.clone();
                self.secret = cmd.secret.clone();
                // A fresh start checkpoints its initial state, so that losing every replica
                // of an expert before the first periodic checkpoint is still recoverable; a
                // reconfiguration after the last step writes the final checkpoint again (the
                // job machine asks for one when it was not committed; a duplicate of a
                // committed one is ignored); and one the job machine asks for is written: a
                // due checkpoint the epoch before could not commit (a member lost before it
                // wrote its parts, the dense state's writer say).
                if cmd.source == StateSource::Fresh
                    || self.step == self.job.steps
                    || cmd.checkpoint_at_resume
                {
                    self.checkpoint_if_due(&mut dist)?;
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
    ///
    /// FSEP: the writers first gather their experts from every rank's shards (a collective
    /// every member runs at the same step; a failed gather fails this checkpoint, and the
    /// aborted mesh the next step).
    fn checkpoint_if_due(&mut self, dist: &mut DistributedExperts) -> Result<()> {
        let Some(spec) = self.job.checkpoint.clone().filter(|c| c.every_steps > 0) else {
            return Ok(());
        };
        if !lazarus_planner::job::checkpoint_due(spec.every_steps, self.job.steps, self.step) {
            return Ok(());
        }
        let (epoch, step) = (self.epoch, self.step);
        let gathered = if self.st.shards.is_some() {
            match dist.gather_experts(&checkpoint_writers(&self.replicas)) {
                Ok(states) => states
                    .into_iter()
                    .map(|s| ((s.layer, s.expert), s))
                    .collect(),
                Err(e) => {
                    let error = error_text(&anyhow::Error::from(e).context("gathering shards"));
                    return self.event(&WorkerEvent::CheckpointFailed { epoch, step, error });
                }
            }
        } else {
            std::collections::BTreeMap::new()
        };
        let ev = match write_checkpoint(&spec, step, &self.st, &self.replicas, self.rank, &gathered)
        {
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
                Ok(Command::Relayout {
                    epoch,
                    version,
                    from_step,
                    replicas,
                    transfers,
                }) => {
                    // A migration in flight is the newest layout this worker holds; the job
                    // machine sends no other until it is in force.
                    let newer = match (&self.migration, &self.staged) {
                        (Some(m), _) => m.version,
                        (None, Some(s)) => s.version,
                        (None, None) => self.layout_version,
                    };
                    if epoch == self.epoch && version > newer {
                        self.staged = Some(StagedLayout {
                            version,
                            from_step,
                            replicas,
                            transfers,
                        });
                    }
                }
                // The command reader aborted the communicator; the step below fails.
                Ok(Command::Abort { .. }) => {}
                Ok(Command::Stop) => return Ok(Some(Phase::Stopped)),
                Ok(other) => bail!("unexpected command while training: {other:?}"),
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => bail!("control channel closed while training"),
            }
        }
    }

    /// The training data, opened on first use (the embedded corpus without `--data`).
    fn train_data(&mut self) -> Result<&TrainData> {
        if self.data.is_none() {
            let cfg = &self.job.config;
            let d = TrainData::open(self.job.data.as_ref(), cfg.seed, cfg.seq_len, cfg.vocab)
                .context("opening the training data")?;
            self.data = Some(d);
        }
        Ok(self.data.as_ref().expect("opened above"))
    }

    /// The held-out loss of the model as it is now ([`eval_step`]): this member's share of the
    /// eval micro-batches, split over the `members` by the rule that splits a global batch.
    fn evaluate(&mut self, dist: &mut DistributedExperts, members: usize) -> Result<f32> {
        let spec = self
            .job
            .eval
            .clone()
            .ok_or_else(|| anyhow!("an evaluation without an eval set"))?;
        if self.eval_fail_at == Some(self.step) {
            self.eval_fail_at = None;
            bail!(
                "test failpoint: the evaluation after step {} fails",
                self.step
            );
        }
        if self.eval_data.is_none() {
            let cfg = &self.job.config;
            let d =
                EvalData::open(&spec, cfg.seq_len, cfg.vocab).context("opening the eval data")?;
            self.eval_data = Some(d);
        }
        let data = self.eval_data.as_ref().expect("opened above");
        let share = lazarus_planner::data::share(spec.batches, members, self.rank);
        let shape = (spec.micro as usize, self.job.config.seq_len + 1);
        let mbs = share
            .clone()
            .map(|i| Ok(Tensor::from_vec(data.micro_batch(i)?, shape, &self.st.dev)?))
            .collect::<Result<Vec<Tensor>>>()?;
        let input = MicroBatches {
            tokens: &mbs,
            first: share.start,
            total: spec.batches,
            rounds: lazarus_planner::data::rounds(spec.batches, members),
        };
        eval_step(&self.st.model, dist, input)
    }

    /// Puts the state back as it was before the update of the step just trained (its
    /// snapshot), for a failure after the update that discards the step: the step is then
    /// retrained from the same state, as after a failure before the update.
    fn undo_update(&mut self) -> Result<()> {
        if let Some((s, snap)) = self.snapshot.take() {
            ensure!(
                s == self.step,
                "the snapshot is of step {s}, not of step {}",
                self.step
            );
            snap.restore_state(&mut self.st)?;
        }
        Ok(())
    }

    /// What this worker trains this step: its micro-batches of the global batch (and what
    /// they hold, for the report), or its own batch.
    fn step_input(&mut self, members: usize) -> Result<(StepTokens, Option<StepData>)> {
        let cfg = self.job.config.clone();
        let (step, shard, cursor, rank) = (self.step, self.job.shard, self.data_cursor, self.rank);
        let dev = self.st.dev.clone();
        let len = cfg.seq_len + 1;
        let Some(b) = self.job.global_batch else {
            if self.job.data.is_none() {
                let t = self
                    .corpus
                    .batch(cfg.seed, step, shard, cfg.batch, len, &dev)?;
                return Ok((StepTokens::PerNode(t), None));
            }
            let t = self
                .train_data()?
                .random_batch(cfg.seed, step, shard, cfg.batch)?;
            let t = Tensor::from_vec(t, (cfg.batch, len), &dev)?;
            return Ok((StepTokens::PerNode(t), None));
        };
        let share = b.share(members, rank);
        let data = self.train_data()?;
        let mut mbs = Vec::with_capacity((share.end - share.start) as usize);
        let mut sequences = Vec::with_capacity(mbs.capacity() * b.micro as usize);
        for mb in share.clone() {
            let m = data.micro_batch(b, cursor, mb)?;
            mbs.push(Tensor::from_vec(m.tokens, (b.micro as usize, len), &dev)?);
            sequences.extend(m.sequences);
        }
        let report = StepData {
            cursor,
            first_micro_batch: share.start,
            micro_batches: share.end - share.start,
            sequences,
        };
        Ok((StepTokens::Global(mbs), Some(report)))
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
        let limit_ms = self.step_limit_ms();
        if limit_ms != self.peer_timeout_ms {
            let set = match dist.with_comm(|c| c.set_timeout_ms(limit_ms)) {
                Ok(r) => r.map_err(anyhow::Error::from),
                Err(e) => Err(anyhow::Error::from(e)),
            };
            if let Err(e) = set {
                return self.failed(&e.context("setting the step deadline"));
            }
            self.peer_timeout_ms = limit_ms;
        }
        let t0 = Instant::now();
        if let Some(d) = self.delay {
            thread::sleep(d);
        }
        // The copies that arrived are installed before the step, so the vote below is true.
        if let Some(m) = &mut self.migration
            && let Err(e) = m.poll()
        {
            return self.failed(&e.context("replica migration"));
        }
        let votes = StepVotes {
            pause: self.pause_pending,
            layout: match (&self.migration, &self.staged) {
                (Some(m), _) => m.version,
                (None, Some(s)) => s.version,
                (None, None) => self.layout_version,
            },
            ready: self
                .migration
                .as_ref()
                .filter(|m| m.ready())
                .map_or(0, |m| m.version),
        };
        let members = dist.world();
        // The step's data wait (issue 31 item 5): until its batch (or micro-batches) is there.
        let fetch = Instant::now();
        let mut data_wait_ms = 0.0;
        let res = self.step_input(members).and_then(|input| {
            data_wait_ms = ms_since(fetch);
            let st = &mut self.st;
            let (tokens, data) = input;
            let out = match (&tokens, self.job.global_batch) {
                (StepTokens::Global(mbs), Some(b)) => {
                    let share = b.share(members, self.rank);
                    let input = StepInput::Global(MicroBatches {
                        tokens: mbs,
                        first: share.start,
                        total: b.micro_batches(),
                        rounds: b.rounds(members),
                    });
                    train_step_input(
                        &st.model,
                        &mut st.opt,
                        &mut st.store,
                        &mut dist,
                        input,
                        votes,
                    )
                }
                (StepTokens::PerNode(t), _) => {
                    train_step_votes(&st.model, &mut st.opt, &mut st.store, &mut dist, t, votes)
                }
                (StepTokens::Global(_), None) => {
                    Err(anyhow!("micro-batches without a global batch"))
                }
            };
            out.map(|o| (o, data))
        });
        let (done, step_data) = match res {
            Ok(r) => r,
            // A data file that changed under the job fails every try of the step alike: this
            // worker ends, naming the file (its node is lost, as on any host fault).
            Err(e) if data_changed(&e) => return Err(e.context(format!("step {}", self.step))),
            // Discard the step and the broken communicator, then wait for the controller.
            Err(e) => return self.failed(&e),
        };
        let pause = done.pause;
        self.snapshot = Some((self.step, done.snapshot));
        if let Some(m) = &mut self.migration
            && let Err(e) = m.record(&done.joined, done.factor, done.nonfinite)
        {
            return self.failed(&e.context("replica migration"));
        }
        let ((expert_ms, expert_tokens), sent_bytes) = match dist
            .expert_compute()
            .and_then(|c| Ok((c, dist.sent_bytes()?)))
        {
            Ok(c) => c,
            Err(e) => return self.failed(&anyhow::Error::from(e)),
        };
        if self.flip_bit_at == Some(self.step) {
            let what = flip_one_bit(&mut self.st)?;
            eprintln!(
                "test failpoint: flipped one bit of {what} after step {}",
                self.step
            );
        }
        let verify =
            self.job.verify_every > 0 && (self.step + 1).is_multiple_of(self.job.verify_every);
        let fingerprints = if verify {
            match fingerprints(&self.st) {
                Ok(f) => Some(f),
                Err(e) => return self.failed(&e.context("fingerprinting the state")),
            }
        } else {
            None
        };
        let ms = ms_since(t0);
        // Held-out evaluation after the update; not part of the step's time. The step's
        // routing and traffic were read above, so the eval's do not count in them.
        let due = self
            .job
            .eval
            .as_ref()
            .is_some_and(|e| e.due(self.step, self.job.steps));
        let eval_loss = if due {
            match self.evaluate(&mut dist, members) {
                Ok(l) => Some(l),
                Err(e) => {
                    // Like a step failure: the step is not reported, so the job redoes it from
                    // the state before its update (which this worker must then hold: the
                    // reconfiguration rolls back only a worker that reported the step).
                    self.undo_update()?;
                    return self.failed(&e.context("held-out evaluation"));
                }
            }
        } else {
            None
        };
        let line = StepLine {
            step: self.step,
            epoch: self.epoch,
            loss: done.loss,
            tokens: step_data
                .as_ref()
                .map_or(self.job.config.batch as u64, |d| {
                    d.micro_batches * self.job.global_batch.map_or(0, |b| b.micro)
                })
                * self.job.config.seq_len as u64,
            ms,
            routing: done.stats.counts,
            nonfinite: done.nonfinite,
            expert_ms,
            expert_tokens,
            sent_bytes,
            copy_bytes: self
                .migration
                .as_mut()
                .map_or(0, Migration::take_copy_bytes),
            layout_version: self.layout_version,
            fingerprints,
            data: step_data,
            data_wait_ms,
            eval_loss,
        };
        (self.emit)(&serde_json::to_string(&line)?)?;
        let now = Instant::now();
        let since = self.last_step_end.unwrap_or(t0);
        let step_ms = u64::try_from(now.duration_since(since).as_millis()).unwrap_or(u64::MAX);
        self.step_times.push(step_ms);
        self.last_step_end = Some(now);
        self.step += 1;
        if let Some(b) = self.job.global_batch {
            self.data_cursor += b.sequences;
        }
        if let Err(e) = self.switch_if_agreed(&mut dist, done.layout_agreed, done.ready_agreed) {
            return self.failed(&e);
        }
        self.checkpoint_if_due(&mut dist)?;
        if pause {
            self.pause_pending = false;
            // A reconfiguration comes next: it carries its own plan.
            self.migration = None;
            let (epoch, step, held) = (self.epoch, self.step, self.held());
            self.event(&WorkerEvent::Paused { epoch, step, held })?;
            return Ok(Phase::Idle);
        }
        Ok(Phase::Training(dist))
    }

    /// Installs the staged layout when the step just trained (`self.step − 1`) showed every
    /// member voting it (`agreed`, the same on every member) and the next step is not before
    /// its `from_step`: every member decides the same at the same boundary. Replicated
    /// experts: that boundary starts the migration instead, and the switch is at the boundary
    /// after the first step that showed every member ready (`ready`).
    fn switch_if_agreed(
        &mut self,
        dist: &mut DistributedExperts,
        agreed: Option<u64>,
        ready: Option<u64>,
    ) -> Result<()> {
        if let Some(m) = self.migration.take() {
            if ready != Some(m.version) {
                self.migration = Some(m);
                return Ok(());
            }
            let v = m.version;
            self.replicas = m.replicas.clone();
            m.finish(&mut self.st.store, self.rank, dist)
                .with_context(|| format!("switching to the layout of plan v{v}"))?;
            self.layout_version = v;
            return Ok(());
        }
        let due = self
            .staged
            .as_ref()
            .is_some_and(|s| agreed == Some(s.version) && self.step >= s.from_step);
        if !due {
            return Ok(());
        }
        let s = self.staged.take().expect("checked");
        if self.st.shards.is_none() {
            let mesh = Mesh {
                rank: self.rank,
                epoch: self.epoch,
                peers: &self.peers,
                secret: &self.secret,
                timeout_ms: self.step_limit_ms(),
            };
            let m = Migration::start(s.version, s.replicas, &s.transfers, &self.st, dist, &mesh)
                .with_context(|| format!("starting the migration to plan v{}", s.version))?;
            self.migration = Some(m);
            return Ok(());
        }
        dist.set_layout(s.replicas.clone())
            .with_context(|| format!("installing the layout of plan v{}", s.version))?;
        self.replicas = s.replicas;
        self.layout_version = s.version;
        Ok(())
    }

    fn finish(mut self) -> Result<Checksums> {
        let world = self
            .replicas
            .first()
            .and_then(|l| l.first())
            .map_or(0, Vec::len);
        let shards = match &self.st.shards {
            Some(sh) => Some(
                sh.lock()
                    .map_err(|_| anyhow!("shard store: lock poisoned"))?,
            ),
            None => None,
        };
        let mut sums = Checksums::collect(
            self.rank,
            world,
            self.step,
            &self.st.opt,
            &self.st.store,
            shards.as_deref(),
        )?;
        drop(shards);
        sums.node = Some(self.job.node_id);
        if let Some(dir) = &self.job.out {
            sums.write_named(dir, &format!("node{}.json", self.job.node_id))?;
        }
        self.event(&WorkerEvent::Done(sums.clone()))?;
        Ok(sums)
    }
}

/// The tokens of one step: a member's own batch, or its micro-batches of the global batch.
enum StepTokens {
    PerNode(Tensor),
    Global(Vec<Tensor>),
}

/// A fresh worker state for `job`: its expert mode and router skew.
fn fresh_state(job: &JobSpec) -> Result<State> {
    let mut st = State::fresh(&job.config)?.with_mode(job.expert_mode);
    st.model.set_router_skew(job.router_skew);
    Ok(st)
}

/// An error with its causes on one line: the first line of each.
///
/// Only the first line of each cause is formatted, never the rest. This is the cause of a
/// job's first failure taking 2–3 steps to be reported (`results/sim-vs-real/`, item 6;
/// `results/executor/recovery.md`): with `RUST_BACKTRACE=1` in the environment, candle's
/// errors carry a captured backtrace (`candle_core::Error::bt`) and display it after their
/// first line; formatting it resolves its symbols, and the first resolution in a process
/// reads and decompresses the binary's debug information — 0.3–0.5 s for the release build
/// and seconds for the debug build on this machine, once per process (later failures found
/// the symbols cached, hence fast). Every survivor of a first failure paid it before it
/// could report `Failed`.
fn error_text(e: &anyhow::Error) -> String {
    e.chain()
        .map(|c| first_line(c))
        .collect::<Vec<_>>()
        .join(": ")
}

/// The first line of `d`'s text, formatting nothing past it (see [`error_text`]).
fn first_line(d: &dyn std::fmt::Display) -> String {
    /// Keeps what is written up to the first newline, then fails the formatting, which stops
    /// it: the arguments after that are never formatted.
    struct UpToNewline(String);
    impl std::fmt::Write for UpToNewline {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            match s.find('\n') {
                Some(i) => {
                    self.0.push_str(&s[..i]);
                    Err(std::fmt::Error)
                }
                None => {
                    self.0.push_str(s);
                    Ok(())
                }
            }
        }
    }
    let mut w = UpToNewline(String::new());
    // An error here is the newline that ended the line (or a Display impl that failed: what
    // it wrote so far is all there is).
    let _ = std::fmt::write(&mut w, format_args!("{d}"));
    w.0
}

/// Elapsed milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Whether `e` is a training data file that changed under the running job.
fn data_changed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<crate::dataset::DatasetError>(),
            Some(crate::dataset::DatasetError::Changed { .. })
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts how often the part after its first line was formatted.
    static TAIL_FORMATTED: AtomicUsize = AtomicUsize::new(0);

    /// What a backtrace-carrying error displays: a message, a newline, then something costly
    /// to format (a backtrace resolves its symbols then).
    #[derive(Debug)]
    struct WithCostlyTail;

    struct Tail;

    impl std::fmt::Display for Tail {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            TAIL_FORMATTED.fetch_add(1, Ordering::SeqCst);
            f.write_str("frame 0: resolved at great cost")
        }
    }

    impl std::fmt::Display for WithCostlyTail {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "rank 2 closed the connection\n{}", Tail)
        }
    }

    impl std::error::Error for WithCostlyTail {}

    #[test]
    fn a_failure_report_formats_only_the_first_line_of_each_cause() {
        let e = anyhow::Error::new(WithCostlyTail).context("step 6");
        assert_eq!(error_text(&e), "step 6: rank 2 closed the connection");
        assert_eq!(
            TAIL_FORMATTED.load(Ordering::SeqCst),
            0,
            "the text after a cause's first line (a backtrace) was formatted"
        );
        assert_eq!(first_line(&"one line"), "one line");
        assert_eq!(first_line(&"\nafter"), "");
    }

    #[test]
    fn a_candle_error_with_a_backtrace_reports_its_message_alone() {
        let inner = candle_core::Error::Msg("communicator aborted".into());
        let e = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let e = anyhow::Error::from(e).context("rank 1");
        assert_eq!(error_text(&e), "rank 1: communicator aborted");
    }
}
