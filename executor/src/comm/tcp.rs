//! [`TcpCommunicator`]: the CPU data plane, a full mesh of TCP connections.
//!
//! ## Rendezvous
//!
//! [`TcpCommunicator::connect`] is given the listen address of every rank and this rank's own
//! listener, already bound (port 0 is fine; the control plane distributes the addresses). Each
//! rank *accepts* one connection from every lower rank and *connects* to every higher rank; the
//! accepting runs on a helper thread while this thread connects, so no rank waits on another
//! rank's progress and the scheme cannot deadlock (connecting only needs the peer's listener to
//! be bound: the kernel completes the TCP handshake from the backlog; until it is bound the
//! connector retries). Over each new connection the connector sends a hello (magic and protocol
//! version, membership epoch, world size, its rank, and the mesh's [`MeshSecret`]); the
//! acceptor answers with its own identity and a verdict. A hello without the secret, from
//! another epoch or world size, from a rank that is not a lower rank still expected, or that is
//! not this protocol at all is rejected and that connection closed, while the acceptor keeps
//! waiting for the right one: neither a stranger who can reach the port nor a stale worker of
//! an old membership that still dials our address can join (or break) the new mesh. The
//! secret is checked first, so a connection without it learns nothing about the mesh. The
//! acceptor reads the hellos of all its pending connections side by side (non-blocking), so a
//! connection that sends nothing holds up no one; it is dropped after `HELLO_WAIT`, and at
//! most `MAX_STRAY_HELLOS` connections beyond the expected peers wait at once (the oldest
//! gives way). The connector checks that the acceptor is the rank it meant to reach.
//! Everything must finish within `timeout_ms`, else [`CommError::Timeout`] with op
//! `"rendezvous"` names a missing peer.
//!
//! ## Re-forming on a new membership
//!
//! A communicator belongs to one membership and is never patched. When membership changes, the
//! control plane assigns new ranks and a new, larger epoch, every worker binds a listener, the
//! addresses are distributed, and every worker calls `connect` again with the new epoch; the old
//! communicator is dropped (or [`abort`](Communicator::abort)ed first, to release peers still
//! blocked in it). The epoch is in every handshake and every message header ([`epoch`]).
//!
//! [`epoch`]: TcpCommunicator::epoch
//!
//! ## Framing and checks
//!
//! Every message is a header (epoch, operation tag, sequence number, payload length) and a
//! little-endian payload. Sequence numbers count messages per ordered pair of ranks, so
//! subgroup operations and point-to-point batches that involve only some pairs keep every
//! pair's count consistent. A wrong epoch, tag or sequence number (ranks calling different
//! operations) is a [`CommError::Protocol`] error instead of silently misread data.
//!
//! ## Timeouts
//!
//! Every socket read and write carries `timeout_ms` (`set_read_timeout` / `set_write_timeout`),
//! so `timeout_ms` bounds how long one peer may stay *silent*: a peer that makes no progress for
//! that long is reported as [`CommError::Timeout`] naming it and the operation. Since a rank
//! that enters a collective early waits for the slowest, `timeout_ms` must exceed the expected
//! skew between ranks (compute imbalance) as well as transfer stalls; use
//! [`TcpCommunicator::set_timeout_ms`] to change it after rendezvous. A closed or reset
//! connection is [`CommError::PeerClosed`].
//!
//! ## Deadlock freedom and failure attribution
//!
//! Within one operation every peer pair is served by its own threads (scoped threads: one
//! writer and one reader per peer involved; the first job runs on the calling thread), all
//! concurrently. A rank therefore always drains what its peers send while it sends its own
//! data, so large payloads cannot deadlock on full socket buffers, and no pair waits for
//! another pair. This also gives precise blame: when a peer dies, the survivors still complete
//! their exchanges with each other, and each reports the dead peer rather than a survivor that
//! gave up first. An operation returns only after all its pairs finished or failed (each bounded
//! by the timeout); the error reported is that of the lowest peer (reads before writes).
//!
//! Thread creation per operation costs a few microseconds per peer; for CPU workers with a
//! handful of peers this is negligible next to the payloads, and it keeps the communicator free
//! of background threads and shared state.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::wire::{self, Ack, Ctx, Elem, Hello, status, tag};
use super::{CommError, Communicator, MeshSecret, Rank, check_group, split_send_recv};

/// How long a connection may take to send its hello before the acceptor drops it (a peer
/// sends it right after connecting).
const HELLO_WAIT: Duration = Duration::from_secs(1);
/// Connections whose hello is still arriving that the acceptor keeps besides one per expected
/// peer; strays beyond that (scanners, stale members, a flood) push out the oldest, so they
/// cannot exhaust the process's file descriptors.
const MAX_STRAY_HELLOS: usize = 64;
/// Pause between polls of the non-blocking listener and between connection retries.
const POLL: Duration = Duration::from_millis(2);
const RETRY: Duration = Duration::from_millis(10);

/// A [`Communicator`] over a full mesh of TCP connections (see the [module docs](self)).
#[derive(Debug)]
pub struct TcpCommunicator {
    rank: Rank,
    world: usize,
    epoch: u64,
    timeout_ms: u64,
    /// `links[p]`: the connection to rank p; `None` for this rank.
    links: Vec<Option<TcpStream>>,
    /// Messages sent to / received from each rank so far: the next sequence numbers.
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    aborted: Arc<AtomicBool>,
    /// [`Communicator::payload_bytes_sent`].
    payload_bytes_sent: u64,
}

/// Aborts a [`TcpCommunicator`] from another thread, e.g. the worker's control-plane task when
/// the controller announces a failure while the compute thread is blocked in a collective.
///
/// [`abort`](AbortHandle::abort) has the effect of [`Communicator::abort`]: the operation in
/// flight fails promptly with [`CommError::Aborted`], later ones fail fast, and peers see the
/// connections close.
#[derive(Debug, Clone)]
pub struct AbortHandle {
    aborted: Arc<AtomicBool>,
    streams: Arc<Vec<TcpStream>>,
}

impl AbortHandle {
    /// Aborts the communicator this handle was taken from.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in self.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Whether that communicator has been aborted (by any means).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// One peer's part in an operation: messages to send to it (in order), messages to receive.
struct PeerIo<'a, T> {
    peer: Rank,
    out: Vec<&'a [T]>,
    n_in: usize,
}

/// The work of one thread of an operation.
enum Job<'a, T> {
    Send {
        peer: Rank,
        stream: &'a TcpStream,
        seq0: u64,
        msgs: &'a [&'a [T]],
    },
    Recv {
        peer: Rank,
        stream: &'a TcpStream,
        seq0: u64,
        n: usize,
    },
}

impl<T: Elem> Job<'_, T> {
    fn run(self, ctx: &Ctx, tag_out: u8, tag_in: u8) -> Result<Vec<Vec<T>>, CommError> {
        match self {
            Job::Send {
                peer,
                mut stream,
                seq0,
                msgs,
            } => {
                for (k, m) in msgs.iter().enumerate() {
                    wire::write_msg(&mut stream, ctx, peer, tag_out, seq0 + k as u64, m)?;
                }
                Ok(Vec::new())
            }
            Job::Recv {
                peer,
                mut stream,
                seq0,
                n,
            } => (0..n)
                .map(|k| wire::read_msg(&mut stream, ctx, peer, tag_in, seq0 + k as u64))
                .collect(),
        }
    }
}

/// Runs the jobs concurrently (the first on this thread) and returns their results in order.
fn run_jobs<T: Elem>(
    ctx: &Ctx,
    tag_out: u8,
    tag_in: u8,
    jobs: Vec<Job<'_, T>>,
) -> Vec<Result<Vec<Vec<T>>, CommError>> {
    thread::scope(|s| {
        let mut jobs = jobs.into_iter();
        let Some(first) = jobs.next() else {
            return Vec::new();
        };
        let spawned: Vec<_> = jobs
            .map(|job| {
                thread::Builder::new().spawn_scoped(s, move || job.run(ctx, tag_out, tag_in))
            })
            .collect();
        let mut results = vec![first.run(ctx, tag_out, tag_in)];
        for h in spawned {
            results.push(match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(CommError::Protocol("communicator thread panicked".into()))
                }),
                Err(e) => Err(CommError::Io(e)),
            });
        }
        results
    })
}

fn duration_ms(ms: u64) -> Duration {
    Duration::from_millis(ms.max(1))
}

/// Puts an established connection into its operating mode.
fn configure(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A connection whose hello is still arriving.
struct PendingHello {
    stream: TcpStream,
    hello: [u8; Hello::LEN],
    filled: usize,
    since: Instant,
}

/// Accepts one connection from each rank in `0..rank` (see the module docs).
#[allow(clippy::too_many_arguments)]
fn accept_lower(
    listener: &TcpListener,
    rank: Rank,
    world: usize,
    epoch: u64,
    secret: &MeshSecret,
    timeout_ms: u64,
    deadline: Instant,
    stop: &AtomicBool,
    abort: &AtomicBool,
) -> Result<Vec<(Rank, TcpStream)>, CommError> {
    use std::io::Read;
    let mut got: Vec<Option<TcpStream>> = (0..rank).map(|_| None).collect();
    let mut missing = rank;
    let mut pending: VecDeque<PendingHello> = VecDeque::new();
    while missing > 0 {
        if stop.load(Ordering::SeqCst) || abort.load(Ordering::SeqCst) {
            return Err(CommError::Aborted);
        }
        if remaining(deadline).is_zero() {
            let first_missing = got.iter().position(Option::is_none).unwrap_or(0);
            return Err(CommError::Timeout {
                peer: first_missing,
                op: "rendezvous",
                ms: timeout_ms,
            });
        }
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    busy = true;
                    // Non-blocking, so that one silent connection holds up no other.
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if pending.len() >= missing + MAX_STRAY_HELLOS {
                        pending.pop_front();
                    }
                    pending.push_back(PendingHello {
                        stream,
                        hello: [0; Hello::LEN],
                        filled: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                // A connection reset before we accepted it, or a signal: keep going.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted | ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(CommError::Io(e)),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let read = (&p.stream).read(&mut p.hello[p.filled..]);
            let keep = match read {
                // Closed before finishing its hello.
                Ok(0) => false,
                Ok(n) => {
                    busy = true;
                    p.filled += n;
                    true
                }
                Err(e) => matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
            };
            let complete = p.filled == Hello::LEN;
            let expired = p.since.elapsed() >= HELLO_WAIT;
            if keep && !complete && !expired {
                i += 1;
                continue;
            }
            let Some(p) = pending.remove(i) else { break };
            if keep && complete {
                let r = answer_hello(&p, rank, world, epoch, secret, deadline, &got);
                if let Some(r) = r {
                    got[r] = Some(p.stream);
                    missing -= 1;
                }
            }
        }
        if !busy {
            thread::sleep(POLL);
        }
    }
    Ok(got
        .into_iter()
        .enumerate()
        .filter_map(|(r, s)| s.map(|s| (r, s)))
        .collect())
}

/// Answers a complete hello. Returns the connector's rank if it is accepted; on a rejection
/// the caller drops the connection.
fn answer_hello(
    p: &PendingHello,
    rank: Rank,
    world: usize,
    epoch: u64,
    secret: &MeshSecret,
    deadline: Instant,
    got: &[Option<TcpStream>],
) -> Option<Rank> {
    use std::io::Write;
    // Not this protocol (or another version of it): no answer at all.
    let hello = Hello::decode(&p.hello)?;
    let r = usize::try_from(hello.rank).ok();
    let verdict = if !secret.matches(&hello.secret) {
        status::BAD_SECRET
    } else if hello.epoch != epoch {
        status::EPOCH_MISMATCH
    } else if hello.world != world as u64 {
        status::WORLD_MISMATCH
    } else if r.is_none_or(|r| r >= rank || got[r].is_some()) {
        status::BAD_RANK
    } else {
        status::OK
    };
    let ack = if verdict == status::BAD_SECRET {
        Ack {
            epoch: 0,
            world: 0,
            rank: 0,
            status: verdict,
        }
    } else {
        Ack {
            epoch,
            world: world as u64,
            rank: rank as u64,
            status: verdict,
        }
    };
    let wait = remaining(deadline)
        .min(HELLO_WAIT)
        .max(Duration::from_millis(1));
    p.stream.set_nonblocking(false).ok()?;
    p.stream.set_write_timeout(Some(wait)).ok()?;
    (&mut &p.stream).write_all(&ack.encode()).ok()?;
    if verdict == status::OK { r } else { None }
}

/// Connects to rank `peer` at `addr` and performs the handshake, retrying refused connections
/// (the peer may not have bound its listener yet) until the deadline.
#[allow(clippy::too_many_arguments)]
fn connect_to(
    addr: SocketAddr,
    peer: Rank,
    rank: Rank,
    world: usize,
    epoch: u64,
    secret: &MeshSecret,
    timeout_ms: u64,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<TcpStream, CommError> {
    use std::io::{Read, Write};
    let op = "rendezvous";
    let timed_out = || CommError::Timeout {
        peer,
        op,
        ms: timeout_ms,
    };
    let stream = loop {
        if abort.load(Ordering::SeqCst) {
            return Err(CommError::Aborted);
        }
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(timed_out());
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::TimedOut
                        | ErrorKind::WouldBlock
                        | ErrorKind::Interrupted
                ) =>
            {
                thread::sleep(RETRY.min(remaining(deadline)));
            }
            Err(e) => return Err(CommError::Io(e)),
        }
    };
    let left = remaining(deadline).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))?;
    let hello = Hello {
        epoch,
        world: world as u64,
        rank: rank as u64,
        secret: *secret.as_bytes(),
    };
    let io = |e| wire::map_io(e, peer, op, timeout_ms);
    (&mut &stream).write_all(&hello.encode()).map_err(io)?;
    let mut b = [0u8; Ack::LEN];
    (&mut &stream).read_exact(&mut b).map_err(io)?;
    let ack = Ack::decode(&b).ok_or_else(|| {
        CommError::Protocol(format!(
            "rendezvous: {addr} (rank {peer}) did not answer with a communicator handshake"
        ))
    })?;
    let reject = |why: String| {
        Err(CommError::Protocol(format!(
            "rendezvous: rank {peer} at {addr} rejected rank {rank}: {why}"
        )))
    };
    match ack.status {
        status::OK => {}
        status::EPOCH_MISMATCH => {
            return reject(format!(
                "epoch mismatch (ours {epoch}, theirs {})",
                ack.epoch
            ));
        }
        status::WORLD_MISMATCH => {
            return reject(format!(
                "world size mismatch (ours {world}, theirs {})",
                ack.world
            ));
        }
        status::BAD_RANK => return reject("rank not expected (duplicate or not lower)".into()),
        status::BAD_SECRET => {
            return reject("wrong mesh secret (not a member of this mesh)".into());
        }
        s => return reject(format!("unknown status {s}")),
    }
    if ack.rank != peer as u64 || ack.epoch != epoch || ack.world != world as u64 {
        return Err(CommError::Protocol(format!(
            "rendezvous: {addr} should be rank {peer} of {world} at epoch {epoch}, \
             but is rank {} of {} at epoch {}",
            ack.rank, ack.world, ack.epoch
        )));
    }
    Ok(stream)
}

impl TcpCommunicator {
    /// Forms this rank's part of the mesh for membership `epoch` (see the module docs).
    ///
    /// `peers[r]` is the listen address of rank r (`peers[rank]` is not used: `listener` is this
    /// rank's, already bound); `world = peers.len()`. Every member must pass the same `secret`;
    /// connections that do not present it are turned away. Blocks until connected to every
    /// other rank, or fails within about `timeout_ms`; `timeout_ms` (at least 1) is also the
    /// per-read and per-write timeout afterwards. The listener is dropped once the mesh is
    /// formed.
    pub fn connect(
        rank: Rank,
        peers: &[SocketAddr],
        listener: TcpListener,
        epoch: u64,
        secret: &MeshSecret,
        timeout_ms: u64,
    ) -> Result<Self, CommError> {
        Self::connect_abortable(
            rank,
            peers,
            listener,
            epoch,
            secret,
            timeout_ms,
            Arc::new(AtomicBool::new(false)),
        )
    }

    /// [`connect`](Self::connect) that gives up with [`CommError::Aborted`] as soon as `abort`
    /// is set (by another thread: the controller announced that a member of this epoch is
    /// gone, so waiting for it until the rendezvous timeout is pointless). The communicator
    /// keeps `abort` as its abort flag.
    pub fn connect_abortable(
        rank: Rank,
        peers: &[SocketAddr],
        listener: TcpListener,
        epoch: u64,
        secret: &MeshSecret,
        timeout_ms: u64,
        abort: Arc<AtomicBool>,
    ) -> Result<Self, CommError> {
        let world = peers.len();
        if rank >= world {
            return Err(CommError::BadShape(format!(
                "rank {rank} is not below world size {world}"
            )));
        }
        let timeout_ms = timeout_ms.max(1);
        let timeout = duration_ms(timeout_ms);
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world > 1 {
            listener.set_nonblocking(true)?;
            let stop = AtomicBool::new(false);
            let (accepted, connected) = thread::scope(|s| {
                let acceptor = (rank > 0).then(|| {
                    thread::Builder::new().spawn_scoped(s, || {
                        accept_lower(
                            &listener, rank, world, epoch, secret, timeout_ms, deadline, &stop,
                            &abort,
                        )
                    })
                });
                let connected: Result<Vec<_>, CommError> = (rank + 1..world)
                    .map(|p| {
                        connect_to(
                            peers[p], p, rank, world, epoch, secret, timeout_ms, deadline, &abort,
                        )
                        .map(|s| (p, s))
                    })
                    .collect();
                if connected.is_err() {
                    stop.store(true, Ordering::SeqCst);
                }
                let accepted = match acceptor {
                    None => Ok(Vec::new()),
                    Some(Ok(h)) => h.join().unwrap_or_else(|_| {
                        Err(CommError::Protocol("rendezvous thread panicked".into()))
                    }),
                    Some(Err(e)) => Err(CommError::Io(e)),
                };
                (accepted, connected)
            });
            for (p, s) in connected?.into_iter().chain(accepted?) {
                configure(&s, timeout)?;
                links[p] = Some(s);
            }
        }
        Ok(Self {
            rank,
            world,
            epoch,
            timeout_ms,
            links,
            send_seq: vec![0; world],
            payload_bytes_sent: 0,
            recv_seq: vec![0; world],
            aborted: abort,
        })
    }

    /// The membership epoch this communicator was formed for; every message carries it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The current per-read/per-write timeout in milliseconds.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// Changes the per-read/per-write timeout (at least 1 ms) on every connection.
    pub fn set_timeout_ms(&mut self, timeout_ms: u64) -> Result<(), CommError> {
        let timeout_ms = timeout_ms.max(1);
        let d = duration_ms(timeout_ms);
        for s in self.links.iter().flatten() {
            s.set_read_timeout(Some(d))?;
            s.set_write_timeout(Some(d))?;
        }
        self.timeout_ms = timeout_ms;
        Ok(())
    }

    /// Whether this communicator has been aborted (explicitly, by an [`AbortHandle`], or by an
    /// error).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// A handle that can abort this communicator from another thread.
    pub fn abort_handle(&self) -> Result<AbortHandle, CommError> {
        let streams = self
            .links
            .iter()
            .flatten()
            .map(TcpStream::try_clone)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AbortHandle {
            aborted: Arc::clone(&self.aborted),
            streams: Arc::new(streams),
        })
    }

    fn check_live(&self) -> Result<(), CommError> {
        if self.is_aborted() {
            Err(CommError::Aborted)
        } else {
            Ok(())
        }
    }

    /// Sends and receives, with every peer in `io` concurrently; returns the received messages
    /// per entry of `io`. Aborts the communicator on failure.
    fn transfer<T: Elem>(
        &mut self,
        op: &'static str,
        tag_out: u8,
        tag_in: u8,
        io: &[PeerIo<'_, T>],
    ) -> Result<Vec<Vec<Vec<T>>>, CommError> {
        self.check_live()?;
        if let Some(e) = io
            .iter()
            .find(|e| self.links.get(e.peer).is_none_or(Option::is_none))
        {
            return Err(CommError::BadShape(format!(
                "{op}: no connection to rank {}",
                e.peer
            )));
        }
        let mut seqs = Vec::with_capacity(io.len());
        for e in io {
            seqs.push((self.send_seq[e.peer], self.recv_seq[e.peer]));
            self.send_seq[e.peer] += e.out.len() as u64;
            self.recv_seq[e.peer] += e.n_in as u64;
        }
        let ctx = Ctx {
            epoch: self.epoch,
            op,
            timeout_ms: self.timeout_ms,
        };
        // Which entry of `io` each job serves; reads before writes so that a dead peer is
        // reported by the read that noticed it.
        let mut owners = Vec::new();
        let mut jobs = Vec::new();
        for (i, (e, &(send0, recv0))) in io.iter().zip(&seqs).enumerate() {
            let Some(stream) = self.links[e.peer].as_ref() else {
                continue;
            };
            if e.n_in > 0 {
                owners.push(i);
                jobs.push(Job::Recv {
                    peer: e.peer,
                    stream,
                    seq0: recv0,
                    n: e.n_in,
                });
            }
            if !e.out.is_empty() {
                owners.push(usize::MAX);
                jobs.push(Job::Send {
                    peer: e.peer,
                    stream,
                    seq0: send0,
                    msgs: &e.out,
                });
            }
        }
        let results = run_jobs(&ctx, tag_out, tag_in, jobs);
        let mut received: Vec<Vec<Vec<T>>> = io.iter().map(|_| Vec::new()).collect();
        let mut first_err = None;
        for (owner, r) in owners.into_iter().zip(results) {
            match r {
                Ok(msgs) => {
                    if let Some(slot) = received.get_mut(owner) {
                        *slot = msgs;
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            None => {
                self.payload_bytes_sent += io
                    .iter()
                    .flat_map(|e| &e.out)
                    .map(|m| (m.len() * T::SIZE) as u64)
                    .sum::<u64>();
                Ok(received)
            }
            Some(e) => Err(self.fail(e)),
        }
    }

    /// Aborts after an error during I/O; an abort that caused the error wins.
    fn fail(&mut self, e: CommError) -> CommError {
        let e = if self.is_aborted() {
            CommError::Aborted
        } else {
            e
        };
        self.abort();
        e
    }

    /// Every other rank, each sent `out` once and expected to send one message back.
    fn everyone<'a, T>(&self, out: &'a [T]) -> Vec<PeerIo<'a, T>> {
        (0..self.world)
            .filter(|&p| p != self.rank)
            .map(|peer| PeerIo {
                peer,
                out: vec![out],
                n_in: 1,
            })
            .collect()
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_to_all_v(&mut self, mut send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
        self.check_live()?;
        if send.len() != self.world {
            return Err(CommError::BadShape(format!(
                "all_to_all_v: {} send buffers for world size {}",
                send.len(),
                self.world
            )));
        }
        let mine = std::mem::take(&mut send[self.rank]);
        let io: Vec<_> = (0..self.world)
            .filter(|&p| p != self.rank)
            .map(|peer| PeerIo {
                peer,
                out: vec![&send[peer][..]],
                n_in: 1,
            })
            .collect();
        let got = self.transfer("all_to_all_v", tag::ALL_TO_ALL_V, tag::ALL_TO_ALL_V, &io)?;
        let mut recv: Vec<Vec<f32>> = (0..self.world).map(|_| Vec::new()).collect();
        for (e, msgs) in io.iter().zip(got) {
            recv[e.peer] = msgs.into_iter().next().unwrap_or_default();
        }
        recv[self.rank] = mine;
        Ok(recv)
    }

    fn all_gather_u64(&mut self, mine: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        self.check_live()?;
        let io = self.everyone(mine);
        let got = self.transfer(
            "all_gather_u64",
            tag::ALL_GATHER_U64,
            tag::ALL_GATHER_U64,
            &io,
        )?;
        let mut all: Vec<Vec<u64>> = (0..self.world).map(|_| Vec::new()).collect();
        for (e, msgs) in io.iter().zip(got) {
            all[e.peer] = msgs.into_iter().next().unwrap_or_default();
        }
        all[self.rank] = mine.to_vec();
        Ok(all)
    }

    /// Gathers to the lowest rank of `group` (the root), which sums in ascending rank order and
    /// broadcasts the result; members send their buffer and receive the result concurrently.
    fn all_reduce_sum(&mut self, group: &[Rank], buf: &mut [f32]) -> Result<(), CommError> {
        const OP: &str = "all_reduce_sum";
        self.check_live()?;
        check_group(OP, group, self.world, self.rank)?;
        let root = group[0];
        if group.len() == 1 {
            return Ok(());
        }
        let len = buf.len();
        let mismatch = |peer: Rank, got: usize| {
            CommError::BadShape(format!(
                "{OP}: rank {peer} reduces {got} values, this rank {len}"
            ))
        };
        if self.rank == root {
            let gather: Vec<PeerIo<'_, f32>> = group[1..]
                .iter()
                .map(|&peer| PeerIo {
                    peer,
                    out: Vec::new(),
                    n_in: 1,
                })
                .collect();
            let got = self.transfer(OP, tag::BROADCAST, tag::REDUCE, &gather)?;
            let parts: Vec<Vec<f32>> = got
                .into_iter()
                .map(|msgs| msgs.into_iter().next().unwrap_or_default())
                .collect();
            if let Some((e, p)) = gather.iter().zip(&parts).find(|(_, p)| p.len() != len) {
                let err = mismatch(e.peer, p.len());
                return Err(self.fail(err));
            }
            // `group` is ascending, so this is the left fold in rank order.
            for p in &parts {
                for (a, b) in buf.iter_mut().zip(p) {
                    *a += *b;
                }
            }
            let result: &[f32] = buf;
            let bcast: Vec<PeerIo<'_, f32>> = group[1..]
                .iter()
                .map(|&peer| PeerIo {
                    peer,
                    out: vec![result],
                    n_in: 0,
                })
                .collect();
            self.transfer(OP, tag::BROADCAST, tag::REDUCE, &bcast)?;
        } else {
            let io = [PeerIo {
                peer: root,
                out: vec![&buf[..]],
                n_in: 1,
            }];
            let got = self.transfer(OP, tag::REDUCE, tag::BROADCAST, &io)?;
            let result = got
                .into_iter()
                .next()
                .and_then(|msgs| msgs.into_iter().next())
                .unwrap_or_default();
            if result.len() != len {
                let err = mismatch(root, result.len());
                return Err(self.fail(err));
            }
            buf.copy_from_slice(&result);
        }
        Ok(())
    }

    fn send_recv(
        &mut self,
        sends: Vec<(Rank, Vec<f32>)>,
        recv_from: &[Rank],
    ) -> Result<Vec<(Rank, Vec<f32>)>, CommError> {
        self.check_live()?;
        let (to_self, remote) = split_send_recv(sends, recv_from, self.rank, self.world)?;
        let mut io: Vec<PeerIo<'_, f32>> = (0..self.world)
            .map(|peer| PeerIo {
                peer,
                out: Vec::new(),
                n_in: 0,
            })
            .collect();
        for (dst, data) in &remote {
            io[*dst].out.push(data);
        }
        for &src in recv_from {
            io[src].n_in += 1;
        }
        io.retain(|e| e.peer != self.rank && (e.n_in > 0 || !e.out.is_empty()));
        let got = self.transfer("send_recv", tag::SEND_RECV, tag::SEND_RECV, &io)?;
        let mut queues: Vec<std::vec::IntoIter<Vec<f32>>> =
            (0..self.world).map(|_| Vec::new().into_iter()).collect();
        for (e, msgs) in io.iter().zip(got) {
            queues[e.peer] = msgs.into_iter();
        }
        queues[self.rank] = to_self.into_iter();
        recv_from
            .iter()
            .map(|&src| {
                queues[src].next().map(|d| (src, d)).ok_or_else(|| {
                    CommError::Protocol(format!("send_recv: missing message from rank {src}"))
                })
            })
            .collect()
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.check_live()?;
        let io = self.everyone::<u64>(&[]);
        self.transfer("barrier", tag::BARRIER, tag::BARRIER, &io)?;
        Ok(())
    }

    fn abort(&mut self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn payload_bytes_sent(&self) -> u64 {
        self.payload_bytes_sent
    }

    fn is_aborted(&self) -> bool {
        TcpCommunicator::is_aborted(self)
    }

    fn set_timeout_ms(&mut self, timeout_ms: u64) -> Result<(), CommError> {
        TcpCommunicator::set_timeout_ms(self, timeout_ms)
    }
}

impl Drop for TcpCommunicator {
    /// Shuts the connections down even if an [`AbortHandle`] still holds duplicates of them, so
    /// peers always see this rank leave.
    fn drop(&mut self) {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Builds a complete loopback mesh inside one process (one thread per rank during
/// rendezvous): for tests and single-node runs.
#[derive(Debug, Clone, Copy)]
pub struct LocalGroup;

impl LocalGroup {
    /// `world` communicators on 127.0.0.1, at epoch 0, in rank order.
    #[expect(
        clippy::new_ret_no_self,
        reason = "LocalGroup is only a namespace for building a group of communicators"
    )]
    pub fn new(world: usize, timeout_ms: u64) -> Result<Vec<TcpCommunicator>, CommError> {
        Self::with_epoch(world, 0, timeout_ms)
    }

    /// `world` communicators on 127.0.0.1 for membership `epoch`, in rank order, sharing a
    /// fresh [`MeshSecret`].
    pub fn with_epoch(
        world: usize,
        epoch: u64,
        timeout_ms: u64,
    ) -> Result<Vec<TcpCommunicator>, CommError> {
        if world == 0 {
            return Err(CommError::BadShape("world size 0".into()));
        }
        let listeners = (0..world)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .collect::<Result<Vec<_>, _>>()?;
        let addrs = listeners
            .iter()
            .map(TcpListener::local_addr)
            .collect::<Result<Vec<_>, _>>()?;
        let addrs = &addrs;
        let secret = &MeshSecret::random();
        thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, l)| {
                    thread::Builder::new().spawn_scoped(s, move || {
                        TcpCommunicator::connect(rank, addrs, l, epoch, secret, timeout_ms)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(CommError::Protocol("rendezvous thread panicked".into()))
                    }),
                    Err(e) => Err(CommError::Io(e)),
                })
                .collect()
        })
    }
}
