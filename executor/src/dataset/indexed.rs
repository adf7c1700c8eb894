//! Megatron-LM indexed datasets (`PREFIX.bin` + `PREFIX.idx`): reader and writer. The layout is
//! in the module docs of [`super`].

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{Bytes, DatasetError, Result, TokenDtype, TokenStream};

/// The 9 magic bytes that open a `.idx`.
pub const IDX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Bytes before the lengths array: magic 9, version 8, dtype 1, two counts 8 + 8.
pub const IDX_HEADER_LEN: u64 = 34;
const VERSION: u64 = 1;

pub(crate) fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = OsString::from(prefix.as_os_str());
    s.push(suffix);
    PathBuf::from(s)
}

fn read_array<const N: usize>(bytes: &[u8], offset: u64) -> Option<[u8; N]> {
    let start = usize::try_from(offset).ok()?;
    bytes.get(start..start.checked_add(N)?)?.try_into().ok()
}

fn u64_at(bytes: &[u8], offset: u64) -> Option<u64> {
    read_array(bytes, offset).map(u64::from_le_bytes)
}

fn i64_at(bytes: &[u8], offset: u64) -> Option<i64> {
    read_array(bytes, offset).map(i64::from_le_bytes)
}

fn i32_at(bytes: &[u8], offset: u64) -> Option<i32> {
    read_array(bytes, offset).map(i32::from_le_bytes)
}

/// A mapped, validated Megatron-LM indexed dataset. The index stays mapped too: sequence and
/// document lookups read it in place.
pub struct IndexedDataset {
    idx_path: PathBuf,
    pub(crate) idx: Bytes,
    pub(crate) bin: TokenStream,
    sequences: u64,
    doc_entries: u64,
    pointers_at: u64,
    docs_at: u64,
}

impl IndexedDataset {
    /// Maps and validates `PREFIX.idx` and `PREFIX.bin`. `expected`, if given, must be the
    /// index's dtype.
    pub fn open(prefix: impl AsRef<Path>, expected: Option<TokenDtype>) -> Result<IndexedDataset> {
        let prefix = prefix.as_ref();
        let idx_path = with_suffix(prefix, ".idx");
        let bin_path = with_suffix(prefix, ".bin");
        let idx = Bytes::map(&idx_path)?;
        // The header first, so a bad index is reported before a missing `.bin`.
        parse_header(&idx_path, idx.as_slice(), expected)?;
        let bin = Bytes::map(&bin_path)?;
        IndexedDataset::validate(idx_path, idx, bin_path, bin, expected)
    }

    /// The same checks on bytes in memory (`prefix` only names them in errors): for tests and
    /// fuzzing.
    pub fn from_memory(
        prefix: impl AsRef<Path>,
        idx: Vec<u8>,
        bin: Vec<u8>,
        expected: Option<TokenDtype>,
    ) -> Result<IndexedDataset> {
        let prefix = prefix.as_ref();
        IndexedDataset::validate(
            with_suffix(prefix, ".idx"),
            Bytes::Owned(idx),
            with_suffix(prefix, ".bin"),
            Bytes::Owned(bin),
            expected,
        )
    }

    fn validate(
        idx_path: PathBuf,
        idx: Bytes,
        bin_path: PathBuf,
        bin: Bytes,
        expected: Option<TokenDtype>,
    ) -> Result<IndexedDataset> {
        let header = parse_header(&idx_path, idx.as_slice(), expected)?;
        let bytes = idx.as_slice();
        let bin = TokenStream::new(bin_path, header.dtype, bin)?;
        let bin_len = bin.bytes.as_slice().len() as u64;
        let size = header.dtype.size() as u64;
        let n = header.sequences;
        // Sizes fit (checked in parse_header), so these offsets cannot overflow.
        let lengths_at = IDX_HEADER_LEN;
        let pointers_at = lengths_at + 4 * n;
        let docs_at = pointers_at + 8 * n;
        let truncated = |offset: u64| DatasetError::CountsExceedFile {
            path: idx_path.clone(),
            sequences: n,
            documents: header.doc_entries,
            needed: u128::from(offset) + 8,
            len: bytes.len() as u64,
        };

        // Lengths and pointers: contiguous from 0, inside `.bin`.
        let mut expected_pointer: u64 = 0;
        for i in 0..n {
            let length_offset = lengths_at + 4 * i;
            let length = i32_at(bytes, length_offset).ok_or_else(|| truncated(length_offset))?;
            if length < 0 {
                return Err(DatasetError::NegativeLength {
                    path: idx_path,
                    sequence: i,
                    offset: length_offset,
                    length,
                });
            }
            let pointer_offset = pointers_at + 8 * i;
            let pointer = i64_at(bytes, pointer_offset).ok_or_else(|| truncated(pointer_offset))?;
            if u64::try_from(pointer).ok() != Some(expected_pointer) {
                if pointer > 0 && pointer as u64 > bin_len {
                    return Err(DatasetError::PastEndOfBin {
                        path: idx_path,
                        sequence: i,
                        offset: pointer_offset,
                        end: pointer as u128,
                        bin_path: bin.path.clone(),
                        bin_len,
                    });
                }
                return Err(DatasetError::PointerMismatch {
                    path: idx_path,
                    sequence: i,
                    offset: pointer_offset,
                    pointer,
                    expected: expected_pointer,
                });
            }
            let end = u128::from(expected_pointer) + u128::from(length as u64) * u128::from(size);
            if end > u128::from(bin_len) {
                return Err(DatasetError::PastEndOfBin {
                    path: idx_path,
                    sequence: i,
                    offset: pointer_offset,
                    end,
                    bin_path: bin.path.clone(),
                    bin_len,
                });
            }
            expected_pointer = end as u64;
        }
        if expected_pointer != bin_len {
            return Err(DatasetError::BinNotCovered {
                path: bin.path.clone(),
                covered: expected_pointer,
                len: bin_len,
            });
        }

        // Document index: 0, non-decreasing, ends at the sequence count.
        if header.doc_entries == 0 {
            return Err(DatasetError::DocIndexEmpty {
                path: idx_path,
                offset: docs_at,
            });
        }
        let mut previous: i64 = 0;
        for entry in 0..header.doc_entries {
            let offset = docs_at + 8 * entry;
            let value = i64_at(bytes, offset).ok_or_else(|| truncated(offset))?;
            if entry == 0 && value != 0 {
                return Err(DatasetError::DocIndexStart {
                    path: idx_path,
                    offset,
                    value,
                });
            }
            if value < previous {
                return Err(DatasetError::DocIndexDecreasing {
                    path: idx_path,
                    entry,
                    offset,
                    value,
                    previous,
                });
            }
            if entry + 1 == header.doc_entries && u64::try_from(value).ok() != Some(n) {
                return Err(DatasetError::DocIndexEnd {
                    path: idx_path,
                    offset,
                    value,
                    sequences: n,
                });
            }
            previous = value;
        }

        if bin.num_tokens == 0 {
            return Err(DatasetError::Empty { path: idx_path });
        }
        Ok(IndexedDataset {
            idx_path,
            idx,
            bin,
            sequences: n,
            doc_entries: header.doc_entries,
            pointers_at,
            docs_at,
        })
    }

    pub fn idx_path(&self) -> &Path {
        &self.idx_path
    }

    pub fn bin_path(&self) -> &Path {
        &self.bin.path
    }

    pub fn dtype(&self) -> TokenDtype {
        self.bin.dtype
    }

    pub fn num_tokens(&self) -> u64 {
        self.bin.num_tokens
    }

    pub fn num_sequences(&self) -> u64 {
        self.sequences
    }

    pub fn num_documents(&self) -> u64 {
        self.doc_entries - 1
    }

    /// The first global token of sequence `i` (`i == num_sequences()` gives `num_tokens()`).
    /// Valid after `validate`: pointers are contiguous multiples of the dtype size.
    fn sequence_start(&self, i: u64) -> u64 {
        if i >= self.sequences {
            return self.bin.num_tokens;
        }
        let pointer = i64_at(self.idx.as_slice(), self.pointers_at + 8 * i).unwrap_or(0);
        (pointer as u64) / self.bin.dtype.size() as u64
    }

    /// The global token range of sequence `i`.
    pub fn sequence(&self, i: u64) -> Result<Range<u64>> {
        if i >= self.sequences {
            return Err(self.no_such("sequence", i, self.sequences));
        }
        Ok(self.sequence_start(i)..self.sequence_start(i + 1))
    }

    /// The sequences of document `k` (indices into the sequences).
    pub fn document_sequences(&self, k: u64) -> Result<Range<u64>> {
        if k >= self.num_documents() {
            return Err(self.no_such("document", k, self.num_documents()));
        }
        let at = |e: u64| i64_at(self.idx.as_slice(), self.docs_at + 8 * e).unwrap_or(0) as u64;
        Ok(at(k)..at(k + 1))
    }

    /// The global token range of document `k`.
    pub fn document(&self, k: u64) -> Result<Range<u64>> {
        let seqs = self.document_sequences(k)?;
        Ok(self.sequence_start(seqs.start)..self.sequence_start(seqs.end))
    }

    /// The sequence holding global token `t` (the last one when `t` is past the end).
    pub fn sequence_containing(&self, t: u64) -> u64 {
        // The last sequence whose start is <= t (empty sequences share starts; the last of
        // them is the non-empty one holding t).
        let (mut lo, mut hi) = (0, self.sequences);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.sequence_start(mid) <= t {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    pub fn tokens(&self, range: Range<u64>) -> Result<Vec<u32>> {
        self.bin.tokens(range)
    }

    fn no_such(&self, what: &'static str, index: u64, count: u64) -> DatasetError {
        DatasetError::NoSuchItem {
            path: self.idx_path.clone(),
            what,
            index,
            count,
        }
    }
}

struct Header {
    dtype: TokenDtype,
    sequences: u64,
    doc_entries: u64,
}

/// Magic, version, dtype, and counts that fit the file exactly.
fn parse_header(path: &Path, bytes: &[u8], expected: Option<TokenDtype>) -> Result<Header> {
    let len = bytes.len() as u64;
    if len < IDX_HEADER_LEN {
        return Err(DatasetError::ShortHeader {
            path: path.to_path_buf(),
            len,
            header: IDX_HEADER_LEN,
        });
    }
    if bytes.get(..9) != Some(&IDX_MAGIC[..]) {
        return Err(DatasetError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    let version = u64_at(bytes, 9).unwrap_or(0);
    if version != VERSION {
        return Err(DatasetError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let code = bytes.get(17).copied().unwrap_or(0);
    let dtype = match code {
        1 => TokenDtype::U8,
        4 => TokenDtype::I32,
        5 => TokenDtype::I64,
        8 => TokenDtype::U16,
        2 | 3 | 6 | 7 => {
            let name = match code {
                2 => "int8",
                3 => "int16",
                6 => "float64",
                _ => "float32",
            };
            return Err(DatasetError::UnsupportedDtype {
                path: path.to_path_buf(),
                name,
                code,
            });
        }
        _ => {
            return Err(DatasetError::UnknownDtypeCode {
                path: path.to_path_buf(),
                code,
            });
        }
    };
    if let Some(expected) = expected
        && expected != dtype
    {
        return Err(DatasetError::DtypeMismatch {
            path: path.to_path_buf(),
            expected,
            found: dtype,
        });
    }
    let sequences = u64_at(bytes, 18).unwrap_or(0);
    let doc_entries = u64_at(bytes, 26).unwrap_or(0);
    let needed =
        u128::from(IDX_HEADER_LEN) + 12 * u128::from(sequences) + 8 * u128::from(doc_entries);
    if needed > u128::from(len) {
        return Err(DatasetError::CountsExceedFile {
            path: path.to_path_buf(),
            sequences,
            documents: doc_entries,
            needed,
            len,
        });
    }
    if needed < u128::from(len) {
        return Err(DatasetError::TrailingData {
            path: path.to_path_buf(),
            offset: needed as u64,
            len,
        });
    }
    Ok(Header {
        dtype,
        sequences,
        doc_entries,
    })
}

/// Writes a Megatron-LM indexed dataset: `add_sequence` appends a sequence's tokens to
/// `PREFIX.bin`, `end_document` closes a document, `finish` writes `PREFIX.idx`.
pub struct IndexedWriter {
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: TokenDtype,
    bin: BufWriter<File>,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    doc_idx: Vec<i64>,
    bin_bytes: u64,
    scratch: Vec<u8>,
}

impl IndexedWriter {
    /// Creates (truncates) `PREFIX.bin`; `dtype` needs a Megatron code (uint8, uint16, int32,
    /// int64).
    pub fn create(prefix: impl AsRef<Path>, dtype: TokenDtype) -> Result<IndexedWriter> {
        let prefix = prefix.as_ref();
        IndexedWriter::create_at(
            with_suffix(prefix, ".bin"),
            with_suffix(prefix, ".idx"),
            dtype,
        )
    }

    /// Like [`IndexedWriter::create`], with the two files named explicitly (for writing under
    /// temporary names and renaming after `finish`, as `lzrun prepare` does).
    pub fn create_at(
        bin_path: impl Into<PathBuf>,
        idx_path: impl Into<PathBuf>,
        dtype: TokenDtype,
    ) -> Result<IndexedWriter> {
        let (bin_path, idx_path) = (bin_path.into(), idx_path.into());
        if dtype.megatron_code().is_none() {
            return Err(DatasetError::NoMegatronCode {
                path: idx_path,
                dtype,
            });
        }
        let file = File::create(&bin_path).map_err(|source| DatasetError::Io {
            path: bin_path.clone(),
            source,
        })?;
        Ok(IndexedWriter {
            idx_path,
            bin_path,
            dtype,
            bin: BufWriter::new(file),
            lengths: Vec::new(),
            pointers: Vec::new(),
            doc_idx: vec![0],
            bin_bytes: 0,
            scratch: Vec::new(),
        })
    }

    /// Appends one sequence (each token must fit the dtype).
    pub fn add_sequence(&mut self, tokens: &[u32]) -> Result<()> {
        let sequence = self.lengths.len() as u64;
        let length = i32::try_from(tokens.len()).map_err(|_| DatasetError::SequenceTooLong {
            path: self.idx_path.clone(),
            sequence,
            len: tokens.len(),
        })?;
        self.scratch.clear();
        for &token in tokens {
            if !self.dtype.fits(token) {
                return Err(DatasetError::TokenDoesNotFit {
                    path: self.bin_path.clone(),
                    token,
                    dtype: self.dtype,
                });
            }
            self.dtype.encode(token, &mut self.scratch);
        }
        self.bin
            .write_all(&self.scratch)
            .map_err(|source| DatasetError::Io {
                path: self.bin_path.clone(),
                source,
            })?;
        self.lengths.push(length);
        self.pointers.push(self.bin_bytes as i64);
        self.bin_bytes += self.scratch.len() as u64;
        Ok(())
    }

    /// Ends the current document (the sequences since the last `end_document`).
    pub fn end_document(&mut self) {
        self.doc_idx.push(self.lengths.len() as i64);
    }

    /// One sequence that is a whole document.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        self.add_sequence(tokens)?;
        self.end_document();
        Ok(())
    }

    /// Flushes `PREFIX.bin` and writes `PREFIX.idx` (closing an open document first).
    pub fn finish(mut self) -> Result<()> {
        if self.doc_idx.last().copied() != Some(self.lengths.len() as i64) {
            self.end_document();
        }
        let bin_io = |source| DatasetError::Io {
            path: self.bin_path.clone(),
            source,
        };
        let file = self.bin.into_inner().map_err(|e| bin_io(e.into_error()))?;
        file.sync_all().map_err(bin_io)?;

        let mut idx = Vec::with_capacity(
            IDX_HEADER_LEN as usize + 12 * self.lengths.len() + 8 * self.doc_idx.len(),
        );
        idx.extend_from_slice(IDX_MAGIC);
        idx.extend_from_slice(&VERSION.to_le_bytes());
        idx.push(self.dtype.megatron_code().unwrap_or(0));
        idx.extend_from_slice(&(self.lengths.len() as u64).to_le_bytes());
        idx.extend_from_slice(&(self.doc_idx.len() as u64).to_le_bytes());
        for l in &self.lengths {
            idx.extend_from_slice(&l.to_le_bytes());
        }
        for p in &self.pointers {
            idx.extend_from_slice(&p.to_le_bytes());
        }
        for d in &self.doc_idx {
            idx.extend_from_slice(&d.to_le_bytes());
        }
        let idx_io = |source| DatasetError::Io {
            path: self.idx_path.clone(),
            source,
        };
        let mut f = File::create(&self.idx_path).map_err(idx_io)?;
        f.write_all(&idx).map_err(idx_io)?;
        f.sync_all().map_err(idx_io)
    }
}
