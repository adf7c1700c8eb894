//! # lazarus-planner
//!
//! The pure planner of Lazarus-rs: every decision about *where experts live, how many
//! replicas they get, how tokens are split and what state must move* is made here, by small
//! pure functions over plain arrays. No I/O, no clocks; randomness only through a seeded RNG
//! passed in by the caller. Both drivers — the simulator (`lzsim`) and the executor (`lzrun`) —
//! call these functions and never re-implement them.
//!
//! Algorithms follow Lazarus (arXiv 2407.04656 v2): Eq. 1 allocation (§4.1), the
//! Maximum-Rank-Overlap placement and its Theorem 1 (§4.1, App. A.2), the flexible token
//! dispatcher (Alg. 1, §4.2) and reconfiguration with minimal migration (§4.3, §5).
//! Where the paper is silent, each module documents the decision it takes.
pub mod allocate;
pub mod data;
pub mod deadline;
pub mod dispatch;
pub mod error;
pub mod fsep;
pub mod gpu_failures;
pub mod migrate;
pub mod place;
pub mod recovery;
pub mod spec;
pub mod transport;

pub use allocate::{AllocPolicy, Allocation, allocate};
pub use error::PlanError;
pub use place::{Grid, LayerPlacement, PlacePolicy, place};
pub use recovery::RecoveryEstimate;
pub use spec::{Aggregation, ClusterSpec, LoadHistory, ModelSpec};
pub mod job;
pub mod model;
pub use model::{
    Alignment, ModelPlan, ReplanError, ReplanOptions, plan_model, replan, replan_held,
};
pub use place::mro_structure;
pub mod relayout;
pub mod repair;
