//! The control-plane wire protocol: serde messages encoded with postcard, one message per
//! length-delimited frame (4-byte big-endian length, then the postcard bytes).
//!
//! # Versioning
//! Both sides are built from this crate, so the protocol is internal and versioned as a whole
//! by [`PROTOCOL_VERSION`]: any change to a message's layout bumps it. An agent announces its
//! version in [`ToController::Register`], and the controller rejects a mismatch with a
//! [`ToAgent::Rejected`] that names both versions. For that to work across versions two things
//! are frozen forever: `Register` is variant 0 of [`ToController`] and `version` is its first
//! field, so [`register_version`] can read the version of a `Register` frame from *any*
//! protocol version even when the rest of the frame no longer decodes; and `Rejected` is
//! variant 1 of [`ToAgent`] with one `String`, so an old agent can still read why it was
//! turned away.
//!
//! # Robustness
//! Decoding never panics: a garbage, truncated or over-long frame is a [`ProtoError`], and the
//! decoders reject trailing bytes (postcard alone would ignore them). Frames are capped at
//! [`MAX_FRAME_BYTES`] by the codec, so a corrupt length prefix cannot make a peer allocate
//! gigabytes. The codec reserves a frame's announced length as soon as it has read the prefix,
//! so the controller caps the first frame of a connection, before the peer has shown the
//! token, at [`MAX_REGISTER_FRAME_BYTES`] and raises the cap only after a successful
//! registration (see `server`).

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use lazarus_planner::job::reconcile::WorkerReport;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio_util::codec::LengthDelimitedCodec;

/// Version of the control protocol; bumped on any change of a message layout, including the
/// worker commands agents relay (an agent parses and re-encodes them). 4: `Reconfigure`
/// carries the mesh secret. 5: worker lines carry a sequence number; `Reattach`, `Ack`,
/// `Reattached` (controller fail-over). 6: `Reconfigure` carries the FSEP shard placement and
/// shard transfers. 7: the worker command `Relayout` (FSEP layout switch without a pause) and
/// the layout version in step lines. 8: `Register` carries the node's host. 9: `Relayout`
/// carries replica transfers (replicated re-layout without a pause).
pub const PROTOCOL_VERSION: u16 = 9;

/// Largest frame either side accepts (64 MiB). A reconfiguration for 1000 nodes × 32 layers ×
/// 32 experts (the replica matrix, JSON) is a few MiB; the cap leaves an order of magnitude of
/// room.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// Largest first frame the controller reads from a connection that has not registered yet
/// (4 KiB). A `Register` is a version, a token and a node name of at most
/// [`MAX_NODE_NAME_BYTES`]: a few hundred bytes with any sensible token. Anything bigger is not
/// an agent, and the small cap keeps what unauthenticated peers can make the controller
/// allocate to this much per connection.
pub const MAX_REGISTER_FRAME_BYTES: usize = 4 << 10;

/// Longest node name accepted at registration: 253 bytes, the longest DNS name, so any host
/// name fits.
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// Most devices one node may announce. Nothing in this executor needs more than a handful; the
/// bound keeps an absurd count (up to `usize::MAX`) from reaching whatever is later sized or
/// summed by it.
pub const MAX_DEVICES_PER_NODE: usize = 1024;

/// A TCP stream framed into length-delimited messages.
pub type Framed = tokio_util::codec::Framed<TcpStream, LengthDelimitedCodec>;

/// Wraps a connected stream with the protocol's codec (frame cap [`MAX_FRAME_BYTES`]).
pub fn framed(stream: TcpStream) -> Framed {
    framed_with_cap(stream, MAX_FRAME_BYTES)
}

/// Wraps a connected stream with the protocol's codec, frames capped at `max_frame_bytes` in
/// both directions (`Framed::codec_mut().set_max_frame_length` changes it later).
pub fn framed_with_cap(stream: TcpStream, max_frame_bytes: usize) -> Framed {
    let codec = LengthDelimitedCodec::builder()
        .max_frame_length(max_frame_bytes)
        .new_codec();
    tokio_util::codec::Framed::new(stream, codec)
}

/// Agent → controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToController {
    /// First message on a connection. Must stay variant 0 with `version` first (see the
    /// module docs).
    Register {
        version: u16,
        /// Shared cluster secret (see `ControllerConfig::token`).
        token: String,
        /// Node name, unique among the live nodes (e.g. the host name).
        node: String,
        /// Accelerators (or worker processes) on the node; at least 1.
        devices: usize,
        /// The physical host this node runs on, shared by the nodes (one per GPU) an agent
        /// process runs for one host: they are placed per host and fail together (see
        /// `lazarus_planner::job::hosts`). Empty: the node is a host of its own.
        host: String,
    },
    /// Liveness; `step` is the last training step the node's runtime reported.
    Heartbeat { node_id: u32, step: u64 },
    /// Graceful departure; the node is removed at once (no heartbeat timeout).
    Bye { node_id: u32 },
    /// One output line of the node's worker (a step or a `WorkerEvent`, JSON), relayed as is;
    /// `seq` numbers the node's lines from 1 (see the module docs).
    Worker {
        node_id: u32,
        seq: u64,
        line: String,
    },
    /// First message on the connection of an agent that lost its controller and comes back as
    /// node `node_id` (with `Register`'s credentials). Must stay variant 4 with `version` first.
    Reattach {
        version: u16,
        token: String,
        node: String,
        devices: usize,
        node_id: u32,
        /// The newest line sequence number the agent produced.
        last_seq: u64,
        /// What the node's worker holds.
        worker: WorkerReport,
    },
}

/// Controller → agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToAgent {
    /// Registration accepted; the node's id for the rest of the connection.
    Registered { node_id: u32 },
    /// Registration refused, or the node was fenced out (expired, protocol violation). The
    /// controller closes the connection after sending it. Must stay variant 1 (module docs).
    Rejected { reason: String },
    /// The controller is shutting down; the agent should stop.
    Shutdown,
    /// One command line for the node's worker (a `worker::Command`, JSON), relayed as is.
    Worker { line: String },
    /// The controller's saved state includes the node's lines up to `seq`: the agent may
    /// forget them.
    Ack { seq: u64 },
    /// A `Reattach` was accepted: the controller has the node's lines up to `acked_seq`; the
    /// agent sends the later ones again, in order.
    Reattached { node_id: u32, acked_seq: u64 },
}

/// Why a registration was refused; its `Display` is the `reason` sent to the agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("protocol version mismatch: agent speaks v{agent}, controller speaks v{controller}")]
    Version { agent: u16, controller: u16 },
    #[error("wrong cluster token")]
    BadToken,
    #[error("node name {0:?} is already registered and alive")]
    DuplicateName(String),
    #[error("node {0:?} reports 0 devices")]
    NoDevices(String),
    #[error("node {node:?} reports {devices} devices; at most {MAX_DEVICES_PER_NODE} are accepted")]
    TooManyDevices { node: String, devices: usize },
    /// `name` is an escaped preview of the refused name (it may hold anything).
    #[error("node name {name} refused: {why}")]
    BadName { name: String, why: &'static str },
    #[error("node ids exhausted")]
    IdsExhausted,
    #[error("the job is over")]
    Over,
    /// A reattachment under an id this controller does not know by that name (the id is what
    /// a reattaching agent presents).
    #[error("node {name:?} (id {node_id}) is not part of this job (any more)")]
    UnknownNode { node_id: u32, name: String },
    /// The node came back, but what its worker holds does not fit the job (see
    /// `lazarus_planner::job::reconcile`).
    #[error("node {name} cannot rejoin: {reason}")]
    Dropped {
        node_id: u32,
        name: String,
        reason: String,
    },
}

/// Why a message could not be encoded, decoded, sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("cannot encode control message: {0}")]
    Encode(postcard::Error),
    #[error("malformed control frame ({len} bytes): {source}")]
    Decode { len: usize, source: postcard::Error },
    #[error("control frame has {extra} trailing bytes after a complete message")]
    TrailingBytes { extra: usize },
    #[error("control connection I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Encodes one message as a frame payload.
pub fn encode<T: Serialize>(msg: &T) -> Result<Bytes, ProtoError> {
    postcard::to_stdvec(msg)
        .map(Bytes::from)
        .map_err(ProtoError::Encode)
}

/// Decodes one frame payload; the whole frame must be one message.
pub fn decode<T: DeserializeOwned>(frame: &[u8]) -> Result<T, ProtoError> {
    let (msg, rest) = postcard::take_from_bytes(frame).map_err(|source| ProtoError::Decode {
        len: frame.len(),
        source,
    })?;
    if rest.is_empty() {
        Ok(msg)
    } else {
        Err(ProtoError::TrailingBytes { extra: rest.len() })
    }
}

/// The protocol version of a `Register` or `Reattach` frame from any protocol version, or
/// `None` if the frame is neither (see the module docs for why this prefix is frozen).
pub fn register_version(frame: &[u8]) -> Option<u16> {
    // Postcard writes an enum as varint(u32 variant index) followed by the fields.
    match postcard::take_from_bytes::<(u32, u16)>(frame) {
        Ok(((0 | 4, version), _)) => Some(version),
        _ => None,
    }
}

/// Sends one message.
pub async fn send<T: Serialize>(framed: &mut Framed, msg: &T) -> Result<(), ProtoError> {
    framed.send(encode(msg)?).await?;
    Ok(())
}

/// Receives one message; `Ok(None)` when the peer closed the connection cleanly.
pub async fn recv<T: DeserializeOwned>(framed: &mut Framed) -> Result<Option<T>, ProtoError> {
    match framed.next().await {
        None => Ok(None),
        Some(frame) => decode(&frame?).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_prefix_is_readable() {
        let msg = ToController::Register {
            version: 7,
            token: "t".into(),
            node: "n".into(),
            devices: 1,
            host: String::new(),
        };
        let bytes = encode(&msg).unwrap();
        assert_eq!(register_version(&bytes), Some(7));
        let hb = encode(&ToController::Heartbeat {
            node_id: 0,
            step: 3,
        })
        .unwrap();
        assert_eq!(register_version(&hb), None);
        assert_eq!(register_version(&[]), None);
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut bytes = encode(&ToAgent::Shutdown).unwrap().to_vec();
        bytes.push(0);
        assert!(matches!(
            decode::<ToAgent>(&bytes),
            Err(ProtoError::TrailingBytes { extra: 1 })
        ));
    }

    #[test]
    fn frozen_variant_indices() {
        // Rejected must stay variant 1 so any agent version can read why it was refused.
        let bytes = encode(&ToAgent::Rejected { reason: "x".into() }).unwrap();
        assert_eq!(bytes[0], 1);
        // Reattach is variant 4 with the version first: its version reads like Register's.
        let reattach = ToController::Reattach {
            version: 9,
            token: "t".into(),
            node: "n".into(),
            devices: 1,
            node_id: 3,
            last_seq: 7,
            worker: WorkerReport::default(),
        };
        let bytes = encode(&reattach).unwrap();
        assert_eq!(bytes[0], 4);
        assert_eq!(register_version(&bytes), Some(9));
    }
}

/// What an agent asked for in its `Register`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub version: u16,
    pub token: String,
    pub node: String,
    pub devices: usize,
    /// The node's host (`Register`'s `host`; empty in a `Reattach`).
    pub host: String,
}

/// What an agent that comes back asked for in its `Reattach`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reattachment {
    pub registration: Registration,
    pub node_id: u32,
    pub last_seq: u64,
    pub worker: WorkerReport,
}

/// The first frame of a controller connection.
#[derive(Debug)]
pub enum FirstFrame {
    /// A well-formed `Register` (still to be checked against the controller's state).
    Register(Registration),
    /// A well-formed `Reattach` (still to be checked).
    Reattach(Reattachment),
    /// The peer closed the connection without sending anything.
    Closed,
    /// Turn the peer away with this reason (timeout, wrong first message, garbage, or a
    /// protocol version this controller does not speak).
    Reject(String),
}

/// Reads and decodes the first frame, waiting at most `timeout`.
pub async fn read_register(
    framed: &mut Framed,
    timeout: std::time::Duration,
) -> Result<FirstFrame, ProtoError> {
    use futures_util::StreamExt;
    let first = match tokio::time::timeout(timeout, framed.next()).await {
        Err(_) => {
            let ms = timeout.as_millis();
            return Ok(FirstFrame::Reject(format!("no Register within {ms} ms")));
        }
        Ok(None) => return Ok(FirstFrame::Closed),
        Ok(Some(frame)) => frame?,
    };
    Ok(match decode::<ToController>(&first) {
        Ok(ToController::Register {
            version,
            token,
            node,
            devices,
            host,
        }) => FirstFrame::Register(Registration {
            version,
            token,
            node,
            devices,
            host,
        }),
        Ok(ToController::Reattach {
            version,
            token,
            node,
            devices,
            node_id,
            last_seq,
            worker,
        }) => FirstFrame::Reattach(Reattachment {
            registration: Registration {
                version,
                token,
                node,
                devices,
                // A node that comes back keeps the host it registered with (saved state).
                host: String::new(),
            },
            node_id,
            last_seq,
            worker,
        }),
        Ok(_) => FirstFrame::Reject("the first message must be Register or Reattach".into()),
        Err(e) => FirstFrame::Reject(match register_version(&first) {
            Some(agent) if agent != PROTOCOL_VERSION => Reject::Version {
                agent,
                controller: PROTOCOL_VERSION,
            }
            .to_string(),
            _ => e.to_string(),
        }),
    })
}
