//! Applying a reconfiguration: a new mesh for the epoch, state from its source (fresh, a
//! checkpoint, or peers), expert-state transfers, then dropping what the plan no longer gives
//! this rank.
//!
//! States move in the checkpoint encoding ([`checkpoint::encode_expert`],
//! [`checkpoint::encode_dense`]: versioned, with shapes and the optimizer step, checked on
//! arrival), carried over the communicator's `f32` channel as raw 32-bit words — the bytes are
//! only copied, never computed on, so every bit pattern arrives as sent.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, ensure};

use super::abort::AbortSlot;
use super::held_replicas;
use super::plane::{KeptPlane, data_plane};
use super::protocol::{Reconfigure, StateSource};
use super::state::State;
use crate::checkpoint;
use crate::comm::{Communicator, TcpCommunicator};
use crate::model::{ExpertMode, ShardState, ShardStore, one_per_rank};
use crate::runtime::DistributedExperts;

/// `bytes` as little-endian 32-bit words for the `f32` channel: the length first, then the
/// bytes zero-padded to a multiple of four.
fn to_words(bytes: &[u8]) -> Vec<f32> {
    let mut words = Vec::with_capacity(2 + bytes.len().div_ceil(4));
    let len = bytes.len() as u64;
    words.push(f32::from_bits(len as u32));
    words.push(f32::from_bits((len >> 32) as u32));
    for chunk in bytes.chunks(4) {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        words.push(f32::from_bits(u32::from_le_bytes(w)));
    }
    words
}

/// Inverse of [`to_words`].
fn from_words(words: &[f32]) -> Result<Vec<u8>> {
    ensure!(words.len() >= 2, "a state message of {} words", words.len());
    let len = u64::from(words[0].to_bits()) | (u64::from(words[1].to_bits()) << 32);
    let len = usize::try_from(len).context("state length")?;
    ensure!(
        len.div_ceil(4) == words.len() - 2,
        "a state message of {} words says it holds {len} bytes",
        words.len()
    );
    let mut bytes: Vec<u8> = words[2..]
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    bytes.truncate(len);
    Ok(bytes)
}

/// Applies `cmd`: new mesh and data plane (`plane`), state from its source, transfers over
/// the data plane (NCCL with `--comm nccl`), drop of replicas no longer held. On error the
/// store still holds at least what it held before (imports only add), so the worker can report
/// its holdings truthfully. `kept` is the last epoch's data plane, which this one may shrink,
/// and then this epoch's. Returns the new runtime and the bytes received.
pub(super) fn reconfigure(
    cmd: &Reconfigure,
    st: &mut State,
    listener: &TcpListener,
    timeout_ms: u64,
    abort: &AbortSlot,
    kept: &mut KeptPlane,
) -> Result<(DistributedExperts, u64)> {
    let me = cmd.rank;
    ensure!(me < cmd.peers.len(), "new rank {me} outside the peer list");
    if st.mode == ExpertMode::Fsep {
        return reconfigure_sharded(cmd, st, listener, timeout_ms, abort, kept);
    }
    let mine: BTreeSet<(usize, usize)> = held_replicas(&cmd.replicas, me).into_iter().collect();
    match &cmd.source {
        StateSource::Fresh => {
            for &(l, e) in &mine {
                if !st.store.contains(l, e) {
                    st.store.add(l, e)?;
                }
            }
        }
        StateSource::Checkpoint { root, step } => {
            let loaded = restore_dense(st, root, *step)?;
            for &(l, e) in &mine {
                let s = loaded.expert(l, e).map_err(|e| anyhow!("{e}"))?;
                st.store.import(&s)?;
            }
        }
        StateSource::Peers { .. } => {}
    }
    let mesh = connect(cmd, listener, timeout_ms, abort)?;
    let mut comm = data_plane(mesh, cmd, timeout_ms, abort, kept)?;
    let mut sends = Vec::new();
    let mut recv_from = Vec::new();
    let mut incoming: Vec<Option<(usize, usize)>> = Vec::new();
    if let StateSource::Peers {
        dense_from,
        dense_to,
    } = &cmd.source
    {
        for &dst in dense_to {
            if *dense_from == me {
                sends.push((dst, to_words(&checkpoint::encode_dense(&st.opt.export()?))));
            }
            if dst == me {
                recv_from.push(*dense_from);
                incoming.push(None);
            }
        }
    }
    for &(l, e, src, dst) in &cmd.transfers {
        if src == me {
            sends.push((
                dst,
                to_words(&checkpoint::encode_expert(&st.store.export(l, e)?)),
            ));
        }
        if dst == me {
            recv_from.push(src);
            incoming.push(Some((l, e)));
        }
    }
    let got = comm
        .send_recv(sends, &recv_from)
        .with_context(|| format!("rank {me}: migrating states"))?;
    ensure!(
        got.len() == incoming.len(),
        "migration: wrong message count"
    );
    let mut bytes_in = 0u64;
    for (what, (src, words)) in incoming.into_iter().zip(got) {
        let bytes = from_words(&words).with_context(|| format!("state from rank {src}"))?;
        bytes_in += bytes.len() as u64;
        match what {
            None => {
                let dense = checkpoint::decode_dense(&bytes)
                    .map_err(|e| anyhow!("dense state from rank {src}: {e}"))?;
                st.opt
                    .import(&dense)
                    .context("installing the dense state")?;
            }
            Some((l, e)) => {
                let s = checkpoint::decode_expert(&bytes)
                    .map_err(|err| anyhow!("expert {e} of layer {l} from rank {src}: {err}"))?;
                ensure!(
                    (s.layer, s.expert) == (l, e),
                    "rank {src} sent expert {} of layer {} for expert {e} of layer {l}",
                    s.expert,
                    s.layer
                );
                st.store.import(&s)?;
            }
        }
    }
    comm.barrier()
        .with_context(|| format!("rank {me}: barrier after migration"))?;
    for (l, e) in st.store.replicas() {
        if !mine.contains(&(l, e)) {
            st.store.remove(l, e);
        }
    }
    for &(l, e) in &mine {
        ensure!(
            st.store.contains(l, e),
            "the plan gives rank {me} expert {e} of layer {l}, but no state arrived for it"
        );
    }
    let dist = DistributedExperts::new(comm, &st.store, cmd.replicas.clone())?;
    Ok((dist, bytes_in))
}

/// The epoch's mesh, abortable from the command reader.
fn connect(
    cmd: &Reconfigure,
    listener: &TcpListener,
    timeout_ms: u64,
    abort: &AbortSlot,
) -> Result<TcpCommunicator> {
    let me = cmd.rank;
    let listener = listener.try_clone().context("cloning the data listener")?;
    let flag = abort.arm(cmd.epoch);
    let comm = TcpCommunicator::connect_abortable(
        me,
        &cmd.peers,
        listener,
        cmd.epoch,
        &cmd.secret,
        timeout_ms,
        flag,
    )
    .with_context(|| format!("rank {me}: forming the mesh of epoch {}", cmd.epoch))?;
    abort.set_handle(comm.abort_handle()?);
    Ok(comm)
}

/// Reads the newest valid checkpoint under `root`, checks that it is the one the controller
/// chose (`step`) and restores the dense state from it; the experts are the caller's (whole
/// replicas or shards).
fn restore_dense(st: &mut State, root: &std::path::Path, step: u64) -> Result<checkpoint::Loaded> {
    let loaded = checkpoint::load_latest(root, &st.cfg)
        .map_err(|e| anyhow!("loading the checkpoint: {e}"))?;
    ensure!(
        loaded.manifest.step == step,
        "the newest valid checkpoint under {} is at step {}, the controller chose step {step}",
        root.display(),
        loaded.manifest.step
    );
    st.opt
        .import(&loaded.dense().map_err(|e| anyhow!("{e}"))?)
        .context("restoring the dense state")?;
    Ok(loaded)
}

/// [`reconfigure`] in FSEP mode: this rank's shard copies — those `cmd.shard_holders` gives
/// it, or shard `rank` of one per rank when the command names no placement — come from the
/// seed (a fresh start) or from the whole experts of a checkpoint. From peers (a re-layout,
/// an in-place repair after a lost member, or an in-place join, whose newcomers start with no
/// shard and get the dense state from `dense_from`), the shards stay: the copies
/// `cmd.shard_transfers` names are sent (every `(layer, expert)` slice of the shard, with its
/// moments and step) from a surviving holder, then each rank keeps exactly what the new
/// placement gives it. Without a placement, shards are cut for one membership (shard `w` on
/// rank `w`): a re-layout only renumbers them, and any other reconfiguration from peers is
/// refused (the controller restores a checkpoint instead: `JobConfig::sharded_experts`).
fn reconfigure_sharded(
    cmd: &Reconfigure,
    st: &mut State,
    listener: &TcpListener,
    timeout_ms: u64,
    abort: &AbortSlot,
    kept: &mut KeptPlane,
) -> Result<(DistributedExperts, u64)> {
    let (me, world) = (cmd.rank, cmd.peers.len());
    let placed = !cmd.shard_holders.is_empty();
    let holders = if placed {
        cmd.shard_holders.clone()
    } else {
        one_per_rank(world)
    };
    ensure!(
        holders.iter().flatten().all(|&r| r < world),
        "FSEP: a shard placement {holders:?} outside the {world} ranks"
    );
    match &cmd.source {
        StateSource::Fresh => {
            let sh = ShardStore::fresh_placed(&st.cfg, &st.dev, me, holders.clone())?;
            st.shards = Some(Arc::new(Mutex::new(sh)));
        }
        StateSource::Checkpoint { root, step } => {
            let loaded = restore_dense(st, root, *step)?;
            let mut states = Vec::new();
            for l in 0..st.cfg.n_layers {
                for e in 0..st.cfg.experts {
                    states.push(loaded.expert(l, e).map_err(|e| anyhow!("{e}"))?);
                }
            }
            let sh =
                ShardStore::from_states_placed(&st.cfg, &st.dev, me, holders.clone(), &states)?;
            st.shards = Some(Arc::new(Mutex::new(sh)));
        }
        StateSource::Peers { dense_to, .. } if placed && dense_to.contains(&me) => {
            // A newcomer of an in-place join (`job::sharded`): no shard yet; the copies the
            // placement gives it arrive as shard transfers, the dense state from a peer.
            let sh = ShardStore::joining(&st.cfg, &st.dev, me, holders.clone())?;
            st.shards = Some(Arc::new(Mutex::new(sh)));
        }
        StateSource::Peers { dense_to, .. } => {
            let same_count = st
                .shards
                .as_ref()
                .is_some_and(|sh| sh.lock().is_ok_and(|sh| sh.count() == holders.len()));
            ensure!(
                same_count && (placed || dense_to.is_empty()),
                "FSEP: rank {me} of {world} from peers needs its copies of {} shards (a newcomer without a placement, or another cut, needs a checkpoint restore)",
                holders.len()
            );
        }
    }
    let shards = st
        .shards
        .clone()
        .context("no shards after the reconfiguration")?;
    let mesh = connect(cmd, listener, timeout_ms, abort)?;
    let mut comm = data_plane(mesh, cmd, timeout_ms, abort, kept)?;
    let mut bytes_in = 0u64;
    let from_peers = matches!(cmd.source, StateSource::Peers { .. });
    if let StateSource::Peers {
        dense_from,
        dense_to,
    } = &cmd.source
        && placed
        && !dense_to.is_empty()
    {
        bytes_in += send_dense(comm.as_mut(), st, *dense_from, dense_to)?;
    }
    if from_peers && placed {
        bytes_in += copy_shards(comm.as_mut(), &cmd.shard_transfers, &shards)?;
    } else if from_peers {
        bytes_in = renumber_shards(comm.as_mut(), st, &shards)?;
    }
    comm.barrier()
        .with_context(|| format!("rank {me}: barrier after the shard transfers"))?;
    if from_peers && placed {
        // Every copy arrived everywhere (the barrier): drop what the placement moved away.
        shards
            .lock()
            .map_err(|_| anyhow!("shard store: lock poisoned"))?
            .set_placement(me, holders)?;
    }
    let dist = DistributedExperts::new_sharded(comm, shards, cmd.replicas.clone())?;
    Ok((dist, bytes_in))
}

/// The dense state (and optimizer step) from `dense_from` to the newcomers `dense_to` of an
/// in-place sharded join. Returns the bytes received.
fn send_dense(
    comm: &mut dyn Communicator,
    st: &mut State,
    dense_from: usize,
    dense_to: &[usize],
) -> Result<u64> {
    let me = comm.rank();
    let mut sends = Vec::new();
    if me == dense_from {
        let words = to_words(&checkpoint::encode_dense(&st.opt.export()?));
        for &dst in dense_to.iter().filter(|&&d| d != me) {
            sends.push((dst, words.clone()));
        }
    }
    let recv_from: Vec<usize> = if dense_to.contains(&me) && me != dense_from {
        vec![dense_from]
    } else {
        Vec::new()
    };
    let got = comm
        .send_recv(sends, &recv_from)
        .with_context(|| format!("rank {me}: sending the dense state"))?;
    ensure!(
        got.len() == recv_from.len(),
        "dense state: wrong message count"
    );
    let mut bytes_in = 0u64;
    for (src, words) in got {
        let bytes = from_words(&words).with_context(|| format!("dense state from rank {src}"))?;
        bytes_in += bytes.len() as u64;
        let dense = checkpoint::decode_dense(&bytes)
            .map_err(|e| anyhow!("dense state from rank {src}: {e}"))?;
        st.opt
            .import(&dense)
            .context("installing the dense state")?;
    }
    Ok(bytes_in)
}

/// Sends and receives the shard copies of an in-place repair, `(shard, src, dst)` each, and
/// imports those that arrive. Returns the bytes received.
fn copy_shards(
    comm: &mut dyn Communicator,
    transfers: &[(usize, usize, usize)],
    shards: &crate::runtime::SharedShards,
) -> Result<u64> {
    let me = comm.rank();
    let mut sh = shards
        .lock()
        .map_err(|_| anyhow!("shard store: lock poisoned"))?;
    let per_shard = sh.n_layers() * sh.experts();
    let mut sends = Vec::new();
    let mut recv_from = Vec::new();
    let mut incoming = Vec::new();
    for &(w, src, dst) in transfers {
        ensure!(w < sh.count(), "a transfer of shard {w} of {}", sh.count());
        if src == me {
            let states = sh.export_shard(w)?;
            ensure!(
                states.len() == per_shard,
                "rank {me} holds no copy of shard {w} to send"
            );
            sends.push((dst, states.iter().flat_map(|s| s.to_words()).collect()));
        }
        if dst == me {
            recv_from.push(src);
            incoming.push(w);
        }
    }
    let got = comm
        .send_recv(sends, &recv_from)
        .with_context(|| format!("rank {me}: copying shards"))?;
    ensure!(
        got.len() == incoming.len(),
        "shard copies: wrong message count"
    );
    let mut bytes_in = 0u64;
    for (w, (src, words)) in incoming.into_iter().zip(got) {
        let n = sh.range(w).len();
        let per = 2 + 3 * n;
        ensure!(
            words.len() == per * per_shard,
            "rank {src} sent {} words of shard {w}, expected {}",
            words.len(),
            per * per_shard
        );
        for (i, chunk) in words.chunks(per).enumerate() {
            let (l, e) = (i / sh.experts(), i % sh.experts());
            sh.import(&ShardState::from_words(w, l, e, n, chunk)?)?;
        }
        bytes_in += 4 * words.len() as u64;
    }
    Ok(bytes_in)
}

/// A re-layout over the same members may renumber them: shard index `w` must live on the
/// rank `w` of the new mesh, so each rank sends its shards to the rank numbered as its shards
/// are (nothing moves when no rank changed number). Returns the bytes received.
fn renumber_shards(
    comm: &mut dyn Communicator,
    st: &State,
    shards: &crate::runtime::SharedShards,
) -> Result<u64> {
    let me = comm.rank();
    let mut sh = shards
        .lock()
        .map_err(|_| anyhow!("shard store: lock poisoned"))?;
    let held = sh.rank();
    let all = comm
        .all_gather_u64(&[held as u64])
        .context("exchanging shard numbers")?;
    let from = all.iter().position(|v| v.first() == Some(&(me as u64)));
    let from = from.with_context(|| format!("no rank holds shard {me}"))?;
    if from == me {
        return Ok(0);
    }
    let states = sh.export_all()?;
    let mut words = Vec::new();
    for s in &states {
        words.extend(s.to_words());
    }
    let got = comm
        .send_recv(vec![(held, words)], &[from])
        .context("moving shards to their renumbered ranks")?;
    let words = got.into_iter().next().map(|(_, w)| w).unwrap_or_default();
    let n = crate::model::shard_range(sh.expert_len(), sh.count(), me).len();
    let per = 2 + 3 * n;
    ensure!(
        words.len() == per * states.len(),
        "rank {from} sent {} shard words, expected {}",
        words.len(),
        per * states.len()
    );
    let mut mine = Vec::with_capacity(states.len());
    for (chunk, s) in words.chunks(per).zip(&states) {
        mine.push(ShardState::from_words(me, s.layer, s.expert, n, chunk)?);
    }
    *sh = ShardStore::from_shards(&st.cfg, &st.dev, me, sh.count(), &mine)?;
    Ok(4 * words.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_carry_any_bytes_exactly() {
        for len in [0usize, 1, 3, 4, 5, 1000] {
            // Includes NaN bit patterns: the words are only copied.
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 % 256) as u8 | 0x7f).collect();
            assert_eq!(from_words(&to_words(&bytes)).unwrap(), bytes);
        }
        let mut w = to_words(&[1, 2, 3, 4, 5]);
        w.pop();
        assert!(from_words(&w).is_err());
        assert!(from_words(&[]).is_err());
    }
}
