//! # lazarus-executor (`lzrun`) — work in progress
//!
//! The measured half of Lazarus-rs: real processes, real gradients, real failures. Planned
//! shape (see `executor/README.md`): a **control plane** (controller, one agent per node) and a
//! **data plane** (a `Communicator` for collectives between workers, the MoE model on candle).
//! Every placement, dispatch and migration decision is the planner's.
//!
//! Built so far: the communicator, the model, the control plane and the distributed expert
//! runtime (per-layer dispatch with `lazarus_planner::dispatch`, backward exchanges, replica-group
//! gradient all-reduce), each tested; worker processes, recovery, checkpoints and the `lzrun`
//! binary are the next step (`executor/README.md`).
pub mod checkpoint;
pub mod comm;
pub mod control;
pub mod faults;
pub mod metrics;
pub mod model;
pub mod recovery;
pub mod runtime;
pub mod worker;
