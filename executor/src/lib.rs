//! # lazarus-executor (`lzrun`) — work in progress
//!
//! The measured half of Lazarus-rs: real processes, real gradients, real failures. Planned
//! shape (see `executor/README.md`): a **control plane** (controller, one agent per node) and a
//! **data plane** (a `Communicator` for collectives between workers, the MoE model on candle).
//! Every placement, dispatch and migration decision is the planner's.
//!
//! Built so far: the pieces below, each tested on its own; the runtime that joins them (per-layer
//! dispatch with `lazarus_planner::dispatch`, expert-gradient all-reduce over replicas, recovery,
//! checkpoints) and the `lzrun` binary are the next step.
pub mod comm;
pub mod control;
pub mod model;
