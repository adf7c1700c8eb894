//! Model configurations: a built-in name, or a TOML file (`base` + overrides), optionally with
//! the model itself from a Hugging Face `config.json` (`--model-config`).

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail, ensure};
use lazarus_executor::device::{DeviceChoice, DeviceKind};
use lazarus_executor::model::{MoeConfig, Precision};
use lazarus_executor::worker::{CONFIG_NAMES, config_by_name};

use crate::args::ModelArgs;

/// The model of the command line: `--model-config config.json` with `--config`'s training
/// knobs, or `--config` alone.
pub fn load_model(a: &ModelArgs) -> Result<MoeConfig> {
    let base = load_config(&a.config, a.seed, a.precision)?;
    with_model_config(base, a.model_config.as_deref())
}

/// `base`, or the model of the Hugging Face `config.json` at `path` with `base`'s training
/// knobs.
pub fn with_model_config(base: MoeConfig, path: Option<&Path>) -> Result<MoeConfig> {
    let Some(path) = path else {
        return Ok(base);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --model-config {}", path.display()))?;
    let cfg = MoeConfig::from_hf_config_json(&text)
        .map_err(|e| anyhow!("--model-config {}: {e}", path.display()))?
        .with_training_of(&base);
    cfg.validate()
        .map_err(|e| anyhow!("--model-config {}: {e}", path.display()))?;
    Ok(cfg)
}

/// A model configuration by name, or from a TOML file (`base` + overrides), with the command
/// line's seed and precision when given.
pub fn load_config(
    spec: &str,
    seed: Option<u64>,
    precision: Option<Precision>,
) -> Result<MoeConfig> {
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
    if let Some(p) = precision {
        cfg.precision = p;
    }
    cfg.validate()
        .map_err(|e| anyhow!("model config {spec}: {e}"))?;
    Ok(cfg)
}

/// Refuses a model whose training state cannot fit one CPU worker of this machine: the dense
/// weights with their two AdamW moments (f32) and `experts_held` expert replicas each, against
/// the machine's physical memory. Each size may pass [`MoeConfig::validate`] while their
/// product does not (a 2^31 vocabulary of width 2^16 is 2^47 embedding weights): the worker
/// aborted on the allocation. A CUDA worker keeps its state on the GPU: not checked here.
pub fn check_fits_memory(
    cfg: &MoeConfig,
    experts_held: usize,
    device: &DeviceChoice,
) -> Result<()> {
    if device.device != DeviceKind::Cpu {
        return Ok(());
    }
    // SAFETY: sysconf(3) reads system constants; no memory is shared.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let (Ok(pages), Ok(page)) = (u64::try_from(pages), u64::try_from(page)) else {
        return Ok(());
    };
    let memory = pages.saturating_mul(page);
    // Within `SizeLimits` these products fit in a u64; saturating anyway, as a guard.
    let dense = (cfg.dense_params() as u64).saturating_mul(12);
    let experts = (cfg.expert_state_bytes() as u64).saturating_mul(experts_held as u64);
    let need = dense.saturating_add(experts);
    ensure!(
        need <= memory,
        "the model needs {:.1} GiB of training state per worker (weights and AdamW moments in \
         f32: {} dense parameters, {experts_held} expert replicas of {} parameters), more than \
         this machine's {:.1} GiB of memory",
        need as f64 / GIB,
        cfg.dense_params(),
        cfg.expert_params(),
        memory as f64 / GIB
    );
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;
