//! Lazarus-rs simulator: the library behind `lzsim`.
//!
//! * [`plan_cmd`], [`recovery_cmd`]: replica plans and recovery probabilities (planner
//!   front-ends; the rows come from [`recovery`]);
//! * [`relayout`]: re-layout policies replayed over a routing trace; [`relayout_cmd`] is its
//!   command;
//! * [`plot`]: charts of the domain modules' rows; `*_cmd` modules only parse, call a domain
//!   module and print;
//! * [`replay`]: the discrete-event simulator of MoE training under node failures, with the
//!   systems it compares ([`replay::systems`]), on the cost model of [`cost`] and the expert-load
//!   workloads of [`workload`]; [`replay_cmd`], [`sweep_cmd`], [`failures_cmd`] are its commands;
//! * [`predict`]: a recorded `lzrun local` run replayed with a calibrated profile, measured vs
//!   predicted; [`predict_cmd`] is its command.
//!
//! Every placement, allocation, dispatch and migration decision is the planner's
//! (`lazarus-planner`); this crate only drives it.

pub mod cost;
pub mod duration;
pub mod failures_cmd;
pub mod fault_log;
pub mod fsep_recovery;
pub mod limits;
pub mod loads;
pub mod plan_cmd;
pub mod plot;
pub mod predict;
pub mod predict_cmd;
pub mod reconfig_cmd;
pub mod recovery;
pub mod recovery_cmd;
pub mod relayout;
pub mod relayout_cmd;
pub mod replay;
pub mod replay_cmd;
pub mod spec_args;
pub mod stdout;
pub mod sweep_cmd;
pub mod workload;

pub use spec_args::SpecArgs;
