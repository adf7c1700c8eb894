//! Flat token files: little-endian token ids, nothing else (`train.bin`).

use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{Bytes, DatasetError, Result, TokenDtype, TokenStream};

/// A mapped flat token file.
pub struct FlatTokens {
    pub(crate) stream: TokenStream,
}

impl FlatTokens {
    /// Maps `path` as tokens of `dtype` (the file does not say; the caller does).
    pub fn open(path: impl AsRef<Path>, dtype: TokenDtype) -> Result<FlatTokens> {
        let path = path.as_ref();
        FlatTokens::from_bytes(path.to_path_buf(), dtype, Bytes::map(path)?)
    }

    /// The same checks on bytes in memory (`path` only names them in errors).
    pub fn from_memory(path: PathBuf, dtype: TokenDtype, bytes: Vec<u8>) -> Result<FlatTokens> {
        FlatTokens::from_bytes(path, dtype, Bytes::Owned(bytes))
    }

    fn from_bytes(path: PathBuf, dtype: TokenDtype, bytes: Bytes) -> Result<FlatTokens> {
        let stream = TokenStream::new(path, dtype, bytes)?;
        if stream.num_tokens == 0 {
            return Err(DatasetError::Empty { path: stream.path });
        }
        Ok(FlatTokens { stream })
    }

    pub fn path(&self) -> &Path {
        &self.stream.path
    }

    pub fn num_tokens(&self) -> u64 {
        self.stream.num_tokens
    }

    pub fn tokens(&self, range: Range<u64>) -> Result<Vec<u32>> {
        self.stream.tokens(range)
    }

    /// The whole file as item 0 (its only sequence and document).
    pub(crate) fn whole(&self, index: u64, what: &'static str) -> Result<Range<u64>> {
        if index == 0 {
            Ok(0..self.stream.num_tokens)
        } else {
            Err(DatasetError::NoSuchItem {
                path: self.stream.path.clone(),
                what,
                index,
                count: 1,
            })
        }
    }
}

/// Writes `tokens` to `path` as a flat file of `dtype` (each token must fit).
pub fn write_flat(path: impl AsRef<Path>, dtype: TokenDtype, tokens: &[u32]) -> Result<()> {
    let path = path.as_ref();
    let mut bytes = Vec::with_capacity(tokens.len().saturating_mul(dtype.size()));
    for &token in tokens {
        if !dtype.fits(token) {
            return Err(DatasetError::TokenDoesNotFit {
                path: path.to_path_buf(),
                token,
                dtype,
            });
        }
        dtype.encode(token, &mut bytes);
    }
    let io = |source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::create(path).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)
}
