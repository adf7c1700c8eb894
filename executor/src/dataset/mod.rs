//! Memory-mapped token datasets: what `lzrun` will train on (issue 31, "lzrun trains on your
//! data"). Files are mapped, never loaded whole: opening validates the (small) index, and reads
//! touch only the pages of the tokens asked for.
//!
//! # Formats
//!
//! **Flat token stream** ([`FlatTokens`]): a file of little-endian token ids and nothing else —
//! the `train.bin` written by small-GPT preparation scripts (nanoGPT's `prepare.py` writes
//! `np.uint16`; vocabularies over 65 536 need `uint32`). The file carries no dtype, so the
//! caller names it ([`TokenDtype::U16`] or [`TokenDtype::U32`]; `u8`/`i32`/`i64` are read too).
//! It is one sequence and one document.
//!
//! **Megatron-LM indexed dataset** ([`IndexedDataset`]): `PREFIX.bin` holds the tokens of every
//! sequence back to back; `PREFIX.idx` describes them. The layout, as documented by Megatron-LM's
//! `megatron/core/datasets/indexed_dataset.py` (`_IndexWriter`/`_IndexReader`), all integers
//! little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..9 | magic `b"MMIDIDX\x00\x00"` |
//! | 9..17 | version, u64 = 1 |
//! | 17 | dtype code, u8: uint8 1, int8 2, int16 3, int32 4, int64 5, float64 6, float32 7, uint16 8 |
//! | 18..26 | sequence count `S`, u64 |
//! | 26..34 | document-index length `D`, u64 |
//! | 34.. | `S` × int32 sequence lengths (tokens) |
//! | then | `S` × int64 sequence pointers (byte offsets into `.bin`) |
//! | then | `D` × int64 document index: the first sequence of each document, then `S` |
//!
//! So there are `D - 1` documents; document `k` is sequences `doc[k]..doc[k+1]`. Token dtypes
//! uint16, int32 (Megatron's choice for vocabularies over 65 500), uint8 and int64 are read;
//! int8/int16/floats are refused. [`IndexedWriter`] writes the same format (our own code, from
//! the description above).
//!
//! # What is validated
//!
//! At open, with an error ([`DatasetError`]) naming the file and the byte offset or sequence:
//! a short header, bad magic, a version other than 1, an unknown or unsupported dtype code, a
//! dtype other than the caller expected, counts that do not fit the index size, trailing index
//! bytes (newer multimodal writers append a sequence-mode array, which we do not read), negative
//! lengths, pointers that do not run contiguously from 0 (each the previous plus its length in
//! bytes) or run past the end of `.bin`, `.bin` bytes no sequence covers, a document index that
//! is empty, does not start at 0, decreases, or does not end at the sequence count, a `.bin` (or
//! flat file) whose size is not a multiple of the dtype size, and an empty dataset. Because
//! pointers are contiguous, the sequences form one global token stream, so a token offset is a
//! position in the whole dataset. On read: negative or > `u32::MAX` ids (signed dtypes), and on
//! request ([`TokenDataset::check_vocab`], one streaming pass) any id `>=` the vocabulary size,
//! with its byte offset and sequence. Nothing panics on any input: all arithmetic on file-derived
//! values is checked and all slicing goes through `get`.
//!
//! # Mapping
//!
//! Mapping a file is `unsafe` in Rust terms: if another process truncates or rewrites it while
//! it is mapped, reads may fault or see changing bytes. Training data is written once, before the
//! run; do not modify the files of a running job. Each read of a training sequence first checks
//! that the mapped files still have the size and modification time they had when opened
//! ([`TokenDataset::check_unchanged`]): a worker finding one changed ends, naming the file, where
//! the read past a truncated file's end used to kill it with SIGBUS and no word (a truncation
//! between the check and the read still can).
//!
//! # How the trainer will use it (not wired yet)
//!
//! `lzrun --data PATH` (flat, with `--data-dtype u16|u32`) or `--data PREFIX` (Megatron) opens a
//! [`TokenDataset`], calls [`TokenDataset::check_vocab`] with the model's vocabulary, and draws
//! training samples as [`TokenDataset::window`]s of `seq_len + 1` tokens (inputs and shifted
//! targets) at offsets from a global sample order that every worker derives from the seed and
//! the step, so a rank joining mid-run reads exactly the samples it would have read.
//!
//! # Making one
//!
//! `lzrun prepare` ([`prepare::prepare`]) tokenizes `.txt` / `.jsonl` text with a Hugging Face
//! `tokenizer.json` (or the byte tokenizer) into a Megatron-LM indexed dataset, one sequence
//! per document; `lzrun tokenizer` ([`prepare::train_tokenizer`]) trains a byte-level BPE
//! `tokenizer.json` for it from local text.

mod error;
mod flat;
mod indexed;
pub mod prepare;
mod train;

#[cfg(test)]
mod tests;

use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use error::{DatasetError, Result};
pub use flat::{FlatTokens, write_flat};
pub use indexed::{IDX_HEADER_LEN, IDX_MAGIC, IndexedDataset, IndexedWriter};
pub use train::{DataFormat, DataSource, DataSpec, EvalData, EvalSpec, MicroBatch, TrainData};

/// The width and signedness of the token ids in a file (always little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    U8,
    U16,
    U32,
    I32,
    I64,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U8 => 1,
            TokenDtype::U16 => 2,
            TokenDtype::U32 | TokenDtype::I32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    /// The numpy name (`uint16`, `int32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U8 => "uint8",
            TokenDtype::U16 => "uint16",
            TokenDtype::U32 => "uint32",
            TokenDtype::I32 => "int32",
            TokenDtype::I64 => "int64",
        }
    }

    /// The Megatron-LM `.idx` dtype code, if the format has one (uint32 has none).
    pub fn megatron_code(self) -> Option<u8> {
        match self {
            TokenDtype::U8 => Some(1),
            TokenDtype::I32 => Some(4),
            TokenDtype::I64 => Some(5),
            TokenDtype::U16 => Some(8),
            TokenDtype::U32 => None,
        }
    }

    /// Whether `token` is representable in this dtype.
    pub fn fits(self, token: u32) -> bool {
        match self {
            TokenDtype::U8 => token <= u32::from(u8::MAX),
            TokenDtype::U16 => token <= u32::from(u16::MAX),
            TokenDtype::I32 => i32::try_from(token).is_ok(),
            TokenDtype::U32 | TokenDtype::I64 => true,
        }
    }

    /// Decodes one token from exactly `size()` little-endian bytes (`None` on a wrong length).
    fn decode(self, bytes: &[u8]) -> Option<i64> {
        Some(match self {
            TokenDtype::U8 => i64::from(*bytes.first()?),
            TokenDtype::U16 => i64::from(u16::from_le_bytes(bytes.try_into().ok()?)),
            TokenDtype::U32 => i64::from(u32::from_le_bytes(bytes.try_into().ok()?)),
            TokenDtype::I32 => i64::from(i32::from_le_bytes(bytes.try_into().ok()?)),
            TokenDtype::I64 => i64::from_le_bytes(bytes.try_into().ok()?),
        })
    }

    /// Encodes `token` (which must fit) little-endian onto `out`.
    fn encode(self, token: u32, out: &mut Vec<u8>) {
        match self {
            TokenDtype::U8 => out.push(token as u8),
            TokenDtype::U16 => out.extend_from_slice(&(token as u16).to_le_bytes()),
            TokenDtype::U32 => out.extend_from_slice(&token.to_le_bytes()),
            TokenDtype::I32 => out.extend_from_slice(&(token as i32).to_le_bytes()),
            TokenDtype::I64 => out.extend_from_slice(&i64::from(token).to_le_bytes()),
        }
    }
}

impl fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TokenDtype {
    type Err = String;

    /// `u16`/`uint16`, `u32`/`uint32`, `u8`/`uint8`, `i32`/`int32`, `i64`/`int64`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "u8" | "uint8" => Ok(TokenDtype::U8),
            "u16" | "uint16" => Ok(TokenDtype::U16),
            "u32" | "uint32" => Ok(TokenDtype::U32),
            "i32" | "int32" => Ok(TokenDtype::I32),
            "i64" | "int64" => Ok(TokenDtype::I64),
            other => Err(format!(
                "unknown token dtype {other:?} (expected u16, u32, u8, i32 or i64)"
            )),
        }
    }
}

/// The bytes of a file: mapped, or (tests, fuzzing, empty files) owned.
pub(crate) enum Bytes {
    /// The map, the open file under it, and the file's size and modification time when mapped
    /// ([`Bytes::check_unchanged`]).
    Mapped {
        map: memmap2::Mmap,
        file: File,
        len: u64,
        modified: Option<std::time::SystemTime>,
    },
    Owned(Vec<u8>),
}

impl Bytes {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, .. } => map,
            Bytes::Owned(v) => v,
        }
    }

    /// Fails with [`DatasetError::Changed`] when the mapped file (`path`, for the message) is
    /// no longer the size or modification time it had when mapped. A read of the map past a
    /// truncated file's end is a SIGBUS that kills the process without a word, and rewritten
    /// bytes would silently train on other data: callers check before they read (one `fstat`
    /// of the open file, which is the mapped one even if the path was replaced since).
    pub(crate) fn check_unchanged(&self, path: &Path) -> Result<()> {
        let Bytes::Mapped {
            file,
            len,
            modified,
            ..
        } = self
        else {
            return Ok(());
        };
        let meta = file.metadata().map_err(|source| DatasetError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if meta.len() != *len || meta.modified().ok() != *modified {
            return Err(DatasetError::Changed {
                path: path.to_path_buf(),
                was: *len,
                now: meta.len(),
            });
        }
        Ok(())
    }

    /// Maps `path` read-only (an empty file becomes an empty buffer: zero-length maps fail on
    /// some platforms).
    pub(crate) fn map(path: &Path) -> Result<Bytes> {
        let io = |source| DatasetError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let len = meta.len();
        if len == 0 {
            return Ok(Bytes::Owned(Vec::new()));
        }
        // SAFETY: the map is read-only and we never hand out references that outlive it. The
        // remaining hazard — another process modifying the file while it is mapped — is
        // documented in the module docs: datasets are written before a run, not during it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(Bytes::Mapped {
            map,
            file,
            len,
            modified: meta.modified().ok(),
        })
    }
}

/// A contiguous stream of tokens of one dtype in one file (the flat file, or a `.bin`).
pub(crate) struct TokenStream {
    pub(crate) path: PathBuf,
    pub(crate) dtype: TokenDtype,
    pub(crate) bytes: Bytes,
    pub(crate) num_tokens: u64,
}

impl TokenStream {
    /// Wraps `bytes`, checking the size is a multiple of the dtype size.
    pub(crate) fn new(path: PathBuf, dtype: TokenDtype, bytes: Bytes) -> Result<TokenStream> {
        let len = bytes.as_slice().len() as u64;
        let size = dtype.size() as u64;
        if !len.is_multiple_of(size) {
            return Err(DatasetError::NotMultipleOfDtype { path, len, dtype });
        }
        Ok(TokenStream {
            path,
            dtype,
            bytes,
            num_tokens: len / size,
        })
    }

    /// The byte range of tokens `range`, or `OutOfRange`.
    fn byte_range(&self, range: &Range<u64>) -> Result<Range<usize>> {
        let out = || DatasetError::OutOfRange {
            path: self.path.clone(),
            start: range.start,
            end: range.end,
            num_tokens: self.num_tokens,
        };
        if range.start > range.end || range.end > self.num_tokens {
            return Err(out());
        }
        let size = self.dtype.size() as u64;
        let start = range.start.checked_mul(size).ok_or_else(out)?;
        let end = range.end.checked_mul(size).ok_or_else(out)?;
        let start = usize::try_from(start).map_err(|_| out())?;
        let end = usize::try_from(end).map_err(|_| out())?;
        Ok(start..end)
    }

    /// Calls `f(token index, token)` for each token of `range`, stopping early when it returns
    /// `false`.
    fn scan(&self, range: Range<u64>, mut f: impl FnMut(u64, u32) -> bool) -> Result<()> {
        let bytes = self.byte_range(&range)?;
        let first_byte = bytes.start as u64;
        let slice = self
            .bytes
            .as_slice()
            .get(bytes)
            .ok_or(DatasetError::OutOfRange {
                path: self.path.clone(),
                start: range.start,
                end: range.end,
                num_tokens: self.num_tokens,
            })?;
        let size = self.dtype.size();
        for (i, chunk) in slice.chunks_exact(size).enumerate() {
            let i = i as u64;
            let offset = first_byte + i * size as u64;
            let value = self.dtype.decode(chunk).unwrap_or(-1);
            let token = u32::try_from(value).map_err(|_| DatasetError::InvalidToken {
                path: self.path.clone(),
                offset,
                value,
            })?;
            if !f(range.start + i, token) {
                break;
            }
        }
        Ok(())
    }

    pub(crate) fn tokens(&self, range: Range<u64>) -> Result<Vec<u32>> {
        let mut out =
            Vec::with_capacity(usize::try_from(range.end.saturating_sub(range.start)).unwrap_or(0));
        self.scan(range, |_, t| {
            out.push(t);
            true
        })?;
        Ok(out)
    }

    /// The largest token id, streaming over the whole file.
    pub(crate) fn max_token_id(&self) -> Result<u32> {
        let mut max = 0;
        self.scan(0..self.num_tokens, |_, t| {
            max = max.max(t);
            true
        })?;
        Ok(max)
    }

    /// The first token `>= vocab`, as (token index, byte offset, token).
    pub(crate) fn first_out_of_vocab(&self, vocab: u32) -> Result<Option<(u64, u64, u32)>> {
        let mut found = None;
        let size = self.dtype.size() as u64;
        self.scan(0..self.num_tokens, |i, t| {
            if t >= vocab {
                found = Some((i, i * size, t));
                return false;
            }
            true
        })?;
        Ok(found)
    }
}

/// A token dataset of either format: what the trainer reads.
pub enum TokenDataset {
    Flat(FlatTokens),
    Indexed(IndexedDataset),
}

impl TokenDataset {
    /// Opens a flat token file of `dtype`.
    pub fn open_flat(path: impl AsRef<Path>, dtype: TokenDtype) -> Result<TokenDataset> {
        FlatTokens::open(path, dtype).map(TokenDataset::Flat)
    }

    /// Opens `PREFIX.idx` + `PREFIX.bin`; `expected`, if given, must be the file's dtype.
    pub fn open_indexed(
        prefix: impl AsRef<Path>,
        expected: Option<TokenDtype>,
    ) -> Result<TokenDataset> {
        IndexedDataset::open(prefix, expected).map(TokenDataset::Indexed)
    }

    fn stream(&self) -> &TokenStream {
        match self {
            TokenDataset::Flat(f) => &f.stream,
            TokenDataset::Indexed(d) => &d.bin,
        }
    }

    /// Fails with [`DatasetError::Changed`] when a file of the dataset changed since it was
    /// opened (see [`Bytes::check_unchanged`]).
    pub fn check_unchanged(&self) -> Result<()> {
        if let TokenDataset::Indexed(d) = self {
            d.idx.check_unchanged(d.idx_path())?;
        }
        let s = self.stream();
        s.bytes.check_unchanged(&s.path)
    }

    /// The token file (the flat file, or `PREFIX.bin`).
    pub fn path(&self) -> &Path {
        &self.stream().path
    }

    pub fn dtype(&self) -> TokenDtype {
        self.stream().dtype
    }

    /// Tokens in the whole dataset.
    pub fn num_tokens(&self) -> u64 {
        self.stream().num_tokens
    }

    /// Sequences (a flat file is one).
    pub fn num_sequences(&self) -> u64 {
        match self {
            TokenDataset::Flat(_) => 1,
            TokenDataset::Indexed(d) => d.num_sequences(),
        }
    }

    /// Documents (a flat file is one).
    pub fn num_documents(&self) -> u64 {
        match self {
            TokenDataset::Flat(_) => 1,
            TokenDataset::Indexed(d) => d.num_documents(),
        }
    }

    /// The global token range of sequence `i`.
    pub fn sequence(&self, i: u64) -> Result<Range<u64>> {
        match self {
            TokenDataset::Flat(f) => f.whole(i, "sequence"),
            TokenDataset::Indexed(d) => d.sequence(i),
        }
    }

    /// The global token range of document `k` (its boundaries).
    pub fn document(&self, k: u64) -> Result<Range<u64>> {
        match self {
            TokenDataset::Flat(f) => f.whole(k, "document"),
            TokenDataset::Indexed(d) => d.document(k),
        }
    }

    /// The tokens at global offsets `range`.
    pub fn tokens(&self, range: Range<u64>) -> Result<Vec<u32>> {
        self.stream().tokens(range)
    }

    /// A training window: the `seq_len + 1` tokens from global offset `offset` (inputs are the
    /// first `seq_len`, targets the last `seq_len`). Windows may cross document boundaries.
    pub fn window(&self, offset: u64, seq_len: usize) -> Result<Vec<u32>> {
        let end = offset
            .checked_add(seq_len as u64)
            .and_then(|e| e.checked_add(1))
            .unwrap_or(u64::MAX);
        self.stream().tokens(offset..end)
    }

    /// The sequence (of the file's index) that holds global token `index`.
    pub fn sequence_of_token(&self, index: u64) -> u64 {
        match self {
            TokenDataset::Flat(_) => 0,
            TokenDataset::Indexed(d) => d.sequence_containing(index),
        }
    }

    /// The largest token id (one streaming pass over the tokens).
    pub fn max_token_id(&self) -> Result<u32> {
        self.stream().max_token_id()
    }

    /// Checks every token id is `< vocab` (one streaming pass); the error names the file, the
    /// byte offset, the token index and its sequence.
    pub fn check_vocab(&self, vocab: u32) -> Result<()> {
        let stream = self.stream();
        let Some((index, offset, token)) = stream.first_out_of_vocab(vocab)? else {
            return Ok(());
        };
        let sequence = match self {
            TokenDataset::Flat(_) => 0,
            TokenDataset::Indexed(d) => d.sequence_containing(index),
        };
        Err(DatasetError::TokenOutOfVocab {
            path: stream.path.clone(),
            offset,
            index,
            sequence,
            token,
            vocab,
        })
    }
}
