//! `lzrun worker`: one training process, managed by an agent or started by hand.

use std::io::{self, BufRead, Write};
use std::sync::mpsc;
use std::thread;

use anyhow::{Result, anyhow, bail, ensure};
use lazarus_executor::worker::{
    AbortSlot, Command as WorkerCommand, EvalFail, FlipBit, StepDelay, TestHooks, WorkerOptions,
    run_managed_worker, run_worker,
};

use crate::args::WorkerArgs;
use crate::config::load_model;

/// One whole line on stdout (from any thread: lines never interleave).
fn emit(line: &str) -> Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// `VAR=NODE:N` of a test hook, if set: node NODE and a number (`example` shows the form).
fn node_and_number_from_env(var: &str, example: &str) -> Result<Option<(u32, u64)>> {
    let Some(v) = std::env::var_os(var) else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    let parsed = v
        .split_once(':')
        .and_then(|(n, x)| Some((n.trim().parse().ok()?, x.trim().parse().ok()?)));
    parsed
        .map(Some)
        .ok_or_else(|| anyhow!("{var}={v:?}: expected {example}"))
}

/// The test hook `LZRUN_TEST_STEP_DELAY=NODE:MS` ([`StepDelay`]): node NODE's worker sleeps MS
/// at the start of every step, heartbeating all along (a slow device).
fn step_delay_from_env() -> Result<Option<StepDelay>> {
    let hook = node_and_number_from_env("LZRUN_TEST_STEP_DELAY", "NODE:MS, e.g. 1:3000")?;
    Ok(hook.map(|(node, ms)| StepDelay { node, ms }))
}

/// The test failpoint `LZRUN_TEST_FLIP_BIT=NODE:STEP` ([`FlipBit`]): node NODE's worker flips
/// one bit of one replica or shard copy after step STEP's update.
fn flip_bit_from_env() -> Result<Option<FlipBit>> {
    let hook = node_and_number_from_env("LZRUN_TEST_FLIP_BIT", "NODE:STEP, e.g. 1:7")?;
    Ok(hook.map(|(node, step)| FlipBit { node, step }))
}

/// The test failpoint `LZRUN_TEST_EVAL_FAIL=NODE:STEP` ([`EvalFail`]): node NODE's worker fails
/// the held-out evaluation after step STEP's update, once.
fn eval_fail_from_env() -> Result<Option<EvalFail>> {
    let hook = node_and_number_from_env("LZRUN_TEST_EVAL_FAIL", "NODE:STEP, e.g. 1:3")?;
    Ok(hook.map(|(node, step)| EvalFail { node, step }))
}

/// Trains as a managed worker (commands on stdin) or as one rank of a fixed cluster.
pub fn worker(a: WorkerArgs) -> Result<()> {
    let choice = a.device.choice()?.with_ordinal_from_env()?;
    choice.preflight()?;
    lazarus_executor::device::set_process_choice(choice);
    if a.managed {
        let hooks = TestHooks {
            delay: step_delay_from_env()?,
            flip_bit: flip_bit_from_env()?,
            eval_fail: eval_fail_from_env()?,
        };
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
        run_managed_worker(&rx, &abort, emit, hooks)?;
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
    let config = load_model(&a.model)?;
    let slots = lazarus_executor::worker::slots_per_node(config.experts, world);
    crate::config::check_fits_memory(&config, slots * config.n_layers, &choice)?;
    let opts = WorkerOptions {
        rank,
        peers: a.peers,
        config,
        steps: a.model.steps,
        epoch: a.epoch,
        timeout_ms: a.timeout_ms,
        out: a.out,
    };
    run_worker(&opts, |line| emit(&serde_json::to_string(line)?))?;
    Ok(())
}
