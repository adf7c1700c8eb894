//! `lzrun calibrate`: measures on this machine what `lzsim`'s cost model needs for one model
//! and writes it as a hardware profile (`lzsim … --hardware FILE.toml`), every number commented
//! with how it was measured.
//!
//! Everything comes from the real code paths: short `lzrun local` jobs of this executable
//! (step times on 1..=N nodes and at other batch sizes, failure detection, replan, mesh build,
//! a node's start, a checkpoint restore, the launcher's start and stop), the checkpoint module
//! writing and reading a full checkpoint of the model, and the TCP communicator moving expert
//! states and all-to-all buffers between two ranks. Nothing is a constant.
//!
//! # The step-time model it fits (the simulator's `step_cost` with the optional host terms)
//!
//! Every node of `lzrun local` is a process on this one host, so the ranks share its cores:
//!
//! `step_s(N) = max(1, N / host_cores) · (compute(T) + step_overhead_s) + step_per_peer_s · (N − 1)
//!             + all-to-all and all-reduce bytes / bandwidth`
//!
//! * `compute(T)`: the model's training FLOPs for the `T` tokens of a rank's batch (dense part,
//!   and `top_k` expert assignments per token) over `gpu_flops_effective`, and
//!   `step_overhead_s` what a step costs besides (optimizer, framework): fitted on one node
//!   (no communication at all) at half, once and twice the batch — the secant through the
//!   half and double batch gives the cost per token, the run at the batch itself anchors the
//!   line, so the model is exact at the configured batch;
//! * `step_per_peer_s`: what each further rank adds to every step (the collectives' messages,
//!   waiting for peers that the shared cores delay): least squares through the origin of
//!   `step_s(N) − max(1, N/host_cores) · step_s(1)` against `N − 1` over `N = 2..=nodes`;
//! * the bandwidth terms use the measured loopback all-to-all bandwidth (they are below a
//!   millisecond for the tiny model, and are left in the per-peer term rather than fitted).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Args;
use lazarus_executor::checkpoint;
use lazarus_executor::comm::{Communicator, MeshSecret, TcpCommunicator};
use lazarus_executor::metrics::{
    KIND_CHECKPOINT, KIND_IN_PLACE, KIND_JOIN, RecoveryRecord, StepRecord,
};
use lazarus_executor::model::{DenseModel, ExpertStore, MoeConfig, model_flops_per_token};
use lazarus_executor::worker::plan_replicas;
use serde::{Deserialize, Serialize};

use crate::config::load_config;
use crate::runinfo::{cpus, load_average};

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Largest cluster measured: step times on 1..=N nodes (at least 2; the failure runs use
    /// up to 4).
    #[arg(long, default_value_t = 6)]
    pub nodes: usize,
    /// Model configuration, as for `lzrun local --config`: tiny, gpt-s, gpt-m, gpt-l or a TOML
    /// file.
    #[arg(long, default_value = "tiny")]
    pub config: String,
    /// Measure with a Hugging Face model instead (as `lzrun local --model-config`; --config
    /// gives its training knobs): every measuring job trains it.
    #[arg(long, value_name = "config.json")]
    pub model_config: Option<PathBuf>,
    /// Training steps of each step-time run (step 0 is not averaged: it warms up; a checkpoint
    /// every 3 steps measures the checkpoint's cost), at least 4.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Write the profile here (TOML; read by `lzsim replay|predict --hardware FILE.toml`).
    #[arg(long, value_name = "FILE.toml")]
    pub out: PathBuf,
    /// Keep the measuring runs' metrics directories here (default: a temporary directory,
    /// removed at the end).
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
}

/// The profile `lzsim` reads: the fields of its `HardwareProfile`, all present.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub gpus_per_node: usize,
    pub nic_shared_by_nodes: usize,
    pub gpu_flops_effective: f64,
    pub gpu_memory_bytes: u64,
    pub intra_node_bandwidth_bytes_per_s: f64,
    pub inter_node_bandwidth_bytes_per_s: f64,
    pub network_efficiency: f64,
    pub checkpoint_bandwidth_bytes_per_s: f64,
    pub failure_detection_timeout_s: f64,
    pub failure_detection_steps: f64,
    pub failure_detection_steps_later: f64,
    pub communicator_rebuild_s: f64,
    pub process_restart_s: f64,
    pub node_boot_s: f64,
    pub host_cores: f64,
    pub step_overhead_s: f64,
    pub step_per_peer_s: f64,
    pub replan_s: f64,
    pub state_transfer_bandwidth_bytes_per_s: f64,
    pub job_start_s: f64,
    pub job_start_per_node_s: f64,
    pub job_stop_s: f64,
}

/// The profile's keys in the order they are written.
const KEYS: [&str; 23] = [
    "name",
    "gpus_per_node",
    "nic_shared_by_nodes",
    "host_cores",
    "gpu_flops_effective",
    "step_overhead_s",
    "step_per_peer_s",
    "gpu_memory_bytes",
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "network_efficiency",
    "state_transfer_bandwidth_bytes_per_s",
    "checkpoint_bandwidth_bytes_per_s",
    "failure_detection_timeout_s",
    "failure_detection_steps",
    "failure_detection_steps_later",
    "replan_s",
    "communicator_rebuild_s",
    "process_restart_s",
    "node_boot_s",
    "job_start_s",
    "job_start_per_node_s",
    "job_stop_s",
];

impl Profile {
    /// TOML: `header` (comment lines), then every key with its note as comment lines above it.
    /// Fails on a non-finite number (TOML could not carry it back).
    pub fn to_toml(&self, header: &str, notes: &BTreeMap<&str, String>) -> Result<String> {
        let table = toml::Table::try_from(self).context("encoding the profile")?;
        let mut s = String::new();
        for line in header.lines() {
            let _ = writeln!(s, "# {line}");
        }
        for key in KEYS {
            let value = table
                .get(key)
                .ok_or_else(|| anyhow!("profile field {key} missing"))?;
            if let toml::Value::Float(x) = value {
                ensure!(
                    x.is_finite(),
                    "profile field {key} is {x}, not a finite number"
                );
            }
            s.push('\n');
            if let Some(note) = notes.get(key) {
                for line in note.lines() {
                    let _ = writeln!(s, "# {line}");
                }
            }
            let _ = writeln!(s, "{key} = {value}");
        }
        ensure!(
            table.len() == KEYS.len(),
            "the profile has {} fields, {} are written",
            table.len(),
            KEYS.len()
        );
        Ok(s)
    }
}

/// What one measuring `lzrun local` run left in its metrics directory.
struct Run {
    records: Vec<StepRecord>,
    reconfigs: Vec<RecoveryRecord>,
    wall_s: f64,
    run: serde_json::Value,
    /// The run's checkpoint interval (0: none).
    ckpt_every: u64,
}

/// One failure recovery of a measuring run.
struct Detection {
    /// Kill to the new plan.
    detect_s: f64,
    /// The run's mean step at the membership that failed.
    step_s: f64,
    /// Not the run's first failure.
    later: bool,
}

/// How long each step record took on the wall clock: the time since the previous record when
/// it follows the previous step on the same plan (so the time between steps counts, and a
/// checkpoint written between them), else `None` (the first step, or the first after a
/// reconfiguration). Whether the step follows a checkpoint (its index a multiple of `every`).
/// The same rule as `lzsim predict`'s measured breakdown.
pub fn step_durations(records: &[StepRecord], every: u64) -> Vec<(Option<f64>, bool)> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let follows = i > 0 && {
                let p = &records[i - 1];
                p.step + 1 == r.step && p.plan_version == r.plan_version
            };
            let d = follows.then(|| r.t_s - records[i - 1].t_s);
            (d, every > 0 && r.step > 0 && r.step.is_multiple_of(every))
        })
        .collect()
}

impl Run {
    /// Mean seconds of a step that follows another and no checkpoint ([`step_durations`]).
    fn mean_step_s(&self) -> f64 {
        mean(
            step_durations(&self.records, self.ckpt_every)
                .into_iter()
                .filter(|(_, after_ckpt)| !after_ckpt)
                .filter_map(|(d, _)| d),
        )
    }

    /// Mean extra seconds of the steps right after a checkpoint over [`Run::mean_step_s`];
    /// `None` without such steps.
    fn checkpoint_excess_s(&self) -> Option<f64> {
        let after: Vec<f64> = step_durations(&self.records, self.ckpt_every)
            .into_iter()
            .filter(|(_, after_ckpt)| *after_ckpt)
            .filter_map(|(d, _)| d)
            .collect();
        (!after.is_empty()).then(|| mean(after.into_iter()) - self.mean_step_s())
    }

    /// Launch-relative seconds of the first step record.
    fn first_step_s(&self) -> f64 {
        self.run["timeline"]["first_step_s"].as_f64().unwrap_or(0.0)
    }

    /// Seconds from the launch until the first step started, counting step 0 as a mean step
    /// (so its warm-up is part of the start).
    fn start_s(&self) -> f64 {
        self.first_step_s() - self.mean_step_s()
    }

    /// Seconds from the last step record to the end of the run.
    fn stop_s(&self) -> f64 {
        let last = self.records.last().map_or(0.0, |r| r.t_s);
        self.wall_s - self.first_step_s() - last
    }

    fn reconfigs_of(&self, kind: &str) -> impl Iterator<Item = &RecoveryRecord> {
        self.reconfigs.iter().filter(move |r| r.kind == kind)
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (n, s) = xs.fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

/// Runs `lzrun local ARGS --metrics-out DIR --format json` and reads what it wrote.
fn run_local(exe: &Path, dir: &Path, args: &[String]) -> Result<Run> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let out = Command::new(exe)
        .arg("local")
        .args(args)
        .arg("--metrics-out")
        .arg(dir)
        .args(["--format", "json"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        bail!(
            "measuring run `lzrun local {}` failed ({}): {}",
            args.join(" "),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    let records: Vec<StepRecord> = csv::Reader::from_path(dir.join("steps.csv"))
        .context("reading steps.csv of a measuring run")?
        .deserialize()
        .collect::<Result<_, _>>()
        .context("parsing steps.csv of a measuring run")?;
    let text = std::fs::read_to_string(dir.join("reconfigurations.jsonl"))
        .context("reading reconfigurations.jsonl of a measuring run")?;
    let reconfigs = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<Vec<RecoveryRecord>, _>>()
        .context("parsing reconfigurations.jsonl of a measuring run")?;
    let summary: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("summary.json")).context("reading summary.json")?,
    )?;
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("run.json")).context("reading run.json")?)?;
    ensure!(
        !records.is_empty(),
        "measuring run `lzrun local {}` recorded no step",
        args.join(" ")
    );
    let ckpt_every = run["checkpoint"]["every_steps"].as_u64().unwrap_or(0);
    Ok(Run {
        records,
        reconfigs,
        wall_s: summary["wall_s"].as_f64().unwrap_or(f64::NAN),
        run,
        ckpt_every,
    })
}

/// A config file equal to `cfg` but with `batch` sequences per worker (for a Hugging Face
/// model, its training knobs only: the measuring runs read the model from `--model-config`).
fn config_with_batch(dir: &Path, cfg: &MoeConfig, batch: usize) -> Result<PathBuf> {
    let mut c = match cfg.hf {
        Some(_) => MoeConfig::tiny().with_training_of(cfg),
        None => cfg.clone(),
    };
    c.batch = batch;
    let mut table = toml::Table::try_from(&c).context("encoding the config")?;
    table.insert("base".into(), toml::Value::String("tiny".into()));
    let path = dir.join(format!("config-batch{batch}.toml"));
    std::fs::write(&path, toml::to_string(&table)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The simulator's training FLOPs per token of one rank that keeps all its assignments
/// (`lazarus_simulator::cost::ModelProfile`: `6·dense_matmul_params + 12·layers·seq·d` for the
/// dense part, `6·expert_params` per expert assignment, `top_k` assignments per token in every
/// MoE layer), for the
/// model profile `lzsim predict` derives from an `lzrun` config (every layer an MoE layer,
/// attention `4·d²`, router `d·E`, LM head tied to the `vocab·d` embedding). It is the model
/// FLOPs count the run's MFU uses ([`model_flops_per_token`]), so a calibrated
/// `gpu_flops_effective` and a measured MFU divide the same numerator.
pub fn flops_per_token(cfg: &MoeConfig) -> f64 {
    model_flops_per_token(cfg)
}

/// Seconds to write and to read a full checkpoint of `cfg` through the checkpoint module, and
/// the seconds rank 0 of an `nodes`-node plan blocks writing its parts (the dense state and
/// the experts it is the lowest holder of). Medians of `reps`.
struct CheckpointTiming {
    bytes: u64,
    rank0_bytes: u64,
    save_all_s: f64,
    save_rank0_s: f64,
    load_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn checkpoint_timing(
    cfg: &MoeConfig,
    root: &Path,
    nodes: usize,
    reps: usize,
) -> Result<CheckpointTiming> {
    let dev = candle_core::Device::Cpu;
    let model = DenseModel::new(cfg, &dev).context("building the dense model")?;
    let opt = model.optimizer()?;
    let store = ExpertStore::all(cfg, &dev).context("building the experts")?;
    let dense = checkpoint::encode_dense(&opt.export()?);
    let mut parts: Vec<(String, Vec<u8>)> = vec![(checkpoint::dense_part().to_owned(), dense)];
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            let bytes = checkpoint::encode_expert(&store.export(l, e)?);
            parts.push((checkpoint::expert_part(l, e), bytes));
        }
    }
    let replicas = plan_replicas(cfg, nodes)?;
    let rank0: Vec<String> = checkpoint::parts_of(&replicas, 0);
    let bytes: u64 = parts.iter().map(|(_, b)| b.len() as u64).sum();
    let rank0_bytes: u64 = parts
        .iter()
        .filter(|(n, _)| rank0.contains(n))
        .map(|(_, b)| b.len() as u64)
        .sum();
    let names: Vec<String> = parts.iter().map(|(n, _)| n.clone()).collect();
    let (mut save_all, mut save_rank0, mut load) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps {
        let step = rep as u64 + 1;
        // Rank 0's share first (what the job blocks on), then the rest and the commit.
        let t = Instant::now();
        let mut infos = Vec::new();
        for (name, b) in parts.iter().filter(|(n, _)| rank0.contains(n)) {
            infos.push(checkpoint::write_part(root, step, name, b)?);
        }
        save_rank0.push(t.elapsed().as_secs_f64());
        for (name, b) in parts.iter().filter(|(n, _)| !rank0.contains(n)) {
            infos.push(checkpoint::write_part(root, step, name, b)?);
        }
        save_all.push(t.elapsed().as_secs_f64());
        let manifest = checkpoint::Manifest::new(step, nodes, 1, cfg.clone(), infos);
        checkpoint::commit(root, manifest, &names, 2)?;
        let t = Instant::now();
        let loaded = checkpoint::load_latest(root, cfg)?;
        loaded.dense()?;
        for l in 0..cfg.n_layers {
            for e in 0..cfg.experts {
                loaded.expert(l, e)?;
            }
        }
        load.push(t.elapsed().as_secs_f64());
    }
    Ok(CheckpointTiming {
        bytes,
        rank0_bytes,
        save_all_s: median(save_all),
        save_rank0_s: median(save_rank0),
        load_s: median(load),
    })
}

/// Bytes/s of the TCP communicator between two ranks of this process (loopback): expert-state
/// transfers (`send_recv`, what migration uses), all-to-all (`all_to_all_v`, what dispatch
/// uses) and all-reduce (`all_reduce_sum` over both ranks, what gradients use; counted as the
/// ring model's `2(m−1)/m · bytes` = `bytes` for two ranks), each `bytes` per direction,
/// the fastest of `reps` (the slower rank's time of each).
fn comm_bandwidth(bytes: usize, reps: usize) -> Result<(f64, f64, f64)> {
    let listeners = [
        TcpListener::bind("127.0.0.1:0")?,
        TcpListener::bind("127.0.0.1:0")?,
    ];
    let peers: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()?;
    let floats = bytes / 4;
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, listener)| {
            let peers = peers.clone();
            std::thread::spawn(move || -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
                let mut c = TcpCommunicator::connect(
                    rank,
                    &peers,
                    listener,
                    0,
                    &MeshSecret::unset(),
                    30_000,
                )?;
                let other = 1 - rank;
                let (mut p2p, mut a2a, mut ar) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..reps {
                    c.barrier()?;
                    let t = Instant::now();
                    let got = c.send_recv(vec![(other, vec![1.0; floats])], &[other])?;
                    ensure!(got[0].1.len() == floats, "short transfer");
                    p2p.push(t.elapsed().as_secs_f64());
                    c.barrier()?;
                    let mut send = vec![Vec::new(), Vec::new()];
                    send[other] = vec![1.0; floats];
                    let t = Instant::now();
                    let got = c.all_to_all_v(send)?;
                    ensure!(got[other].len() == floats, "short all-to-all");
                    a2a.push(t.elapsed().as_secs_f64());
                    c.barrier()?;
                    let mut buf = vec![1.0f32; floats];
                    let t = Instant::now();
                    c.all_reduce_sum(&[0, 1], &mut buf)?;
                    ar.push(t.elapsed().as_secs_f64());
                }
                Ok((p2p, a2a, ar))
            })
        })
        .collect();
    let mut times = Vec::new();
    for h in handles {
        times.push(
            h.join()
                .map_err(|_| anyhow!("a bandwidth thread panicked"))??,
        );
    }
    // The slower rank's time of each repetition.
    type Times = (Vec<f64>, Vec<f64>, Vec<f64>);
    let slow = |f: fn(&Times) -> &Vec<f64>| -> Vec<f64> {
        (0..reps)
            .map(|i| f(&times[0])[i].max(f(&times[1])[i]))
            .collect()
    };
    // The fastest repetition: other work on the host only ever slows a transfer down.
    let best = |v: Vec<f64>| v.into_iter().fold(f64::INFINITY, f64::min);
    let b = (floats * 4) as f64;
    Ok((
        b / best(slow(|t| &t.0)),
        b / best(slow(|t| &t.1)),
        b / best(slow(|t| &t.2)),
    ))
}

/// Runs the measurements and writes the profile.
pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    let t0 = Instant::now();
    crate::bounds::within("--nodes", a.nodes, 2, 64, "the largest cluster measured")?;
    crate::bounds::within(
        "--steps",
        a.steps,
        4,
        100_000,
        "steps of each measuring job",
    )?;
    let cfg = crate::config::with_model_config(
        load_config(&a.config, None, None)?,
        a.model_config.as_deref(),
    )?;
    if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        ensure!(
            parent.is_dir(),
            "--out {}: the directory {} does not exist",
            a.out.display(),
            parent.display()
        );
    }
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    let (work, temp) = match &a.work_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("lzrun-calibrate-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let result = measure(&a, &cfg, &exe, &work, t0);
    if temp {
        let _ = std::fs::remove_dir_all(&work);
    }
    let text = result?;
    std::fs::write(&a.out, text).with_context(|| format!("writing {}", a.out.display()))?;
    let _ = crate::report::print_line(&format!(
        "profile written to {} ({:.0} s)",
        a.out.display(),
        t0.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn say(line: &str) {
    let _ = crate::report::print_line(line);
}

/// How each number of the profile was measured, by profile key.
type Notes = BTreeMap<&'static str, String>;

/// What the measuring runs gave (see [`measure_runs`]).
struct Measured {
    /// Step-time runs on 1..=N nodes, by node count.
    grid: Vec<(usize, Run)>,
    /// Mean step of one node by batch size, sorted by batch.
    batches: Vec<(usize, f64)>,
    /// Two in-place recoveries and two joins.
    faults: Run,
    /// Kills meant to force a checkpoint restore.
    restore: Run,
    /// Nodes of the fault run.
    fault_nodes: usize,
    ckpt: CheckpointTiming,
    /// Bytes each way of the bandwidth measurements.
    transfer_bytes: usize,
    p2p_bw: f64,
    a2a_bw: f64,
    ar_bw: f64,
}

/// `lzrun local ARGS --config SPEC [--model-config FILE]` in `work/name`.
fn run_named(
    exe: &Path,
    work: &Path,
    name: &str,
    args: &[String],
    (spec, model): (&Path, Option<&Path>),
) -> Result<Run> {
    let mut args = args.to_vec();
    args.extend(["--config".to_string(), spec.display().to_string()]);
    if let Some(m) = model {
        args.extend(["--model-config".to_string(), m.display().to_string()]);
    }
    run_local(exe, &work.join(name), &args)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Runs every measurement: `lzrun local` jobs, then checkpoint I/O and the communicator's
/// bandwidth in this process.
fn measure_runs(a: &CalibrateArgs, cfg: &MoeConfig, exe: &Path, work: &Path) -> Result<Measured> {
    let spec = config_with_batch(work, cfg, cfg.batch)?;
    let model = a.model_config.as_deref();
    let steps = a.steps.to_string();

    // 1. Step times on 1..=N nodes, no faults, a checkpoint every 3 steps (the steps after
    // one are left out of the step time and give the checkpoint's cost).
    let mut grid: Vec<(usize, Run)> = Vec::new();
    for n in 1..=a.nodes {
        let args = strings(&[
            "--nodes",
            &n.to_string(),
            "--steps",
            &steps,
            "--ckpt-every",
            "3",
        ]);
        let run = run_named(exe, work, &format!("nodes{n}"), &args, (&spec, model))?;
        say(&format!(
            "calibrate: {n} node(s): {:.1} ms/step, checkpoint {:.1} ms, start {:.2} s, stop {:.2} s",
            run.mean_step_s() * 1e3,
            run.checkpoint_excess_s().unwrap_or(f64::NAN) * 1e3,
            run.start_s(),
            run.stop_s()
        ));
        grid.push((n, run));
    }

    // 2. Tokens per rank: one node at half and twice the batch.
    let mut batches: Vec<(usize, f64)> = Vec::new();
    for b in [cfg.batch / 2, cfg.batch * 2] {
        if b == 0 || b == cfg.batch {
            continue;
        }
        let path = config_with_batch(work, cfg, b)?;
        let args = strings(&["--nodes", "1", "--steps", &steps, "--ckpt-every", "0"]);
        let run = run_named(exe, work, &format!("batch{b}"), &args, (&path, model))?;
        say(&format!(
            "calibrate: 1 node, batch {b}: {:.1} ms/step",
            run.mean_step_s() * 1e3
        ));
        batches.push((b, run.mean_step_s()));
    }
    batches.push((cfg.batch, grid[0].1.mean_step_s()));
    batches.sort_by_key(|x| x.0);

    // 3. Faults: two in-place recoveries and two joins; then a checkpoint restore.
    let nf = a.nodes.clamp(2, 4);
    let fault_steps = 22u64.max(a.steps);
    let last = format!("{}@4", nf - 1);
    let args = strings(&[
        "--nodes",
        &nf.to_string(),
        "--steps",
        &fault_steps.to_string(),
        "--kill",
        &last,
        "--join",
        "@8",
        "--kill",
        "0@13",
        "--join",
        "@16",
        "--ckpt-every",
        "4",
    ]);
    let faults = run_named(exe, work, "faults", &args, (&spec, model))?;
    let args = strings(&[
        "--nodes",
        "4",
        "--steps",
        "12",
        "--kill",
        "0@6",
        "--kill",
        "1@6",
        "--ckpt-every",
        "4",
    ]);
    let restore = run_named(exe, work, "restore", &args, (&spec, model))?;
    say(&format!(
        "calibrate: fault runs: {} reconfigurations",
        (faults.reconfigs.len() + restore.reconfigs.len()).saturating_sub(2)
    ));

    // 4. In-process: checkpoint I/O and the communicator's bandwidth.
    let ckpt = checkpoint_timing(cfg, &work.join("ckpt"), nf, 5)?;
    let transfer_bytes = (cfg.expert_state_bytes() * 4).max(16 << 20);
    let (p2p_bw, a2a_bw, ar_bw) = comm_bandwidth(transfer_bytes, 5)?;
    Ok(Measured {
        grid,
        batches,
        faults,
        restore,
        fault_nodes: nf,
        ckpt,
        transfer_bytes,
        p2p_bw,
        a2a_bw,
        ar_bw,
    })
}

/// One rank's compute: returns (`gpu_flops_effective`, `step_overhead_s`) from the one-node
/// runs at several batches (see the module docs).
fn fit_compute(cfg: &MoeConfig, m: &Measured, notes: &mut Notes) -> (f64, f64) {
    let tokens = |b: usize| (b * cfg.seq_len) as f64;
    let s1 = m.grid[0].1.mean_step_s();
    let batches = &m.batches;
    let (lo, hi) = (batches[0], batches[batches.len() - 1]);
    let mut slope = if hi.0 > lo.0 {
        (hi.1 - lo.1) / (tokens(hi.0) - tokens(lo.0))
    } else {
        s1 / tokens(cfg.batch)
    };
    let mut overhead = s1 - slope * tokens(cfg.batch);
    if !(overhead >= 0.0 && slope > 0.0) {
        overhead = 0.0;
        slope = s1 / tokens(cfg.batch);
    }
    let fpt = flops_per_token(cfg);
    let flops = fpt / slope;
    let batch_list = batches
        .iter()
        .map(|(b, s)| format!("batch {b}: {:.1} ms", s * 1e3))
        .collect::<Vec<_>>()
        .join(", ");
    let line_list = batches
        .iter()
        .map(|(b, _)| format!("{:.1}", (slope * tokens(*b) + overhead) * 1e3))
        .collect::<Vec<_>>()
        .join(" / ");
    notes.insert(
        "gpu_flops_effective",
        format!(
            "FLOP/s of one rank alone on this host: one-node `lzrun local` runs (no communication),\n\
             mean step time (time between step records, steps after a checkpoint left out): {batch_list} ({} tokens per sequence).\n\
             Cost per token = secant through the smallest and largest batch = {:.4} ms; the\n\
             simulator's training FLOPs per token of this model (dense part + top_k = {} expert\n\
             assignments in each of the {} MoE layers) = {fpt:.0}; {fpt:.0} / {:.4e} s =\n\
             {flops:.4e} FLOP/s.\n\
             The line a·T + b gives {line_list} ms for these batches.",
            cfg.seq_len,
            slope * 1e3,
            cfg.top_k,
            cfg.n_layers,
            slope
        ),
    );
    notes.insert(
        "step_overhead_s",
        format!(
            "Per-step time of one rank besides its FLOPs (optimizer, framework): the one-node run at\n\
             the configured batch {} ({:.1} ms) minus cost per token x {} tokens; clamped at 0\n\
             (then the cost per token is that run's mean over its tokens).",
            cfg.batch,
            s1 * 1e3,
            tokens(cfg.batch)
        ),
    );
    (flops, overhead)
}

/// What every further rank adds to a step: `step_per_peer_s`, fitted on the step-time runs
/// after the shared cores and the bytes-over-bandwidth terms (see the module docs).
fn fit_per_peer(cfg: &MoeConfig, m: &Measured, cores: f64, nodes: usize, notes: &mut Notes) -> f64 {
    let s1 = m.grid[0].1.mean_step_s();
    let share = |n: usize| (n as f64 / cores).max(1.0);
    // The bytes-over-bandwidth terms the simulator adds on its own (approximated for uniform
    // routing): all-to-all of the assignments whose expert the rank does not hold (4 passes
    // per MoE layer, d_model f32 each) and the ring all-reduces of the dense and expert
    // gradients, at the measured bandwidths. Left out of the per-peer fit, so that it is not
    // counted twice.
    let bw_terms = |n: usize| -> f64 {
        if n < 2 {
            return 0.0;
        }
        let slots = crate_slots(cfg.experts, n);
        let held = (slots as f64 / cfg.experts as f64).min(1.0);
        let assignments = (cfg.batch * cfg.seq_len * cfg.top_k) as f64;
        let a2a = cfg.n_layers as f64 * 4.0 * assignments * (1.0 - held) * 4.0 * cfg.d_model as f64
            / m.a2a_bw;
        let ring = 2.0 * (n - 1) as f64 / n as f64;
        let dense = ring * cfg.dense_params() as f64 * 4.0;
        let experts = (cfg.n_layers * slots) as f64 * cfg.expert_params() as f64 * 4.0;
        a2a + (dense + experts) / m.ar_bw.min(m.a2a_bw)
    };
    let (mut num, mut den) = (0.0, 0.0);
    for (n, run) in m.grid.iter().skip(1) {
        let x = (*n - 1) as f64;
        num += (run.mean_step_s() - share(*n) * s1 - bw_terms(*n)) * x;
        den += x * x;
    }
    let per_peer = if den > 0.0 { (num / den).max(0.0) } else { 0.0 };
    let mut fit_rows = String::new();
    for (n, run) in &m.grid {
        let model = share(*n) * s1 + per_peer * (*n - 1) as f64 + bw_terms(*n);
        let ms = run.mean_step_s();
        let _ = writeln!(
            fit_rows,
            "  {n} node(s): measured {:.1} ms, model {:.1} ms ({:+.1} %)",
            ms * 1e3,
            model * 1e3,
            100.0 * (model / ms - 1.0)
        );
    }
    notes.insert(
        "step_per_peer_s",
        format!(
            "What every further rank adds to a step (the collectives' messages, and waiting for\n\
             peers the shared cores delay): least squares through the origin of\n\
             step(N) - max(1, N/host_cores) x step(1) - bandwidth terms against N - 1 (the\n\
             all-to-all and all-reduce bytes over the measured bandwidths, {:.2} ms at {nodes} nodes,\n\
             which the simulator adds itself), `lzrun local` runs of N = 2..{nodes}\n\
             nodes (mean time between step records, steps after a checkpoint left out). The\n\
             fitted step model against the runs:\n{}",
            bw_terms(nodes) * 1e3,
            fit_rows.trim_end()
        ),
    );
    per_peer
}

/// The launcher's start and stop: returns (`job_start_s`, `job_start_per_node_s`,
/// `job_stop_s`), a least-squares line through the start times by node count and the mean
/// stop.
fn fit_launcher(m: &Measured, notes: &mut Notes) -> (f64, f64, f64) {
    let (mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0);
    let k = m.grid.len() as f64;
    for (n, run) in &m.grid {
        let (x, y) = (*n as f64, run.start_s());
        sx += x;
        sy += y;
        sxx += x * x;
        sxy += x * y;
    }
    let mut start_per_node = (k * sxy - sx * sy) / (k * sxx - sx * sx);
    if !start_per_node.is_finite() || start_per_node < 0.0 {
        start_per_node = 0.0;
    }
    let start_base = (sy - start_per_node * sx) / k;
    let start_list = m
        .grid
        .iter()
        .map(|(n, r)| format!("{n}: {:.2}", r.start_s()))
        .collect::<Vec<_>>()
        .join(", ");
    notes.insert(
        "job_start_s",
        format!(
            "`lzrun local` from its launch to the start of step 0 (controller, agents and workers\n\
             started, registered, first plan, mesh, the step-0 checkpoint), taken as the arrival of\n\
             the first step record minus a mean step: per node count {start_list} s;\n\
             least-squares line job_start_s + job_start_per_node_s x N."
        ),
    );
    notes.insert(
        "job_start_per_node_s",
        "Slope of that line (see job_start_s).".into(),
    );
    let stop = mean(m.grid.iter().map(|(_, r)| r.stop_s()));
    notes.insert(
        "job_stop_s",
        format!(
            "`lzrun local` from the last step record to its exit (stop, checksums compared,\n\
             processes reaped, metrics written): mean over the {} step-time runs.",
            m.grid.len()
        ),
    );
    (start_base, start_per_node, stop)
}

/// Failure detection in steps of the membership that failed: returns
/// (`failure_detection_steps`, `failure_detection_steps_later`).
fn fit_detection(m: &Measured, notes: &mut Notes) -> Result<(f64, f64)> {
    // Detection in steps of the membership that failed (its mean step in that run).
    let step_of = |run: &Run, nodes: usize| -> f64 {
        mean(
            step_durations(&run.records, run.ckpt_every)
                .into_iter()
                .zip(&run.records)
                .filter(|((_, after), r)| !after && r.used_nodes == nodes)
                .filter_map(|((d, _), _)| d),
        )
    };
    // Each recovery, the run's first failure or a later one: `lzrun local` sees a job's first
    // failure 2-4 steps after the kill and later ones within about one, whichever rank the
    // killed node held (results/sim-vs-real/README.md), so the two are measured apart.
    let samples: Vec<Detection> = [&m.faults, &m.restore]
        .into_iter()
        .flat_map(|run| {
            run.reconfigs
                .iter()
                .filter(|r| r.kind == KIND_IN_PLACE || r.kind == KIND_CHECKPOINT)
                .enumerate()
                .map(move |(i, r)| Detection {
                    detect_s: r.detect_ms / 1e3,
                    step_s: step_of(run, r.nodes_before),
                    later: i > 0,
                })
        })
        .filter(|d| d.step_s.is_finite() && d.step_s > 0.0)
        .collect();
    ensure!(
        !samples.is_empty(),
        "the fault runs recorded no recovery: cannot measure failure detection"
    );
    let of_kind =
        |later: bool| -> Vec<&Detection> { samples.iter().filter(|d| d.later == later).collect() };
    let (firsts, laters) = (of_kind(false), of_kind(true));
    let mean_steps = |ds: &[&Detection]| mean(ds.iter().map(|d| d.detect_s / d.step_s));
    let list = |ds: &[&Detection]| {
        ds.iter()
            .map(|d| format!("{:.0} ms / {:.0} ms", d.detect_s * 1e3, d.step_s * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // Every run's first recovery is a first failure; a kind without a sample takes the other's.
    let detect_steps = if firsts.is_empty() {
        mean_steps(&laters)
    } else {
        mean_steps(&firsts)
    };
    let detect_steps_later = if laters.is_empty() {
        detect_steps
    } else {
        mean_steps(&laters)
    };
    notes.insert(
        "failure_detection_timeout_s",
        "Detection on this host is measured in steps (failure_detection_steps), not seconds."
            .into(),
    );
    notes.insert(
        "failure_detection_steps",
        format!(
            "From the SIGKILL of a node (right after a step completed) to the new plan, for the job's\n\
             FIRST failure, in steps of the membership that failed: the controller learns of the\n\
             death at once, but the survivors' failure reports come 2-4 steps later (their abort\n\
             and their collectives with the dead rank take effect late the first time; the cores\n\
             are shared with the training steps), so it grows with the step time. Mean over the\n\
             first recovery of each fault run of `detect_ms` / that run's mean step at that\n\
             membership: {}.",
            list(&firsts)
        ),
    );
    notes.insert(
        "failure_detection_steps_later",
        format!(
            "As failure_detection_steps, for the failures after a job's first (within about one\n\
             step in `lzrun local`): {} recoveries, {}.{}",
            laters.len(),
            list(&laters),
            if laters.is_empty() {
                "\nNone: the first failures' value."
            } else {
                ""
            }
        ),
    );
    Ok((detect_steps, detect_steps_later))
}

/// The controller's replan and the mesh rebuild: returns (`replan_s`,
/// `communicator_rebuild_s`).
fn fit_reconfiguration(m: &Measured, notes: &mut Notes) -> (f64, f64) {
    let (faults, restore) = (&m.faults, &m.restore);
    let all: Vec<&RecoveryRecord> = faults
        .reconfigs
        .iter()
        .chain(&restore.reconfigs)
        .filter(|r| r.kind != "start")
        .collect();
    let replan = mean(all.iter().map(|r| r.replan_ms / 1e3));
    notes.insert(
        "replan_s",
        format!(
            "The controller's replan (job machine + planner): mean `replan_ms` of the {} \
             reconfigurations\nof the fault runs.",
            all.len()
        ),
    );
    let meshes: Vec<&RecoveryRecord> = faults
        .reconfigs_of(KIND_IN_PLACE)
        .chain(faults.reconfigs_of(KIND_JOIN))
        .chain(restore.reconfigs_of(KIND_IN_PLACE))
        .collect();
    let rebuild = mean(
        meshes
            .iter()
            .map(|r| (r.migrate_ms / 1e3 - r.bytes as f64 / m.p2p_bw).max(0.0)),
    );
    notes.insert(
        "communicator_rebuild_s",
        format!(
            "Forming a new mesh (rendezvous of every member) after a membership change: mean over\n\
             the {} in-place recoveries and joins of the fault runs of `migrate_ms` (plan to every\n\
             member's Migrated) minus their transferred bytes over\n\
             state_transfer_bandwidth_bytes_per_s ({}).",
            meshes.len(),
            meshes
                .iter()
                .map(|r| format!("{} {:.0} ms, {} B", r.kind, r.migrate_ms, r.bytes))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    );
    (replan, rebuild)
}

/// Checkpoint write and restore: returns (`checkpoint_bandwidth_bytes_per_s`,
/// `process_restart_s`).
fn fit_checkpoint(m: &Measured, rebuild: f64, notes: &mut Notes) -> (f64, f64) {
    let ckpt = &m.ckpt;
    let excesses: Vec<(usize, f64)> = m
        .grid
        .iter()
        .filter_map(|(n, r)| r.checkpoint_excess_s().map(|x| (*n, x)))
        .collect();
    let excess = mean(excesses.iter().map(|x| x.1));
    let (ckpt_s, how) = if excess.is_finite() && excess > 0.0 {
        (excess, "the mean excess above")
    } else {
        (
            ckpt.save_rank0_s,
            "rank 0's write (the excess above is not positive)",
        )
    };
    let ckpt_bw = ckpt.bytes as f64 / ckpt_s;
    notes.insert(
        "checkpoint_bandwidth_bytes_per_s",
        format!(
            "Effective: the full checkpoint's {} bytes over the time the job loses writing it. In\n\
             the step-time runs (a checkpoint every 3 steps) a step right after a checkpoint takes\n\
             longer than the others (the writers write between steps, the others wait in the next\n\
             step's first collective); the mean excess per node count: {} ms.\n\
             Used: {how}, {:.1} ms. Cross-check: a checkpoint of this model written through\n\
             checkpoint::write_part (temporary file, fsync, rename), median of 5: rank 0's parts\n\
             of a {}-node plan (dense state and the experts it is the lowest holder of, {}\n\
             bytes) {:.1} ms, all parts by one writer {:.1} ms.",
            ckpt.bytes,
            excesses
                .iter()
                .map(|(n, x)| format!("{n}: {:.1}", x * 1e3))
                .collect::<Vec<_>>()
                .join(", "),
            ckpt_s * 1e3,
            m.fault_nodes,
            ckpt.rank0_bytes,
            ckpt.save_rank0_s * 1e3,
            ckpt.save_all_s * 1e3,
        ),
    );
    let load_sim = ckpt.bytes as f64 / ckpt_bw;
    let restores: Vec<&RecoveryRecord> = m.restore.reconfigs_of(KIND_CHECKPOINT).collect();
    let (restart, restart_note) = if restores.is_empty() {
        (
            rebuild + (ckpt.load_s - load_sim).max(0.0),
            format!(
                "No restore happened in the restore run (its kills left every expert a replica), so\n\
                 this is communicator_rebuild_s plus the measured checkpoint read ({:.1} ms) minus the\n\
                 read the simulator charges at checkpoint_bandwidth_bytes_per_s ({:.1} ms).",
                ckpt.load_s * 1e3,
                load_sim * 1e3
            ),
        )
    } else {
        let mig = mean(restores.iter().map(|r| r.migrate_ms / 1e3));
        (
            (mig - load_sim).max(0.0),
            format!(
                "`lzrun` restores in place (no process restarts): the survivors form a mesh and read\n\
                 the checkpoint. Mean `migrate_ms` of the {} restore(s) of the restore run ({:.0} ms)\n\
                 minus the checkpoint read the simulator charges at checkpoint_bandwidth_bytes_per_s\n\
                 ({:.1} ms); a read through checkpoint::load_latest measured {:.1} ms.",
                restores.len(),
                mig * 1e3,
                load_sim * 1e3,
                ckpt.load_s * 1e3
            ),
        )
    };
    notes.insert("process_restart_s", restart_note);
    (ckpt_bw, restart)
}

/// A joining node's boot (`node_boot_s`); without a join, the launcher's start of one node.
fn fit_boot(m: &Measured, start_of_one_s: f64, notes: &mut Notes) -> f64 {
    let boots = join_boot_times(&m.faults);
    let boot = if boots.is_empty() {
        start_of_one_s
    } else {
        mean(boots.iter().copied())
    };
    notes.insert(
        "node_boot_s",
        if boots.is_empty() {
            "No join was measured: the launcher's start of one node (job_start_s + \
             job_start_per_node_s)."
                .into()
        } else {
            format!(
                "From starting a joining node's agent to its worker being ready (process starts,\n\
                 registration, model built), while the others train: from the fault run's timeline,\n\
                 the join's record arrival minus its resume, migrate and detect times, minus the\n\
                 launch time of the node: {} s.",
                boots
                    .iter()
                    .map(|b| format!("{b:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        },
    );
    boot.max(0.0)
}

/// The notes of the bandwidths and of the numbers that are facts of `lzrun local`, not fits.
fn note_fixed(m: &Measured, load_before: Option<f64>, notes: &mut Notes) {
    let transfer_bytes = m.transfer_bytes;
    notes.insert(
        "host_cores",
        format!(
            "Cores of this host (available parallelism): every node of `lzrun local` is a process\n\
             here, so with more ranks than cores each rank's compute takes ranks / cores times longer.\n\
             1-minute load average when the calibration started: {}.",
            load_before.map_or("unknown".into(), |l| format!("{l:.2}"))
        ),
    );
    notes.insert(
        "state_transfer_bandwidth_bytes_per_s",
        format!(
            "Expert-state migration: TcpCommunicator::send_recv of {transfer_bytes} bytes each way\n\
             between two ranks in this process over loopback, the fastest of 5 (the slower rank's time)."
        ),
    );
    notes.insert(
        "inter_node_bandwidth_bytes_per_s",
        format!(
            "All-to-all: TcpCommunicator::all_to_all_v of {transfer_bytes} bytes each way between\n\
             two ranks over loopback, the fastest of 5. Every node is on this host, so this is also the\n\
             intra-node bandwidth. The cost model charges the replica groups' gradient all-reduces\n\
             to it too; all_reduce_sum of the same buffer over the two ranks measured {:.3e} B/s\n\
             (ring model).",
            m.ar_bw
        ),
    );
    let fixed = [
        (
            "intra_node_bandwidth_bytes_per_s",
            "As inter_node_bandwidth_bytes_per_s (unused with one rank per node).",
        ),
        (
            "network_efficiency",
            "The bandwidths above are achieved rates already.",
        ),
        (
            "gpus_per_node",
            "One worker process (one rank) per `lzrun` node.",
        ),
        (
            "nic_shared_by_nodes",
            "Nodes do not share a network link in the model (loopback).",
        ),
        (
            "gpu_memory_bytes",
            "Not measured and not used by the cost model: the host's memory (MemTotal).",
        ),
        (
            "name",
            "Profile name (the model of lzrun local on this host).",
        ),
    ];
    for (key, note) in fixed {
        notes.insert(key, note.into());
    }
}

/// Measures everything and returns the profile as commented TOML.
fn measure(
    a: &CalibrateArgs,
    cfg: &MoeConfig,
    exe: &Path,
    work: &Path,
    t0: Instant,
) -> Result<String> {
    let load_before = load_average();
    let cores = cpus() as f64;
    let m = measure_runs(a, cfg, exe, work)?;
    let mut notes = Notes::new();
    let (flops, overhead) = fit_compute(cfg, &m, &mut notes);
    let per_peer = fit_per_peer(cfg, &m, cores, a.nodes, &mut notes);
    let (start_base, start_per_node, stop) = fit_launcher(&m, &mut notes);
    let (detect_steps, detect_steps_later) = fit_detection(&m, &mut notes)?;
    let (replan, rebuild) = fit_reconfiguration(&m, &mut notes);
    let (ckpt_bw, restart) = fit_checkpoint(&m, rebuild, &mut notes);
    let boot = fit_boot(&m, start_base + start_per_node, &mut notes);
    note_fixed(&m, load_before, &mut notes);
    let profile = Profile {
        name: "lzrun-local".into(),
        gpus_per_node: 1,
        nic_shared_by_nodes: 1,
        gpu_flops_effective: flops,
        gpu_memory_bytes: mem_total_bytes().unwrap_or(1 << 30),
        intra_node_bandwidth_bytes_per_s: m.a2a_bw,
        inter_node_bandwidth_bytes_per_s: m.a2a_bw,
        network_efficiency: 1.0,
        checkpoint_bandwidth_bytes_per_s: ckpt_bw,
        failure_detection_timeout_s: 0.0,
        failure_detection_steps: detect_steps,
        failure_detection_steps_later: detect_steps_later,
        communicator_rebuild_s: rebuild,
        process_restart_s: restart,
        node_boot_s: boot,
        host_cores: cores,
        step_overhead_s: overhead,
        step_per_peer_s: per_peer,
        replan_s: replan,
        state_transfer_bandwidth_bytes_per_s: m.p2p_bw,
        job_start_s: start_base.max(0.0),
        job_start_per_node_s: start_per_node,
        job_stop_s: stop.max(0.0),
    };
    let header = format!(
        "Hardware profile of `lzrun local` on this host, measured by `lzrun calibrate` for the model\n\
         below ({} build of lzrun, {:.0} s). Read it with `lzsim predict RUN_DIR --hardware FILE` or\n\
         `lzsim replay --hardware FILE`. Command: lzrun calibrate --nodes {} --config {} --steps {}\n\
         Model: {}\n\
         Load average (1 min) before / after: {} / {}. Other work on this host slows every run\n\
         measured here; calibrate on a quiet host, and predict runs made under the same load.",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        t0.elapsed().as_secs_f64(),
        a.nodes,
        a.config,
        a.steps,
        serde_json::to_string(cfg)?,
        load_before.map_or("?".into(), |l| format!("{l:.2}")),
        load_average().map_or("?".into(), |l| format!("{l:.2}")),
    );
    profile.to_toml(&header, &notes)
}

/// Seconds from a join's launch to its worker being ready, per join of `run` (see the
/// `node_boot_s` note).
fn join_boot_times(run: &Run) -> Vec<f64> {
    let tl = &run.run["timeline"];
    let launches: Vec<f64> = tl["injected"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["kind"] == "join")
        .filter_map(|i| i["t_s"].as_f64())
        .collect();
    let arrivals: Vec<f64> = tl["reconfigurations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["kind"] == KIND_JOIN)
        .filter_map(|i| i["t_s"].as_f64())
        .collect();
    let joins: Vec<&RecoveryRecord> = run.reconfigs_of(KIND_JOIN).collect();
    launches
        .iter()
        .zip(arrivals.iter().zip(joins))
        .map(|(launch, (arrival, r))| {
            arrival - (r.resume_ms + r.migrate_ms + r.replan_ms + r.detect_ms) / 1e3 - launch
        })
        .collect()
}

/// Slots per node `lzrun local` gives `n` nodes (`⌈f·E / n⌉` with the default `f`).
fn crate_slots(experts: usize, n: usize) -> usize {
    lazarus_executor::worker::slots_per_node(experts, n)
}

fn mem_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Profile {
        Profile {
            name: "lzrun-local".into(),
            gpus_per_node: 1,
            nic_shared_by_nodes: 1,
            gpu_flops_effective: 1.234_567_890_123e9,
            gpu_memory_bytes: 8 << 30,
            intra_node_bandwidth_bytes_per_s: 2.5e9,
            inter_node_bandwidth_bytes_per_s: 2.5e9,
            network_efficiency: 1.0,
            checkpoint_bandwidth_bytes_per_s: 1.0 / 3.0 * 1e8,
            failure_detection_timeout_s: 0.123_456_789,
            failure_detection_steps: 2.5,
            failure_detection_steps_later: 1.25,
            communicator_rebuild_s: 0.0,
            process_restart_s: 1e-7,
            node_boot_s: 0.75,
            host_cores: 2.0,
            step_overhead_s: 0.0123,
            step_per_peer_s: 0.035,
            replan_s: 9.0e-5,
            state_transfer_bandwidth_bytes_per_s: 1.5e9,
            job_start_s: 0.3,
            job_start_per_node_s: 0.12,
            job_stop_s: 0.25,
        }
    }

    #[test]
    fn profile_round_trips_through_commented_toml() {
        let p = sample();
        let mut notes = BTreeMap::new();
        notes.insert("gpu_flops_effective", "measured\non two lines".to_string());
        let text = p.to_toml("header\nline two", &notes).unwrap();
        assert!(text.starts_with("# header\n# line two\n"), "{text}");
        assert!(text.contains("# measured\n# on two lines\ngpu_flops_effective = "));
        let back: Profile = toml::from_str(&text).unwrap();
        assert_eq!(back, p);
        // Every field is written once.
        for key in KEYS {
            assert_eq!(
                text.lines()
                    .filter(|l| l.starts_with(&format!("{key} = ")))
                    .count(),
                1,
                "{key}"
            );
        }
    }

    #[test]
    fn non_finite_numbers_are_refused() {
        let p = Profile {
            step_per_peer_s: f64::NAN,
            ..sample()
        };
        let e = p.to_toml("", &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("step_per_peer_s"), "{e}");
    }

    #[test]
    fn flops_per_token_of_the_tiny_model() {
        let c = MoeConfig::tiny();
        // dense matmul params: 2·(4·64² + 64·4) + 256·64 = 49,664; ×6 = 297,984;
        // attention scores 12·2·32·64 = 49,152; experts 2 layers × top-2 × 6·2·64·128 = 393,216.
        assert_eq!(flops_per_token(&c), 297_984.0 + 49_152.0 + 393_216.0);
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
