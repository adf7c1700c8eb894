//! Seeded swarm test of the job's control plane (a deterministic simulation tester in the style
//! of FoundationDB's simulator / TigerBeetle's VOPR): a simulated cluster of nodes (agent +
//! worker) and a simulated network drive the real [`lazarus_planner::job::JobMachine`]; faults
//! come from one seeded RNG, so a seed replays exactly. The simulated cluster lives under
//! `swarm/`, one module per concern: `sim.rs` (nodes, network, the driver performing the
//! machine's actions), `model.rs` (the simulated training state), `mode.rs` (the modes),
//! `faults.rs` (the fault schedule and the driver's crash), `switch.rs` (layout switches) and
//! `oracle.rs` (the checks).
//!
//! * `cargo test -p lazarus-planner --test swarm` runs [`DEFAULT_SEEDS`] seeds of every mode;
//! * `LAZARUS_SWARM_SEEDS=n` runs `n` seeds of every mode, in parallel, and prints seeds/s;
//!   `LAZARUS_SWARM_MODE=sharded,laer` only those modes;
//! * `LAZARUS_SWARM_MODE=laer LAZARUS_SWARM_SEED=1234` replays one seed and prints its trace;
//! * `LAZARUS_SWARM_FINAL_STATE=0` turns the final-state oracle off (it is on by default);
//! * the long run, [`LONG_SEEDS`] seeds of every mode (100,000 in all), is `#[ignore]`d:
//!   `cargo test --release -p lazarus-planner --test swarm -- --ignored --nocapture`; its
//!   measured result is in `results/swarm/README.md`.
//!
//! # Modes (each with its own seeds: the RNG stream of seed `s` differs per mode)
//! * `base`: replicated experts (`f = 2`), blocking migration, a node per host;
//! * `failover`: the job of any mode (drawn per seed), whose driver crashes 1-3 times: the
//!   machine is serialised (serde JSON), dropped,
//!   deserialised and `recover`ed; commands it had not sent are lost (half of those in
//!   flight), the agents keep their reports and, once it is back, send `Reattached` (what
//!   their worker holds) and then the reports it has not seen, in order; a frozen agent never
//!   comes back; `Resend`s are performed;
//! * `sharded`: sharded experts with 2-3 copies of every shard (a shard is a hash chain of its
//!   own, per cut), repaired in place from the surviving copies or restored from a checkpoint
//!   that is resharded only when it holds every shard of its cut;
//! * `laer`: LAER re-layout every 4-10 steps from skewed routing: sharded experts (1-3 copies)
//!   switch layouts without a pause (`SwitchLayout`), replicated experts pause and
//!   reconfigure;
//! * `async`: replicated experts with `ReplicaMigration::Async` (Lazarus's or LAER's layout):
//!   the members copy the replicas the switch names in the background (each member's copies
//!   take 10-400 ms) and switch once every copy arrived;
//! * `hosts`: hosts of 2-3 GPUs (a node each, `Joined` with `host`); a fault kills a GPU or a
//!   whole host; joins and rejoins are whole hosts; 30% of the seeds ask for async migration
//!   (which host-aware placement keeps blocking);
//! * `deadline`: a step deadline (floor 300 ms, ceiling 4 s), workers heartbeat
//!   (`WorkerAlive`), members become 3-8x slow, half the frozen workers are hung (their
//!   heartbeat thread goes on);
//! * `nonfinite`: runs of non-finite steps (skipped on every member), now and then as long as
//!   `max_nonfinite_steps`.
//!
//! Every mode also has the faults of the first swarm: nodes killed (one, several at once, one
//! during the next reconfiguration), joins and rejoins under an old name, frozen workers and
//! agents, workers that never become ready, failing checkpoint commits, late, reordered (per
//! node in order) and duplicated reports.
//!
//! # Checks, after every event the machine handles
//! The machine's `check_invariants()`, and the test's own oracle, from what the simulated nodes
//! really hold:
//! * while the members train or take a plan in, every expert has a replica (every shard a
//!   copy) on a live member;
//! * epochs and plan versions strictly increase over `Reconfigure`s; `Record`s of an epoch are
//!   consecutive from its resume step, an in-place replan resumes exactly at the first
//!   uncounted step (nothing counted twice or skipped) and never before the resume step of
//!   its lineage; a restore resumes at a committed checkpoint no newer than the newest;
//! * an in-place plan (a repair) only keeps or sends replicas, shards and the dense state that
//!   their holders really have at the resume step;
//! * every counted step was trained by every member of its epoch, each on the layout the
//!   machine counts it on (a switch never splits the members), and each holds the correct
//!   dense state, replicas and shards after it (hash chains compared with the canonical
//!   ones: a member of another lineage, a half-restored one or one at another step holds other
//!   values, so two lineages are never mixed); a full step covers every expert (shard);
//! * a host fails whole: no member outlives a sibling GPU the machine dropped;
//! * slow is not dead: with worker heartbeats, a member fenced as stuck is hung or frozen
//!   (or blocked in a collective by one that is);
//! * `Finished(Ok)` only after every step was counted; `Finished(Err)` only when no checkpoint
//!   could be restored, or after `max_nonfinite_steps` non-finite steps in a row;
//! * the final-state rule at `Finished(Ok)`: every member sent the checksums of the final
//!   step's state, together the members hold the dense state and every expert (shard), and,
//!   when a checkpoint is due at `total_steps`, it was committed;
//! * liveness: once faults stop, within `SETTLE_MS` of simulated time the job has finished or
//!   waits for nodes with too few healthy ones.
//!
//! # Measured
//! On the shared 2-core machine under other engineers' builds (load average 9-17): the default
//! run (300 seeds of each mode, 2,400 seeds) takes 8-23 s of test time in the dev profile
//! (105-300 seeds/s; a mode alone 0.7-1.4 s at load 9); the long run (100,000 seeds) took
//! 382.6 s in release (261 seeds/s, 195-419 per mode) at load 16-17, with no failure but the
//! final-state oracle's 3,588 seeds (`results/swarm/README.md`).
//!
//! Planted bugs the first swarm caught (then reverted), over the default 300 seeds of `base`:
//! 1. `has_state` set when a member is sent an in-place plan rather than on its `Migrated` (a
//!    newcomer whose join was cut short trains on its own initialisation);
//! 2. member-timeout fencing disabled in `tick` (a hung worker stalls the job).
//!
//! Planted bugs the modes catch (planted in `job.rs` behind an environment variable, one
//! build, then reverted), over the default 300 seeds of the mode named:
//! 3. `laer`, `async`: a layout switch taken in force from its `from_step` whatever the
//!    members report: 89 (`laer`) and 184 (`async`) seeds, "node 3 trained it on layout v3,
//!    the machine counts it on v4";
//! 4. `async`: the switch sent without its replica transfers: 169 seeds, "node 0's replica of
//!    expert 5 of layer 0 is wrong";
//! 5. `sharded`: the repair planned without its shard copies: 71 seeds, "rank 0 (node 1) gets
//!    shard 2 from rank 0, which does not hold it";
//! 6. `failover`: `recover` not asking again for the checkpoint the crashed driver was
//!    looking for: 7 of 3,000 seeds (349, 1061, 1456, 2216, ...; a crash must fall between
//!    `FindCheckpoint` and its answer), "stalled: Restoring";
//! 7. `hosts`: a lost node's host siblings not fenced: 203 seeds, "member 0 outlived node 1
//!    of its host";
//! 8. `deadline`: a heartbeating member waited for only the step deadline, not at least
//!    `member_timeout_ms`: 153 seeds, "node 6 (healthy, 1x slow) fenced as stuck";
//! 9. `nonfinite`: the run of non-finite steps never reset by a finite one: 148 seeds, "the
//!    job failed: training diverged".
//!
//! Real bugs it found in `job.rs` (each now a test in `tests/job.rs`; seeds of the simulator
//! version that found them): a node lost while stopping stayed a member (seed 255) and stayed
//! awaited by a pending reconfiguration (seed 2588); a restore that lost nodes while looking
//! for its checkpoint failed the job instead of waiting (seed 67); a step every survivor
//! reported was never counted when the holdout was lost (seed 207); a duplicated
//! `CheckpointWritten` committed a checkpoint again (seed 44); a hung worker that never
//! answered `Stop` stalled the job (seed 274); an in-place replan resumed past a step a
//! stateless member never reported (seed 18499).
//!
//! Every mode (12,500 seeds each in the long run) found nothing new in `job.rs` but the
//! final-state rule, which `main` is adding to it: on this branch 82 of the default 2,400 seeds
//! fail its oracle (survivors hold only part of the experts after a member was lost while
//! stopping; every member lost while stopping; no checkpoint of the final step committed).
//! Observed, not changed: a hung worker blocks its peers in the collective, and at the
//! deadline the machine fences every member still awaited, the healthy ones with it (about
//! half of all stuck-fences, `Stats::fenced_collateral`); real workers whose collectives have
//! their own deadline report a failure first. The modes' first versions found bugs of the
//! simulation only (fixed there): a peer that had not taken a plan in still "sent" replicas,
//! an agent that never reattached still delivered reports, reports in flight overtook the
//! ones an agent kept while the driver was down, a host's sibling dropped before the machine
//! heard of the other GPU counted as outlived.
//!
//! The simulated network keeps each node's reports in order (one connection per node; the
//! machine relies on a member's `Stepped` arriving before its `Idle`), delays them differently
//! per node, and duplicates some (a copy arrives later, after newer reports).

#[path = "swarm/sim.rs"]
mod sim;

use std::time::Instant;

use rayon::prelude::*;
use sim::{Failure, Mode, Stats, run_seed};

/// Seeds per mode of the default run.
const DEFAULT_SEEDS: u64 = 300;
/// Seeds per mode of the long run (`--ignored`): 112,500 over the 9 modes.
const LONG_SEEDS: u64 = 12_500;

fn final_state_on() -> bool {
    std::env::var("LAZARUS_SWARM_FINAL_STATE").map_or(true, |v| v != "0")
}

/// The modes to run: all, or those named in `LAZARUS_SWARM_MODE` (comma-separated).
fn modes() -> Vec<Mode> {
    match std::env::var("LAZARUS_SWARM_MODE") {
        Ok(names) => names
            .split(',')
            .map(|n| Mode::parse(n.trim()).unwrap_or_else(|| panic!("no swarm mode {n:?}")))
            .collect(),
        Err(_) => Mode::ALL.to_vec(),
    }
}

fn replay_line(mode: Mode, seed: u64) -> String {
    format!(
        "LAZARUS_SWARM_MODE={} LAZARUS_SWARM_SEED={seed} cargo test -p lazarus-planner --test \
         swarm -- --nocapture",
        mode.name()
    )
}

fn report(mode: Mode, seed: u64, f: &Failure) -> String {
    format!(
        "swarm {} seed {seed} failed at t={} ms: {}\n  replay: {}\n  trace tail:\n{}",
        mode.name(),
        f.at_ms,
        f.why,
        replay_line(mode, seed),
        f.trace
    )
}

struct ModeRun {
    mode: Mode,
    seeds: u64,
    secs: f64,
    failures: Vec<(u64, Failure)>,
    total: Stats,
}

fn run_mode(mode: Mode, seeds: u64, final_state: bool) -> ModeRun {
    let t0 = Instant::now();
    let results: Vec<(u64, Result<Stats, Failure>)> = (0..seeds)
        .into_par_iter()
        .map(|seed| (seed, run_seed(mode, seed, final_state)))
        .collect();
    let secs = t0.elapsed().as_secs_f64();
    let mut total = Stats::default();
    let mut failures = Vec::new();
    for (seed, r) in results {
        match r {
            Ok(s) => total.add(&s),
            Err(f) => failures.push((seed, f)),
        }
    }
    ModeRun {
        mode,
        seeds,
        secs,
        failures,
        total,
    }
}

/// The schedule must really exercise what the checks of each mode are about, or a passing
/// run proves little.
fn check_mix(run: &ModeRun) {
    let (t, seeds, name) = (&run.total, run.seeds, run.mode.name());
    if seeds < 100 {
        return;
    }
    let mut want: Vec<(&str, bool)> = vec![
        ("most seeds finish", t.finished_ok > seeds / 2),
        ("in-place recovery", t.in_place > 0),
        ("checkpoint restore", t.restores > 0),
        ("scale-out", t.joins > 0),
        ("too few nodes", t.waited_for_nodes > 0),
        ("ended waiting for nodes", t.ended_waiting > 0),
        ("stuck member fenced", t.fenced_stuck > 0),
    ];
    match run.mode {
        Mode::Base => want.push(("a member rolled back", t.rolled_back > 0)),
        Mode::Failover => {
            want.push(("driver restarts", t.restarts > seeds / 2));
            want.push(("nodes reattached", t.reattached > 0));
            want.push(("a lost command resent", t.resent > 0));
            want.push(("a recovery in place", t.recovered_in_place > 0));
        }
        Mode::Sharded => want.push(("a shard repair", t.shard_repairs > 0)),
        Mode::Laer => {
            want.push(("a layout switch in force", t.switches_done > 0));
            want.push(("a switch sent", t.switches_sent > 0));
        }
        Mode::AsyncMigration => {
            want.push(("a layout switch in force", t.switches_done > 0));
            want.push(("replicas copied in the background", t.async_copies > 0));
        }
        Mode::Hosts => want.push(("a host fenced whole", t.fenced_host > 0)),
        Mode::Deadline => {
            want.push(("slow members", t.slow_members > 0));
            want.push(("a member logged slow, not gone", t.slow_logged > 0));
            want.push(("a silent worker fenced", t.fenced_silent > 0));
        }
        Mode::Repair => {
            want.push(("a repair in place", t.repairs > 0));
            want.push(("a repair that copied replicas", t.repair_copies > 0));
            want.push(("a rebalance (the re-optimisation)", t.rebalances > 0));
        }
        Mode::Nonfinite => {
            want.push(("non-finite steps counted", t.nonfinite_counted > 0));
            want.push(("a diverged job", t.diverged > 0));
        }
    }
    let missing: Vec<&str> = want.iter().filter(|(_, ok)| !ok).map(|(w, _)| *w).collect();
    assert!(missing.is_empty(), "swarm {name}: never {missing:?}: {t:?}");
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Runs `seeds` seeds of every mode; panics on failures (listing them, and the first's
/// trace), final-state failures last.
fn swarm_run(seeds: u64) {
    let final_state = final_state_on();
    let t0 = Instant::now();
    let runs: Vec<ModeRun> = modes()
        .into_iter()
        .map(|m| run_mode(m, seeds, final_state))
        .collect();
    let secs = t0.elapsed().as_secs_f64();
    let mut lines = Vec::new();
    let mut final_lines = Vec::new();
    let mut first = None;
    let mut first_final = None;
    for r in &runs {
        println!(
            "swarm {:<9} {} seeds in {:.2} s ({:.0} seeds/s), {} failed; {:?}",
            r.mode.name(),
            r.seeds,
            r.secs,
            r.seeds as f64 / r.secs,
            r.failures.len(),
            r.total
        );
        for (seed, f) in &r.failures {
            let line = format!("  {} seed {seed}: {}", r.mode.name(), f.why);
            if f.final_state {
                final_lines.push(line);
                first_final.get_or_insert_with(|| report(r.mode, *seed, f));
            } else {
                lines.push(line);
                first.get_or_insert_with(|| report(r.mode, *seed, f));
            }
        }
    }
    let n = seeds * runs.len() as u64;
    println!(
        "swarm: {n} seeds in {secs:.2} s ({:.0} seeds/s), {} failed, {} on the final-state \
         oracle only; load average {}",
        n as f64 / secs,
        lines.len(),
        final_lines.len(),
        load()
    );
    if let Some(first) = first {
        let shown: Vec<&String> = lines.iter().take(40).collect();
        panic!(
            "{} of {n} seeds failed:\n{}\n{first}",
            lines.len(),
            shown
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    for r in &runs {
        check_mix(r);
    }
    if let Some(first) = first_final {
        let shown: Vec<&str> = final_lines.iter().take(200).map(String::as_str).collect();
        let per_mode: Vec<String> = runs
            .iter()
            .map(|r| {
                let seeds: Vec<String> = r
                    .failures
                    .iter()
                    .filter(|(_, f)| f.final_state)
                    .map(|(s, _)| s.to_string())
                    .collect();
                format!("  {}: {}", r.mode.name(), seeds.join(" "))
            })
            .collect();
        panic!(
            "{} of {n} seeds failed the final-state oracle (LAZARUS_SWARM_FINAL_STATE=0 turns \
             it off):\n{}\nall of them:\n{}\n{first}",
            final_lines.len(),
            shown.join("\n"),
            per_mode.join("\n")
        );
    }
}

#[test]
fn swarm() {
    if let Ok(seed) = std::env::var("LAZARUS_SWARM_SEED") {
        let seed: u64 = seed.parse().expect("LAZARUS_SWARM_SEED is a number");
        for mode in modes() {
            match run_seed(mode, seed, final_state_on()) {
                Ok(s) => println!("{} seed {seed} passed: {s:?}", mode.name()),
                Err(f) => panic!("{}", report(mode, seed, &f)),
            }
        }
        return;
    }
    let seeds: u64 = std::env::var("LAZARUS_SWARM_SEEDS")
        .map(|s| s.parse().expect("LAZARUS_SWARM_SEEDS is a number"))
        .unwrap_or(DEFAULT_SEEDS);
    swarm_run(seeds);
}

/// The long run: `LONG_SEEDS` seeds of every mode (100,000 in all). Run it in release:
/// `cargo test --release -p lazarus-planner --test swarm -- --ignored --nocapture`.
#[test]
#[ignore]
fn swarm_long() {
    swarm_run(LONG_SEEDS);
}
