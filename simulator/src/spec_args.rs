//! Arguments shared by `lzsim plan` and `lzsim recovery`: the cluster, the model and its loads.

use crate::limits::{self, MAX_EXPERTS, MAX_F, MAX_LAYERS, MAX_NODES, MAX_SLOTS_PER_NODE};
use crate::loads;
use clap::Args;
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelPlan, ModelSpec, PlacePolicy, plan_model,
};
use std::path::PathBuf;

/// The cluster, the model and its loads — shared by every subcommand. Defaults are the
/// paper's testbed with GPT-L: 10 nodes × 6 slots, 16 experts, f = 2. Sizes are bounded
/// ([`crate::limits`]) so a typo is a usage error, not a panic or gigabytes of plan.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Nodes (the failure unit), 1..=1048576.
    #[arg(long, default_value_t = 10, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Expert-replica slots per node (the paper's c), 1..=4096.
    #[arg(long, default_value_t = 6, value_parser = limits::count(MAX_SLOTS_PER_NODE))]
    pub slots: usize,
    /// Experts per MoE layer, 1..=65536.
    #[arg(long, default_value_t = 16, value_parser = limits::count(MAX_EXPERTS))]
    pub experts: usize,
    /// MoE layers, 1..=1024; recovery is then for the whole model (every layer must keep every
    /// expert). Also nodes x slots x layers <= 67108864 replica slots (about 1.6 GB of plan).
    #[arg(long, default_value_t = 1, value_parser = limits::count(MAX_LAYERS))]
    pub layers: usize,
    /// Fault-tolerance threshold: minimum replicas per expert (relaxed when slots run short),
    /// 1..=1024.
    #[arg(long, default_value_t = 2, value_parser = limits::count(MAX_F))]
    pub f: usize,
    /// Loads (tokens per expert), comma-separated, used for every layer.
    #[arg(long, conflicts_with_all = ["loads_file", "zipf"])]
    pub loads: Option<String>,
    /// Loads file: one line of E loads per layer, or the SmartMoE gate trace CSV.
    #[arg(long, conflicts_with = "zipf")]
    pub loads_file: Option<PathBuf>,
    /// Iteration to take from a SmartMoE trace (default: its last).
    #[arg(long, requires = "loads_file")]
    pub iter: Option<u64>,
    /// Zipf-skewed synthetic loads with this exponent (default 1.2 when no loads are given).
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Replica allocation: lazarus (Eq. 1), eplb, uniform.
    #[arg(long, default_value = "lazarus")]
    pub alloc: AllocPolicy,
    /// Layer alignment: aligned (MRO blocks on the same nodes in every layer) or independent.
    #[arg(long, default_value = "aligned", value_parser = ["aligned", "independent"])]
    pub align: String,
    /// Seed for random placements, synthetic loads and Monte Carlo.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SpecArgs {
    pub fn cluster(&self) -> ClusterSpec {
        ClusterSpec::new(self.nodes, self.slots)
    }

    pub fn model(&self) -> ModelSpec {
        ModelSpec {
            experts: self.experts,
            layers: self.layers,
            f: self.f,
        }
    }

    pub fn alignment(&self) -> Alignment {
        if self.align == "independent" {
            Alignment::Independent { seed: self.seed }
        } else {
            Alignment::Aligned
        }
    }

    /// Checks the numbers before anything is computed, so bad input is one clear line.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.cluster().validate()?;
        self.model().validate()?;
        limits::check_product(
            &[
                ("--nodes", self.nodes),
                ("--slots", self.slots),
                ("--layers", self.layers),
            ],
            limits::MAX_REPLICA_SLOTS,
            "replica slots",
            "",
        )?;
        if self.experts > self.nodes * self.slots {
            anyhow::bail!(
                "--experts {} exceeds the {} slots of --nodes {} x --slots {}: every expert needs a slot",
                self.experts,
                self.nodes * self.slots,
                self.nodes,
                self.slots
            );
        }
        Ok(())
    }

    /// The whole-model plan for `place` (a bare `random` takes its seed from `--seed`).
    pub fn plan(&self, place: PlacePolicy, loads: &[Vec<u64>]) -> anyhow::Result<ModelPlan> {
        let place = match place {
            PlacePolicy::Random { seed: 0 } => PlacePolicy::Random { seed: self.seed },
            p => p,
        };
        Ok(plan_model(
            &self.cluster(),
            &self.model(),
            loads,
            self.alloc,
            place,
            self.alignment(),
        )?)
    }

    pub fn loads(&self) -> anyhow::Result<Vec<Vec<u64>>> {
        if let Some(text) = &self.loads {
            loads::from_list(text, self.experts, self.layers)
        } else if let Some(path) = &self.loads_file {
            loads::from_file(path, self.experts, self.layers, self.iter)
        } else {
            loads::zipf(
                self.zipf.unwrap_or(1.2),
                self.experts,
                self.layers,
                self.seed,
            )
        }
    }
}
