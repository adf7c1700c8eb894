//! `lzsim replay` of a fault log (StepFun's InfiniteHBD JSON, [`lazarus_traces::faultlog`]):
//! the cluster size it lacks (`--cluster-nodes`) and the faults of each class that fell in the
//! replayed window.

use anyhow::{Context, Result, bail};
use lazarus_traces::faultlog::MS_PER_DAY;
use lazarus_traces::{FaultLog, NodeOp, Trace, TraceFile};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Reads the trace at `path`; a fault log becomes the trace of a cluster of `cluster_nodes`
/// nodes (default: the log's own nodes) and is returned too. `cluster_nodes` with any other
/// format is an error.
pub fn load(path: &Path, cluster_nodes: Option<usize>) -> Result<(Trace, Option<FaultLog>)> {
    match lazarus_traces::load_file(path)? {
        TraceFile::Trace(t) => {
            if let Some(n) = cluster_nodes {
                bail!(
                    "--cluster-nodes {n}: {} is not a fault log (InfiniteHBD JSON); the other \
                     formats name every node they have",
                    path.display()
                );
            }
            Ok((t, None))
        }
        TraceFile::FaultLog(log) => {
            let trace = match cluster_nodes {
                Some(n) => log
                    .trace_on(n)
                    .with_context(|| format!("--cluster-nodes {n}: {}", path.display()))?,
                None => log.trace(),
            };
            Ok((trace, Some(log)))
        }
    }
}

/// What a replay saw of a fault log: the faults that started in the replayed window
/// `[start_ms, end_ms]` of the log's time (`--window`'s start and the replay's end), by class,
/// and the node removals (outages) of the replayed trace in it.
#[derive(Debug, Clone, Serialize)]
pub struct FaultCounts {
    /// Replayed window, in the log's time: first and last millisecond (inclusive).
    pub start_ms: u64,
    /// Last millisecond replayed (inclusive).
    pub end_ms: u64,
    /// Nodes of the cluster (`--cluster-nodes`, else the log's).
    pub cluster_nodes: usize,
    /// Distinct nodes of the whole log.
    pub log_nodes: usize,
    /// Faults starting in the window.
    pub faults: usize,
    /// Distinct nodes with a fault starting in the window.
    pub faulty_nodes: usize,
    /// Node removals the replay processes (one per outage: overlapping faults on a node are
    /// one).
    pub removals: usize,
    /// Faults starting in the window, per `Class`.
    pub by_class: BTreeMap<String, usize>,
    /// The same per `Level`, then `Class` (a class such as "Other Failures" appears under
    /// several levels).
    pub by_level: BTreeMap<String, BTreeMap<String, usize>>,
}

impl FaultCounts {
    /// The counts for a replay of `trace` (the log's trace on `cluster_nodes` nodes after
    /// `--window`, rebased to its start `window_start_ms`) up to `run_ms` of replayed time;
    /// `window_end_ms` is the window's exclusive end (`u64::MAX` without `--window`).
    pub fn new(
        log: &FaultLog,
        cluster_nodes: usize,
        trace: &Trace,
        window_start_ms: u64,
        window_end_ms: u64,
        run_ms: u64,
    ) -> Self {
        let start_ms = window_start_ms;
        let end_excl = window_end_ms.min(start_ms.saturating_add(run_ms).saturating_add(1));
        let faults: Vec<_> = log.faults_starting_in(start_ms, end_excl).collect();
        let mut by_level: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
        for f in &faults {
            let t = &f.fault_type;
            *by_level
                .entry(t.level.clone())
                .or_default()
                .entry(t.class.clone())
                .or_default() += 1;
        }
        let mut nodes: Vec<&str> = faults.iter().map(|f| f.node.as_str()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        Self {
            start_ms,
            end_ms: end_excl.saturating_sub(1),
            cluster_nodes,
            log_nodes: log.nodes().len(),
            faults: faults.len(),
            faulty_nodes: nodes.len(),
            removals: trace
                .events()
                .iter()
                .filter(|e| e.op == NodeOp::Remove && e.time_ms <= run_ms)
                .count(),
            by_class: log.class_counts(start_ms, end_excl),
            by_level,
        }
    }

    /// Two lines for the text output: the totals, then the faults per class (most first).
    pub fn text(&self) -> String {
        let days = |ms: u64| ms as f64 / MS_PER_DAY;
        let mut classes: Vec<(&String, &usize)> = self.by_class.iter().collect();
        classes.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let classes: Vec<String> = classes.iter().map(|(c, n)| format!("{c} {n}")).collect();
        format!(
            "fault log: {} faults on {} nodes (of {} in the log, {} in the cluster) in days \
             {:.4}..{:.4}, {} node removals (overlapping faults on a node are one)\n\
             faults by class: {}\n",
            self.faults,
            self.faulty_nodes,
            self.log_nodes,
            self.cluster_nodes,
            days(self.start_ms),
            days(self.end_ms),
            self.removals,
            if classes.is_empty() {
                "none".to_owned()
            } else {
                classes.join(", ")
            }
        )
    }
}
