//! `lzrun worker`: one training process, managed by an agent or started by hand.

use std::io::{self, BufRead, Write};
use std::sync::mpsc;
use std::thread;

use anyhow::{Result, bail, ensure};
use lazarus_executor::worker::{
    AbortSlot, Command as WorkerCommand, WorkerOptions, run_managed_worker, run_worker,
};

use crate::args::WorkerArgs;
use crate::config::load_config;

/// Trains as a managed worker (commands on stdin) or as one rank of a fixed cluster.
pub fn worker(a: WorkerArgs) -> Result<()> {
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
