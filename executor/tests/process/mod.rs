//! Running the `lzrun` binary from an integration test: its exit code and output, bounded.

use std::io::Read;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::metrics::Summary;
use lazarus_executor::model::MoeConfig;
use lazarus_executor::worker::Checksums;
use std::collections::BTreeMap;
use std::path::Path;

pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    pub fn show(&self) -> String {
        format!("stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr)
    }

    /// The summary object of a `--format json` run.
    #[allow(dead_code)] // not every test crate reads a summary
    pub fn summary(&self) -> Summary {
        assert_eq!(self.code, Some(0), "{}", self.show());
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| {
            panic!("summary JSON: {e}\n{}", self.show());
        })
    }
}

/// A fresh directory `<prefix>-<name>-<pid>` under the test target's temporary directory.
#[allow(dead_code)] // not every test crate makes one
pub fn scratch(prefix: &str, name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{prefix}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `cmd` to the end with its output captured; kills it (and fails the test) after `limit`.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Outcome {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lzrun");
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
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for lzrun") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lzrun did not finish within {limit:?}");
        }
        thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

/// Every worker's checksum file in `dir`: replicas of one expert identical everywhere, the dense
/// weights identical everywhere, every expert of every layer held somewhere (replicas or FSEP
/// shard copies; the checksums cover whatever parameters the model family has). Returns the
/// files.
#[allow(dead_code)] // lzrun.rs and families_lzrun.rs
pub fn assert_consistent(dir: &Path, cfg: &MoeConfig) -> Vec<Checksums> {
    let mut sums = Vec::new();
    for entry in std::fs::read_dir(dir).expect("checksum dir") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("node") && name.ends_with(".json") {
            let s = Checksums::read(&path).expect("checksum file");
            // A newcomer started near the end that never became a member (world 0, no step)
            // holds its fresh initial state, not the job's; the controller's final check
            // leaves it out too. With faster recoveries a trace run ends before such a late
            // addition has joined more often.
            if s.world == 0 && s.steps == 0 {
                continue;
            }
            sums.push(s);
        }
    }
    assert!(!sums.is_empty(), "no checksum files in {}", dir.display());
    let mut seen: BTreeMap<(usize, usize), Vec<(u64, u64)>> = BTreeMap::new();
    for s in &sums {
        assert_eq!(s.dense, sums[0].dense, "dense weights differ: {sums:?}");
        for r in &s.replicas {
            seen.entry((r.layer, r.expert))
                .or_default()
                .push((r.checksum, r.weights_checksum));
        }
    }
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            let v = seen
                .get(&(l, e))
                .unwrap_or_else(|| panic!("expert {e} of layer {l} is held by nobody"));
            assert!(
                v.iter().all(|x| *x == v[0]),
                "replicas of expert {e} of layer {l} differ: {v:?}"
            );
        }
    }
    sums
}

/// Every node's checksum file of an FSEP run: one dense state everywhere, no whole replica
/// anywhere (each worker holds only shards). Returns how many files.
#[allow(dead_code)] // lzrun.rs and families_lzrun.rs
pub fn assert_fsep_consistent(dir: &Path) -> usize {
    let mut sums = Vec::new();
    for entry in std::fs::read_dir(dir).expect("checksum dir") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("node") && name.ends_with(".json") {
            sums.push(Checksums::read(&path).expect("checksum file"));
        }
    }
    assert!(!sums.is_empty(), "no checksum files in {}", dir.display());
    for s in &sums {
        assert_eq!(s.dense, sums[0].dense, "dense weights differ: {sums:?}");
        assert!(
            s.replicas.is_empty(),
            "an FSEP worker holds replicas: {s:?}"
        );
    }
    sums.len()
}
