//! Hosts in the job machine ([`lazarus_planner::job::hosts`]): placement per host, the split
//! of a host's slots over its GPUs, and a host that fails whole.

use std::collections::BTreeSet;

use lazarus_planner::job::hosts::{group, host_of_rank, plan_hosts, split_host_slots};
use lazarus_planner::job::{
    Action, Event, IdleReason, JobConfig, JobMachine, NodeId, ReconfigKind, Reconfiguration,
    StateSource, StepReport,
};
use lazarus_planner::{AllocPolicy, ModelPlan, ModelSpec, PlacePolicy};
use proptest::prelude::*;

/// `hosts` × `gpus` node ids, host-major: node `h·gpus + g` is GPU `g` of host `h`.
fn groups(hosts: usize, gpus: usize) -> Vec<Vec<NodeId>> {
    (0..hosts)
        .map(|h| (0..gpus).map(|g| (h * gpus + g) as NodeId).collect())
        .collect()
}

/// The distinct hosts holding each expert, per layer.
fn hosts_per_expert(plan: &ModelPlan, groups: &[Vec<NodeId>]) -> Vec<Vec<usize>> {
    let host = host_of_rank(plan, groups);
    plan.layers
        .iter()
        .map(|layer| {
            let mut sets = vec![BTreeSet::new(); plan.model.experts];
            for (rank, slots) in layer.grid().iter().enumerate() {
                for &e in slots {
                    sets[e as usize].insert(host[rank]);
                }
            }
            sets.iter().map(BTreeSet::len).collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// With slots for `f` replicas of every expert, every expert's replicas are on at least
    /// `min(f, hosts)` distinct hosts,
    /// every node gets `c` slots, and the ranks of one host are consecutive.
    #[test]
    fn replicas_of_every_expert_land_on_distinct_hosts(
        hosts in 1usize..7,
        gpus in 1usize..5,
        c in 1usize..4,
        f in 1usize..4,
        layers in 1usize..3,
        experts_frac in 0.0f64..1.0,
        loads in proptest::collection::vec(1u64..1_000, 64),
    ) {
        let slots = hosts * gpus * c;
        let experts = 1 + ((slots - 1) as f64 * experts_frac) as usize;
        // Eq. 1 gives every expert f replicas only when the slots allow it.
        prop_assume!(slots >= f * experts);
        let model = ModelSpec { experts, layers, f };
        let loads: Vec<Vec<u64>> = (0..layers)
            .map(|l| (0..experts).map(|e| loads[(l * 31 + e) % loads.len()]).collect())
            .collect();
        let g = groups(hosts, gpus);
        let plan = plan_hosts(&g, c, &model, &loads, AllocPolicy::Lazarus, PlacePolicy::Mro)
            .unwrap();
        prop_assert_eq!(plan.node_map.len(), hosts * gpus);
        prop_assert_eq!(&plan.node_map, &g.concat());
        for layer in &plan.layers {
            prop_assert!(layer.grid().iter().all(|s| s.len() == c));
        }
        for (l, per_expert) in hosts_per_expert(&plan, &g).iter().enumerate() {
            for (e, &distinct) in per_expert.iter().enumerate() {
                let r = plan.allocations[l].replicas[e];
                prop_assert!(r >= f);
                prop_assert!(
                    distinct >= f.min(hosts),
                    "layer {l} expert {e}: {r} replicas on {distinct} hosts (f {f}, {hosts} hosts)"
                );
            }
        }
    }

    /// The split of a host's slots is a function of the slots alone and puts every slot on
    /// exactly one GPU, in order, `c` per GPU when `c·G` slots are split.
    #[test]
    fn the_split_of_host_slots_is_deterministic_and_covers_every_slot(
        mut slots in proptest::collection::vec(0u32..20, 1..40),
        gpus in 1usize..9,
    ) {
        slots.sort_unstable();
        let a = split_host_slots(&slots, gpus);
        prop_assert_eq!(&a, &split_host_slots(&slots, gpus));
        prop_assert_eq!(a.len(), gpus);
        prop_assert_eq!(a.concat(), slots.clone());
        let sizes: Vec<usize> = a.iter().map(Vec::len).collect();
        let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        prop_assert!(hi - lo <= 1, "uneven split {sizes:?}");
        if slots.len() % gpus == 0 {
            prop_assert!(sizes.iter().all(|&s| s == slots.len() / gpus));
        }
    }
}

#[test]
fn nodes_are_grouped_by_host_in_order_and_hostless_nodes_are_their_own_host() {
    let host = |id: NodeId| match id {
        0 | 3 => Some("a"),
        1 | 4 => Some("b"),
        _ => None,
    };
    assert_eq!(
        group(&[0, 1, 2, 3, 4, 5], host),
        vec![vec![0, 3], vec![1, 4], vec![2], vec![5]]
    );
}

/// 4 experts × 2 layers, f = 2, 2 slots per GPU: 3 hosts × 2 GPUs hold 12 replicas per layer.
fn config(steps: u64) -> JobConfig {
    let model = ModelSpec {
        experts: 4,
        layers: 2,
        f: 2,
    };
    let mut cfg = JobConfig::new(model, 2, steps);
    cfg.initial_nodes = 6;
    cfg.heartbeat_timeout_ms = 1_000;
    cfg.member_timeout_ms = 5_000;
    cfg.checkpoint_every_steps = 5;
    cfg
}

struct Job {
    m: JobMachine,
    now_ms: u64,
}

impl Job {
    fn ev(&mut self, ev: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.m.handle(self.now_ms, ev, &mut out);
        self.m.check_invariants().unwrap();
        out
    }

    fn step_all(&mut self, step: u64) {
        let epoch = self.m.epoch();
        for m in self.m.members().to_vec() {
            self.ev(Event::Stepped {
                node: m,
                epoch,
                step,
                report: StepReport {
                    loss: 2.0,
                    tokens: 8,
                    step_ms: 1.0,
                    ..StepReport::default()
                },
            });
        }
    }

    fn migrated_all(&mut self, r: &Reconfiguration) {
        for &m in r.members() {
            self.ev(Event::Migrated {
                node: m,
                epoch: r.epoch,
                bytes_in: 0,
            });
        }
    }

    fn held(&self, node: NodeId) -> Vec<Vec<u32>> {
        let plan = self.m.plan().unwrap();
        let q = plan.node_map.iter().position(|&n| n == node).unwrap();
        plan.plan_node_contents()[q].clone()
    }
}

fn reconfig(actions: &[Action]) -> Option<Reconfiguration> {
    actions.iter().find_map(|a| match a {
        Action::Reconfigure(r) => Some((**r).clone()),
        _ => None,
    })
}

/// Starts 3 hosts × 2 GPUs (nodes `2h + g`, named `h{h}-gpu{g}`), trains 3 steps.
fn started() -> (Job, Reconfiguration) {
    let mut j = Job {
        m: JobMachine::new(config(10)).unwrap(),
        now_ms: 0,
    };
    // Registration order is not rank order: the ranks follow the names, host-major.
    for node in [5, 0, 3, 1, 2, 4] {
        j.ev(Event::Joined {
            node,
            name: format!("h{}-gpu{}", node / 2, node % 2),
            host: Some(format!("h{}", node / 2)),
        });
    }
    let mut a = Vec::new();
    for node in 0..6 {
        a.extend(j.ev(Event::Ready { node }));
    }
    let r = reconfig(&a).expect("the first plan");
    j.migrated_all(&r);
    for s in 0..3 {
        j.step_all(s);
    }
    (j, r)
}

#[test]
fn the_first_plan_places_per_host_with_host_major_ranks() {
    let (_, r) = started();
    assert_eq!(r.kind, ReconfigKind::Start);
    assert_eq!(r.members(), &[0, 1, 2, 3, 4, 5]);
    let g = groups(3, 2);
    for per_expert in hosts_per_expert(&r.plan, &g) {
        assert!(per_expert.iter().all(|&h| h >= 2), "{per_expert:?}");
    }
}

#[test]
fn a_host_failure_fences_its_other_gpus_and_recovers_in_place() {
    let (mut j, _) = started();
    j.now_ms = 100;
    // GPU 0 of host h1 dies: its sibling (node 3) is fenced, the other hosts abort.
    let a = j.ev(Event::Lost {
        node: 2,
        reason: "killed".into(),
    });
    let fenced: Vec<NodeId> = a
        .iter()
        .filter_map(|a| match a {
            Action::Fence { node, reason } => {
                assert!(reason.contains("host h1"), "{reason}");
                Some(*node)
            }
            _ => None,
        })
        .collect();
    assert_eq!(fenced, vec![3]);
    for n in [0, 1, 4, 5] {
        assert!(a.contains(&Action::Abort { node: n, epoch: 1 }), "{a:?}");
    }
    assert!(!a.iter().any(|a| matches!(a, Action::Abort { node: 3, .. })));
    j.now_ms = 110;
    let mut a = Vec::new();
    let mut before = std::collections::BTreeMap::new();
    for n in [0, 1, 4, 5] {
        let held = j.held(n);
        before.insert(n, held.clone());
        let epoch = j.m.epoch();
        a.extend(j.ev(Event::Idle {
            node: n,
            epoch,
            why: IdleReason::Failed("peer".into()),
            step: 3,
            held: held.into(),
        }));
    }
    assert!(!a.contains(&Action::FindCheckpoint), "{a:?}");
    let r = reconfig(&a).expect("an in-place replan");
    assert_eq!(r.kind, ReconfigKind::InPlace);
    assert_eq!(
        r.members().iter().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([0, 1, 4, 5])
    );
    assert!(matches!(r.source, StateSource::Peers { .. }));
    // The survivors' ranks stay host-major and every expert is on both surviving hosts.
    let hosts_left = vec![vec![0, 1], vec![4, 5]];
    let host = host_of_rank(&r.plan, &hosts_left);
    assert!(host[0] == host[1] && host[2] == host[3] && host[0] != host[2]);
    for per_expert in hosts_per_expert(&r.plan, &hosts_left) {
        assert!(per_expert.iter().all(|&h| h == 2), "{per_expert:?}");
    }
    // Every transfer's source holds the expert.
    for t in &r.transfers {
        let src = r.members()[t.src_rank];
        assert!(before[&src][t.layer].contains(&(t.expert as u32)), "{t:?}");
    }
    j.migrated_all(&r);
    j.step_all(3);
    assert_eq!(j.m.next_step(), 4);
}

#[test]
fn nodes_without_a_host_are_planned_per_node_as_before() {
    let mut j = Job {
        m: JobMachine::new(config(10)).unwrap(),
        now_ms: 0,
    };
    let mut a = Vec::new();
    for node in 0..6 {
        j.ev(Event::Joined {
            node,
            name: format!("n{node}"),
            host: None,
        });
    }
    for node in 0..6 {
        a.extend(j.ev(Event::Ready { node }));
    }
    let r = reconfig(&a).unwrap();
    // A loss takes only that node.
    let a = j.ev(Event::Lost {
        node: 2,
        reason: "killed".into(),
    });
    assert!(!a.iter().any(|a| matches!(a, Action::Fence { .. })));
    assert_eq!(r.members().len(), 6);
}

#[test]
fn hosts_of_unequal_sizes_are_planned_per_node_and_say_so() {
    let mut cfg = config(10);
    cfg.initial_nodes = 3;
    let mut j = Job {
        m: JobMachine::new(cfg).unwrap(),
        now_ms: 0,
    };
    // Host a has two nodes, host b one (its second GPU never registered).
    for (node, host) in [(0, "a"), (1, "a"), (2, "b")] {
        j.ev(Event::Joined {
            node,
            name: format!("{host}-gpu{node}"),
            host: Some(host.into()),
        });
    }
    let mut a = Vec::new();
    for node in 0..3 {
        a.extend(j.ev(Event::Ready { node }));
    }
    let r = reconfig(&a).expect("the first plan");
    assert_eq!(r.members(), &[0, 1, 2]);
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Log(l) if l.contains("hosts of unequal sizes [2, 1]")))
    );
    // A node lost still takes its host.
    j.migrated_all(&r);
    let a = j.ev(Event::Lost {
        node: 1,
        reason: "killed".into(),
    });
    assert!(a.contains(&Action::Fence {
        node: 0,
        reason: "its host a failed with node a-gpu1".into()
    }));
}

/// Why placement is per host: MRO over the 4 GPUs of 2 hosts (8 experts, f = 2, 4 slots per
/// GPU) puts both replicas of every expert on the two GPUs of one host, so either host's
/// failure loses experts; placed per host, every expert is on both hosts.
#[test]
fn per_gpu_placement_can_confine_an_expert_to_one_host_and_per_host_placement_does_not() {
    let model = ModelSpec {
        experts: 8,
        layers: 1,
        f: 2,
    };
    let loads = vec![vec![1; 8]];
    let g = groups(2, 2);
    let mut per_gpu = lazarus_planner::plan_model(
        &lazarus_planner::ClusterSpec::new(4, 4),
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        lazarus_planner::Alignment::Aligned,
    )
    .unwrap();
    per_gpu.node_map = g.concat();
    assert!(hosts_per_expert(&per_gpu, &g)[0].contains(&1));
    let per_host = plan_hosts(
        &g,
        4,
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
    )
    .unwrap();
    assert!(hosts_per_expert(&per_host, &g)[0].iter().all(|&h| h == 2));
}

/// An in-place replan gives a host's runs of slots to the host's GPUs that already hold them:
/// GPUs whose holdings were swapped get them swapped back, and nothing moves.
#[test]
fn a_replan_gives_each_gpu_the_run_it_already_holds() {
    use lazarus_planner::ReplanOptions;
    use lazarus_planner::migrate::{MappingMethod, PhysicalNode};
    let model = ModelSpec {
        experts: 8,
        layers: 2,
        f: 2,
    };
    let loads = vec![vec![1; 8]; 2];
    let g = groups(2, 2);
    let plan = plan_hosts(
        &g,
        4,
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
    )
    .unwrap();
    let contents = plan.plan_node_contents();
    // Node 0 holds what rank 1 was given and node 1 what rank 0 was; host 1 as planned.
    let physical: Vec<PhysicalNode> = [(0, 1), (1, 0), (2, 2), (3, 3)]
        .into_iter()
        .map(|(id, rank)| PhysicalNode {
            id,
            holdings: contents[rank].clone(),
        })
        .collect();
    let options = ReplanOptions {
        alloc: AllocPolicy::Lazarus,
        place: PlacePolicy::Mro,
        mapping: MappingMethod::Optimal,
        bytes_per_expert: 1,
    };
    let (next, migration) =
        lazarus_planner::job::hosts::replan_hosts(&g, &physical, 4, &model, &loads, &options, 1)
            .unwrap();
    assert!(migration.transfers.is_empty(), "{:?}", migration.transfers);
    assert_eq!(next.version, 2);
    let host = host_of_rank(&next, &g);
    assert!(host[0] == host[1] && host[2] == host[3] && host[0] != host[2]);
}
