use std::fs::{self, File};
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

/// A fresh directory for one test.
fn tmp(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "lzrun-dataset-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// Raw `.idx` bytes with explicit counts (so tests can lie about them).
fn idx_raw(
    code: u8,
    sequences: u64,
    doc_entries: u64,
    lengths: &[i32],
    pointers: &[i64],
    docs: &[i64],
) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(IDX_MAGIC);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(code);
    b.extend_from_slice(&sequences.to_le_bytes());
    b.extend_from_slice(&doc_entries.to_le_bytes());
    lengths
        .iter()
        .for_each(|l| b.extend_from_slice(&l.to_le_bytes()));
    pointers
        .iter()
        .for_each(|p| b.extend_from_slice(&p.to_le_bytes()));
    docs.iter()
        .for_each(|d| b.extend_from_slice(&d.to_le_bytes()));
    b
}

/// A consistent uint16 `.idx` for `lengths` (contiguous pointers) and document index `docs`.
fn idx_u16(lengths: &[i32], docs: &[i64]) -> Vec<u8> {
    let mut pointers = Vec::new();
    let mut p = 0i64;
    for &l in lengths {
        pointers.push(p);
        p += 2 * i64::from(l);
    }
    idx_raw(
        8,
        lengths.len() as u64,
        docs.len() as u64,
        lengths,
        &pointers,
        docs,
    )
}

fn u16_bin(tokens: &[u16]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Writes `PREFIX.idx`/`PREFIX.bin` under a fresh directory and opens them.
fn open_raw(name: &str, idx: &[u8], bin: &[u8]) -> (PathBuf, Result<IndexedDataset>) {
    let prefix = tmp(name).join("corpus_text_document");
    fs::write(prefix.with_extension("idx"), idx).unwrap();
    fs::write(prefix.with_extension("bin"), bin).unwrap();
    let opened = IndexedDataset::open(&prefix, None);
    (prefix, opened)
}

/// Opens bad input and returns the message, checking it names the `.idx` (or `.bin`) file
/// and contains each of `needles`.
fn bad(name: &str, idx: &[u8], bin: &[u8], file: &str, needles: &[&str]) -> String {
    let (_, opened) = open_raw(name, idx, bin);
    let msg = match opened {
        Ok(_) => panic!("{name}: bad input was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains(&format!("corpus_text_document.{file}")),
        "{name}: {msg:?} does not name the .{file} file"
    );
    for n in needles {
        assert!(msg.contains(n), "{name}: {msg:?} lacks {n:?}");
    }
    msg
}

#[test]
fn good_index_opens_and_reads() {
    // Documents: [seq0, seq1], [seq2 (empty), seq3].
    let idx = idx_u16(&[3, 2, 0, 4], &[0, 2, 4]);
    let bin = u16_bin(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    let (prefix, opened) = open_raw("good", &idx, &bin);
    let d = TokenDataset::Indexed(opened.unwrap());
    assert_eq!(d.path(), prefix.with_extension("bin"));
    assert_eq!(d.dtype(), TokenDtype::U16);
    assert_eq!(d.num_tokens(), 9);
    assert_eq!(d.num_sequences(), 4);
    assert_eq!(d.num_documents(), 2);
    assert_eq!(d.sequence(1).unwrap(), 3..5);
    assert_eq!(d.sequence(2).unwrap(), 5..5);
    assert_eq!(d.document(0).unwrap(), 0..5);
    assert_eq!(d.document(1).unwrap(), 5..9);
    assert!(
        d.document(2)
            .unwrap_err()
            .to_string()
            .contains("document 2")
    );
    assert!(
        d.sequence(4)
            .unwrap_err()
            .to_string()
            .contains("sequence 4")
    );
    assert_eq!(d.tokens(2..6).unwrap(), vec![3, 4, 5, 6]);
    assert_eq!(d.window(5, 3).unwrap(), vec![6, 7, 8, 9]);
    let err = d.window(6, 3).unwrap_err().to_string();
    assert!(
        err.contains("corpus_text_document.bin") && err.contains("6..10"),
        "{err}"
    );
    assert!(d.window(u64::MAX, usize::MAX).is_err());
    assert_eq!(d.max_token_id().unwrap(), 9);
    let TokenDataset::Indexed(ix) = &d else {
        unreachable!()
    };
    assert_eq!(ix.sequence_containing(4), 1);
    assert_eq!(
        ix.sequence_containing(5),
        3,
        "the empty sequence 2 holds no token"
    );
    assert_eq!(ix.document_sequences(1).unwrap(), 2..4);
}

#[test]
fn token_at_or_over_vocab_names_file_offset_and_sequence() {
    let idx = idx_u16(&[3, 2], &[0, 1, 2]);
    let bin = u16_bin(&[1, 2, 3, 4, 50]);
    let (_, opened) = open_raw("vocab", &idx, &bin);
    let d = TokenDataset::Indexed(opened.unwrap());
    d.check_vocab(51).unwrap();
    let msg = d.check_vocab(50).unwrap_err().to_string();
    for n in [
        "corpus_text_document.bin",
        "token id 50",
        "byte 8",
        "token 4",
        "sequence 1",
        "vocabulary size 50",
    ] {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
}

#[test]
fn negative_int32_token_is_an_error_naming_its_offset() {
    let idx = idx_raw(4, 1, 2, &[2], &[0], &[0, 1]);
    let bin: Vec<u8> = [7i32, -3].iter().flat_map(|t| t.to_le_bytes()).collect();
    let (_, opened) = open_raw("negtok", &idx, &bin);
    let d = TokenDataset::Indexed(opened.unwrap());
    assert_eq!(d.tokens(0..1).unwrap(), vec![7]);
    let msg = d.tokens(0..2).unwrap_err().to_string();
    assert!(
        msg.contains("corpus_text_document.bin") && msg.contains("token -3 at byte 4"),
        "{msg}"
    );
    assert!(d.max_token_id().is_err());
}

#[test]
fn short_header() {
    bad(
        "short",
        &IDX_MAGIC[..],
        &[],
        "idx",
        &["9 bytes", "34-byte header"],
    );
}

#[test]
fn bad_magic() {
    let mut idx = idx_u16(&[1], &[0, 1]);
    idx[0] = b'X';
    bad(
        "magic",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["bad magic at byte 0"],
    );
}

#[test]
fn bad_version() {
    let mut idx = idx_u16(&[1], &[0, 1]);
    idx[9] = 2;
    bad(
        "version",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["version 2 at byte 9"],
    );
}

#[test]
fn unknown_and_unsupported_dtype_codes() {
    let mut idx = idx_u16(&[1], &[0, 1]);
    idx[17] = 9;
    bad(
        "code9",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["dtype code 9 at byte 17"],
    );
    idx[17] = 7;
    bad(
        "float32",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["float32", "byte 17"],
    );
    idx[17] = 3;
    bad("int16", &idx, &u16_bin(&[1]), "idx", &["int16", "byte 17"]);
}

#[test]
fn dtype_other_than_expected() {
    let prefix = tmp("mismatch").join("corpus_text_document");
    fs::write(prefix.with_extension("idx"), idx_u16(&[1], &[0, 1])).unwrap();
    fs::write(prefix.with_extension("bin"), u16_bin(&[1])).unwrap();
    let msg = IndexedDataset::open(&prefix, Some(TokenDtype::I32))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("corpus_text_document.idx") && msg.contains("uint16"),
        "{msg}"
    );
    assert!(msg.contains("int32 was expected"), "{msg}");
    IndexedDataset::open(&prefix, Some(TokenDtype::U16)).unwrap();
}

#[test]
fn counts_that_do_not_fit_the_file() {
    // Claims 3 sequences, holds 1.
    let idx = idx_raw(8, 3, 2, &[1], &[0], &[0, 1]);
    bad(
        "counts",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["3 sequences", "need 86 bytes", "is 62 bytes"],
    );
    // Counts so large the size overflows u64.
    let idx = idx_raw(8, u64::MAX, u64::MAX, &[], &[], &[]);
    bad(
        "huge",
        &idx,
        &[],
        "idx",
        &["18446744073709551615 sequences"],
    );
}

#[test]
fn trailing_index_data_is_refused() {
    let mut idx = idx_u16(&[1], &[0, 1]);
    idx.push(0); // a multimodal writer's sequence mode
    bad(
        "trailing",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["1 bytes of trailing data from byte 62"],
    );
}

#[test]
fn negative_length() {
    let idx = idx_raw(8, 2, 2, &[1, -1], &[0, 2], &[0, 2]);
    bad(
        "neglen",
        &idx,
        &u16_bin(&[1]),
        "idx",
        &["sequence 1", "negative length -1", "byte 38"],
    );
}

#[test]
fn pointers_not_contiguous() {
    // Sequence 1 should start at byte 4.
    let idx = idx_raw(8, 2, 2, &[2, 1], &[0, 2], &[0, 2]);
    bad(
        "ptr",
        &idx,
        &u16_bin(&[1, 2, 3]),
        "idx",
        &["sequence 1", "pointer 2", "byte 50", "expected 4"],
    );
    // Decreasing (negative) pointer.
    let idx = idx_raw(8, 2, 2, &[2, 1], &[0, -4], &[0, 2]);
    bad(
        "ptrneg",
        &idx,
        &u16_bin(&[1, 2, 3]),
        "idx",
        &["sequence 1", "pointer -4", "byte 50"],
    );
}

#[test]
fn pointer_or_sequence_past_end_of_bin() {
    let idx = idx_raw(8, 2, 2, &[2, 1], &[0, 100], &[0, 2]);
    bad(
        "ptrpast",
        &idx,
        &u16_bin(&[1, 2, 3]),
        "idx",
        &["sequence 1", "byte 50", "ends at byte 100", "(6 bytes)"],
    );
    let idx = idx_u16(&[2, 5], &[0, 2]);
    bad(
        "seqpast",
        &idx,
        &u16_bin(&[1, 2, 3]),
        "idx",
        &[
            "sequence 1",
            "byte 50",
            "ends at byte 14",
            "corpus_text_document.bin (6 bytes)",
        ],
    );
}

#[test]
fn bin_bytes_no_sequence_covers() {
    let idx = idx_u16(&[2], &[0, 1]);
    bad(
        "uncovered",
        &idx,
        &u16_bin(&[1, 2, 3]),
        "bin",
        &["covers 4 bytes", "file is 6 bytes"],
    );
}

#[test]
fn bin_not_a_multiple_of_the_dtype() {
    let idx = idx_u16(&[1], &[0, 1]);
    bad("odd", &idx, &[1, 0, 7], "bin", &["size 3 bytes", "uint16"]);
}

#[test]
fn document_index_errors() {
    let bin = u16_bin(&[1, 2]);
    let idx = idx_u16(&[1, 1], &[]);
    bad(
        "docempty",
        &idx,
        &bin,
        "idx",
        &["document index is empty (byte 58)"],
    );
    let idx = idx_u16(&[1, 1], &[1, 2]);
    bad("docstart", &idx, &bin, "idx", &["starts at 1 (byte 58)"]);
    let idx = idx_u16(&[1, 1], &[0, 2, 1, 2]);
    bad(
        "docdec",
        &idx,
        &bin,
        "idx",
        &["entry 2 is 1 (byte 74)", "previous entry 2"],
    );
    let idx = idx_u16(&[1, 1], &[0, 1]);
    bad(
        "docend",
        &idx,
        &bin,
        "idx",
        &["ends at 1 (byte 66)", "sequence count 2"],
    );
}

#[test]
fn empty_datasets_are_refused() {
    bad("empty0", &idx_u16(&[], &[0]), &[], "idx", &["no tokens"]);
    bad(
        "emptyseq",
        &idx_u16(&[0, 0], &[0, 2]),
        &[],
        "idx",
        &["no tokens"],
    );
    let dir = tmp("emptyflat");
    let path = dir.join("train.bin");
    fs::write(&path, []).unwrap();
    let msg = FlatTokens::open(&path, TokenDtype::U16)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("train.bin") && msg.contains("no tokens"),
        "{msg}"
    );
}

#[test]
fn missing_files_name_the_path() {
    let prefix = tmp("missing").join("nothing");
    let msg = IndexedDataset::open(&prefix, None)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("nothing.idx"), "{msg}");
    fs::write(prefix.with_extension("idx"), idx_u16(&[1], &[0, 1])).unwrap();
    let msg = IndexedDataset::open(&prefix, None)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("nothing.bin"), "{msg}");
}

#[test]
fn prefix_with_dots_keeps_them() {
    let prefix = tmp("dots").join("v1.2_text");
    let mut w = IndexedWriter::create(&prefix, TokenDtype::U16).unwrap();
    w.add_document(&[5, 6]).unwrap();
    w.finish().unwrap();
    assert!(prefix.parent().unwrap().join("v1.2_text.idx").exists());
    assert_eq!(IndexedDataset::open(&prefix, None).unwrap().num_tokens(), 2);
}

fn flat_case(dtype: TokenDtype, tokens: &[u32]) {
    let path = tmp(&format!("flat-{dtype}")).join("train.bin");
    write_flat(&path, dtype, tokens).unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        (tokens.len() * dtype.size()) as u64
    );
    let d = TokenDataset::open_flat(&path, dtype).unwrap();
    assert_eq!(d.num_tokens(), tokens.len() as u64);
    assert_eq!((d.num_sequences(), d.num_documents()), (1, 1));
    assert_eq!(d.document(0).unwrap(), 0..tokens.len() as u64);
    assert!(d.sequence(1).is_err());
    assert_eq!(d.tokens(0..tokens.len() as u64).unwrap(), tokens);
    assert_eq!(d.window(1, 2).unwrap(), &tokens[1..4]);
    let max = *tokens.iter().max().unwrap();
    assert_eq!(d.max_token_id().unwrap(), max);
    if let Some(vocab) = max.checked_add(1) {
        d.check_vocab(vocab).unwrap();
    }
    let first = tokens.iter().position(|&t| t == max).unwrap();
    let msg = d.check_vocab(max).unwrap_err().to_string();
    let byte = format!("at byte {} ", first * dtype.size());
    assert!(msg.contains("train.bin") && msg.contains(&byte), "{msg}");
}

#[test]
fn flat_u16_and_u32() {
    flat_case(TokenDtype::U16, &[0, 50_256, 7, 65_535, 3]);
    flat_case(TokenDtype::U32, &[0, 50_256, 7, 200_000, u32::MAX, 3]);
    let path = tmp("flatfit").join("train.bin");
    let msg = write_flat(&path, TokenDtype::U16, &[70_000])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("70000") && msg.contains("uint16"), "{msg}");
}

#[test]
fn flat_size_not_a_multiple() {
    let path = tmp("flatodd").join("train.bin");
    fs::write(&path, [0u8; 6]).unwrap();
    FlatTokens::open(&path, TokenDtype::U16).unwrap();
    let msg = FlatTokens::open(&path, TokenDtype::U32)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("train.bin") && msg.contains("size 6 bytes") && msg.contains("uint32"),
        "{msg}"
    );
}

#[test]
fn dtype_names_parse() {
    assert_eq!("u16".parse::<TokenDtype>().unwrap(), TokenDtype::U16);
    assert_eq!("uint32".parse::<TokenDtype>().unwrap(), TokenDtype::U32);
    assert_eq!("INT32".parse::<TokenDtype>().unwrap(), TokenDtype::I32);
    assert!("f32".parse::<TokenDtype>().is_err());
    let msg = IndexedWriter::create(tmp("nocode").join("x"), TokenDtype::U32)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("uint32"), "{msg}");
}

/// A sparse 1 GiB file: opening and reading one window must not read the whole file (which
/// would take seconds at best and, on a slow disk, much longer; here it is all holes).
#[test]
fn sparse_gigabyte_reads_one_window_quickly() {
    const GIB: u64 = 1 << 30;
    let dir = tmp("sparse");
    let path = dir.join("train.bin");
    let mut f = File::create(&path).unwrap();
    f.set_len(GIB).unwrap();
    let tail: Vec<u8> = (1..=8u16).flat_map(|t| t.to_le_bytes()).collect();
    f.seek(SeekFrom::Start(GIB - tail.len() as u64)).unwrap();
    f.write_all(&tail).unwrap();
    drop(f);

    let start = Instant::now();
    let d = TokenDataset::open_flat(&path, TokenDtype::U16).unwrap();
    assert_eq!(d.num_tokens(), GIB / 2);
    let w = d.window(GIB / 2 - 9, 8).unwrap();
    assert_eq!(w, vec![0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(d.window(GIB / 4, 3).unwrap(), vec![0; 4]);

    // The same through an index: one sequence of 2^29 uint16 tokens, validated in O(sequences).
    let prefix = dir.join("big");
    fs::rename(&path, prefix.with_extension("bin")).unwrap();
    let n = (GIB / 2) as i32;
    fs::write(
        prefix.with_extension("idx"),
        idx_raw(8, 1, 2, &[n], &[0], &[0, 1]),
    )
    .unwrap();
    let d = TokenDataset::open_indexed(&prefix, Some(TokenDtype::U16)).unwrap();
    assert_eq!(d.sequence(0).unwrap(), 0..GIB / 2);
    assert_eq!(d.window(GIB / 2 - 3, 2).unwrap(), vec![6, 7, 8]);
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "reading windows of a sparse 1 GiB file took {took:?}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// Documents of sequences of tokens.
type Corpus = Vec<Vec<Vec<u32>>>;

fn corpus(max_token: u32) -> impl Strategy<Value = Corpus> {
    let seq = prop::collection::vec(0..=max_token, 0..20);
    let doc = prop::collection::vec(seq, 0..4);
    prop::collection::vec(doc, 1..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn writer_reader_round_trip(
        (dtype, docs) in prop_oneof![
            corpus(u32::from(u16::MAX)).prop_map(|c| (TokenDtype::U16, c)),
            corpus(i32::MAX as u32).prop_map(|c| (TokenDtype::I32, c)),
            corpus(255).prop_map(|c| (TokenDtype::U8, c)),
            corpus(u32::MAX).prop_map(|c| (TokenDtype::I64, c)),
        ]
    ) {
        let all: Vec<u32> = docs.iter().flatten().flatten().copied().collect();
        prop_assume!(!all.is_empty());
        let prefix = tmp("roundtrip").join("corpus");
        let mut w = IndexedWriter::create(&prefix, dtype).unwrap();
        for doc in &docs {
            for seq in doc {
                w.add_sequence(seq).unwrap();
            }
            w.end_document();
        }
        w.finish().unwrap();

        let d = TokenDataset::open_indexed(&prefix, Some(dtype)).unwrap();
        prop_assert_eq!(d.dtype(), dtype);
        prop_assert_eq!(d.num_tokens(), all.len() as u64);
        prop_assert_eq!(d.num_documents(), docs.len() as u64);
        let seqs: Vec<&Vec<u32>> = docs.iter().flatten().collect();
        prop_assert_eq!(d.num_sequences(), seqs.len() as u64);
        for (i, seq) in seqs.iter().enumerate() {
            let r = d.sequence(i as u64).unwrap();
            prop_assert_eq!(&d.tokens(r).unwrap(), *seq);
        }
        let mut at = 0u64;
        for (k, doc) in docs.iter().enumerate() {
            let len: u64 = doc.iter().map(|s| s.len() as u64).sum();
            prop_assert_eq!(d.document(k as u64).unwrap(), at..at + len);
            at += len;
        }
        prop_assert_eq!(d.tokens(0..all.len() as u64).unwrap(), all.clone());
        let max = *all.iter().max().unwrap();
        prop_assert_eq!(d.max_token_id().unwrap(), max);
        if max < u32::MAX {
            prop_assert!(d.check_vocab(max + 1).is_ok());
        }
        let msg = d.check_vocab(max).unwrap_err().to_string();
        prop_assert!(msg.contains("corpus.bin"), "{}", msg);
        let TokenDataset::Indexed(ix) = &d else { unreachable!() };
        for t in 0..all.len() as u64 {
            let s = ix.sequence_containing(t);
            prop_assert!(d.sequence(s).unwrap().contains(&t));
        }
        fs::remove_dir_all(prefix.parent().unwrap()).unwrap();
    }

    /// Arbitrary index bytes never panic (the fuzz target's property, at proptest scale).
    #[test]
    fn arbitrary_index_bytes_never_panic(
        idx in prop::collection::vec(any::<u8>(), 0..128),
        bin in prop::collection::vec(any::<u8>(), 0..32),
        header in any::<bool>(),
    ) {
        let mut idx = idx;
        if header && idx.len() >= 18 {
            idx[..9].copy_from_slice(IDX_MAGIC);
            idx[9..17].copy_from_slice(&1u64.to_le_bytes());
        }
        if let Ok(d) = IndexedDataset::from_memory("fuzz", idx, bin, None) {
            let d = TokenDataset::Indexed(d);
            let _ = d.tokens(0..d.num_tokens());
            let _ = d.check_vocab(3);
            for k in 0..d.num_documents() {
                let _ = d.document(k).unwrap();
            }
        }
    }
}
