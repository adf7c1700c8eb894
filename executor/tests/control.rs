//! Control plane: the controller's state machine, the wire protocol, and controller + agents
//! on loopback under paused tokio time (instant and deterministic).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use lazarus_executor::control::proto::{self, ProtoError};
use lazarus_executor::control::{
    Agent, AgentConfig, AgentError, AgentExit, ControllerConfig, ControllerState, PROTOCOL_VERSION,
    PlanMsg, Reject, StepCounts, ToAgent, ToController, run_controller,
};
use lazarus_planner::Aggregation;
use proptest::prelude::*;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const TOKEN: &str = "cluster-secret";
const V: u16 = PROTOCOL_VERSION;

fn config(experts: usize, layers: usize, slots: usize) -> ControllerConfig {
    let mut c = ControllerConfig::new(TOKEN, experts, layers, slots);
    c.heartbeat_timeout_ms = 1_000;
    c.tick_ms = 100;
    c.scale_out_wait_ms = 5_000;
    c.bytes_per_expert = 1 << 20;
    c.aggregation = Aggregation::Sum { window_steps: 10 };
    c
}

/// Registers `n` nodes at time 0 and returns their ids.
fn register_all(s: &mut ControllerState, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| s.register(V, TOKEN, &format!("node{i}"), 1, 0).unwrap())
        .collect()
}

/// `[layer][expert]` → number of replicas in the plan.
fn replica_counts(plan: &PlanMsg, layers: usize, experts: usize) -> Vec<Vec<usize>> {
    let mut r = vec![vec![0; experts]; layers];
    for (_, holdings) in &plan.assignment {
        for (l, ids) in holdings.iter().enumerate() {
            for &e in ids {
                r[l][e as usize] += 1;
            }
        }
    }
    r
}

fn holdings(plan: &PlanMsg) -> BTreeMap<u32, Vec<Vec<u32>>> {
    plan.assignment.iter().cloned().collect()
}

/// Every expert a member needs under `new` is either already held (under `old`) or fetched by
/// a transfer from a node that holds it under `old`.
fn assert_transfers_complete(old: &PlanMsg, new: &PlanMsg) {
    let before = holdings(old);
    for (node, need) in &new.assignment {
        for (l, ids) in need.iter().enumerate() {
            for &e in ids.iter().collect::<BTreeSet<_>>() {
                let had = before.get(node).is_some_and(|h| h[l].contains(&e));
                let fetched = new
                    .transfers
                    .iter()
                    .find(|t| (t.0, t.1, t.3) == (l as u32, e, *node));
                match fetched {
                    Some(&(_, _, src, _)) => {
                        assert!(!had, "node {node} fetches ({l}, {e}) it already holds");
                        assert!(
                            before[&src][l].contains(&e),
                            "source {src} lacks ({l}, {e})"
                        );
                    }
                    None => assert!(
                        had,
                        "node {node} needs ({l}, {e}) but neither has nor fetches it"
                    ),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// State machine
// ---------------------------------------------------------------------------------------------

#[test]
fn registration_checks_token_version_devices_and_names() {
    let mut s = ControllerState::new(config(8, 2, 4)).unwrap();
    assert_eq!(s.register(V, "wrong", "a", 1, 0), Err(Reject::BadToken));
    assert_eq!(s.register(V, "", "a", 1, 0), Err(Reject::BadToken));
    assert_eq!(
        s.register(V + 1, TOKEN, "a", 1, 0),
        Err(Reject::Version {
            agent: V + 1,
            controller: V
        })
    );
    assert_eq!(
        s.register(V, TOKEN, "a", 0, 0),
        Err(Reject::NoDevices("a".into()))
    );
    let a = s.register(V, TOKEN, "a", 2, 0).unwrap();
    assert_eq!(
        s.register(V, TOKEN, "a", 1, 0),
        Err(Reject::DuplicateName("a".into()))
    );
    assert_eq!(s.node_info(a), Some(("a", 2)));
    let reason = Reject::Version {
        agent: 9,
        controller: 1,
    }
    .to_string();
    assert!(reason.contains("v9") && reason.contains("v1"), "{reason}");
    // Once the old incarnation expired, the name is free again, with a fresh id.
    assert_eq!(s.expire(1_001), vec![a]);
    let again = s.register(V, TOKEN, "a", 2, 1_001).unwrap();
    assert_ne!(again, a);
    assert_eq!(s.live_nodes(), vec![again]);
}

#[test]
fn heartbeat_expiry_boundary_is_exactly_the_timeout() {
    let mut s = ControllerState::new(config(8, 2, 4)).unwrap();
    let ids = register_all(&mut s, 2);
    // Registration counts as a heartbeat: alive at exactly the timeout, dead 1 ms later.
    assert_eq!(s.expire(1_000), Vec::<u32>::new());
    assert!(s.heartbeat(ids[1], 1_000));
    assert_eq!(s.expire(1_001), vec![ids[0]]);
    assert_eq!(s.expire(2_000), Vec::<u32>::new());
    assert_eq!(s.expire(2_001), vec![ids[1]]);
    // Expired nodes are fenced: their heartbeats are refused.
    assert!(!s.heartbeat(ids[0], 2_001));
    assert!(s.live_nodes().is_empty());
}

#[test]
fn first_plan_gives_every_expert_f_replicas_and_versions_increase() {
    let (experts, layers, slots) = (8, 2, 4);
    let mut cfg = config(experts, layers, slots);
    cfg.initial_nodes = 5;
    let mut s = ControllerState::new(cfg).unwrap();
    let ids = register_all(&mut s, 4);
    assert_eq!(s.replan(0), None, "waits for initial_nodes");
    ids.iter().for_each(|&id| assert!(s.heartbeat(id, 10)));
    ids.iter().take(2).for_each(|&id| {
        // Skewed loads: expert 7 popular in layer 0, expert 0 in layer 1.
        let counts = vec![vec![1, 1, 1, 1, 1, 1, 1, 50], vec![40, 1, 1, 1, 1, 1, 1, 1]];
        s.record_routing(id, 0, &counts).unwrap();
    });
    let last = s.register(V, TOKEN, "node4", 1, 10).unwrap();
    s.record_routing(ids[2], 0, &[vec![0; 8], vec![0; 8]])
        .unwrap();
    s.record_routing(ids[3], 0, &[vec![0; 8], vec![0; 8]])
        .unwrap();
    s.record_routing(last, 0, &[vec![0; 8], vec![0; 8]])
        .unwrap();
    assert_eq!(s.steps_aggregated(), 1);

    let v1 = s.replan(10).expect("5 nodes registered");
    assert_eq!(v1.version, 1);
    assert_eq!(v1.members, s.live_nodes());
    assert!(!v1.restore_from_checkpoint);
    assert!(v1.transfers.is_empty());
    let r = replica_counts(&v1, layers, experts);
    for (l, layer) in r.iter().enumerate() {
        assert_eq!(layer.iter().sum::<usize>(), 5 * slots);
        assert!(layer.iter().all(|&x| x >= 2), "layer {l}: {layer:?}");
    }
    assert!(
        r[0][7] > r[0][0] && r[1][0] > r[1][7],
        "loads drive allocation: {r:?}"
    );
    assert_eq!(s.replan(20), None, "nothing changed");

    s.request_rebalance();
    let v2 = s.replan(30).expect("rebalance requested");
    assert_eq!(v2.version, 2);
    assert_transfers_complete(&v1, &v2);
    let others: Vec<u32> = s.live_nodes().into_iter().filter(|&i| i != last).collect();
    others
        .iter()
        .for_each(|&id| assert!(s.heartbeat(id, 1_500)));
    assert_eq!(s.expire(1_500), vec![last]);
    let v3 = s.replan(1_500).expect("a member died");
    assert_eq!(v3.version, 3);
}

#[test]
fn one_failure_replans_with_transfers_from_survivors() {
    // 5 nodes x 6 slots: MRO leaves several experts on a strict subset of the nodes, so
    // losing some node forces re-replication. Every choice of victim is checked.
    let (experts, layers, slots) = (8, 2, 6);
    let mut cfg = config(experts, layers, slots);
    cfg.initial_nodes = 5;
    let mut start = ControllerState::new(cfg).unwrap();
    let ids = register_all(&mut start, 5);
    let v1 = start.replan(0).unwrap();
    let mut moved = 0;
    for &dead in &ids {
        let mut s = start.clone();
        for &id in ids.iter().filter(|&&i| i != dead) {
            assert!(s.heartbeat(id, 900));
        }
        assert_eq!(s.expire(1_001), vec![dead]);
        let v2 = s.replan(1_001).expect("a member died: replan at once");
        assert_eq!(v2.version, v1.version + 1);
        assert!(!v2.restore_from_checkpoint);
        let survivors: BTreeSet<u32> = ids.iter().copied().filter(|&i| i != dead).collect();
        assert_eq!(
            v2.members.iter().copied().collect::<BTreeSet<_>>(),
            survivors
        );
        for &(l, e, src, dst) in &v2.transfers {
            assert!(
                survivors.contains(&src) && survivors.contains(&dst),
                "({l},{e}) {src}->{dst}"
            );
            assert_ne!(src, dst);
        }
        assert_transfers_complete(&v1, &v2);
        let r = replica_counts(&v2, layers, experts);
        assert!(
            r.iter().flatten().all(|&x| x >= 2),
            "24 slots still hold f = 2: {r:?}"
        );
        let migration = s.last_migration().expect("a migration plan");
        assert_eq!(migration.new_replicas as usize, v2.transfers.len());
        assert_eq!(migration.bytes, v2.transfers.len() as u64 * (1 << 20));
        moved += v2.transfers.len();
    }
    assert!(moved > 0, "some failure re-replicates experts");
}

#[test]
fn losing_every_holder_of_an_expert_restores_from_checkpoint() {
    // 4 nodes x 4 slots = 16 = 8 experts x f: every expert has exactly two replicas, and MRO
    // puts each group of 4 experts on a block of 2 nodes.
    let (experts, layers, slots) = (8, 2, 4);
    let mut cfg = config(experts, layers, slots);
    cfg.initial_nodes = 4;
    let mut s = ControllerState::new(cfg).unwrap();
    register_all(&mut s, 4);
    let v1 = s.replan(0).unwrap();
    let holders = |e: u32| -> BTreeSet<u32> {
        v1.assignment
            .iter()
            .filter(|(_, h)| h.iter().any(|ids| ids.contains(&e)))
            .map(|(id, _)| *id)
            .collect()
    };
    let doomed = (0..experts as u32)
        .map(holders)
        .min_by_key(BTreeSet::len)
        .unwrap();
    assert!(
        doomed.len() < 4,
        "some expert lives on a strict subset: {doomed:?}"
    );
    for id in s.live_nodes() {
        if !doomed.contains(&id) {
            assert!(s.heartbeat(id, 1_000));
        }
    }
    assert_eq!(s.expire(1_001), doomed.iter().copied().collect::<Vec<_>>());
    let v2 = s
        .replan(1_001)
        .expect("survivors can hold every expert once");
    assert!(v2.restore_from_checkpoint);
    assert!(v2.transfers.is_empty());
    assert_eq!(v2.version, 2);
    assert_eq!(v2.members, s.live_nodes());
    let r = replica_counts(&v2, layers, experts);
    assert!(r.iter().flatten().all(|&x| x >= 1), "{r:?}");
    assert_eq!(s.last_migration(), None);
}

#[test]
fn scale_out_is_lazy_but_failures_are_not() {
    let mut s = ControllerState::new(config(4, 1, 4)).unwrap();
    let a = s.register(V, TOKEN, "a", 1, 0).unwrap();
    let v1 = s.replan(0).expect("initial_nodes = 1");
    assert_eq!(v1.members, vec![a]);
    let b = s.register(V, TOKEN, "b", 1, 100).unwrap();
    s.heartbeat(a, 3_000);
    let c = s.register(V, TOKEN, "c", 1, 3_000).unwrap();
    assert_eq!(s.replan(3_000), None);
    assert_eq!(
        s.replan(5_099),
        None,
        "the window runs from the first newcomer (t = 100)"
    );
    s.heartbeat(a, 5_100);
    s.heartbeat(c, 5_100);
    assert_eq!(s.expire(5_100), vec![b], "b died while waiting");
    let v2 = s.replan(5_100).expect("c waited long enough");
    assert_eq!(v2.version, 2);
    assert_eq!(v2.members, vec![a, c]);
    assert!(!v2.transfers.is_empty());
    assert!(v2.transfers.iter().all(|t| t.2 == a && t.3 == c));
    assert_transfers_complete(&v1, &v2);

    // A newcomer is pending, then a member dies: the replan is immediate and includes it.
    let d = s.register(V, TOKEN, "d", 1, 6_000).unwrap();
    s.heartbeat(a, 6_500);
    s.heartbeat(d, 6_500);
    assert_eq!(s.expire(6_500), vec![c]);
    let v3 = s.replan(6_500).expect("a member died");
    assert_eq!(v3.members, vec![a, d]);
    assert!(!v3.restore_from_checkpoint);
    assert!(v3.transfers.iter().all(|t| t.2 == a && t.3 == d));
    assert_transfers_complete(&v2, &v3);
}

// ---------------------------------------------------------------------------------------------
// Protocol
// ---------------------------------------------------------------------------------------------

#[test]
fn protocol_round_trips() {
    let to_controller = [
        ToController::Register {
            version: V,
            token: TOKEN.into(),
            node: "gpu-17".into(),
            devices: 8,
        },
        ToController::Heartbeat {
            node_id: 3,
            step: u64::MAX,
        },
        ToController::RoutingStats {
            node_id: 3,
            step: 42,
            counts: vec![vec![0, 1, u64::MAX], vec![]],
        },
        ToController::Bye { node_id: 0 },
    ];
    for msg in &to_controller {
        let bytes = proto::encode(msg).unwrap();
        assert_eq!(&proto::decode::<ToController>(&bytes).unwrap(), msg);
    }
    let plan = PlanMsg {
        version: 7,
        members: vec![4, 1],
        assignment: vec![(4, vec![vec![0, 0, 1]]), (1, vec![vec![2, 3, 3]])],
        transfers: vec![(0, 3, 1, 4)],
        restore_from_checkpoint: true,
    };
    let to_agent = [
        ToAgent::Registered { node_id: 9 },
        ToAgent::Rejected {
            reason: "wrong cluster token".into(),
        },
        ToAgent::Plan(plan.clone()),
        ToAgent::Shutdown,
    ];
    for msg in &to_agent {
        let bytes = proto::encode(msg).unwrap();
        assert_eq!(&proto::decode::<ToAgent>(&bytes).unwrap(), msg);
    }
    assert_eq!(plan.holdings_of(1), Some(&[vec![2, 3, 3]][..]));
    assert_eq!(plan.holdings_of(2), None);
    assert!(plan.is_member(4) && !plan.is_member(2));
}

#[test]
fn garbage_frames_are_decode_errors() {
    let decode = |b: &[u8]| proto::decode::<ToController>(b);
    assert!(matches!(decode(&[]), Err(ProtoError::Decode { .. })));
    assert!(matches!(
        decode(&[0xff, 0xff, 0xff]),
        Err(ProtoError::Decode { .. })
    ));
    // Variant 2 (RoutingStats) claiming ~2^63 layers: an error, not an allocation.
    let huge = [
        2, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
    ];
    assert!(matches!(decode(&huge), Err(ProtoError::Decode { .. })));
    let hb = proto::encode(&ToController::Heartbeat {
        node_id: 1,
        step: 300,
    })
    .unwrap();
    assert!(matches!(
        decode(&hb[..hb.len() - 1]),
        Err(ProtoError::Decode { .. })
    ));
    let mut long = hb.to_vec();
    long.extend_from_slice(b"junk");
    assert!(matches!(
        decode(&long),
        Err(ProtoError::TrailingBytes { extra: 4 })
    ));
    let text = decode(&[9]).unwrap_err().to_string();
    assert!(text.contains("malformed control frame"), "{text}");
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = proto::decode::<ToController>(&bytes);
        let _ = proto::decode::<ToAgent>(&bytes);
        let _ = proto::register_version(&bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// Controller + agents on loopback, paused time
// ---------------------------------------------------------------------------------------------

/// Generous virtual-time bound on every wait (virtual, so it costs nothing).
const WAIT: Duration = Duration::from_secs(30);

struct Running {
    id: u32,
    plans: mpsc::Receiver<PlanMsg>,
    stats: mpsc::Sender<StepCounts>,
    task: JoinHandle<Result<AgentExit, AgentError>>,
}

fn agent_config(addr: &str, name: &str) -> AgentConfig {
    let mut cfg = AgentConfig::new(addr, TOKEN, name, 1);
    cfg.heartbeat_every_ms = 100;
    cfg
}

async fn start_agent(addr: &str, name: &str, stop: &watch::Receiver<bool>) -> Running {
    let agent = Agent::register(&agent_config(addr, name)).await.unwrap();
    let (plan_tx, plans) = mpsc::channel(4);
    let (stats, stats_rx) = mpsc::channel(4);
    Running {
        id: agent.node_id(),
        plans,
        stats,
        task: tokio::spawn(agent.run(plan_tx, stats_rx, stop.clone())),
    }
}

async fn next_plan(a: &mut Running) -> PlanMsg {
    tokio::time::timeout(WAIT, a.plans.recv())
        .await
        .expect("a plan within the bound")
        .expect("agent still running")
}

async fn start_controller(
    cfg: ControllerConfig,
) -> (
    String,
    watch::Sender<bool>,
    watch::Receiver<bool>,
    JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop_tx, stop_rx) = watch::channel(false);
    let rx = stop_rx.clone();
    let task = tokio::spawn(async move { run_controller(listener, cfg, rx).await.unwrap() });
    (addr, stop_tx, stop_rx, task)
}

#[tokio::test(start_paused = true)]
async fn kill_one_agent_then_late_join() {
    let mut cfg = config(4, 2, 4);
    cfg.initial_nodes = 3;
    let (timeout_ms, wait_ms) = (cfg.heartbeat_timeout_ms, cfg.scale_out_wait_ms);
    let (addr, stop_tx, _, controller) = start_controller(cfg).await;
    // The agents' local switch stays off: they must stop on the controller's Shutdown.
    let (_agents_stop_tx, stop_rx) = watch::channel(false);
    let mut agents = Vec::new();
    for name in ["n0", "n1", "n2"] {
        agents.push(start_agent(&addr, name, &stop_rx).await);
    }
    let ids: Vec<u32> = agents.iter().map(|a| a.id).collect();
    for a in &mut agents {
        let v1 = next_plan(a).await;
        assert_eq!(v1.version, 1);
        assert_eq!(v1.members, ids);
        assert!(v1.holdings_of(a.id).is_some());
    }

    // kill -9: the task is gone mid-flight, no Bye.
    let victim = agents.remove(1);
    victim.task.abort();
    let killed_at = Instant::now();
    let mut v2 = None;
    for a in &mut agents {
        let p = next_plan(a).await;
        assert_eq!(p.version, 2);
        v2 = Some(p);
    }
    let detected = killed_at.elapsed();
    let v2 = v2.unwrap();
    // The last heartbeat was at most one period (100 ms) before the kill; expiry needs more
    // than the timeout since it, and the ticker adds up to one tick (100 ms).
    assert!(
        detected >= Duration::from_millis(timeout_ms - 100),
        "{detected:?}"
    );
    assert!(
        detected <= Duration::from_millis(timeout_ms + 300),
        "{detected:?}"
    );
    let survivors = [agents[0].id, agents[1].id];
    assert_eq!(
        v2.members.iter().copied().collect::<BTreeSet<_>>(),
        survivors.into()
    );
    assert!(!v2.restore_from_checkpoint);
    assert!(v2.transfers.iter().all(|t| survivors.contains(&t.2)));

    // A late joiner learns the plan in force at once, but joins one only after the wait.
    let joined_at = Instant::now();
    let mut late = start_agent(&addr, "n3", &stop_rx).await;
    assert_eq!(next_plan(&mut late).await, v2);
    let early = Duration::from_millis(wait_ms - 200);
    assert!(
        tokio::time::timeout(early, agents[0].plans.recv())
            .await
            .is_err(),
        "no replan before scale_out_wait_ms"
    );
    let v3 = next_plan(&mut agents[0]).await;
    assert!(joined_at.elapsed() >= Duration::from_millis(wait_ms));
    assert!(joined_at.elapsed() <= Duration::from_millis(wait_ms + 300));
    assert_eq!(v3.version, 3);
    assert!(v3.is_member(late.id));
    assert!(
        v3.transfers
            .iter()
            .all(|t| survivors.contains(&t.2) && t.3 == late.id)
    );
    assert_eq!(next_plan(&mut late).await, v3);
    assert_eq!(next_plan(&mut agents[1]).await, v3);

    // Shutdown reaches every agent and the controller returns.
    stop_tx.send(true).unwrap();
    agents.push(late);
    for a in agents {
        let exit = tokio::time::timeout(WAIT, a.task).await.unwrap().unwrap();
        assert_eq!(exit.unwrap(), AgentExit::ControllerShutdown);
    }
    tokio::time::timeout(WAIT, controller)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn routing_stats_flow_and_local_shutdown_says_bye() {
    let mut cfg = config(4, 1, 12);
    cfg.initial_nodes = 2;
    let (addr, stop_tx, stop_rx, controller) = start_controller(cfg).await;
    let mut a = start_agent(&addr, "a", &stop_rx).await;
    // b has its own local shutdown switch.
    let (b_stop_tx, b_stop_rx) = watch::channel(false);
    let mut b = start_agent(&addr, "b", &b_stop_rx).await;
    assert_eq!(next_plan(&mut a).await.version, 1);
    assert_eq!(next_plan(&mut b).await.version, 1);
    for step in 0..3 {
        let counts = vec![vec![100, 1, 1, 1]];
        a.stats
            .send(StepCounts {
                step,
                counts: counts.clone(),
            })
            .await
            .unwrap();
        b.stats.send(StepCounts { step, counts }).await.unwrap();
    }
    // b leaves gracefully: removed at once, well before any heartbeat timeout.
    let left_at = Instant::now();
    b_stop_tx.send(true).unwrap();
    let exit = tokio::time::timeout(WAIT, b.task).await.unwrap().unwrap();
    assert_eq!(exit.unwrap(), AgentExit::LocalShutdown);
    let v2 = next_plan(&mut a).await;
    assert!(
        left_at.elapsed() <= Duration::from_millis(200),
        "{:?}",
        left_at.elapsed()
    );
    assert_eq!(v2.members, vec![a.id]);
    // Loads from the stats drove the allocation: expert 0 got most of the 12 slots.
    let r = replica_counts(&v2, 1, 4);
    assert_eq!(r, vec![vec![6, 2, 2, 2]]);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(WAIT, controller)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn rejections_and_fencing_over_tcp() {
    let (addr, stop_tx, stop_rx, controller) = start_controller(config(4, 1, 4)).await;

    let mut wrong = agent_config(&addr, "x");
    wrong.token = "guess".into();
    match Agent::register(&wrong).await {
        Err(AgentError::Rejected { reason }) => assert!(reason.contains("token"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    let _first = start_agent(&addr, "dup", &stop_rx).await;
    match Agent::register(&agent_config(&addr, "dup")).await {
        Err(AgentError::Rejected { reason }) => assert!(reason.contains("dup"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }

    let raw = |addr: String| async move { proto::framed(TcpStream::connect(addr).await.unwrap()) };
    let expect_rejected = |msg: Option<ToAgent>| match msg {
        Some(ToAgent::Rejected { reason }) => reason,
        other => panic!("expected Rejected, got {other:?}"),
    };
    // Garbage instead of Register: a clear rejection, no panic.
    let mut conn = raw(addr.clone()).await;
    conn.send(Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef]))
        .await
        .unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("malformed"), "{reason}");
    assert!(
        proto::recv::<ToAgent>(&mut conn).await.unwrap().is_none(),
        "closed after"
    );

    // A future agent whose Register layout changed: the version is still read.
    let mut conn = raw(addr.clone()).await;
    let future = postcard::to_stdvec(&(0u32, 99u16, [1.5f64, 2.5], "new field")).unwrap();
    conn.send(Bytes::from(future)).await.unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("v99"), "{reason}");

    // A node that stops heartbeating is fenced out once it expires.
    let mut conn = raw(addr.clone()).await;
    let register = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: "silent".into(),
        devices: 1,
    };
    proto::send(&mut conn, &register).await.unwrap();
    let id = match proto::recv(&mut conn).await.unwrap() {
        Some(ToAgent::Registered { node_id }) => node_id,
        other => panic!("expected Registered, got {other:?}"),
    };
    let started = Instant::now();
    let reason = loop {
        match tokio::time::timeout(WAIT, proto::recv(&mut conn))
            .await
            .unwrap()
            .unwrap()
        {
            Some(ToAgent::Plan(_)) => continue,
            other => break expect_rejected(other),
        }
    };
    assert!(reason.contains(&format!("node {id} expired")), "{reason}");
    assert!(started.elapsed() > Duration::from_millis(1_000));

    // The controller survived all of that.
    let mut ok = start_agent(&addr, "after", &stop_rx).await;
    assert!(next_plan(&mut ok).await.version >= 1);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(WAIT, controller)
        .await
        .unwrap()
        .unwrap();
}

/// The job controller (`run_job`, what `lzrun` runs) under paused time: a registered node that
/// never heartbeats is declared gone one heartbeat timeout later, and its next heartbeat is
/// refused.
#[tokio::test(start_paused = true)]
async fn job_controller_expires_a_silent_node_and_fences_it() {
    use lazarus_executor::control::{JobParams, Notice, run_job};
    use lazarus_executor::model::MoeConfig;

    let model = MoeConfig::tiny();
    let mut cfg = ControllerConfig::new(TOKEN, model.experts, model.n_layers, 4);
    cfg.heartbeat_timeout_ms = 1_000;
    cfg.tick_ms = 50;
    cfg.initial_nodes = 2;
    let job = JobParams {
        config: model,
        steps: 4,
        timeout_ms: 1_000,
        checkpoint: None,
        checkpoint_keep: 1,
        out: None,
        rebalance_every_steps: 0,
        resume: None,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut notices) = mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = tokio::spawn(run_job(listener, cfg, job, tx, stop_rx, |_| {}));

    let mut framed = proto::framed(TcpStream::connect(addr).await.unwrap());
    let register = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: "quiet".into(),
        devices: 1,
    };
    proto::send(&mut framed, &register).await.unwrap();
    let node_id = match proto::recv::<ToAgent>(&mut framed).await.unwrap() {
        Some(ToAgent::Registered { node_id }) => node_id,
        other => panic!("expected Registered, got {other:?}"),
    };
    match proto::recv::<ToAgent>(&mut framed).await.unwrap() {
        Some(ToAgent::Worker { line }) => assert!(line.starts_with("{\"Job\""), "{line}"),
        other => panic!("expected the Job command, got {other:?}"),
    }
    let registered = Instant::now();
    let gone = loop {
        match tokio::time::timeout(WAIT, notices.recv()).await {
            Ok(Some(Notice::Log(l))) if l.contains("is gone") => break l,
            Ok(Some(_)) => {}
            other => panic!("no expiry notice: {other:?}"),
        }
    };
    assert!(gone.contains("no heartbeat"), "{gone}");
    let waited = registered.elapsed();
    assert!(
        waited >= Duration::from_millis(1_000) && waited <= Duration::from_millis(1_200),
        "expired after {waited:?}"
    );
    proto::send(&mut framed, &ToController::Heartbeat { node_id, step: 0 })
        .await
        .unwrap();
    match proto::recv::<ToAgent>(&mut framed).await.unwrap() {
        Some(ToAgent::Rejected { reason }) => assert!(reason.contains("expired"), "{reason}"),
        other => panic!("expected Rejected, got {other:?}"),
    }
    stop_tx.send(true).unwrap();
    server.await.unwrap().unwrap();
}
