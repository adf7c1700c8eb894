//! Model configurations: a built-in name, or a TOML file (`base` + overrides), optionally with
//! the model itself from a Hugging Face `config.json` (`--model-config`).

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail, ensure};
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
