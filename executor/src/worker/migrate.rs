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

use anyhow::{Context, Result, anyhow, ensure};

use super::abort::AbortSlot;
use super::held_replicas;
use super::protocol::{Reconfigure, StateSource};
use super::state::State;
use crate::checkpoint;
use crate::comm::{Communicator, TcpCommunicator};
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

/// Applies `cmd`: new mesh, state from its source, transfers, drop of replicas no longer
/// held. On error the store still holds at least what it held before (imports only add), so
/// the worker can report its holdings truthfully. Returns the new runtime and the bytes
/// received.
pub(super) fn reconfigure(
    cmd: &Reconfigure,
    st: &mut State,
    listener: &TcpListener,
    timeout_ms: u64,
    abort: &AbortSlot,
) -> Result<(DistributedExperts, u64)> {
    let me = cmd.rank;
    ensure!(me < cmd.peers.len(), "new rank {me} outside the peer list");
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
            let loaded = checkpoint::load_latest(root, &st.cfg)
                .map_err(|e| anyhow!("loading the checkpoint: {e}"))?;
            ensure!(
                loaded.manifest.step == *step,
                "the newest valid checkpoint under {} is at step {}, the controller chose step {step}",
                root.display(),
                loaded.manifest.step
            );
            st.opt
                .import(&loaded.dense().map_err(|e| anyhow!("{e}"))?)
                .context("restoring the dense state")?;
            for &(l, e) in &mine {
                let s = loaded.expert(l, e).map_err(|e| anyhow!("{e}"))?;
                st.store.import(&s)?;
            }
        }
        StateSource::Peers { .. } => {}
    }
    let listener = listener.try_clone().context("cloning the data listener")?;
    let flag = abort.arm(cmd.epoch);
    let mut comm = TcpCommunicator::connect_abortable(
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
    let dist = DistributedExperts::new(Box::new(comm), &st.store, cmd.replicas.clone())?;
    Ok((dist, bytes_in))
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
