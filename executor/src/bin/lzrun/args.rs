//! The options of each subcommand (clap derive structs) and their value parsers.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use lazarus_executor::control::agent::DEFAULT_RECONNECT_GRACE_MS;
use lazarus_executor::dataset::TokenDtype;
use lazarus_executor::device::{self, CommKind, DeviceChoice, DeviceError, DeviceKind};
use lazarus_executor::faults;
use lazarus_executor::model::{ExpertMode, Precision};
use lazarus_executor::worker::{FAULT_TOLERANCE, MAX_NONFINITE_STEPS};
use lazarus_traces::FitMode;

/// `--relayout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RelayoutArg {
    Lazarus,
    Laer,
}

/// `--migration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MigrationArg {
    /// Copy the replicas in the background while training; switch at an agreed step boundary.
    Async,
    /// Pause every worker, reconfigure, migrate over the new mesh, resume.
    Blocking,
}

/// `--recovery`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecoveryArg {
    /// Keep the layout on the survivors; copy only what fell under the floor or the load bound.
    Repair,
    /// The paper's rule: Eq. 1 + MRO over the new membership at every failure and join.
    Replan,
}

/// `--format`. How lines are written ([`Format::say`]) belongs to `report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Log lines and a loss table.
    Text,
    /// Only the summary object on stdout (logs go to stderr).
    Json,
}

#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Nodes to start with (one agent and one worker process each). With --fault-trace: the
    /// most nodes the trace is fitted to (default: as many as it has).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// SIGKILL node nNODE (its agent and worker) once every worker completed step STEP. NODE
    /// is the number in the node's name, as the log names it: --nodes N starts n0 to n<N-1>,
    /// and each --join starts the next (nN, nN+1, …); a name is never reused. Steps count from
    /// 0 (see --steps): `--kill 2@5` kills n2 after step 5, the sixth update. Repeatable;
    /// several at one step fail together.
    #[arg(long, value_name = "NODE@STEP", value_parser = parse_kill)]
    pub kill: Vec<(usize, u64)>,
    /// Start a new node once every worker completed step STEP (the `@` is required); it joins
    /// at the next step boundary and receives its experts. It is named after the nodes
    /// launched before it: the first --join on --nodes 4 starts n4. Repeatable.
    #[arg(long, value_name = "@STEP", value_parser = parse_join)]
    pub join: Vec<u64>,
    /// Kill the controller once every worker completed step STEP (the `@` is required), as
    /// SIGKILL would (its connections drop, nothing more is saved), and start a new one from
    /// the saved job state (--state-dir) --controller-down-ms later. Workers train on
    /// meanwhile; agents reconnect and the job goes on without a checkpoint restore.
    /// Repeatable. Any controller crash (a panic) is restarted the same way.
    #[arg(long, value_name = "@STEP", value_parser = parse_kill_controller)]
    pub kill_controller: Vec<u64>,
    /// How long a killed controller stays down before `lzrun local` restarts it.
    #[arg(long, value_name = "MS", default_value_t = 1_000)]
    pub controller_down_ms: u64,
    /// Replay a node-availability trace, format detected from the content: Bamboo CSV
    /// `time_ms,add|remove,node`, node-count CSV `time_ms,live_nodes` (nodes n0, n1, …, the
    /// newest removed first), Parcae / SpotServe JSON lines or a SkyPilot count series (the
    /// formats of `lzsim replay`). Nodes live at time 0 (at START with --window) start the
    /// job; removals kill, additions join.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kill", "join"])]
    pub fault_trace: Option<PathBuf>,
    /// Replay only [START, END) of the --fault-trace, rebased to 0: the nodes live at START
    /// start the job (as `lzsim replay --window`), e.g. `8m..2h`, `480s..7200s`. Needed for a
    /// trace whose first node appears after 0.
    #[arg(long, value_name = "START..END", requires = "fault_trace", value_parser = parse_window)]
    pub window: Option<(u64, u64)>,
    /// How a --fault-trace with more nodes than --nodes is fitted onto them: clamp (the live
    /// count clamped to --nodes, spare nodes promoted at once), track (the first --nodes nodes
    /// are the cluster; a removed one is replaced by the next node added later) or scale (the
    /// live count scaled). The mappings, parser and default of `lzsim replay --map`. Needs
    /// --nodes: without it the trace is replayed on as many nodes as it has, and nothing is
    /// fitted.
    #[arg(long, value_name = "clamp|track|scale", requires = "fault_trace", requires = "nodes",
          default_value_t = FitMode::DEFAULT, value_parser = FitMode::parse_flag)]
    pub map: FitMode,
    /// Trace seconds one training step stands for: an event at trace time t fires after step
    /// ⌊t / X⌋.
    #[arg(
        long,
        value_name = "X",
        default_value_t = 60.0,
        requires = "fault_trace"
    )]
    pub time_scale: f64,
    /// A seeded storm of N faults of every kind on --nodes nodes (default 6): kills, several
    /// nodes killed at once, joins racing kills, frozen (SIGSTOPped) workers and agents,
    /// controller kills and a full checkpoint disk for 1–4 steps; the job must survive all of
    /// them and end with every copy of its state identical (`results/soak/run.sh` runs 1,000).
    /// Adds to --kill-controller; not with --kill, --join or --fault-trace.
    #[arg(long, value_name = "N", conflicts_with_all = ["kill", "join", "fault_trace"])]
    pub storm: Option<usize>,
    /// Seed of the --storm schedule (the same seed gives the same faults at the same steps).
    #[arg(long, value_name = "SEED", default_value_t = 1, requires = "storm")]
    pub storm_seed: u64,
    /// Nodes a --storm never goes below (at least 1; the experts must fit on them).
    #[arg(long, value_name = "N", default_value_t = 2, requires = "storm")]
    pub storm_min_live: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub job: JobArgs,
}

#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Address to listen on for agents [default: 127.0.0.1:29400; with --recover, the address
    /// the job's controller listened on].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Take back the job whose state a controller started with `--state-dir DIR` saved, after
    /// that controller died (kill -9, a crash, its machine). The job's options come from DIR:
    /// besides it, only --listen, --token, --format, --metrics-out, --out and --peak-tflops may
    /// be given (any other is refused: it would have no effect). The token must be the job's.
    /// Agents reconnect on their own within their --reconnect-grace-ms; workers that trained
    /// on meanwhile keep their state, and training resumes in place when every node comes back
    /// (see the README, "Controller fail-over"). The controller goes on saving into DIR. Exit
    /// 2 with a clear message when DIR holds no state, a damaged one, or a job that ended.
    #[arg(long, value_name = "DIR", conflicts_with = "state_dir")]
    pub recover: Option<PathBuf>,
    /// Workers to wait for before the first plan: one per agent, or G per agent started with
    /// `--gpus-per-node G` (N hosts of G GPUs: `--nodes N*G`).
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Shared secret agents must present (default: the LZRUN_TOKEN environment variable).
    #[arg(long, env = "LZRUN_TOKEN", hide_env_values = true)]
    pub token: String,
    #[command(flatten)]
    pub job: JobArgs,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The controller's address, HOST:PORT.
    #[arg(long)]
    pub controller: String,
    /// Shared secret (default: the LZRUN_TOKEN environment variable).
    #[arg(long, env = "LZRUN_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Node name, unique among live nodes (default: `agent-PID`). With `--gpus-per-node G` > 1
    /// the host's name: its G workers register as NAME-gpu0 … NAME-gpu<G-1> of host NAME.
    #[arg(long)]
    pub name: Option<String>,
    /// Address this node's worker listens on for its peers (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub data_addr: SocketAddr,
    /// Heartbeat period in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// Give up registering after this many milliseconds.
    #[arg(long, default_value_t = 5_000)]
    pub register_timeout_ms: u64,
    /// Protocol version to announce (tests of the controller's version check only).
    #[arg(long, hide = true)]
    pub protocol_version: Option<u16>,
    /// After losing the controller, keep the worker training and try to reconnect for this
    /// many milliseconds (attempts 50 ms apart at first, doubling up to 1 s, jittered); then
    /// stop the worker and exit 2. 0: give up at once.
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_RECONNECT_GRACE_MS)]
    pub reconnect_grace_ms: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Take commands from a controller (JSON lines on stdin); set by `lzrun agent`.
    #[arg(long, conflicts_with_all = ["rank", "world", "peers"])]
    pub managed: bool,
    /// This worker's rank, 0-based.
    #[arg(long, required_unless_present = "managed")]
    pub rank: Option<usize>,
    /// Number of workers; must equal the number of --peers.
    #[arg(long, required_unless_present = "managed")]
    pub world: Option<usize>,
    /// Listen address of every rank in rank order, e.g. 127.0.0.1:4000,127.0.0.1:4001.
    #[arg(long, value_delimiter = ',', required_unless_present = "managed")]
    pub peers: Vec<SocketAddr>,
    /// Membership epoch of the communicator (all workers must agree).
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Directory for the checksum file `rank<R>.json`.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Rendezvous and per-collective timeout in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub timeout_ms: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// Where workers compute and how they talk (`lzrun local` and `lzrun agent` hand these to the
/// processes they start through the same environment variables).
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// Where workers compute: cpu, or cuda (a build with `--features cuda`, a driver and a GPU;
    /// otherwise one line and exit status 2).
    #[arg(long, value_name = "cpu|cuda", env = device::ENV_DEVICE, default_value = "cpu",
          value_parser = parse_device)]
    pub device: DeviceKind,
    /// The workers' data plane: tcp, or nccl (default: nccl with --device cuda, else tcp).
    /// With nccl, expert states migrate over NCCL too, and after a lost node the survivors
    /// shrink the last communicator (ncclCommShrink, NCCL 2.27 and later) instead of forming a
    /// new one. Several workers sharing one GPU need tcp (NCCL cannot put two ranks on one
    /// GPU).
    #[arg(long, value_name = "tcp|nccl", env = device::ENV_COMM, value_parser = parse_comm)]
    pub comm: Option<CommKind>,
    /// GPUs per node: an agent runs one worker per GPU (device ordinals 0..G), registered as
    /// the G GPUs of one host. Replicas of an expert are placed on distinct hosts, and a host
    /// fails whole: its agent killed, or any one of its workers lost (a GPU failure counts as
    /// its host's), fences all G. `lzrun local`: each node is such a host (CPU workers with
    /// --device cpu).
    #[arg(long, value_name = "G", env = device::ENV_GPUS_PER_NODE, default_value_t = 1)]
    pub gpus_per_node: usize,
}

impl DeviceArgs {
    /// The resolved choice (the defaults applied), not yet checked against this machine.
    pub fn choice(&self) -> Result<DeviceChoice, DeviceError> {
        DeviceChoice::resolve(self.device, self.comm, self.gpus_per_node)
    }
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    DeviceKind::parse(s).map_err(|e| e.to_string())
}

fn parse_comm(s: &str) -> Result<CommKind, String> {
    CommKind::parse(s).map_err(|e| e.to_string())
}

/// What to train and for how long (shared by jobs and stand-alone workers).
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Training steps (optimizer updates). They are counted from 0 in every output and flag:
    /// `--steps 20` trains steps 0 to 19.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Model configuration: tiny (fast on CPU), gpt-s, gpt-m, gpt-l (the paper's, for GPUs), or
    /// a TOML file: `base = "tiny"` plus any field of the model config to override (d_model,
    /// n_layers, n_heads, d_ff, experts, top_k, seq_len, batch, lb_loss_coef, lr, adam_beta2,
    /// grad_clip_norm, seed, vocab, precision).
    #[arg(long, default_value = "tiny")]
    pub config: String,
    /// Seed of the model initialisation and of the data order (overrides the config's).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Arithmetic of the matrix products (overrides the config's `precision`): auto (bf16 on
    /// CUDA, f32 on the CPU), f32, or bf16 — bf16 operands and results with f32 accumulation;
    /// master weights, Adam moments, router, norms, softmaxes and the loss stay f32. On the CPU
    /// bf16 reproduces a GPU run's rounding at some cost (candle widens bf16 products there).
    #[arg(long, value_name = "auto|f32|bf16", value_parser = parse_precision)]
    pub precision: Option<Precision>,
    // ---- issue 32, model families (the `families` helper's block) ----
    /// A Hugging Face `config.json` to train instead of the GPT-style model:
    /// MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM (RMSNorm, rotary
    /// positions, grouped-query attention, SwiGLU experts, their routers and shared experts) or
    /// DeepseekV3ForCausalLM (multi-head latent attention, sigmoid node-limited routing, shared
    /// experts, the auxiliary-loss-free routing bias).
    /// The shape and architecture come from the file; the training knobs (seq_len, batch, lr,
    /// adam_beta2, grad_clip_norm, seed, precision) from --config (default tiny's), the
    /// balancing-loss weight from its router_aux_loss_coef. What is not implemented is refused
    /// with one line naming the field (exit 2): rope_scaling, sliding windows, a model of dense
    /// layers only. Dense (non-MoE) blocks among MoE ones are built (first_k_dense_replace,
    /// mlp_only_layers, decoder_sparse_step).
    #[arg(long, value_name = "config.json")]
    pub model_config: Option<PathBuf>,
}

fn parse_data_dtype(s: &str) -> Result<TokenDtype, String> {
    match s {
        "u16" | "uint16" => Ok(TokenDtype::U16),
        "u32" | "uint32" => Ok(TokenDtype::U32),
        other => Err(format!(
            "unknown token dtype {other:?} (expected u16 or u32)"
        )),
    }
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    Precision::parse(s).map_err(|e| e.to_string())
}

#[derive(Debug, Args)]
pub struct JobArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Minimum replicas per expert (the paper's f; relaxed by the planner when slots run short).
    #[arg(long, default_value_t = FAULT_TOLERANCE)]
    pub fault_tolerance: usize,
    /// Expert slots per worker (default: ⌈f·E / workers⌉, enough for f replicas of every
    /// expert; a node of G GPUs holds G times as many).
    #[arg(long)]
    pub slots: Option<usize>,
    /// Directory of the checkpoints (default: the --resume directory, else `<metrics-out>/ckpt`
    /// or `<out>/ckpt`, else a temporary directory, removed at the end unless the job failed:
    /// then its path is printed). The last step is always checkpointed, whatever --ckpt-every:
    /// a job that ends 0 has its final state committed there.
    /// One job at a time: the job locks it (`lzrun.lock`), and a second job on it exits 2
    /// naming the holder. It must be writable.
    #[arg(long, value_name = "DIR")]
    pub ckpt_dir: Option<PathBuf>,
    /// Checkpoint after every K completed steps: after steps K-1, 2K-1, … (counted from 0),
    /// and after the last step (0: never; then a failure that loses every replica of an expert
    /// ends the job). The checkpoint after step S is the directory `step-<S+1>` of --ckpt-dir:
    /// named after the step a restore resumes at.
    #[arg(long, value_name = "K", default_value_t = 5)]
    pub ckpt_every: u64,
    /// Checkpoints to keep (only checkpoints that verify count; a damaged one never costs a
    /// valid one).
    #[arg(long, default_value_t = 3)]
    pub ckpt_keep: usize,
    /// End the job (exit 2) after N failed checkpoints in a row (0: never). A checkpoint that
    /// cannot be written or committed (full or read-only directory) is logged and training goes
    /// on; the next due checkpoint is a fresh try. It never fails a node.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_ckpt_failures: u64,
    /// End the job (exit 2) after N steps in a row with a non-finite loss or gradient. Such a
    /// step (NaN or infinity on any worker: the workers vote in the step's last collective)
    /// applies no update on any worker, so the weights stay finite and identical everywhere; it
    /// is logged and counted. A checkpoint never holds a non-finite value.
    #[arg(long, value_name = "N", default_value_t = MAX_NONFINITE_STEPS)]
    pub max_nonfinite_steps: u64,
    /// Every K steps, each worker fingerprints everything it holds after the step's update
    /// (dense weights with their AdamW moments and step counter, every expert replica, every
    /// FSEP shard copy) and the controller compares the copies of each object: the first
    /// disagreement ends the job (exit 2) naming the object, the nodes and the step. 0: only
    /// at the end of the job. Costs one pass over the worker's state (see
    /// results/executor/fingerprints.md).
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub verify_every: u64,
    /// Start from the newest valid checkpoint under DIR (a checkpoint root) instead of a fresh
    /// model; steps before the checkpoint's are not trained again. The run goes on
    /// checkpointing into DIR unless --ckpt-dir says otherwise.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Start (or fine-tune) from a Hugging Face model directory: DIR/config.json gives the
    /// model (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM; or a lazarus GPT
    /// export), --config only the training knobs (seq_len, batch, lr, adam_beta2,
    /// grad_clip_norm, seed, precision), and the weights (model.safetensors, or the shards of
    /// model.safetensors.index.json; F32, BF16 or F16, widened to f32) every variable and
    /// expert; AdamW moments start at zero and the step at 0. The weights are committed as the
    /// checkpoint of the initial state of the checkpoint directory (a restore before the first
    /// checkpoint goes back to them), which must not hold checkpoints yet. With --resume on a
    /// directory that holds a checkpoint, --resume wins and DIR's weights are not read (so the
    /// same command line continues a fine-tuning run; DIR/config.json still gives the model).
    /// Not with --model-config (DIR/config.json is the model). Exit status 2 with one line
    /// naming the tensor, field or file on a missing or extra tensor, a wrong shape or dtype, an
    /// unsupported architecture or field, an index naming a missing file or a truncated file.
    #[arg(long, value_name = "DIR", conflicts_with = "model_config")]
    pub init_from: Option<PathBuf>,
    /// Replan from the routing statistics every K steps and migrate through the same path
    /// (0: only on membership changes). With --relayout laer: the re-layout period.
    #[arg(
        long,
        visible_alias = "relayout-every",
        value_name = "K",
        default_value_t = 0
    )]
    pub rebalance_every: u64,
    /// The policy of the periodic rebalance (--rebalance-every). lazarus: Eq. 1 + MRO from
    /// scratch on the summed routing history. laer: LAER-style incremental re-layout from each
    /// worker's own routed tokens (the per-(rank, expert) traffic), run only after
    /// --relayout-warmup steps and when the busiest worker computes more than
    /// --relayout-threshold times the mean; it keeps every expert at f replicas on distinct
    /// nodes. With --expert-mode fsep a laer re-layout moves no state and does not pause: the
    /// workers switch layout while they train, at a step boundary they agree on.
    #[arg(long, value_enum, default_value_t = RelayoutArg::Lazarus)]
    pub relayout: RelayoutArg,
    /// With --expert-mode replicated: how a rebalance (--rebalance-every, either --relayout)
    /// moves the replicas the new layout adds. async: no pause — the workers keep training on
    /// the old layout while each new replica is copied in the background over a connection
    /// of its own (a copy taken at an agreed step boundary, caught up exactly by replaying the
    /// updates its holders applied since), and all switch at the first step boundary after
    /// every copy arrived. blocking: pause every worker, reconfigure and migrate over the new
    /// mesh, resume. Failures and joins always reconfigure (blocking). Not used with
    /// host-aware placement (--gpus-per-node above 1), whose rebalance is blocking.
    #[arg(long, value_enum, default_value_t = MigrationArg::Async)]
    pub migration: MigrationArg,
    /// With --expert-mode replicated: how a failure or a join re-lays the experts. repair:
    /// the survivors keep their replicas; only a replica whose expert fell below
    /// min(--fault-tolerance, nodes) distinct nodes (or whose load would more than double the
    /// busiest replica's) is copied, a newcomer's slots take the hottest experts; the full
    /// replan follows as the next rebalance (--rebalance-every, --migration), brought forward
    /// when the repaired layout's busiest replica is over 1.1x the replan's or it survives f
    /// more failures less often. replan: the paper's rule, the whole model re-planned at every
    /// event (the default of lzrun for now: a repair at the job's last step can ask for one
    /// more in-place reconfiguration, see results/repair/README.md). Each reconfiguration's
    /// transfers and bytes are in reconfigurations.jsonl, the repair's under its kind
    /// (in-place, join), the re-optimisation's under rebalance.
    #[arg(long, value_enum, default_value_t = RecoveryArg::Replan)]
    pub recovery: RecoveryArg,
    /// --relayout laer: no re-layout before this many steps.
    #[arg(long, value_name = "STEPS", default_value_t = 2)]
    pub relayout_warmup: u64,
    /// --relayout laer: re-layout only when the max / mean tokens computed per worker over the
    /// routing window exceeds this (hysteresis against re-layouts chasing noise).
    #[arg(long, value_name = "RATIO", default_value_t = 1.1)]
    pub relayout_threshold: f64,
    /// Force skewed routing: the router's top-k choice ranks expert e by its probability times
    /// (e+1)^-S (a Zipf router bias; the gates stay the router's). 0: the plain router.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub router_skew: f64,
    /// How the experts are stored. replicated: whole replicas with their optimizer state,
    /// placed by the plan (a re-layout migrates them). fsep: every expert's weights and Adam
    /// moments cut into one shard per worker (LAER-MoE's FSEP); each MoE layer gathers the
    /// experts the layout assigns to a worker by an all-to-all of shards and returns the
    /// gradients to the shard owners, so a re-layout moves no state — but any lost worker
    /// loses a shard of every expert: the job restores the newest checkpoint (unless
    /// --shard-copies is 2 or more).
    #[arg(long, value_enum, default_value_t = ExpertMode::Replicated)]
    pub expert_mode: ExpertMode,
    /// With --expert-mode fsep: keep F copies of every shard on distinct workers (resilient
    /// FSEP), placed by the planner to make losing every copy of a shard least likely. A lost
    /// worker is then repaired in place — the survivors copy the lost shard copies from the
    /// remaining ones and training goes on, no checkpoint restore — unless some shard lost
    /// all its copies. 1: one shard per worker (LAER-MoE). At most the number of nodes.
    #[arg(long, value_name = "F", default_value_t = 1)]
    pub shard_copies: usize,
    /// Train on a tokenized dataset instead of the embedded text: a Megatron-LM indexed dataset
    /// (`PREFIX` of `PREFIX.bin` + `PREFIX.idx`, e.g. from `lzrun prepare`) or a flat file of
    /// little-endian token ids (`train.bin`; its dtype from --data-dtype or a sidecar file
    /// `PATH.dtype` holding `u16` or `u32`). Repeat it for a blend, each with a weight:
    /// `--data 0.7:a --data 0.3:b`. Files are memory-mapped and checked before the job starts
    /// (index, sizes, every token id below the model's vocabulary). Every worker opens the
    /// path itself: with agents on several machines, give a path they all see (a shared file
    /// system), as for --ckpt-dir.
    #[arg(long, value_name = "[WEIGHT:]PATH")]
    pub data: Vec<String>,
    /// The token dtype of the flat --data files.
    #[arg(long, value_name = "u16|u32", value_parser = parse_data_dtype)]
    pub data_dtype: Option<TokenDtype>,
    /// A constant global batch of B sequences per optimizer step, whoever is alive: every step
    /// trains the next B sequences of one seeded order of the data (each sequence once per
    /// epoch), split over the current workers in micro-batches of --micro-batch (gradients
    /// accumulated; the update is the mean over the B sequences). Failures, joins, checkpoint
    /// restores (the data cursor rewinds with the weights) and controller fail-over do not
    /// change what a step trains: a run with faults computes the fault-free run's steps, up to
    /// the order of floating-point sums. --metrics-out then writes samples.csv. Without it:
    /// --batch-per-node.
    #[arg(long, value_name = "B", conflicts_with = "batch_per_node")]
    pub global_batch: Option<u64>,
    /// With --global-batch: sequences per micro-batch (divides B; default: the model config's
    /// `batch`, or B if that does not divide it). A member trains ⌈B / (M · members)⌉
    /// micro-batches at most per step.
    #[arg(long, value_name = "M", requires = "global_batch")]
    pub micro_batch: Option<u64>,
    /// Held-out evaluation: a dataset in the forms of one --data (a Megatron prefix, or a flat
    /// token file whose dtype comes from --data-dtype or `PATH.dtype`), checked like it before
    /// the job starts. Every --eval-every steps, and after the last step, every worker runs
    /// the eval set forward (no gradients, no update; the training is bit for bit the same as
    /// without it) and the log line, steps.csv (eval_loss, eval_ppl) and summary.json
    /// (first_eval_*, final_eval_*) report the held-out cross-entropy and its perplexity. The
    /// eval set is the first --eval-batches × M sequences of the file in file order (M: the
    /// --micro-batch size, or the config's `batch` without --global-batch), the same at every
    /// evaluation; a shorter file wraps around.
    #[arg(long, value_name = "PATH")]
    pub eval_data: Option<String>,
    /// With --eval-data: evaluate after every N steps (after steps N-1, 2N-1, … counted from
    /// 0), and after the last step; 0: only after the last step. Default 10.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// With --eval-data: micro-batches in the eval set (split over the workers like a global
    /// batch's). Default 4.
    #[arg(long, value_name = "B")]
    pub eval_batches: Option<u64>,
    /// Each worker trains its own batch of the config's `batch` sequences, drawn at random
    /// positions of the data: the global batch is `workers × batch` and follows the membership
    /// (the Lazarus paper's behaviour). The default without --global-batch.
    #[arg(long)]
    pub batch_per_node: bool,
    /// Directory for the workers' replica checksum files `node<ID>.json`.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Save the controller's job state in DIR (atomically, at every change), so that a
    /// controller that dies can be replaced: `lzrun controller --recover DIR`. `lzrun local`
    /// always saves it (default: a temporary directory, removed at the end) and restarts its
    /// own controller from it. One controller per directory (it is locked).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Write summary.json, timeseries.csv (the simulator's columns), steps.csv and
    /// reconfigurations.jsonl into DIR; `lzrun local` also writes run.json (model, nodes, seed,
    /// checkpoint settings, fault schedule and its source, launch timeline: what `lzsim
    /// predict DIR` replays).
    #[arg(long, value_name = "DIR")]
    pub metrics_out: Option<PathBuf>,
    /// Output: text (log lines) or json (only the summary object on stdout).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Floor of the step deadline, in milliseconds: how long a worker waits for a silent peer
    /// (in a collective, forming a mesh, migrating) at least. The deadline follows the measured
    /// step times: 4 × the slowest of the last 20 steps, between this and
    /// --step-timeout-max-ms (which is the deadline until a step was measured). The controller
    /// waits at least twice this plus 2 s for a member, and as long as the step deadline for
    /// one whose worker still heartbeats (slow, not gone).
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Ceiling of the step deadline, and the deadline of the first steps (nothing is measured
    /// yet), in milliseconds. A node that is gone (dead, or its agent or worker stopped
    /// heartbeating) is found by --heartbeat-timeout-ms, not by this. Equal to --timeout-ms:
    /// a fixed timeout.
    #[arg(long, value_name = "MS", default_value_t = 600_000)]
    pub step_timeout_max_ms: u64,
    /// A node whose agent or worker sent no heartbeat for this long is gone (and fenced).
    /// Agents and workers heartbeat from threads that compute cannot starve.
    #[arg(long, default_value_t = 3_000)]
    pub heartbeat_timeout_ms: u64,
    /// When the live nodes' slots cannot hold every expert, wait this many milliseconds for
    /// nodes to join (then replan, or restore the newest checkpoint if an expert lost every
    /// replica); after that the job fails. 0: wait for ever. `lzrun local` starts the
    /// schedule's next joins at once while it waits.
    #[arg(
        long,
        alias = "wait-for-nodes",
        value_name = "MS",
        default_value_t = 600_000
    )]
    pub wait_for_nodes_ms: u64,
    /// Peak dense TFLOP/s of one device (one GPU; with --device cpu the machine's CPU), for the
    /// model-FLOPs utilisation (MFU) in the log lines, steps.csv and summary.json: the model
    /// FLOPs of the tokens per second (Megatron/PaLM: 6 × the weights a token meets, with
    /// only its top_k experts, plus the attention scores) over this peak × the devices.
    /// `lzrun local` runs every node on this machine's devices (--gpus-per-node GPUs, or the
    /// one CPU); `lzrun controller` counts one device per member. Default: with `lzrun local
    /// --device cuda` and bf16 products, the datasheet's dense BF16 peak of the GPU (H100 and
    /// H200 SXM 989, H100 PCIe 756, A100 312); otherwise unknown, and no MFU is reported.
    #[arg(long, value_name = "X")]
    pub peak_tflops: Option<f64>,
}

fn parse_kill(s: &str) -> Result<(usize, u64), String> {
    faults::parse_kill(s).map_err(|e| e.to_string())
}

fn parse_join(s: &str) -> Result<u64, String> {
    faults::parse_join(s).map_err(|e| e.to_string())
}

fn parse_kill_controller(s: &str) -> Result<u64, String> {
    faults::parse_kill_controller(s).map_err(|e| e.to_string())
}

fn parse_window(s: &str) -> Result<(u64, u64), String> {
    lazarus_traces::duration::parse_range_ms("--window", s).map_err(|e| e.to_string())
}
