//! # lazarus-executor (`lzrun`)
//!
//! The measured half of Lazarus-rs: real processes, real gradients, real failures. A **control
//! plane** ([`control`]: the job controller and one agent per node) drives a **data plane**
//! (managed worker processes, [`worker`], over a [`comm::Communicator`], training the candle
//! MoE model of [`model`] with the distributed expert runtime of [`runtime`]). Every placement,
//! dispatch and migration decision is the planner's. [`checkpoint`] writes and verifies atomic
//! checkpoints, [`faults`] turns flags and spot traces into fault schedules, [`metrics`] writes
//! what a run measured, [`interop`] reads and writes Hugging Face model directories. See `executor/README.md`.
pub mod checkpoint;
pub mod comm;
pub mod control;
pub mod dataset;
pub mod device;
pub mod faults;
pub mod interop;
pub mod malloc;
pub mod metrics;
pub mod model;
pub mod runtime;
pub mod worker;
