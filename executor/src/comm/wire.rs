//! Wire format of the TCP communicator: message framing and the rendezvous handshake.
//!
//! A message is a 25-byte header followed by its payload, all little-endian:
//!
//! | bytes  | field                                              |
//! |--------|----------------------------------------------------|
//! | 0..8   | membership epoch (`u64`)                           |
//! | 8      | operation tag (`u8`, see [`tag`])                  |
//! | 9..17  | sequence number (`u64`, per ordered pair of ranks) |
//! | 17..25 | payload length in bytes (`u64`)                    |
//!
//! The payload is the elements (`f32` or `u64`) in little-endian order. The receiver knows which
//! tag and sequence number it expects next from that peer and rejects anything else with
//! [`CommError::Protocol`], which catches ranks that called different operations.
//!
//! Payloads are written and read in chunks of [`CHUNK`] bytes, so a message costs at most one
//! chunk of extra memory, and a corrupt length field cannot make the receiver allocate more than
//! what actually arrives.

use std::io::{self, ErrorKind, Read, Write};

use super::{CommError, MeshSecret, Rank};

/// Size of a message header.
pub(crate) const HEADER_LEN: usize = 25;
/// Bytes converted and written (or read) at a time; a multiple of every element size.
pub(crate) const CHUNK: usize = 256 * 1024;
/// Largest payload accepted (1 TiB): anything larger is a corrupt header.
pub(crate) const MAX_PAYLOAD_BYTES: u64 = 1 << 40;

/// Operation tags carried by every message.
pub(crate) mod tag {
    pub(crate) const ALL_TO_ALL_V: u8 = 1;
    pub(crate) const ALL_GATHER_U64: u8 = 2;
    /// All-reduce, member to root.
    pub(crate) const REDUCE: u8 = 3;
    /// All-reduce, root to member.
    pub(crate) const BROADCAST: u8 = 4;
    pub(crate) const SEND_RECV: u8 = 5;
    pub(crate) const BARRIER: u8 = 6;

    pub(crate) fn name(tag: u8) -> &'static str {
        match tag {
            ALL_TO_ALL_V => "all_to_all_v",
            ALL_GATHER_U64 => "all_gather_u64",
            REDUCE => "all_reduce_sum/reduce",
            BROADCAST => "all_reduce_sum/broadcast",
            SEND_RECV => "send_recv",
            BARRIER => "barrier",
            _ => "unknown",
        }
    }
}

/// An element type that travels as little-endian bytes.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    /// `b.len() == SIZE`.
    fn get(b: &[u8]) -> Self;
}

impl Elem for f32 {
    const SIZE: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> Self {
        let mut a = [0u8; 4];
        a.copy_from_slice(b);
        f32::from_le_bytes(a)
    }
}

impl Elem for u64 {
    const SIZE: usize = 8;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> Self {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    }
}

/// What every message of one operation shares.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx {
    pub epoch: u64,
    pub op: &'static str,
    pub timeout_ms: u64,
}

/// Classifies a socket error on the connection to `peer`.
pub(crate) fn map_io(e: io::Error, peer: Rank, op: &'static str, ms: u64) -> CommError {
    match e.kind() {
        // `set_read_timeout` expiries surface as WouldBlock on Unix and TimedOut on Windows.
        ErrorKind::WouldBlock | ErrorKind::TimedOut => CommError::Timeout { peer, op, ms },
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe
        | ErrorKind::NotConnected
        | ErrorKind::WriteZero => CommError::PeerClosed { peer },
        _ => CommError::Io(e),
    }
}

fn encode_header(epoch: u64, tag: u8, seq: u64, len: u64, out: &mut Vec<u8>) {
    out.extend_from_slice(&epoch.to_le_bytes());
    out.push(tag);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Writes one message (header and payload) to `peer`.
pub(crate) fn write_msg<W: Write, T: Elem>(
    w: &mut W,
    ctx: &Ctx,
    peer: Rank,
    tag: u8,
    seq: u64,
    data: &[T],
) -> Result<(), CommError> {
    let io = |e| map_io(e, peer, ctx.op, ctx.timeout_ms);
    let bytes = data.len() as u64 * T::SIZE as u64;
    let per_chunk = CHUNK / T::SIZE;
    let mut buf = Vec::with_capacity(HEADER_LEN + data.len().min(per_chunk) * T::SIZE);
    encode_header(ctx.epoch, tag, seq, bytes, &mut buf);
    let mut chunks = data.chunks(per_chunk);
    // The first chunk travels with the header: one write for small messages.
    if let Some(first) = chunks.next() {
        first.iter().for_each(|&x| x.put(&mut buf));
    }
    w.write_all(&buf).map_err(io)?;
    for chunk in chunks {
        buf.clear();
        chunk.iter().for_each(|&x| x.put(&mut buf));
        w.write_all(&buf).map_err(io)?;
    }
    w.flush().map_err(io)
}

/// Reads one message from `peer`, which must carry `ctx.epoch`, `tag` and `seq`.
pub(crate) fn read_msg<R: Read, T: Elem>(
    r: &mut R,
    ctx: &Ctx,
    peer: Rank,
    tag: u8,
    seq: u64,
) -> Result<Vec<T>, CommError> {
    let io = |e| map_io(e, peer, ctx.op, ctx.timeout_ms);
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).map_err(io)?;
    let (epoch, got_tag, got_seq, len) = (u64_at(&h, 0), h[8], u64_at(&h, 9), u64_at(&h, 17));
    if epoch != ctx.epoch {
        return Err(CommError::Protocol(format!(
            "{}: message from rank {peer} carries epoch {epoch}, this communicator is epoch {}",
            ctx.op, ctx.epoch
        )));
    }
    if got_tag != tag || got_seq != seq {
        return Err(CommError::Protocol(format!(
            "{}: desync with rank {peer}: expected {} #{seq}, received {} (tag {got_tag}) #{got_seq}",
            ctx.op,
            tag::name(tag),
            tag::name(got_tag),
        )));
    }
    if !len.is_multiple_of(T::SIZE as u64) || len > MAX_PAYLOAD_BYTES {
        return Err(CommError::Protocol(format!(
            "{}: rank {peer} announced a payload of {len} bytes ({}-byte elements)",
            ctx.op,
            T::SIZE
        )));
    }
    let len = usize::try_from(len).map_err(|_| {
        CommError::Protocol(format!(
            "{}: payload of {len} bytes from rank {peer} exceeds the address space",
            ctx.op
        ))
    })?;
    let mut out = Vec::with_capacity((len / T::SIZE).min(CHUNK));
    let mut buf = vec![0u8; len.min(CHUNK)];
    let mut remaining = len;
    while remaining > 0 {
        let k = remaining.min(CHUNK);
        r.read_exact(&mut buf[..k]).map_err(io)?;
        out.extend(buf[..k].chunks_exact(T::SIZE).map(T::get));
        remaining -= k;
    }
    Ok(out)
}

/// Identifies the communicator's handshake (and its version: 02 added the mesh secret).
pub(crate) const MAGIC: [u8; 8] = *b"LZCOMM02";

/// Connector to acceptor: "I am `rank` of a `world`-rank membership `epoch`, and I know its
/// secret". Layout: magic, epoch, world, rank (`u64` little-endian each), the 32-byte secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub epoch: u64,
    pub world: u64,
    pub rank: u64,
    pub secret: [u8; MeshSecret::LEN],
}

impl Hello {
    pub(crate) const LEN: usize = 32 + MeshSecret::LEN;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.secret);
        let mut out = [0u8; Self::LEN];
        out.copy_from_slice(&b);
        out
    }

    /// `None` if the bytes are not a handshake of this protocol version.
    pub(crate) fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        let mut secret = [0u8; MeshSecret::LEN];
        secret.copy_from_slice(&b[32..]);
        (b[..8] == MAGIC).then(|| Self {
            epoch: u64_at(b, 8),
            world: u64_at(b, 16),
            rank: u64_at(b, 24),
            secret,
        })
    }
}

/// Leaves the secret out.
impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("epoch", &self.epoch)
            .field("world", &self.world)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

/// Handshake verdicts, sent back in [`Ack::status`].
pub(crate) mod status {
    pub(crate) const OK: u8 = 0;
    pub(crate) const EPOCH_MISMATCH: u8 = 1;
    pub(crate) const WORLD_MISMATCH: u8 = 2;
    /// The connector's rank is not a lower rank still expected by the acceptor.
    pub(crate) const BAD_RANK: u8 = 3;
    /// The connector does not know the mesh secret; the acceptor's identity fields are then
    /// zero (a stranger learns nothing about the mesh).
    pub(crate) const BAD_SECRET: u8 = 4;
}

/// Acceptor to connector: the acceptor's own identity and its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub epoch: u64,
    pub world: u64,
    pub rank: u64,
    pub status: u8,
}

impl Ack {
    pub(crate) const LEN: usize = 33;

    pub(crate) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.push(self.status);
        let mut out = [0u8; Self::LEN];
        out.copy_from_slice(&b);
        out
    }

    /// `None` if the bytes are not a handshake of this protocol version.
    pub(crate) fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        (b[..8] == MAGIC).then(|| Self {
            epoch: u64_at(b, 8),
            world: u64_at(b, 16),
            rank: u64_at(b, 24),
            status: b[32],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    const CTX: Ctx = Ctx {
        epoch: 7,
        op: "test",
        timeout_ms: 100,
    };

    fn frame<T: Elem>(tag: u8, seq: u64, data: &[T]) -> Vec<u8> {
        let mut out = Vec::new();
        write_msg(&mut out, &CTX, 1, tag, seq, data).unwrap();
        out
    }

    #[test]
    fn round_trips_f32_and_u64_including_empty_and_multi_chunk() {
        let big: Vec<f32> = (0..(CHUNK / 4) * 2 + 3).map(|i| i as f32 * 0.5).collect();
        for data in [vec![], vec![1.5f32, -0.0, f32::NAN, f32::INFINITY], big] {
            let bytes = frame(tag::ALL_TO_ALL_V, 3, &data);
            assert_eq!(bytes.len(), HEADER_LEN + 4 * data.len());
            let got: Vec<f32> =
                read_msg(&mut Cursor::new(bytes), &CTX, 1, tag::ALL_TO_ALL_V, 3).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&data));
        }
        let data = vec![0u64, 1, u64::MAX, 1 << 40];
        let bytes = frame(tag::ALL_GATHER_U64, 0, &data);
        let got: Vec<u64> =
            read_msg(&mut Cursor::new(bytes), &CTX, 1, tag::ALL_GATHER_U64, 0).unwrap();
        assert_eq!(got, data);
    }

    #[test]
    fn header_layout_is_little_endian() {
        let bytes = frame(tag::BARRIER, 0x0102, &[1u64]);
        assert_eq!(&bytes[0..8], &7u64.to_le_bytes());
        assert_eq!(bytes[8], tag::BARRIER);
        assert_eq!(&bytes[9..17], &0x0102u64.to_le_bytes());
        assert_eq!(&bytes[17..25], &8u64.to_le_bytes());
        assert_eq!(&bytes[25..], &1u64.to_le_bytes());
    }

    fn expect_protocol(r: Result<Vec<f32>, CommError>, needle: &str) {
        match r {
            Err(CommError::Protocol(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected a protocol error about {needle}, got {other:?}"),
        }
    }

    #[test]
    fn rejects_wrong_tag_sequence_epoch_and_length() {
        let bytes = frame(tag::ALL_TO_ALL_V, 3, &[1.0f32]);
        let read =
            |tag, seq, ctx: &Ctx| read_msg::<_, f32>(&mut Cursor::new(&bytes), ctx, 1, tag, seq);
        expect_protocol(read(tag::BARRIER, 3, &CTX), "desync");
        expect_protocol(read(tag::ALL_TO_ALL_V, 4, &CTX), "desync");
        let other_epoch = Ctx { epoch: 8, ..CTX };
        expect_protocol(read(tag::ALL_TO_ALL_V, 3, &other_epoch), "epoch");

        // A length that is not a whole number of elements, and an absurd one.
        for len in [5u64, u64::MAX - 3] {
            let mut bad = bytes.clone();
            bad[17..25].copy_from_slice(&len.to_le_bytes());
            expect_protocol(
                read_msg(&mut Cursor::new(bad), &CTX, 1, tag::ALL_TO_ALL_V, 3),
                "payload",
            );
        }
    }

    #[test]
    fn truncated_stream_is_peer_closed_without_huge_allocation() {
        // Announces 1 GiB but carries 8 bytes: the reader must fail on EOF, not allocate 1 GiB.
        let mut bytes = frame(tag::ALL_TO_ALL_V, 0, &[1.0f32, 2.0]);
        bytes[17..25].copy_from_slice(&(1u64 << 30).to_le_bytes());
        let r: Result<Vec<f32>, _> =
            read_msg(&mut Cursor::new(bytes), &CTX, 4, tag::ALL_TO_ALL_V, 0);
        assert!(matches!(r, Err(CommError::PeerClosed { peer: 4 })), "{r:?}");
        let r: Result<Vec<f32>, _> =
            read_msg(&mut Cursor::new(Vec::new()), &CTX, 2, tag::ALL_TO_ALL_V, 0);
        assert!(matches!(r, Err(CommError::PeerClosed { peer: 2 })), "{r:?}");
    }

    #[test]
    fn io_errors_are_classified() {
        let e = |k| map_io(io::Error::from(k), 3, "op", 9);
        assert!(matches!(
            e(ErrorKind::WouldBlock),
            CommError::Timeout {
                peer: 3,
                op: "op",
                ms: 9
            }
        ));
        assert!(matches!(e(ErrorKind::TimedOut), CommError::Timeout { .. }));
        for k in [
            ErrorKind::ConnectionReset,
            ErrorKind::BrokenPipe,
            ErrorKind::UnexpectedEof,
        ] {
            assert!(matches!(e(k), CommError::PeerClosed { peer: 3 }));
        }
        assert!(matches!(e(ErrorKind::PermissionDenied), CommError::Io(_)));
    }

    #[test]
    fn handshake_round_trips_and_rejects_foreign_bytes() {
        let h = Hello {
            epoch: 3,
            world: 5,
            rank: 2,
            secret: [7; MeshSecret::LEN],
        };
        assert_eq!(Hello::decode(&h.encode()), Some(h));
        assert_eq!(&h.encode()[32..], &[7; MeshSecret::LEN]);
        assert!(!format!("{h:?}").contains('7'), "{h:?}");
        let a = Ack {
            epoch: 3,
            world: 5,
            rank: 4,
            status: status::EPOCH_MISMATCH,
        };
        assert_eq!(Ack::decode(&a.encode()), Some(a));
        let mut junk = h.encode();
        junk[0] = b'X';
        assert_eq!(Hello::decode(&junk), None);
    }
}
