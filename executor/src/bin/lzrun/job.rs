//! A job's settings resolved from the command line: planner rules, checkpoints, timeouts.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, ensure};
use lazarus_executor::checkpoint::{self, RootLock};
use lazarus_executor::control::{Controller, JobParams, ServerConfig};
use lazarus_executor::dataset::{
    DataFormat, DataSource, DataSpec, EvalData, EvalSpec, TokenDataset, TokenDtype, TrainData,
};
use lazarus_executor::interop;
use lazarus_executor::model::{ExpertMode, MoeConfig};
use lazarus_executor::worker::CheckpointSpec;
use lazarus_planner::ModelSpec;
use lazarus_planner::data::GlobalBatch;
use lazarus_planner::deadline::StepDeadline;
use lazarus_planner::job::JobConfig;
use lazarus_planner::job::relayout::{LaerRelayout, Relayout};
use lazarus_planner::job::{RecoveryPolicy, ReplicaMigration};

use crate::args::{JobArgs, MigrationArg, RecoveryArg, RelayoutArg};
use crate::config::{load_config, load_model};
use crate::drive::Interrupted;

/// Everything a job needs from the command line, resolved.
pub struct Job {
    pub server: ServerConfig,
    pub params: JobParams,
    /// A checkpoint directory we created (no `--ckpt-dir`), see [`Job::clean_up`].
    temp_ckpt: Option<TempDir>,
    /// The checkpoint of the initial state of `--init-from` without checkpoints: removed at
    /// the end.
    temp_init: Option<TempDir>,
    /// The lock on the checkpoint directory: never read, held for the whole job (dropping it
    /// releases the directory).
    _ckpt_lock: Option<RootLock>,
    /// Where the controller saves the job state (`--state-dir`).
    pub state_dir: Option<PathBuf>,
    /// A state directory we created (`lzrun local` without `--state-dir`): removed at the end.
    temp_state: Option<TempDir>,
    /// The lock on the state directory (one controller at a time), held for the whole job.
    _state_lock: Option<RootLock>,
}

impl Job {
    /// The checkpoint directory, if checkpoints are on.
    pub fn ckpt_root(&self) -> Option<&std::path::Path> {
        self.params.checkpoint.as_ref().map(|c| c.root.as_path())
    }

    /// Tidies the checkpoint directory once no worker writes into it any more: parts of
    /// checkpoints that were never committed go; committed checkpoints stay. The temporary
    /// directory (no `--ckpt-dir`) goes when the job succeeded or was stopped by a signal; when
    /// it failed its checkpoints are what is left of the run, so it stays and its path is
    /// printed.
    ///
    /// A job dropped without it (refused before it ran) removes its temporary directories.
    pub fn clean_up(&mut self, result: &Result<()>) {
        if let Some(root) = self.ckpt_root() {
            let _ = checkpoint::remove_staging(root);
        }
        self.temp_state = None;
        self.temp_init = None;
        let Some(dir) = self.temp_ckpt.take() else {
            return;
        };
        let interrupted = result
            .as_ref()
            .err()
            .is_some_and(|e| e.downcast_ref::<Interrupted>().is_some());
        if result.is_err()
            && !interrupted
            && checkpoint::load_latest(&dir.0, &self.params.config).is_ok()
        {
            let dir = dir.keep();
            // stderr: the error line goes there too, and stdout may be a summary reader's.
            let _ = writeln!(
                std::io::stderr(),
                "checkpoints kept in {} (continue with --resume {})",
                dir.display(),
                dir.display()
            );
        }
    }
}

impl Job {
    /// The job's controller, saving the job state into the state directory (if any) from the
    /// start; `listen` is the address agents reach it at.
    pub fn controller(&self, listen: SocketAddr) -> Result<Controller> {
        let mut c =
            Controller::new(self.params.clone()).map_err(|e| anyhow!("invalid job: {e}"))?;
        if let Some(dir) = &self.state_dir {
            c.save_to(dir, Some(listen))
                .map_err(|e| anyhow!("state directory {} is not usable: {e}", dir.display()))?;
        }
        Ok(c)
    }

    /// The job saved in `dir` by a controller that died, and its controller rebuilt from there
    /// (`lzrun controller --recover DIR`): the state and checkpoint directories are locked
    /// again (the dead controller's locks went with it).
    pub fn recover(dir: &Path, token: &str) -> Result<(Job, Controller)> {
        ensure!(
            dir.is_dir(),
            "--recover {}: no such directory",
            dir.display()
        );
        let state_lock = lock_dir(dir, "state directory")?;
        let controller = Controller::recover(dir, token).map_err(|e| anyhow!("--recover: {e}"))?;
        let params = controller.params().clone();
        let ckpt_lock = match &params.checkpoint {
            Some(c) if same_dir(&c.root, dir) => None,
            Some(c) => {
                std::fs::create_dir_all(&c.root).with_context(|| {
                    format!("creating the checkpoint directory {}", c.root.display())
                })?;
                Some(lock_dir(&c.root, "checkpoint directory")?)
            }
            None => None,
        };
        let job = Job {
            server: ServerConfig::new(50, params.rules.heartbeat_timeout_ms),
            params,
            temp_ckpt: None,
            temp_init: None,
            _ckpt_lock: ckpt_lock,
            state_dir: Some(dir.to_path_buf()),
            temp_state: None,
            _state_lock: Some(state_lock),
        };
        Ok((job, controller))
    }
}

/// A directory this job made in the system's temporary directory: removed when dropped, so a
/// run refused after making it (bad data, a bad batch) leaves nothing behind, unless kept.
struct TempDir(PathBuf);

impl TempDir {
    /// `lzrun-<what>-<pid>` in the temporary directory (not created yet).
    fn for_this_process(what: &str) -> Self {
        Self(std::env::temp_dir().join(format!("lzrun-{what}-{}", std::process::id())))
    }

    /// Leaves the directory in place; its path.
    fn keep(self) -> PathBuf {
        let dir = self.0.clone();
        std::mem::forget(self);
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Locks `dir` (a checkpoint or state directory) for this job, or says who holds it.
fn lock_dir(dir: &Path, what: &str) -> Result<RootLock> {
    checkpoint::lock_root(dir, &holder()).map_err(|e| match e {
        // Named as what it is: a state directory is no checkpoint directory.
        checkpoint::CheckpointError::Locked { root, holder } => anyhow!(
            "{what} {} is in use by another job ({holder}); give each job its own directory",
            root.display()
        ),
        other => anyhow!("{what} {} is not usable: {other}", dir.display()),
    })
}

/// Whether `a` and `b` name the same existing directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Where the job state is saved: `--state-dir`, or with `temp_default` (`lzrun local`) a
/// temporary directory; created and locked (unless it is the checkpoint directory, locked
/// already). Returns the directory, whether it is temporary, and the lock.
fn state_dir(
    a: &JobArgs,
    temp_default: bool,
    ckpt: Option<&Path>,
) -> Result<(Option<PathBuf>, Option<TempDir>, Option<RootLock>)> {
    let (dir, temp) = match (&a.state_dir, temp_default) {
        (Some(d), _) => (d.clone(), None),
        (None, true) => {
            let d = TempDir::for_this_process("state");
            (d.0.clone(), Some(d))
        }
        (None, false) => return Ok((None, None, None)),
    };
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("creating the state directory {}", dir.display()))?;
    let lock = match ckpt {
        Some(root) if same_dir(root, &dir) => None,
        _ => Some(lock_dir(&dir, "state directory")?),
    };
    Ok((Some(dir), temp, lock))
}

/// The flags' own bounds (the rules' consistency is checked by `JobConfig::validate`).
fn check_job_args(a: &JobArgs, nodes: usize) -> Result<()> {
    ensure!(
        a.heartbeat_timeout_ms >= 1,
        "--heartbeat-timeout-ms must be at least 1"
    );
    ensure!(a.model.steps >= 1, "--steps must be at least 1 (got 0)");
    ensure!(nodes >= 1, "at least one node is needed");
    ensure!(
        a.fault_tolerance >= 1,
        "--fault-tolerance must be at least 1"
    );
    ensure!(a.timeout_ms >= 1, "--timeout-ms must be at least 1");
    ensure!(
        a.step_timeout_max_ms >= a.timeout_ms,
        "--step-timeout-max-ms ({}) must be at least --timeout-ms ({})",
        a.step_timeout_max_ms,
        a.timeout_ms
    );
    ensure!(a.ckpt_keep >= 1, "--ckpt-keep must be at least 1");
    ensure!(
        (1..=nodes).contains(&a.shard_copies),
        "--shard-copies must be between 1 and the {nodes} node(s) (got {}): copies of a shard \
         sit on distinct nodes",
        a.shard_copies
    );
    ensure!(
        a.shard_copies == 1 || a.expert_mode == ExpertMode::Fsep,
        "--shard-copies {} needs --expert-mode fsep (replicated experts have --fault-tolerance)",
        a.shard_copies
    );
    ensure!(
        a.max_nonfinite_steps >= 1,
        "--max-nonfinite-steps must be at least 1"
    );
    Ok(())
}

/// Checks the job options and resolves them for a job that starts on `nodes` nodes; with
/// `temp_state` the job state is saved even without `--state-dir` (in a temporary directory).
pub fn job_from_args(a: &JobArgs, nodes: usize, token: &str, temp_state: bool) -> Result<Job> {
    check_job_args(a, nodes)?;
    // --init-from: the model of DIR/config.json, the training knobs of --config (issue 32).
    let resume_wins = init_from_resume_wins(a);
    let config = match &a.init_from {
        Some(dir) => {
            let base = load_config(&a.model.config, a.model.seed, a.model.precision)?;
            interop::read_config(dir, &base)
                .map_err(|e| anyhow!("--init-from {}: {e}", dir.display()))?
        }
        _ => load_model(&a.model)?,
    };
    let mut resume = a.resume.clone();
    crate::bounds::check_model_bounds(a, config.experts)?;
    let slots = a
        .slots
        .unwrap_or_else(|| (a.fault_tolerance * config.experts).div_ceil(nodes).max(1));
    ensure!(
        slots * nodes >= config.experts,
        "{nodes} nodes × {slots} slots cannot hold {} experts (raise --slots)",
        config.experts
    );
    if let Some(r) = a
        .resume
        .as_ref()
        .filter(|_| a.init_from.is_none() || resume_wins)
    {
        ensure!(
            r.is_dir(),
            "--resume {}: no such checkpoint directory",
            r.display()
        );
        // A checkpoint at or past the last step leaves nothing to train: a job that "trains"
        // 0 steps and exits 0 would claim work it did not do.
        // Steps count from 0: the checkpoint `step-<S>` holds the state after step S-1 and
        // resumes at step S, and `--steps N` trains steps 0 to N-1.
        if let Ok(Some(step)) = checkpoint::latest_step(r) {
            ensure!(
                step < a.model.steps,
                "--resume {}: its newest checkpoint is the {} (training would resume at step \
                 {step}), but --steps {} trains steps 0 to {}: nothing is left to train (raise \
                 --steps)",
                r.display(),
                lazarus_planner::job::checkpoint_label(step),
                a.model.steps,
                a.model.steps.saturating_sub(1)
            );
        }
    }
    let mut temp_ckpt = None;
    let mut ckpt_lock = None;
    let checkpoint = if a.ckpt_every == 0 {
        None
    } else {
        // A resumed run goes on checkpointing where it resumed from: its continuation must
        // not end up in a directory removed on success.
        let root = match (&a.ckpt_dir, &resume, &a.metrics_out, &a.out) {
            (Some(d), _, _, _) | (None, Some(d), _, _) => d.clone(),
            (None, None, Some(d), _) | (None, None, None, Some(d)) => d.join("ckpt"),
            (None, None, None, None) => {
                let d = TempDir::for_this_process("ckpt");
                let root = d.0.clone();
                temp_ckpt = Some(d);
                root
            }
        };
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
        // Two jobs on one directory would prune and overwrite each other's checkpoints; a
        // directory the lock file cannot be created in will not take checkpoints either.
        ckpt_lock = Some(lock_dir(&root, "checkpoint directory")?);
        Some(CheckpointSpec {
            root,
            every_steps: a.ckpt_every,
        })
    };
    let mut temp_init = None;
    if let (Some(dir), false) = (&a.init_from, resume_wins) {
        let root = match &checkpoint {
            Some(c) => c.root.clone(),
            // Checkpoints off: the initial state still goes through a checkpoint, of its own.
            None => {
                let d = TempDir::for_this_process("init");
                let root = d.0.clone();
                temp_init = Some(d);
                root
            }
        };
        init_from(dir, &config, &root)?;
        resume = Some(root);
    }
    let model = ModelSpec {
        experts: config.experts,
        layers: config.n_layers,
        f: a.fault_tolerance,
    };
    let mut rules = JobConfig::new(model, slots, a.model.steps);
    rules.initial_nodes = nodes;
    rules.heartbeat_timeout_ms = a.heartbeat_timeout_ms;
    // A member is waited for at least this long (survivors notice a stuck peer after one
    // timeout; the stuck member gets that long again and a margin), and up to the step deadline
    // while its worker heartbeats: slow is not dead.
    rules.member_timeout_ms = a.timeout_ms.saturating_mul(2).saturating_add(2_000);
    rules.step_deadline = Some(StepDeadline::new(a.timeout_ms, a.step_timeout_max_ms));
    // Newcomers join at the next step boundary (the paper waits 2 min to batch joins; this
    // executor pauses training for them anyway).
    rules.scale_out_wait_ms = 0;
    rules.rebalance_every_steps = a.rebalance_every;
    rules.wait_for_nodes_ms = a.wait_for_nodes_ms;
    rules.checkpoint_every_steps = if checkpoint.is_some() {
        a.ckpt_every
    } else {
        0
    };
    rules.resume = resume.is_some();
    rules.max_nonfinite_steps = a.max_nonfinite_steps;
    rules.max_checkpoint_failures = a.max_ckpt_failures;
    rules.bytes_per_expert = config.expert_state_bytes() as u64;
    rules.sharded_experts = a.expert_mode == ExpertMode::Fsep;
    rules.shard_copies = a.shard_copies;
    rules.replica_migration = match a.migration {
        MigrationArg::Async => ReplicaMigration::Async,
        MigrationArg::Blocking => ReplicaMigration::Blocking,
    };
    rules.recovery = match a.recovery {
        RecoveryArg::Repair => RecoveryPolicy::Repair,
        RecoveryArg::Replan => RecoveryPolicy::Replan,
    };
    ensure!(
        a.relayout_threshold.is_finite() && a.relayout_threshold >= 1.0,
        "--relayout-threshold must be a finite number >= 1, got {}",
        a.relayout_threshold
    );
    ensure!(
        a.router_skew.is_finite() && a.router_skew >= 0.0,
        "--router-skew must be a finite number >= 0, got {}",
        a.router_skew
    );
    if a.relayout == RelayoutArg::Laer {
        // f32 activations of d_model values per token.
        let bytes_per_token = 4.0 * config.d_model as f64;
        let mut laer = LaerRelayout::new(bytes_per_token, rules.bytes_per_expert);
        laer.warmup_steps = a.relayout_warmup;
        laer.imbalance_threshold = a.relayout_threshold;
        rules.relayout = Relayout::Laer(laer);
    }
    rules.global_batch = global_batch(a, &config)?;
    let data = data_spec(a)?;
    check_data(data.as_ref(), &config)?;
    let eval = eval_spec(a, &config, rules.global_batch)?;
    rules
        .validate()
        .map_err(|e| anyhow!("invalid job configuration: {e}"))?;
    let (state_dir, temp_state, state_lock) =
        state_dir(a, temp_state, checkpoint.as_ref().map(|c| c.root.as_path()))?;
    Ok(Job {
        server: ServerConfig::new(50, a.heartbeat_timeout_ms),
        params: JobParams {
            config,
            rules,
            token: token.to_owned(),
            timeout_ms: a.timeout_ms,
            checkpoint,
            checkpoint_keep: a.ckpt_keep,
            out: a.out.clone(),
            resume,
            router_skew: a.router_skew,
            verify_every: a.verify_every,
            data,
            eval,
        },
        temp_ckpt,
        temp_init,
        _ckpt_lock: ckpt_lock,
        state_dir,
        temp_state,
        _state_lock: state_lock,
    })
}

/// Sequences in a global batch at most (a million: far beyond a CPU or one node's run, clear
/// of overflow in cursor arithmetic).
pub const MAX_GLOBAL_BATCH: u64 = 1 << 20;

/// `--global-batch` and `--micro-batch`, checked.
fn global_batch(a: &JobArgs, config: &MoeConfig) -> Result<Option<GlobalBatch>> {
    let Some(b) = a.global_batch else {
        return Ok(None);
    };
    crate::bounds::within(
        "--global-batch",
        b,
        1,
        MAX_GLOBAL_BATCH,
        "sequences per step",
    )?;
    let default_micro = config.batch as u64;
    let micro = a.micro_batch.unwrap_or(if b.is_multiple_of(default_micro) {
        default_micro
    } else {
        b
    });
    crate::bounds::within("--micro-batch", micro, 1, b, "at most the global batch")?;
    let g = GlobalBatch::new(b, micro).map_err(|e| anyhow!("--global-batch: {e}"))?;
    Ok(Some(g))
}

/// The `--data` flags as datasets: `[WEIGHT:]PATH`, each a [`data_source`].
fn data_spec(a: &JobArgs) -> Result<Option<DataSpec>> {
    if a.data.is_empty() {
        ensure!(
            a.data_dtype.is_none() || a.eval_data.is_some(),
            "--data-dtype without --data or --eval-data (the embedded text needs no dtype)"
        );
        return Ok(None);
    }
    let mut sources = Vec::with_capacity(a.data.len());
    for arg in &a.data {
        let (weight, path) = match arg.split_once(':') {
            Some((w, p)) if w.parse::<f64>().is_ok() => (w.parse::<f64>()?, p),
            _ if a.data.len() > 1 => {
                anyhow::bail!(
                    "--data {arg}: a blend of several datasets needs WEIGHT:PATH for each"
                )
            }
            _ => (1.0, arg.as_str()),
        };
        ensure!(
            weight.is_finite() && weight > 0.0,
            "--data {arg}: the weight must be a finite number > 0"
        );
        sources.push(data_source("--data", path, weight, a.data_dtype)?);
    }
    Ok(Some(DataSpec { sources }))
}

/// One dataset of `flag` (`--data`, `--eval-data`): a Megatron prefix when `PATH.idx`
/// exists, else a flat token file whose dtype comes from `dtype` (`--data-dtype`) or
/// `PATH.dtype`.
fn data_source(
    flag: &str,
    path: &str,
    weight: f64,
    dtype: Option<TokenDtype>,
) -> Result<DataSource> {
    let path = PathBuf::from(path);
    let idx = PathBuf::from(format!("{}.idx", path.display()));
    let format = if idx.is_file() {
        DataFormat::Indexed
    } else if path.is_file() {
        let sidecar = PathBuf::from(format!("{}.dtype", path.display()));
        let dtype = match (dtype, sidecar.is_file()) {
            (Some(d), _) => d,
            (None, true) => {
                let text = std::fs::read_to_string(&sidecar)
                    .with_context(|| format!("reading {}", sidecar.display()))?;
                match text.trim() {
                    "u16" | "uint16" => TokenDtype::U16,
                    "u32" | "uint32" => TokenDtype::U32,
                    other => anyhow::bail!(
                        "{}: unknown token dtype {other:?} (expected u16 or u32)",
                        sidecar.display()
                    ),
                }
            }
            (None, false) => anyhow::bail!(
                "{flag} {}: a flat token file; say its dtype with --data-dtype u16|u32 (or \
                 write it to {})",
                path.display(),
                sidecar.display()
            ),
        };
        DataFormat::Flat(dtype)
    } else {
        anyhow::bail!(
            "{flag} {}: no such file, and no Megatron index {}",
            path.display(),
            idx.display()
        );
    };
    Ok(DataSource {
        path,
        weight,
        format,
    })
}

/// Opens `s` as the workers will and checks every token id against the vocabulary (one pass
/// over the file), so that bad data is one line and exit 2 before any worker runs.
fn check_source(flag: &str, s: &DataSource, config: &MoeConfig) -> Result<()> {
    let d = match s.format {
        DataFormat::Flat(dtype) => TokenDataset::open_flat(&s.path, dtype),
        DataFormat::Indexed => TokenDataset::open_indexed(&s.path, None),
    }
    .map_err(|e| anyhow!("{flag}: {e}"))?;
    d.check_vocab(u32::try_from(config.vocab).unwrap_or(u32::MAX))
        .map_err(|e| anyhow!("{flag}: {e} (the model's vocab is {})", config.vocab))
}

/// The `--data` datasets, checked ([`check_source`]) and opened as the workers will.
fn check_data(spec: Option<&DataSpec>, config: &MoeConfig) -> Result<()> {
    let Some(spec) = spec else {
        return Ok(());
    };
    for s in &spec.sources {
        check_source("--data", s, config)?;
    }
    TrainData::open(Some(spec), config.seed, config.seq_len, config.vocab)
        .map_err(|e| anyhow!("--data: {e}"))?;
    Ok(())
}

/// `--eval-every` when `--eval-data` does not say: often enough to follow the curve of a short
/// run, at `--eval-batches` forward passes per evaluation.
pub const DEFAULT_EVAL_EVERY: u64 = 10;
/// `--eval-batches` when not given.
pub const DEFAULT_EVAL_BATCHES: u64 = 4;

/// `--eval-data`, `--eval-every`, `--eval-batches`: the held-out evaluation, its dataset
/// checked like `--data`'s. The eval micro-batch is the training one (`batch`: the config's
/// without a global batch).
fn eval_spec(
    a: &JobArgs,
    config: &MoeConfig,
    batch: Option<GlobalBatch>,
) -> Result<Option<EvalSpec>> {
    let Some(path) = &a.eval_data else {
        ensure!(
            a.eval_every.is_none(),
            "--eval-every without --eval-data (no eval set to evaluate)"
        );
        ensure!(
            a.eval_batches.is_none(),
            "--eval-batches without --eval-data (no eval set to evaluate)"
        );
        return Ok(None);
    };
    let source = data_source("--eval-data", path, 1.0, a.data_dtype)?;
    check_source("--eval-data", &source, config)?;
    let spec = EvalSpec {
        source,
        every: a.eval_every.unwrap_or(DEFAULT_EVAL_EVERY),
        batches: a.eval_batches.unwrap_or(DEFAULT_EVAL_BATCHES),
        micro: batch.map_or(config.batch as u64, |b| b.micro),
    };
    crate::bounds::within(
        "--eval-batches",
        spec.batches,
        1,
        crate::bounds::MAX_EVAL_BATCHES,
        "eval micro-batches",
    )?;
    EvalData::open(&spec, config.seq_len, config.vocab).map_err(|e| anyhow!("--eval-data: {e}"))?;
    Ok(Some(spec))
}

/// Who holds a checkpoint lock, for the job that finds it taken: this process and its host.
fn holder() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown host".to_owned()
    };
    let sub = std::env::args().nth(1).unwrap_or_default();
    format!("held by lzrun {sub}, pid {} on {host}", std::process::id())
}

/// `--init-from` with `--resume` on a directory that holds a checkpoint: the checkpoint wins
/// (the same command line continues a fine-tuning run) and the model directory's weights are
/// not read (its config.json still gives the model the checkpoint must be of).
fn init_from_resume_wins(a: &JobArgs) -> bool {
    a.init_from.is_some() && a.resume.as_deref().is_some_and(holds_checkpoint)
}

/// Whether `root` holds a committed checkpoint (or a pointer to one).
fn holds_checkpoint(root: &Path) -> bool {
    matches!(checkpoint::latest_step(root), Ok(Some(_)))
        || std::fs::read_dir(root).is_ok_and(|entries| {
            entries.filter_map(|e| e.ok()).any(|e| {
                e.file_name()
                    .to_str()
                    .and_then(checkpoint::parse_step_dir_name)
                    .is_some()
            })
        })
}

/// `--init-from DIR`: DIR's weights committed as the checkpoint of the initial state of
/// `root` (the job then starts by restoring it). Refused when `root` holds checkpoints:
/// committing step 0 would discard them.
fn init_from(dir: &Path, config: &MoeConfig, root: &Path) -> Result<()> {
    ensure!(
        !holds_checkpoint(root),
        "--init-from {}: the checkpoint directory {} already holds checkpoints; continue them \
         with --resume {} or give another --ckpt-dir",
        dir.display(),
        root.display(),
        root.display()
    );
    std::fs::create_dir_all(root)
        .with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
    interop::init_checkpoint(dir, config, root).map_err(|e| {
        // Nothing half-written stays behind: the parts were staged, never committed.
        let _ = checkpoint::remove_staging(root);
        anyhow!("--init-from {}: {e}", dir.display())
    })?;
    Ok(())
}
