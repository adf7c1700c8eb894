//! `lzrun`: elastic MoE training on worker processes.
//!
//! `lzrun local` runs a controller and one agent process per node on this machine (like
//! `torchrun --standalone`); `lzrun controller` and `lzrun agent` run the same pieces across
//! machines; `lzrun worker` is one training process (started by an agent, or by hand for a
//! fixed cluster). `lzrun prepare` tokenizes text into a dataset to train on, `lzrun tokenizer`
//! trains a small tokenizer for it. See `--help`.

mod agent;
mod args;
mod bounds;
mod calibrate;
mod config;
mod controller;
mod drive;
mod export;
mod job;
mod local;
mod nodes;
mod prepare;
mod report;
mod runinfo;
mod worker;

use std::io::Write;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::args::{AgentArgs, ControllerArgs, LocalArgs, WorkerArgs};

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
#[command(
    name = "lzrun",
    version,
    arg_required_else_help = true,
    after_help = "Environment: LAZARUS_MALLOC_TUNING=0 keeps glibc's allocator defaults. By \
                  default lzrun raises glibc's mmap and trim thresholds so that a training \
                  step reuses the memory of the large tensors it freed instead of mapping fresh \
                  zero pages (fewer page faults, a higher resident set between steps; any \
                  MALLOC_*_ or GLIBC_TUNABLES setting of your own is left as it is)."
)]
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
    /// reconfiguration prints its detect / replan / migrate / resume times. `--kill-controller
    /// @STEP` kills the controller instead; `lzrun local` restarts it from its saved job state
    /// (as it does after any controller crash) and training goes on in place. Ctrl-C, SIGTERM or
    /// SIGHUP stops every process and keeps the committed checkpoints; so does a reader of the
    /// output that stops early (`lzrun local | head`), with exit status 0. A step whose loss or
    /// gradient is NaN or infinite on any worker applies no update on any worker (see
    /// --max-nonfinite-steps); a checkpoint that cannot be written is logged and training goes
    /// on (see --max-ckpt-failures). Exit status 2 on bad input, a failed job or an output that
    /// cannot be written.
    Local(LocalArgs),
    /// The controller of a multi-machine job: waits for `--nodes` agents, then trains.
    ///
    /// Agents must present the shared token (`--token` or the LZRUN_TOKEN environment
    /// variable). Listens on loopback unless `--listen` says otherwise. Checkpoints must be on a
    /// file system every node sees. With `--state-dir DIR` it saves the job state there at
    /// every change; if it dies (kill -9, a crash), `lzrun controller --recover DIR` (same
    /// token) takes the job back: agents keep their workers training for their
    /// --reconnect-grace-ms and reconnect, and training resumes in place when every node comes
    /// back consistent (otherwise the usual failure path: replan on the survivors or restore).
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
    /// Measure this machine for the simulator: write a hardware profile for `lzsim --hardware`.
    ///
    /// Runs short `lzrun local` jobs of this executable — step times on 1..=N nodes and at
    /// half and twice the batch on one node, a run with a kill and a join, a run whose kills
    /// force a checkpoint restore — writes and reads a full checkpoint through the checkpoint
    /// module and moves buffers through the TCP communicator, then fits the cost model's
    /// constants (compute FLOP/s, per-step and per-peer step costs on this host's cores,
    /// bandwidths, failure detection, replan, mesh build, node start, restore, the launcher's
    /// start and stop) and writes them as TOML, each with a comment saying how it was
    /// measured. About a minute for the tiny model on 6 nodes; other work on the machine
    /// slows what it measures. Use the profile with `lzsim predict RUN_DIR --hardware FILE`.
    Calibrate(calibrate::CalibrateArgs),
    /// Tokenize text files into a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx).
    ///
    /// Inputs: `.txt` files (each file one document) and `.jsonl` files (one document per
    /// line, its "text" string). Each document becomes one sequence (and one document of the
    /// index): its tokens followed by the end-of-document token (--eod-token; by default the
    /// first of <|endoftext|>, </s>, <eos>, <|eos|> the tokenizer has). Tokens are uint16 when
    /// the tokenizer's vocabulary is at most 65,536, else int32. `--tokenizer bytes` is the
    /// built-in byte tokenizer of the tiny model: one uint16 token per UTF-8 byte, vocabulary
    /// 256 and no end-of-document token (every id is a byte; an extra id would not fit the tiny
    /// model's vocabulary), documents still delimited in the index. The files are written
    /// under .tmp names and renamed at the end: a failed prepare leaves an existing dataset
    /// under PREFIX as it was. Prints one summary line (documents, tokens, bytes, tokens/s); a
    /// progress bar on stderr when it is a terminal. Exit status 2 with one line naming the
    /// file (and line) on bad input: a missing or unreadable file, an unreadable tokenizer, a
    /// .jsonl line without a "text" string, inputs with no tokens, a missing output directory.
    Prepare(prepare::PrepareArgs),
    /// Train a small byte-level BPE tokenizer.json (for `lzrun prepare --tokenizer`).
    ///
    /// GPT-2 style: byte-level pre-tokenizer and decoder, no normalizer, the 256 byte tokens,
    /// then merges learned from the inputs up to --vocab tokens; <|endoftext|> is id 0 and a
    /// special token (the end-of-document token `lzrun prepare` picks by default). Any text
    /// decodes back exactly. Needs no download: e.g. train on the embedded corpus,
    /// `lzrun tokenizer --vocab 512 --input executor/data/corpus.txt --out tokenizer.json`.
    /// Exit status 2 with one line on bad input.
    Tokenizer(prepare::TokenizerArgs),
    // Hugging Face interop (issue 32).
    /// Write an `lzrun` checkpoint as a Hugging Face model directory: config.json + safetensors.
    ///
    /// Reads CKPT_DIR (a checkpoint root: its newest valid checkpoint, as --resume reads it; or
    /// one `step-*` directory) and writes the family's own config.json (as it was read, with
    /// torch_dtype "float32") and its weights in the family's tensor names and layouts
    /// (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): model.safetensors, or above
    /// --shard-size-mb the shards model-00001-of-0000N.safetensors … and
    /// model.safetensors.index.json, as `transformers` writes them. Every expert is read from the checkpoint's part (an FSEP job gathers its
    /// shards before writing it). The export loads with
    /// `AutoModelForCausalLM.from_pretrained(DIR)` and with `lzrun local --init-from DIR`.
    /// The paper's GPT family has no `transformers` class: it is exported in a lazarus naming
    /// (`model_type` "lazarus_gpt_moe", see executor/README.md) that only --init-from reads.
    /// Exit status 2 with one line on a missing or damaged checkpoint or an --out that already
    /// holds a model.
    Export(export::ExportArgs),
    /// One batch forward on this process (CPU, f32, no training): logits and loss.
    ///
    /// Reads the model from --init-from DIR (a Hugging Face model directory) or --ckpt DIR (an
    /// `lzrun` checkpoint), runs the batch of --tokens (JSON: equal-length arrays of token
    /// ids), writes the logits to --out as a .npy file (little-endian f32, [batch, seq, vocab])
    /// and prints one JSON line: the mean next-token cross-entropy ("loss": position t's logits
    /// predict token t+1, the `transformers` loss with labels = input ids), the shape, the
    /// family. Exit status 2 with one line on bad input.
    Logits(export::LogitsArgs),
}

/// A clap error as one line, details included: clap lists what the first line announces (the
/// missing arguments, the possible values, a tip) on the lines after it, then the usage, which
/// `--help` shows better. Only the first line used to be kept: "the following required
/// arguments were not provided:" named none of them.
fn one_line(rendered: &str) -> String {
    let mut lines = rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:"))
        .map(str::trim)
        // An invalid value has no usage after it, only the hint `help_hint` gives better.
        .filter(|l| !l.is_empty() && !l.starts_with("For more information"));
    let first = lines.next().unwrap_or("");
    let first = first.strip_prefix("error:").unwrap_or(first).trim();
    let details: Vec<&str> = lines.collect();
    match (details.is_empty(), first.ends_with(':')) {
        (true, _) => first.to_owned(),
        (false, true) => format!("{first} {}", details.join(", ")),
        (false, false) => format!("{first}; {}", details.join("; ")),
    }
}

/// A missing `--token` also names the environment variable that gives it: clap asked for the
/// flag alone.
fn name_token_env(msg: &str) -> String {
    msg.replace(
        "--token <TOKEN>",
        "--token <TOKEN> (or the LZRUN_TOKEN environment variable)",
    )
}

/// The options `lzrun controller --recover DIR` takes: the job's come from DIR.
const RECOVER_OPTIONS: [&str; 7] = [
    "recover",
    "listen",
    "token",
    "format",
    "metrics_out",
    "out",
    "peak_tflops",
];

/// `lzrun controller --recover DIR` with a job option on the command line (`--steps 50`):
/// refused, as it would have no effect (the job's options are the saved job's).
fn recover_takes_no_job_options(matches: &ArgMatches) -> anyhow::Result<()> {
    let Some(("controller", m)) = matches.subcommand() else {
        return Ok(());
    };
    if m.value_source("recover") != Some(ValueSource::CommandLine) {
        return Ok(());
    }
    let cmd = Cli::command();
    let args = cmd
        .find_subcommand("controller")
        .map(|c| c.get_arguments().cloned().collect::<Vec<_>>())
        .unwrap_or_default();
    let given = args.iter().find(|a| {
        let id = a.get_id().as_str();
        !RECOVER_OPTIONS.contains(&id) && m.value_source(id) == Some(ValueSource::CommandLine)
    });
    match given {
        Some(a) => anyhow::bail!(
            "--{} cannot be given with --recover: the job's options are the ones saved in its \
             state directory (with --recover: --listen, --token, --format, --metrics-out, --out \
             and --peak-tflops)",
            a.get_long().unwrap_or(a.get_id().as_str())
        ),
        None => Ok(()),
    }
}

/// `lzrun SUBCOMMAND --help` when the command line names one, else `lzrun --help`.
fn help_hint() -> String {
    let sub = std::env::args().nth(1);
    match sub.as_deref() {
        Some(
            s @ ("local" | "controller" | "agent" | "worker" | "prepare" | "tokenizer" | "export"
            | "logits"),
        ) => {
            format!("lzrun {s} --help")
        }
        _ => "lzrun --help".to_owned(),
    }
}

fn main() -> ExitCode {
    // Under a file-size limit (`ulimit -f`) a write past it raises SIGXFSZ, whose default
    // action kills the process: a worker writing a checkpoint part died, its node was lost and
    // the cascade left the job waiting. Ignored (and inherited by the agents and workers this
    // process starts), the write fails with EFBIG instead: a failed checkpoint, not a dead node.
    // SAFETY: setting a signal's disposition to SIG_IGN before any thread exists.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // Large freed tensors stay in the heap for the next step instead of coming back as fresh
    // zero pages (`LAZARUS_MALLOC_TUNING=0` turns it off; measured in results/executor/).
    lazarus_executor::malloc::tune();
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
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
                kind => {
                    let mut msg = one_line(&e.to_string());
                    if kind == ErrorKind::MissingRequiredArgument {
                        msg = name_token_env(&msg);
                    }
                    let _ = writeln!(std::io::stderr(), "error: {msg} (see `{}`)", help_hint());
                    ExitCode::from(2)
                }
            };
        }
    };
    // Every numeric flag within its bounds before anything starts (see `bounds`).
    let res = match cli.cmd {
        Cmd::Local(a) => bounds::check_local(&a).and_then(|()| local::local(a)),
        Cmd::Controller(a) => recover_takes_no_job_options(&matches)
            .and_then(|()| bounds::check_controller(&a))
            .and_then(|()| controller::controller(a)),
        Cmd::Agent(a) => bounds::check_agent(&a).and_then(|()| agent::agent(a)),
        Cmd::Worker(a) => bounds::check_worker(&a).and_then(|()| worker::worker(a)),
        Cmd::Calibrate(a) => calibrate::calibrate(a),
        Cmd::Prepare(a) => prepare::prepare(a),
        Cmd::Tokenizer(a) => prepare::tokenizer(a),
        Cmd::Export(a) => export::export(a),
        Cmd::Logits(a) => export::logits(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout stopped early (`| head`): it has what it wanted.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<report::StdoutError>()
                    .is_some_and(report::StdoutError::is_broken_pipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            // A failed write to stderr leaves no one to tell.
            let _ = writeln!(std::io::stderr(), "error: {msg}");
            ExitCode::from(2)
        }
    }
}
