//! Hugging Face interop (issue 32, parts 2–3): `lzrun` model state ⇄ a Hugging Face model
//! directory (`config.json` + safetensors weights).
//!
//! * [`export_checkpoint`] (`lzrun export`) reads an `lzrun` checkpoint (a root, as
//!   `--resume` takes, or one `step-*` directory) and writes `config.json` plus
//!   `model.safetensors`, or above the shard size `model-00001-of-0000N.safetensors` … and
//!   `model.safetensors.index.json` (`{"metadata": {"total_size": …}, "weight_map": {…}}`,
//!   the `transformers` format). Checkpoints always hold whole experts (an FSEP job gathers
//!   every expert's shards before it writes its part), so each expert is read from its one
//!   part.
//! * [`init_checkpoint`] (`--init-from DIR`) reads such a directory and writes it as an `lzrun`
//!   checkpoint of step 0 (AdamW moments zero, every optimizer at step 0): the job then starts
//!   from it by the restore path every job already has, which builds every expert replica or
//!   FSEP shard from it.
//! * [`forward`] (`lzrun logits`) runs one batch forward on one process and returns the logits
//!   and the mean next-token cross-entropy.
//!
//! # Names and layouts
//!
//! A Hugging Face family (`MixtralForCausalLM`, `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`,
//! `DeepseekV3ForCausalLM`): the dense variables (DeepSeek's routing bias
//! `e_score_correction_bias` among them) already carry their Hugging Face names and layouts,
//! and are written as they are.
//! A routed expert's `w1 [d, 2·ff]` is split and transposed into the gate (`w1` for Mixtral,
//! `gate_proj` otherwise, `[ff, d]`) and up (`w3` / `up_proj`, `[ff, d]`) projections, its
//! `w2 [ff, d]` transposed into the down projection (`w2` / `down_proj`, `[d, ff]`), named by
//! `HfModel::expert_tensor_names`.
//!
//! The GPT family (the paper's model, no `transformers` class) is exported in a documented
//! lazarus naming that only `lzrun` reads back: `config.json` is
//! `{"architectures": ["LazarusGptMoe"], "model_type": "lazarus_gpt_moe", "torch_dtype":
//! "float32", "lazarus_config": <the MoeConfig>}`, the dense variables keep their executor
//! names and layouts (`wte [vocab, d]`, `wpe`, `h.{l}.ln1.weight`, `h.{l}.attn.qkv.weight [d,
//! 3d]` (`x·W`), …, `ln_f.bias`), and expert `(l, e)` is `h.{l}.experts.{e}.w1 [d, ff]` and
//! `h.{l}.experts.{e}.w2 [ff, d]`.
//!
//! # What is read
//!
//! F32 tensors as they are; BF16 and F16 tensors widened to f32 (exactly: both are subsets of
//! f32); any other dtype is refused. Every tensor the model has must be present with its exact
//! shape, and every tensor present must be one the model has (an extra tensor means a model
//! this executor would not compute, e.g. the MLP of a dense layer). A NaN or an
//! infinity is refused (a checkpoint never holds one). Each refusal is one
//! [`InteropError`] naming the tensor, field or file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{Value, json};

use crate::checkpoint::{self, CheckpointError, Loaded, Manifest};
use crate::model::{
    ConfigError, DenseModel, ExpertState, ExpertStore, LocalExperts, MoeConfig, OptimState,
    ParamState, RoutingStats,
};

/// The single weights file of an unsharded export.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded export.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The Hugging Face configuration.
pub const CONFIG_FILE: &str = "config.json";
/// `model_type` of an exported GPT-family model (no `transformers` class reads it).
pub const GPT_MODEL_TYPE: &str = "lazarus_gpt_moe";
/// `architectures[0]` of an exported GPT-family model.
pub const GPT_ARCHITECTURE: &str = "LazarusGptMoe";
/// Default largest shard, in MiB (the `transformers` default `max_shard_size` is 5 GB).
pub const DEFAULT_SHARD_MB: u64 = 4096;

/// Why an export, an import or a forward failed. Every variant names the tensor, field or file.
#[derive(Debug, thiserror::Error)]
pub enum InteropError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Config { path: PathBuf, source: ConfigError },
    #[error("{}: {reason}", path.display())]
    ConfigJson { path: PathBuf, reason: String },
    #[error("{} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("{}: {reason}", path.display())]
    Index { path: PathBuf, reason: String },
    #[error("{}: names the file {file}, which does not exist", index.display())]
    MissingFile { index: PathBuf, file: String },
    #[error("{}: not a valid safetensors file (truncated or damaged): {reason}", path.display())]
    BadFile { path: PathBuf, reason: String },
    #[error("tensor {name}: missing from {}", dir.display())]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor {name} in {}: not a parameter of this {family} model", path.display())]
    UnexpectedTensor {
        name: String,
        path: PathBuf,
        family: String,
    },
    #[error("tensor {name} in {}: shape {found:?}, the model's is {expected:?}", path.display())]
    Shape {
        name: String,
        path: PathBuf,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "tensor {name} in {}: dtype {dtype}, only F32, BF16 and F16 are read",
        path.display()
    )]
    Dtype {
        name: String,
        path: PathBuf,
        dtype: String,
    },
    #[error("tensor {name} in {}: value {index} is {value}, not a finite number", path.display())]
    NonFinite {
        name: String,
        path: PathBuf,
        index: usize,
        value: f32,
    },
    #[error(
        "{} already holds a model ({}): export into a new or empty directory",
        dir.display(),
        file
    )]
    OutNotEmpty { dir: PathBuf, file: String },
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    #[error("{0}")]
    Model(String),
}

fn io<T>(op: &'static str, path: &Path, r: std::io::Result<T>) -> Result<T, InteropError> {
    r.map_err(|source| InteropError::Io {
        op,
        path: path.to_path_buf(),
        source,
    })
}

fn model_err(e: candle_core::Error) -> InteropError {
    InteropError::Model(e.to_string())
}

/// One tensor of an export: name, shape, row-major f32 values.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

// ---------------------------------------------------------------------------------------
// config.json

/// The `config.json` of an export: the family's Hugging Face configuration as it was read
/// (`hf.config_json`) with `torch_dtype` (and `dtype` where present) `"float32"` and
/// `architectures` set, or the lazarus GPT description.
pub fn config_json(cfg: &MoeConfig) -> Value {
    match &cfg.hf {
        Some(hf) => {
            let mut v = hf.config_json.clone();
            if let Value::Object(m) = &mut v {
                m.insert("architectures".into(), json!([hf.family.name()]));
                m.insert("torch_dtype".into(), json!("float32"));
                // transformers 5 names it `dtype` (and prefers it): the same value, or a
                // `save_pretrained` config of a bf16 model would load the f32 export as bf16.
                if m.contains_key("dtype") {
                    m.insert("dtype".into(), json!("float32"));
                }
            }
            v
        }
        None => json!({
            "architectures": [GPT_ARCHITECTURE],
            "model_type": GPT_MODEL_TYPE,
            "torch_dtype": "float32",
            "lazarus_config": cfg,
        }),
    }
}

/// The model of `dir/config.json`, with the training knobs of `base` (`seq_len`, `batch`,
/// `lr`, `adam_beta2`, `grad_clip_norm`, `seed`, `precision`). A lazarus GPT export keeps its
/// own `seq_len` (the position embeddings' length is part of its shape) and takes the others
/// from `base`.
pub fn read_config(dir: &Path, base: &MoeConfig) -> Result<MoeConfig, InteropError> {
    let path = dir.join(CONFIG_FILE);
    let text = io("reading", &path, fs::read_to_string(&path))?;
    let bad = |reason: String| InteropError::ConfigJson {
        path: path.clone(),
        reason,
    };
    let value: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if value.get("model_type").and_then(Value::as_str) == Some(GPT_MODEL_TYPE) {
        let stored = value
            .get("lazarus_config")
            .ok_or_else(|| bad("lazarus_config: missing".into()))?;
        let stored: MoeConfig = serde_json::from_value(stored.clone())
            .map_err(|e| bad(format!("lazarus_config: {e}")))?;
        let cfg = MoeConfig {
            seq_len: stored.seq_len,
            ..stored.with_training_of(base)
        };
        cfg.validate()
            .map_err(|source| InteropError::Config { path, source })?;
        return Ok(cfg);
    }
    let cfg = MoeConfig::from_hf_config_json(&text)
        .map_err(|source| InteropError::Config {
            path: path.clone(),
            source,
        })?
        .with_training_of(base);
    cfg.validate()
        .map_err(|source| InteropError::Config { path, source })?;
    Ok(cfg)
}

// ---------------------------------------------------------------------------------------
// State ⇄ tensors

/// The tensors of expert `(layer, expert)` in the export's names and layouts (module docs).
fn expert_tensors(cfg: &MoeConfig, s: &ExpertState) -> Vec<NamedTensor> {
    let (d, ff) = (cfg.d_model, cfg.d_ff);
    match &cfg.hf {
        None => {
            let p = format!("h.{}.experts.{}", s.layer, s.expert);
            vec![
                NamedTensor {
                    name: format!("{p}.w1"),
                    shape: vec![d, ff],
                    values: s.w1.clone(),
                },
                NamedTensor {
                    name: format!("{p}.w2"),
                    shape: vec![ff, d],
                    values: s.w2.clone(),
                },
            ]
        }
        Some(hf) => {
            let [gate, up, down] = hf.expert_tensor_names(s.layer, s.expert);
            let cols = 2 * ff;
            // w1 [d, 2ff] row-major: gate[f, r] = w1[r, f], up[f, r] = w1[r, ff + f].
            let mut g = vec![0.0f32; ff * d];
            let mut u = vec![0.0f32; ff * d];
            for r in 0..d {
                for f in 0..ff {
                    g[f * d + r] = s.w1[r * cols + f];
                    u[f * d + r] = s.w1[r * cols + ff + f];
                }
            }
            // w2 [ff, d]: down[r, f] = w2[f, r].
            let mut dn = vec![0.0f32; d * ff];
            for f in 0..ff {
                for r in 0..d {
                    dn[r * ff + f] = s.w2[f * d + r];
                }
            }
            vec![
                NamedTensor {
                    name: gate,
                    shape: vec![ff, d],
                    values: g,
                },
                NamedTensor {
                    name: up,
                    shape: vec![ff, d],
                    values: u,
                },
                NamedTensor {
                    name: down,
                    shape: vec![d, ff],
                    values: dn,
                },
            ]
        }
    }
}

/// Every tensor of the model (dense variables in their canonical order, then the experts in
/// `(layer, expert)` order) in the export's names and layouts.
pub fn export_tensors(
    cfg: &MoeConfig,
    dense: &OptimState,
    experts: &[ExpertState],
) -> Vec<NamedTensor> {
    let mut out: Vec<NamedTensor> = dense
        .params
        .iter()
        .map(|p| NamedTensor {
            name: p.name.clone(),
            shape: p.shape.clone(),
            values: p.value.clone(),
        })
        .collect();
    for s in experts {
        out.extend(expert_tensors(cfg, s));
    }
    out
}

/// The names and shapes of the dense variables of `cfg`'s model, in canonical order.
pub fn dense_layout(cfg: &MoeConfig) -> Result<Vec<(String, Vec<usize>)>, InteropError> {
    let model = DenseModel::new(cfg, &Device::Cpu).map_err(model_err)?;
    Ok(model
        .named_vars()
        .iter()
        .map(|(n, v)| (n.clone(), v.dims().to_vec()))
        .collect())
}

/// Reads the model's whole state from `src` (moments zero, step 0): the dense optimizer state
/// and every expert in `(layer, expert)` order. Refuses a missing, misshapen, unreadable or
/// extra tensor.
pub fn import_state(
    cfg: &MoeConfig,
    src: &WeightsDir,
) -> Result<(OptimState, Vec<ExpertState>), InteropError> {
    let mut used = BTreeSet::new();
    let mut params = Vec::new();
    for (name, shape) in dense_layout(cfg)? {
        let value = src.read_f32(&name, &shape)?;
        let n = value.len();
        used.insert(name.clone());
        params.push(ParamState {
            name,
            shape,
            value,
            m: vec![0.0; n],
            v: vec![0.0; n],
        });
    }
    let (d, ff) = (cfg.d_model, cfg.d_ff);
    let mut experts = Vec::with_capacity(cfg.n_layers * cfg.experts);
    for layer in 0..cfg.n_layers {
        for expert in 0..cfg.experts {
            let (w1, w2) = match &cfg.hf {
                None => {
                    let p = format!("h.{layer}.experts.{expert}");
                    let w1 = src.read_f32(&format!("{p}.w1"), &[d, ff])?;
                    let w2 = src.read_f32(&format!("{p}.w2"), &[ff, d])?;
                    used.insert(format!("{p}.w1"));
                    used.insert(format!("{p}.w2"));
                    (w1, w2)
                }
                Some(hf) => {
                    let [gate, up, down] = hf.expert_tensor_names(layer, expert);
                    let g = src.read_f32(&gate, &[ff, d])?;
                    let u = src.read_f32(&up, &[ff, d])?;
                    let dn = src.read_f32(&down, &[d, ff])?;
                    let cols = 2 * ff;
                    let mut w1 = vec![0.0f32; d * cols];
                    for f in 0..ff {
                        for r in 0..d {
                            w1[r * cols + f] = g[f * d + r];
                            w1[r * cols + ff + f] = u[f * d + r];
                        }
                    }
                    let mut w2 = vec![0.0f32; ff * d];
                    for r in 0..d {
                        for f in 0..ff {
                            w2[f * d + r] = dn[r * ff + f];
                        }
                    }
                    used.extend([gate, up, down]);
                    (w1, w2)
                }
            };
            let (n1, n2) = (w1.len(), w2.len());
            experts.push(ExpertState {
                layer,
                expert,
                d_model: d,
                d_ff: ff,
                w1,
                w2,
                m1: vec![0.0; n1],
                v1: vec![0.0; n1],
                m2: vec![0.0; n2],
                v2: vec![0.0; n2],
                step: 0,
            });
        }
    }
    if let Some((name, path)) = src.tensors.iter().find_map(|(name, (file, _))| {
        (!used.contains(name)).then(|| (name.clone(), src.files[*file].path.clone()))
    }) {
        return Err(InteropError::UnexpectedTensor {
            name,
            path,
            family: cfg.family().name().to_owned(),
        });
    }
    Ok((OptimState { step: 0, params }, experts))
}

// ---------------------------------------------------------------------------------------
// Reading safetensors

struct WeightsFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Offset of the data section (8 + header length).
    data_start: usize,
}

/// Where one tensor lies: file index, dtype, shape, byte range within the data section.
type TensorInfo = (usize, (Dtype, Vec<usize>, (usize, usize)));

/// The weights of a Hugging Face model directory (one file or sharded with an index), checked
/// at [`WeightsDir::open`] (every file exists, is complete and names the tensors the index
/// gives it) and read tensor by tensor.
pub struct WeightsDir {
    dir: PathBuf,
    files: Vec<WeightsFile>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for WeightsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightsDir")
            .field("dir", &self.dir)
            .field("files", &self.files.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn open_file(path: &Path) -> Result<WeightsFile, InteropError> {
    let f = io("opening", path, fs::File::open(path))?;
    // SAFETY: the file is only read; a file changed underneath while it is mapped is the
    // caller's to avoid, as for the datasets `lzrun` maps.
    let map = io("mapping", path, unsafe { memmap2::Mmap::map(&f) })?;
    // Checks the header and that the data section holds every tensor's bytes (a truncated
    // file fails here).
    let bad = |e: safetensors::SafeTensorError| InteropError::BadFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    SafeTensors::deserialize(&map).map_err(bad)?;
    let (header, _) = SafeTensors::read_metadata(&map).map_err(bad)?;
    Ok(WeightsFile {
        path: path.to_path_buf(),
        map,
        data_start: 8 + header,
    })
}

impl WeightsDir {
    /// Opens `dir/model.safetensors.index.json` and its shards, else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, InteropError> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(WEIGHTS_FILE);
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        if index.is_file() {
            let text = io("reading", &index, fs::read_to_string(&index))?;
            let bad = |reason: String| InteropError::Index {
                path: index.clone(),
                reason,
            };
            let v: Value =
                serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("weight_map: missing or not an object".into()))?;
            let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| bad(format!("weight_map: {name}: not a file name")))?;
                // A shard lies in the directory itself: no paths out of it.
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    return Err(bad(format!(
                        "weight_map: {name}: {file:?} is not a plain file name"
                    )));
                }
                by_file
                    .entry(file.to_owned())
                    .or_default()
                    .push(name.clone());
            }
            for (file, names) in by_file {
                let path = dir.join(&file);
                if !path.is_file() {
                    return Err(InteropError::MissingFile {
                        index: index.clone(),
                        file,
                    });
                }
                let wf = open_file(&path)?;
                let (_, meta) =
                    SafeTensors::read_metadata(&wf.map).map_err(|e| InteropError::BadFile {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                let idx = files.len();
                for name in names {
                    let info = meta.info(&name).ok_or_else(|| InteropError::Index {
                        path: index.clone(),
                        reason: format!("weight_map: {name}: not in {file}"),
                    })?;
                    tensors.insert(
                        name,
                        (idx, (info.dtype, info.shape.clone(), info.data_offsets)),
                    );
                }
                files.push(wf);
            }
        } else if single.is_file() {
            let wf = open_file(&single)?;
            let (_, meta) =
                SafeTensors::read_metadata(&wf.map).map_err(|e| InteropError::BadFile {
                    path: single.clone(),
                    reason: e.to_string(),
                })?;
            for (name, info) in meta.tensors() {
                tensors.insert(
                    name,
                    (0, (info.dtype, info.shape.clone(), info.data_offsets)),
                );
            }
            files.push(wf);
        } else {
            return Err(InteropError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
        })
    }

    /// Names of every tensor, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|(_, (_, s, _))| s.as_slice())
    }

    /// The file holding tensor `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.tensors
            .get(name)
            .map(|(f, _)| self.files[*f].path.as_path())
    }

    /// Tensor `name` as f32, checked to have shape `expected` and finite values.
    pub fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, InteropError> {
        let (file, (dtype, shape, (begin, end))) =
            self.tensors
                .get(name)
                .ok_or_else(|| InteropError::MissingTensor {
                    name: name.to_owned(),
                    dir: self.dir.clone(),
                })?;
        let wf = &self.files[*file];
        if shape.as_slice() != expected {
            return Err(InteropError::Shape {
                name: name.to_owned(),
                path: wf.path.clone(),
                found: shape.clone(),
                expected: expected.to_vec(),
            });
        }
        let bytes = &wf.map[wf.data_start + begin..wf.data_start + end];
        let values: Vec<f32> = match dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            // bf16 is the upper half of an f32.
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            Dtype::F16 => {
                Tensor::from_raw_buffer(bytes, DType::F16, &[bytes.len() / 2], &Device::Cpu)
                    .and_then(|t| t.to_dtype(DType::F32))
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(model_err)?
            }
            other => {
                return Err(InteropError::Dtype {
                    name: name.to_owned(),
                    path: wf.path.clone(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(InteropError::NonFinite {
                name: name.to_owned(),
                path: wf.path.clone(),
                index,
                value: values[index],
            });
        }
        Ok(values)
    }
}

// ---------------------------------------------------------------------------------------
// Writing safetensors

/// Writes `bytes` to `dir/name` through a temporary file and a rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), InteropError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    {
        let mut f = io("creating", &tmp, fs::File::create(&tmp))?;
        io("writing", &tmp, f.write_all(bytes))?;
        io("syncing", &tmp, f.sync_all())?;
    }
    io("renaming", &path, fs::rename(&tmp, &path))
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One safetensors file of `tensors` (metadata `{"format": "pt"}`, which `transformers`
/// requires).
fn serialize(tensors: &[&NamedTensor]) -> Result<Vec<u8>, InteropError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| le_bytes(&t.values)).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(Dtype::F32, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| InteropError::Model(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::tensor::serialize(views, Some(meta))
        .map_err(|e| InteropError::Model(format!("serializing safetensors: {e}")))
}

/// What [`write_model_dir`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The weights files, in order.
    pub files: Vec<String>,
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_bytes: u64,
}

/// Writes `config` and `tensors` into `out` (created; refused if it already holds a
/// `config.json` or weights): one `model.safetensors` when the data fits in `shard_bytes`,
/// else shards of at most `shard_bytes` each (a larger tensor gets a shard of its own) and the
/// index. Files go through temporary names; `config.json` is written last, so a directory with
/// it is complete.
pub fn write_model_dir(
    out: &Path,
    config: &Value,
    tensors: &[NamedTensor],
    shard_bytes: u64,
) -> Result<Written, InteropError> {
    io("creating", out, fs::create_dir_all(out))?;
    for file in [CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE] {
        if out.join(file).exists() {
            return Err(InteropError::OutNotEmpty {
                dir: out.to_path_buf(),
                file: file.to_owned(),
            });
        }
    }
    let size = |t: &NamedTensor| 4 * t.values.len() as u64;
    let total_bytes: u64 = tensors.iter().map(size).sum();
    let mut shards: Vec<Vec<&NamedTensor>> = vec![Vec::new()];
    let mut current = 0u64;
    for t in tensors {
        let last = shards.last_mut().expect("one shard at least");
        if !last.is_empty() && current + size(t) > shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        shards.last_mut().expect("pushed").push(t);
        current += size(t);
    }
    let mut files = Vec::new();
    if shards.len() == 1 {
        write_atomic(out, WEIGHTS_FILE, &serialize(&shards[0])?)?;
        files.push(WEIGHTS_FILE.to_owned());
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            write_atomic(out, &name, &serialize(shard)?)?;
            for t in shard {
                weight_map.insert(t.name.clone(), json!(name));
            }
            files.push(name);
        }
        let index = json!({
            "metadata": {"total_size": total_bytes},
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).expect("JSON values serialize");
        write_atomic(out, INDEX_FILE, text.as_bytes())?;
    }
    let text = serde_json::to_string_pretty(config).expect("JSON values serialize");
    write_atomic(out, CONFIG_FILE, format!("{text}\n").as_bytes())?;
    Ok(Written {
        files,
        tensors: tensors.len(),
        total_bytes,
    })
}

// ---------------------------------------------------------------------------------------
// lzrun checkpoints

/// A verified `lzrun` checkpoint: `path` is a checkpoint root (its newest valid checkpoint,
/// as `--resume` reads it) or one committed `step-*` directory (its parts are checked against
/// its manifest as they are read).
pub fn open_checkpoint(path: &Path) -> Result<Loaded, InteropError> {
    let manifest_path = path.join(checkpoint::MANIFEST);
    if manifest_path.is_file() {
        let text = io(
            "reading",
            &manifest_path,
            fs::read_to_string(&manifest_path),
        )?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| InteropError::ConfigJson {
                path: manifest_path.clone(),
                reason: e.to_string(),
            })?;
        return Ok(Loaded {
            dir: path.to_path_buf(),
            manifest,
            rejected: Vec::new(),
        });
    }
    // The config to verify against is the checkpoint's own: that of the manifest `latest`
    // names, else of the newest committed directory whose manifest reads (a damaged newest
    // one is then rejected by `load_latest`, which falls back as a restore would).
    let mut steps: Vec<u64> = io("listing", path, fs::read_dir(path))?
        .filter_map(|e| e.ok())
        .filter_map(|e| checkpoint::parse_step_dir_name(e.file_name().to_str()?))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    if let Ok(Some(s)) = checkpoint::latest_step(path) {
        steps.insert(0, s);
    }
    for s in steps {
        let mpath = path
            .join(checkpoint::step_dir_name(s))
            .join(checkpoint::MANIFEST);
        let Ok(text) = fs::read_to_string(&mpath) else {
            continue;
        };
        if let Ok(manifest) = serde_json::from_str::<Manifest>(&text) {
            return Ok(checkpoint::load_latest(path, &manifest.config)?);
        }
    }
    Err(InteropError::Checkpoint(CheckpointError::NoCheckpoint {
        root: path.to_path_buf(),
        rejected: Vec::new(),
    }))
}

/// The dense state and every expert of a verified checkpoint.
pub fn checkpoint_state(
    loaded: &Loaded,
) -> Result<(MoeConfig, OptimState, Vec<ExpertState>), InteropError> {
    let cfg = loaded.manifest.config.clone();
    let dense = loaded.dense()?;
    let mut experts = Vec::with_capacity(cfg.n_layers * cfg.experts);
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            experts.push(loaded.expert(l, e)?);
        }
    }
    Ok((cfg, dense, experts))
}

/// `lzrun export`: the checkpoint at `ckpt` (see [`open_checkpoint`]) written into `out`.
/// Returns the checkpoint's step and what was written.
pub fn export_checkpoint(
    ckpt: &Path,
    out: &Path,
    shard_bytes: u64,
) -> Result<(u64, MoeConfig, Written), InteropError> {
    let loaded = open_checkpoint(ckpt)?;
    let (cfg, dense, experts) = checkpoint_state(&loaded)?;
    let tensors = export_tensors(&cfg, &dense, &experts);
    let written = write_model_dir(out, &config_json(&cfg), &tensors, shard_bytes)?;
    Ok((loaded.step(), cfg, written))
}

/// `--init-from`: the model directory `src` (read for `cfg`, see [`read_config`]) committed as
/// the step-0 checkpoint of the checkpoint root `root` (AdamW moments zero, step 0). The
/// caller makes sure `root` holds no committed checkpoint (committing step 0 would discard
/// newer ones).
pub fn init_checkpoint(src: &Path, cfg: &MoeConfig, root: &Path) -> Result<u64, InteropError> {
    let weights = WeightsDir::open(src)?;
    let (dense, experts) = import_state(cfg, &weights)?;
    let mut parts = Vec::with_capacity(1 + experts.len());
    parts.push(checkpoint::write_part(
        root,
        0,
        checkpoint::dense_part(),
        &checkpoint::encode_dense(&dense),
    )?);
    for s in &experts {
        parts.push(checkpoint::write_part(
            root,
            0,
            &checkpoint::expert_part(s.layer, s.expert),
            &checkpoint::encode_expert(s),
        )?);
    }
    let expected = checkpoint::all_parts(cfg.n_layers, cfg.experts);
    let mut manifest = Manifest::new(0, 1, 0, cfg.clone(), parts);
    manifest.data_cursor = Some(0);
    // Keep every older checkpoint: there is none (the caller's check), and none is pruned.
    checkpoint::commit(root, manifest, &expected, usize::MAX)?;
    Ok(weights.tensors.len() as u64)
}

// ---------------------------------------------------------------------------------------
// Forward

/// Logits and loss of one batch ([`forward`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// `[batch, seq, vocab]`.
    pub shape: [usize; 3],
    /// Row-major f32.
    pub logits: Vec<f32>,
    /// Mean next-token cross-entropy: position `t`'s logits predict token `t + 1`, over every
    /// sequence (the `transformers` loss of `labels = input_ids`, and `lzrun`'s training
    /// cross-entropy without the balancing term).
    pub loss: f32,
}

/// One forward of `tokens` (equal-length sequences of at least 2 tokens, at most the config's
/// `seq_len`) through the model of `(cfg, dense, experts)` on the CPU in f32, no training.
pub fn forward(
    cfg: &MoeConfig,
    dense: &OptimState,
    experts: &[ExpertState],
    tokens: &[Vec<u32>],
) -> Result<Forward, InteropError> {
    let bad = |s: String| InteropError::Model(s);
    let b = tokens.len();
    let s = tokens.first().map_or(0, Vec::len);
    if b == 0 || s < 2 || tokens.iter().any(|t| t.len() != s) {
        return Err(bad(format!(
            "tokens: need at least one sequence, all of one length of at least 2 (got {b} \
             sequences of lengths {:?})",
            tokens.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    if s > cfg.seq_len {
        return Err(bad(format!(
            "tokens: sequences of {s} tokens, the model's seq_len is {}",
            cfg.seq_len
        )));
    }
    if let Some(t) = tokens.iter().flatten().find(|&&t| t as usize >= cfg.vocab) {
        return Err(bad(format!(
            "tokens: id {t} is outside the vocabulary of {}",
            cfg.vocab
        )));
    }
    // f32 products: the arithmetic every exported weight is compared in.
    let cfg = MoeConfig {
        precision: crate::model::Precision::F32,
        ..cfg.clone()
    };
    let dev = Device::Cpu;
    let model = DenseModel::new(&cfg, &dev).map_err(model_err)?;
    model
        .optimizer()
        .and_then(|mut o| o.import(dense))
        .map_err(model_err)?;
    let mut store = ExpertStore::empty(&cfg, &dev);
    for e in experts {
        store.import(e).map_err(model_err)?;
    }
    let flat: Vec<u32> = tokens.iter().flatten().copied().collect();
    let t = Tensor::from_vec(flat, (b, s), &dev).map_err(model_err)?;
    let mut stats = RoutingStats::default();
    let logits = model
        .logits(&t, &mut LocalExperts(&store), &mut stats)
        .map_err(model_err)?;
    let v = cfg.vocab;
    let pred = logits
        .narrow(1, 0, s - 1)
        .and_then(|l| l.reshape((b * (s - 1), v)))
        .map_err(model_err)?;
    let tgt = t
        .narrow(1, 1, s - 1)
        .and_then(|t| t.flatten_all())
        .map_err(model_err)?;
    let loss = candle_nn::loss::cross_entropy(&pred, &tgt)
        .and_then(|l| l.to_scalar::<f32>())
        .map_err(model_err)?;
    let logits = logits
        .flatten_all()
        .and_then(|l| l.to_vec1::<f32>())
        .map_err(model_err)?;
    Ok(Forward {
        shape: [b, s, v],
        logits,
        loss,
    })
}

/// The `.npy` (format 1.0, little-endian f32, C order) encoding of `values` of `shape`.
pub fn npy_bytes(shape: &[usize], values: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let shape_txt = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + 4 * values.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exported_config_says_float32_under_both_dtype_names() {
        let text = json!({
            "architectures": ["MixtralForCausalLM"], "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_local_experts": 2, "num_experts_per_tok": 1, "dtype": "bfloat16",
            "torch_dtype": "bfloat16", "max_position_embeddings": 64
        });
        let cfg = MoeConfig::from_hf_config_json(&text.to_string()).unwrap();
        let c = config_json(&cfg);
        assert_eq!(c["dtype"], json!("float32"));
        assert_eq!(c["torch_dtype"], json!("float32"));
        assert_eq!(c["hidden_size"], json!(8));
    }

    #[test]
    fn npy_header_is_aligned_and_describes_the_array() {
        let b = npy_bytes(&[2, 3, 4], &[0.5; 24]);
        assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let h = std::str::from_utf8(&b[10..10 + hl]).unwrap();
        assert!(h.contains("'shape': (2, 3, 4)"), "{h}");
        assert_eq!(b.len(), 10 + hl + 24 * 4);
        assert_eq!(&b[10 + hl..10 + hl + 4], &0.5f32.to_le_bytes());
    }

    #[test]
    fn shards_split_at_the_size_and_the_index_maps_every_tensor() {
        let dir = std::env::temp_dir().join(format!("lz-interop-shard-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let t = |name: &str, n: usize| NamedTensor {
            name: name.into(),
            shape: vec![n],
            values: (0..n).map(|i| i as f32).collect(),
        };
        let ts = vec![t("a", 10), t("b", 10), t("c", 30), t("d", 1)];
        // 80 bytes per shard: [a, b], [c] (120 bytes alone), [d].
        let w = write_model_dir(&dir, &json!({}), &ts, 80).unwrap();
        assert_eq!(w.files.len(), 3);
        assert_eq!(w.total_bytes, 4 * 51);
        let idx: Value =
            serde_json::from_str(&fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(idx["metadata"]["total_size"], json!(204));
        assert_eq!(
            idx["weight_map"]["c"],
            json!("model-00002-of-00003.safetensors")
        );
        let r = WeightsDir::open(&dir).unwrap();
        assert_eq!(r.read_f32("c", &[30]).unwrap(), ts[2].values);
        assert_eq!(r.read_f32("d", &[1]).unwrap(), vec![0.0]);
        assert!(matches!(
            r.read_f32("c", &[3, 10]),
            Err(InteropError::Shape { .. })
        ));
        // Refused a second time into the same directory.
        assert!(matches!(
            write_model_dir(&dir, &json!({}), &ts, 80),
            Err(InteropError::OutNotEmpty { .. })
        ));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bf16_and_f16_widen_exactly_and_other_dtypes_are_refused() {
        let dir = std::env::temp_dir().join(format!("lz-interop-dtype-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        // 1.5 and -2.0 in bf16 (upper halves of their f32 bits) and f16 (0x3e00, 0xc000).
        let bf: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let hf: Vec<u8> = [0x3e00u16, 0xc000]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let i32s: Vec<u8> = [1i32, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let views = vec![
            ("bf", TensorView::new(Dtype::BF16, vec![2], &bf).unwrap()),
            ("hf", TensorView::new(Dtype::F16, vec![2], &hf).unwrap()),
            ("int", TensorView::new(Dtype::I32, vec![2], &i32s).unwrap()),
        ];
        let bytes = safetensors::tensor::serialize(views, None).unwrap();
        fs::write(dir.join(WEIGHTS_FILE), &bytes).unwrap();
        let r = WeightsDir::open(&dir).unwrap();
        assert_eq!(r.read_f32("bf", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(r.read_f32("hf", &[2]).unwrap(), vec![1.5, -2.0]);
        assert!(matches!(
            r.read_f32("int", &[2]),
            Err(InteropError::Dtype { .. })
        ));
        // A truncated file is refused when opened.
        fs::write(dir.join(WEIGHTS_FILE), &bytes[..bytes.len() - 3]).unwrap();
        assert!(matches!(
            WeightsDir::open(&dir),
            Err(InteropError::BadFile { .. })
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
