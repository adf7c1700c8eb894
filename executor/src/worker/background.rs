//! Replicated re-layout without a pause, the worker's side: the copies of a
//! [`super::Command::Relayout`] with transfers, streamed in the background while the members
//! train, caught up by replay and installed at a boundary every member agrees on. The design
//! and why it is exact are in [`crate::model::shadow`]; the steps are driven by
//! `managed.rs`.
//!
//! # The side connections
//! Each copy travels over a TCP connection of its own, not over the epoch's mesh (whose
//! collectives it would stall). At the start boundary every member says in one all-gather
//! the port it listens on for its incoming copies (0: none); a sender connects to the
//! receiver's data-plane address in the epoch's peer list (so only `127.0.0.1` or the mesh
//! peers' addresses) at that port, presents the epoch's mesh secret and names the copy. A
//! receiver drops a connection from an address outside the peer list or without the secret,
//! and accepts only the copies it expects, each once.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::checkpoint;
use crate::comm::MeshSecret;
use crate::model::{ExpertState, ExpertStore, ShadowReplica, scale_grad};
use crate::runtime::DistributedExperts;

use super::state::State;

/// Opens every copy's header.
const MAGIC: [u8; 4] = *b"LZMG";
/// Header: magic, secret, epoch, version, layer, expert, payload length.
const HEADER: usize = 4 + MeshSecret::LEN + 8 + 8 + 4 + 4 + 8;

/// A replica migration this worker takes part in, from its start boundary until the switch
/// (or until it is dropped: a failure, a pause, a reconfiguration). Dropping it stops its
/// threads.
pub(super) struct Migration {
    pub version: u64,
    /// `[layer][expert][rank]` of the new layout.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// Copies not arrived yet, each with the updates since `from_step`.
    waiting: BTreeMap<(usize, usize), ShadowReplica>,
    /// Copies arrived, caught up and updated every step since (the second buffer).
    installed: ExpertStore,
    arrivals: Receiver<Result<ExpertState>>,
    sent: Receiver<Result<u64>>,
    cancel: Arc<AtomicBool>,
    /// Bytes (headers and payloads) of the copies this rank sends, not reported yet.
    copy_bytes: u64,
}

impl Drop for Migration {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Who this rank is in the epoch's mesh, for [`Migration::start`].
pub(super) struct Mesh<'a> {
    pub rank: usize,
    pub epoch: u64,
    pub peers: &'a [SocketAddr],
    pub secret: &'a MeshSecret,
    /// How long a copy may take to arrive, and a connection to be made.
    pub timeout_ms: u64,
}

impl Migration {
    /// Starts migration `version` at the current step boundary (a collective: every member
    /// calls it at the same boundary): the exchange of the receivers' ports, the snapshot of
    /// every replica this rank sends (handed to a thread each), the receiving thread, the
    /// joining table of `dist` and one shadow per replica this rank receives.
    pub fn start(
        version: u64,
        replicas: Vec<Vec<Vec<u32>>>,
        transfers: &[(usize, usize, usize, usize)],
        st: &State,
        dist: &mut DistributedExperts,
        mesh: &Mesh<'_>,
    ) -> Result<Self> {
        let me = mesh.rank;
        let world = mesh.peers.len();
        ensure!(
            transfers.iter().all(|t| t.2 < world && t.3 < world),
            "a transfer outside the {world} ranks"
        );
        let incoming: BTreeSet<(usize, usize)> = transfers
            .iter()
            .filter(|t| t.3 == me)
            .map(|t| (t.0, t.1))
            .collect();
        ensure!(
            incoming.len() == transfers.iter().filter(|t| t.3 == me).count(),
            "two copies of one replica for rank {me}"
        );
        let listener = if incoming.is_empty() {
            None
        } else {
            let ip = mesh.peers[me].ip();
            let l = TcpListener::bind(SocketAddr::new(ip, 0))
                .with_context(|| format!("binding the copy listener on {ip}"))?;
            Some(l)
        };
        let port = match &listener {
            Some(l) => u64::from(l.local_addr()?.port()),
            None => 0,
        };
        let ports = dist
            .with_comm(|c| c.all_gather_u64(&[port]))?
            .context("exchanging the copy ports")?;
        let mut joining: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
        for &(l, e, _, dst) in transfers {
            joining.entry((l, e)).or_default().push(dst);
        }
        dist.set_joining(
            joining,
            st.cfg.d_model,
            st.cfg.w1_cols(),
            st.cfg.d_ff,
            st.dev.clone(),
        )?;
        let cancel = Arc::new(AtomicBool::new(false));
        let timeout = Duration::from_millis(mesh.timeout_ms.max(1));
        let (sent_tx, sent) = mpsc::channel();
        let mut copy_bytes = 0;
        for &(l, e, src, dst) in transfers {
            if src != me {
                continue;
            }
            let port = ports.get(dst).and_then(|p| p.first()).copied().unwrap_or(0);
            ensure!(port != 0, "rank {dst} listens for no copies");
            let port = u16::try_from(port).context("a copy port out of range")?;
            let to = SocketAddr::new(mesh.peers[dst].ip(), port);
            let payload = checkpoint::encode_expert(&st.store.export(l, e)?);
            let mut header = Vec::with_capacity(HEADER);
            header.extend(MAGIC);
            header.extend(mesh.secret.as_bytes());
            header.extend(mesh.epoch.to_le_bytes());
            header.extend(version.to_le_bytes());
            header.extend((l as u32).to_le_bytes());
            header.extend((e as u32).to_le_bytes());
            header.extend((payload.len() as u64).to_le_bytes());
            copy_bytes += (header.len() + payload.len()) as u64;
            let tx = sent_tx.clone();
            thread::Builder::new()
                .name(format!("copy-{l}-{e}-to-{dst}"))
                .spawn(move || {
                    let r = send_copy(to, &header, &payload, timeout)
                        .with_context(|| format!("sending expert {e} of layer {l} to {to}"));
                    let _ = tx.send(r.map(|()| payload.len() as u64));
                })
                .context("starting a copy sender")?;
        }
        let (arrive_tx, arrivals) = mpsc::channel();
        if let Some(listener) = listener {
            let expect = Expect {
                copies: incoming.clone(),
                epoch: mesh.epoch,
                version,
                secret: mesh.secret.clone(),
                peers: mesh.peers.iter().map(SocketAddr::ip).collect(),
                timeout,
            };
            let stop = cancel.clone();
            thread::Builder::new()
                .name("copy-receiver".into())
                .spawn(move || receive_copies(&listener, &expect, &stop, &arrive_tx))
                .context("starting the copy receiver")?;
        }
        Ok(Self {
            version,
            replicas,
            waiting: incoming
                .into_iter()
                .map(|(l, e)| ((l, e), ShadowReplica::new(l, e)))
                .collect(),
            installed: ExpertStore::empty(&st.cfg, &st.dev),
            arrivals,
            sent,
            cancel,
            copy_bytes,
        })
    }

    /// Installs the copies that arrived (each caught up by replaying its recorded updates);
    /// an error when a copy failed on either side.
    pub fn poll(&mut self) -> Result<()> {
        while let Ok(r) = self.sent.try_recv() {
            r?;
        }
        loop {
            match self.arrivals.try_recv() {
                Ok(r) => {
                    let state = r?;
                    let key = (state.layer, state.expert);
                    let shadow = self
                        .waiting
                        .remove(&key)
                        .with_context(|| format!("an unexpected copy of {key:?}"))?;
                    shadow.install(&mut self.installed, &state)?;
                }
                Err(TryRecvError::Empty) => return Ok(()),
                Err(TryRecvError::Disconnected) if self.waiting.is_empty() => return Ok(()),
                Err(TryRecvError::Disconnected) => bail!("the copy receiver stopped"),
            }
        }
    }

    /// The bytes of the copies this rank sends, once (0 afterwards): the step report counts
    /// them when the copies start, not when they arrive.
    pub fn take_copy_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.copy_bytes)
    }

    /// Every copy this rank receives is installed.
    pub fn ready(&self) -> bool {
        self.waiting.is_empty()
    }

    /// After a step: the update the holders applied to each replica this rank receives
    /// (`joined`: reduced and unscaled, absent when no token reached it; nothing when
    /// `skipped`, a non-finite step), recorded for a copy still on its way or applied to an
    /// installed one.
    pub fn record(
        &mut self,
        joined: &BTreeMap<(usize, usize), (candle_core::Tensor, candle_core::Tensor)>,
        factor: f64,
        skipped: bool,
    ) -> Result<()> {
        let update = |key: &(usize, usize)| -> Result<_> {
            match joined.get(key).filter(|_| !skipped) {
                Some((g1, g2)) => Ok(Some((scale_grad(g1, factor)?, scale_grad(g2, factor)?))),
                None => Ok(None),
            }
        };
        for (key, shadow) in &mut self.waiting {
            shadow.record(update(key)?);
        }
        for (l, e) in self.installed.replicas() {
            if let Some((g1, g2)) = update(&(l, e))? {
                self.installed.step_replica(l, e, &g1, &g2)?;
            }
        }
        Ok(())
    }

    /// The switch: the installed copies join `store`, the replicas the new layout moves away
    /// from rank `me` leave it, and `dist` computes on the new layout from the next step.
    pub fn finish(
        self,
        store: &mut ExpertStore,
        me: usize,
        dist: &mut DistributedExperts,
    ) -> Result<()> {
        ensure!(self.ready(), "switching before every copy arrived");
        for (l, e) in self.installed.replicas() {
            store.import(&self.installed.export(l, e)?)?;
        }
        for (l, e) in store.replicas() {
            let held = self
                .replicas
                .get(l)
                .and_then(|r| r.get(e))
                .and_then(|r| r.get(me))
                .is_some_and(|&n| n > 0);
            if !held {
                store.remove(l, e);
            }
        }
        dist.set_replicas(store, self.replicas.clone())?;
        Ok(())
    }
}

/// What a receiver accepts.
struct Expect {
    copies: BTreeSet<(usize, usize)>,
    epoch: u64,
    version: u64,
    secret: MeshSecret,
    peers: Vec<IpAddr>,
    timeout: Duration,
}

fn send_copy(to: SocketAddr, header: &[u8], payload: &[u8], timeout: Duration) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&to, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    s.write_all(header)?;
    s.write_all(payload)?;
    s.flush()?;
    // Wait for the receiver's one-byte acknowledgement: the copy is in, not just sent.
    s.set_read_timeout(Some(timeout))?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    ensure!(ack == [1], "the receiver refused the copy");
    Ok(())
}

/// Accepts the expected copies (until all arrived, `stop` is set, or none arrives within the
/// timeout), each decoded and sent on `out`.
fn receive_copies(
    listener: &TcpListener,
    expect: &Expect,
    stop: &AtomicBool,
    out: &Sender<Result<ExpertState>>,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        let _ = out.send(Err(anyhow!("copy listener: {e}")));
        return;
    }
    let mut left = expect.copies.clone();
    let mut last = Instant::now();
    while !left.is_empty() && !stop.load(Ordering::Relaxed) {
        let (stream, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if last.elapsed() > expect.timeout {
                    let _ = out.send(Err(anyhow!(
                        "no copy arrived for {} ms ({} missing)",
                        expect.timeout.as_millis(),
                        left.len()
                    )));
                    return;
                }
                thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                let _ = out.send(Err(anyhow!("accepting a copy: {e}")));
                return;
            }
        };
        if !expect.peers.contains(&from.ip()) {
            continue;
        }
        match read_copy(stream, expect, &left) {
            Ok(Some(state)) => {
                left.remove(&(state.layer, state.expert));
                last = Instant::now();
                if out.send(Ok(state)).is_err() {
                    return;
                }
            }
            // Not one of ours (a stranger, a stale epoch): ignored.
            Ok(None) => {}
            Err(e) => {
                let _ = out.send(Err(e));
                return;
            }
        }
    }
}

/// One copy from `stream`: `None` for a connection that is not an expected copy of this
/// migration; an error when an expected copy broke on the way.
fn read_copy(
    mut stream: TcpStream,
    expect: &Expect,
    left: &BTreeSet<(usize, usize)>,
) -> Result<Option<ExpertState>> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(expect.timeout))?;
    stream.set_write_timeout(Some(expect.timeout))?;
    let mut h = [0u8; HEADER];
    if stream.read_exact(&mut h).is_err() {
        return Ok(None);
    }
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let s = 4 + MeshSecret::LEN;
    if h[..4] != MAGIC || !expect.secret.matches(&h[4..s]) {
        return Ok(None);
    }
    let (epoch, version) = (u64_at(s), u64_at(s + 8));
    let key = (u32_at(s + 16) as usize, u32_at(s + 20) as usize);
    let len = u64_at(s + 24);
    if (epoch, version) != (expect.epoch, expect.version) || !left.contains(&key) {
        return Ok(None);
    }
    // An expert state is 6 matrices of d·f f32 plus a small header; refuse absurd lengths
    // before allocating.
    ensure!(len < 1 << 34, "a copy of {len} bytes");
    let mut payload = vec![0u8; usize::try_from(len)?];
    stream
        .read_exact(&mut payload)
        .with_context(|| format!("reading the copy of {key:?}"))?;
    let state =
        checkpoint::decode_expert(&payload).map_err(|e| anyhow!("the copy of {key:?}: {e}"))?;
    ensure!(
        (state.layer, state.expert) == key,
        "the copy named {key:?} holds ({}, {})",
        state.layer,
        state.expert
    );
    stream.write_all(&[1])?;
    Ok(Some(state))
}
