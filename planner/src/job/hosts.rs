//! Hosts: several nodes of the job machine on one physical host (one node per GPU).
//!
//! A node of the [`JobMachine`](super::JobMachine) is one worker: one rank with `c` slots
//! ([`JobConfig::slots_per_node`](super::JobConfig::slots_per_node)). On a host with `G` GPUs,
//! `G` nodes register, each saying which host it is on ([`Event::Joined`](super::Event)'s
//! `host`). The machine stays a machine of nodes (ranks, steps, idleness, transfers are per
//! node, as before); only two rules look at hosts:
//!
//! * **Placement** is made per host: the Eq. 1 allocation and MRO placement over the `H`
//!   hosts with `c·G` slots each (the planner's [`ClusterSpec`] with `gpus_per_node = G`),
//!   then each host's slots (sorted by expert id) are split into `G` contiguous runs of `c`
//!   ([`split_host_slots`], as [`ClusterSpec::gpu_of_slot`] does), run `k` for the host's
//!   `k`-th node (nodes of a host in the order the machine ranks them). So replicas of an
//!   expert are spread over hosts exactly as MRO spreads them over nodes, and a host failure
//!   is what MRO's recovery analysis counts as one node failure. The ranks of one host are
//!   consecutive. An in-place replan maps the new plan's hosts onto the surviving hosts with
//!   the usual minimal-migration mapping (holdings of a host: the union of its nodes'), then
//!   splits each host's slots the same way and gives the runs to the host's nodes by the
//!   assignment that fetches the fewest replicas (deterministic); transfers are computed per
//!   node (a replica that moves between two GPUs of one host is a transfer too).
//! * **Failure**: a node lost for any reason (its worker or agent died, it was fenced, it
//!   stopped heartbeating) takes its whole host: the machine fences the host's other nodes at
//!   once. A failure of one GPU is thus treated as its host failing — conservative (the other
//!   GPUs may be fine) but it keeps the invariant that hosts are whole, so placement never has
//!   to deal with a host of fewer GPUs, and it is the unit MRO was planned for.
//!
//! Why nodes with a host key rather than one node with `G` devices: every rule of the machine
//! (a step counts when every rank reported it, idleness, holdings, transfers, the dense
//! state, fencing a stuck worker) is about one worker, and the executor runs one worker per
//! registered node; a host key per node adds one string to the machine's state and two rules,
//! where a node of `G` workers would change every one of them.
//!
//! Nodes without a host (`None`), as the simulator registers them, are each a host of their
//! own: nothing changes for them. Host placement is used when some host has several nodes
//! and every host has the same number of candidate nodes; otherwise (a host only partly
//! registered, or hosts of different sizes) the machine plans per node as before and says so
//! in its log. LAER's re-layout and sharded experts are not host-aware: with hosts, a
//! rebalance uses Lazarus's replan.

use crate::migrate::{MappingMethod, MigrationPlan, PhysicalNode, map_layers, min_cost_assignment};
use crate::{
    Alignment, AllocPolicy, ClusterSpec, LayerPlacement, ModelPlan, ModelSpec, PlacePolicy,
    PlanError, ReplanError, ReplanOptions, plan_model, replan,
};

use super::NodeId;

/// Groups `ids` by host: hosts in the order of their first node in `ids`, each host's nodes
/// in the order of `ids`; a node without a host is a host of its own.
pub fn group<'a>(ids: &[NodeId], host_of: impl Fn(NodeId) -> Option<&'a str>) -> Vec<Vec<NodeId>> {
    let mut keys: Vec<Option<&str>> = Vec::new();
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    for &id in ids {
        let key = host_of(id);
        match key.and_then(|k| keys.iter().position(|x| *x == Some(k))) {
            Some(i) => groups[i].push(id),
            None => {
                keys.push(key);
                groups.push(vec![id]);
            }
        }
    }
    groups
}

/// Whether `groups` are worth planning per host: some host has several nodes and all hosts
/// have the same number.
pub fn uniform(groups: &[Vec<NodeId>]) -> bool {
    let g = groups.first().map_or(0, Vec::len);
    g > 1 && groups.iter().all(|h| h.len() == g)
}

/// Splits one host's slots (`c·G` expert ids) over its `gpus` GPUs: contiguous runs, the
/// first `slots.len() % gpus` GPUs one slot more ([`ClusterSpec::gpu_of_slot`]). Every slot
/// lands on exactly one GPU, and the split depends on nothing else.
pub fn split_host_slots(slots: &[u32], gpus: usize) -> Vec<Vec<u32>> {
    let gpus = gpus.max(1);
    let spec = ClusterSpec::new(1, slots.len().max(1)).with_gpus_per_node(gpus);
    let mut out = vec![Vec::new(); gpus];
    for (slot, &e) in slots.iter().enumerate() {
        out[spec.gpu_of_slot(slot)].push(e);
    }
    out
}

/// A host-level plan made into a node-level one: plan host `q` is the host
/// `groups[host_of_plan[q]]`, whose nodes take its slots split by [`split_host_slots`]: run
/// `k` to the host's `k`-th node, or, given what the nodes hold (`held`, an in-place replan),
/// the runs to the host's nodes by the assignment that leaves the fewest replicas to fetch
/// ([`min_cost_assignment`]; deterministic). The result has one plan node per node (`c` slots
/// each, ranks host-major, a host's ranks in the order of its runs) and its `node_map` is the
/// nodes in rank order.
fn expand<'a>(
    host_plan: &ModelPlan,
    groups: &[Vec<NodeId>],
    host_of_plan: &[usize],
    slots_per_gpu: usize,
    held: Option<&dyn Fn(NodeId) -> &'a [Vec<u32>]>,
) -> Result<ModelPlan, PlanError> {
    let gpus = groups.first().map_or(1, Vec::len);
    // `[plan host][layer][run]`
    let runs: Vec<Vec<Vec<Vec<u32>>>> = (0..host_plan.cluster.nodes)
        .map(|q| {
            host_plan
                .layers
                .iter()
                .map(|layer| split_host_slots(&layer.grid()[q], gpus))
                .collect()
        })
        .collect();
    // `[plan host][run]` = the node that takes it.
    let takers: Vec<Vec<NodeId>> = host_of_plan
        .iter()
        .zip(&runs)
        .map(|(&h, runs)| {
            let nodes = &groups[h];
            let Some(held) = held else {
                return nodes.clone();
            };
            let cost: Vec<Vec<u64>> = (0..gpus)
                .map(|k| {
                    nodes
                        .iter()
                        .map(|&n| missing(runs.iter().map(|l| &l[k][..]), held(n)))
                        .collect()
                })
                .collect();
            min_cost_assignment(&cost)
                .into_iter()
                .map(|m| nodes[m])
                .collect()
        })
        .collect();
    let node_map: Vec<NodeId> = takers.concat();
    let layers = host_plan
        .allocations
        .iter()
        .enumerate()
        .map(|(l, alloc)| {
            let grid: Vec<Vec<u32>> = runs
                .iter()
                .flat_map(|host| host[l].iter().cloned())
                .collect();
            LayerPlacement::from_grid(grid, host_plan.model.experts, Some(&alloc.replicas))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ModelPlan {
        version: host_plan.version,
        cluster: ClusterSpec::new(node_map.len(), slots_per_gpu),
        model: host_plan.model,
        alloc: host_plan.alloc,
        place: host_plan.place,
        allocations: host_plan.allocations.clone(),
        layers,
        node_map,
    })
}

/// Replicas of `need` (`[layer]` expert ids) that `have` (`[layer]`, or empty) lacks.
fn missing<'a>(need: impl Iterator<Item = &'a [u32]>, have: &[Vec<u32>]) -> u64 {
    need.enumerate()
        .map(|(l, need)| {
            let mut have: Vec<u32> = have.get(l).cloned().unwrap_or_default();
            need.iter()
                .filter(|e| match have.iter().position(|h| h == *e) {
                    Some(i) => {
                        have.swap_remove(i);
                        false
                    }
                    None => true,
                })
                .count() as u64
        })
        .sum()
}

/// A fresh plan (start or restore) over the hosts `groups` (see [`uniform`]), `slots_per_gpu`
/// slots per node: ranks host-major, `node_map` the nodes in rank order, version 0.
pub fn plan_hosts(
    groups: &[Vec<NodeId>],
    slots_per_gpu: usize,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    alloc: AllocPolicy,
    place: PlacePolicy,
) -> Result<ModelPlan, PlanError> {
    let gpus = groups.first().map_or(1, Vec::len);
    let cluster =
        ClusterSpec::new(groups.len(), slots_per_gpu * gpus).with_gpus_per_node(gpus.max(1));
    let host_plan = plan_model(&cluster, model, loads, alloc, place, Alignment::Aligned)?;
    let order: Vec<usize> = (0..groups.len()).collect();
    expand(&host_plan, groups, &order, slots_per_gpu, None)
}

/// An in-place replan over the hosts `groups` (see [`uniform`]): [`replan`] over the hosts
/// (each holding what its nodes hold), then the hosts' slots split over their nodes and the
/// transfers between nodes. `physical` holds every node of `groups` (any order).
pub fn replan_hosts(
    groups: &[Vec<NodeId>],
    physical: &[PhysicalNode],
    slots_per_gpu: usize,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    options: &ReplanOptions,
    previous_version: u64,
) -> Result<(ModelPlan, MigrationPlan), ReplanError> {
    let gpus = groups.first().map_or(1, Vec::len);
    let holdings_of = |id: NodeId| {
        physical
            .iter()
            .find(|p| p.id == id)
            .map_or(&[][..], |p| &p.holdings[..])
    };
    let hosts: Vec<PhysicalNode> = groups
        .iter()
        .enumerate()
        .map(|(h, nodes)| {
            let mut holdings: Vec<Vec<u32>> = Vec::new();
            for held in nodes.iter().map(|&id| holdings_of(id)) {
                if held.is_empty() {
                    continue;
                }
                holdings.resize(held.len().max(holdings.len()), Vec::new());
                for (l, experts) in held.iter().enumerate() {
                    holdings[l].extend_from_slice(experts);
                }
            }
            PhysicalNode {
                id: h as u32,
                holdings,
            }
        })
        .collect();
    let (host_plan, _) = replan(
        &hosts,
        slots_per_gpu * gpus,
        model,
        loads,
        options,
        previous_version,
    )?;
    let host_of_plan: Vec<usize> = host_plan.node_map.iter().map(|&h| h as usize).collect();
    let plan = expand(
        &host_plan,
        groups,
        &host_of_plan,
        slots_per_gpu,
        Some(&holdings_of),
    )?;
    // Plan node `i` is node `plan.node_map[i]`: the identity mapping gives the node-level
    // transfers (and says which expert was lost, should one be).
    let nodes: Vec<PhysicalNode> = plan
        .node_map
        .iter()
        .map(|&id| PhysicalNode {
            id,
            holdings: holdings_of(id).to_vec(),
        })
        .collect();
    let migration = map_layers(
        &plan.layers,
        &nodes,
        model.experts,
        MappingMethod::Identity,
        options.bytes_per_expert,
    )?;
    Ok((plan, migration))
}

/// The host index (into `groups`) of every rank of `plan`, for checks.
pub fn host_of_rank(plan: &ModelPlan, groups: &[Vec<NodeId>]) -> Vec<usize> {
    plan.node_map
        .iter()
        .map(|id| {
            groups
                .iter()
                .position(|g| g.contains(id))
                .unwrap_or(usize::MAX)
        })
        .collect()
}
