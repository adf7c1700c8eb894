//! `lzrun`: elastic MoE training on worker processes.
//!
//! `lzrun local` trains on this machine with one worker process per simulated device;
//! `lzrun worker` is one such process (started by `local`, or by hand). See `--help`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Parser, Subcommand};
use lazarus_executor::recovery::{
    Reconfigure, Survivor, WorkerEvent, plan_recovery, run_elastic_worker,
};
use lazarus_executor::worker::{
    StepLine, WorkerOptions, config_by_name, plan_replicas, run_worker,
};

const AFTER_HELP: &str = "\
Coming next: `lzrun controller` and `lzrun agent` (a control plane across machines that
replans with the Lazarus planner when nodes come and go), `--fault-trace FILE` for
`lzrun local`, and checkpoint restore when a failure loses every replica of an expert.";

/// Elastic MoE training on worker processes, driven by the Lazarus planner.
///
/// Every worker holds the dense model and only the expert replicas the planner assigns to it;
/// tokens travel between workers over TCP to the experts they were routed to, and replicas of
/// one expert stay bit-identical. Start with `lzrun local`: it trains a tiny model with two
/// worker processes on this machine.
#[derive(Debug, Parser)]
#[command(name = "lzrun", version, after_help = AFTER_HELP, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Train on this machine: spawn one worker process per node and report the mean loss.
    ///
    /// Picks a free loopback port per node, starts `--nodes` `lzrun worker` processes (this
    /// executable), streams their per-step JSON lines prefixed with `[rank R]`, and at the end
    /// prints the mean loss of each step over the workers. With no options it trains the tiny
    /// model on 2 nodes for 20 steps. If any worker fails, the others are killed and lzrun
    /// exits with status 2. `--kill RANK@STEP` SIGKILLs a worker and recovers in place: the
    /// survivors discard the in-flight step, this process replans with the Lazarus planner,
    /// the survivors form a new mesh, migrate expert states and resume; one JSON line
    /// `{"recovery":{..}}` gives the detect / replan / migrate / resume times in ms. If a kill
    /// loses every replica of an expert, lzrun stops with status 2 (no checkpoints yet).
    #[command(after_help = AFTER_HELP)]
    Local(LocalArgs),
    /// One worker process (one device); normally started by `lzrun local`.
    ///
    /// Computes the same whole-model plan as every other worker from (--world, --config),
    /// keeps only its own expert replicas, binds its address in --peers, connects to every
    /// other rank, and trains --steps steps on shard --rank of the embedded corpus. Prints one
    /// JSON line per step on stdout ({"step","loss","tokens","ms"}) and, with --out, writes
    /// the checksums of its replicas and dense weights to `DIR/rank<R>.json`.
    #[command(after_help = AFTER_HELP)]
    Worker(WorkerArgs),
}

#[derive(Debug, Args)]
struct LocalArgs {
    /// Number of worker processes (nodes of one device each).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Kill (SIGKILL) worker RANK once it reports having finished step STEP, then recover in
    /// place: replan for the survivors, migrate expert states, resume. Repeatable.
    #[arg(long, value_name = "RANK@STEP", value_parser = parse_kill)]
    kill: Vec<(usize, u64)>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    /// This worker's rank, 0-based.
    #[arg(long)]
    rank: usize,
    /// Number of workers; must equal the number of --peers.
    #[arg(long)]
    world: usize,
    /// Listen address of every rank in rank order, e.g. 127.0.0.1:4000,127.0.0.1:4001.
    #[arg(long, value_delimiter = ',', required = true)]
    peers: Vec<SocketAddr>,
    /// Membership epoch of the communicator (all workers must agree).
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// Exit when stdin closes (set by `lzrun local`, so workers die with their parent).
    #[arg(long, hide = true)]
    watch_stdin: bool,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Debug, Args)]
struct TrainArgs {
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Model configuration: tiny (fast on CPU), gpt-s, gpt-m or gpt-l (the paper's).
    #[arg(long, default_value = "tiny")]
    config: String,
    /// Seed of the model initialisation and of the data order (overrides the config's).
    #[arg(long)]
    seed: Option<u64>,
    /// Directory for the per-worker checksum files `rank<R>.json`.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Rendezvous and per-collective timeout in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
}

fn parse_kill(s: &str) -> Result<(usize, u64), String> {
    let (r, st) = s
        .split_once('@')
        .ok_or_else(|| format!("--kill {s:?}: expected RANK@STEP"))?;
    let r = r
        .trim()
        .parse()
        .map_err(|_| format!("--kill {s:?}: bad rank"))?;
    let st = st
        .trim()
        .parse()
        .map_err(|_| format!("--kill {s:?}: bad step"))?;
    Ok((r, st))
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

fn worker(a: WorkerArgs) -> Result<()> {
    ensure!(
        a.world == a.peers.len(),
        "--world {} but {} --peers addresses",
        a.world,
        a.peers.len()
    );
    ensure!(
        a.rank < a.world,
        "--rank {} is not below --world {}",
        a.rank,
        a.world
    );
    // With --watch-stdin, stdin carries the parent's commands (one JSON line each) and its
    // end means the parent went away.
    let commands = a.watch_stdin.then(|| {
        let (tx, rx) = mpsc::channel::<String>();
        thread::spawn(move || {
            for line in io::stdin().lock().lines().map_while(Result::ok) {
                if !line.trim().is_empty() {
                    let _ = tx.send(line);
                }
            }
            eprintln!("error: parent process went away; stopping");
            std::process::exit(3);
        });
        rx
    });
    let mut config = config_by_name(&a.train.config)?;
    if let Some(seed) = a.train.seed {
        config.seed = seed;
    }
    let opts = WorkerOptions {
        rank: a.rank,
        peers: a.peers,
        config,
        steps: a.train.steps,
        epoch: a.epoch,
        timeout_ms: a.train.timeout_ms,
        out: a.train.out,
    };
    let stdout = io::stdout();
    if let Some(rx) = commands {
        run_elastic_worker(&opts, &rx, |line| {
            let mut out = stdout.lock();
            writeln!(out, "{line}")?;
            out.flush()?;
            Ok(())
        })?;
        return Ok(());
    }
    run_worker(&opts, |line| {
        let mut out = stdout.lock();
        writeln!(out, "{}", serde_json::to_string(line)?)?;
        out.flush()?;
        Ok(())
    })?;
    Ok(())
}

/// The spawned workers; dropping it kills and reaps every one still running.
struct Workers {
    children: Vec<Option<Child>>,
    /// Held open so that workers started with `--watch-stdin` stop when we go away.
    stdins: Vec<Option<ChildStdin>>,
}

impl Workers {
    fn kill_all(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.iter_mut().for_each(|c| *c = None);
        self.stdins.iter_mut().for_each(|s| *s = None);
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// `n` distinct free loopback ports (bound together, then released for the workers).
fn free_addrs(n: usize) -> Result<Vec<SocketAddr>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<io::Result<Vec<_>>>()
        .context("picking free loopback ports")?;
    Ok(listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<io::Result<Vec<_>>>()?)
}

enum Event {
    Step(usize, StepLine),
    Worker(usize, WorkerEvent),
    Stderr(usize, String),
}

/// The parent's bookkeeping in `lzrun local` (ids are the workers' original ranks).
struct Local {
    workers: Workers,
    /// Pending `--kill` requests `(id, step)`.
    kills: Vec<(usize, u64)>,
    killed: BTreeSet<usize>,
    /// Workers that exited successfully.
    done: BTreeSet<usize>,
    steps: Vec<BTreeSet<u64>>,
    losses: BTreeMap<u64, BTreeMap<usize, f32>>,
    last_err: Vec<Option<String>>,
    /// `id → step` of the failure reports since the last recovery.
    failed: BTreeMap<usize, u64>,
    migrated: BTreeSet<usize>,
    /// Survivors that reported a step at or after the resume step since migrating.
    resumed: BTreeSet<usize>,
    resume_step: u64,
    last_kill: Option<Instant>,
}

impl Local {
    fn absorb(&mut self, ev: Event) {
        match ev {
            Event::Step(id, s) => {
                if self.killed.contains(&id) {
                    return;
                }
                self.steps[id].insert(s.step);
                self.losses.entry(s.step).or_default().insert(id, s.loss);
                if self.migrated.contains(&id) && s.step >= self.resume_step {
                    self.resumed.insert(id);
                }
                if let Some(i) = self.kills.iter().position(|&k| k == (id, s.step)) {
                    self.kills.remove(i);
                    if let Some(mut c) = self.workers.children[id].take() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    self.workers.stdins[id] = None;
                    self.killed.insert(id);
                    self.last_kill = Some(Instant::now());
                    println!(
                        "lzrun local: killed worker {id} (SIGKILL) after step {}",
                        s.step
                    );
                }
            }
            Event::Worker(id, WorkerEvent::Failed { step, .. }) => {
                if !self.killed.contains(&id) {
                    self.failed.insert(id, step);
                }
            }
            Event::Worker(id, WorkerEvent::Migrated { .. }) => {
                self.migrated.insert(id);
            }
            Event::Stderr(id, line) => {
                if !line.trim().is_empty() {
                    self.last_err[id] = Some(line);
                }
            }
        }
    }

    /// Reaps exited workers; an unexpected failure is an error.
    fn reap(&mut self) -> Result<()> {
        for id in 0..self.workers.children.len() {
            let Some(child) = self.workers.children[id].as_mut() else {
                continue;
            };
            let status = match child.try_wait() {
                Ok(None) => continue,
                Ok(Some(status)) => status.to_string(),
                Err(e) => format!("could not be waited for: {e}"),
            };
            let ok = matches!(child.try_wait(), Ok(Some(s)) if s.success());
            self.workers.children[id] = None;
            if ok {
                self.done.insert(id);
            } else {
                // Give the stderr reader a moment to deliver the last line.
                thread::sleep(Duration::from_millis(100));
                let why = self.last_err[id]
                    .as_deref()
                    .map(|l| format!(": {}", l.trim_start_matches("error:").trim()))
                    .unwrap_or_default();
                bail!("worker {id} failed ({status}){why}; all workers stopped");
            }
        }
        Ok(())
    }

    /// Workers neither killed nor finished.
    fn alive(&self) -> Vec<usize> {
        (0..self.workers.children.len())
            .filter(|id| self.workers.children[*id].is_some())
            .collect()
    }

    /// Absorbs events until `done(self)` or `deadline`.
    fn wait_until(
        &mut self,
        rx: &mpsc::Receiver<Event>,
        deadline: Instant,
        what: &str,
        done: impl Fn(&Self) -> bool,
    ) -> Result<()> {
        loop {
            while let Ok(ev) = rx.try_recv() {
                self.absorb(ev);
            }
            if done(self) {
                return Ok(());
            }
            self.reap()?;
            ensure!(Instant::now() < deadline, "timed out waiting for {what}");
            if let Ok(ev) = rx.recv_timeout(Duration::from_millis(10)) {
                self.absorb(ev);
            }
        }
    }
}

/// The parent's view of the current membership.
struct Membership {
    /// `[layer][expert][rank]`.
    replicas: Vec<Vec<Vec<u32>>>,
    /// Current rank of each original id.
    rank_of_id: BTreeMap<usize, usize>,
    epoch: u64,
    version: u64,
}

fn recover(
    st: &mut Local,
    m: &mut Membership,
    rx: &mpsc::Receiver<Event>,
    a: &LocalArgs,
    experts: usize,
    bytes_per_expert: u64,
) -> Result<()> {
    let t_detect = st.last_kill.take().unwrap_or_else(Instant::now);
    let wait =
        Duration::from_millis(a.train.timeout_ms.saturating_mul(3)) + Duration::from_secs(30);
    st.wait_until(
        rx,
        Instant::now() + wait,
        "the survivors to detect the failure",
        |s| s.alive().iter().all(|id| s.failed.contains_key(id)),
    )?;
    let detect_ms = t_detect.elapsed().as_secs_f64() * 1e3;

    let t = Instant::now();
    let ids = st.alive();
    ensure!(!ids.is_empty(), "no worker survived");
    let survivors: Vec<Survivor> = ids
        .iter()
        .map(|&id| Survivor {
            id: id as u32,
            rank: m.rank_of_id[&id],
        })
        .collect();
    let resume = ids.iter().map(|id| st.failed[id]).min().unwrap_or(0);
    let peers = free_addrs(ids.len())?;
    let epoch = m.epoch + 1;
    let plan = plan_recovery(
        &m.replicas,
        &survivors,
        experts,
        bytes_per_expert,
        &peers,
        epoch,
        resume,
        m.version,
    )?;
    let replan_ms = t.elapsed().as_secs_f64() * 1e3;

    let t = Instant::now();
    // Survivors report new failures only after they got their command: forget the old ones.
    st.failed.clear();
    st.migrated.clear();
    st.resumed.clear();
    st.resume_step = resume;
    let n_transfers = plan.commands.first().map_or(0, |c| c.transfers.len());
    for (&id, cmd) in ids.iter().zip(&plan.commands) {
        let line = serde_json::to_string::<Reconfigure>(cmd)?;
        let stdin = st.workers.stdins[id]
            .as_mut()
            .with_context(|| format!("worker {id} has no stdin"))?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("sending the new plan to worker {id}"))?;
    }
    st.wait_until(rx, Instant::now() + wait, "the migration", |s| {
        ids.iter().all(|id| s.migrated.contains(id))
    })?;
    let migrate_ms = t.elapsed().as_secs_f64() * 1e3;

    let t = Instant::now();
    st.wait_until(rx, Instant::now() + wait, "the survivors to resume", |s| {
        ids.iter()
            .all(|id| s.resumed.contains(id) || s.done.contains(id))
    })?;
    let resume_ms = t.elapsed().as_secs_f64() * 1e3;

    m.replicas = plan.replicas;
    m.rank_of_id = plan
        .id_of_rank
        .iter()
        .enumerate()
        .map(|(r, &id)| (id as usize, r))
        .collect();
    m.epoch = epoch;
    m.version = plan.version;
    let killed: Vec<usize> = st.killed.iter().copied().collect();
    let line = serde_json::json!({
        "recovery": {
            "epoch": epoch,
            "killed": killed,
            "survivors": ids,
            "resume_step": resume,
            "transfers": n_transfers,
            "detect_ms": detect_ms,
            "replan_ms": replan_ms,
            "migrate_ms": migrate_ms,
            "resume_ms": resume_ms,
        }
    });
    println!("{line}");
    Ok(())
}

fn local(a: LocalArgs) -> Result<()> {
    ensure!(a.nodes >= 1, "--nodes must be at least 1 (got 0)");
    ensure!(a.nodes <= 64, "--nodes {} is more than 64", a.nodes);
    ensure!(a.train.steps >= 1, "--steps must be at least 1 (got 0)");
    for &(r, s) in &a.kill {
        ensure!(
            r < a.nodes,
            "--kill {r}@{s}: rank {r} is not below --nodes {}",
            a.nodes
        );
        ensure!(
            s + 1 < a.train.steps,
            "--kill {r}@{s}: step {s} must be before the last step {}",
            a.train.steps - 1
        );
    }
    let mut config = config_by_name(&a.train.config)?;
    if let Some(seed) = a.train.seed {
        config.seed = seed;
    }
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    if let Some(dir) = &a.train.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let addrs = free_addrs(a.nodes)?;
    let peers = addrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    println!(
        "lzrun local: {} workers, config {}, {} steps, peers {peers}",
        a.nodes, a.train.config, a.train.steps
    );

    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
    };
    let (tx, rx) = mpsc::channel::<Event>();
    let mut readers: Vec<JoinHandle<()>> = Vec::new();
    for rank in 0..a.nodes {
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .args(["--rank", &rank.to_string()])
            .args(["--world", &a.nodes.to_string()])
            .args(["--peers", &peers])
            .args(["--config", &a.train.config])
            .args(["--steps", &a.train.steps.to_string()])
            .args(["--timeout-ms", &a.train.timeout_ms.to_string()])
            .arg("--watch-stdin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(seed) = a.train.seed {
            cmd.args(["--seed", &seed.to_string()]);
        }
        if let Some(dir) = &a.train.out {
            cmd.arg("--out").arg(dir);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting worker {rank} ({})", exe.display()))?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        workers.stdins.push(child.stdin.take());
        workers.children.push(Some(child));
        if let Some(out) = stdout {
            let tx = tx.clone();
            readers.push(thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    println!("[rank {rank}] {line}");
                    if let Ok(step) = serde_json::from_str::<StepLine>(&line) {
                        let _ = tx.send(Event::Step(rank, step));
                    } else if let Ok(ev) = serde_json::from_str::<WorkerEvent>(&line) {
                        let _ = tx.send(Event::Worker(rank, ev));
                    }
                }
            }));
        }
        if let Some(err) = stderr {
            let tx = tx.clone();
            readers.push(thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    eprintln!("[rank {rank}] {line}");
                    let _ = tx.send(Event::Stderr(rank, line));
                }
            }));
        }
    }
    drop(tx);

    let mut st = Local {
        workers,
        kills: a.kill.clone(),
        killed: BTreeSet::new(),
        done: BTreeSet::new(),
        steps: vec![BTreeSet::new(); a.nodes],
        losses: BTreeMap::new(),
        last_err: vec![None; a.nodes],
        failed: BTreeMap::new(),
        migrated: BTreeSet::new(),
        resumed: BTreeSet::new(),
        resume_step: 0,
        last_kill: None,
    };
    let mut m = Membership {
        replicas: plan_replicas(&config, a.nodes)?,
        rank_of_id: (0..a.nodes).map(|r| (r, r)).collect(),
        epoch: 0,
        version: 0,
    };
    let bytes_per_expert = (6 * 4 * config.d_model * config.d_ff) as u64;
    let res = (|| -> Result<()> {
        loop {
            st.wait_until(&rx, far_future(), "workers", |s| {
                s.alive().is_empty() || !s.failed.is_empty() || s.last_kill.is_some()
            })?;
            if st.alive().is_empty() {
                return Ok(());
            }
            if st.last_kill.is_none() {
                let (&id, &step) = st.failed.iter().next().expect("a failure");
                let why = st.last_err[id].clone().unwrap_or_default();
                bail!("worker {id} failed at step {step} without an injected kill{why}");
            }
            recover(&mut st, &mut m, &rx, &a, config.experts, bytes_per_expert)?;
        }
    })();
    st.workers.kill_all();
    for r in readers {
        let _ = r.join();
    }
    res?;
    for (id, s) in st.steps.iter().enumerate() {
        if st.killed.contains(&id) {
            continue;
        }
        ensure!(
            s.len() as u64 == a.train.steps,
            "worker {id} reported {} of {} steps",
            s.len(),
            a.train.steps
        );
    }

    let n = a.nodes - st.killed.len();
    println!("mean loss per step over the workers ({n} at the end):");
    for (step, ls) in &st.losses {
        let mean = ls.values().map(|l| f64::from(*l)).sum::<f64>() / ls.len() as f64;
        println!("step {step:>4}  mean loss {mean:.4}");
    }
    if let Some(dir) = &a.train.out {
        println!("replica checksums in {}", dir.display());
    }
    Ok(())
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(365 * 24 * 3600)
}
