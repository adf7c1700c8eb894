//! What a worker and its controller say to each other (one JSON line each, relayed by the
//! node's agent): the controller's [`Command`]s on the worker's stdin, the worker's
//! [`StepLine`]s and [`WorkerEvent`]s on its stdout, and the [`Checksums`] of its final state.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Deserializer, Serialize};

use crate::checkpoint;
use crate::comm::MeshSecret;
use crate::model::{AdamW, ExpertMode, ExpertStore, MoeConfig, ShardStore, fingerprint};
use lazarus_planner::deadline::StepDeadline;
use lazarus_planner::job::StateChecksums;

/// One training step as a worker reports it (one JSON line on stdout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepLine {
    pub step: u64,
    /// Membership epoch the step was trained in (0 for a stand-alone worker).
    #[serde(default)]
    pub epoch: u64,
    /// This worker's shard loss. JSON has no NaN or infinity (serde_json writes `null`), so
    /// `null` reads back as NaN: a diverged step must still be reported, not dropped.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f32,
    /// Tokens predicted by this worker in this step.
    pub tokens: u64,
    /// Wall-clock time of the step in milliseconds.
    pub ms: f64,
    /// `[layer][expert]` tokens this worker routed to each expert in this step (the
    /// controller's load history for rebalancing).
    #[serde(default)]
    pub routing: Vec<Vec<u64>>,
    /// The loss or a gradient was not finite on some member: every member skipped the update
    /// of this step ([`super::train_step`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nonfinite: bool,
    /// CPU milliseconds this worker spent computing its experts (forward and backward).
    #[serde(default)]
    pub expert_ms: f64,
    /// Token rows this worker ran through its experts (forward).
    #[serde(default)]
    pub expert_tokens: u64,
    /// Bytes this worker sent to other workers during the step (every collective).
    #[serde(default)]
    pub sent_bytes: u64,
    /// Bytes of replica copies this worker sends in the background for a re-layout without a
    /// pause, counted on the first step after the migration started.
    #[serde(default)]
    pub copy_bytes: u64,
    /// The plan version of the layout the step ran on: the epoch's, or a later one after a
    /// [`Command::Relayout`] (0: not reported).
    #[serde(default)]
    pub layout_version: u64,
    /// Fingerprints of everything this worker holds after the step's update, every
    /// [`JobSpec::verify_every`] steps (`worker::state::fingerprints`); the job machine
    /// compares the copies of each object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprints: Option<StateChecksums>,
    /// A global batch: what this worker trained (its micro-batches and their sequences).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<lazarus_planner::job::StepData>,
    /// Milliseconds of the step this worker spent getting its batch (part of `ms`): the step's
    /// data wait, which throughput numbers need to tell a slow input from slow compute. A
    /// worker that does not report it sends none (read as 0).
    #[serde(default)]
    pub data_wait_ms: f64,
    /// The held-out loss after this step's update ([`JobSpec::eval`]; the same on every
    /// member), `None` when the step was not evaluated. A non-finite loss is written as
    /// `null` and read back as NaN; an absent field is `None`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "some_nan_if_null"
    )]
    pub eval_loss: Option<f32>,
}

fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

/// A field that is present: `null` (how JSON writes NaN) is `Some(NaN)`. Absent fields are
/// `None` through `#[serde(default)]`, which never calls this.
fn some_nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
    nan_if_null(d).map(Some)
}

/// Checksum of one held expert replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaChecksum {
    pub layer: usize,
    pub expert: usize,
    /// [`ExpertStore::checksum`]: weights, optimizer moments and step.
    pub checksum: u64,
    /// [`ExpertStore::weights_checksum`]: weights only.
    pub weights_checksum: u64,
}

/// What a worker holds after training: written to `<out>/rank<R>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksums {
    /// Node id under a controller (`lzrun local`); absent for a stand-alone worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    pub rank: usize,
    pub world: usize,
    pub steps: u64,
    /// [`fingerprint::optim_state`] of the dense model's optimizer: every dense variable's
    /// values and AdamW moments, and the step counter.
    pub dense: u64,
    pub replicas: Vec<ReplicaChecksum>,
    /// FSEP: a fingerprint of every shard copy held ([`fingerprint::shard_copy`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardChecksum>,
}

/// Fingerprint of one held FSEP shard copy: that slice of every expert, with moments and step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardChecksum {
    pub shard: usize,
    pub checksum: u64,
}

impl Checksums {
    /// Fingerprints of everything a worker holds: the dense state with its optimizer (values,
    /// AdamW moments, step counter), every replica (weights, moments, step) and, in FSEP mode,
    /// every shard copy.
    pub fn collect(
        rank: usize,
        world: usize,
        steps: u64,
        opt: &AdamW,
        store: &ExpertStore,
        shards: Option<&ShardStore>,
    ) -> Result<Self> {
        let dense = opt.fingerprint()?;
        let shards = match shards {
            None => Vec::new(),
            Some(sh) => sh
                .held_shards()
                .into_iter()
                .map(|w| {
                    Ok(ShardChecksum {
                        shard: w,
                        checksum: fingerprint::shard_copy(&sh.export_shard(w)?),
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let replicas = store
            .replicas()
            .into_iter()
            .map(|(layer, expert)| {
                let missing = || anyhow!("replica ({layer}, {expert}) vanished");
                Ok(ReplicaChecksum {
                    layer,
                    expert,
                    checksum: store.checksum(layer, expert).ok_or_else(missing)?,
                    weights_checksum: store.weights_checksum(layer, expert).ok_or_else(missing)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            node: None,
            rank,
            world,
            steps,
            dense,
            replicas,
            shards,
        })
    }

    /// The file a worker of rank `rank` writes into `dir`.
    pub fn path(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank{rank}.json"))
    }

    /// Writes `<dir>/rank<R>.json` (through a temporary file and a rename).
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        self.write_named(dir, &format!("rank{}.json", self.rank))
    }

    /// Writes `<dir>/<name>` (through a temporary file and a rename).
    pub fn write_named(&self, dir: &Path, name: &str) -> Result<PathBuf> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        Ok(path)
    }

    /// Reads a file written by [`Checksums::write`].
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
    }
}

/// Where and how often a job writes checkpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointSpec {
    /// Root directory of the checkpoints (shared by every worker).
    pub root: PathBuf,
    /// Write one after every this many completed steps (0: never).
    pub every_steps: u64,
}

/// The training job a worker runs (the first command it gets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub config: MoeConfig,
    /// Steps to train in all.
    pub steps: u64,
    /// The data shard this worker reads (its node index: stable across reconfigurations).
    pub shard: u64,
    /// Node id given by the controller (names the checksum file).
    pub node_id: u32,
    /// Address to listen on for peers (port 0: any free port).
    pub listen: SocketAddr,
    /// Rendezvous and per-collective timeout of the communicator: fixed without
    /// `step_deadline`, else its floor.
    pub timeout_ms: u64,
    /// How long any one wait on a peer may last, from this worker's measured step times
    /// ([`lazarus_planner::deadline`]); `None`: `timeout_ms`, fixed.
    #[serde(default)]
    pub step_deadline: Option<StepDeadline>,
    /// The worker says [`WorkerEvent::Alive`] this often, from a thread of its own.
    #[serde(default = "default_alive_every_ms")]
    pub alive_every_ms: u64,
    pub checkpoint: Option<CheckpointSpec>,
    /// Directory for the checksum file `rank<node_id>.json` written at [`Command::Stop`].
    pub out: Option<PathBuf>,
    /// Whole expert replicas, or FSEP shards (one per rank of every expert).
    #[serde(default)]
    pub expert_mode: ExpertMode,
    /// Zipf router bias ([`crate::model::DenseModel::set_router_skew`]); 0: none.
    #[serde(default)]
    pub router_skew: f64,
    /// Report [`StepLine::fingerprints`] after every this many steps (0: never).
    #[serde(default = "default_verify_every")]
    pub verify_every: u64,
    /// The training data (`None`: the embedded corpus, byte tokens).
    #[serde(default)]
    pub data: Option<crate::dataset::DataSpec>,
    /// A constant global batch split over the members (`None`: `config.batch` per member).
    #[serde(default)]
    pub global_batch: Option<lazarus_planner::data::GlobalBatch>,
    /// Held-out evaluation (`--eval-data`); `None`: none.
    #[serde(default)]
    pub eval: Option<crate::dataset::EvalSpec>,
}

/// Every step: measured to cost little next to the step (`results/executor/`).
pub fn default_verify_every() -> u64 {
    1
}

fn default_alive_every_ms() -> u64 {
    250
}

/// Where a worker's state comes from when it applies a [`Reconfigure`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateSource {
    /// The first plan: dense model and the held replicas initialised from the seed (every
    /// worker gets the same values).
    Fresh,
    /// Keep what it has; new replicas arrive as transfers; ranks in `dense_to` (joining
    /// nodes) receive the dense model and its optimizer state from rank `dense_from`.
    Peers {
        dense_from: usize,
        dense_to: Vec<usize>,
    },
    /// Some expert lost every replica: everyone loads the checkpoint under `root` whose
    /// manifest says `step` (the controller checked it is the newest valid one).
    Checkpoint { root: PathBuf, step: u64 },
}

/// A new membership and plan for one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconfigure {
    /// This worker's rank in the new membership.
    pub rank: usize,
    /// Data-plane addresses of the members, in rank order.
    pub peers: Vec<SocketAddr>,
    /// Epoch of the new communicator (strictly increasing).
    pub epoch: u64,
    /// What every member of the new mesh presents to the others (fresh for each epoch).
    pub secret: MeshSecret,
    /// Version of the controller's plan.
    pub plan_version: u64,
    /// `[layer][expert][rank]` replicas of the new plan.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// `(layer, expert, src rank, dst rank)` expert-state transfers.
    pub transfers: Vec<(usize, usize, usize, usize)>,
    pub source: StateSource,
    /// The step to train next.
    pub resume_step: u64,
    /// A global batch: the data cursor at `resume_step`.
    #[serde(default)]
    pub data_cursor: Option<u64>,
    /// FSEP: `[shard]` = the ranks holding a copy of that shard of every expert (empty: one
    /// shard per rank, shard `w` on rank `w`).
    #[serde(default)]
    pub shard_holders: Vec<Vec<usize>>,
    /// FSEP: `(shard, src rank, dst rank)` shard copies to rebuild first (an in-place repair).
    #[serde(default)]
    pub shard_transfers: Vec<(usize, usize, usize)>,
    /// Write the checkpoint of `resume_step` before training: it is due and not committed (the
    /// controller's job machine decides: `Reconfiguration::checkpoint_at_resume`).
    #[serde(default)]
    pub checkpoint_at_resume: bool,
}

/// A controller command (one JSON line on the worker's stdin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Job(JobSpec),
    Reconfigure(Reconfigure),
    /// Pause at the next step boundary every member agrees on.
    Pause,
    /// Train on the layout `replicas` (`[layer][expert][rank]`, plan `version`) from step
    /// `from_step` on, or from the first step after it at which every member of `epoch` holds
    /// it (they agree in each step's barrier; see [`super::train_step_voting`]), without a
    /// pause. FSEP: only the index table of the shard all-to-all changes, nothing moves.
    /// Replicated: the replicas `transfers` names (`(layer, expert, src rank, dst rank)`)
    /// are copied in the background from that boundary, and every member switches at the
    /// first boundary after which every copy arrived (see `worker/managed.rs`). Ignored
    /// outside `epoch` or when the worker already trains on `version` or a newer plan.
    Relayout {
        epoch: u64,
        version: u64,
        from_step: u64,
        replicas: Vec<Vec<Vec<u32>>>,
        #[serde(default)]
        transfers: Vec<(usize, usize, usize, usize)>,
    },
    /// A member of `epoch` is gone: abort the collective or rendezvous in flight (without
    /// waiting for its timeout) and report `Failed`.
    Abort {
        epoch: u64,
    },
    /// Write the checksums and exit.
    Stop,
}

/// What a worker reports besides its [`StepLine`]s (one JSON line each).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerEvent {
    /// The job was accepted; peers reach this worker at `addr`.
    Ready { addr: SocketAddr },
    /// The worker process is alive: said every `alive_every_ms` by a thread that does nothing
    /// else, so a long step does not silence it and a stopped, frozen or dead process does.
    /// The controller tells "slow" (alive, step not done) from "gone" with it.
    Alive,
    /// Step `step` (or a reconfiguration to resume at `step`) failed and was discarded.
    Failed {
        epoch: u64,
        step: u64,
        error: String,
        /// `(layer, expert)` replicas this worker holds now.
        held: Vec<(usize, usize)>,
    },
    /// Paused before step `step` (see the module docs).
    Paused {
        epoch: u64,
        step: u64,
        held: Vec<(usize, usize)>,
    },
    /// Trained every step; waiting for `Stop` (or a rollback if a peer failed in the last step).
    Finished {
        epoch: u64,
        step: u64,
        held: Vec<(usize, usize)>,
    },
    /// A reconfiguration completed; training resumes at `resume_step`.
    Migrated {
        epoch: u64,
        rank: usize,
        world: usize,
        resume_step: u64,
        /// Bytes of state this worker received.
        bytes_in: u64,
        ms: f64,
    },
    /// This worker wrote its parts of the checkpoint taken after `step` completed steps.
    Checkpointed {
        epoch: u64,
        step: u64,
        parts: Vec<checkpoint::PartInfo>,
    },
    /// This worker could not write its parts of the checkpoint after `step` completed steps
    /// (full or read-only directory, non-finite state); it trains on.
    CheckpointFailed {
        epoch: u64,
        step: u64,
        error: String,
    },
    /// Checksums of the final state (sent at `Stop`).
    Done(Checksums),
}

/// A worker output line: a step or an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WorkerLine {
    Step(StepLine),
    Event(WorkerEvent),
}

impl WorkerLine {
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_as_steps_or_events() {
        let step = r#"{"step":3,"loss":2.5,"tokens":10,"ms":1.0,"routing":[[1,2]]}"#;
        assert!(matches!(WorkerLine::parse(step), Some(WorkerLine::Step(s)) if s.step == 3));
        let ev = serde_json::to_string(&WorkerEvent::Paused {
            epoch: 1,
            step: 4,
            held: vec![(0, 1)],
        })
        .unwrap();
        assert!(matches!(
            WorkerLine::parse(&ev),
            Some(WorkerLine::Event(WorkerEvent::Paused { step: 4, .. }))
        ));
        assert!(WorkerLine::parse("not json").is_none());
        let alive = serde_json::to_string(&WorkerEvent::Alive).unwrap();
        assert!(matches!(
            WorkerLine::parse(&alive),
            Some(WorkerLine::Event(WorkerEvent::Alive))
        ));
    }

    /// Issue 14: a NaN loss went out as `null`, the controller could not parse the line, and
    /// the step was never counted.
    #[test]
    fn a_non_finite_loss_survives_the_line() {
        for loss in [f32::NAN, f32::INFINITY] {
            let line = StepLine {
                step: 4,
                epoch: 1,
                loss,
                tokens: 10,
                ms: 1.0,
                routing: Vec::new(),
                nonfinite: true,
                expert_ms: 0.0,
                expert_tokens: 0,
                sent_bytes: 0,
                copy_bytes: 0,
                layout_version: 0,
                fingerprints: Some(StateChecksums {
                    dense: 1,
                    replicas: vec![(0, 1, 2)],
                    shards: vec![(3, 4)],
                }),
                data: None,
                data_wait_ms: 0.25,
                eval_loss: Some(loss),
            };
            let text = serde_json::to_string(&line).unwrap();
            let Some(WorkerLine::Step(back)) = WorkerLine::parse(&text) else {
                panic!("{text} does not parse as a step");
            };
            assert!(back.loss.is_nan() && back.nonfinite, "{back:?}");
            assert_eq!(back.fingerprints, line.fingerprints);
            assert_eq!(back.data_wait_ms, 0.25);
            // A diverged eval is reported as NaN, not as "not evaluated".
            assert!(back.eval_loss.is_some_and(f32::is_nan), "{back:?}");
            let none = StepLine {
                eval_loss: None,
                ..line
            };
            let text = serde_json::to_string(&none).unwrap();
            assert!(!text.contains("eval_loss"), "{text}");
        }
        // A line without the newer fields (an older worker) still parses: no data wait.
        let plain = r#"{"step":3,"loss":2.5,"tokens":10,"ms":1.0}"#;
        assert!(matches!(
            WorkerLine::parse(plain),
            Some(WorkerLine::Step(s))
                if !s.nonfinite && s.data_wait_ms == 0.0 && s.eval_loss.is_none()
        ));
        let eval = r#"{"step":3,"loss":2.5,"tokens":10,"ms":1.0,"eval_loss":3.25}"#;
        assert!(matches!(
            WorkerLine::parse(eval),
            Some(WorkerLine::Step(s)) if s.eval_loss == Some(3.25)
        ));
    }
}
