//! Running the `lzrun` binary from an integration test: its exit code and output, bounded.

use std::io::Read;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::metrics::Summary;

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
