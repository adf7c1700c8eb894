//! # lazarus-traces
//!
//! The node-availability trace layer shared by the simulator (`lzsim replay`) and the executor
//! (`lzrun --fault-trace`): a validated list of `add` / `remove` events on named nodes
//! ([`Trace`]), parsers for the public trace formats, slicing ([`Trace::window`]), fitting onto
//! a smaller cluster ([`Trace::fit`], [`FitMode`]) and seeded synthetic generators
//! ([`synth`]). Also the expert-load side: the SmartMoE gate-trace parser
//! ([`routing::GateTrace`]) and the synthetic drifting-Zipf loads ([`zipf::ZipfLoads`]), and
//! where tests find the third-party traces ([`shared`]), and the duration syntax of trace
//! windows on the command line ([`duration`]: `--window 8m..1h`).
//!
//! Everything is pure and deterministic; the only I/O is the thin [`load`] helper.
//!
//! * Formats ([`TraceFormat`]): F1 Bamboo CSV `time_ms,add|remove,node` (the primary replay
//!   format: the AWS P3 and g4dn spot traces), F2 JSON lines `[time_ms, op, {"nodes": [...]}]`
//!   (Parcae and SpotServe replays), F3 node-count CSV `time_ms,live_nodes` (the P3 trace as
//!   some replayers ship it) and F5 SkyPilot count series (the F-numbers are our format
//!   names), and F6, the fault log of a production cluster (StepFun's InfiniteHBD JSON:
//!   `fault_start`/`fault_end` per node with a fault class, times in days; [`faultlog`]),
//!   replayed as removes at each outage's start and adds at its repair; [`detect_format`]
//!   tells them apart, and [`load_file`] keeps a fault log's classes. The two count series name their nodes by one
//!   rule (fresh names for adds, newest node removed first), documented on [`TraceFormat`].
//! * Semantics: events are sorted by time; at equal times adds come before removes (the
//!   Bamboo and Oobleck simulators' `(time, kind)` queue order); a batch of events at one
//!   time stamp takes effect atomically.
//! * Third-party traces are never copied into this repository; tests read them from
//!   [`shared::dir`] (`$LAZARUS_TRACES`, else `../shared/traces/`) and skip when absent.
//!
//! ```
//! use lazarus_traces::{FitMode, TraceFormat, parse};
//! let csv = "0,add,a\n0,add,b\n0,add,c\n60000,remove,b\n120000,add,d\n";
//! let trace = parse(csv, TraceFormat::BambooCsv).unwrap();
//! assert_eq!((trace.max_live(), trace.live_at(60_000)), (3, 2));
//! let w = trace.window(90_000, 180_000); // a and c carried over, then +d at 30 s
//! assert_eq!(w.to_bamboo_csv(), "0,add,a\n0,add,c\n30000,add,d\n");
//! assert!(trace.fit(2, FitMode::Clamp).max_live() <= 2);
//! ```
#![deny(missing_docs)]

pub mod duration;
pub mod error;
pub mod faultlog;
pub mod fit;
pub mod hardware;
pub mod parse;
pub mod routing;
pub mod shared;
pub mod synth;
pub mod trace;
pub mod zipf;

pub use error::{ParseEnumError, TraceError};
pub use faultlog::FaultLog;
pub use fit::FitMode;
pub use parse::{MAX_SYNTH_EVENTS, TraceFile, TraceFormat, detect_format, load, load_file, parse};
pub use trace::{NodeOp, Trace, TraceEvent};
