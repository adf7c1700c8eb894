//! `lzrun`: elastic MoE training on worker processes.
//!
//! `lzrun local` trains on this machine with one worker process per simulated device;
//! `lzrun worker` is one such process (started by `local`, or by hand). See `--help`.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Parser, Subcommand};
use lazarus_executor::worker::{StepLine, WorkerOptions, config_by_name, run_worker};

const AFTER_HELP: &str = "\
Coming next: `lzrun controller` and `lzrun agent` (a control plane across machines that
replans with the Lazarus planner when nodes come and go), and failure injection in
`lzrun local` (`--kill NODE@STEP`, `--fault-trace FILE`) with recovery instead of abort.";

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
    /// exits with status 2. No failures are injected yet (`--kill NODE@STEP` and
    /// `--fault-trace FILE` come next).
    #[command(after_help = AFTER_HELP)]
    Local(LocalArgs),
    /// One worker process (one device); normally started by `lzrun local`.
    ///
    /// Computes the same whole-model plan as every other worker from (--world, --config),
    /// keeps only its own expert replicas, binds its address in --peers, connects to every
    /// other rank, and trains --steps steps on shard --rank of the embedded corpus. Prints one
    /// JSON line per step on stdout ({"step","loss","tokens","ms"}) and, with --out, writes
    /// the checksums of its replicas and dense weights to DIR/rank<R>.json.
    #[command(after_help = AFTER_HELP)]
    Worker(WorkerArgs),
}

#[derive(Debug, Args)]
struct LocalArgs {
    /// Number of worker processes (nodes of one device each).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
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
    /// Directory for the per-worker checksum files rank<R>.json.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Rendezvous and per-collective timeout in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
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
    if a.watch_stdin {
        thread::spawn(|| {
            let mut sink = [0u8; 256];
            let mut stdin = io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            eprintln!("error: parent process went away; stopping");
            std::process::exit(3);
        });
    }
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
    Stderr(usize, String),
}

fn local(a: LocalArgs) -> Result<()> {
    ensure!(a.nodes >= 1, "--nodes must be at least 1 (got 0)");
    ensure!(a.nodes <= 64, "--nodes {} is more than 64", a.nodes);
    ensure!(a.train.steps >= 1, "--steps must be at least 1 (got 0)");
    config_by_name(&a.train.config)?;
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

    // Wait for every worker; the first failure kills the rest.
    let mut losses: BTreeMap<u64, Vec<(usize, f32)>> = BTreeMap::new();
    let mut last_err: Vec<Option<String>> = vec![None; a.nodes];
    let mut steps_seen = vec![0u64; a.nodes];
    let mut absorb = |ev: Event, last_err: &mut Vec<Option<String>>| match ev {
        Event::Step(rank, s) => {
            steps_seen[rank] += 1;
            losses.entry(s.step).or_default().push((rank, s.loss));
        }
        Event::Stderr(rank, line) => {
            if !line.trim().is_empty() {
                last_err[rank] = Some(line);
            }
        }
    };
    let mut failure: Option<(usize, String)> = None;
    loop {
        while let Ok(ev) = rx.try_recv() {
            absorb(ev, &mut last_err);
        }
        let mut running = 0;
        for (rank, slot) in workers.children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() && failure.is_none() {
                        failure = Some((rank, status.to_string()));
                    }
                }
                Err(e) => {
                    *slot = None;
                    failure.get_or_insert((rank, format!("could not be waited for: {e}")));
                }
            }
        }
        if failure.is_some() || running == 0 {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    workers.kill_all();
    for r in readers {
        let _ = r.join();
    }
    while let Ok(ev) = rx.try_recv() {
        absorb(ev, &mut last_err);
    }
    if let Some((rank, status)) = failure {
        let why = last_err[rank]
            .as_deref()
            .map(|l| format!(": {}", l.trim_start_matches("error:").trim()))
            .unwrap_or_default();
        bail!("worker {rank} failed ({status}){why}; all workers stopped");
    }
    for (rank, n) in steps_seen.iter().enumerate() {
        ensure!(
            *n == a.train.steps,
            "worker {rank} reported {n} of {} steps",
            a.train.steps
        );
    }

    println!("mean loss per step over {} workers:", a.nodes);
    for (step, ls) in &losses {
        let mean = ls.iter().map(|(_, l)| f64::from(*l)).sum::<f64>() / ls.len() as f64;
        println!("step {step:>4}  mean loss {mean:.4}");
    }
    if let Some(dir) = &a.train.out {
        println!("replica checksums in {}", dir.display());
    }
    Ok(())
}
