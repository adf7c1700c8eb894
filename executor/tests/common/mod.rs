//! Helpers shared by the integration tests that run one thread per rank.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::comm::TcpCommunicator;

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
