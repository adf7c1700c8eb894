//! `lzrun export` (an `lzrun` checkpoint as a Hugging Face model directory) and `lzrun logits`
//! (one batch forward: logits and loss), see `lazarus_executor::interop`.

use std::io::Write;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, anyhow, ensure};
use clap::Args;
use lazarus_executor::checkpoint;
use lazarus_executor::interop::{self, DEFAULT_SHARD_MB, WeightsDir};
use lazarus_executor::model::MoeConfig;

use crate::config::load_config;

/// Refuses an `--out` in the checkpoint root (`ckpt`, or the root of the `step-*` directory
/// `ckpt`) or under it: a model directory written there mixes its files with the checkpoints
/// (a `config.json` and weights beside `latest`), and the job's checkpoint pruning and the
/// removal of uncommitted parts own that directory.
fn refuse_out_in_checkpoints(ckpt: &Path, out: &Path) -> Result<()> {
    let ckpt = ckpt
        .canonicalize()
        .with_context(|| format!("{}", ckpt.display()))?;
    let is_step_dir = ckpt
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| checkpoint::parse_step_dir_name(n).is_some());
    let root = match ckpt.parent() {
        Some(parent) if is_step_dir => parent.to_path_buf(),
        _ => ckpt.clone(),
    };
    // `out` need not exist yet: resolved component by component, links where the path
    // exists (as the kernel would), `..` and `.` by name past that.
    let absolute = std::path::absolute(out).with_context(|| format!("{}", out.display()))?;
    let mut resolved = PathBuf::new();
    for c in absolute.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                resolved.pop();
            }
            c => resolved.push(c),
        }
        if let Ok(real) = resolved.canonicalize() {
            resolved = real;
        }
    }
    ensure!(
        !resolved.starts_with(&root),
        "--out {} is inside the checkpoint directory {}: export to a directory of its own",
        out.display(),
        root.display()
    );
    Ok(())
}

/// `lzrun export CKPT_DIR --out DIR`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// An `lzrun` checkpoint: a checkpoint root (its newest valid checkpoint, as --resume reads
    /// it) or one `step-*` directory of it.
    #[arg(value_name = "CKPT_DIR")]
    pub ckpt: PathBuf,
    /// The model directory to write (created; refused if it already holds a config.json or
    /// weights, or lies in the checkpoint directory).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Largest weights file in MiB: a model above it is written as
    /// model-00001-of-0000N.safetensors … with model.safetensors.index.json.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SHARD_MB)]
    pub shard_size_mb: u64,
}

/// `lzrun logits`.
#[derive(Debug, Args)]
pub struct LogitsArgs {
    /// A Hugging Face model directory (config.json + safetensors, what `lzrun export` writes
    /// and --init-from reads).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "ckpt",
        conflicts_with = "ckpt"
    )]
    pub init_from: Option<PathBuf>,
    /// An `lzrun` checkpoint instead (a root or one `step-*` directory).
    #[arg(long, value_name = "DIR")]
    pub ckpt: Option<PathBuf>,
    /// The batch: a JSON array of equal-length arrays of token ids, e.g. [[1, 2, 3], [4, 5,
    /// 6]] (at least 2 tokens each).
    #[arg(long, value_name = "FILE")]
    pub tokens: PathBuf,
    /// Where to write the logits: a NumPy .npy file, little-endian f32, shape [batch, seq,
    /// vocab].
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// Runs `lzrun export`: prints one line saying what was written.
pub fn export(a: ExportArgs) -> Result<()> {
    ensure!(
        a.shard_size_mb >= 1,
        "--shard-size-mb must be at least 1 (got 0)"
    );
    ensure!(
        a.ckpt.is_dir(),
        "{}: no such checkpoint directory",
        a.ckpt.display()
    );
    refuse_out_in_checkpoints(&a.ckpt, &a.out)?;
    let shard_bytes = a.shard_size_mb.saturating_mul(1 << 20);
    let (step, cfg, w) = interop::export_checkpoint(&a.ckpt, &a.out, shard_bytes)
        .map_err(|e| anyhow!("export {}: {e}", a.ckpt.display()))?;
    writeln!(
        std::io::stdout(),
        "exported the {} ({}) to {}: {} tensors, {} bytes in {}",
        lazarus_planner::job::checkpoint_label(step),
        cfg.family().name(),
        a.out.display(),
        w.tensors,
        w.total_bytes,
        w.files.join(", ")
    )?;
    Ok(())
}

/// Runs `lzrun logits`: writes the logits and prints `{"loss": …, "shape": […], …}`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.tokens)
        .with_context(|| format!("reading --tokens {}", a.tokens.display()))?;
    let tokens: Vec<Vec<u32>> = serde_json::from_str(&text).map_err(|e| {
        anyhow!(
            "--tokens {}: not a JSON array of arrays of token ids: {e}",
            a.tokens.display()
        )
    })?;
    let s = tokens.first().map_or(0, Vec::len);
    let (cfg, dense, experts, source) = match (&a.init_from, &a.ckpt) {
        (Some(dir), _) => {
            let base = load_config("tiny", None, None)?;
            let mut cfg = interop::read_config(dir, &base)
                .map_err(|e| anyhow!("--init-from {}: {e}", dir.display()))?;
            if cfg.hf.is_some() {
                // Rotary positions: any length up to max_position_embeddings (validated).
                cfg.seq_len = cfg.seq_len.max(s);
                cfg.validate()
                    .map_err(|e| anyhow!("--init-from {}: {e}", dir.display()))?;
            }
            let weights =
                WeightsDir::open(dir).map_err(|e| anyhow!("--init-from {}: {e}", dir.display()))?;
            let (dense, experts) = interop::import_state(&cfg, &weights)
                .map_err(|e| anyhow!("--init-from {}: {e}", dir.display()))?;
            (cfg, dense, experts, dir.display().to_string())
        }
        (None, Some(dir)) => {
            let loaded = interop::open_checkpoint(dir)
                .map_err(|e| anyhow!("--ckpt {}: {e}", dir.display()))?;
            let (mut cfg, dense, experts) = interop::checkpoint_state(&loaded)
                .map_err(|e| anyhow!("--ckpt {}: {e}", dir.display()))?;
            if cfg.hf.is_some() {
                cfg.seq_len = cfg.seq_len.max(s);
            }
            (cfg, dense, experts, loaded.dir.display().to_string())
        }
        (None, None) => unreachable!("clap requires --init-from or --ckpt"),
    };
    let f = run_forward(&cfg, &dense, &experts, &tokens)?;
    std::fs::write(&a.out, interop::npy_bytes(&f.shape, &f.logits))
        .with_context(|| format!("writing --out {}", a.out.display()))?;
    let line = serde_json::json!({
        "loss": f.loss,
        "shape": f.shape,
        "family": cfg.family().name(),
        "source": source,
        "out": a.out.display().to_string(),
    });
    writeln!(std::io::stdout(), "{line}")?;
    Ok(())
}

fn run_forward(
    cfg: &MoeConfig,
    dense: &lazarus_executor::model::OptimState,
    experts: &[lazarus_executor::model::ExpertState],
    tokens: &[Vec<u32>],
) -> Result<interop::Forward> {
    interop::forward(cfg, dense, experts, tokens).map_err(|e| anyhow!("{e}"))
}
