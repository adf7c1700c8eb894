//! The Lazarus control plane (paper §3, `shared/reference/lazarus.md` §1): one centralized
//! controller and one agent per node, over TCP.
//!
//! * [`controller`] — [`ControllerState`], a pure state machine over the cluster view
//!   (registration, heartbeats and expiry, routing loads, when and how to replan through the
//!   planner), and [`run_controller`], the tokio server around it.
//! * [`agent`] — [`run_agent`]: register, heartbeat, relay plans to the runtime, report routing
//!   counts.
//! * [`proto`] — the messages and their framing.
//! * [`job`] — [`JobDriver`] and [`run_job`]: the controller of a training job, sequencing the
//!   workers' data plane (start, pause, reconfigure, checkpoint commits, stop) around
//!   [`ControllerState`]; its agents run [`run_job_agent`]. `run_controller` / `run_agent`
//!   are the plan-broadcast service without a data plane.
//!
//! # Why a length-delimited postcard protocol and not gRPC
//! The control plane is internal: the controller and the agents are built from this crate, so
//! there is no foreign client to serve and no need for a language-neutral schema. A handful of
//! serde enums in a length-delimited frame (tokio-util's `LengthDelimitedCodec`, postcard
//! payloads) is enough, versioned as a whole by [`proto::PROTOCOL_VERSION`] (checked at
//! registration). Measured in `shared/reference/rust-stack.md` (probe 7 vs 7c): tonic + prost
//! needs a `.proto` toolchain (protoc, or protox in build.rs), builds in **88 s** (103 units) against
//! **22 s** (34 units) for tokio + tokio-util + postcard, and 1000 loopback round trips took
//! 0.34–0.40 s with gRPC against 33–109 ms framed — **~30–100 µs** per round trip. Heartbeats and
//! plans are tiny and rare, so neither speed matters much; the smaller build and having no
//! code generator do.
pub mod agent;
pub mod controller;
pub mod job;
pub mod proto;

pub use agent::{
    Agent, AgentConfig, AgentError, AgentExit, StepCounts, WorkerLaunch, run_agent, run_job_agent,
};
pub use controller::{
    ConfigError, ControllerConfig, ControllerError, ControllerState, Reject, RoutingError,
    run_controller,
};
pub use job::{JobDriver, JobHandle, JobParams, Notice, run_job};
pub use proto::{PROTOCOL_VERSION, PlanMsg, ToAgent, ToController};

/// Resolves once `shutdown` is `true` or its sender is gone (nobody can stop us any more, so
/// stopping is the safe reading).
pub(crate) async fn shutdown_signal(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&stop| stop).await;
}
