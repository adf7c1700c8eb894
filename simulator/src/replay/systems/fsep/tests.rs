use super::*;
use crate::cost::fsep::dense_allreduce_s;
use crate::replay::systems::lazarus::Sharded;
use crate::replay::systems::{Ctx, NodeId, System};

fn profiles() -> (HardwareProfile, ModelProfile) {
    (
        cost::hardware("rtx3090-100g").unwrap(),
        cost::model("gpt-l").unwrap(),
    )
}

fn skewed_loads(model: &ModelProfile) -> Vec<Vec<u64>> {
    (0..model.moe_layers as u64)
        .map(|l| {
            (0..model.experts as u64)
                .map(|e| 1 + 1000 / (1 + (e + l) % model.experts as u64))
                .collect()
        })
        .collect()
}

/// The FSEP step costs the replicated step on the same materialised layout, minus the expert
/// all-reduce it replaces, plus the shard all-to-alls: their bytes over the rank's link.
#[test]
fn fsep_step_exceeds_replicated_by_the_shard_traffic() {
    let (hw, model) = profiles();
    let ctx = Ctx {
        hw: &hw,
        model: &model,
    };
    let loads = skewed_loads(&model);
    let nodes: Vec<NodeId> = (0..10).collect();
    let layout = Sharded { copies: Some(1) }
        .start(&ctx, &nodes, &loads)
        .unwrap();
    let (fsep, traffic) = layout_step_cost(&hw, &model, &layout, &loads).unwrap();
    let traffic = traffic.unwrap();
    let replicas = materialised(&hw, &model, 10, &loads).unwrap();
    let replicated = cost::step_cost_sparse(
        &hw,
        &model,
        &cost::SparseStepInput {
            gpus: 10,
            replicas: cost::LayerRows::Each(&replicas),
            loads: &loads,
            dispatch: Dispatch::Unpadded,
            ep_groups: None,
            equal_nodes: None,
        },
    )
    .unwrap();
    // By hand: one GPU per node, so every peer is remote; S = 10 shards, one held locally.
    // ⌈8·16/10⌉ = 13 copies' worth is above the profile's 6 slots: C = 6.
    assert_eq!(cost::fsep::slots_per_gpu(&model, 10), model.slots_per_gpu);
    let c = model.slots_per_gpu as f64;
    let p_w = (model.expert_params() * model.bytes_per_param_weights) as f64;
    let p_g = model.expert_grad_bytes() as f64;
    let bytes = model.moe_layers as f64 * (2.0 * c * p_w + c * p_g) * 0.9;
    assert!((traffic.bytes_per_rank - bytes).abs() < 1.0);
    let shard_s = bytes / hw.rank_inter_bandwidth();
    assert!((traffic.shard_s - shard_s).abs() < 1e-9);
    let saved = replicated.grad_allreduce_s - dense_allreduce_s(&hw, &model, 10);
    assert!(saved >= 0.0);
    let extra = fsep.total_s - replicated.total_s;
    assert!(
        (extra - (shard_s - saved)).abs() < 1e-9,
        "{extra} vs {shard_s} - {saved}"
    );
    assert!(fsep.total_s > replicated.total_s);
    assert_eq!(fsep.expert_compute_s, replicated.expert_compute_s);
    assert_eq!(fsep.all_to_all_s, replicated.all_to_all_s);
}

/// Copies cost the gradient forward to the other holders: f = 2 pays more than f = 1.
#[test]
fn copies_add_the_gradient_forward() {
    let (hw, model) = profiles();
    let shape = |copies| FsepShape {
        shards: 10,
        copies,
        holder_ranks: 10,
    };
    let one = cost::fsep::shard_traffic(&hw, &model, 10, &shape(1)).unwrap();
    let two = cost::fsep::shard_traffic(&hw, &model, 10, &shape(2)).unwrap();
    // f = 2 holds 2 of 10 shards locally (less to gather) but forwards E gradient shards.
    let p_w = (model.expert_params() * model.bytes_per_param_weights) as f64;
    let p_g = model.expert_grad_bytes() as f64;
    let c = model.slots_per_gpu as f64;
    let want = model.moe_layers as f64
        * ((2.0 * c * p_w + c * p_g) * 0.8 + model.experts as f64 * p_g / 10.0);
    assert!((two.bytes_per_rank - want).abs() < 1.0);
    assert!(one.bytes_per_rank > 0.0 && two.shard_s > 0.0);
}
