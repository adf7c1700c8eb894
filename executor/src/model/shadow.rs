//! Catching a migrated replica up with training: the building block of replicated re-layout
//! without a pause (issue 13 item 2, "asynchronous, double-buffered"), and the design it is
//! for. Built: `lzrun --migration async` (the default) runs it; the worker's side is
//! `worker/background.rs` and `worker/managed.rs`, the job machine's is
//! `lazarus_planner::job` ([`ReplicaMigration`](lazarus_planner::job::ReplicaMigration)).
//! The blocking path (`--migration blocking`: pause, reconfigure, migrate over the new mesh)
//! stays, and failures and joins always take it.
//!
//! # The problem
//! A copy of a replica taken at step boundary `b` is stale as soon as step `b` updates the
//! existing replicas. For the new holder to join their replica group it must end up
//! bit-identical to them at the step it starts computing the expert, or replicas drift apart
//! (the end-of-job checksum comparison would catch it; the dispatch would silently mix two
//! models before that).
//!
//! # The design
//! 1. **Agree on `b`.** The controller sends the migration (new layout `v`, transfers) while
//!    the members train; as for the FSEP layout switch (`worker/managed.rs`), each member votes
//!    in the step barrier, and the migration starts at the boundary after the first step whose
//!    barrier shows every member holding it.
//! 2. **Snapshot and stream.** At `b` each sender exports the replica (weights, both Adam
//!    moments, step) and hands the bytes to a background thread that streams them to the new
//!    holder over a connection of its own (its address sent over the mesh at `b`), so the
//!    step's collectives never wait for the copy.
//! 3. **Shadow.** From step `b` on, the new holder joins the expert's gradient all-reduce group
//!    contributing zeros (it computes no tokens of the expert yet: the dispatch still reads the
//!    old layout). Adding `+0.0` changes no sum, and the group's result is the same on every
//!    member, so the new holder receives exactly the reduced gradient the holders apply. It
//!    records each step's scaled update (or that the step made none: no token reached the
//!    expert, or a non-finite step every member skipped) in a [`ShadowReplica`].
//! 4. **Install.** When the snapshot has arrived, [`ShadowReplica::install`] imports it and
//!    replays the recorded updates in order through the same AdamW code path
//!    ([`ExpertStore::step_replica`] on the same scaled tensors), which is deterministic: the
//!    result equals the holders' replica bit for bit (the test below). From then on the shadow
//!    applies each step's update directly.
//! 5. **Switch.** Each member votes "all my copies installed"; after the first step whose
//!    barrier shows every member ready, every member installs layout `v` at the next boundary
//!    (the dispatch and the replica groups change together) and the old holders drop the
//!    replicas `v` moves away. A failure before that drops the shadows (nothing of `v` was
//!    used) and goes through the usual recovery.
//!
//! As built: the start vote is the layout slot of the step barrier (as for FSEP), the ready
//! vote a second slot per rank ([`crate::worker::StepVotes`]); the receivers' listening ports
//! are exchanged with one all-gather at `b` and each copy is sent to the receiver's address in
//! the epoch's peer list, authenticated with the epoch's mesh secret; the copy, once in, is
//! kept in a store of its own (the second buffer) and updated each step until the switch. A
//! worker rolled back one step after a switch drops the replicas the switch added (they hold
//! the later state) and reports what it holds.
//!
//! Exactness: the zero contributions are `x + 0.0`, which is `x` for every `x` but `-0.0`
//! (`+0.0`); an exactly zero summed gradient element could thus change sign, which changes no
//! Adam moment or weight unless the moment was itself `-0.0` — never seen, and
//! `executor/tests/asyncmig.rs` checks losses and every worker's final state bit for bit
//! against the blocking migration at the same boundary.
//!
//! The cost on the training path is the zero contribution to a few all-reduce groups per step
//! and the replay (one AdamW step per recorded update, once); the copy itself overlaps with
//! training. Memory: the shadow copy plus the recorded updates (two expert-sized tensors per
//! step until the copy arrives) — the "double buffer".
//!
//! The replay assumes a constant learning rate (the workers' AdamW has no schedule); with one,
//! each recorded update would carry the step's rate.

use candle_core::{Result, Tensor};

use super::experts::{ExpertState, ExpertStore};

/// The updates a new holder of replica `(layer, expert)` received since the snapshot it waits
/// for was taken (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct ShadowReplica {
    layer: usize,
    expert: usize,
    /// One entry per step since the snapshot: the scaled gradients `(dL/dw1, dL/dw2)` the
    /// holders applied, or `None` when they applied none.
    updates: Vec<Option<(Tensor, Tensor)>>,
}

impl ShadowReplica {
    pub fn new(layer: usize, expert: usize) -> Self {
        Self {
            layer,
            expert,
            updates: Vec::new(),
        }
    }

    /// Records one step: the scaled gradients every holder applied to the replica, or `None`.
    pub fn record(&mut self, update: Option<(Tensor, Tensor)>) {
        self.updates.push(update);
    }

    /// Steps recorded since the snapshot.
    pub fn steps(&self) -> usize {
        self.updates.len()
    }

    /// Installs `snapshot` (taken at the boundary the recording started from) into `store`
    /// and replays every recorded update on it: the replica is then what the holders have.
    pub fn install(self, store: &mut ExpertStore, snapshot: &ExpertState) -> Result<()> {
        if (snapshot.layer, snapshot.expert) != (self.layer, self.expert) {
            candle_core::bail!(
                "shadow of expert {} of layer {} got the snapshot of expert {} of layer {}",
                self.expert,
                self.layer,
                snapshot.expert,
                snapshot.layer
            );
        }
        store.import(snapshot)?;
        for (g1, g2) in self.updates.into_iter().flatten() {
            store.step_replica(self.layer, self.expert, &g1, &g2)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{MoeConfig, scale_grad};
    use candle_core::Device;

    /// Deterministic pseudo-random gradients of one expert at `step`.
    fn grads(cfg: &MoeConfig, step: u64) -> (Tensor, Tensor) {
        let (d, f) = (cfg.d_model, cfg.d_ff);
        let vals = |n: usize, salt: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| {
                    let x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (step * 31 + salt);
                    ((x % 2001) as f32 - 1000.0) * 1e-4
                })
                .collect()
        };
        let g1 = Tensor::from_vec(vals(d * f, 1), (d, f), &Device::Cpu).unwrap();
        let g2 = Tensor::from_vec(vals(f * d, 2), (f, d), &Device::Cpu).unwrap();
        (g1, g2)
    }

    /// A replica copied at step 3 and caught up by replaying steps 3..12 (two of them without
    /// an update) equals the replica trained live through step 12, bit for bit: weights, both
    /// moments and the optimizer step.
    #[test]
    fn a_snapshot_caught_up_by_replay_is_bit_identical_to_the_live_replica() {
        let cfg = MoeConfig::tiny();
        let (l, e) = (1, 2);
        let mut live = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(l, e)]).unwrap();
        let factor = 0.25;
        let scaled = |step: u64| {
            let (g1, g2) = grads(&cfg, step);
            (
                scale_grad(&g1, factor).unwrap(),
                scale_grad(&g2, factor).unwrap(),
            )
        };
        for step in 0..3 {
            let (g1, g2) = scaled(step);
            live.step_replica(l, e, &g1, &g2).unwrap();
        }
        let snapshot = live.export(l, e).unwrap();
        let mut shadow = ShadowReplica::new(l, e);
        for step in 3..12 {
            if step == 5 || step == 9 {
                shadow.record(None);
                continue;
            }
            let (g1, g2) = scaled(step);
            live.step_replica(l, e, &g1, &g2).unwrap();
            shadow.record(Some((g1, g2)));
        }
        assert_eq!(shadow.steps(), 9);
        let mut joined = ExpertStore::empty(&cfg, &Device::Cpu);
        shadow.install(&mut joined, &snapshot).unwrap();
        assert_eq!(joined.checksum(l, e), live.checksum(l, e));
        assert_ne!(joined.checksum(l, e), Some(snapshot.checksum()));
    }

    #[test]
    fn a_snapshot_of_another_expert_is_refused() {
        let cfg = MoeConfig::tiny();
        let store = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 1)]).unwrap();
        let snapshot = store.export(0, 1).unwrap();
        let mut joined = ExpertStore::empty(&cfg, &Device::Cpu);
        let err = ShadowReplica::new(0, 2)
            .install(&mut joined, &snapshot)
            .unwrap_err();
        assert!(err.to_string().contains("snapshot of expert 1"), "{err}");
        assert!(joined.is_empty());
    }
}
