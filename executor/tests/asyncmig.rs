//! Replicated re-layout without a pause (issue 13 item 2), in process: four managed workers
//! (threads of this test, the real worker loop, real TCP meshes and side connections on
//! 127.0.0.1) get the same plan change once as a `Relayout` with transfers (copied in the
//! background, switched at a boundary the workers agree on) and once as the blocking path
//! (pause, reconfigure with the transfers, resume) at the same boundary. Every loss and the
//! final state of every worker — dense weights, every replica's weights, Adam moments and
//! step — must be bit for bit the same: the copies caught up by replay equal the replicas
//! their holders trained.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use lazarus_executor::comm::MeshSecret;
use lazarus_executor::model::{ExpertMode, MoeConfig};
use lazarus_executor::worker::{
    AbortSlot, Checksums, Command, JobSpec, Reconfigure, StateSource, StepDelay, TestHooks,
    WorkerEvent, WorkerLine, run_managed_worker,
};

const WORLD: usize = 4;
const STEPS: u64 = 16;
/// Node 0 sleeps this long at the start of each step, after taking its commands (the test
/// hook `StepDelay`): a `Pause` sent [`PAUSE_AFTER_MS`] after node 0 reported step `s − 3` lands
/// in that sleep of step `s − 2`, so node 0 takes it at the start of step `s − 1` and every
/// worker pauses at boundary `s`. (Sent at once, it could beat node 0 to its command check of
/// step `s − 2`.)
const DELAY_MS: u64 = 200;
const PAUSE_AFTER_MS: u64 = 80;
const WAIT: Duration = Duration::from_secs(120);

/// `[layer][expert][rank]` with every layer holding expert `e` on `holders[e]`.
fn table(cfg: &MoeConfig, holders: [[usize; 2]; 4]) -> Vec<Vec<Vec<u32>>> {
    (0..cfg.n_layers)
        .map(|_| {
            holders
                .iter()
                .map(|h| {
                    let mut row = vec![0u32; WORLD];
                    for &r in h {
                        row[r] = 1;
                    }
                    row
                })
                .collect()
        })
        .collect()
}

fn layout_a(cfg: &MoeConfig) -> Vec<Vec<Vec<u32>>> {
    table(cfg, [[0, 1], [1, 2], [2, 3], [3, 0]])
}

/// Every expert moves one of its replicas: e0 1→2, e1 2→3, e2 3→0, e3 0→1.
fn layout_b(cfg: &MoeConfig) -> Vec<Vec<Vec<u32>>> {
    table(cfg, [[0, 2], [1, 3], [2, 0], [3, 1]])
}

/// `(layer, expert, src, dst)` from A to B.
fn transfers(cfg: &MoeConfig) -> Vec<(usize, usize, usize, usize)> {
    (0..cfg.n_layers)
        .flat_map(|l| [(l, 0, 0, 2), (l, 1, 1, 3), (l, 2, 2, 0), (l, 3, 3, 1)])
        .collect()
}

struct Node {
    tx: Sender<Command>,
    handle: JoinHandle<anyhow::Result<Checksums>>,
}

/// What a run saw.
#[derive(Debug, Default)]
struct Seen {
    /// `(node, step)` → (loss bits, layout version).
    steps: BTreeMap<(usize, u64), (u32, u64)>,
    /// `(node, step)` → the background copy bytes the step reported, where not 0.
    copied: BTreeMap<(usize, u64), u64>,
    paused: Vec<(usize, u64)>,
    migrated: usize,
    failed: Vec<String>,
    finished: usize,
}

/// Starts the workers and waits for their addresses.
fn start(cfg: &MoeConfig) -> (Vec<Node>, Receiver<(usize, String)>, Vec<SocketAddr>) {
    let (ltx, lines) = mpsc::channel::<(usize, String)>();
    let mut nodes = Vec::new();
    for i in 0..WORLD {
        let (tx, rx) = mpsc::channel();
        let out = ltx.clone();
        let emit = move |l: &str| {
            out.send((i, l.to_owned()))
                .map_err(|_| anyhow::anyhow!("test gone"))
        };
        let handle = thread::spawn(move || {
            let delay = StepDelay {
                node: 0,
                ms: DELAY_MS,
            };
            run_managed_worker(
                &rx,
                &AbortSlot::default(),
                emit,
                TestHooks {
                    delay: Some(delay),
                    ..TestHooks::default()
                },
            )
        });
        let job = JobSpec {
            config: cfg.clone(),
            steps: STEPS,
            shard: i as u64,
            node_id: i as u32,
            listen: "127.0.0.1:0".parse().unwrap(),
            timeout_ms: 30_000,
            step_deadline: None,
            alive_every_ms: 1_000,
            checkpoint: None,
            out: None,
            expert_mode: ExpertMode::Replicated,
            router_skew: 0.0,
            verify_every: 1,
            data: None,
            global_batch: None,
            eval: None,
        };
        tx.send(Command::Job(job)).unwrap();
        nodes.push(Node { tx, handle });
    }
    let mut addrs = vec![None; WORLD];
    let t = Instant::now();
    while addrs.iter().any(Option::is_none) {
        let (i, l) = lines.recv_timeout(WAIT - t.elapsed()).expect("ready");
        if let Some(WorkerLine::Event(WorkerEvent::Ready { addr })) = WorkerLine::parse(&l) {
            addrs[i] = Some(addr);
        }
    }
    (
        nodes,
        lines,
        addrs.into_iter().map(Option::unwrap).collect(),
    )
}

fn reconfigure(
    nodes: &[Node],
    peers: &[SocketAddr],
    epoch: u64,
    replicas: &[Vec<Vec<u32>>],
    transfers: Vec<(usize, usize, usize, usize)>,
    source: StateSource,
    resume_step: u64,
) {
    let secret = MeshSecret::random();
    for (rank, n) in nodes.iter().enumerate() {
        let cmd = Reconfigure {
            rank,
            peers: peers.to_vec(),
            epoch,
            secret: secret.clone(),
            plan_version: epoch,
            replicas: replicas.to_vec(),
            transfers: transfers.clone(),
            source: source.clone(),
            resume_step,
            shard_holders: Vec::new(),
            shard_transfers: Vec::new(),
            data_cursor: None,
            checkpoint_at_resume: false,
        };
        n.tx.send(Command::Reconfigure(cmd)).unwrap();
    }
}

/// Reads lines until every worker finished; `on_step(seen, node, step)` may send commands.
fn watch(
    nodes: &[Node],
    lines: &Receiver<(usize, String)>,
    mut on: impl FnMut(&mut Seen, &WorkerLine, usize),
) -> Seen {
    let mut seen = Seen::default();
    let t = Instant::now();
    while seen.finished < WORLD {
        assert!(seen.failed.is_empty(), "{:?}", seen.failed);
        let left = WAIT
            .checked_sub(t.elapsed())
            .expect("the run took too long");
        let (i, l) = lines.recv_timeout(left).expect("a worker line");
        let Some(line) = WorkerLine::parse(&l) else {
            continue;
        };
        match &line {
            WorkerLine::Step(s) => {
                seen.steps
                    .insert((i, s.step), (s.loss.to_bits(), s.layout_version));
                if s.copy_bytes > 0 {
                    seen.copied.insert((i, s.step), s.copy_bytes);
                }
            }
            WorkerLine::Event(WorkerEvent::Paused { step, .. }) => seen.paused.push((i, *step)),
            WorkerLine::Event(WorkerEvent::Migrated { .. }) => seen.migrated += 1,
            WorkerLine::Event(WorkerEvent::Failed { error, .. }) => seen.failed.push(error.clone()),
            WorkerLine::Event(WorkerEvent::Finished { .. }) => seen.finished += 1,
            _ => {}
        }
        on(&mut seen, &line, i);
    }
    let _ = nodes;
    seen
}

fn stop(nodes: Vec<Node>) -> Vec<Checksums> {
    for n in &nodes {
        n.tx.send(Command::Stop).unwrap();
    }
    nodes
        .into_iter()
        .map(|n| n.handle.join().unwrap().unwrap())
        .collect()
}

/// The first step every worker trained on layout version 2.
fn switch_step(seen: &Seen) -> u64 {
    let firsts: Vec<u64> = (0..WORLD)
        .map(|i| {
            (0..STEPS)
                .find(|&s| seen.steps.get(&(i, s)).is_some_and(|v| v.1 == 2))
                .unwrap_or_else(|| panic!("node {i} never switched: {seen:?}"))
        })
        .collect();
    assert!(firsts.iter().all(|&s| s == firsts[0]), "{firsts:?}");
    firsts[0]
}

#[test]
fn async_migration_equals_the_blocking_migration_at_the_same_boundary_bit_for_bit() {
    let cfg = MoeConfig::tiny();
    let (a, b, moves) = (layout_a(&cfg), layout_b(&cfg), transfers(&cfg));

    // Async: the plan change arrives while the workers train.
    let (nodes, lines, peers) = start(&cfg);
    reconfigure(&nodes, &peers, 1, &a, Vec::new(), StateSource::Fresh, 0);
    for n in &nodes {
        n.tx.send(Command::Relayout {
            epoch: 1,
            version: 2,
            from_step: 3,
            replicas: b.clone(),
            transfers: moves.clone(),
        })
        .unwrap();
    }
    let seen_async = watch(&nodes, &lines, |_, _, _| {});
    let sums_async = stop(nodes);
    assert!(seen_async.paused.is_empty(), "no pause: {seen_async:?}");
    assert_eq!(
        seen_async.migrated, WORLD,
        "the start is the only reconfiguration"
    );
    let s = switch_step(&seen_async);
    // Every worker sends one copy per layer, started at boundary 3: each reports their bytes
    // once, with step 3, all the same size (the experts have one shape); nothing else counts.
    let copied: Vec<(usize, u64)> = seen_async.copied.keys().copied().collect();
    assert_eq!(copied, (0..WORLD).map(|i| (i, 3)).collect::<Vec<_>>());
    let sizes: Vec<u64> = seen_async.copied.values().copied().collect();
    assert!(sizes.iter().all(|&b| b == sizes[0]), "{sizes:?}");
    let per_expert = (2 * cfg.d_model * cfg.d_ff * 4 * 3) as u64; // weights and two moments
    assert!(
        sizes[0] >= cfg.n_layers as u64 * per_expert,
        "{} bytes for {} copies of {per_expert}",
        sizes[0],
        cfg.n_layers
    );
    // Agreed in step 2's barrier (from_step 3), started at boundary 3, ready in step 3 at the
    // earliest (copies in before it starts): the first step on the new layout is 4 or later.
    assert!((4..=STEPS - 10).contains(&s), "switched at step {s}");
    for (i, sums) in sums_async.iter().enumerate() {
        let held: Vec<(usize, usize)> = sums.replicas.iter().map(|r| (r.layer, r.expert)).collect();
        let want: Vec<(usize, usize)> = (0..cfg.n_layers)
            .flat_map(|l| (0..cfg.experts).map(move |e| (l, e)))
            .filter(|&(l, e)| b[l][e][i] > 0)
            .collect();
        assert_eq!(held, want, "node {i} holds the new layout's replicas");
    }

    // Blocking, the same plan change at the same boundary `s`.
    let (nodes, lines, peers) = start(&cfg);
    reconfigure(&nodes, &peers, 1, &a, Vec::new(), StateSource::Fresh, 0);
    let mut paused_sent = false;
    let seen_blocking = watch(&nodes, &lines, |seen, line, i| match line {
        WorkerLine::Step(st) if i == 0 && st.step + 3 == s && !paused_sent => {
            thread::sleep(Duration::from_millis(PAUSE_AFTER_MS));
            nodes[0].tx.send(Command::Pause).unwrap();
            paused_sent = true;
        }
        WorkerLine::Event(WorkerEvent::Paused { .. }) if seen.paused.len() == WORLD => {
            assert!(seen.paused.iter().all(|p| p.1 == s), "{:?}", seen.paused);
            let source = StateSource::Peers {
                dense_from: 0,
                dense_to: Vec::new(),
            };
            reconfigure(&nodes, &peers, 2, &b, moves.clone(), source, s);
        }
        _ => {}
    });
    let sums_blocking = stop(nodes);
    assert_eq!(seen_blocking.paused.len(), WORLD);
    assert!(
        seen_blocking.copied.is_empty(),
        "{:?}",
        seen_blocking.copied
    );

    let losses = |seen: &Seen| -> BTreeMap<(usize, u64), u32> {
        seen.steps.iter().map(|(k, v)| (*k, v.0)).collect()
    };
    assert_eq!(losses(&seen_async).len(), WORLD * STEPS as usize);
    assert_eq!(
        losses(&seen_async),
        losses(&seen_blocking),
        "every loss, bit for bit"
    );
    assert_eq!(
        sums_async, sums_blocking,
        "every worker's final state, bit for bit"
    );
}
