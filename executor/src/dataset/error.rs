//! The dataset errors. Every message names the file and, where one exists, the byte offset
//! and/or the sequence (or document-index entry) at fault.

use std::path::PathBuf;

use super::TokenDtype;

/// What can go wrong opening, reading or writing a token dataset.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{}: {tokens} tokens, fewer than one training sequence of seq_len + 1 = {needed}", .path.display())]
    TooShort {
        path: PathBuf,
        tokens: u64,
        needed: u64,
    },
    /// A mapped file changed while the job ran (truncated, rewritten): a storage fault, not
    /// something a retry of the step can mend.
    #[error(
        "{}: the file changed while the job was using it ({was} bytes when opened, {now} now); \
         training data must not change under a running job",
        .path.display()
    )]
    Changed { path: PathBuf, was: u64, now: u64 },
    #[error("the data blend: {0}")]
    Order(#[from] lazarus_planner::data::DataPlanError),
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: index is {len} bytes, shorter than the {header}-byte header (magic, version, dtype, counts)",
        .path.display()
    )]
    ShortHeader {
        path: PathBuf,
        len: u64,
        header: u64,
    },
    #[error("{}: bad magic at byte 0 (expected b\"MMIDIDX\\x00\\x00\", a Megatron-LM indexed dataset)", .path.display())]
    BadMagic { path: PathBuf },
    #[error("{}: unsupported index version {version} at byte 9 (only version 1 is read)", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u64 },
    #[error("{}: unknown dtype code {code} at byte 17", .path.display())]
    UnknownDtypeCode { path: PathBuf, code: u8 },
    #[error(
        "{}: dtype {name} (code {code} at byte 17) is not a supported token dtype (uint8, uint16, int32, int64)",
        .path.display()
    )]
    UnsupportedDtype {
        path: PathBuf,
        name: &'static str,
        code: u8,
    },
    #[error("{}: tokens are {found}, but {expected} was expected", .path.display())]
    DtypeMismatch {
        path: PathBuf,
        expected: TokenDtype,
        found: TokenDtype,
    },
    #[error(
        "{}: header (bytes 18..34) declares {sequences} sequences and {documents} document-index entries, \
         which need {needed} bytes, but the index is {len} bytes (truncated or corrupt)",
        .path.display()
    )]
    CountsExceedFile {
        path: PathBuf,
        sequences: u64,
        documents: u64,
        needed: u128,
        len: u64,
    },
    #[error(
        "{}: {} bytes of trailing data from byte {offset} (index ends there; newer multimodal writers append \
         sequence modes, which this reader does not support)",
        .path.display(), .len - .offset
    )]
    TrailingData {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    #[error("{}: sequence {sequence} has negative length {length} (byte {offset})", .path.display())]
    NegativeLength {
        path: PathBuf,
        sequence: u64,
        offset: u64,
        length: i32,
    },
    #[error(
        "{}: sequence {sequence} has pointer {pointer} (byte {offset}), expected {expected}: pointers must \
         increase contiguously from 0 by each sequence's length in bytes",
        .path.display()
    )]
    PointerMismatch {
        path: PathBuf,
        sequence: u64,
        offset: u64,
        pointer: i64,
        expected: u64,
    },
    #[error(
        "{}: sequence {sequence} (pointer at byte {offset}) ends at byte {end}, past the end of {} ({bin_len} bytes)",
        .path.display(), .bin_path.display()
    )]
    PastEndOfBin {
        path: PathBuf,
        sequence: u64,
        offset: u64,
        end: u128,
        bin_path: PathBuf,
        bin_len: u64,
    },
    #[error(
        "{}: the index covers {covered} bytes but the file is {len} bytes (bytes from {covered} on belong to no sequence)",
        .path.display()
    )]
    BinNotCovered {
        path: PathBuf,
        covered: u64,
        len: u64,
    },
    #[error("{}: document index is empty (byte {offset}); it must start at 0 and end at the sequence count", .path.display())]
    DocIndexEmpty { path: PathBuf, offset: u64 },
    #[error("{}: document index starts at {value} (byte {offset}), not 0", .path.display())]
    DocIndexStart {
        path: PathBuf,
        offset: u64,
        value: i64,
    },
    #[error(
        "{}: document index entry {entry} is {value} (byte {offset}), less than the previous entry {previous}",
        .path.display()
    )]
    DocIndexDecreasing {
        path: PathBuf,
        entry: u64,
        offset: u64,
        value: i64,
        previous: i64,
    },
    #[error(
        "{}: document index ends at {value} (byte {offset}), not at the sequence count {sequences}",
        .path.display()
    )]
    DocIndexEnd {
        path: PathBuf,
        offset: u64,
        value: i64,
        sequences: u64,
    },
    #[error("{}: size {len} bytes is not a multiple of the {dtype} token size ({} bytes)", .path.display(), .dtype.size())]
    NotMultipleOfDtype {
        path: PathBuf,
        len: u64,
        dtype: TokenDtype,
    },
    #[error("{}: the dataset has no tokens", .path.display())]
    Empty { path: PathBuf },
    #[error(
        "{}: token {value} at byte {offset} is not a valid token id (must be in 0..=4294967295)",
        .path.display()
    )]
    InvalidToken {
        path: PathBuf,
        offset: u64,
        value: i64,
    },
    #[error(
        "{}: token id {token} at byte {offset} (token {index}, sequence {sequence}) is >= the vocabulary size {vocab}",
        .path.display()
    )]
    TokenOutOfVocab {
        path: PathBuf,
        offset: u64,
        index: u64,
        sequence: u64,
        token: u32,
        vocab: u32,
    },
    #[error("{}: token range {start}..{end} is outside the dataset's {num_tokens} tokens", .path.display())]
    OutOfRange {
        path: PathBuf,
        start: u64,
        end: u64,
        num_tokens: u64,
    },
    #[error("{}: {what} {index} does not exist (there are {count})", .path.display())]
    NoSuchItem {
        path: PathBuf,
        what: &'static str,
        index: u64,
        count: u64,
    },
    #[error("{}: token {token} does not fit the {dtype} dtype", .path.display())]
    TokenDoesNotFit {
        path: PathBuf,
        token: u32,
        dtype: TokenDtype,
    },
    #[error("{}: sequence {sequence} has {len} tokens, more than an int32 length can hold", .path.display())]
    SequenceTooLong {
        path: PathBuf,
        sequence: u64,
        len: usize,
    },
    #[error("{}: {dtype} has no Megatron-LM dtype code (use uint16 or int32)", .path.display())]
    NoMegatronCode { path: PathBuf, dtype: TokenDtype },
}

/// Result of the dataset functions.
pub type Result<T> = std::result::Result<T, DatasetError>;
