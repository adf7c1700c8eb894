//! Byte-level tokenizer, the embedded corpus and deterministic batch sampling.

use super::init::rng_for;
use candle_core::{Device, Result, Tensor};
use rand::RngExt;

/// The default training text (original English prose, ASCII), compiled into the binary.
pub const EMBEDDED_CORPUS: &str = include_str!("../../data/corpus.txt");

/// Tokens are the UTF-8 bytes of the text: vocabulary 256, no merges.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB: usize = 256;

    pub fn encode(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Lossy inverse of [`Self::encode`] (ids ≥ 256 become U+FFFD).
    pub fn decode(tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens
            .iter()
            .map(|&t| u8::try_from(t).unwrap_or(0xff))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// A token stream to sample training windows from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corpus {
    tokens: Vec<u32>,
}

impl Corpus {
    /// [`EMBEDDED_CORPUS`], byte-tokenized.
    pub fn embedded() -> Self {
        Self::from_text(EMBEDDED_CORPUS)
    }

    pub fn from_text(text: &str) -> Self {
        Self {
            tokens: ByteTokenizer::encode(text),
        }
    }

    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self { tokens }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Start offsets of the `batch` windows of length `len` for `(seed, step, shard)`; each
    /// is uniform over the corpus. A pure function of its arguments, so every worker (`shard`
    /// = its data-parallel rank) can draw its own share of a step without coordination.
    pub fn offsets(
        &self,
        seed: u64,
        step: u64,
        shard: u64,
        batch: usize,
        len: usize,
    ) -> Vec<usize> {
        let span = self.tokens.len().saturating_sub(len) + 1;
        let mut rng = rng_for(seed, &format!("data.step{step}.shard{shard}"));
        (0..batch).map(|_| rng.random_range(0..span)).collect()
    }

    /// `[batch, len]` u32 windows at [`Self::offsets`]; `len = seq_len + 1` for training.
    pub fn batch(
        &self,
        seed: u64,
        step: u64,
        shard: u64,
        batch: usize,
        len: usize,
        dev: &Device,
    ) -> Result<Tensor> {
        if len == 0 || len > self.tokens.len() {
            candle_core::bail!(
                "window of {len} tokens from a corpus of {}",
                self.tokens.len()
            );
        }
        let mut out = Vec::with_capacity(batch * len);
        for o in self.offsets(seed, step, shard, batch, len) {
            out.extend_from_slice(&self.tokens[o..o + len]);
        }
        Tensor::from_vec(out, (batch, len), dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_corpus_is_large_ascii_prose() {
        assert!(
            EMBEDDED_CORPUS.len() >= 20 * 1024,
            "{}",
            EMBEDDED_CORPUS.len()
        );
        assert!(EMBEDDED_CORPUS.is_ascii());
        let words = EMBEDDED_CORPUS.split_whitespace().count();
        assert!(words > 3000, "{words} words");
    }

    #[test]
    fn tokenizer_round_trips() {
        let s = "Replicas fail; training goes on.\n";
        let t = ByteTokenizer::encode(s);
        assert!(t.iter().all(|&x| (x as usize) < ByteTokenizer::VOCAB));
        assert_eq!(ByteTokenizer::decode(&t), s);
    }

    #[test]
    fn batches_are_deterministic_windows() -> Result<()> {
        let c = Corpus::embedded();
        let dev = Device::Cpu;
        let a = c.batch(3, 10, 0, 4, 9, &dev)?.to_vec2::<u32>()?;
        let b = c.batch(3, 10, 0, 4, 9, &dev)?.to_vec2::<u32>()?;
        let other_step = c.batch(3, 11, 0, 4, 9, &dev)?.to_vec2::<u32>()?;
        let other_shard = c.batch(3, 10, 1, 4, 9, &dev)?.to_vec2::<u32>()?;
        assert_eq!(a, b);
        assert_ne!(a, other_step);
        assert_ne!(a, other_shard);
        for (row, o) in a.iter().zip(c.offsets(3, 10, 0, 4, 9)) {
            assert_eq!(row.as_slice(), &c.tokens()[o..o + 9]);
        }
        assert!(c.batch(0, 0, 0, 1, c.len() + 1, &dev).is_err());
        Ok(())
    }
}
