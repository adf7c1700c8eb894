//! Aborting the communicator of the worker's current epoch from the thread that reads the
//! controller's commands.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::comm::AbortHandle;

/// Lets the thread that reads the controller's commands abort the communicator of the
/// worker's current epoch while the training thread is blocked in a rendezvous or a
/// collective ([`Command::Abort`]).
#[derive(Debug, Default, Clone)]
pub struct AbortSlot(Arc<Mutex<SlotState>>);

#[derive(Debug, Default)]
struct SlotState {
    epoch: u64,
    flag: Arc<AtomicBool>,
    handle: Option<AbortHandle>,
    /// The newest epoch an abort was asked for (it may arrive before the reconfiguration).
    aborted: Option<u64>,
}

impl AbortSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Aborts the communicator of `epoch` (now, or as soon as one is formed).
    pub fn abort(&self, epoch: u64) {
        let mut st = self.lock();
        st.aborted = Some(st.aborted.map_or(epoch, |a| a.max(epoch)));
        if st.epoch == epoch {
            st.flag.store(true, Ordering::SeqCst);
            if let Some(h) = &st.handle {
                h.abort();
            }
        }
    }

    /// A fresh abort flag for the rendezvous of `epoch`.
    pub(super) fn arm(&self, epoch: u64) -> Arc<AtomicBool> {
        let mut st = self.lock();
        let flag = Arc::new(AtomicBool::new(st.aborted.is_some_and(|a| a >= epoch)));
        st.epoch = epoch;
        st.flag = flag.clone();
        st.handle = None;
        flag
    }

    /// The abort flag of the current epoch (raised by [`Self::abort`]): what a communicator
    /// without an [`AbortHandle`] polls (NCCL's).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn flag(&self) -> Arc<AtomicBool> {
        self.lock().flag.clone()
    }

    pub(super) fn set_handle(&self, handle: AbortHandle) {
        let mut st = self.lock();
        if st.flag.load(Ordering::SeqCst) {
            handle.abort();
        }
        st.handle = Some(handle);
    }
}
