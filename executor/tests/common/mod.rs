//! Helpers shared by the integration tests that run one thread per rank.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::comm::TcpCommunicator;
use lazarus_executor::model::MoeConfig;

/// Runs `f(comm)` for every rank on its own thread and returns the results in rank order.
/// Panics (fails the test) if a rank panics or not every rank finishes within `limit`.
pub fn run_ranks<R, F>(comms: Vec<TcpCommunicator>, limit: Duration, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(TcpCommunicator) -> R + Send + Sync + Clone + 'static,
{
    let world = comms.len();
    let (tx, rx) = mpsc::channel();
    for (rank, comm) in comms.into_iter().enumerate() {
        let (tx, f) = (tx.clone(), f.clone());
        thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
            let _ = tx.send((rank, r));
        });
    }
    let deadline = Instant::now() + limit;
    let mut out: Vec<Option<R>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, r) = rx
            .recv_timeout(left)
            .expect("a rank did not finish in time (hang)");
        match r {
            Ok(v) => out[rank] = Some(v),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// A model small enough for several ranks on threads: 2 MoE layers of 4 experts, top-2, the
/// clipped recipe.
#[allow(dead_code)] // not every test crate that shares this module builds a model
pub fn small_config(seed: u64) -> MoeConfig {
    MoeConfig {
        vocab: 256,
        d_model: 16,
        n_layers: 2,
        n_heads: 2,
        d_ff: 32,
        experts: 4,
        top_k: 2,
        seq_len: 8,
        batch: 3,
        lb_loss_coef: 0.01,
        lr: 1e-2,
        adam_beta2: 0.999,
        grad_clip_norm: 1.0,
        seed,
        precision: lazarus_executor::model::Precision::Auto,
        hf: None,
    }
}
