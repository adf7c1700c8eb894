//! The READMEs' examples, run as written (issue 35: "every runnable example in the READMEs
//! runs as written and prints what the README says it prints").
//!
//! Every command line of a ```` ```sh ```` block of `README.md` and `executor/README.md` is
//! taken in document order and either **run** — with the debug `lzrun` / `lzsim` first on
//! `PATH`, in a scratch directory that sees the repository's `executor/`, `traces/`, … but
//! writes its own `runs/` — or **skipped with its reason**, and then at least each `--flag` it
//! uses is checked against its command's `--help`. What a run must show comes from the README
//! itself:
//! * exit status 0, or 2 with one line on stderr where the comment says "exit status 2";
//! * "loss A → B" in the comment: the run's done line prints the same losses to the README's
//!   precision;
//! * a ```` ```text ```` block opening with `$ COMMAND` or `Usage: BIN <COMMAND>`: every line
//!   of it (but `…`) appears in the command's output, in order.
//!
//! A command that needs a file a later example writes (the tour's `--resume runs/a/ckpt`,
//! `--data runs/data/train`) fails first and is run again at the end. `trace.csv`, the
//! README's stand-in for "your trace", is the embedded trace. Examples that take minutes run
//! only with `LAZARUS_README_ALL=1`; the ones that need other machines, a GPU, a Slurm
//! cluster or a third-party trace are skipped, each with its reason printed.
//!
//! The binaries are the ones `cargo test --workspace` builds next to this test (the executor's
//! and the simulator's own integration tests make cargo build them); run alone without them,
//! the test prints one `skipped:` line.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The documents whose shell examples are run (every document with a ```` ```sh ```` block;
/// `every_document_with_shell_examples_is_listed` keeps this list whole).
const DOCS: [&str; 8] = [
    "README.md",
    "executor/README.md",
    "kernels/README.md",
    "notebooks/README.md",
    "results/executor/README.md",
    "results/executor/recovery.md",
    "results/hf-interop/README.md",
    "results/swarm/README.md",
];

/// Longest any one example may take (the slowest quick one takes ≈ 1 min in the debug build on
/// a loaded 2-core machine).
const LIMIT: Duration = Duration::from_secs(600);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

/// `target/debug` (or the profile this test was built in) when it holds both binaries.
fn bin_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.to_path_buf(); // target/<profile>/deps/<test> → target/<profile>
    (dir.join("lzrun").is_file() && dir.join("lzsim").is_file()).then_some(dir)
}

/// One shell command of a README, continuation lines joined, with its trailing comment.
#[derive(Debug, Clone)]
struct Example {
    doc: &'static str,
    line: usize,
    command: String,
    comment: String,
    /// A line of a job script (`#!` block), not a command of its own.
    in_script: bool,
}

impl Example {
    fn at(&self) -> String {
        let first = self.command.lines().next().unwrap_or_default();
        let more = if self.command.lines().count() > 1 {
            " …"
        } else {
            ""
        };
        format!("{}:{}: {first}{more}", self.doc, self.line)
    }
}

/// A ```` ```text ```` block: its opening line (`$ COMMAND` or `Usage: …`) and the rest.
#[derive(Debug)]
struct Shown {
    doc: &'static str,
    line: usize,
    lines: Vec<String>,
}

/// Splits a shell line into the command and a trailing `# comment` (a `#` after whitespace,
/// outside quotes).
fn split_comment(line: &str) -> (String, String) {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => {
                return (
                    line[..i].trim().to_string(),
                    line[i + 1..].trim().to_string(),
                );
            }
            _ => {}
        }
        prev = c;
    }
    (line.trim().to_string(), String::new())
}

/// The shell blocks of `doc` (each a list of examples) and its text blocks.
fn read_doc(doc: &'static str, text: &str) -> (Vec<Vec<Example>>, Vec<Shown>) {
    let mut blocks = Vec::new();
    let mut shown = Vec::new();
    let mut fence: Option<(String, usize)> = None;
    let mut body: Vec<(usize, String)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if let Some(rest) = raw.strip_prefix("```") {
            match fence.take() {
                None => fence = Some((rest.trim().to_string(), i + 1)),
                Some((lang, at)) => {
                    if lang == "sh" || lang == "bash" {
                        blocks.push(shell_block(doc, &body));
                        let first = body.iter().find(|(_, l)| !l.trim().is_empty());
                        let last = blocks.last_mut().unwrap();
                        if first.is_some_and(|(_, l)| l.starts_with("#!")) {
                            // A job script (Slurm): its lines are not commands of their own.
                            for e in last.iter_mut() {
                                e.in_script = true;
                            }
                        } else if last
                            .iter()
                            .any(|e| e.command.ends_with('&') || e.command.starts_with("export "))
                        {
                            // A shell session (background jobs, `%1`, exported variables):
                            // one script, run whole.
                            let session = Example {
                                doc,
                                line: last[0].line,
                                command: last
                                    .iter()
                                    .map(|e| e.command.as_str())
                                    .collect::<Vec<_>>()
                                    .join("\n"),
                                comment: String::new(),
                                in_script: false,
                            };
                            *last = vec![session];
                        }
                    } else if lang == "text" {
                        shown.push(Shown {
                            doc,
                            line: at + 1,
                            lines: body.iter().map(|(_, l)| l.clone()).collect(),
                        });
                    }
                    body.clear();
                }
            }
            continue;
        }
        if fence.is_some() {
            body.push((i + 1, raw.to_string()));
        }
    }
    (blocks, shown)
}

fn shell_block(doc: &'static str, body: &[(usize, String)]) -> Vec<Example> {
    let mut out = Vec::new();
    let mut pending: Option<Example> = None;
    for (line, raw) in body {
        let (command, comment) = split_comment(raw);
        let continued = command.ends_with('\\');
        let command = command.trim_end_matches('\\').trim().to_string();
        match pending.as_mut() {
            Some(p) => {
                p.command = format!("{} {}", p.command, command);
                if !comment.is_empty() {
                    p.comment = comment;
                }
            }
            None if command.is_empty() && !continued => continue,
            None => {
                pending = Some(Example {
                    doc,
                    line: *line,
                    command,
                    comment,
                    in_script: false,
                })
            }
        }
        if !continued {
            out.extend(pending.take());
        }
    }
    out.extend(pending);
    out
}

/// Why an example is not run here, or `None` to run it.
fn skip_reason(e: &Example, all: bool) -> Option<&'static str> {
    let c = e.command.as_str();
    let has = |s: &str| c.contains(s);
    if e.in_script {
        return Some("a Slurm job script: needs a cluster");
    }
    if c.starts_with("cargo test --workspace") {
        return Some("the test command itself");
    }
    if c.starts_with("cargo build --release -p lazarus-executor --bin lzrun") {
        return Some("a release build (minutes); the tests use the debug build");
    }
    if c.starts_with("cargo build")
        || has("setup-cuda.sh")
        || has("stage-gpu.sh")
        || has("check-gpu.sh")
        || has("--device cuda --comm")
    {
        return Some("the CUDA build or a GPU: .ci/cuda builds and checks this path");
    }
    if has("10.0.0.") || has("/shared/") {
        return Some("needs several machines");
    }
    if has("path/to/") || has("g4dn.csv") {
        return Some("needs a third-party trace (../shared/traces)");
    }
    if has("kernels/build-ptx.sh") || has("$LZ_CUDA_LIBS") {
        return Some("the CUDA build or a GPU: .ci/cuda builds and checks this path");
    }
    if c.starts_with("bash results/") || has(" bash results/") || has("regenerate.sh") {
        return Some("regenerates a results folder (minutes to hours)");
    }
    if c.starts_with("pip ")
        || c.starts_with("python3 ")
        || c.starts_with("jupyter ")
        || has("python3 results/")
    {
        return Some("needs the notebooks' Python environment");
    }
    if has("cargo bench") || c.starts_with("cargo test --release") {
        return Some("a benchmark or a release-profile run (minutes)");
    }
    if !all {
        if has("--storm 100") {
            return Some("slow (minutes): LAZARUS_README_ALL=1 runs it");
        }
        if has("lzrun calibrate") || has("--hardware hw.toml") {
            return Some("slow (calibration, 1–2 min): LAZARUS_README_ALL=1 runs it");
        }
    }
    None
}

/// The command as run here: `cargo run --release --bin X -- ARGS` becomes `X ARGS` (the debug
/// build, which cargo test has just made), the rest runs as written.
fn as_run(command: &str) -> String {
    if let Some(rest) = command.strip_prefix("cargo run --release --bin ") {
        if let Some((bin, args)) = rest.split_once(" -- ") {
            return format!("{bin} {args}");
        }
        return rest.to_string();
    }
    command.to_string()
}

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    secs: f64,
}

fn run_shell(command: &str, cwd: &Path, bins: &Path) -> Outcome {
    let path = format!(
        "{}:{}",
        bins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let start = Instant::now();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("set -e\n{command}"))
        .current_dir(cwd)
        .env("PATH", path)
        .env_remove("LZRUN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bash");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status.code();
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    Outcome {
        code,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
        secs: start.elapsed().as_secs_f64(),
    }
}

/// "loss A → B" in a README comment or an output line.
fn loss_claim(s: &str) -> Option<(String, String)> {
    let at = s.find("loss ")?;
    let rest = &s[at + 5..];
    let (a, rest) = rest.split_once(" → ")?;
    let b: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let a = a.trim();
    (a.parse::<f64>().is_ok() && b.parse::<f64>().is_ok()).then(|| (a.to_string(), b))
}

/// `printed` rounds to `claimed` at the claim's precision.
fn same_to_precision(claimed: &str, printed: &str) -> bool {
    let decimals = claimed.split_once('.').map_or(0, |(_, d)| d.len());
    let (c, p) = (
        claimed.parse::<f64>().unwrap(),
        printed.parse::<f64>().unwrap(),
    );
    (c - p).abs() <= 0.5 * 10f64.powi(-(decimals as i32)) + 1e-9
}

/// Checks what a run printed against what its README line says; `Err` says what differs.
fn check(e: &Example, o: &Outcome) -> Result<(), String> {
    let says_exit_2 = e.comment.contains("exit status 2") || e.comment.contains("exit 2");
    if says_exit_2 {
        if o.code != Some(2) {
            return Err(format!("exit {:?}, the README says 2", o.code));
        }
        if o.stderr.trim().lines().count() != 1 {
            return Err(format!(
                "the README says one line; stderr has {}",
                o.stderr.trim().lines().count()
            ));
        }
        return Ok(());
    }
    if o.code != Some(0) {
        return Err(format!("exit {:?}", o.code));
    }
    if let Some((a, b)) = loss_claim(&e.comment) {
        let printed = o
            .stdout
            .lines()
            .chain(o.stderr.lines())
            .filter(|l| l.contains("done"))
            .find_map(loss_claim)
            .ok_or("the README claims a loss, the run printed no done line with one")?;
        if !same_to_precision(&a, &printed.0) || !same_to_precision(&b, &printed.1) {
            return Err(format!(
                "the README says loss {a} → {b}, the run printed {} → {}",
                printed.0, printed.1
            ));
        }
    }
    Ok(())
}

/// Every line of `expected` (but `…` lines) appears in `output`, in order.
fn shows_in_order(expected: &[String], output: &str) -> Result<(), String> {
    let lines: Vec<&str> = output.lines().map(str::trim_end).collect();
    let mut at = 0;
    for want in expected {
        let want = want.trim_end();
        if want.trim() == "…" || want.trim().is_empty() {
            continue;
        }
        match lines[at..].iter().position(|l| *l == want) {
            Some(i) => at += i + 1,
            None => return Err(format!("missing (in order): {want:?}")),
        }
    }
    Ok(())
}

/// The flags (`--name`) a command passes to `lzrun` / `lzsim`, with the subcommand.
fn flags_of(command: &str) -> Option<(String, Vec<String>, Vec<String>)> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "lzrun" || *w == "lzsim")?;
    let bin = words[at].to_string();
    let mut sub = Vec::new();
    if let Some(s) = words.get(at + 1).filter(|w| !w.starts_with('-')) {
        sub.push(s.to_string());
    }
    let flags = words[at + 1..]
        .iter()
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_string())
        .collect();
    Some((bin, sub, flags))
}

/// The scratch directory: the repository's inputs linked in, everything written stays here.
fn scratch(repo: &Path) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("readme-examples-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in [
        "executor",
        "traces",
        "simulator",
        "kernels",
        "planner",
        "results",
        "notebooks",
    ] {
        std::os::unix::fs::symlink(repo.join(entry), dir.join(entry)).unwrap();
    }
    // "trace.csv" is the READMEs' name for the user's own trace: the embedded one here.
    std::fs::copy(
        repo.join("traces/data/paper-5min-10nodes.csv"),
        dir.join("trace.csv"),
    )
    .unwrap();
    dir
}

#[test]
fn every_readme_example_runs_as_written() {
    let Some(bins) = bin_dir() else {
        eprintln!(
            "skipped: lzrun and lzsim are not built next to this test (cargo test --workspace builds them)"
        );
        return;
    };
    let all = std::env::var_os("LAZARUS_README_ALL").is_some();
    let repo = repo();
    let cwd = scratch(&repo);

    let mut examples = Vec::new();
    let mut shown = Vec::new();
    for doc in DOCS {
        let text = std::fs::read_to_string(repo.join(doc)).unwrap();
        let (blocks, texts) = read_doc(doc, &text);
        examples.extend(blocks.into_iter().flatten());
        shown.extend(texts);
    }
    assert!(
        examples.len() > 40,
        "the READMEs' examples were not found ({} commands)",
        examples.len()
    );

    let mut failures = Vec::new();
    let mut deferred = Vec::new();
    let mut ran = 0;
    let mut help_checked = 0;
    for e in &examples {
        if let Some(why) = skip_reason(e, all) {
            println!("skip  {} ({why})", e.at());
            if let Err(m) = flags_exist(&e.command, &bins, &cwd) {
                failures.push(format!("{}: {m}", e.at()));
            } else {
                help_checked += 1;
            }
            continue;
        }
        let o = run_shell(&as_run(&e.command), &cwd, &bins);
        match check(e, &o) {
            Ok(()) => {
                ran += 1;
                println!("ok    {} ({:.1} s)", e.at(), o.secs);
            }
            Err(_) if o.code != Some(0) && needs_a_later_file(&e.command, &cwd) => {
                println!("later {} (needs a file a later example writes)", e.at());
                deferred.push(e.clone());
            }
            Err(m) => failures.push(format!(
                "{}: {m}\nstdout:\n{}\nstderr:\n{}",
                e.at(),
                tail(&o.stdout),
                tail(&o.stderr)
            )),
        }
    }
    for e in &deferred {
        let o = run_shell(&as_run(&e.command), &cwd, &bins);
        match check(e, &o) {
            Ok(()) => {
                ran += 1;
                println!(
                    "ok    {} ({:.1} s, after the later examples)",
                    e.at(),
                    o.secs
                );
            }
            Err(m) => failures.push(format!(
                "{}: {m}\nstdout:\n{}\nstderr:\n{}",
                e.at(),
                tail(&o.stdout),
                tail(&o.stderr)
            )),
        }
    }

    // Text blocks that show a command's output: the same lines, in order.
    let mut shown_checked = 0;
    for s in &shown {
        let Some(first) = s.lines.first() else {
            continue;
        };
        let (command, expected) = if let Some(cmd) = first.strip_prefix("$ ") {
            (cmd.to_string(), &s.lines[1..])
        } else if let Some(bin) = first
            .strip_prefix("Usage: ")
            .and_then(|u| u.strip_suffix(" <COMMAND>"))
        {
            (format!("{bin} --help"), &s.lines[..])
        } else {
            continue;
        };
        let o = run_shell(&command, &cwd, &bins);
        if o.code != Some(0) {
            failures.push(format!(
                "{}:{}: `{command}` exits {:?}",
                s.doc, s.line, o.code
            ));
        } else if let Err(m) = shows_in_order(expected, &o.stdout) {
            failures.push(format!(
                "{}:{}: `{command}` does not print what the README shows: {m}\noutput:\n{}",
                s.doc,
                s.line,
                tail(&o.stdout)
            ));
        } else {
            shown_checked += 1;
        }
    }
    println!(
        "{ran} examples run, {help_checked} skipped ones checked against --help, {shown_checked} shown outputs compared"
    );
    assert!(
        failures.is_empty(),
        "{} README example(s) do not hold:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    let _ = std::fs::remove_dir_all(&cwd);
}

/// A path argument under `runs/` that does not exist yet.
fn needs_a_later_file(command: &str, cwd: &Path) -> bool {
    command
        .split_whitespace()
        .filter(|w| w.starts_with("runs/"))
        .any(|w| {
            let p = cwd.join(w);
            !p.exists() && !p.with_extension("idx").exists()
        })
}

/// Every file a skipped example names as a script or input (`*.sh`, `*.py`, `*.ipynb`,
/// `*requirements.txt` under the repository) exists, and every `--flag` of a skipped `lzrun` /
/// `lzsim` command is one its `--help` lists.
fn flags_exist(command: &str, bins: &Path, cwd: &Path) -> Result<(), String> {
    for word in command.split_whitespace() {
        let word = word.trim_matches(|c| c == '"' || c == '\'' || c == ';');
        let named = [".sh", ".py", ".ipynb", "requirements.txt"]
            .iter()
            .any(|x| word.ends_with(x));
        if named && !word.contains('/') {
            continue;
        }
        if named && !word.starts_with('/') && !cwd.join(word).exists() {
            return Err(format!("names {word}, which is not in the repository"));
        }
    }
    let Some((bin, sub, flags)) = flags_of(&as_run(command)) else {
        return Ok(());
    };
    let help = run_shell(&format!("{bin} {} --help", sub.join(" ")), cwd, bins);
    if help.code != Some(0) {
        return Err(format!(
            "`{bin} {} --help` exits {:?}",
            sub.join(" "),
            help.code
        ));
    }
    let listed = |f: &str| {
        help.stdout
            .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
            .any(|w| w == f || w.split('=').next() == Some(f))
    };
    let unknown: Vec<&String> = flags.iter().filter(|f| !listed(f)).collect();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "flags not listed by `{bin} {} --help`: {unknown:?}",
            sub.join(" ")
        ))
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[test]
fn every_document_with_shell_examples_is_listed() {
    let repo = repo();
    let mut missing = Vec::new();
    let mut stack = vec![repo.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "fuzz" {
                    stack.push(path);
                }
            } else if name.ends_with(".md") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let rel = path
                    .strip_prefix(&repo)
                    .unwrap()
                    .to_string_lossy()
                    .to_string();
                let has_shell = text.lines().any(|l| l == "```sh" || l == "```bash");
                if has_shell && !DOCS.contains(&rel.as_str()) {
                    missing.push(rel);
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "shell examples not run by this test: {missing:?} (add them to DOCS)"
    );
}

#[test]
fn the_example_reader_joins_continuations_and_splits_comments() {
    let text = "x\n```sh\nlzrun local --a 1 \\\n  --b 2   # two flags\nprintf 'a # b'  # quoted\n```\n```text\n$ lzsim plan\n  node 0\n```\n";
    let (blocks, shown) = read_doc("doc", text);
    let ex: Vec<_> = blocks.into_iter().flatten().collect();
    assert_eq!(ex.len(), 2);
    assert_eq!(ex[0].command, "lzrun local --a 1 --b 2");
    assert_eq!(ex[0].comment, "two flags");
    assert_eq!(ex[0].line, 3);
    assert_eq!(ex[1].command, "printf 'a # b'");
    assert_eq!(shown.len(), 1);
    assert_eq!(shown[0].lines, vec!["$ lzsim plan", "  node 0"]);
    assert_eq!(
        as_run("cargo run --release --bin lzsim -- replay"),
        "lzsim replay"
    );
    assert_eq!(
        loss_claim("2 nodes (≈ 2 s): loss 5.5 → 3.7"),
        Some(("5.5".into(), "3.7".into()))
    );
    assert!(same_to_precision("5.5", "5.53"));
    assert!(!same_to_precision("3.0", "3.69"));
    let session = "```sh\nexport T=1\nlzrun controller &\nkill %1  # gone\n```\n```sh\n#!/bin/bash\nsrun lzrun agent\n```\n";
    let (blocks, _) = read_doc("doc", session);
    assert_eq!(blocks[0].len(), 1, "a session runs whole");
    assert_eq!(
        blocks[0][0].command,
        "export T=1\nlzrun controller &\nkill %1"
    );
    assert!(
        blocks[1].iter().all(|e| e.in_script),
        "a job script's lines are not run"
    );
    assert!(shows_in_order(&["a".into(), "…".into(), "c".into()], "a\nb\nc\n").is_ok());
    assert!(shows_in_order(&["c".into(), "a".into()], "a\nb\nc\n").is_err());
}
