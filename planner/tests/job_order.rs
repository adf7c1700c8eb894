//! Issue 33 item 5: the plans of a job depend on its membership and inputs, never on the
//! order its nodes registered in (the ids a driver gave them). `lzrun`'s controller numbers
//! nodes as they register, `lzsim predict` as the run launched them; the same run must get
//! the same plans from both.

use lazarus_planner::ModelSpec;
use lazarus_planner::job::{
    Action, Event, Holdings, IdleReason, JobConfig, JobMachine, NodeId, ReconfigKind, StepReport,
};
use std::collections::BTreeMap;

/// What the job does next, in the scenario's terms.
#[derive(Clone, Copy)]
enum Do {
    Kill(&'static [&'static str]),
    Join(&'static [&'static str]),
}

/// A reconfiguration with nodes named, not numbered: kind, members in rank order, every
/// layer's replicas per member, and the transfers.
type Named = (
    ReconfigKind,
    Vec<String>,
    Vec<Vec<Vec<u32>>>,
    Vec<(usize, usize, usize, usize)>,
);

/// Runs the held-out run of issue 33 item 5 (5 nodes, 80 steps, checkpoints every 10; kill
/// n2 after 13, n0 and n3 after 29, a join after 41, kill n4 after 55), with two nodes
/// joining after 41, on the job machine with the nodes registered in `order` and the
/// newcomers in `joins`; skewed routing depending on the step only. Returns every
/// reconfiguration and the steps counted.
fn run(order: &[&str], joins: &'static [&'static str]) -> (Vec<Named>, u64) {
    let model = ModelSpec {
        experts: 4,
        layers: 2,
        f: 2,
    };
    let mut cfg = JobConfig::new(model, 2, 80);
    cfg.initial_nodes = 5;
    cfg.checkpoint_every_steps = 10;
    cfg.heartbeat_timeout_ms = u64::MAX / 4;
    cfg.member_timeout_ms = u64::MAX / 4;
    let mut m = JobMachine::new(cfg).unwrap();
    let mut ids: BTreeMap<String, NodeId> = BTreeMap::new();
    let mut names: BTreeMap<NodeId, String> = BTreeMap::new();
    let mut next_id: NodeId = 0;
    let mut reconfigs: Vec<Named> = Vec::new();
    let mut committed = 0u64;
    let mut now = 0u64;

    // Feeds `ev`, answers checkpoint commits and look-ups, applies reconfigurations.
    fn feed(
        m: &mut JobMachine,
        now: u64,
        ev: Event,
        names: &BTreeMap<NodeId, String>,
        reconfigs: &mut Vec<Named>,
        committed: &mut u64,
    ) {
        let mut queue = vec![ev];
        while let Some(ev) = queue.pop() {
            let mut out = Vec::new();
            m.handle(now, ev, &mut out);
            for a in out {
                match a {
                    Action::CommitCheckpoint { step, .. } => {
                        *committed = step;
                        queue.push(Event::CheckpointCommitted { step });
                    }
                    Action::FindCheckpoint => queue.push(Event::CheckpointFound {
                        step: *committed,
                        data_cursor: None,
                    }),
                    Action::Reconfigure(r) => {
                        let members: Vec<String> =
                            r.members().iter().map(|id| names[id].clone()).collect();
                        let transfers = r
                            .transfers
                            .iter()
                            .map(|t| (t.layer, t.expert, t.src_rank, t.dst_rank))
                            .collect();
                        reconfigs.push((r.kind, members, r.replicas_per_member(), transfers));
                        for &node in r.members() {
                            queue.push(Event::Migrated {
                                node,
                                epoch: r.epoch,
                                bytes_in: 0,
                            });
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    let mut join = |name: &str,
                    m: &mut JobMachine,
                    ids: &mut BTreeMap<String, NodeId>,
                    names: &mut BTreeMap<NodeId, String>,
                    now: u64,
                    reconfigs: &mut Vec<Named>,
                    committed: &mut u64| {
        let id = next_id;
        next_id += 1;
        ids.insert(name.to_string(), id);
        names.insert(id, name.to_string());
        let joined = Event::Joined {
            node: id,
            name: name.to_string(),
            host: None,
        };
        feed(m, now, joined, names, reconfigs, committed);
        feed(
            m,
            now,
            Event::Ready { node: id },
            names,
            reconfigs,
            committed,
        );
    };
    for name in order {
        join(
            name,
            &mut m,
            &mut ids,
            &mut names,
            now,
            &mut reconfigs,
            &mut committed,
        );
    }
    let schedule: BTreeMap<u64, Do> = [
        (13, Do::Kill(&["n2"])),
        (29, Do::Kill(&["n0", "n3"])),
        (41, Do::Join(joins)),
        (55, Do::Kill(&["n4"])),
    ]
    .into_iter()
    .collect();
    let mut fired = BTreeMap::new();
    let mut guard = 0;
    while m.next_step() < 80 {
        guard += 1;
        assert!(guard < 1000, "the job does not progress");
        now += 10;
        let step = m.next_step();
        let epoch = m.epoch();
        // Every member trains the step; a routing that depends on the step, skewed.
        let members = m.members().to_vec();
        for &node in &members {
            let routing = (0..2u64)
                .map(|l| (0..4u64).map(|e| 1 + (e + l + step) % 4 * 10).collect())
                .collect();
            let report = StepReport {
                loss: 1.0,
                tokens: 8,
                step_ms: 1.0,
                routing,
                ..StepReport::default()
            };
            let ev = Event::Stepped {
                node,
                epoch,
                step,
                report,
            };
            feed(&mut m, now, ev, &names, &mut reconfigs, &mut committed);
        }
        if m.next_step() == step + 1 && (step + 1).is_multiple_of(10) {
            for &node in &members {
                let ev = Event::CheckpointWritten {
                    node,
                    epoch,
                    step: step + 1,
                };
                feed(&mut m, now, ev, &names, &mut reconfigs, &mut committed);
            }
        }
        let Some(&what) = schedule.get(&step).filter(|_| !fired.contains_key(&step)) else {
            continue;
        };
        fired.insert(step, ());
        let version = m.plan().unwrap().version;
        match what {
            Do::Kill(dead) => {
                for d in dead {
                    let ev = Event::Lost {
                        node: ids[*d],
                        reason: "killed".into(),
                    };
                    feed(&mut m, now, ev, &names, &mut reconfigs, &mut committed);
                }
                let epoch = m.epoch();
                for node in m.members().to_vec() {
                    if dead.iter().any(|d| ids[*d] == node) {
                        continue;
                    }
                    let ev = Event::Idle {
                        node,
                        epoch,
                        why: IdleReason::Failed("a peer is gone".into()),
                        step: step + 1,
                        held: Holdings::Planned { version },
                    };
                    feed(&mut m, now, ev, &names, &mut reconfigs, &mut committed);
                }
            }
            Do::Join(newcomers) => {
                for name in newcomers {
                    join(
                        name,
                        &mut m,
                        &mut ids,
                        &mut names,
                        now,
                        &mut reconfigs,
                        &mut committed,
                    );
                }
                let epoch = m.epoch();
                for node in m.members().to_vec() {
                    let ev = Event::Idle {
                        node,
                        epoch,
                        why: IdleReason::Paused,
                        step: step + 1,
                        held: Holdings::Planned { version },
                    };
                    feed(&mut m, now, ev, &names, &mut reconfigs, &mut committed);
                }
            }
        }
    }
    (reconfigs, m.next_step())
}

#[test]
fn plans_do_not_depend_on_the_registration_order() {
    let by_name = run(&["n0", "n1", "n2", "n3", "n4"], &["n5", "n10"]);
    let kinds: Vec<ReconfigKind> = by_name.0.iter().map(|r| r.0).collect();
    assert_eq!(by_name.1, 80);
    assert!(kinds.len() >= 4, "{kinds:?}");
    for (order, joins) in [
        (["n0", "n1", "n2", "n4", "n3"], &["n5", "n10"][..]),
        (["n4", "n3", "n2", "n1", "n0"], &["n10", "n5"]),
        (["n2", "n0", "n4", "n1", "n3"], &["n10", "n5"]),
    ] {
        let joins: &'static [&'static str] = if joins[0] == "n5" {
            &["n5", "n10"]
        } else {
            &["n10", "n5"]
        };
        let other = run(&order, joins);
        assert_eq!(other.1, by_name.1, "registered {order:?} {joins:?}");
        for (i, (a, b)) in by_name.0.iter().zip(&other.0).enumerate() {
            assert_eq!(
                a, b,
                "reconfiguration {i} differs when registered {order:?} then {joins:?}"
            );
        }
        assert_eq!(other.0.len(), by_name.0.len(), "registered {order:?}");
    }
}
