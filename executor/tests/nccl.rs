//! The NCCL backend's public API, as the control plane and workers use it. Without CUDA (CI)
//! only the clean-failure path can run; the success path needs GPUs (a later issue).
#![cfg(feature = "cuda")]

use lazarus_executor::comm::nccl::{NcclCommunicator, NcclError, NcclUniqueId, nccl_available};
use lazarus_executor::comm::{CommError, Communicator};

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
