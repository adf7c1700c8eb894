//! The NCCL backend's public API, as the control plane and workers use it. Without CUDA (CI)
//! only the clean-failure path can run; the success path needs GPUs (a later issue).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use lazarus_executor::comm::nccl::{
    NcclCommunicator, NcclError, NcclUniqueId, connect_over, nccl_available,
};
use lazarus_executor::comm::{CommError, Communicator, LocalGroup};

fn assert_backend<C: Communicator + Send + 'static>() {}

#[test]
fn nccl_communicator_is_a_sendable_backend() {
    assert_backend::<NcclCommunicator>();
}

#[test]
fn unique_id_ships_through_the_control_plane_formats() {
    let id = NcclUniqueId(std::array::from_fn(|i| (i as u8).wrapping_mul(37)));
    let bytes = postcard::to_stdvec(&id).unwrap();
    assert_eq!(postcard::from_bytes::<NcclUniqueId>(&bytes).unwrap(), id);
    let json = serde_json::to_string(&id).unwrap();
    assert_eq!(serde_json::from_str::<NcclUniqueId>(&json).unwrap(), id);
    assert_eq!(NcclUniqueId::from_slice(id.as_bytes()).unwrap(), id);
}

#[test]
fn without_cuda_everything_fails_cleanly() {
    let Err(e) = nccl_available() else {
        return; // a CUDA machine: nothing to check here
    };
    // The CUDA build links the libraries; without a GPU (CI: the driver is a link stub) the
    // driver reports no device.
    assert!(matches!(e, NcclError::NoDevice(_)), "{e:?}");
    assert!(NcclUniqueId::new().is_err());
    let id = NcclUniqueId([0; NcclUniqueId::LEN]);
    let e = NcclCommunicator::new(0, 2, 0, &id, 50).expect_err("no CUDA");
    let c: CommError = e.into();
    assert!(matches!(c, CommError::Io(_)), "{c:?}");
}

/// Forming the NCCL communicator of a membership over its TCP mesh: without CUDA rank 0 cannot
/// make the id, and every rank fails promptly with an error saying so — nobody waits for a
/// rendezvous that cannot happen.
#[test]
fn without_cuda_every_rank_of_a_mesh_fails_promptly() {
    if nccl_available().is_ok() {
        return; // a CUDA machine: check-gpu.sh runs the success path
    }
    let world = 3;
    let mesh = LocalGroup::new(world, 5_000).expect("loopback mesh");
    let results = common::run_ranks(mesh, Duration::from_secs(30), |mut tcp| {
        let rank = tcp.rank();
        let r = connect_over(&mut tcp, 0, 1_000, Arc::new(AtomicBool::new(false)));
        (rank, r.map(|_| ()).map_err(|e| e.to_string()))
    });
    assert_eq!(results.len(), world);
    for (rank, r) in results {
        let e = r.expect_err("no CUDA");
        if rank == 0 {
            assert!(e.contains("device") || e.contains("CUDA"), "rank 0: {e}");
        } else {
            assert!(e.contains("rank 0 could not create"), "rank {rank}: {e}");
        }
    }
}
