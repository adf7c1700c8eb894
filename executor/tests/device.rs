//! `--device` / `--comm` / `--gpus-per-node` of `lzrun`: what a machine without a GPU (or a
//! build without CUDA) answers — one line and exit status 2, before any process is started.

use std::process::Command;

fn lzrun(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lzrun"))
        .args(args)
        .env_remove("LZRUN_DEVICE")
        .env_remove("LZRUN_COMM")
        .env_remove("LZRUN_GPUS_PER_NODE")
        .output()
        .expect("run lzrun");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether a CUDA device is usable here (then the refusal cases below do not apply).
fn gpu_here() -> bool {
    lazarus_executor::device::DeviceChoice::resolve(
        lazarus_executor::device::DeviceKind::Cuda,
        Some(lazarus_executor::device::CommKind::Tcp),
        1,
    )
    .and_then(|c| c.preflight())
    .is_ok()
}

#[test]
fn cuda_without_a_gpu_is_one_line_and_exit_2() {
    if gpu_here() {
        return;
    }
    for args in [
        &["local", "--device", "cuda"][..],
        &["local", "--device", "cuda", "--comm", "tcp", "--nodes", "3"],
        &[
            "worker",
            "--device",
            "cuda",
            "--rank",
            "0",
            "--world",
            "1",
            "--peers",
            "127.0.0.1:1",
        ],
    ] {
        let (code, stdout, stderr) = lzrun(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        let line = stderr.trim_end();
        assert!(line.starts_with("error: --device cuda: "), "{line}");
        if lazarus_executor::device::cuda_built() {
            assert!(line.contains("no usable CUDA device 0"), "{line}");
        } else {
            assert!(line.contains("built without CUDA support"), "{line}");
        }
    }
}

#[test]
fn bad_device_flags_are_one_line_and_exit_2() {
    let cases: [(&[&str], &str); 4] = [
        (&["local", "--device", "gpu"], "expected cpu or cuda"),
        (
            &["local", "--comm", "nccl"],
            "--comm nccl needs --device cuda",
        ),
        (
            &["local", "--gpus-per-node", "0"],
            "--gpus-per-node 0 is out of range: it must be between 1 and 64",
        ),
        (
            &["local", "--nodes", "3", "--gpus-per-node", "40"],
            "--nodes × --gpus-per-node 120 is out of range: it must be between 1 and 64",
        ),
    ];
    for (args, want) in cases {
        let (code, _, stderr) = lzrun(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
