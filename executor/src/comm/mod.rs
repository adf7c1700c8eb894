//! # Data plane: the `Communicator` between workers
//!
//! Workers are separate OS processes, one per device. Each holds one [`Communicator`] that
//! connects it to the other workers of the *current membership*: `world` ranks numbered
//! `0..world`. The runtime uses it for MoE token dispatch ([`Communicator::all_to_all_v`]),
//! routing statistics ([`Communicator::all_gather_u64`]), gradient reduction over the replicas of
//! an expert ([`Communicator::all_reduce_sum`] over a subgroup), expert-state migration
//! ([`Communicator::send_recv`]) and step fences ([`Communicator::barrier`]).
//!
//! This module holds the backend-neutral contract; [`TcpCommunicator`] (module [`tcp`]) is the
//! CPU backend, a full mesh of TCP connections. `nccl::NcclCommunicator` (behind the `cuda`
//! feature) implements the same trait for CUDA workers through cudarc.
//!
//! ## Contract shared by every backend
//!
//! * **Collective discipline.** Every member of an operation calls the same operations in the
//!   same order (for subgroup operations: every member of that subgroup). Ranks outside a
//!   subgroup are not involved, so disjoint subgroups may reduce concurrently.
//! * **Errors are final.** A failed operation may leave messages half-sent, so after any error
//!   that happened once I/O had started the communicator aborts itself (see
//!   [`Communicator::abort`]): later operations fail fast with [`CommError::Aborted`] and peers
//!   blocked on this rank see [`CommError::PeerClosed`] at once instead of waiting for their
//!   timeout. Argument errors ([`CommError::BadShape`] found before anything is sent) leave the
//!   communicator usable. Lazarus recovers from a failure by re-forming: the control plane
//!   computes the new membership and every surviving worker builds a *new* communicator with a
//!   new, larger membership epoch; a communicator is never repaired in place.
//! * **Bounded blocking.** No operation blocks forever: the backend's timeout bounds every wait
//!   on a peer, and a dead or silent peer is named in the error ([`CommError::PeerClosed`] or
//!   [`CommError::Timeout`]).
//! * **Determinism.** [`Communicator::all_reduce_sum`] gives every member bit-identical results,
//!   so replicas of an expert never drift apart.

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod tcp;
mod wire;

pub use tcp::{AbortHandle, LocalGroup, TcpCommunicator};

/// The secret of one mesh: every member presents it when it connects to another
/// ([`TcpCommunicator::connect`]), and a connection without it is dropped, so only the workers
/// the controller told about the membership can join it. The controller draws a fresh one for
/// every epoch and sends it with the reconfiguration; a member of an older epoch, or anyone
/// who learnt an older secret, cannot join a newer mesh.
///
/// It travels in clear (like the cluster token): it keeps strangers and stale members out, it
/// does not defend against an eavesdropper on the network. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct MeshSecret([u8; MeshSecret::LEN]);

impl MeshSecret {
    /// Length in bytes (256 bits: not guessable).
    pub const LEN: usize = 32;

    /// A fresh secret from the thread-local CSPRNG (ChaCha seeded by the OS).
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// All zeros, for meshes without a controller to hand out a secret (stand-alone workers,
    /// whose peers are given on the command line): it keeps out nothing but foreign protocols.
    pub const fn unset() -> Self {
        Self([0; Self::LEN])
    }

    pub const fn from_bytes(bytes: [u8; Self::LEN]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// Whether `given` is this secret, in time independent of where they differ (so a
    /// stranger cannot find it byte by byte from response times).
    pub fn matches(&self, given: &[u8]) -> bool {
        constant_time_eq(&self.0, given)
    }
}

impl std::fmt::Debug for MeshSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MeshSecret(..)")
    }
}

/// As 64 lowercase hex digits (it travels in the controller's JSON commands).
impl serde::Serialize for MeshSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use std::fmt::Write;
        let mut hex = String::with_capacity(2 * Self::LEN);
        for b in self.0 {
            let _ = write!(hex, "{b:02x}");
        }
        s.serialize_str(&hex)
    }
}

impl<'de> serde::Deserialize<'de> for MeshSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let hex = String::deserialize(d)?;
        let bad = || D::Error::custom(format!("a mesh secret is {} hex digits", 2 * Self::LEN));
        if hex.len() != 2 * Self::LEN {
            return Err(bad());
        }
        let mut out = [0u8; Self::LEN];
        let nibble = |c: u8| char::from(c).to_digit(16).ok_or_else(bad);
        for (o, pair) in out.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
            *o = u8::try_from(nibble(pair[0])? << 4 | nibble(pair[1])?).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

/// `a == b`, in time that depends only on the lengths (for secrets: a mismatch found early
/// takes as long as one found late).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

/// Index of a worker in the current membership, `0..world`.
pub type Rank = usize;

/// Why a communicator operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Peer `peer` sent or accepted nothing for `ms` milliseconds during `op`: it is dead,
    /// stalled, or not (yet) in the same operation.
    #[error("{op}: timed out after {ms} ms waiting on rank {peer}")]
    Timeout {
        /// The silent peer.
        peer: Rank,
        /// The operation (`"all_to_all_v"`, `"rendezvous"`, ...).
        op: &'static str,
        /// The timeout that expired.
        ms: u64,
    },
    /// The connection to `peer` was closed or reset (the peer exited, dropped or aborted its
    /// communicator).
    #[error("rank {peer} closed the connection")]
    PeerClosed {
        /// The peer whose connection closed.
        peer: Rank,
    },
    /// This communicator was aborted (explicitly, or by an earlier error).
    #[error("communicator aborted")]
    Aborted,
    /// Any other I/O error (binding, socket options, ...).
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A peer sent something unexpected: wrong epoch, wrong operation or sequence number (the
    /// ranks called different operations: a desync), a malformed frame, or a rejected handshake.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The arguments are inconsistent (wrong number of buffers, rank out of range, bad group,
    /// or buffer lengths that differ between the members of an all-reduce).
    #[error("bad shape: {0}")]
    BadShape(String),
}

/// Collective and point-to-point operations among the workers of one membership.
///
/// See the [module documentation](self) for the contract every backend keeps.
pub trait Communicator: Send {
    /// This worker's rank, `0..world()`.
    fn rank(&self) -> Rank;

    /// Number of workers in the membership.
    fn world(&self) -> usize;

    /// Variable-count all-to-all: `send[dst]` goes to rank dst; returns `recv[src]`. No padding.
    ///
    /// `send.len()` must be `world()` (else [`CommError::BadShape`]); any entry may be empty.
    /// `send[rank()]` is returned as `recv[rank()]` without a copy.
    fn all_to_all_v(&mut self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError>;

    /// Same for u64 (token counts / routing statistics): every rank contributes `mine` (lengths
    /// may differ between ranks); returns `all[src]` for every rank, including this one.
    fn all_gather_u64(&mut self, mine: &[u64]) -> Result<Vec<Vec<u64>>, CommError>;

    /// Sum-all-reduce in place over an arbitrary subgroup (sorted distinct ranks containing
    /// self.rank()); deterministic: every member ends with bit-identical results.
    ///
    /// The result is the left fold in ascending rank order,
    /// `((buf[g0] + buf[g1]) + buf[g2]) + ...` element-wise, computed once and then copied to
    /// every member, so it is bit-identical everywhere and reproducible run to run. Every member
    /// must pass a buffer of the same length (else [`CommError::BadShape`]). A group of one is a
    /// no-op.
    fn all_reduce_sum(&mut self, group: &[Rank], buf: &mut [f32]) -> Result<(), CommError>;

    /// Batched point-to-point: send each (dst, data) and receive from each listed src (for
    /// expert-state migration).
    ///
    /// Several messages may go to the same destination; they arrive in the order they were
    /// listed, and the receiver lists that source once per message. The result has one
    /// `(src, data)` per entry of `recv_from`, in that order. Sending to oneself is allowed when
    /// `recv_from` lists oneself as often. Pairs of ranks that exchange nothing are not involved.
    fn send_recv(
        &mut self,
        sends: Vec<(Rank, Vec<f32>)>,
        recv_from: &[Rank],
    ) -> Result<Vec<(Rank, Vec<f32>)>, CommError>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Abort: every later op fails fast with Aborted; peers blocked on us see PeerClosed/Timeout.
    fn abort(&mut self);

    /// Whether this communicator was aborted (by [`Communicator::abort`], from another thread,
    /// or by a failed operation): the step it serves is lost, so compute between two
    /// collectives (a rank's local experts) checks it to give up at once rather than at its
    /// next collective. A backend that cannot tell says `false` (its next operation fails).
    fn is_aborted(&self) -> bool {
        false
    }

    /// Changes how long one wait on a peer may last (at least 1 ms), from the next operation
    /// on: a managed worker follows its step deadline with it
    /// ([`lazarus_planner::deadline`]).
    fn set_timeout_ms(&mut self, timeout_ms: u64) -> Result<(), CommError>;

    /// Bytes of elements (f32, u64) this rank has sent to other ranks by successful operations
    /// since the communicator was made — what a step or a migration put on the network, for the
    /// run's per-step traffic. Messages to oneself (local moves) and the backend's framing are
    /// not counted (NCCL's length rounds are: they are elements too).
    fn payload_bytes_sent(&self) -> u64;
}

/// Checks an all-reduce group: ranks below `world`, sorted and distinct, containing `rank`.
pub(crate) fn check_group(
    op: &str,
    group: &[Rank],
    world: usize,
    rank: Rank,
) -> Result<(), CommError> {
    if let Some(&bad) = group.iter().find(|&&r| r >= world) {
        return Err(CommError::BadShape(format!(
            "{op}: group rank {bad} is not below world size {world}"
        )));
    }
    if !group.windows(2).all(|w| w[0] < w[1]) {
        return Err(CommError::BadShape(format!(
            "{op}: group {group:?} is not sorted and distinct"
        )));
    }
    if !group.contains(&rank) {
        return Err(CommError::BadShape(format!(
            "{op}: group {group:?} does not contain rank {rank}"
        )));
    }
    Ok(())
}

/// Point-to-point messages `(peer, data)`.
pub(crate) type Messages = Vec<(Rank, Vec<f32>)>;

/// Checks the ranks of a [`Communicator::send_recv`] call and splits off the messages a rank
/// sends to itself (returned first, data only, in order) from those to peers. Sending to
/// oneself must match receiving from oneself, message for message.
pub(crate) fn split_send_recv(
    sends: Vec<(Rank, Vec<f32>)>,
    recv_from: &[Rank],
    rank: Rank,
    world: usize,
) -> Result<(Vec<Vec<f32>>, Messages), CommError> {
    let check = |r: Rank, what: &str| {
        if r < world {
            Ok(())
        } else {
            Err(CommError::BadShape(format!(
                "send_recv: {what} rank {r} is not below world size {world}"
            )))
        }
    };
    for &(dst, _) in &sends {
        check(dst, "destination")?;
    }
    for &src in recv_from {
        check(src, "source")?;
    }
    let (to_self, remote): (Vec<_>, Vec<_>) = sends.into_iter().partition(|(dst, _)| *dst == rank);
    let self_expected = recv_from.iter().filter(|&&s| s == rank).count();
    if to_self.len() != self_expected {
        return Err(CommError::BadShape(format!(
            "send_recv: {} messages to self but {self_expected} expected from self",
            to_self.len()
        )));
    }
    Ok((to_self.into_iter().map(|(_, d)| d).collect(), remote))
}
