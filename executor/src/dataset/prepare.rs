//! `lzrun prepare`: tokenize text files into a Megatron-LM indexed dataset (`PREFIX.bin` +
//! `PREFIX.idx`, written with [`IndexedWriter`]), and `lzrun tokenizer`: train a small byte-level
//! BPE `tokenizer.json` to prepare with.
//!
//! # Inputs
//!
//! - `.txt`: the whole file is **one document**. Not blank-line-separated paragraphs: splitting
//!   would have to decide what a blank line is (`"\n \n"`? `"\r\n\r\n"`?) and would drop the
//!   separators, so a document could no longer be decoded back to the exact text it came from.
//!   A corpus of many documents is many `.txt` files or one `.jsonl` file. The file is read
//!   whole: its text and its tokens are in memory at once, so very large single documents
//!   belong in `.jsonl` (one line each).
//! - `.jsonl`: **one document per line**, the line's `"text"` field (a JSON string; other
//!   fields are ignored). A line that is not JSON, not an object, or has no string `"text"` is
//!   an error naming the file and the line (1-based). Lines of only whitespace are skipped.
//!   The file is streamed: one line in memory at a time.
//!
//! Text must be UTF-8 (an error names the file, the line for `.jsonl`, and the byte offset of
//! the first invalid byte). Empty documents (`""`) are skipped and counted; inputs with no
//! tokens at all are an error.
//!
//! # Output
//!
//! One sequence per document, and every sequence is a document (document index `0, 1, …, S`).
//! With a `tokenizer.json`, each sequence is the document's tokens (encoded without the
//! tokenizer's own added special tokens or template, and with any truncation or padding in the
//! file switched off) followed by one end-of-document (EOD) token: `--eod-token TOKEN`, or the
//! first of [`EOD_CANDIDATES`] the tokenizer knows. The dtype is uint16 when the vocabulary
//! (the largest id + 1, counting added tokens) is at most 65,536, else int32 (Megatron's rule;
//! uint32 has no `.idx` code).
//!
//! # `--tokenizer bytes`: no EOD token
//!
//! The built-in byte tokenizer ([`crate::model::ByteTokenizer`]) maps each UTF-8 byte to its
//! value, so it uses all 256 ids of a 256-token vocabulary, and the `tiny` model
//! ([`crate::model::MoeConfig::tiny`]) has exactly `vocab = 256`. An EOD id 256 would need a
//! vocabulary of 257, and `lzrun local --config tiny --data PREFIX` would refuse the dataset
//! (its vocabulary check finds id 256 >= 256). So `bytes` writes **no EOD token**: a sequence
//! is exactly the document's bytes (uint16), the document boundaries are still in the index,
//! and training windows that cross a boundary see the next document's first byte as the target
//! after the last byte of this one, as they do on the embedded corpus. `--eod-token` with
//! `bytes` is an error.
//!
//! # Atomic output
//!
//! Tokens go to `PREFIX.bin.tmp` and the index to `PREFIX.idx.tmp`; only when both are written
//! and synced are they renamed to `PREFIX.bin` and `PREFIX.idx`. A prepare that fails removes
//! its temporary files; one that is killed leaves at most the `.tmp` files. Either way an
//! existing dataset under `PREFIX` is untouched until the prepare has succeeded. (The two
//! renames are two steps; if the second one failed, the new `.bin` would sit beside the old
//! `.idx`, which the reader's size and pointer checks refuse.)
//!
//! Memory: the index arrays (20 bytes per document) and one document at a time.

use std::collections::HashSet;
use std::fmt;
use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder,
};

use super::indexed::with_suffix;
use super::{DatasetError, IndexedWriter, TokenDtype};
use crate::model::ByteTokenizer;

/// The EOD tokens looked up, in order, when `--eod-token` is not given.
pub const EOD_CANDIDATES: [&str; 4] = ["<|endoftext|>", "</s>", "<eos>", "<|eos|>"];
/// The special token [`train_tokenizer`] adds (id 0).
pub const TRAINED_EOD: &str = "<|endoftext|>";
/// The largest vocabulary stored as uint16.
pub const U16_MAX_VOCAB: u64 = 65_536;
/// The smallest `--vocab` of [`train_tokenizer`]: 256 byte tokens and [`TRAINED_EOD`].
pub const MIN_TRAIN_VOCAB: usize = 257;
/// The largest `--vocab` of [`train_tokenizer`] (ids must fit an int32 dataset).
pub const MAX_TRAIN_VOCAB: usize = i32::MAX as usize;

/// A file and, for `.jsonl`, a 1-based line: `file` or `file:line` in messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub path: PathBuf,
    pub line: Option<u64>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}", self.path.display()),
            None => write!(f, "{}", self.path.display()),
        }
    }
}

/// What can go wrong preparing a dataset or training a tokenizer. Every message is one line
/// naming the file (and the line of a `.jsonl`).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a regular file", .path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "{}: unsupported input (expected .txt, one document per file, or .jsonl, one JSON object \
         with a \"text\" string per line)",
        .path.display()
    )]
    UnsupportedInput { path: PathBuf },
    #[error("{at}: not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 { at: Location, offset: u64 },
    #[error("{at}: not valid JSON ({message})")]
    BadJson { at: Location, message: String },
    #[error("{at}: no string \"text\" field")]
    NoText { at: Location },
    #[error("{}: cannot read the tokenizer: {message}", .path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{at}: the tokenizer failed: {message}")]
    Encode { at: Location, message: String },
    #[error(
        "{}: the tokenizer has none of the end-of-document tokens <|endoftext|>, </s>, <eos>, \
         <|eos|>; pass --eod-token TOKEN",
        .path.display()
    )]
    NoEodToken { path: PathBuf },
    #[error("{}: the tokenizer has no token {token:?} (--eod-token)", .path.display())]
    UnknownEodToken { path: PathBuf, token: String },
    #[error(
        "--eod-token does not apply to --tokenizer bytes, which writes no end-of-document token \
         (its 256 ids are all bytes, and the tiny model's vocabulary is 256)"
    )]
    EodWithBytes,
    #[error("{inputs}: no tokens to write (no documents, or every document is empty)")]
    Empty { inputs: String },
    #[error("{}: the output directory does not exist", .dir.display())]
    NoOutputDir { dir: PathBuf },
    #[error("{}: --out names a file prefix (PREFIX.bin, PREFIX.idx), not a directory", .path.display())]
    OutIsDir { path: PathBuf },
    #[error(
        "--vocab {vocab} is out of range ({MIN_TRAIN_VOCAB}..={MAX_TRAIN_VOCAB}: 256 byte tokens plus <|endoftext|> at least)"
    )]
    VocabOutOfRange { vocab: usize },
    #[error("training the tokenizer failed: {message}")]
    Train { message: String },
    #[error(transparent)]
    Dataset(#[from] DatasetError),
}

/// Result of the prepare functions.
pub type Result<T> = std::result::Result<T, PrepareError>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PrepareError + '_ {
    move |source| PrepareError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `--tokenizer`: the built-in byte tokenizer, or a Hugging Face `tokenizer.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    Bytes,
    File(PathBuf),
}

impl FromStr for TokenizerSource {
    type Err = String;

    /// `bytes`, or a path (write `./bytes` for a file of that name).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" => Err("expected a tokenizer.json path or `bytes`".to_owned()),
            "bytes" => Ok(TokenizerSource::Bytes),
            path => Ok(TokenizerSource::File(PathBuf::from(path))),
        }
    }
}

/// A loaded tokenizer: encodes a document into its sequence (tokens, then the EOD if any).
pub struct DocumentTokenizer {
    kind: Kind,
    eod: Option<(String, u32)>,
    vocab: u64,
}

enum Kind {
    Bytes,
    File {
        path: PathBuf,
        tokenizer: Box<Tokenizer>,
    },
}

impl DocumentTokenizer {
    /// Loads `source` and resolves the EOD token (`eod_token`, else the first of
    /// [`EOD_CANDIDATES`] it knows; none for `bytes`).
    pub fn load(source: &TokenizerSource, eod_token: Option<&str>) -> Result<DocumentTokenizer> {
        let path = match source {
            TokenizerSource::Bytes => {
                if eod_token.is_some() {
                    return Err(PrepareError::EodWithBytes);
                }
                return Ok(DocumentTokenizer {
                    kind: Kind::Bytes,
                    eod: None,
                    vocab: ByteTokenizer::VOCAB as u64,
                });
            }
            TokenizerSource::File(path) => path,
        };
        let bad = |message: String| PrepareError::Tokenizer {
            path: path.clone(),
            message,
        };
        let text = fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let mut tokenizer = Tokenizer::from_str(&text).map_err(|e| bad(one_line(&*e)))?;
        // A tokenizer.json made for inference may truncate (e.g. to 512 tokens) or pad: a
        // document must be encoded whole and as it is.
        tokenizer
            .with_truncation(None)
            .map_err(|e| bad(one_line(&*e)))?;
        tokenizer.with_padding(None);
        let vocab = tokenizer
            .get_vocab(true)
            .values()
            .map(|&id| u64::from(id) + 1)
            .max()
            .unwrap_or(0)
            .max(tokenizer.get_vocab_size(true) as u64);
        let eod = match eod_token {
            Some(token) => {
                let id =
                    tokenizer
                        .token_to_id(token)
                        .ok_or_else(|| PrepareError::UnknownEodToken {
                            path: path.clone(),
                            token: token.to_owned(),
                        })?;
                (token.to_owned(), id)
            }
            None => EOD_CANDIDATES
                .iter()
                .find_map(|t| tokenizer.token_to_id(t).map(|id| ((*t).to_owned(), id)))
                .ok_or_else(|| PrepareError::NoEodToken { path: path.clone() })?,
        };
        Ok(DocumentTokenizer {
            kind: Kind::File {
                path: path.clone(),
                tokenizer: Box::new(tokenizer),
            },
            eod: Some(eod),
            vocab,
        })
    }

    /// The vocabulary size (the largest id + 1, added tokens included).
    pub fn vocab(&self) -> u64 {
        self.vocab
    }

    /// The EOD token and its id (`None` for `bytes`).
    pub fn eod(&self) -> Option<(&str, u32)> {
        self.eod.as_ref().map(|(t, id)| (t.as_str(), *id))
    }

    /// uint16 when the vocabulary is at most 65,536, else int32.
    pub fn dtype(&self) -> TokenDtype {
        if self.vocab <= U16_MAX_VOCAB {
            TokenDtype::U16
        } else {
            TokenDtype::I32
        }
    }

    /// The tokenizer file (`None` for `bytes`).
    pub fn path(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Bytes => None,
            Kind::File { path, .. } => Some(path),
        }
    }

    /// Appends the sequence of `text` (its tokens, then the EOD if any) to `out`; `at` names
    /// the document in an error.
    pub fn encode_document(&self, text: &str, at: &Location, out: &mut Vec<u32>) -> Result<()> {
        match &self.kind {
            Kind::Bytes => out.extend(text.bytes().map(u32::from)),
            Kind::File { tokenizer, .. } => {
                let encoding =
                    tokenizer
                        .encode_fast(text, false)
                        .map_err(|e| PrepareError::Encode {
                            at: at.clone(),
                            message: one_line(&*e),
                        })?;
                out.extend_from_slice(encoding.get_ids());
            }
        }
        if let Some((_, id)) = self.eod {
            out.push(id);
        }
        Ok(())
    }

    /// The text of `tokens` (a sequence without its EOD): the inverse of
    /// [`Self::encode_document`] for byte-level tokenizers.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        match &self.kind {
            Kind::Bytes => Ok(ByteTokenizer::decode(tokens)),
            Kind::File { path, tokenizer } => {
                tokenizer
                    .decode(tokens, false)
                    .map_err(|e| PrepareError::Tokenizer {
                        path: path.clone(),
                        message: one_line(&*e),
                    })
            }
        }
    }
}

/// An error's message and its causes on one line.
fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cause = c.source();
    }
    s.replace('\n', " ")
}

/// The kind of an input file, from its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputKind {
    Txt,
    Jsonl,
}

impl InputKind {
    fn of(path: &Path) -> Result<InputKind> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("txt") => Ok(InputKind::Txt),
            Some("jsonl") => Ok(InputKind::Jsonl),
            _ => Err(PrepareError::UnsupportedInput {
                path: path.to_path_buf(),
            }),
        }
    }
}

/// Checks every input exists, is a regular file and has a supported extension; returns their
/// total size in bytes.
fn check_inputs(inputs: &[PathBuf]) -> Result<u64> {
    let mut total = 0u64;
    for path in inputs {
        let meta = fs::metadata(path).map_err(io(path))?;
        if !meta.is_file() {
            return Err(PrepareError::NotAFile { path: path.clone() });
        }
        InputKind::of(path)?;
        total = total.saturating_add(meta.len());
    }
    if inputs.is_empty() {
        return Err(PrepareError::Empty {
            inputs: "(no inputs)".to_owned(),
        });
    }
    Ok(total)
}

/// Checks an output file's directory exists and the path is not a directory.
fn check_output(out: &Path) -> Result<()> {
    let trailing_separator = out
        .as_os_str()
        .as_encoded_bytes()
        .last()
        .is_some_and(|&b| std::path::is_separator(char::from(b)));
    if out.file_name().is_none() || trailing_separator || out.is_dir() {
        return Err(PrepareError::OutIsDir {
            path: out.to_path_buf(),
        });
    }
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(PrepareError::NoOutputDir {
            dir: dir.to_path_buf(),
        });
    }
    Ok(())
}

fn input_list(inputs: &[PathBuf]) -> String {
    inputs
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One document read from the inputs.
#[derive(Debug)]
pub(crate) struct Document {
    pub(crate) text: String,
    pub(crate) at: Location,
    /// Input bytes consumed since the previous document (for progress).
    pub(crate) bytes: u64,
}

/// The documents of the inputs, in order; stops after the first error.
pub(crate) struct Documents {
    inputs: std::vec::IntoIter<PathBuf>,
    jsonl: Option<JsonlReader>,
    failed: bool,
}

struct JsonlReader {
    path: PathBuf,
    reader: BufReader<File>,
    line: u64,
    buf: Vec<u8>,
    pending_bytes: u64,
}

impl Documents {
    pub(crate) fn new(inputs: Vec<PathBuf>) -> Documents {
        Documents {
            inputs: inputs.into_iter(),
            jsonl: None,
            failed: false,
        }
    }

    fn advance(&mut self) -> Option<Result<Document>> {
        loop {
            if let Some(jsonl) = &mut self.jsonl {
                match jsonl.next_document() {
                    Some(doc) => return Some(doc),
                    None => self.jsonl = None,
                }
            }
            let path = self.inputs.next()?;
            match InputKind::of(&path) {
                Err(e) => return Some(Err(e)),
                Ok(InputKind::Txt) => return Some(read_txt(path)),
                Ok(InputKind::Jsonl) => match File::open(&path) {
                    Ok(file) => {
                        self.jsonl = Some(JsonlReader {
                            path,
                            reader: BufReader::with_capacity(1 << 20, file),
                            line: 0,
                            buf: Vec::new(),
                            pending_bytes: 0,
                        })
                    }
                    Err(source) => return Some(Err(PrepareError::Io { path, source })),
                },
            }
        }
    }
}

impl Iterator for Documents {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Result<Document>> {
        if self.failed {
            return None;
        }
        let next = self.advance();
        if matches!(next, Some(Err(_))) {
            self.failed = true;
        }
        next
    }
}

fn read_txt(path: PathBuf) -> Result<Document> {
    let bytes = fs::read(&path).map_err(io(&path))?;
    let len = bytes.len() as u64;
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Document {
            text,
            at: Location { path, line: None },
            bytes: len,
        }),
        Err(e) => Err(PrepareError::NotUtf8 {
            offset: e.utf8_error().valid_up_to() as u64,
            at: Location { path, line: None },
        }),
    }
}

impl JsonlReader {
    fn next_document(&mut self) -> Option<Result<Document>> {
        loop {
            self.buf.clear();
            let n = match self.reader.read_until(b'\n', &mut self.buf) {
                Ok(n) => n,
                Err(source) => {
                    return Some(Err(PrepareError::Io {
                        path: self.path.clone(),
                        source,
                    }));
                }
            };
            if n == 0 {
                return None;
            }
            self.line += 1;
            self.pending_bytes += n as u64;
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let at = Location {
                path: self.path.clone(),
                line: Some(self.line),
            };
            let text = match std::str::from_utf8(&self.buf) {
                Ok(text) => text,
                Err(e) => {
                    return Some(Err(PrepareError::NotUtf8 {
                        at,
                        offset: e.valid_up_to() as u64,
                    }));
                }
            };
            // Without its line ending, so an error's column is on this line.
            let text = text.trim_end_matches(['\n', '\r']);
            let value: serde_json::Value = match serde_json::from_str(text) {
                Ok(value) => value,
                Err(e) => {
                    // serde_json ends its message with "at line 1 column C": keep the column.
                    let message = e.to_string();
                    let message = message.split(" at line ").next().unwrap_or(&message);
                    return Some(Err(PrepareError::BadJson {
                        message: format!("{message} at column {}", e.column()),
                        at,
                    }));
                }
            };
            let text = match value {
                serde_json::Value::Object(mut map) => match map.remove("text") {
                    Some(serde_json::Value::String(text)) => text,
                    _ => return Some(Err(PrepareError::NoText { at })),
                },
                _ => return Some(Err(PrepareError::NoText { at })),
            };
            let bytes = std::mem::take(&mut self.pending_bytes);
            return Some(Ok(Document { text, at, bytes }));
        }
    }
}

/// What `lzrun prepare` does.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub tokenizer: TokenizerSource,
    pub inputs: Vec<PathBuf>,
    /// The dataset prefix: `PREFIX.bin` and `PREFIX.idx` are written.
    pub out: PathBuf,
    pub eod_token: Option<String>,
}

/// Progress so far, reported after each document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub bytes_read: u64,
    pub total_bytes: u64,
    pub documents: u64,
    pub tokens: u64,
}

/// What a prepare wrote.
#[derive(Debug, Clone)]
pub struct PrepareSummary {
    pub bin_path: PathBuf,
    pub idx_path: PathBuf,
    /// Documents written (one sequence each).
    pub documents: u64,
    /// Empty documents skipped.
    pub empty: u64,
    /// Tokens written, EOD tokens included.
    pub tokens: u64,
    pub bin_bytes: u64,
    pub dtype: TokenDtype,
    pub vocab: u64,
    pub eod: Option<(String, u32)>,
    pub elapsed: Duration,
}

impl PrepareSummary {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Removes the temporary files unless disarmed.
struct TempFiles(Vec<PathBuf>);

impl Drop for TempFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

/// Tokenizes `opts.inputs` into `opts.out` (`PREFIX.bin` + `PREFIX.idx`); see the module docs.
/// `progress` is called after each document.
pub fn prepare(
    opts: &PrepareOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PrepareSummary> {
    let start = Instant::now();
    check_output(&opts.out)?;
    let total_bytes = check_inputs(&opts.inputs)?;
    let tokenizer = DocumentTokenizer::load(&opts.tokenizer, opts.eod_token.as_deref())?;
    let dtype = tokenizer.dtype();

    let bin_path = with_suffix(&opts.out, ".bin");
    let idx_path = with_suffix(&opts.out, ".idx");
    let bin_tmp = with_suffix(&bin_path, ".tmp");
    let idx_tmp = with_suffix(&idx_path, ".tmp");
    let mut temp = TempFiles(vec![bin_tmp.clone(), idx_tmp.clone()]);
    let mut writer = IndexedWriter::create_at(&bin_tmp, &idx_tmp, dtype)?;

    let mut p = Progress {
        bytes_read: 0,
        total_bytes,
        documents: 0,
        tokens: 0,
    };
    let mut empty = 0u64;
    let mut sequence = Vec::new();
    for doc in Documents::new(opts.inputs.clone()) {
        let doc = doc?;
        p.bytes_read += doc.bytes;
        if doc.text.is_empty() {
            empty += 1;
            progress(p);
            continue;
        }
        sequence.clear();
        tokenizer.encode_document(&doc.text, &doc.at, &mut sequence)?;
        writer.add_document(&sequence)?;
        p.documents += 1;
        p.tokens += sequence.len() as u64;
        progress(p);
    }
    if p.tokens == 0 {
        return Err(PrepareError::Empty {
            inputs: input_list(&opts.inputs),
        });
    }
    writer.finish()?;
    let bin_bytes = fs::metadata(&bin_tmp).map_err(io(&bin_tmp))?.len();
    fs::rename(&bin_tmp, &bin_path).map_err(io(&bin_path))?;
    fs::rename(&idx_tmp, &idx_path).map_err(io(&idx_path))?;
    temp.0.clear();
    // Make the renames durable (best effort: not every file system syncs directories).
    if let Some(dir) = opts.out.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(PrepareSummary {
        bin_path,
        idx_path,
        documents: p.documents,
        empty,
        tokens: p.tokens,
        bin_bytes,
        dtype,
        vocab: tokenizer.vocab(),
        eod: tokenizer.eod().map(|(t, id)| (t.to_owned(), id)),
        elapsed: start.elapsed(),
    })
}

/// What `lzrun tokenizer` does.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// The vocabulary size to train to (byte tokens and `<|endoftext|>` included).
    pub vocab: usize,
    pub inputs: Vec<PathBuf>,
    /// The `tokenizer.json` to write.
    pub out: PathBuf,
}

/// What a tokenizer training wrote.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub out: PathBuf,
    /// The trained vocabulary (smaller than asked when the text has too few pairs to merge).
    pub vocab: usize,
    pub documents: u64,
    pub bytes: u64,
    pub elapsed: Duration,
}

/// The documents as strings for the trainer, which takes a plain iterator: the first error is
/// kept aside and ends the iteration.
struct TrainerFeed<'a> {
    documents: Documents,
    error: &'a mut Option<PrepareError>,
    count: &'a mut u64,
    bytes: &'a mut u64,
}

impl Iterator for TrainerFeed<'_> {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        loop {
            match self.documents.next()? {
                Ok(doc) => {
                    *self.bytes += doc.bytes;
                    if doc.text.is_empty() {
                        continue;
                    }
                    *self.count += 1;
                    return Some(doc.text);
                }
                Err(e) => {
                    *self.error = Some(e);
                    return None;
                }
            }
        }
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2 style: byte-level pre-tokenizer with its split
/// regex, no prefix space, no normalizer, byte-level decoder; `<|endoftext|>` is id 0 and a
/// special token) on the documents of `opts.inputs` (read as [`prepare`] reads them) and writes
/// it as a `tokenizer.json` (atomically: `OUT.tmp`, then a rename). Decoding its encoding of
/// any text gives the text back.
pub fn train_tokenizer(opts: &TrainOptions) -> Result<TrainSummary> {
    let start = Instant::now();
    if !(MIN_TRAIN_VOCAB..=MAX_TRAIN_VOCAB).contains(&opts.vocab) {
        return Err(PrepareError::VocabOutOfRange { vocab: opts.vocab });
    }
    check_output(&opts.out)?;
    check_inputs(&opts.inputs)?;
    let train_err = |e: tokenizers::Error| PrepareError::Train {
        message: one_line(&*e),
    };

    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
    .with_post_processor(None)
    .with_decoder(Some(ByteLevel::new(false, true, true).into()))
    .build()
    .map_err(train_err)?;
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainer::builder()
        .vocab_size(opts.vocab)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(TRAINED_EOD, true)])
        .initial_alphabet(alphabet)
        .build();

    let (mut error, mut documents, mut bytes) = (None, 0u64, 0u64);
    let feed = TrainerFeed {
        documents: Documents::new(opts.inputs.clone()),
        error: &mut error,
        count: &mut documents,
        bytes: &mut bytes,
    };
    tokenizer.train(&mut trainer, feed).map_err(train_err)?;
    if let Some(e) = error {
        return Err(e);
    }
    if documents == 0 {
        return Err(PrepareError::Empty {
            inputs: input_list(&opts.inputs),
        });
    }

    let tmp = with_suffix(&opts.out, ".tmp");
    let mut temp = TempFiles(vec![tmp.clone()]);
    tokenizer.save(&tmp, true).map_err(|e| PrepareError::Io {
        path: tmp.clone(),
        source: std::io::Error::other(one_line(&*e)),
    })?;
    // Read back what was written: the file must load as a `tokenizer.json`.
    let saved = Tokenizer::from_file(&tmp).map_err(|e| PrepareError::Tokenizer {
        path: tmp.clone(),
        message: one_line(&*e),
    })?;
    fs::rename(&tmp, &opts.out).map_err(io(&opts.out))?;
    temp.0.clear();
    Ok(TrainSummary {
        out: opts.out.clone(),
        vocab: saved.get_vocab_size(true),
        documents,
        bytes,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::IndexedDataset;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lz-prepare-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    const DOCS: [&str; 4] = [
        "The quick brown fox jumps over the lazy dog.\nTwice: the quick brown fox.",
        "Experts fail; replicas survive. Experts fail; replicas survive!",
        "  leading spaces, tabs\tand unicode: naïve café — 多专家 🚀\n\n",
        "<|endoftext|> inside a document stays a token of its own.",
    ];

    fn train(dir: &Path, vocab: usize) -> PathBuf {
        let corpus = dir.join("corpus.txt");
        fs::write(&corpus, DOCS.concat().repeat(4)).unwrap();
        let out = dir.join("tokenizer.json");
        let summary = train_tokenizer(&TrainOptions {
            vocab,
            inputs: vec![corpus],
            out: out.clone(),
        })
        .unwrap();
        assert!(summary.vocab > 257 && summary.vocab <= vocab, "{summary:?}");
        assert_eq!(summary.documents, 1);
        out
    }

    #[test]
    fn trained_tokenizer_round_trips_and_has_eod_first() {
        let dir = scratch("train");
        let path = train(&dir, 400);
        let tok = DocumentTokenizer::load(&TokenizerSource::File(path), None).unwrap();
        assert_eq!(tok.eod(), Some((TRAINED_EOD, 0)));
        assert_eq!(tok.dtype(), TokenDtype::U16);
        for doc in DOCS {
            let mut ids = Vec::new();
            let at = Location {
                path: "x".into(),
                line: None,
            };
            tok.encode_document(doc, &at, &mut ids).unwrap();
            assert_eq!(ids.pop(), Some(0));
            assert!(ids.len() < doc.len(), "no merges learned: {ids:?}");
            assert_eq!(tok.decode(&ids).unwrap(), doc);
        }
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn prepare_jsonl_one_sequence_per_document() {
        let dir = scratch("jsonl");
        let tokenizer = train(&dir, 300);
        let input = dir.join("docs.jsonl");
        let mut lines = String::new();
        for (i, doc) in DOCS.iter().enumerate() {
            lines.push_str(&serde_json::json!({"id": i, "text": doc}).to_string());
            lines.push_str("\n\n");
        }
        lines.push_str("{\"text\": \"\"}\n");
        fs::write(&input, lines).unwrap();
        let out = dir.join("ds");
        let mut calls = Vec::new();
        let summary = prepare(
            &PrepareOptions {
                tokenizer: TokenizerSource::File(tokenizer.clone()),
                inputs: vec![input],
                out: out.clone(),
                eod_token: None,
            },
            &mut |p| calls.push(p),
        )
        .unwrap();
        assert_eq!((summary.documents, summary.empty), (4, 1));
        assert_eq!(calls.len(), 5);
        assert_eq!(calls.last().unwrap().bytes_read, calls[0].total_bytes);
        let ds = IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();
        assert_eq!((ds.num_sequences(), ds.num_documents()), (4, 4));
        assert_eq!(ds.num_tokens(), summary.tokens);
        let tok = DocumentTokenizer::load(&TokenizerSource::File(tokenizer), None).unwrap();
        for (i, doc) in DOCS.iter().enumerate() {
            assert_eq!(
                ds.document(i as u64).unwrap(),
                ds.sequence(i as u64).unwrap()
            );
            let mut ids = ds.tokens(ds.sequence(i as u64).unwrap()).unwrap();
            assert_eq!(ids.pop(), Some(0));
            assert_eq!(tok.decode(&ids).unwrap(), *doc);
        }
        assert!(!with_suffix(&out, ".bin.tmp").exists());
        assert!(!with_suffix(&out, ".idx.tmp").exists());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bytes_writes_no_eod_and_refuses_one() {
        let dir = scratch("bytes");
        let input = dir.join("a.txt");
        fs::write(&input, DOCS[2]).unwrap();
        let out = dir.join("ds");
        let opts = PrepareOptions {
            tokenizer: TokenizerSource::Bytes,
            inputs: vec![input],
            out: out.clone(),
            eod_token: None,
        };
        let summary = prepare(&opts, &mut |_| {}).unwrap();
        assert_eq!(summary.tokens, DOCS[2].len() as u64);
        assert_eq!(summary.eod, None);
        let ds = crate::dataset::TokenDataset::open_indexed(&out, Some(TokenDtype::U16)).unwrap();
        ds.check_vocab(256).unwrap();
        assert_eq!(
            ByteTokenizer::decode(&ds.tokens(0..ds.num_tokens()).unwrap()),
            DOCS[2]
        );
        let err = prepare(
            &PrepareOptions {
                eod_token: Some("\n".into()),
                ..opts
            },
            &mut |_| {},
        )
        .unwrap_err();
        assert!(matches!(err, PrepareError::EodWithBytes), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn jsonl_errors_name_file_and_line() {
        let dir = scratch("badjsonl");
        let cases: [(&str, &str); 5] = [
            (
                "{\"text\": \"a\"}\n{\"text\": 3}\n",
                ":2: no string \"text\" field",
            ),
            (
                "{\"text\": \"a\"}\n\n{\"txt\": \"b\"}\n",
                ":3: no string \"text\" field",
            ),
            ("[1, 2]\n", ":1: no string \"text\" field"),
            (
                "{\"text\": \"a\"}\n{\"text\": \"b\"\n",
                ":2: not valid JSON",
            ),
            ("{\"text\": \"\u{e9}\"}\n", ""),
        ];
        for (i, (body, want)) in cases.iter().enumerate() {
            let input = dir.join(format!("c{i}.jsonl"));
            fs::write(&input, body).unwrap();
            let res = prepare(
                &PrepareOptions {
                    tokenizer: TokenizerSource::Bytes,
                    inputs: vec![input.clone()],
                    out: dir.join(format!("ds{i}")),
                    eod_token: None,
                },
                &mut |_| {},
            );
            if want.is_empty() {
                res.unwrap();
                continue;
            }
            let msg = res.unwrap_err().to_string();
            let expected = format!("{}{want}", input.display());
            assert!(msg.starts_with(&expected), "{msg:?} vs {expected:?}");
            assert!(!msg.contains('\n'));
        }
        let bad_utf8 = dir.join("bad.jsonl");
        fs::write(&bad_utf8, b"{\"text\": \"ok\"}\n{\"text\": \"\xff\"}\n").unwrap();
        let err = prepare(
            &PrepareOptions {
                tokenizer: TokenizerSource::Bytes,
                inputs: vec![bad_utf8.clone()],
                out: dir.join("ds"),
                eod_token: None,
            },
            &mut |_| {},
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:2: not UTF-8 text (invalid byte at offset 10)",
                bad_utf8.display()
            )
        );
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn dtype_rule() {
        let tok = |vocab| DocumentTokenizer {
            kind: Kind::Bytes,
            eod: None,
            vocab,
        };
        assert_eq!(tok(256).dtype(), TokenDtype::U16);
        assert_eq!(tok(65_536).dtype(), TokenDtype::U16);
        assert_eq!(tok(65_537).dtype(), TokenDtype::I32);
        assert_eq!(tok(151_936).dtype(), TokenDtype::I32);
    }

    #[test]
    fn output_checks() {
        let dir = scratch("out");
        assert!(matches!(
            check_output(&dir.join("missing/ds")),
            Err(PrepareError::NoOutputDir { .. })
        ));
        assert!(matches!(
            check_output(&dir),
            Err(PrepareError::OutIsDir { .. })
        ));
        let mut slash = dir.join("x").into_os_string();
        slash.push("/");
        assert!(matches!(
            check_output(Path::new(&slash)),
            Err(PrepareError::OutIsDir { .. })
        ));
        check_output(&dir.join("ds")).unwrap();
        check_output(Path::new("ds")).unwrap();
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn vocab_bounds() {
        let err = train_tokenizer(&TrainOptions {
            vocab: 256,
            inputs: vec![],
            out: "t.json".into(),
        })
        .unwrap_err();
        assert!(matches!(err, PrepareError::VocabOutOfRange { vocab: 256 }));
    }
}
