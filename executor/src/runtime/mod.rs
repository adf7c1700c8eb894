//! # Runtime: the data plane of one distributed training step
//!
//! Every worker holds the full [`DenseModel`](crate::model::DenseModel) and only the expert
//! replicas its plan assigns (`replicas[layer][expert][rank] > 0`). [`DistributedExperts`] is
//! the [`ExpertExec`](crate::model::ExpertExec) that joins them: per MoE layer it all-gathers the
//! per-expert token counts, computes the same [`lazarus_planner::dispatch::plan`] on every
//! worker, ships the routed activations with one `all_to_all_v`, runs the local replicas on what
//! arrived and ships the outputs back with the reverse all-to-all.
//!
//! ## Backward: a custom op that does the reverse exchange
//!
//! The layer's outputs are produced by a `candle_core::CustomOp1` applied to the concatenation
//! of the layer's local expert inputs. Its forward only returns the outputs that came back from
//! the exchange; its `bwd`, run from inside `loss.backward()`, performs the reverse exchange:
//!
//! 1. `dL/dy` rows go (same layout as the forward send buffer) to the workers that computed
//!    them;
//! 2. each worker recomputes its experts on the received inputs with autograd (inputs as fresh
//!    `Var`s), seeds the backward with the received `dL/dy` (`(y · g).sum().backward()`),
//!    **accumulates the expert weight gradients** in [`DistributedExperts`] and
//! 3. returns `dL/dx` with the inverse exchange; the source's custom op returns it to candle.
//!
//! **Collective-order requirement.** These exchanges are collectives, so every worker must run
//! them in the same order: one forward exchange per MoE layer in layer order, then (during
//! `loss.backward()`) one backward exchange per MoE layer in *reverse* layer order. This holds
//! because layer `l+1`'s op depends on layer `l`'s output, so candle's reverse topological
//! order always visits the ops last layer first. Consequently: every worker must call
//! `loss.backward()` (on a loss that depends on every MoE layer's output) exactly once per
//! forward, must not drop a forward graph without backward while others do backward, and must
//! pass at least one token to every layer (the [`DenseModel`](crate::model::DenseModel) always
//! does). A worker that fails mid-step leaves its peers blocked until the communicator timeout.
//!
//! ## After backward
//!
//! [`DistributedExperts::step_experts`] all-reduces every expert's gradients over the ranks
//! holding a replica (left fold in rank order: bit-identical everywhere) and applies
//! [`ExpertStore::step_replica`](crate::model::ExpertStore::step_replica);
//! [`DistributedExperts::all_reduce_dense`] sums the dense gradients over all ranks.
//! [`crate::worker::train_step`] composes one whole step. Both reductions **sum** over workers;
//! the step then multiplies every gradient by [`crate::model::grad_scale`] (`1 / members`, so
//! the update follows the mean of the workers' shard losses, times the clipping factor).
//!
//! ## FSEP mode ([`DistributedExperts::new_sharded`])
//!
//! Storage follows LAER-MoE's FSEP: every expert's flattened parameters and AdamW moments are
//! cut into `S` shards, and each rank keeps the shards a placement gives it
//! ([`crate::model::ShardStore`]): LAER's shard `w` on rank `w`, or resilient FSEP's `f`
//! copies of every shard on distinct ranks. The layout table
//! `[layer][expert][rank]` is the same one the replicated mode holds replicas by, and the
//! dispatch plan reads it the same way, so tokens route identically in both modes. Per MoE
//! layer, in the forward, one `all_to_all_v` of shards materialises the experts the layout
//! assigns to this rank (as fresh `Var`s; each shard is served by its *primary*, its lowest
//! holder); they are **kept for backward** rather than gathered
//! again: the backward exchange needs each computed expert once more, and keeping them costs
//! the memory of the replicated mode's weights (`Σ_layers C_l · P_e` for `C_l` experts
//! computed in layer `l` and `P_e = 8·d·ff` bytes per expert) until the gradients are
//! reduced, against a second shard all-to-all per layer. After backward the reverse
//! all-to-all (a reduce-scatter) sends shard `w` of each computed expert's local gradient to
//! every holder of shard `w`, which sums the replicas' contributions in ascending rank order
//! (the left fold of the replicated all-reduce, so the summed shard is bit-identical to the
//! slice of the replicated sum, and the same on every copy); the materialised weights are
//! dropped and AdamW updates the local shards only, every copy the same way, so copies stay
//! bit-identical. A re-layout ([`DistributedExperts::set_layout`]) changes the table and
//! nothing else.
//!
//! ## Data path: the dispatch kernels
//!
//! The rows move between local order and the plan's send layout through the `lazarus-kernels`
//! crate (`dispatch.rs`, `LayerRoute`), in the forward (tokens out, expert outputs back) and in
//! the op's backward (`dL/dy` out, `dL/dx` back): per layer, the send position of every local
//! row (`DispatchTables::from_plan` + `send_positions`, which checks the rows' per-expert
//! counts against the plan: a row routed to an unknown expert is an error, not a panic), the
//! permutation into the send buffer (`permute_rows`, top_k = 1 since `run_layer` receives
//! per-expert batches), split per destination by `send_counts[me]`, and on the way back the
//! exact inverse (`unpermute_rows` of the concatenated returned buffers: rows copied bit for
//! bit). On the CPU it runs the crate's CPU references. With feature `cuda`, when the layer's
//! rows live on a CUDA device, it runs the crate's CUDA kernels on candle's stream of that
//! device: the op then runs on the device (its `cuda_fwd` hands out the outputs un-permuted
//! there), and the only host traffic is one device-to-host copy of each permuted send buffer and
//! one host-to-device copy of each returned one.
//!
//! Host staging: activations travel as f32 through host memory (the
//! [`Communicator`](crate::comm::Communicator) moves host buffers); on a device other than the
//! CPU or CUDA the op runs on a host copy of the inputs (moved with differentiable
//! `to_device`).

mod dispatch;
mod experts;
mod fsep;

pub use experts::{DistributedExperts, LayerLog};
pub use fsep::{ShardGrads, SharedShards, Traffic, gather_experts};
