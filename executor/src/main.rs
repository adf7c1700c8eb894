//! `lzrun`: elastic MoE training on worker processes.
//!
//! `lzrun local` runs a controller and one agent process per node on this machine (like
//! `torchrun --standalone`); `lzrun controller` and `lzrun agent` run the same pieces across
//! machines; `lzrun worker` is one training process (started by an agent, or by hand for a
//! fixed cluster). See `--help`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufRead, Write};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Args, Parser, Subcommand, ValueEnum};
use lazarus_executor::control::{
    AgentConfig, JobHandle, JobParams, Notice, ServerConfig, WorkerLaunch, run_agent, run_job,
};
use lazarus_executor::faults::{self, Fault, FaultSchedule};
use lazarus_executor::metrics::{self, RecoveryRecord, StepRecord};
use lazarus_executor::model::MoeConfig;
use lazarus_executor::worker::{
    AbortSlot, CheckpointSpec, Command as WorkerCommand, run_managed_worker,
};
use lazarus_executor::worker::{
    CONFIG_NAMES, FAULT_TOLERANCE, WorkerOptions, config_by_name, run_worker,
};
use lazarus_planner::ModelSpec;
use lazarus_planner::job::JobConfig;
use tokio::sync::{mpsc as tmpsc, watch};

/// Elastic MoE training on worker processes, driven by the Lazarus planner.
///
/// A controller plans with the Lazarus planner (Eq. 1 allocation, MRO placement, optimal
/// migration); one agent per node starts that node's worker process and relays plans and
/// reports; workers hold the dense model and only the expert replicas their plan assigns, send
/// tokens over TCP to whichever replica the dispatch plan picks, and keep replicas of one expert
/// bit-identical. When a node dies the survivors discard the step, the controller replans on
/// them and they migrate expert states and resume in place; only when some expert lost every
/// replica do they restore the last checkpoint. Start with `lzrun local`.
#[derive(Debug, Parser)]
#[command(name = "lzrun", version, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Train on this machine: a controller plus one agent (and worker) process per node.
    ///
    /// With no options it trains the tiny model on 2 nodes for 20 steps and prints
    /// Megatron-style log lines and the loss. Faults: `--kill NODE@STEP` SIGKILLs a node (its
    /// agent and worker) after STEP, `--join @STEP` starts a new node, `--fault-trace FILE
    /// --time-scale X` replays a spot trace (the formats `lzsim replay` reads). Each
    /// reconfiguration prints its detect / replan / migrate / resume times. Ctrl-C stops every
    /// process. Exit status 2 on bad input or a failed job.
    Local(LocalArgs),
    /// The controller of a multi-machine job: waits for `--nodes` agents, then trains.
    ///
    /// Agents must present the shared token (`--token` or the LZRUN_TOKEN environment
    /// variable). Listens on loopback unless `--listen` says otherwise. Checkpoints must be on a
    /// file system every node sees.
    Controller(ControllerArgs),
    /// One node's agent: registers with the controller, heartbeats, runs the node's worker.
    Agent(AgentArgs),
    /// One training process (one device); started by an agent (`--managed`) or by hand.
    ///
    /// By hand (a fixed cluster, no controller, no recovery): computes the same whole-model
    /// plan as every other worker from (--world, --config), keeps only its own expert
    /// replicas, binds its address in --peers, connects to every other rank, trains --steps
    /// steps on shard --rank of the embedded corpus, prints one JSON line per step and, with
    /// --out, writes the checksums of its replicas and dense weights to `DIR/rank<R>.json`.
    /// With --managed it reads the controller's commands (JSON lines) on stdin instead.
    Worker(WorkerArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Log lines and a loss table.
    Text,
    /// Only the summary object on stdout (logs go to stderr).
    Json,
}

impl Format {
    /// A log line: stdout for text, stderr for json (stdout then carries only the summary).
    fn say(self, line: &str) {
        match self {
            Format::Text => println!("{line}"),
            Format::Json => eprintln!("{line}"),
        }
    }
}

#[derive(Debug, Args)]
struct LocalArgs {
    /// Nodes to start with (one agent and one worker process each). With --fault-trace: the
    /// most nodes the trace is fitted to (default: as many as it has).
    #[arg(long)]
    nodes: Option<usize>,
    /// SIGKILL node NODE (0-based launch index; joined nodes get the next indices) with its
    /// worker once every worker completed step STEP. Repeatable; several at one step fail
    /// together.
    #[arg(long, value_name = "NODE@STEP", value_parser = parse_kill)]
    kill: Vec<(usize, u64)>,
    /// Start a new node once every worker completed step STEP; it joins at the next step
    /// boundary and receives its experts. Repeatable.
    #[arg(long, value_name = "@STEP", value_parser = parse_join)]
    join: Vec<u64>,
    /// Replay a node-availability trace: Bamboo CSV `time_ms,add|remove,node`, Parcae /
    /// SpotServe JSON lines or a SkyPilot count series (the formats of `lzsim replay`). Nodes
    /// live at time 0 start the job; removals kill, additions join.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kill", "join"])]
    fault_trace: Option<PathBuf>,
    /// Trace seconds one training step stands for: an event at trace time t fires after step
    /// ⌊t / X⌋.
    #[arg(
        long,
        value_name = "X",
        default_value_t = 60.0,
        requires = "fault_trace"
    )]
    time_scale: f64,
    #[command(flatten)]
    job: JobArgs,
}

#[derive(Debug, Args)]
struct ControllerArgs {
    /// Address to listen on for agents.
    #[arg(long, default_value = "127.0.0.1:29400")]
    listen: SocketAddr,
    /// Agents to wait for before the first plan.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Shared secret agents must present (default: the LZRUN_TOKEN environment variable).
    #[arg(long, env = "LZRUN_TOKEN", hide_env_values = true)]
    token: String,
    #[command(flatten)]
    job: JobArgs,
}

#[derive(Debug, Args)]
struct AgentArgs {
    /// The controller's address, HOST:PORT.
    #[arg(long)]
    controller: String,
    /// Shared secret (default: the LZRUN_TOKEN environment variable).
    #[arg(long, env = "LZRUN_TOKEN", hide_env_values = true)]
    token: String,
    /// Node name, unique among live nodes (default: `agent-PID`).
    #[arg(long)]
    name: Option<String>,
    /// Address this node's worker listens on for its peers (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    data_addr: SocketAddr,
    /// Heartbeat period in milliseconds.
    #[arg(long, default_value_t = 200)]
    heartbeat_ms: u64,
    /// Give up registering after this many milliseconds.
    #[arg(long, default_value_t = 5_000)]
    register_timeout_ms: u64,
    /// Protocol version to announce (tests of the controller's version check only).
    #[arg(long, hide = true)]
    protocol_version: Option<u16>,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    /// Take commands from a controller (JSON lines on stdin); set by `lzrun agent`.
    #[arg(long, conflicts_with_all = ["rank", "world", "peers"])]
    managed: bool,
    /// This worker's rank, 0-based.
    #[arg(long, required_unless_present = "managed")]
    rank: Option<usize>,
    /// Number of workers; must equal the number of --peers.
    #[arg(long, required_unless_present = "managed")]
    world: Option<usize>,
    /// Listen address of every rank in rank order, e.g. 127.0.0.1:4000,127.0.0.1:4001.
    #[arg(long, value_delimiter = ',', required_unless_present = "managed")]
    peers: Vec<SocketAddr>,
    /// Membership epoch of the communicator (all workers must agree).
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    #[command(flatten)]
    model: ModelArgs,
    /// Directory for the checksum file `rank<R>.json`.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Rendezvous and per-collective timeout in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
}

/// What to train and for how long (shared by jobs and stand-alone workers).
#[derive(Debug, Args)]
struct ModelArgs {
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Model configuration: tiny (fast on CPU), gpt-s, gpt-m, gpt-l (the paper's, for GPUs), or
    /// a TOML file: `base = "tiny"` plus any field of the model config to override (d_model,
    /// n_layers, n_heads, d_ff, experts, top_k, seq_len, batch, lb_loss_coef, lr, seed, vocab).
    #[arg(long, default_value = "tiny")]
    config: String,
    /// Seed of the model initialisation and of the data order (overrides the config's).
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Debug, Args)]
struct JobArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Minimum replicas per expert (the paper's f; relaxed by the planner when slots run short).
    #[arg(long, default_value_t = FAULT_TOLERANCE)]
    fault_tolerance: usize,
    /// Expert slots per node (default: ⌈f·E / nodes⌉, enough for f replicas of every expert).
    #[arg(long)]
    slots: Option<usize>,
    /// Directory of the checkpoints (default: `<metrics-out>/ckpt` or `<out>/ckpt`, else a
    /// temporary directory removed at the end).
    #[arg(long, value_name = "DIR")]
    ckpt_dir: Option<PathBuf>,
    /// Checkpoint after every K completed steps (0: never; then a failure that loses every
    /// replica of an expert ends the job).
    #[arg(long, value_name = "K", default_value_t = 5)]
    ckpt_every: u64,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 3)]
    ckpt_keep: usize,
    /// Start from the newest valid checkpoint under DIR (a checkpoint root) instead of a fresh
    /// model; steps before the checkpoint's are not trained again.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Replan from the routing statistics every K steps and migrate through the same path
    /// (0: only on membership changes).
    #[arg(long, value_name = "K", default_value_t = 0)]
    rebalance_every: u64,
    /// Directory for the workers' replica checksum files `node<ID>.json`.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write summary.json, timeseries.csv (the simulator's columns), steps.csv and
    /// reconfigurations.jsonl into DIR.
    #[arg(long, value_name = "DIR")]
    metrics_out: Option<PathBuf>,
    /// Output: text (log lines) or json (only the summary object on stdout).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Workers' rendezvous and per-collective timeout in milliseconds (a silent peer is
    /// declared dead after it).
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// A node whose agent sent no heartbeat for this long is dead.
    #[arg(long, default_value_t = 3_000)]
    heartbeat_timeout_ms: u64,
}

fn parse_kill(s: &str) -> Result<(usize, u64), String> {
    faults::parse_kill(s).map_err(|e| e.to_string())
}

fn parse_join(s: &str) -> Result<u64, String> {
    faults::parse_join(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    ExitCode::SUCCESS
                }
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    ExitCode::from(2)
                }
                _ => {
                    let text = e.to_string();
                    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                    let msg = first.trim().trim_start_matches("error:").trim();
                    eprintln!("error: {msg} (see `lzrun --help`)");
                    ExitCode::from(2)
                }
            };
        }
    };
    let res = match cli.cmd {
        Cmd::Local(a) => local(a),
        Cmd::Controller(a) => controller(a),
        Cmd::Agent(a) => agent(a),
        Cmd::Worker(a) => worker(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

/// A model configuration by name, or from a TOML file (`base` + overrides).
fn load_config(spec: &str, seed: Option<u64>) -> Result<MoeConfig> {
    let path = Path::new(spec);
    let mut cfg = if CONFIG_NAMES.contains(&spec) {
        config_by_name(spec)?
    } else if spec.ends_with(".toml") || path.exists() {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let mut table: toml::Table = text
            .parse()
            .map_err(|e| anyhow!("config file {}: {e}", path.display()))?;
        let base = match table.remove("base") {
            None => "tiny".to_owned(),
            Some(toml::Value::String(s)) => s,
            Some(v) => bail!(
                "config file {}: base must be a string, got {v}",
                path.display()
            ),
        };
        let mut merged: toml::Table =
            toml::Table::try_from(config_by_name(&base)?).context("encoding the base config")?;
        for (k, v) in table {
            ensure!(
                merged.contains_key(&k),
                "config file {}: unknown field {k:?} (fields: base, {})",
                path.display(),
                merged.keys().cloned().collect::<Vec<_>>().join(", ")
            );
            merged.insert(k, v);
        }
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e| anyhow!("config file {}: {e}", path.display()))?
    } else {
        config_by_name(spec)?
    };
    if let Some(seed) = seed {
        cfg.seed = seed;
    }
    cfg.validate()
        .map_err(|e| anyhow!("model config {spec}: {e}"))?;
    Ok(cfg)
}

fn worker(a: WorkerArgs) -> Result<()> {
    let stdout = io::stdout();
    let emit = |line: &str| -> Result<()> {
        let mut out = stdout.lock();
        writeln!(out, "{line}")?;
        out.flush()?;
        Ok(())
    };
    if a.managed {
        let (tx, rx) = mpsc::channel::<WorkerCommand>();
        let abort = AbortSlot::default();
        let slot = abort.clone();
        thread::spawn(move || {
            for line in io::stdin().lock().lines().map_while(Result::ok) {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str(&line) {
                    Ok(cmd) => {
                        // The training thread may be blocked in a collective: abort it here.
                        if let WorkerCommand::Abort { epoch } = cmd {
                            slot.abort(epoch);
                        }
                        if tx.send(cmd).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        eprintln!("error: bad command {line:?}: {e}");
                        std::process::exit(2);
                    }
                }
            }
            // The agent went away: so does its node.
            std::process::exit(3);
        });
        run_managed_worker(&rx, &abort, emit)?;
        return Ok(());
    }
    let (Some(rank), Some(world)) = (a.rank, a.world) else {
        bail!("--rank and --world are required without --managed");
    };
    ensure!(
        world == a.peers.len(),
        "--world {world} but {} --peers addresses",
        a.peers.len()
    );
    ensure!(rank < world, "--rank {rank} is not below --world {world}");
    let opts = WorkerOptions {
        rank,
        peers: a.peers,
        config: load_config(&a.model.config, a.model.seed)?,
        steps: a.model.steps,
        epoch: a.epoch,
        timeout_ms: a.timeout_ms,
        out: a.out,
    };
    run_worker(&opts, |line| emit(&serde_json::to_string(line)?))?;
    Ok(())
}

fn agent(a: AgentArgs) -> Result<()> {
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("agent-{}", std::process::id()));
    let mut cfg = AgentConfig::new(&a.controller, &a.token, &name, 1);
    cfg.heartbeat_every_ms = a.heartbeat_ms;
    cfg.register_timeout_ms = a.register_timeout_ms;
    if let Some(v) = a.protocol_version {
        cfg.protocol_version = v;
    }
    let launch = WorkerLaunch {
        exe: std::env::current_exe().context("locating the lzrun executable")?,
        listen: a.data_addr,
    };
    let rt = runtime()?;
    rt.block_on(async {
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = stop_tx.send(true);
            }
        });
        run_agent(&cfg, &launch, stop_rx)
            .await
            .map(|_| ())
            .map_err(|e| anyhow!("agent {name}: {e}"))
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

/// Everything a job needs from the command line, resolved.
struct Job {
    server: ServerConfig,
    params: JobParams,
    /// A checkpoint directory we created and remove at the end.
    temp_ckpt: Option<PathBuf>,
}

fn job_from_args(a: &JobArgs, nodes: usize, token: &str) -> Result<Job> {
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
    ensure!(a.ckpt_keep >= 1, "--ckpt-keep must be at least 1");
    let config = load_config(&a.model.config, a.model.seed)?;
    let slots = a
        .slots
        .unwrap_or_else(|| (a.fault_tolerance * config.experts).div_ceil(nodes).max(1));
    ensure!(
        slots * nodes >= config.experts,
        "{nodes} nodes × {slots} slots cannot hold {} experts (raise --slots)",
        config.experts
    );
    if let Some(r) = &a.resume {
        ensure!(
            r.is_dir(),
            "--resume {}: no such checkpoint directory",
            r.display()
        );
    }
    let mut temp_ckpt = None;
    let checkpoint = if a.ckpt_every == 0 {
        None
    } else {
        let root = match (&a.ckpt_dir, &a.metrics_out, &a.out) {
            (Some(d), _, _) => d.clone(),
            (None, Some(d), _) | (None, None, Some(d)) => d.join("ckpt"),
            (None, None, None) => {
                let d = std::env::temp_dir().join(format!("lzrun-ckpt-{}", std::process::id()));
                temp_ckpt = Some(d.clone());
                d
            }
        };
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
        Some(CheckpointSpec {
            root,
            every_steps: a.ckpt_every,
        })
    };
    let model = ModelSpec {
        experts: config.experts,
        layers: config.n_layers,
        f: a.fault_tolerance,
    };
    let mut rules = JobConfig::new(model, slots, a.model.steps);
    rules.initial_nodes = nodes;
    rules.heartbeat_timeout_ms = a.heartbeat_timeout_ms;
    // Survivors notice a stuck peer after one collective timeout; give the stuck member that
    // long again (and a margin) to answer before fencing it.
    rules.member_timeout_ms = a.timeout_ms.saturating_mul(2).saturating_add(2_000);
    // Newcomers join at the next step boundary (the paper waits 2 min to batch joins; this
    // executor pauses training for them anyway).
    rules.scale_out_wait_ms = 0;
    rules.rebalance_every_steps = a.rebalance_every;
    rules.checkpoint_every_steps = if checkpoint.is_some() {
        a.ckpt_every
    } else {
        0
    };
    rules.resume = a.resume.is_some();
    rules.bytes_per_expert = config.expert_state_bytes() as u64;
    rules
        .validate()
        .map_err(|e| anyhow!("invalid job configuration: {e}"))?;
    Ok(Job {
        server: ServerConfig {
            tick_ms: 50,
            io_timeout_ms: a.heartbeat_timeout_ms,
        },
        params: JobParams {
            config,
            rules,
            token: token.to_owned(),
            timeout_ms: a.timeout_ms,
            checkpoint,
            checkpoint_keep: a.ckpt_keep,
            out: a.out.clone(),
            resume: a.resume.clone(),
        },
        temp_ckpt,
    })
}

/// Collects what a run reports and prints it.
struct Report {
    format: Format,
    steps: u64,
    records: Vec<StepRecord>,
    reconfigs: Vec<RecoveryRecord>,
    consumed: u64,
    start: Instant,
}

impl Report {
    fn new(format: Format, steps: u64) -> Self {
        Self {
            format,
            steps,
            records: Vec::new(),
            reconfigs: Vec::new(),
            consumed: 0,
            start: Instant::now(),
        }
    }

    fn say(&self, line: &str) {
        self.format.say(line);
    }

    fn step(&mut self, r: StepRecord) {
        self.consumed += r.samples;
        self.say(&metrics::log_line(&r, self.steps, self.consumed));
        self.records.push(r);
    }

    fn reconfigured(&mut self, r: RecoveryRecord) {
        let line = serde_json::json!({ "reconfiguration": &r });
        self.say(&line.to_string());
        self.reconfigs.push(r);
    }

    /// Summary, metrics files, final output.
    fn finish(&self, a: &JobArgs, config: &MoeConfig) -> Result<()> {
        let summary = metrics::summarize(
            &self.records,
            &self.reconfigs,
            self.start.elapsed().as_secs_f64(),
            serde_json::to_value(config)?,
            config.seed,
            git_commit(),
        );
        if let Some(dir) = &a.metrics_out {
            metrics::write_metrics(dir, &summary, &self.records, &self.reconfigs)
                .with_context(|| format!("writing metrics to {}", dir.display()))?;
        }
        match self.format {
            Format::Json => println!("{}", serde_json::to_string(&summary)?),
            Format::Text => {
                println!(
                    "done: {} steps, loss {:.4} → {:.4}, {} in-place recoveries {:?} ms, {} checkpoint restores, {} joins, {} rebalances, {:.0} tokens/s",
                    summary.steps,
                    summary.initial_loss,
                    summary.final_loss,
                    summary.recoveries,
                    summary
                        .recovery_ms
                        .iter()
                        .map(|m| m.round() as u64)
                        .collect::<Vec<_>>(),
                    summary.fallbacks,
                    summary.joins,
                    summary.rebalances,
                    summary.tokens_per_s
                );
                if let Some(dir) = &a.metrics_out {
                    println!("metrics in {}", dir.display());
                }
                if let Some(dir) = &a.out {
                    println!("replica checksums in {}", dir.display());
                }
            }
        }
        Ok(())
    }
}

/// The commit of the checkout the binary runs in, or "unknown".
fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn controller(a: ControllerArgs) -> Result<()> {
    ensure!(!a.token.is_empty(), "the token is empty");
    let job = job_from_args(&a.job, a.nodes, &a.token)?;
    let rt = runtime()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(a.listen))
        .with_context(|| format!("listening on {}", a.listen))?;
    let mut report = Report::new(a.job.format, a.job.model.steps);
    report.say(&format!(
        "lzrun controller: listening on {}, waiting for {} agents",
        a.listen, a.nodes
    ));
    let config = job.params.config.clone();
    let result = rt.block_on(drive(
        listener,
        job.server,
        job.params,
        &mut report,
        |_| {},
        |_, _| Ok(()),
    ));
    if let Some(d) = job.temp_ckpt {
        let _ = std::fs::remove_dir_all(d);
    }
    result?;
    report.finish(&a.job, &config)
}

/// Runs the job server and handles its notices until the job is over (or Ctrl-C); `on_step`
/// runs after every completed step (fault injection in `lzrun local`), `on_fenced` with the
/// name of every node the controller fenced.
async fn drive(
    listener: tokio::net::TcpListener,
    server_cfg: ServerConfig,
    params: JobParams,
    report: &mut Report,
    mut on_fenced: impl FnMut(&str),
    mut on_step: impl FnMut(&StepRecord, &JobHandle) -> Result<()>,
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
                    if first && let Err(e) = on_step(&rec, &handle) {
                        outcome = Err(e);
                        break;
                    }
                }
                Some(Notice::Reconfigured(r)) => report.reconfigured(r),
                Some(Notice::Log(l)) => report.say(&format!("[controller] {l}")),
                Some(Notice::Fenced { name, reason }) => {
                    report.say(&format!("[controller] node {name} fenced: {reason}"));
                    on_fenced(&name);
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

/// The agent processes of `lzrun local`, each in its own process group (with its worker);
/// dropping it SIGKILLs every group still running.
struct Nodes {
    exe: PathBuf,
    controller: SocketAddr,
    token: String,
    children: Vec<(String, Option<Child>)>,
}

impl Nodes {
    fn spawn(&mut self, name: &str) -> Result<()> {
        let child = Command::new(&self.exe)
            .arg("agent")
            .args(["--controller", &self.controller.to_string()])
            .args(["--name", name])
            .env("LZRUN_TOKEN", &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Own process group: `kill_group` takes the agent and its worker together, and a
            // Ctrl-C in the terminal reaches only `lzrun local`, which stops the job cleanly.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting agent {name} ({})", self.exe.display()))?;
        self.children.push((name.to_owned(), Some(child)));
        Ok(())
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.children
            .iter()
            .rposition(|(n, c)| n == name && c.is_some())
    }

    /// SIGKILLs node `i`'s process group (agent and worker).
    fn kill_group(&mut self, i: usize) -> Result<String> {
        let (name, slot) = self
            .children
            .get_mut(i)
            .ok_or_else(|| anyhow!("no node {i}"))?;
        let mut child = slot
            .take()
            .ok_or_else(|| anyhow!("node {i} is not running"))?;
        let pgid = i32::try_from(child.id()).context("pid out of range")?;
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is shared.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        let _ = child.wait();
        Ok(name.clone())
    }

    /// Waits up to `grace` for every agent to exit, then kills the rest.
    fn reap(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        for i in 0..self.children.len() {
            while let Some(c) = self.children[i].1.as_mut() {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => {
                        self.children[i].1 = None;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        thread::sleep(Duration::from_millis(20));
                    }
                    Ok(None) => {
                        let _ = self.kill_group(i);
                    }
                }
            }
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            if self.children[i].1.is_some() {
                let _ = self.kill_group(i);
            }
        }
    }
}

fn local(a: LocalArgs) -> Result<()> {
    let schedule: FaultSchedule = match &a.fault_trace {
        Some(path) => {
            let trace = lazarus_traces::load(path)
                .map_err(|e| anyhow!("--fault-trace {}: {e}", path.display()))?;
            faults::schedule_from_trace(&trace, a.time_scale, a.job.model.steps, a.nodes)
                .map_err(|e| anyhow!("--fault-trace {}: {e}", path.display()))?
        }
        None => {
            faults::schedule_from_flags(a.nodes.unwrap_or(2), &a.kill, &a.join, a.job.model.steps)
                .map_err(|e| anyhow!("{e}"))?
        }
    };
    ensure!(
        schedule.initial_nodes <= 64,
        "{} nodes is more than 64",
        schedule.initial_nodes
    );
    // Keeps stray agents of other local runs out; not a secret against local users.
    let token = format!("{:016x}", rand::random::<u64>());
    let job = job_from_args(&a.job, schedule.initial_nodes, &token)?;
    if let Some(dir) = &a.job.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let rt = runtime()?;
    let std_listener = StdListener::bind(("127.0.0.1", 0)).context("binding the controller")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let listener = {
        let _guard = rt.enter();
        tokio::net::TcpListener::from_std(std_listener)?
    };
    let mut report = Report::new(a.job.format, a.job.model.steps);
    report.say(&format!(
        "lzrun local: {} nodes, config {}, {} steps, {} faults scheduled, controller {addr}",
        schedule.initial_nodes,
        a.job.model.config,
        a.job.model.steps,
        schedule.len()
    ));
    let mut nodes = Nodes {
        exe: std::env::current_exe().context("locating the lzrun executable")?,
        controller: addr,
        token,
        children: Vec::new(),
    };
    for name in &schedule.initial_names {
        nodes.spawn(name)?;
    }
    let config = job.params.config.clone();
    let format = a.job.format;
    let nodes = std::cell::RefCell::new(nodes);
    let result = rt.block_on(drive(
        listener,
        job.server,
        job.params,
        &mut report,
        |name| {
            // A fenced node's processes may be stopped, not dead: kill them for good.
            let mut nodes = nodes.borrow_mut();
            if let Some(i) = nodes.index_of(name) {
                let _ = nodes.kill_group(i);
            }
        },
        |rec, handle| {
            let mut nodes = nodes.borrow_mut();
            for fault in schedule.at(rec.step) {
                match fault {
                    Fault::Kill { node } => {
                        let name = nodes.kill_group(*node)?;
                        handle.fault_injected();
                        format.say(&format!(
                            "lzrun local: killed node {node} ({name}) with SIGKILL after step {}",
                            rec.step
                        ));
                    }
                    Fault::KillName { name } => {
                        let i = nodes
                            .index_of(name)
                            .ok_or_else(|| anyhow!("trace kills {name}, which is not running"))?;
                        nodes.kill_group(i)?;
                        handle.fault_injected();
                        format.say(&format!(
                            "lzrun local: killed node {i} ({name}) with SIGKILL after step {}",
                            rec.step
                        ));
                    }
                    Fault::Join { name } => {
                        let name = name
                            .clone()
                            .unwrap_or_else(|| format!("n{}", nodes.children.len()));
                        nodes.spawn(&name)?;
                        format.say(&format!(
                            "lzrun local: started node {} ({name}) after step {}",
                            nodes.children.len() - 1,
                            rec.step
                        ));
                    }
                }
            }
            Ok(())
        },
    ));
    nodes.borrow_mut().reap(Duration::from_secs(5));
    if let Some(d) = &job.temp_ckpt {
        let _ = std::fs::remove_dir_all(d);
    }
    result?;
    report.finish(&a.job, &config)?;
    if format == Format::Text {
        let mut by_step: BTreeMap<u64, f64> = BTreeMap::new();
        for r in &report.records {
            by_step.insert(r.step, r.loss);
        }
        println!("mean loss per step over the workers:");
        for (step, loss) in by_step {
            println!("step {step:>4}  mean loss {loss:.4}");
        }
    }
    Ok(())
}
