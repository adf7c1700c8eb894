//! `lzsim plan`.

use crate::SpecArgs;
use clap::Args;
use lazarus_planner::dispatch::{replicas_per_rank, tokens_per_rank};
use lazarus_planner::place::mro_structure;
use lazarus_planner::{LayerPlacement, ModelPlan, PlacePolicy};
use serde_json::{Value, json};
use std::fmt::Write;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Placement: mro, spread, compact, random (seeded by --seed).
    #[arg(long, default_value = "mro")]
    pub place: String,
    /// Output format. JSON lists replicas per node and expert too, so it is bounded:
    /// nodes x (slots + experts) x layers <= 33554432 values.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// Most values `--format json` builds: the placement grid and the replicas-per-node matrix of
/// every layer. A JSON tree costs about 45 bytes per value, so this is about 1.5 GB.
pub const MAX_JSON_VALUES: usize = 1 << 25;

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let spec = &args.spec;
    spec.validate()?;
    if args.format == "json" {
        crate::limits::check_product(
            &[
                ("--nodes", spec.nodes),
                ("(--slots + --experts)", spec.slots + spec.experts),
                ("--layers", spec.layers),
            ],
            MAX_JSON_VALUES,
            "JSON values",
            "--format text has no such limit",
        )?;
    }
    let place: PlacePolicy = args.place.parse().map_err(anyhow::Error::msg)?;
    let loads = spec.loads()?;
    let plan = spec.plan(place, &loads)?;
    if args.format == "json" {
        crate::stdout::println(&serde_json::to_string_pretty(&to_json(&plan, &loads))?)?;
    } else {
        crate::stdout::print(&to_text(&plan, &loads))?;
    }
    Ok(())
}

/// Tokens each node computes when the layer's loads are dispatched over its replicas (the
/// dispatcher's capacities), and their max / mean (1.0 = every node equally busy).
fn node_tokens(p: &LayerPlacement, loads: &[u64]) -> (Vec<u64>, f64) {
    let tokens = tokens_per_rank(loads, &replicas_per_rank(&p.grid().to_vec(), p.experts()))
        .expect("a valid plan gives every expert a replica");
    let max = tokens.iter().copied().max().unwrap_or(0) as f64;
    let sum: u64 = tokens.iter().sum();
    let ratio = if sum == 0 {
        1.0
    } else {
        max * tokens.len() as f64 / sum as f64
    };
    (tokens, ratio)
}

fn layer_json(plan: &ModelPlan, loads: &[Vec<u64>], l: usize) -> Value {
    let p = &plan.layers[l];
    let (tokens, ratio) = node_tokens(p, &loads[l]);
    json!({
        "layer": l,
        "loads": loads[l],
        "f_effective": plan.allocations[l].f_effective,
        "replicas": plan.allocations[l].replicas,
        "placement": p.grid(),
        "replicas_per_node": p.replica_matrix(),
        "tokens_per_node": tokens,
        "load_ratio": ratio,
    })
}

/// One layer: the layer's keys at top level. Several: the same under `"layers"`.
pub fn to_json(plan: &ModelPlan, loads: &[Vec<u64>]) -> Value {
    let mut v = json!({
        "nodes": plan.cluster.nodes,
        "slots": plan.cluster.slots_per_node,
        "experts": plan.model.experts,
        "f": plan.model.f,
        "alloc": plan.alloc.name(),
        "place": plan.place.name(),
    });
    let obj = v.as_object_mut().expect("object");
    if plan.layers.len() == 1 {
        if let Value::Object(layer) = layer_json(plan, loads, 0) {
            obj.extend(layer.into_iter().filter(|(k, _)| k != "layer"));
        }
    } else {
        obj.insert(
            "layers".into(),
            Value::Array(
                (0..plan.layers.len())
                    .map(|l| layer_json(plan, loads, l))
                    .collect(),
            ),
        );
    }
    v
}

/// EPLB-style picture: one row per node, one cell per slot.
pub fn to_text(plan: &ModelPlan, loads: &[Vec<u64>]) -> String {
    let mut s = String::new();
    let e = plan.model.experts;
    let w = (e.saturating_sub(1)).to_string().len().max(2);
    let _ = writeln!(
        s,
        "{} nodes x {} slots, {} experts, {} layer(s), f = {}, alloc = {}, place = {}",
        plan.cluster.nodes,
        plan.cluster.slots_per_node,
        e,
        plan.layers.len(),
        plan.model.f,
        plan.alloc,
        plan.place
    );
    for (l, p) in plan.layers.iter().enumerate() {
        let a = &plan.allocations[l];
        let _ = writeln!(s, "\nlayer {l}  (f effective = {})", a.f_effective);
        let _ = writeln!(s, "  expert  {:>12}  {:>8}  nodes", "load", "replicas");
        let sets = p.node_sets();
        for x in 0..e {
            let _ = writeln!(
                s,
                "  {:>6}  {:>12}  {:>8}  {}",
                x,
                loads[l][x],
                a.replicas[x],
                sets[x].len()
            );
        }
        let _ = writeln!(s);
        for (n, row) in p.grid().iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|x| format!("{x:>w$}")).collect();
            let _ = writeln!(s, "  node {n:>3} | {} |", cells.join(" "));
        }
        let (tokens, ratio) = node_tokens(p, &loads[l]);
        let _ = writeln!(
            s,
            "  tokens per node as dispatched: {tokens:?}  (max / mean {ratio:.3})"
        );
        if plan.place == PlacePolicy::Mro {
            let st = mro_structure(&a.replicas, plan.cluster.nodes, plan.cluster.slots_per_node);
            let _ = writeln!(
                s,
                "  MRO blocks (nodes per group, from node 0): {:?}{}",
                st.block_sizes,
                if st.spread_fallback {
                    "  [last block truncated below the minimum replica count: placed with spread]"
                } else if st.truncated {
                    "  [last block truncated by N]"
                } else {
                    ""
                }
            );
        }
    }
    s
}
