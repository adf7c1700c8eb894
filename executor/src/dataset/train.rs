//! What a worker trains on: the embedded corpus or the `--data` datasets, cut into training
//! sequences and handed out in the planner's global sample order
//! ([`lazarus_planner::data`]).
//!
//! **Training sequences.** A source's tokens (every document back to back, as the format
//! stores them) are cut into sequences of `seq_len + 1` tokens starting every `seq_len`
//! tokens: sequence `j` is tokens `j·seq_len ..= (j+1)·seq_len`, inputs its first `seq_len`
//! and targets its last `seq_len` (consecutive sequences share one token, so every token is a
//! target exactly once). A source of `T` tokens has `⌊(T - 1) / seq_len⌋` sequences; sequences
//! cross document boundaries (the end-of-document token `lzrun prepare` writes marks them), as
//! in GPT-2/Megatron pre-training.

use std::path::PathBuf;

use lazarus_planner::data::{GlobalBatch, Located, SampleOrder};
use rand::RngExt;
use serde::{Deserialize, Serialize};

use super::{DatasetError, Result, TokenDataset, TokenDtype};
use crate::model::Corpus;

/// The datasets of a job (`--data`), with their blend weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataSpec {
    pub sources: Vec<DataSource>,
}

/// One dataset of a [`DataSpec`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataSource {
    /// The flat token file, or the Megatron prefix (`PREFIX.bin` + `PREFIX.idx`).
    pub path: PathBuf,
    /// Relative weight in the blend (1 for a single dataset).
    pub weight: f64,
    pub format: DataFormat,
}

/// How a [`DataSource`] is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// A flat little-endian token stream of this dtype.
    Flat(TokenDtype),
    /// A Megatron-LM indexed dataset (the dtype is in its index).
    Indexed,
}

enum Source {
    Embedded(Corpus),
    Dataset(TokenDataset),
}

/// One micro-batch of a global batch: `[M, seq_len + 1]` tokens, row-major, and the
/// `(source, sequence)` of each row.
pub struct MicroBatch {
    pub tokens: Vec<u32>,
    pub sequences: Vec<(u32, u64)>,
}

/// The training sequences of a job and their global order.
pub struct TrainData {
    sources: Vec<Source>,
    order: SampleOrder,
    seq_len: usize,
    vocab: u32,
}

impl TrainData {
    /// The embedded corpus (`spec` = `None`) or the datasets of `spec`, ordered from `seed`.
    /// Opening validates each dataset's index and size; token ids are checked against `vocab`
    /// as sequences are read (the launcher checks every token once, before the job starts:
    /// [`TokenDataset::check_vocab`]).
    pub fn open(spec: Option<&DataSpec>, seed: u64, seq_len: usize, vocab: usize) -> Result<Self> {
        let need = seq_len as u64 + 1;
        let (sources, weights) = match spec {
            None => (vec![Source::Embedded(Corpus::embedded())], vec![1.0]),
            Some(spec) => {
                let mut sources = Vec::with_capacity(spec.sources.len());
                for s in &spec.sources {
                    let d = match s.format {
                        DataFormat::Flat(dtype) => TokenDataset::open_flat(&s.path, dtype)?,
                        DataFormat::Indexed => TokenDataset::open_indexed(&s.path, None)?,
                    };
                    if d.num_tokens() < need {
                        return Err(DatasetError::TooShort {
                            path: d.path().to_path_buf(),
                            tokens: d.num_tokens(),
                            needed: need,
                        });
                    }
                    sources.push(Source::Dataset(d));
                }
                let weights = spec.sources.iter().map(|s| s.weight).collect();
                (sources, weights)
            }
        };
        let sizes = sources
            .iter()
            .map(|s| Self::count(s, seq_len))
            .collect::<Result<Vec<u64>>>()?;
        let order = SampleOrder::new(seed, sizes, &weights)?;
        Ok(Self {
            sources,
            order,
            seq_len,
            vocab: u32::try_from(vocab).unwrap_or(u32::MAX),
        })
    }

    fn count(s: &Source, seq_len: usize) -> Result<u64> {
        let tokens = match s {
            Source::Embedded(c) => c.len() as u64,
            Source::Dataset(d) => d.num_tokens(),
        };
        if tokens < seq_len as u64 + 1 {
            return Err(DatasetError::TooShort {
                path: PathBuf::from("<embedded corpus>"),
                tokens,
                needed: seq_len as u64 + 1,
            });
        }
        Ok((tokens - 1) / seq_len as u64)
    }

    /// Training sequences of each source.
    pub fn sizes(&self) -> &[u64] {
        self.order.sizes()
    }

    /// Where position `p` of the global order lands.
    pub fn locate(&self, p: u64) -> Located {
        self.order.locate(p)
    }

    /// The `seq_len + 1` tokens of `sequence` of `source`, checked against the vocabulary.
    pub fn sequence(&self, source: usize, sequence: u64) -> Result<Vec<u32>> {
        let start = sequence * self.seq_len as u64;
        let tokens = match &self.sources[source] {
            Source::Embedded(c) => {
                let s = start as usize;
                c.tokens()[s..s + self.seq_len + 1].to_vec()
            }
            Source::Dataset(d) => {
                d.check_unchanged()?;
                let t = d.window(start, self.seq_len)?;
                if let Some(i) = t.iter().position(|&x| x >= self.vocab) {
                    return Err(DatasetError::TokenOutOfVocab {
                        path: d.path().to_path_buf(),
                        offset: (start + i as u64) * d.dtype().size() as u64,
                        index: start + i as u64,
                        sequence: d.sequence_of_token(start + i as u64),
                        token: t[i],
                        vocab: self.vocab,
                    });
                }
                t
            }
        };
        Ok(tokens)
    }

    /// Micro-batch `mb` of the step whose first position is `cursor`.
    pub fn micro_batch(&self, batch: GlobalBatch, cursor: u64, mb: u64) -> Result<MicroBatch> {
        let positions = batch.positions(cursor, mb);
        let mut tokens = Vec::with_capacity(batch.micro as usize * (self.seq_len + 1));
        let mut sequences = Vec::with_capacity(batch.micro as usize);
        for p in positions {
            let l = self.order.locate(p);
            tokens.extend(self.sequence(l.source, l.sequence)?);
            sequences.push((l.source as u32, l.sequence));
        }
        Ok(MicroBatch { tokens, sequences })
    }

    /// `--batch-per-node`: `batch` sequences for `(seed, step, shard)`, each at a uniform
    /// position of the order (the paper's per-member batches, drawn without coordination).
    pub fn random_batch(&self, seed: u64, step: u64, shard: u64, batch: usize) -> Result<Vec<u32>> {
        let mut rng = crate::model::rng_for(seed, &format!("data.step{step}.shard{shard}"));
        let mut tokens = Vec::with_capacity(batch * (self.seq_len + 1));
        for _ in 0..batch {
            let l = self.order.locate(rng.random_range(0..1u64 << 62));
            tokens.extend(self.sequence(l.source, l.sequence)?);
        }
        Ok(tokens)
    }
}

/// Held-out evaluation (`--eval-data`): every member runs the same fixed eval set forward
/// after the update of each due step, and the job reports its loss.
///
/// **The eval set** is the first `batches × micro` training sequences (cut as above) of one
/// dataset in file order, not shuffled, so that every evaluation of a run — and of another run
/// on the same file — scores the same sequences; a dataset with fewer sequences wraps around.
/// Micro-batch `i` holds sequences `i·micro .. (i+1)·micro` (mod the dataset's count).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalSpec {
    /// The eval dataset (weight 1).
    pub source: DataSource,
    /// Evaluate after every step `s` with `(s + 1) % every == 0`; 0: only after the last step
    /// (which is always evaluated).
    pub every: u64,
    /// Eval micro-batches.
    pub batches: u64,
    /// Sequences per eval micro-batch (the training micro-batch size).
    pub micro: u64,
}

impl EvalSpec {
    /// Whether the job evaluates after the update of `step` of a job of `steps` steps.
    pub fn due(&self, step: u64, steps: u64) -> bool {
        step + 1 == steps || (self.every > 0 && (step + 1).is_multiple_of(self.every))
    }
}

/// The eval dataset of an [`EvalSpec`], opened.
pub struct EvalData {
    data: TrainData,
    micro: u64,
}

impl EvalData {
    /// Opens the eval dataset as a training source (the same cut, the same vocabulary check
    /// as its sequences are read); the order [`TrainData`] builds is not used.
    pub fn open(spec: &EvalSpec, seq_len: usize, vocab: usize) -> Result<Self> {
        let one = DataSpec {
            sources: vec![spec.source.clone()],
        };
        Ok(Self {
            data: TrainData::open(Some(&one), 0, seq_len, vocab)?,
            micro: spec.micro,
        })
    }

    /// Training sequences in the eval dataset.
    pub fn sequences(&self) -> u64 {
        self.data.sizes()[0]
    }

    /// Eval micro-batch `i`: `[micro, seq_len + 1]` tokens, row-major.
    pub fn micro_batch(&self, i: u64) -> Result<Vec<u32>> {
        let n = self.sequences();
        let mut tokens = Vec::with_capacity(self.micro as usize * (self.data.seq_len + 1));
        for j in 0..self.micro {
            tokens.extend(self.data.sequence(0, (i * self.micro + j) % n)?);
        }
        Ok(tokens)
    }
}
