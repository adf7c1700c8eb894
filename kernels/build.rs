//! With feature `cuda`: compiles `src/dispatch.cu` to PTX (`compute_80`, PTX ISA 9.0 with nvcc
//! 13.0) into `OUT_DIR/dispatch.ptx`, which `src/cuda.rs` embeds. nvcc is taken from
//! `$CUDA_HOME/bin`, else from `PATH` (`source kernels/setup-cuda.sh` provides both).
//! Without the feature it does nothing: the CPU references need no toolchain.

use std::path::PathBuf;
use std::process::Command;

/// The virtual architecture the embedded PTX targets; the driver JITs it for newer GPUs.
const ARCH: &str = "compute_80";

fn main() {
    println!("cargo:rerun-if-changed=src/dispatch.cu");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let status = Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17", "-arch", ARCH, "-o"])
        .arg(out.join("dispatch.ptx"))
        .arg("src/dispatch.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{} failed ({s}) compiling src/dispatch.cu", nvcc.display()),
        Err(e) => panic!(
            "cannot run {} ({e}): feature `cuda` needs a CUDA 13.0 toolchain; \
             `source kernels/setup-cuda.sh` lays one out",
            nvcc.display()
        ),
    }
}
