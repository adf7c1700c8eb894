//! `lzrun tokenizer` and `lzrun prepare`, run as the binary: a trained byte-level BPE and the
//! byte tokenizer round-trip every document through the written Megatron-LM indexed dataset;
//! bad input is one line on stderr and exit status 2; a failed prepare leaves an existing
//! dataset alone.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lazarus_executor::dataset::{IndexedDataset, TokenDataset, TokenDtype};
use lazarus_executor::model::{ByteTokenizer, MoeConfig};

mod process;
use process::{Outcome, run_within};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");

fn lzrun(args: &[&str]) -> Outcome {
    run_within(Command::new(LZRUN).args(args), Duration::from_secs(120))
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prepare-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 scratch path")
}

/// Documents with what tokenizers get wrong: leading and repeated spaces, tabs, newlines at
/// both ends, non-ASCII text, a special token's text inside a document.
const DOCS: [&str; 6] = [
    "On training large models when machines fail.\nA step is lost, not the run.",
    "  Two leading spaces,\tA tab, and  double  spaces.  ",
    "\n\nNewlines first, and last\n",
    "naïve café — 多专家模型 🚀 ünïcödé",
    "Experts fail; replicas survive. Experts fail; replicas survive!",
    "a",
];

/// Trains a tokenizer with `lzrun tokenizer` on a text made of [`DOCS`].
fn train_tokenizer(dir: &Path, vocab: usize) -> PathBuf {
    let corpus = dir.join("train.txt");
    fs::write(&corpus, DOCS.join("\n").repeat(8)).unwrap();
    let out = dir.join("tokenizer.json");
    let o = lzrun(&[
        "tokenizer",
        "--vocab",
        &vocab.to_string(),
        "--input",
        s(&corpus),
        "--out",
        s(&out),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.starts_with("wrote "), "{}", o.show());
    assert!(!dir.join("tokenizer.json.tmp").exists());
    out
}

/// Writes DOCS[0..2] as two `.txt` files and the rest as a `.jsonl` (with a blank line and an
/// extra field); returns the inputs in the order their documents should appear.
fn write_inputs(dir: &Path) -> Vec<PathBuf> {
    let a = dir.join("a.txt");
    let b = dir.join("b.txt");
    fs::write(&a, DOCS[0]).unwrap();
    fs::write(&b, DOCS[1]).unwrap();
    let jsonl = dir.join("docs.jsonl");
    let mut body = String::new();
    for (i, doc) in DOCS[2..].iter().enumerate() {
        body.push_str(&serde_json::json!({ "text": doc, "id": i }).to_string());
        body.push('\n');
        if i == 1 {
            body.push('\n');
        }
    }
    fs::write(&jsonl, body).unwrap();
    vec![a, b, jsonl]
}

fn prepare(tokenizer: &str, inputs: &[PathBuf], out: &Path, extra: &[&str]) -> Outcome {
    let mut args = vec![
        "prepare",
        "--tokenizer",
        tokenizer,
        "--out",
        s(out),
        "--input",
    ];
    args.extend(inputs.iter().map(|p| s(p)));
    args.extend_from_slice(extra);
    lzrun(&args)
}

/// Every document is one sequence and one document of the index, in input order.
fn sequences(ds: &IndexedDataset) -> Vec<Vec<u32>> {
    assert_eq!(ds.num_documents(), ds.num_sequences());
    (0..ds.num_sequences())
        .map(|i| {
            let range = ds.sequence(i).unwrap();
            assert_eq!(ds.document(i).unwrap(), range);
            ds.tokens(range).unwrap()
        })
        .collect()
}

#[test]
fn trained_bpe_round_trips_txt_and_jsonl() {
    let dir = scratch("bpe");
    let tok_path = train_tokenizer(&dir, 400);
    let inputs = write_inputs(&dir);
    let out = dir.join("ds");
    let o = prepare(s(&tok_path), &inputs, &out, &[]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let line = o.stdout.trim();
    assert_eq!(o.stdout.lines().count(), 1, "{}", o.show());
    assert!(
        line.contains("6 documents") && line.contains("EOD <|endoftext|> = 0"),
        "{line}"
    );
    assert!(line.ends_with("tokens/s"), "{line}");

    let tokenizer = tokenizers::Tokenizer::from_file(&tok_path).unwrap();
    let eod = tokenizer.token_to_id("<|endoftext|>").unwrap();
    let ds = IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();
    let seqs = sequences(&ds);
    assert_eq!(seqs.len(), DOCS.len());
    let mut total = 0;
    for (mut seq, doc) in seqs.into_iter().zip(DOCS) {
        total += seq.len() as u64;
        assert_eq!(seq.pop(), Some(eod), "{doc:?}");
        assert!(!seq.contains(&eod), "{doc:?}");
        assert_eq!(tokenizer.decode(&seq, false).unwrap(), doc);
    }
    assert_eq!(total, ds.num_tokens());
    assert!(line.contains(&format!("{total} tokens")), "{line}");
    // Merges were learned: fewer tokens than bytes.
    assert!(ds.num_tokens() < DOCS.iter().map(|d| d.len() as u64 + 1).sum());
    for tmp in ["ds.bin.tmp", "ds.idx.tmp"] {
        assert!(!dir.join(tmp).exists(), "{tmp} left behind");
    }
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eod_token_flag_and_a_tokenizer_without_a_known_eod() {
    let dir = scratch("eod");
    let tok_path = train_tokenizer(&dir, 300);
    // The same tokenizer with its special token renamed: none of the default EOD names.
    let renamed = dir.join("renamed.json");
    let json = fs::read_to_string(&tok_path).unwrap();
    assert!(json.contains("<|endoftext|>"));
    fs::write(&renamed, json.replace("<|endoftext|>", "<|doc_end|>")).unwrap();
    let input = vec![dir.join("a.txt")];
    fs::write(&input[0], DOCS[3]).unwrap();
    let out = dir.join("ds");

    let o = prepare(s(&renamed), &input, &out, &[]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    let err = o.stderr.trim();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(s(&renamed)) && err.contains("pass --eod-token"),
        "{err}"
    );
    assert!(!dir.join("ds.bin").exists() && !dir.join("ds.bin.tmp").exists());

    let o = prepare(s(&renamed), &input, &out, &["--eod-token", "<|nope|>"]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(o.stderr.contains("<|nope|>") && o.stderr.contains(s(&renamed)));

    let o = prepare(s(&renamed), &input, &out, &["--eod-token", "<|doc_end|>"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("EOD <|doc_end|> = 0"), "{}", o.show());
    let tokenizer = tokenizers::Tokenizer::from_file(&renamed).unwrap();
    let ds = IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();
    let mut seq = sequences(&ds).pop().unwrap();
    assert_eq!(seq.pop(), Some(0));
    assert_eq!(tokenizer.decode(&seq, false).unwrap(), DOCS[3]);
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bytes_round_trips_without_eod_and_fits_the_tiny_model() {
    let dir = scratch("bytes");
    let inputs = write_inputs(&dir);
    let out = dir.join("ds");
    let o = prepare("bytes", &inputs, &out, &[]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(
        o.stdout.contains("uint16, vocab 256, no EOD token"),
        "{}",
        o.show()
    );
    let ds = IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();
    let seqs = sequences(&ds);
    assert_eq!(seqs.len(), DOCS.len());
    for (seq, doc) in seqs.iter().zip(DOCS) {
        assert_eq!(seq.len(), doc.len(), "{doc:?}: one token per byte, no EOD");
        assert_eq!(ByteTokenizer::decode(seq), doc);
    }
    // The reason there is no EOD id: the tiny model's vocabulary is exactly the 256 bytes.
    let tiny = MoeConfig::tiny();
    assert_eq!(tiny.vocab, ByteTokenizer::VOCAB);
    TokenDataset::open_indexed(&out, None)
        .unwrap()
        .check_vocab(tiny.vocab as u32)
        .unwrap();

    let o = prepare("bytes", &inputs, &out, &["--eod-token", "\n"]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(
        o.stderr
            .contains("--eod-token does not apply to --tokenizer bytes")
    );
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let dir = scratch("bad");
    let good = dir.join("good.txt");
    fs::write(&good, "some text").unwrap();
    let missing = dir.join("missing.txt");
    let bad_json_tok = dir.join("broken.json");
    fs::write(&bad_json_tok, "{ \"model\": ").unwrap();
    let not_a_tok = dir.join("not-a-tokenizer.json");
    fs::write(&not_a_tok, "{\"hello\": 1}").unwrap();
    let malformed = dir.join("malformed.jsonl");
    fs::write(&malformed, "{\"text\": \"fine\"}\n{\"text\": \"cut\n").unwrap();
    let no_text = dir.join("no-text.jsonl");
    fs::write(&no_text, "{\"text\": \"fine\"}\n\n{\"body\": \"x\"}\n").unwrap();
    let number_text = dir.join("number-text.jsonl");
    fs::write(&number_text, "{\"text\": 42}\n").unwrap();
    let empty_txt = dir.join("empty.txt");
    fs::write(&empty_txt, "").unwrap();
    let empty_jsonl = dir.join("empty.jsonl");
    fs::write(&empty_jsonl, "{\"text\": \"\"}\n\n").unwrap();
    let not_utf8 = dir.join("latin1.txt");
    fs::write(&not_utf8, b"caf\xe9").unwrap();
    let csv = dir.join("data.csv");
    fs::write(&csv, "text\nx\n").unwrap();
    let out = dir.join("ds");
    let no_dir = dir.join("no-such-dir").join("ds");

    let p = |p: &PathBuf| s(p).to_owned();
    // (tokenizer, inputs, out, what stderr must contain)
    let cases: Vec<(String, Vec<PathBuf>, PathBuf, String)> = vec![
        (
            "bytes".into(),
            vec![good.clone(), missing.clone()],
            out.clone(),
            p(&missing),
        ),
        (
            p(&dir.join("nope.json")),
            vec![good.clone()],
            out.clone(),
            p(&dir.join("nope.json")),
        ),
        (
            p(&bad_json_tok),
            vec![good.clone()],
            out.clone(),
            p(&bad_json_tok),
        ),
        (
            p(&not_a_tok),
            vec![good.clone()],
            out.clone(),
            p(&not_a_tok),
        ),
        (
            "bytes".into(),
            vec![malformed.clone()],
            out.clone(),
            format!("{}:2: not valid JSON", p(&malformed)),
        ),
        (
            "bytes".into(),
            vec![no_text.clone()],
            out.clone(),
            format!("{}:3: no string \"text\" field", p(&no_text)),
        ),
        (
            "bytes".into(),
            vec![number_text.clone()],
            out.clone(),
            format!("{}:1: no string \"text\" field", p(&number_text)),
        ),
        (
            "bytes".into(),
            vec![empty_txt.clone()],
            out.clone(),
            format!("{}: no tokens", p(&empty_txt)),
        ),
        (
            "bytes".into(),
            vec![empty_txt.clone(), empty_jsonl.clone()],
            out.clone(),
            format!("{}, {}: no tokens", p(&empty_txt), p(&empty_jsonl)),
        ),
        (
            "bytes".into(),
            vec![not_utf8.clone()],
            out.clone(),
            format!(
                "{}: not UTF-8 text (invalid byte at offset 3)",
                p(&not_utf8)
            ),
        ),
        (
            "bytes".into(),
            vec![csv.clone()],
            out.clone(),
            format!("{}: unsupported input", p(&csv)),
        ),
        (
            "bytes".into(),
            vec![dir.clone()],
            out.clone(),
            format!("{}: not a regular file", p(&dir)),
        ),
        (
            "bytes".into(),
            vec![good.clone()],
            no_dir.clone(),
            format!(
                "{}: the output directory does not exist",
                p(&dir.join("no-such-dir"))
            ),
        ),
        (
            "bytes".into(),
            vec![good.clone()],
            dir.clone(),
            format!("{}: --out names a file prefix", p(&dir)),
        ),
    ];
    for (tokenizer, inputs, out, want) in cases {
        let o = prepare(&tokenizer, &inputs, &out, &[]);
        assert_eq!(o.code, Some(2), "{want}: {}", o.show());
        assert!(o.stdout.is_empty(), "{want}: {}", o.show());
        let err = o.stderr.trim_end();
        assert_eq!(err.lines().count(), 1, "{want}: {err}");
        assert!(err.starts_with("error: "), "{err}");
        assert!(err.contains(&want), "want {want:?} in {err:?}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Nothing was written by any of them.
    let left: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ds"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // The tokenizer trainer: the same one-line errors.
    let tok = dir.join("t.json");
    for (args, want) in [
        (
            vec!["--vocab", "256", "--input", s(&good)],
            "--vocab 256 is out of range".to_owned(),
        ),
        (
            vec!["--vocab", "300", "--input", s(&no_text)],
            format!("{}:3:", p(&no_text)),
        ),
        (
            vec!["--vocab", "300", "--input", s(&empty_txt)],
            format!("{}: no tokens", p(&empty_txt)),
        ),
        (vec!["--vocab", "300", "--input", s(&missing)], p(&missing)),
    ] {
        let mut full = vec!["tokenizer", "--out", s(&tok)];
        full.extend(args);
        let o = lzrun(&full);
        assert_eq!(o.code, Some(2), "{want}: {}", o.show());
        let err = o.stderr.trim_end();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(&want), "want {want:?} in {err:?}");
        assert!(!tok.exists() && !dir.join("t.json.tmp").exists());
    }
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_failed_prepare_leaves_the_existing_dataset_alone() {
    let dir = scratch("keep");
    let inputs = write_inputs(&dir);
    let out = dir.join("ds");
    let o = prepare("bytes", &inputs, &out, &[]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let bin = fs::read(dir.join("ds.bin")).unwrap();
    let idx = fs::read(dir.join("ds.idx")).unwrap();

    // Fails after writing has started: good documents first, a bad line 3.
    let late = dir.join("late.jsonl");
    fs::write(
        &late,
        "{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"text\": null}\n",
    )
    .unwrap();
    let mut all = inputs.clone();
    all.push(late.clone());
    let o = prepare("bytes", &all, &out, &[]);
    assert_eq!(o.code, Some(2), "{}", o.show());
    assert!(
        o.stderr.contains(&format!("{}:3:", s(&late))),
        "{}",
        o.show()
    );
    // And one that fails before anything is written.
    let o = prepare("bytes", &[dir.join("missing.txt")], &out, &[]);
    assert_eq!(o.code, Some(2), "{}", o.show());

    assert_eq!(fs::read(dir.join("ds.bin")).unwrap(), bin);
    assert_eq!(fs::read(dir.join("ds.idx")).unwrap(), idx);
    for tmp in ["ds.bin.tmp", "ds.idx.tmp"] {
        assert!(!dir.join(tmp).exists(), "{tmp} left behind");
    }
    IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();

    // A successful prepare replaces it.
    let o = prepare("bytes", &inputs[..1], &out, &[]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let ds = IndexedDataset::open(&out, Some(TokenDtype::U16)).unwrap();
    assert_eq!(ds.num_documents(), 1);
    assert_eq!(ds.num_tokens(), DOCS[0].len() as u64);
    fs::remove_dir_all(dir).unwrap();
}
