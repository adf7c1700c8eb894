//! Errors of the allocation / placement / recovery half of the planner.

/// Why a plan cannot be made. Every variant names the offending quantity so a CLI can print
/// it as one clear line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("nodes must be at least 1 (got {0})")]
    NoNodes(usize),
    #[error("slots per node must be at least 1 (got {0})")]
    NoSlots(usize),
    #[error("experts per layer must be at least 1 (got {0})")]
    NoExperts(usize),
    #[error("layers must be at least 1 (got {0})")]
    NoLayers(usize),
    #[error("fault-tolerance threshold f must be at least 1 (got {0})")]
    ZeroF(usize),
    #[error(
        "{experts} experts do not fit in {slots} slots (nodes x slots per node): every expert needs at least one slot"
    )]
    TooFewSlots { experts: usize, slots: usize },
    #[error("expected {expected} loads (one per expert), got {got}")]
    LoadCount { expected: usize, got: usize },
    #[error("expected loads for {expected} layers, got {got}")]
    LayerCount { expected: usize, got: usize },
    #[error("replica counts sum to {got} but the cluster has {expected} slots")]
    ReplicaSum { expected: usize, got: usize },
    #[error("expert {expert} has 0 replicas; every expert needs at least one")]
    ZeroReplicas { expert: usize },
    #[error(
        "node {node} has {got} slots but node 0 has {expected}: every node needs the same slot count"
    )]
    RaggedGrid {
        node: usize,
        expected: usize,
        got: usize,
    },
    #[error("expert {expert} has {got} replicas in the grid but its allocation says {expected}")]
    CountMismatch {
        expert: usize,
        expected: usize,
        got: usize,
    },
    #[error("expert id {expert} is out of range: the layer has {experts} experts")]
    ExpertOutOfRange { expert: usize, experts: usize },
    #[error(
        "layer {layer} is placed on {got} nodes but layer 0 on {expected}: layers must share one node set"
    )]
    LayerNodeMismatch {
        layer: usize,
        expected: usize,
        got: usize,
    },
    #[error("failure domain list has {got} entries for {nodes} nodes")]
    DomainCount { nodes: usize, got: usize },
    #[error("{failed} failures requested but only {units} {unit} exist")]
    TooManyFailures {
        failed: usize,
        units: usize,
        unit: &'static str,
    },
    #[error(
        "exact enumeration of C({n}, {k}) failure sets is too large ({count:.3e} > {limit:.0e}); use Monte Carlo"
    )]
    EnumerationTooLarge {
        n: usize,
        k: usize,
        count: f64,
        limit: f64,
    },
    #[error("exact enumeration supports at most 64 nodes (got {0}); use Monte Carlo")]
    TooManyNodesForExact(usize),
    #[error("the closed form applies to MRO plans only: {0}")]
    NotMro(String),
    #[error("EMA smoothing factor must be in (0, 1] (got {0})")]
    BadAlpha(f64),
    #[error("the aggregation window must be at least 1 step")]
    ZeroWindow,
    #[error("Monte Carlo needs at least 1 trial")]
    ZeroTrials,
    #[error(
        "GPUs per node must be between 1 and the {slots} slots of a node (got {gpus}): every GPU holds at least one slot"
    )]
    BadGpusPerNode { gpus: usize, slots: usize },
}
