//! `lzrun prepare` (text → Megatron-LM indexed dataset) and `lzrun tokenizer` (train a
//! byte-level BPE `tokenizer.json`). The work is in `lazarus_executor::dataset::prepare`; this
//! is the command line, the progress bar and the summary line.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, anyhow};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lazarus_executor::dataset::prepare::{self, PrepareOptions, TokenizerSource, TrainOptions};

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// A Hugging Face `tokenizer.json`, or `bytes` for the built-in byte tokenizer (vocabulary
    /// 256, no end-of-document token; write `./bytes` for a file named so).
    #[arg(long, value_name = "PATH|bytes", value_parser = parse_tokenizer)]
    pub tokenizer: TokenizerSource,
    /// Input files: `.txt` (the whole file is one document) or `.jsonl` (one document per
    /// line, its "text" string; blank lines are skipped). UTF-8. Several may follow one
    /// --input, or --input may be repeated; they are read in order.
    #[arg(long, value_name = "FILE", required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// Output prefix: PREFIX.bin and PREFIX.idx are written (via PREFIX.bin.tmp and
    /// PREFIX.idx.tmp, renamed at the end, so a failed or interrupted prepare never leaves a
    /// partial dataset under PREFIX nor replaces an existing one). Its directory must exist.
    #[arg(long, value_name = "PREFIX")]
    pub out: PathBuf,
    /// The end-of-document token appended to every document, as a token string of the
    /// tokenizer (e.g. "</s>"). Default: the first of <|endoftext|>, </s>, <eos>, <|eos|> the
    /// tokenizer has. Not with `--tokenizer bytes`.
    #[arg(long, value_name = "TOKEN")]
    pub eod_token: Option<String>,
}

#[derive(Debug, Args)]
pub struct TokenizerArgs {
    /// Vocabulary size to train to, counting the 256 byte tokens and <|endoftext|> (at least
    /// 257). Fewer tokens result when the text has too few pairs left to merge.
    #[arg(long, value_name = "N")]
    pub vocab: usize,
    /// Training text: `.txt` (one document per file) or `.jsonl` (one "text" per line), read
    /// as `lzrun prepare` reads them.
    #[arg(long, value_name = "FILE", required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// The tokenizer.json to write (via OUT.tmp, renamed at the end). Its directory must exist.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn parse_tokenizer(s: &str) -> Result<TokenizerSource, String> {
    s.parse()
}

fn progress_bar(total: u64) -> ProgressBar {
    // Drawn on stderr, and only when stderr is a terminal (indicatif hides it otherwise).
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, eta {eta}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// `lzrun prepare`.
pub fn prepare(a: PrepareArgs) -> Result<()> {
    let opts = PrepareOptions {
        tokenizer: a.tokenizer,
        inputs: a.input,
        out: a.out,
        eod_token: a.eod_token,
    };
    let mut bar: Option<ProgressBar> = None;
    let res = prepare::prepare(&opts, &mut |p| {
        let bar = bar.get_or_insert_with(|| progress_bar(p.total_bytes));
        bar.set_position(p.bytes_read);
        bar.set_message(format!("{} documents, {} tokens", p.documents, p.tokens));
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    // One line: the library's message already names the file (and line).
    let s = res.map_err(|e| anyhow!("{e}"))?;
    let eod = match &s.eod {
        Some((token, id)) => format!("EOD {token} = {id}"),
        None => "no EOD token".to_owned(),
    };
    let empty = if s.empty > 0 {
        format!(" ({} empty skipped)", s.empty)
    } else {
        String::new()
    };
    crate::report::print_line(&format!(
        "prepared {} + .idx: {}{empty}, {} tokens ({}, vocab {}, {eod}), {} bytes, {:.0} tokens/s",
        s.bin_path.display(),
        plural(s.documents, "document"),
        s.tokens,
        s.dtype,
        s.vocab,
        s.bin_bytes,
        s.tokens_per_second(),
    ))?;
    Ok(())
}

/// `lzrun tokenizer`.
pub fn tokenizer(a: TokenizerArgs) -> Result<()> {
    let s = prepare::train_tokenizer(&TrainOptions {
        vocab: a.vocab,
        inputs: a.input,
        out: a.out,
    })
    .map_err(|e| anyhow!("{e}"))?;
    crate::report::print_line(&format!(
        "wrote {}: byte-level BPE, vocab {} (<|endoftext|> = 0), trained on {} ({} bytes) in {:.1} s",
        s.out.display(),
        s.vocab,
        plural(s.documents, "document"),
        s.bytes,
        s.elapsed.as_secs_f64(),
    ))?;
    Ok(())
}
