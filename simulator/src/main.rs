//! `lzsim`: the Lazarus-rs simulator's command line. Every decision comes from the
//! `lazarus-planner` crate; this binary only reads inputs, calls the planner and prints.

use clap::{Parser, Subcommand};
use lazarus_simulator::{
    failures_cmd, plan_cmd, predict_cmd, reconfig_cmd, recovery_cmd, relayout_cmd, replay_cmd,
    sweep_cmd,
};
use std::io::Write;
use std::process::ExitCode;

/// Resilient MoE training, simulated: replica plans and recovery probabilities
/// (Lazarus, arXiv 2407.04656).
#[derive(Parser)]
#[command(name = "lzsim", version, about, long_about = None)]
#[command(after_help = "Examples:\n  \
    lzsim plan --nodes 10 --slots 6 --experts 8 --loads 1,1,1,1,2,4,10,20\n  \
    lzsim plan --experts 16 --layers 12 --zipf 1.2 --format json\n  \
    lzsim recovery --place mro,spread,compact --failed 0..6 --plot recovery.png\n  \
    lzsim recovery --nodes 32 --slots 8 --experts 64 --failed 0..8 --method mc --trials 200000\n\n\
    Exit status: 0 on success, also when the reader of the output stops early (`lzsim plan | \
    head`); 2 on any error (bad arguments or input, an output that cannot be written).")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Allocate replicas and place them: print the node×slot grid per layer.
    Plan(plan_cmd::PlanArgs),
    /// Probability that the survivors of k simultaneous failures still hold every expert.
    Recovery(recovery_cmd::RecoveryArgs),
    /// Replay a node trace: simulate MoE training with Lazarus and its baselines (ds-ft, ds,
    /// dropless, laer, lazarus-fsep) and compare.
    Replay(Box<replay_cmd::ReplayArgs>),
    /// Write a synthetic failure trace (Bamboo CSV) for replay here and in lzrun.
    Failures(failures_cmd::FailuresArgs),
    /// Many stochastic traces x systems in parallel; one CSV row per run.
    Sweep(Box<sweep_cmd::SweepArgs>),
    /// Cost of one Lazarus reconfiguration after k simultaneous failures (paper Table 2).
    Reconfig(Box<reconfig_cmd::ReconfigArgs>),
    /// Replay a routing trace through re-layout policies (static, lazarus, eplb, flexmoe, laer).
    Relayout(Box<relayout_cmd::RelayoutArgs>),
    /// Predict a recorded `lzrun local` run with a calibrated profile: measured vs predicted.
    ///
    /// Reads RUN_DIR (`lzrun local --metrics-out RUN_DIR`), replays the same fault schedule
    /// through the lazarus system (the job state machine lzrun drives; an `--expert-mode fsep`
    /// run through laer, or lazarus-fsep with `--shard-copies` 2 or more) with the hardware
    /// profile `lzrun calibrate` measured, and prints measured and predicted wall time, steps,
    /// samples, recoveries, fallbacks (checkpoint restores), joins, rebalances and the time
    /// breakdown (compute, checkpoint, reconfigure, restore, lost, idle) with relative errors.
    /// Example: lzrun calibrate --out hw.toml; lzrun local --nodes 4 --kill 2@5 --metrics-out
    /// run; lzsim predict run --hardware hw.toml --format json
    Predict(Box<predict_cmd::PredictArgs>),
}

/// A clap error as one line (the project's rule for bad input): the first line with the
/// details clap lists under it (missing arguments, possible values, a similar flag), without
/// the usage and the `--help` hint that follow, nor the tip to pass an unknown flag as a
/// value, which misleads for a flag this subcommand does not take.
fn one_line(rendered: &str) -> String {
    let mut lines = rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:"))
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("For more information") && !l.contains("as a value")
        });
    let first = lines.next().unwrap_or("");
    let first = first.strip_prefix("error:").unwrap_or(first).trim();
    let details: Vec<&str> = lines.collect();
    match (details.is_empty(), first.ends_with(':')) {
        (true, _) => first.to_owned(),
        (false, true) => format!("{first} {}", details.join(", ")),
        (false, false) => format!("{first}; {}", details.join("; ")),
    }
}

/// `lzsim SUBCOMMAND --help` when the command line names one, else `lzsim --help`.
fn help_hint() -> String {
    use clap::CommandFactory;
    let sub = std::env::args().nth(1).unwrap_or_default();
    if Cli::command()
        .get_subcommands()
        .any(|c| c.get_name() == sub)
    {
        format!("lzsim {sub} --help")
    } else {
        "lzsim --help".to_owned()
    }
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
                    let msg = one_line(&e.to_string());
                    let _ = writeln!(std::io::stderr(), "error: {msg} (see `{}`)", help_hint());
                    ExitCode::from(2)
                }
            };
        }
    };
    let result = match cli.command {
        Command::Plan(a) => plan_cmd::run(&a),
        Command::Recovery(a) => recovery_cmd::run(&a),
        Command::Replay(a) => replay_cmd::run(&a),
        Command::Failures(a) => failures_cmd::run(&a),
        Command::Sweep(a) => sweep_cmd::run(&a),
        Command::Reconfig(a) => reconfig_cmd::run(&a),
        Command::Relayout(a) => relayout_cmd::run(&a),
        Command::Predict(a) => predict_cmd::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader stopped early (`| head`): it has what it wanted.
        Err(e) if lazarus_simulator::stdout::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming the problem; exit code 2 like clap's own usage errors. Ignoring a
            // failed write: with stderr gone too there is no one left to tell.
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::from(2)
        }
    }
}
