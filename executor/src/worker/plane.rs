//! The epoch's data plane: what a managed worker trains and migrates state over.
//!
//! Every epoch forms a TCP mesh first ([`TcpCommunicator`], with the epoch's secret). With
//! `--comm tcp` the mesh is the data plane. With `--comm nccl` the mesh only bootstraps an NCCL
//! communicator and closes; the expert-state migration and training then run over NCCL:
//!
//! * **Shrink** (`ncclCommShrink`, NCCL 2.27 and later): when the new membership is the
//!   previous epoch's less some members, in the same order — what losing a node leaves — the
//!   survivors shrink the NCCL communicator they kept from that epoch (aborting its outstanding
//!   operations when it failed). No new unique id, no bootstrap of a whole new communicator.
//! * **Fresh** (`ncclCommInitRankConfig`): otherwise — a first epoch, a newcomer, a
//!   renumbering, an older NCCL without shrink — rank 0 creates a unique id and sends it over
//!   the mesh (`comm::nccl::connect_over`, feature `cuda`).
//!
//! Shrinking is collective among the survivors, so they first agree over the mesh
//! ([`agree_on_shrink`]): each proposes the epoch of the communicator it kept and the ranks to
//! exclude, and they shrink only if every member proposed exactly the same. A member that kept
//! nothing, or a different epoch's communicator, makes them all form a fresh one instead.
//! A communicator is never repaired in place either way: the new epoch always gets a new one.

use anyhow::Result;

use super::abort::AbortSlot;
use super::protocol::Reconfigure;
use crate::comm::{Communicator, Rank, TcpCommunicator};
#[cfg(not(feature = "cuda"))]
use crate::device::CommKind;

/// What a worker keeps of the last epoch's data plane for the next one (the NCCL communicator,
/// to shrink). Empty with `--comm tcp` and in builds without CUDA.
#[derive(Default)]
pub(super) struct KeptPlane {
    #[cfg(feature = "cuda")]
    nccl: Option<nccl::Kept>,
}

/// The ranks of the `old` membership that the `new` one drops, when `new` is `old` less those
/// members in the same order (the condition for `ncclCommShrink`, whose survivors keep their
/// order); `None` when `new` has a member `old` lacks or orders them differently. Members are
/// identified by their data-plane address, which a worker keeps for its whole life.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn shrink_exclusions<T: PartialEq>(old: &[T], new: &[T]) -> Option<Vec<Rank>> {
    let mut exclude = Vec::new();
    let mut next = new.iter().peekable();
    for (rank, member) in old.iter().enumerate() {
        if next.peek() == Some(&member) {
            next.next();
        } else {
            exclude.push(rank);
        }
    }
    (next.next().is_none() && exclude.len() < old.len()).then_some(exclude)
}

/// Whether every member of `mesh` proposes the same shrink: `proposal` is this member's
/// `(epoch of the communicator it kept, ranks of that epoch to exclude)`, `None` when it cannot
/// shrink. One all-gather; every member gets the same answer.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn agree_on_shrink(
    mesh: &mut dyn Communicator,
    proposal: Option<(u64, &[Rank])>,
) -> Result<bool, crate::comm::CommError> {
    let words: Vec<u64> = match proposal {
        Some((epoch, exclude)) => [1, epoch, exclude.len() as u64]
            .into_iter()
            .chain(exclude.iter().map(|&r| r as u64))
            .collect(),
        None => vec![0],
    };
    let all = mesh.all_gather_u64(&words)?;
    Ok(words[0] == 1 && all.iter().all(|w| *w == words))
}

/// The data plane of epoch `cmd.epoch`, from its TCP mesh (see the module docs).
pub(super) fn data_plane(
    tcp: TcpCommunicator,
    cmd: &Reconfigure,
    timeout_ms: u64,
    abort: &AbortSlot,
    kept: &mut KeptPlane,
) -> Result<Box<dyn Communicator>> {
    #[cfg(feature = "cuda")]
    {
        nccl::data_plane(tcp, cmd, timeout_ms, abort, kept)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (cmd, timeout_ms, abort, kept);
        match crate::device::process_choice().comm {
            CommKind::Tcp => Ok(Box::new(tcp)),
            CommKind::Nccl => Err(anyhow::anyhow!(
                "--comm nccl needs an lzrun built with --features cuda"
            )),
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex, MutexGuard};

    use anyhow::{Context, Result};

    use super::*;
    use crate::comm::CommError;
    use crate::comm::nccl::{NcclCommunicator, connect_over, shrink_available};
    use crate::device::CommKind;

    /// The NCCL communicator of one epoch, shared by the epoch's runtime and the worker (which
    /// keeps it for the next epoch to shrink).
    pub(super) struct Kept {
        epoch: u64,
        peers: Vec<SocketAddr>,
        comm: Arc<Mutex<NcclCommunicator>>,
    }

    /// [`NcclCommunicator`] behind the mutex it shares with [`Kept`].
    struct Shared(Arc<Mutex<NcclCommunicator>>);

    impl Shared {
        fn lock(&self) -> MutexGuard<'_, NcclCommunicator> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    impl Communicator for Shared {
        fn rank(&self) -> Rank {
            self.lock().rank()
        }
        fn world(&self) -> usize {
            self.lock().world()
        }
        fn all_to_all_v(&mut self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
            self.lock().all_to_all_v(send)
        }
        fn all_gather_u64(&mut self, mine: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
            self.lock().all_gather_u64(mine)
        }
        fn all_reduce_sum(&mut self, group: &[Rank], buf: &mut [f32]) -> Result<(), CommError> {
            self.lock().all_reduce_sum(group, buf)
        }
        fn send_recv(
            &mut self,
            sends: Vec<(Rank, Vec<f32>)>,
            recv_from: &[Rank],
        ) -> Result<Vec<(Rank, Vec<f32>)>, CommError> {
            self.lock().send_recv(sends, recv_from)
        }
        fn barrier(&mut self) -> Result<(), CommError> {
            self.lock().barrier()
        }
        fn abort(&mut self) {
            Communicator::abort(&mut *self.lock());
        }
        fn set_timeout_ms(&mut self, timeout_ms: u64) -> Result<(), CommError> {
            Communicator::set_timeout_ms(&mut *self.lock(), timeout_ms)
        }
        fn payload_bytes_sent(&self) -> u64 {
            self.lock().payload_bytes_sent()
        }
    }

    pub(super) fn data_plane(
        mut tcp: TcpCommunicator,
        cmd: &Reconfigure,
        timeout_ms: u64,
        abort: &AbortSlot,
        kept: &mut KeptPlane,
    ) -> Result<Box<dyn Communicator>> {
        let choice = crate::device::process_choice();
        // Whatever happens, the last epoch's communicator is used at most once.
        let previous = kept.nccl.take();
        if choice.comm == CommKind::Tcp {
            return Ok(Box::new(tcp));
        }
        let me = cmd.rank;
        let proposal = previous.as_ref().and_then(|p| {
            let live = p.comm.lock().map(|c| c.can_shrink()).unwrap_or(false);
            let exclude = shrink_exclusions(&p.peers, &cmd.peers)?;
            (live && shrink_available()).then_some((p.epoch, exclude))
        });
        let agreed = agree_on_shrink(&mut tcp, proposal.as_ref().map(|(e, x)| (*e, &x[..])))
            .with_context(|| format!("rank {me}: agreeing on how to form the NCCL communicator"))?;
        let mut comm = match (agreed, previous, proposal) {
            (true, Some(p), Some((_, exclude))) => {
                drop(tcp);
                let mut parent = p
                    .comm
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                parent.shrink(&exclude, timeout_ms).with_context(|| {
                    format!(
                        "rank {me}: shrinking the NCCL communicator of epoch {} (excluding its ranks {exclude:?})",
                        p.epoch
                    )
                })?
            }
            (_, previous, _) => {
                // Abort the last epoch's communicator before forming the next one.
                drop(previous);
                connect_over(&mut tcp, choice.ordinal, timeout_ms, abort.flag()).with_context(
                    || {
                        format!(
                            "rank {me}: forming the NCCL communicator on device {}",
                            choice.ordinal
                        )
                    },
                )?
            }
        };
        comm.set_abort_flag(abort.flag());
        let shared = Arc::new(Mutex::new(comm));
        kept.nccl = Some(Kept {
            epoch: cmd.epoch,
            peers: cmd.peers.clone(),
            comm: Arc::clone(&shared),
        });
        Ok(Box::new(Shared(shared)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalGroup;

    #[test]
    fn exclusions_are_the_dropped_members_in_order() {
        assert_eq!(
            shrink_exclusions(&[10, 11, 12, 13], &[10, 12]),
            Some(vec![1, 3])
        );
        assert_eq!(
            shrink_exclusions(&[10, 11, 12], &[10, 11, 12]),
            Some(vec![])
        );
        assert_eq!(shrink_exclusions(&[10, 11, 12], &[12]), Some(vec![0, 1]));
        // A newcomer, a reordering, nobody left: no shrink.
        assert_eq!(shrink_exclusions(&[10, 11], &[10, 11, 14]), None);
        assert_eq!(shrink_exclusions(&[10, 11, 12], &[12, 10]), None);
        assert_eq!(shrink_exclusions(&[10, 11], &[]), None);
        assert_eq!(shrink_exclusions::<u8>(&[], &[]), None);
    }

    /// Runs `f` on every rank of a loopback TCP mesh and returns the results in rank order.
    fn on_mesh<R: Send + 'static>(
        world: usize,
        f: impl Fn(&mut TcpCommunicator) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let f = std::sync::Arc::new(f);
        let mesh = LocalGroup::new(world, 5_000).expect("loopback mesh");
        let handles: Vec<_> = mesh
            .into_iter()
            .map(|mut c| {
                let f = std::sync::Arc::clone(&f);
                std::thread::spawn(move || f(&mut c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    #[test]
    fn the_survivors_shrink_only_when_all_propose_the_same() {
        let same = on_mesh(3, |c| agree_on_shrink(c, Some((4, &[1, 3]))).unwrap());
        assert_eq!(same, [true, true, true]);
        // One member kept another epoch's communicator, or none, or excludes otherwise.
        let epochs = on_mesh(3, |c| {
            let epoch = if c.rank() == 2 { 3 } else { 4 };
            agree_on_shrink(c, Some((epoch, &[1]))).unwrap()
        });
        assert_eq!(epochs, [false, false, false]);
        let none = on_mesh(3, |c| {
            let p = (c.rank() != 0).then_some((4, &[1][..]));
            agree_on_shrink(c, p).unwrap()
        });
        assert_eq!(none, [false, false, false]);
        let lists = on_mesh(2, |c| {
            let x: &[Rank] = if c.rank() == 0 { &[1] } else { &[1, 2] };
            agree_on_shrink(c, Some((4, x))).unwrap()
        });
        assert_eq!(lists, [false, false]);
        let nobody = on_mesh(2, |c| agree_on_shrink(c, None).unwrap());
        assert_eq!(nobody, [false, false]);
    }
}
