//! Integration tests of the TCP communicator: every rank runs on its own thread over loopback.
//! Every blocking call is bounded: communicators use short timeouts and the harness waits for
//! each rank with a deadline, so a bug fails a test instead of hanging it.

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use lazarus_executor::comm::{
    CommError, Communicator, LocalGroup, MeshSecret, Rank, TcpCommunicator,
};

/// Per-operation timeout for tests where every rank participates promptly.
const T_MS: u64 = 5_000;
/// How long the harness waits for any rank before failing the test.
const HARNESS: Duration = Duration::from_secs(60);
/// The mesh secret of the tests that form meshes by hand.
const S: MeshSecret = MeshSecret::from_bytes([0x5a; MeshSecret::LEN]);

/// SplitMix64: a small deterministic generator, so every rank can regenerate what others sent.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Values of widely varying magnitude, so that summation order changes rounding.
    fn f32(&mut self) -> f32 {
        let mantissa = (self.next() % 2_000_001) as f32 / 1_000_000.0 - 1.0;
        let exp = (self.next() % 17) as i32 - 8;
        mantissa * 2f32.powi(exp * 3)
    }
}

fn seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0xC0FF_EE00_u64, |h, &p| h.wrapping_mul(1_000_003) ^ p)
}

/// What `src` sends to `dst` in round `round`: a random length in 0..40 (often zero).
fn payload(src: Rank, dst: Rank, round: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed(&[src as u64, dst as u64, round]));
    let len = if rng.below(4) == 0 {
        0
    } else {
        rng.below(40) as usize
    };
    (0..len).map(|_| rng.f32()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// [`common::run_ranks`] within [`HARNESS`].
fn run_ranks<R, F>(comms: Vec<TcpCommunicator>, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(TcpCommunicator) -> R + Send + Sync + Clone + 'static,
{
    common::run_ranks(comms, HARNESS, f)
}

fn group(world: usize, timeout_ms: u64) -> Vec<TcpCommunicator> {
    LocalGroup::new(world, timeout_ms).expect("loopback mesh")
}

#[test]
fn all_to_all_v_delivers_variable_sizes_including_empty() {
    for world in 1..=5 {
        let results = run_ranks(group(world, T_MS), move |mut c| {
            let me = c.rank();
            assert_eq!(c.world(), world);
            for round in 0..4 {
                let send = (0..world).map(|dst| payload(me, dst, round)).collect();
                let recv = c.all_to_all_v(send).expect("all_to_all_v");
                assert_eq!(recv.len(), world);
                for (src, got) in recv.iter().enumerate() {
                    assert_eq!(
                        bits(got),
                        bits(&payload(src, me, round)),
                        "world {world} round {round}: rank {me} from {src}"
                    );
                }
            }
        });
        assert_eq!(results.len(), world);
    }
}

/// The byte counter counts exactly the elements sent to other ranks: not the message to
/// oneself, not the framing, u64 words at 8 bytes.
#[test]
fn payload_bytes_sent_counts_what_left_for_other_ranks() {
    let world = 4;
    let results = run_ranks(group(world, T_MS), move |mut c| {
        let me = c.rank();
        assert_eq!(c.payload_bytes_sent(), 0);
        let mut want = 0u64;
        for round in 0..3 {
            let send: Vec<Vec<f32>> = (0..world).map(|dst| payload(me, dst, round)).collect();
            want += send
                .iter()
                .enumerate()
                .filter(|&(dst, _)| dst != me)
                .map(|(_, m)| 4 * m.len() as u64)
                .sum::<u64>();
            c.all_to_all_v(send).expect("all_to_all_v");
            assert_eq!(c.payload_bytes_sent(), want, "rank {me} round {round}");
        }
        c.all_gather_u64(&vec![7; me + 1]).expect("all_gather");
        want += 8 * (me as u64 + 1) * (world as u64 - 1);
        assert_eq!(
            c.payload_bytes_sent(),
            want,
            "rank {me} after the all-gather"
        );
    });
    assert_eq!(results.len(), world);
}

#[test]
fn all_gather_u64_collects_every_rank() {
    for world in 1..=5 {
        run_ranks(group(world, T_MS), move |mut c| {
            let mine_of = |r: Rank, round: u64| -> Vec<u64> {
                let mut rng = Rng::new(seed(&[r as u64, round, 77]));
                (0..rng.below(6)).map(|_| rng.next()).collect()
            };
            for round in 0..3 {
                let all = c
                    .all_gather_u64(&mine_of(c.rank(), round))
                    .expect("all_gather_u64");
                let want: Vec<_> = (0..world).map(|r| mine_of(r, round)).collect();
                assert_eq!(all, want);
            }
        });
    }
}

fn reduce_input(rank: Rank, round: u64, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed(&[rank as u64, round, 991]));
    (0..len).map(|_| rng.f32()).collect()
}

/// The documented result: the left fold over the group in ascending rank order.
fn reference_sum(group: &[Rank], round: u64, len: usize) -> Vec<f32> {
    let mut acc = reduce_input(group[0], round, len);
    for &r in &group[1..] {
        for (a, b) in acc.iter_mut().zip(reduce_input(r, round, len)) {
            *a += b;
        }
    }
    acc
}

#[test]
fn all_reduce_sum_full_group_matches_sequential_reference_bitwise() {
    for world in 1..=5 {
        let results = run_ranks(group(world, T_MS), move |mut c| {
            let all: Vec<Rank> = (0..world).collect();
            let mut outs = Vec::new();
            for (round, len) in [(0, 0usize), (1, 1), (2, 1000), (3, 70_001)] {
                let mut buf = reduce_input(c.rank(), round, len);
                c.all_reduce_sum(&all, &mut buf).expect("all_reduce_sum");
                assert_eq!(bits(&buf), bits(&reference_sum(&all, round, len)));
                outs.push(bits(&buf));
            }
            outs
        });
        for r in &results {
            assert_eq!(r, &results[0], "members differ bitwise");
        }
    }
}

/// Partitions of the ranks into disjoint groups that reduce concurrently.
fn partitions(world: usize) -> Vec<Vec<Vec<Rank>>> {
    let mut out = vec![vec![(0..world).collect::<Vec<_>>()]];
    if world == 5 {
        out.push(vec![vec![0, 2, 3], vec![1, 4]]);
        out.push(vec![vec![0, 4], vec![1, 2, 3]]);
        out.push(vec![vec![1, 2], vec![0], vec![3, 4]]);
    }
    if world == 4 {
        out.push(vec![vec![0, 2, 3], vec![1]]);
        out.push(vec![vec![0, 3], vec![1, 2]]);
    }
    if world == 3 {
        out.push(vec![vec![0, 2], vec![1]]);
    }
    // And a random partition of every world size.
    let mut rng = Rng::new(seed(&[world as u64, 5]));
    let labels: Vec<u64> = (0..world).map(|_| rng.below(3)).collect();
    let random: Vec<Vec<Rank>> = (0..3)
        .map(|l| (0..world).filter(|&r| labels[r] == l).collect::<Vec<_>>())
        .filter(|g| !g.is_empty())
        .collect();
    out.push(random);
    out
}

#[test]
fn all_reduce_sum_over_disjoint_subgroups_concurrently() {
    for world in 1..=5 {
        for (round, parts) in partitions(world).into_iter().enumerate() {
            let round = round as u64 + 10;
            let len = 257;
            let parts2 = parts.clone();
            let results = run_ranks(group(world, T_MS), move |mut c| {
                let mine = parts2
                    .iter()
                    .find(|g| g.contains(&c.rank()))
                    .expect("every rank is in a group")
                    .clone();
                let mut buf = reduce_input(c.rank(), round, len);
                c.all_reduce_sum(&mine, &mut buf).expect("subgroup reduce");
                // Still in sync with the whole world afterwards.
                c.barrier().expect("barrier");
                (mine, bits(&buf))
            });
            for g in &parts {
                let want = bits(&reference_sum(g, round, len));
                for &r in g {
                    assert_eq!(results[r].0, *g);
                    assert_eq!(results[r].1, want, "world {world} group {g:?} rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_sum_rejects_bad_groups_without_breaking_the_communicator() {
    run_ranks(group(3, T_MS), |mut c| {
        let mut buf = vec![1.0f32; 4];
        let me = c.rank();
        let others: Vec<Rank> = (0..3).filter(|&r| r != me).collect();
        for bad in [
            vec![],
            others,
            vec![2, 1, 0],
            vec![0, 0, 1, 2],
            vec![0, 1, 2, 3],
        ] {
            let r = c.all_reduce_sum(&bad, &mut buf);
            assert!(matches!(r, Err(CommError::BadShape(_))), "{bad:?}: {r:?}");
        }
        let r = c.all_to_all_v(vec![vec![]; 2]);
        assert!(matches!(r, Err(CommError::BadShape(_))), "{r:?}");
        c.all_reduce_sum(&[0, 1, 2], &mut buf)
            .expect("usable after argument errors");
        assert_eq!(buf, vec![3.0; 4]);
    });
}

#[test]
fn all_reduce_sum_length_mismatch_is_an_error_not_a_hang() {
    let t0 = Instant::now();
    let results = run_ranks(group(3, 1_000), |mut c| {
        let mut buf = vec![1.0f32; 4 + c.rank()];
        c.all_reduce_sum(&[0, 1, 2], &mut buf)
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(
        matches!(results[0], Err(CommError::BadShape(_))),
        "{results:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// Messages of round `round`: a deterministic plan every rank can recompute.
/// Returns (src, dst, data) in send order.
fn p2p_plan(world: usize, round: u64) -> Vec<(Rank, Rank, Vec<f32>)> {
    let mut rng = Rng::new(seed(&[world as u64, round, 31]));
    let n = rng.below(3 * world as u64 + 1);
    (0..n)
        .map(|k| {
            let src = rng.below(world as u64) as Rank;
            let dst = rng.below(world as u64) as Rank;
            let len = rng.below(50) as usize;
            let data = (0..len).map(|i| (k * 1000 + i as u64) as f32).collect();
            (src, dst, data)
        })
        .collect()
}

#[test]
fn send_recv_batches_arrive_in_order() {
    for world in 1..=5 {
        run_ranks(group(world, T_MS), move |mut c| {
            let me = c.rank();
            for round in 0..6 {
                let plan = p2p_plan(world, round);
                let sends: Vec<(Rank, Vec<f32>)> = plan
                    .iter()
                    .filter(|(s, _, _)| *s == me)
                    .map(|(_, d, data)| (*d, data.clone()))
                    .collect();
                let expected: Vec<(Rank, Vec<f32>)> = plan
                    .iter()
                    .filter(|(_, d, _)| *d == me)
                    .map(|(s, _, data)| (*s, data.clone()))
                    .collect();
                let recv_from: Vec<Rank> = expected.iter().map(|(s, _)| *s).collect();
                let got = c.send_recv(sends, &recv_from).expect("send_recv");
                assert_eq!(got, expected, "world {world} round {round} rank {me}");
            }
            c.barrier().expect("barrier");
        });
    }
}

#[test]
fn barrier_waits_for_the_last_rank() {
    for world in 1..=5 {
        let start = Instant::now();
        let times = run_ranks(group(world, T_MS), move |mut c| {
            thread::sleep(Duration::from_millis(40 * c.rank() as u64));
            let entered = start.elapsed();
            c.barrier().expect("barrier");
            let left = start.elapsed();
            c.barrier().expect("second barrier");
            (entered, left)
        });
        let last_in = times.iter().map(|t| t.0).max().unwrap();
        let first_out = times.iter().map(|t| t.1).min().unwrap();
        assert!(first_out >= last_in, "{times:?}");
    }
}

/// Asserts that `r` is an error that names `dead` (closed or timed out).
fn names_peer(r: &Result<Vec<Vec<f32>>, CommError>, dead: Rank) -> bool {
    matches!(r, Err(CommError::PeerClosed { peer }) if *peer == dead)
        || matches!(r, Err(CommError::Timeout { peer, .. }) if *peer == dead)
}

#[test]
fn dropped_peer_is_named_by_every_survivor_within_the_timeout() {
    for world in 2..=5 {
        for dead in [0, world / 2, world - 1] {
            let t0 = Instant::now();
            let results = run_ranks(group(world, 500), move |mut c| {
                let me = c.rank();
                if me == dead {
                    drop(c);
                    return None;
                }
                let mut first_err = None;
                for round in 0..3 {
                    let send = (0..world).map(|d| payload(me, d, round)).collect();
                    if let Err(e) = c.all_to_all_v(send) {
                        first_err = Some(Err(e));
                        break;
                    }
                }
                let after = c.barrier();
                assert!(matches!(after, Err(CommError::Aborted)), "{after:?}");
                Some(first_err.expect("an operation with a dead peer must fail"))
            });
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            for (r, res) in results.iter().enumerate() {
                if let Some(res) = res {
                    assert!(
                        names_peer(res, dead),
                        "world {world}: rank {r} should name {dead}, got {res:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn aborting_peer_fails_fast_and_is_named_by_survivors() {
    for world in 2..=5 {
        let dead = world - 1;
        let t0 = Instant::now();
        let results = run_ranks(group(world, 500), move |mut c| {
            let me = c.rank();
            if me == dead {
                c.abort();
                let t = Instant::now();
                let r = c.all_to_all_v(vec![vec![1.0]; world]);
                assert!(matches!(r, Err(CommError::Aborted)), "{r:?}");
                assert!(matches!(c.barrier(), Err(CommError::Aborted)));
                assert!(t.elapsed() < Duration::from_millis(100));
                // Keep the communicator alive: survivors must notice the abort, not a drop.
                thread::sleep(Duration::from_millis(300));
                return None;
            }
            Some(c.all_to_all_v((0..world).map(|d| vec![d as f32; 100]).collect()))
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        for res in results.iter().flatten() {
            assert!(
                matches!(res, Err(CommError::PeerClosed { peer }) if *peer == dead),
                "{res:?}"
            );
        }
    }
}

#[test]
fn silent_peer_times_out_naming_it() {
    let world = 4;
    let silent = 2;
    let t0 = Instant::now();
    let results = run_ranks(group(world, 500), move |mut c| {
        if c.rank() == silent {
            // Alive but never joins the collective.
            thread::sleep(Duration::from_millis(1_500));
            return None;
        }
        let t = Instant::now();
        let r = c.all_to_all_v((0..world).map(|_| vec![0.5; 10]).collect());
        Some((r, t.elapsed()))
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    for (res, took) in results.iter().flatten() {
        assert!(
            matches!(res, Err(CommError::Timeout { peer, op: "all_to_all_v", ms: 500 }) if *peer == silent),
            "{res:?}"
        );
        assert!(*took >= Duration::from_millis(400) && *took < Duration::from_secs(3));
    }
}

#[test]
fn abort_handle_interrupts_a_blocked_collective() {
    let mut comms = group(2, 10_000);
    let c1 = comms.pop().unwrap();
    let mut c0 = comms.pop().unwrap();
    let handle = c0.abort_handle().expect("handle");
    let t0 = Instant::now();
    let aborter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        handle.abort();
        handle.is_aborted()
    });
    // Rank 1 never participates; rank 0 would wait 10 s without the abort.
    let r = c0.all_to_all_v(vec![vec![1.0], vec![2.0]]);
    assert!(matches!(r, Err(CommError::Aborted)), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(aborter.join().unwrap());
    assert!(c0.is_aborted());
    drop(c1);
}

#[test]
fn desynchronized_ranks_get_a_protocol_error() {
    let t0 = Instant::now();
    let results = run_ranks(group(2, 1_000), |mut c| {
        if c.rank() == 0 {
            c.all_gather_u64(&[]).map(|_| ())
        } else {
            c.all_to_all_v(vec![vec![], vec![]]).map(|_| ())
        }
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(CommError::Protocol(m)) if m.contains("desync"))),
        "{results:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

fn bind() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

#[test]
fn epoch_mismatch_on_handshake_is_rejected() {
    let (l0, a0) = bind();
    let (l1, a1) = bind();
    let peers = [a0, a1];
    let t0 = Instant::now();
    let h0 = thread::spawn(move || TcpCommunicator::connect(0, &peers, l0, 1, &S, 500));
    let h1 = thread::spawn(move || TcpCommunicator::connect(1, &peers, l1, 2, &S, 500));
    let r0 = h0.join().unwrap();
    let r1 = h1.join().unwrap();
    assert!(
        matches!(&r0, Err(CommError::Protocol(m)) if m.contains("epoch mismatch")),
        "{r0:?}"
    );
    assert!(
        matches!(
            r1,
            Err(CommError::Timeout {
                peer: 0,
                op: "rendezvous",
                ..
            })
        ),
        "{r1:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn stale_connector_is_rejected_and_the_new_mesh_still_forms() {
    let (l0, a0) = bind();
    let (l1, a1) = bind();
    let (l_old, a_old) = bind();
    let peers = [a0, a1];
    // Rank 1 of epoch 8 waits for rank 0 of epoch 8.
    let h1 = thread::spawn(move || TcpCommunicator::connect(1, &peers, l1, 8, &S, 3_000));
    // A leftover rank 0 of epoch 7 dials first and is turned away...
    let stale = TcpCommunicator::connect(0, &[a_old, a1], l_old, 7, &S, 3_000);
    assert!(
        matches!(&stale, Err(CommError::Protocol(m)) if m.contains("epoch")),
        "{stale:?}"
    );
    // ...and the rightful rank 0 joins.
    let mut c0 = TcpCommunicator::connect(0, &peers, l0, 8, &S, 3_000).expect("rank 0");
    let mut c1 = h1.join().unwrap().expect("rank 1");
    assert_eq!((c0.epoch(), c1.epoch()), (8, 8));
    let h = thread::spawn(move || c1.all_gather_u64(&[1]).map(|v| (v, c1)));
    assert_eq!(c0.all_gather_u64(&[0]).unwrap(), vec![vec![0], vec![1]]);
    assert_eq!(h.join().unwrap().unwrap().0, vec![vec![0], vec![1]]);
}

#[test]
fn wrong_world_or_missing_peer_fails_rendezvous_in_time() {
    // World size disagreement.
    let (l0, a0) = bind();
    let (l1, a1) = bind();
    let (_l2, a2) = bind();
    let t0 = Instant::now();
    let h1 = thread::spawn(move || TcpCommunicator::connect(1, &[a0, a1], l1, 0, &S, 500));
    let r0 = TcpCommunicator::connect(0, &[a0, a1, a2], l0, 0, &S, 500);
    assert!(
        matches!(&r0, Err(CommError::Protocol(m)) if m.contains("world")),
        "{r0:?}"
    );
    assert!(h1.join().unwrap().is_err());
    // The peer's listener is bound but nobody ever answers: a timeout naming it.
    let (l0, a0) = bind();
    let (_silent, silent_addr) = bind();
    let r = TcpCommunicator::connect(0, &[a0, silent_addr], l0, 0, &S, 300);
    assert!(
        matches!(
            r,
            Err(CommError::Timeout {
                peer: 1,
                op: "rendezvous",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A bad rank is an argument error.
    let (l0, a0) = bind();
    assert!(matches!(
        TcpCommunicator::connect(1, &[a0], l0, 0, &S, 100),
        Err(CommError::BadShape(_))
    ));
}

#[test]
fn five_ranks_exchange_a_megabyte_each() {
    const N: usize = 1 << 18; // 262 144 f32 = 1 MiB per destination
    let world = 5;
    let t0 = Instant::now();
    run_ranks(group(world, T_MS), move |mut c| {
        let me = c.rank();
        for round in 0..2 {
            let send = (0..world)
                .map(|d| {
                    (0..N)
                        .map(|i| (me * 10 + d + round + i % 1000) as f32)
                        .collect()
                })
                .collect();
            let recv = c.all_to_all_v(send).expect("large all_to_all_v");
            for (src, got) in recv.iter().enumerate() {
                assert_eq!(got.len(), N);
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(i, &x)| x == (src * 10 + me + round + i % 1000) as f32),
                    "rank {me} from {src}"
                );
            }
        }
    });
    let took = t0.elapsed();
    eprintln!("5 ranks x 2 rounds x 1 MiB all_to_all_v: {took:?}");
    assert!(took < Duration::from_secs(30));
}

#[test]
fn communicators_work_behind_a_trait_object() {
    let comms: Vec<Box<dyn Communicator>> = group(3, T_MS)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    let (tx, rx) = mpsc::channel();
    for mut c in comms {
        let tx = tx.clone();
        thread::spawn(move || {
            let r = c.all_gather_u64(&[c.rank() as u64]);
            let _ = tx.send(r.map(|v| v.concat()));
        });
    }
    for _ in 0..3 {
        let r = rx.recv_timeout(HARNESS).expect("rank finished");
        assert_eq!(r.unwrap(), vec![0, 1, 2]);
    }
}

#[test]
fn connector_retries_until_the_peer_listener_is_bound() {
    // A free port outside the usual ephemeral range, so that the other tests (which bind port 0)
    // are unlikely to take it while it is unbound.
    let base = 20_000 + (std::process::id() % 5_000) as u16;
    let Some(a1) = (0..200u16).find_map(|k| {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, base + 17 * k)).ok()?;
        l.local_addr().ok()
    }) else {
        return;
    };
    let (l0, a0) = bind();
    let h0 = thread::spawn(move || TcpCommunicator::connect(0, &[a0, a1], l0, 3, &S, 3_000));
    thread::sleep(Duration::from_millis(200));
    // Rebinding the released port can only fail if someone else took it meanwhile.
    let Ok(l1) = TcpListener::bind(a1) else {
        let _ = h0.join();
        return;
    };
    let r1 = TcpCommunicator::connect(1, &[a0, a1], l1, 3, &S, 3_000);
    let r0 = h0.join().unwrap();
    let (mut c0, mut c1) = match (r0, r1) {
        (Ok(c0), Ok(c1)) => (c0, c1),
        // Someone else's communicator listened there for a while: rightly rejected by the
        // handshake, but this test cannot conclude.
        (Err(CommError::Protocol(m)), _) if m.contains("mismatch") => return,
        other => panic!("{other:?}"),
    };
    let h = thread::spawn(move || c0.barrier());
    c1.barrier().expect("barrier 1");
    h.join().unwrap().expect("barrier 0");
}

/// A hello as this protocol writes it: magic `LZCOMM02`, epoch, world, rank (`u64`
/// little-endian each), then the 32-byte mesh secret.
fn hello(epoch: u64, world: u64, rank: u64, secret: &[u8; MeshSecret::LEN]) -> Vec<u8> {
    let mut b = b"LZCOMM02".to_vec();
    for x in [epoch, world, rank] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b.extend_from_slice(secret);
    b
}

/// The mesh ports took anyone who spoke the handshake: an intruder who knew the epoch, the
/// world size and a rank that had not connected yet (none of them secret) took that rank's
/// place, and the real one was turned away; silent connections held up the rendezvous one
/// second each. Now a hello must carry the mesh secret and silent connections wait side by
/// side: intruders are dropped, and the mesh forms at once and runs.
#[test]
fn intruders_without_the_mesh_secret_are_dropped_and_the_mesh_still_forms() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let (l0, a0) = bind();
    let (l1, a1) = bind();
    let peers = [a0, a1];
    let secret = MeshSecret::random();
    let s1 = secret.clone();
    let h1 = thread::spawn(move || TcpCommunicator::connect(1, &peers, l1, 5, &s1, 10_000));
    // Silent connections first: each would have held up the acceptor for a second.
    let silent: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(a1).unwrap()).collect();
    // The hello of the old protocol, which had no secret, claiming rank 0.
    let mut old = TcpStream::connect(a1).unwrap();
    let mut v1 = hello(5, 2, 0, &[0; MeshSecret::LEN]);
    v1[..8].copy_from_slice(b"LZCOMM01");
    old.write_all(&v1[..32]).unwrap();
    // Today's hello with a wrong secret: refused without a word about the mesh.
    let mut wrong = TcpStream::connect(a1).unwrap();
    wrong
        .write_all(&hello(5, 2, 0, &[0xaa; MeshSecret::LEN]))
        .unwrap();
    wrong.set_read_timeout(Some(HARNESS)).unwrap();
    let mut ack = [0u8; 33];
    wrong.read_exact(&mut ack).unwrap();
    assert_eq!(&ack[..8], b"LZCOMM02");
    assert_eq!(ack[32], 4, "status: wrong secret");
    assert!(
        ack[8..32].iter().all(|&b| b == 0),
        "identity leaked: {ack:?}"
    );
    assert!(
        matches!(wrong.read(&mut [0u8; 8]), Ok(0) | Err(_)),
        "still open"
    );
    // Garbage of a hello's length.
    let mut junk = TcpStream::connect(a1).unwrap();
    junk.write_all(&[0xee; 64]).unwrap();
    let t0 = Instant::now();
    let mut c0 = TcpCommunicator::connect(0, &peers, l0, 5, &secret, 10_000).expect("rank 0");
    let mut c1 = h1.join().unwrap().expect("rank 1");
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(2_500),
        "the mesh took {took:?}"
    );
    let h = thread::spawn(move || c1.all_gather_u64(&[1]).map(|v| (v, c1)));
    assert_eq!(c0.all_gather_u64(&[0]).unwrap(), vec![vec![0], vec![1]]);
    assert_eq!(h.join().unwrap().unwrap().0, vec![vec![0], vec![1]]);
    drop((silent, old, junk));
}

/// A legitimate peer with another secret (say, a member of an older epoch) is told why.
#[test]
fn a_peer_with_another_secret_is_told_why() {
    let (l0, a0) = bind();
    let (l1, a1) = bind();
    let peers = [a0, a1];
    let h1 = thread::spawn(move || TcpCommunicator::connect(1, &peers, l1, 0, &S, 500));
    let other = MeshSecret::from_bytes([1; MeshSecret::LEN]);
    let r0 = TcpCommunicator::connect(0, &peers, l0, 0, &other, 500);
    assert!(
        matches!(&r0, Err(CommError::Protocol(m)) if m.contains("wrong mesh secret")),
        "{r0:?}"
    );
    assert!(matches!(
        h1.join().unwrap(),
        Err(CommError::Timeout { peer: 0, .. })
    ));
}
