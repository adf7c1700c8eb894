//! Issue 31 item 1: `lzrun local --data` trains on tokenized datasets (a Megatron-LM indexed
//! dataset from `lzrun prepare`, a flat `uint16` file, a blend of both), and bad data is one
//! line naming the file and exit 2 before any worker starts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use lazarus_executor::dataset::{IndexedWriter, TokenDtype, write_flat};
use lazarus_executor::model::{ByteTokenizer, EMBEDDED_CORPUS};

mod process;
use process::{Outcome, run_within};

const LZRUN: &str = env!("CARGO_BIN_EXE_lzrun");
const LIMIT: Duration = Duration::from_secs(300);
static SERIAL: Mutex<()> = Mutex::new(());

fn lzrun(args: &[&str]) -> Outcome {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run_within(Command::new(LZRUN).args(args), LIMIT)
}

fn scratch(name: &str) -> PathBuf {
    process::scratch("data", name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The embedded corpus as a flat `uint16` file, and as an indexed dataset made by
/// `lzrun prepare --tokenizer bytes`.
fn datasets(dir: &Path) -> (PathBuf, PathBuf) {
    let flat = dir.join("train.bin");
    write_flat(
        &flat,
        TokenDtype::U16,
        &ByteTokenizer::encode(EMBEDDED_CORPUS),
    )
    .unwrap();
    let text = dir.join("corpus.txt");
    std::fs::write(&text, EMBEDDED_CORPUS).unwrap();
    let prefix = dir.join("corpus");
    let o = lzrun(&[
        "prepare",
        "--tokenizer",
        "bytes",
        "--input",
        s(&text),
        "--out",
        s(&prefix),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    (flat, prefix)
}

fn losses(o: &Outcome) -> (f64, f64) {
    let sm = o.summary();
    (sm.initial_loss, sm.final_loss)
}

#[test]
fn a_prepared_dataset_a_flat_file_and_a_blend_train_and_the_loss_falls() {
    let dir = scratch("train");
    let (flat, prefix) = datasets(&dir);
    let common = [
        "local",
        "--steps",
        "30",
        "--ckpt-every",
        "0",
        "--format",
        "json",
    ];
    let blend = [format!("0.7:{}", s(&prefix)), format!("0.3:{}", s(&flat))];
    let runs: [Vec<&str>; 4] = [
        vec!["--data", s(&prefix), "--global-batch", "16"],
        vec![
            "--data",
            s(&flat),
            "--data-dtype",
            "u16",
            "--global-batch",
            "16",
        ],
        vec![
            "--data",
            &blend[0],
            "--data",
            &blend[1],
            "--data-dtype",
            "u16",
            "--global-batch",
            "16",
        ],
        // The paper's per-node batches, drawn from the dataset.
        vec!["--data", s(&prefix), "--batch-per-node"],
    ];
    for (i, extra) in runs.iter().enumerate() {
        let mut args: Vec<&str> = common.to_vec();
        args.extend(extra);
        let o = lzrun(&args);
        let (first, last) = losses(&o);
        assert!(
            last < first - 0.5,
            "run {i} ({args:?}): loss {first} → {last}\n{}",
            o.show()
        );
    }
    // A sidecar names the flat file's dtype.
    std::fs::write(dir.join("train.bin.dtype"), "u16\n").unwrap();
    let o = lzrun(&[
        "local",
        "--steps",
        "2",
        "--ckpt-every",
        "0",
        "--data",
        s(&flat),
        "--format",
        "json",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}

/// One line naming the file (and where), exit 2, for every kind of bad data.
#[test]
fn bad_data_is_one_line_naming_the_file_and_exit_2() {
    let dir = scratch("bad");
    let (flat, prefix) = datasets(&dir);
    let idx = std::fs::read(format!("{}.idx", s(&prefix))).unwrap();
    let bin = std::fs::read(format!("{}.bin", s(&prefix))).unwrap();

    // A truncated index.
    let trunc = dir.join("trunc");
    std::fs::write(format!("{}.idx", s(&trunc)), &idx[..idx.len() - 5]).unwrap();
    std::fs::write(format!("{}.bin", s(&trunc)), &bin).unwrap();
    // Pointers past the end of .bin.
    let short = dir.join("short");
    std::fs::write(format!("{}.idx", s(&short)), &idx).unwrap();
    std::fs::write(format!("{}.bin", s(&short)), &bin[..bin.len() - 64]).unwrap();
    // A token id ≥ the tiny model's vocabulary (256), at token 100.
    let mut tokens = ByteTokenizer::encode(EMBEDDED_CORPUS);
    tokens[100] = 300;
    let oov = dir.join("oov.bin");
    write_flat(&oov, TokenDtype::U16, &tokens).unwrap();
    // An empty dataset, and one shorter than a sequence.
    let empty = dir.join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    let tiny = dir.join("tiny.bin");
    write_flat(&tiny, TokenDtype::U16, &[1, 2, 3]).unwrap();
    // A size that is not a whole number of u32 tokens.
    let odd = dir.join("odd.bin");
    std::fs::write(&odd, [0u8; 6]).unwrap();
    // An indexed dataset of int32 tokens read as one of uint16: its index says int32.
    let wide = dir.join("wide");
    let mut w = IndexedWriter::create(&wide, TokenDtype::I32).unwrap();
    w.add_document(&ByteTokenizer::encode(EMBEDDED_CORPUS))
        .unwrap();
    w.finish().unwrap();

    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--data".into(), s(&trunc).into()], "trunc.idx"),
        (vec!["--data".into(), s(&short).into()], "short"),
        (
            vec![
                "--data".into(),
                s(&oov).into(),
                "--data-dtype".into(),
                "u16".into(),
            ],
            "oov.bin",
        ),
        (
            vec![
                "--data".into(),
                s(&empty).into(),
                "--data-dtype".into(),
                "u16".into(),
            ],
            "empty.bin",
        ),
        (
            vec![
                "--data".into(),
                s(&tiny).into(),
                "--data-dtype".into(),
                "u16".into(),
            ],
            "tiny.bin",
        ),
        (
            vec![
                "--data".into(),
                s(&odd).into(),
                "--data-dtype".into(),
                "u32".into(),
            ],
            "odd.bin",
        ),
        (vec!["--data".into(), s(&flat).into()], "--data-dtype"),
        (vec!["--data".into(), s(&dir.join("nope")).into()], "nope"),
        (
            vec![
                "--data".into(),
                s(&flat).into(),
                "--data".into(),
                s(&prefix).into(),
            ],
            "WEIGHT:PATH",
        ),
        (vec!["--data".into(), format!("0:{}", s(&prefix))], "weight"),
        (vec!["--data-dtype".into(), "u16".into()], "without --data"),
        (
            vec![
                "--data".into(),
                s(&prefix).into(),
                "--data-dtype".into(),
                "u8".into(),
            ],
            "u8",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["local", "--steps", "1", "--global-batch", "8"];
        args.extend(extra.iter().map(String::as_str));
        let o = lzrun(&args);
        assert_eq!(o.code, Some(2), "{extra:?}: {}", o.show());
        assert!(
            o.stderr.contains(want),
            "{extra:?}: want {want:?} in {}",
            o.stderr
        );
        assert_eq!(
            o.stderr.trim().lines().count(),
            1,
            "{extra:?}: {}",
            o.stderr
        );
    }
    // The index says int32 tokens: they train (the dtype is the file's), and the vocabulary
    // check reads them as such.
    let o = lzrun(&[
        "local",
        "--steps",
        "1",
        "--ckpt-every",
        "0",
        "--data",
        s(&wide),
        "--global-batch",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let _ = std::fs::remove_dir_all(&dir);
}
