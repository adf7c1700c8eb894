//! Control plane: the controller's registration checks, the wire protocol, and the job
//! controller on loopback under paused tokio time (instant and deterministic). The control
//! rules themselves are the planner's job state machine, tested in `planner/tests/job.rs` and
//! by the swarm test.

use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use lazarus_executor::control::proto::{self, ProtoError, Registration};
use lazarus_executor::control::{
    Agent, AgentConfig, AgentError, Controller, JobParams, Notice, Output, PROTOCOL_VERSION,
    Reject, ServerConfig, ToAgent, ToController, run_job,
};
use lazarus_executor::model::MoeConfig;
use lazarus_planner::ModelSpec;
use lazarus_planner::job::JobConfig;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

const TOKEN: &str = "cluster-secret";
const V: u16 = PROTOCOL_VERSION;

/// Generous virtual-time bound on every wait (virtual, so it costs nothing).
const WAIT: Duration = Duration::from_secs(60);

/// The tiny model on `nodes` nodes, 1 s heartbeat timeout, 5 s member timeout.
fn params(nodes: usize) -> JobParams {
    let config = MoeConfig::tiny();
    let model = ModelSpec {
        experts: config.experts,
        layers: config.n_layers,
        f: 2,
    };
    let mut rules = JobConfig::new(model, 4, 4);
    rules.initial_nodes = nodes;
    rules.heartbeat_timeout_ms = 1_000;
    rules.member_timeout_ms = 5_000;
    JobParams {
        config,
        rules,
        token: TOKEN.into(),
        timeout_ms: 1_000,
        checkpoint: None,
        checkpoint_keep: 1,
        out: None,
        resume: None,
        router_skew: 0.0,
        verify_every: 1,
        data: None,
        eval: None,
    }
}

fn reg(token: &str, node: &str, devices: usize, version: u16) -> Registration {
    Registration {
        version,
        token: token.into(),
        node: node.into(),
        devices,
        host: String::new(),
    }
}

#[test]
fn registration_checks_token_version_devices_and_names() {
    let mut c = Controller::new(params(2)).unwrap();
    let mut out = Vec::new();
    let mut r = |reg: Registration, now: u64| c.register(&reg, now, &mut out);
    assert_eq!(r(reg("wrong", "a", 1, V), 0), Err(Reject::BadToken));
    assert_eq!(r(reg("", "a", 1, V), 0), Err(Reject::BadToken));
    assert_eq!(
        r(reg(TOKEN, "a", 1, V + 1), 0),
        Err(Reject::Version {
            agent: V + 1,
            controller: V
        })
    );
    assert_eq!(
        r(reg(TOKEN, "a", 0, V), 0),
        Err(Reject::NoDevices("a".into()))
    );
    let bad_host = Registration {
        host: "h 0".into(),
        ..reg(TOKEN, "a", 1, V)
    };
    assert!(
        matches!(r(bad_host, 0), Err(Reject::BadName { ref name, .. }) if name.contains("host")),
    );
    let a = r(reg(TOKEN, "a", 2, V), 0).unwrap();
    assert_eq!(
        r(reg(TOKEN, "a", 1, V), 0),
        Err(Reject::DuplicateName("a".into()))
    );
    let reason = Reject::Version {
        agent: 9,
        controller: 1,
    }
    .to_string();
    assert!(reason.contains("v9") && reason.contains("v1"), "{reason}");
    // Once the old incarnation is fenced (no heartbeat), the name is free, with a fresh id.
    c.tick(1_001, &mut out);
    assert!(
        out.iter()
            .any(|o| matches!(o, lazarus_executor::control::Output::Close(id) if *id == a))
    );
    let again = c.register(&reg(TOKEN, "a", 2, V), 1_001, &mut out).unwrap();
    assert_ne!(again, a);
    assert_eq!(c.machine().live_nodes(), vec![again]);
}

#[test]
fn protocol_round_trips() {
    let to_controller = [
        ToController::Register {
            version: V,
            token: TOKEN.into(),
            node: "gpu-17".into(),
            devices: 8,
            host: String::new(),
        },
        ToController::Heartbeat {
            node_id: 3,
            step: u64::MAX,
        },
        ToController::Bye { node_id: 0 },
        ToController::Worker {
            node_id: 2,
            seq: 7,
            line: "{\"step\":1}".into(),
        },
        ToController::Reattach {
            version: V,
            token: TOKEN.into(),
            node: "gpu-17".into(),
            devices: 8,
            node_id: 3,
            last_seq: 12,
            worker: lazarus_planner::job::reconcile::WorkerReport::default(),
        },
    ];
    for msg in &to_controller {
        let bytes = proto::encode(msg).unwrap();
        assert_eq!(&proto::decode::<ToController>(&bytes).unwrap(), msg);
    }
    let to_agent = [
        ToAgent::Registered { node_id: 9 },
        ToAgent::Rejected {
            reason: "wrong cluster token".into(),
        },
        ToAgent::Shutdown,
        ToAgent::Worker {
            line: "\"Stop\"".into(),
        },
        ToAgent::Ack { seq: 12 },
        ToAgent::Reattached {
            node_id: 3,
            acked_seq: 11,
        },
    ];
    for msg in &to_agent {
        let bytes = proto::encode(msg).unwrap();
        assert_eq!(&proto::decode::<ToAgent>(&bytes).unwrap(), msg);
    }
}

#[test]
fn garbage_frames_are_decode_errors() {
    let decode = |b: &[u8]| proto::decode::<ToController>(b);
    assert!(matches!(decode(&[]), Err(ProtoError::Decode { .. })));
    assert!(matches!(
        decode(&[0xff, 0xff, 0xff]),
        Err(ProtoError::Decode { .. })
    ));
    // Variant 3 (Worker) claiming a ~2^63-byte line: an error, not an allocation.
    let huge = [3, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
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
// The job controller on loopback, paused time
// ---------------------------------------------------------------------------------------------

struct Server {
    addr: String,
    notices: mpsc::UnboundedReceiver<Notice>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// Ticks every 50 ms, 1 s to register, the default connection limits.
fn server_config() -> ServerConfig {
    ServerConfig::new(50, 1_000)
}

async fn start(params: JobParams) -> Server {
    start_with(params, server_config()).await
}

async fn start_with(params: JobParams, server: ServerConfig) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, notices) = mpsc::unbounded_channel();
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        run_job(listener, server, params, tx, stop_rx, |_| {})
            .await
            .unwrap();
    });
    Server {
        addr,
        notices,
        stop,
        task,
    }
}

impl Server {
    async fn shutdown(self) {
        self.stop.send(true).unwrap();
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }

    /// The next log notice containing `needle`.
    async fn log_with(&mut self, needle: &str) -> String {
        loop {
            match tokio::time::timeout(WAIT, self.notices.recv()).await {
                Ok(Some(Notice::Log(l))) if l.contains(needle) => return l,
                Ok(Some(_)) => {}
                other => panic!("no notice with {needle:?}: {other:?}"),
            }
        }
    }
}

async fn raw(addr: &str) -> proto::Framed {
    proto::framed(TcpStream::connect(addr).await.unwrap())
}

fn expect_rejected(msg: Option<ToAgent>) -> String {
    match msg {
        Some(ToAgent::Rejected { reason }) => reason,
        other => panic!("expected Rejected, got {other:?}"),
    }
}

/// Registers `name` on a raw connection; returns the connection and the node id, after the
/// `Job` command arrived.
async fn register(addr: &str, name: &str) -> (proto::Framed, u32) {
    let mut conn = raw(addr).await;
    let register = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: name.into(),
        devices: 1,
        host: String::new(),
    };
    proto::send(&mut conn, &register).await.unwrap();
    let id = match proto::recv(&mut conn).await.unwrap() {
        Some(ToAgent::Registered { node_id }) => node_id,
        other => panic!("expected Registered, got {other:?}"),
    };
    match proto::recv::<ToAgent>(&mut conn).await.unwrap() {
        Some(ToAgent::Worker { line }) => assert!(line.starts_with("{\"Job\""), "{line}"),
        other => panic!("expected the Job command, got {other:?}"),
    }
    (conn, id)
}

#[tokio::test(start_paused = true)]
async fn rejections_over_tcp_leave_the_controller_serving() {
    let server = start(params(2)).await;
    let addr = server.addr.clone();
    // Garbage instead of Register: a clear rejection, no panic, connection closed after.
    let mut conn = raw(&addr).await;
    conn.send(Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef]))
        .await
        .unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("malformed"), "{reason}");
    assert!(proto::recv::<ToAgent>(&mut conn).await.unwrap().is_none());
    // A future agent whose Register layout changed: the version is still read.
    let mut conn = raw(&addr).await;
    let future = postcard::to_stdvec(&(0u32, 99u16, [1.5f64, 2.5], "new field")).unwrap();
    conn.send(Bytes::from(future)).await.unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("v99"), "{reason}");
    // A wrong token, then a duplicate name.
    let mut conn = raw(&addr).await;
    let bad = ToController::Register {
        version: V,
        token: "guess".into(),
        node: "x".into(),
        devices: 1,
        host: String::new(),
    };
    proto::send(&mut conn, &bad).await.unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("token"), "{reason}");
    let (_first, _) = register(&addr, "dup").await;
    let mut conn = raw(&addr).await;
    let dup = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: "dup".into(),
        devices: 1,
        host: String::new(),
    };
    proto::send(&mut conn, &dup).await.unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("dup"), "{reason}");
    // The controller survived all of that.
    let (_ok, id) = register(&addr, "after").await;
    assert!(id >= 1);
    server.shutdown().await;
}

/// Issue 33 item 6.1: `--slots 18446744073709551615` made the planner panic ("capacity
/// overflow") inside a connection task, which the server dropped unseen: the job never moved
/// and `lzrun local` never exited. A panic in a connection task now ends the server as a panic
/// of its own (its runner restarts it or fails the job), within a tick.
#[tokio::test(start_paused = true)]
async fn a_panic_while_serving_a_connection_ends_the_server_instead_of_hanging_it() {
    let mut p = params(2);
    // Passes the job's validation, panics in the planner's placement (MRO grid rows).
    p.rules.slots_per_node = usize::MAX;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, _notices) = mpsc::unbounded_channel();
    let (_stop, stop_rx) = watch::channel(false);
    // Ticks 10 s apart: no tick of the server's own task plans (and panics) meanwhile.
    let server = ServerConfig::new(10_000, 1_000);
    let task = tokio::spawn(run_job(listener, server, p, tx, stop_rx, |_| {}));
    let (mut a, ida) = register(&addr, "a").await;
    let (mut b, idb) = register(&addr, "b").await;
    for (conn, id, port) in [(&mut a, ida, 7001), (&mut b, idb, 7002)] {
        let line = format!("{{\"Ready\":{{\"addr\":\"127.0.0.1:{port}\"}}}}");
        let msg = ToController::Worker {
            node_id: id,
            seq: 1,
            line,
        };
        let _ = proto::send(conn, &msg).await;
    }
    let sent = Instant::now();
    let ended = tokio::time::timeout(WAIT, task)
        .await
        .expect("the server hung after a panic in a connection task");
    let e = ended.expect_err("the server must end as a panic, not report success");
    assert!(e.is_panic(), "{e}");
    // At once: not when a later tick (a heartbeat timeout, 1 s) happens to plan again in the
    // server's own task.
    assert!(
        sent.elapsed() < Duration::from_millis(500),
        "{:?}",
        sent.elapsed()
    );
}

/// A registered node that never heartbeats is declared gone one heartbeat timeout later and
/// fenced: it is told so and its next heartbeat is refused.
#[tokio::test(start_paused = true)]
async fn a_silent_node_is_fenced_after_one_heartbeat_timeout() {
    let mut server = start(params(2)).await;
    let (mut conn, id) = register(&server.addr, "quiet").await;
    let registered = Instant::now();
    let gone = server.log_with("is gone").await;
    assert!(gone.contains("no heartbeat"), "{gone}");
    let waited = registered.elapsed();
    assert!(
        waited >= Duration::from_millis(1_000) && waited <= Duration::from_millis(1_200),
        "fenced after {waited:?}"
    );
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    // Issue 35 item 6: named by its name, not by the id the controller gave it.
    assert!(reason.contains("node quiet fenced"), "{reason} (id {id})");
    server.shutdown().await;
}

/// Bug 2 of the control-plane issue: an agent that registers and heartbeats but never starts
/// its worker stalled the start of the job forever. It is fenced after the member timeout and
/// the job starts with the others. Real time (≈ 1.5 s): heartbeats must keep flowing over
/// the sockets while the timeout runs, which paused time would skip past.
#[tokio::test]
async fn an_agent_whose_worker_never_starts_is_fenced_and_the_job_starts_without_it() {
    let mut p = params(2);
    p.rules.member_timeout_ms = 1_500;
    let mut server = start(p).await;
    let addr = server.addr.clone();
    let (mut ready_a, a) = register(&addr, "a").await;
    let (mut ready_b, b) = register(&addr, "b").await;
    let (mut stuck, s) = register(&addr, "stuck").await;
    for (conn, id, port) in [(&mut ready_a, a, 7001), (&mut ready_b, b, 7002)] {
        let line = format!("{{\"Ready\":{{\"addr\":\"127.0.0.1:{port}\"}}}}");
        proto::send(
            conn,
            &ToController::Worker {
                node_id: id,
                seq: 1,
                line,
            },
        )
        .await
        .unwrap();
    }
    let started = Instant::now();
    let heartbeats = async {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for (conn, id) in [(&mut ready_a, a), (&mut ready_b, b), (&mut stuck, s)] {
                let hb = ToController::Heartbeat {
                    node_id: id,
                    step: 0,
                };
                let _ = proto::send(conn, &hb).await;
            }
        }
    };
    let fenced = async {
        loop {
            match tokio::time::timeout(WAIT, server.notices.recv()).await {
                Ok(Some(Notice::Fenced { name, reason })) => return (name, reason),
                Ok(Some(_)) => {}
                other => panic!("nobody was fenced: {other:?}"),
            }
        }
    };
    let (name, reason) = tokio::select! {
        fenced = fenced => fenced,
        _ = heartbeats => unreachable!(),
    };
    assert_eq!(name, "stuck", "{reason}");
    assert!(reason.contains("never became ready"), "{reason}");
    let waited = started.elapsed();
    assert!(
        waited > Duration::from_millis(1_400) && waited < Duration::from_millis(5_000),
        "{waited:?}"
    );
    // The members by name, in rank order (ids {a} and {b}).
    let plan = server.log_with("epoch 1: plan v1").await;
    assert!(
        plan.contains("[a, b] (rank order)"),
        "{plan} (ids {a}, {b})"
    );
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Abuse by peers (issue 14, item 5): memory, connections, registration fields, log lines
// ---------------------------------------------------------------------------------------------

/// How soon the controller must close a connection it refuses outright: far below the 1 s it
/// grants for a Register (virtual time).
const AT_ONCE: Duration = Duration::from_millis(100);

/// Whether the controller closes `stream` within `within` without sending anything.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(within, stream.read(&mut buf)).await {
        // End of stream, or a reset (it closed with our bytes unread).
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(n)) => panic!("expected the connection to close, got {n} bytes"),
        Err(_) => false,
    }
}

/// A connection that has sent the 4-byte length prefix of a `len`-byte frame and a few bytes.
async fn announcing(addr: &str, len: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let prefix = u32::try_from(len).unwrap().to_be_bytes();
    // The controller may already have closed it: write errors are fine.
    let _ = s.write_all(&prefix).await;
    let _ = s.write_all(&[0; 16]).await;
    s
}

/// Before registering, a peer could announce 64 MiB frames and the controller reserved that
/// much for each, on any number of connections (32 of them: 2 GB). Now a first frame over
/// 4 KiB closes the connection at once, and agents still register.
#[tokio::test(start_paused = true)]
async fn huge_length_prefixes_before_registration_are_closed_at_once() {
    let server = start(params(2)).await;
    let addr = server.addr.clone();
    let mut flood = Vec::new();
    for _ in 0..32 {
        flood.push(announcing(&addr, proto::MAX_FRAME_BYTES - 1).await);
    }
    for (i, s) in flood.iter_mut().enumerate() {
        assert!(
            closed_within(s, AT_ONCE).await,
            "connection {i} announcing 64 MiB is still open"
        );
    }
    // The cap is exact: one byte over is refused too.
    let mut over = announcing(&addr, proto::MAX_REGISTER_FRAME_BYTES + 1).await;
    assert!(closed_within(&mut over, AT_ONCE).await);
    // A Register with a 100 KB node name is such a frame.
    let long_name = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: "n".repeat(100_000),
        devices: 1,
        host: String::new(),
    };
    let payload = proto::encode(&long_name).unwrap();
    let mut long = announcing(&addr, payload.len()).await;
    let _ = long.write_all(&payload[16..]).await;
    assert!(closed_within(&mut long, AT_ONCE).await);
    let (_agent, _) = register(&addr, "after-the-flood").await;
    server.shutdown().await;
}

/// Any number of connections could stay open without registering. Now at most
/// `max_pending_conns` unregistered and `max_conns` in all are kept; more are closed as soon
/// as they are accepted, and the slots come back when connections end.
#[tokio::test(start_paused = true)]
async fn connections_over_the_limits_are_closed_at_once() {
    let config = ServerConfig {
        max_pending_conns: 2,
        max_conns: 3,
        ..server_config()
    };
    let server = start_with(params(2), config).await;
    let addr = server.addr.clone();
    // Two idle connections take both unregistered slots: a third is closed at once...
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(TcpStream::connect(&addr).await.unwrap());
    }
    let mut third = TcpStream::connect(&addr).await.unwrap();
    assert!(
        closed_within(&mut third, AT_ONCE).await,
        "over max_pending_conns"
    );
    // ...while the two keep their slots (until their Register deadline).
    for s in &mut idle {
        assert!(!closed_within(s, AT_ONCE).await);
    }
    // They leave: their slots are free again.
    drop(idle);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Two registered nodes and one idle connection fill all three slots: a fourth connection
    // is closed at once although an unregistered slot is free.
    let (_a, _) = register(&addr, "a").await;
    let (_b, _) = register(&addr, "b").await;
    let idle = TcpStream::connect(&addr).await.unwrap();
    let mut fourth = TcpStream::connect(&addr).await.unwrap();
    assert!(closed_within(&mut fourth, AT_ONCE).await, "over max_conns");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (_c, _) = register(&addr, "c").await;
    server.shutdown().await;
}

/// Issue 33 item 6.4: 70 idle connections reopened every 2 s held all 64 unregistered slots,
/// and real agents were refused (and gave up at once). One address now holds at most
/// `max_pending_per_addr` of them: a flood from 127.0.0.2 leaves room for an agent on
/// 127.0.0.1.
#[tokio::test(start_paused = true)]
async fn a_flood_of_idle_connections_from_one_address_does_not_lock_out_the_others() {
    let server = start(params(2)).await;
    let addr: std::net::SocketAddr = server.addr.parse().unwrap();
    let mut flood = Vec::new();
    for _ in 0..70 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        flood.push(sock.connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let open = {
        let mut n = 0;
        for s in &mut flood {
            if !closed_within(s, Duration::from_millis(10)).await {
                n += 1;
            }
        }
        n
    };
    assert_eq!(open, ServerConfig::DEFAULT_MAX_PENDING_PER_ADDR);
    let (_agent, _) = register(&server.addr, "real").await;
    drop(flood);
    server.shutdown().await;
}

/// Issue 33 item 6.4: an agent refused or unanswered gave up at once ("cannot connect", exit 2)
/// although its --register-timeout-ms had time left. It now tries again with back-off until
/// the time is up: here the controller starts listening 300 ms after the agent tried first.
#[tokio::test(start_paused = true)]
async fn an_agent_keeps_trying_to_register_until_its_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let (stop, stop_rx) = watch::channel(false);
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let (tx, _notices) = mpsc::unbounded_channel();
        run_job(listener, server_config(), params(2), tx, stop_rx, |_| {})
            .await
            .unwrap();
    });
    let mut cfg = AgentConfig::new(&addr, TOKEN, "patient", 1);
    cfg.register_timeout_ms = 5_000;
    let t0 = Instant::now();
    let agent = Agent::register(&cfg)
        .await
        .expect("registered once it listened");
    assert!(t0.elapsed() >= Duration::from_millis(300));
    drop(agent);
    // With nothing listening for its whole timeout, the last failure is the error, on time.
    let mut cfg = AgentConfig::new("127.0.0.1:1", TOKEN, "alone", 1);
    cfg.register_timeout_ms = 2_000;
    let t0 = Instant::now();
    let err = Agent::register(&cfg).await.unwrap_err();
    assert!(matches!(err, AgentError::Connect { .. }), "{err}");
    assert!(
        t0.elapsed() <= Duration::from_millis(2_000),
        "{:?}",
        t0.elapsed()
    );
    stop.send(true).unwrap();
    late.await.unwrap();
}

/// A slow sender cannot hold an unregistered slot: the whole first frame must arrive within
/// `io_timeout_ms` (1 s here), however steadily it trickles in.
#[tokio::test(start_paused = true)]
async fn a_register_trickled_byte_by_byte_is_cut_off_at_the_deadline() {
    let server = start(params(2)).await;
    let slow = ToController::Register {
        version: V,
        token: TOKEN.into(),
        node: "a-node-that-sends-one-byte-every-100-ms".into(),
        devices: 1,
        host: String::new(),
    };
    let payload = proto::encode(&slow).unwrap();
    let mut frame = u32::try_from(payload.len()).unwrap().to_be_bytes().to_vec();
    frame.extend_from_slice(&payload);
    assert!(
        frame.len() > 20,
        "the frame must take longer than the deadline"
    );
    let (mut rd, mut wr) = TcpStream::connect(&server.addr).await.unwrap().into_split();
    let t0 = Instant::now();
    let trickle = tokio::spawn(async move {
        for b in frame {
            if wr.write_all(&[b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        wr
    });
    // The controller answers why and closes (or the close overtakes the answer as a reset).
    let mut got = Vec::new();
    let _ = tokio::time::timeout(WAIT, rd.read_to_end(&mut got))
        .await
        .unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(1_000) && waited <= Duration::from_millis(1_100),
        "closed after {waited:?}"
    );
    if got.len() > 4 {
        let reason = expect_rejected(proto::decode(&got[4..]).ok());
        assert!(reason.contains("no Register within 1000 ms"), "{reason}");
    }
    trickle.abort();
    let (_ok, _) = register(&server.addr, "prompt").await;
    server.shutdown().await;
}

/// A token holder could register `usize::MAX` devices, a 100 KB name or a name carrying
/// newlines and ANSI escapes that forge log lines. Names are now 1..=253 bytes of
/// `[A-Za-z0-9._:-]`, devices 1..=1024, and the reason never echoes the raw name.
#[test]
fn registration_refuses_absurd_device_counts_and_names() {
    let mut c = Controller::new(params(2)).unwrap();
    let mut out = Vec::new();
    let mut r = |reg: Registration| c.register(&reg, 0, &mut out);
    for devices in [usize::MAX, 1_025] {
        assert_eq!(
            r(reg(TOKEN, "many", devices, V)),
            Err(Reject::TooManyDevices {
                node: "many".into(),
                devices
            })
        );
    }
    let forged = "evil\n[lzrun] node 0 fenced: \u{1b}[2Jgone";
    for name in [
        String::new(),
        "n".repeat(100_000),
        "n".repeat(254),
        forged.to_owned(),
        "tab\there".into(),
        "space here".into(),
        "rtl\u{202e}txt".into(),
        "caf\u{e9}".into(),
    ] {
        let reason = match r(reg(TOKEN, &name, 1, V)) {
            Err(e @ Reject::BadName { .. }) => e.to_string(),
            other => panic!("{name:?} was not refused for its name: {other:?}"),
        };
        assert!(reason.len() < 200, "{reason}");
        assert!(!reason.chars().any(char::is_control), "{reason:?}");
        assert!(!reason.contains('\u{202e}'), "{reason:?}");
    }
    // What is allowed: host names, addresses, the longest DNS name, many devices.
    for (name, devices) in [
        ("gpu-17.cluster.example", 1_024),
        ("127.0.0.1:29500", 8),
        ("node_1", 1),
        (&*"a".repeat(253), 1),
    ] {
        assert!(r(reg(TOKEN, name, devices, V)).is_ok(), "{name}");
    }
    // The token is checked before anything else, so strangers learn nothing about the rules.
    assert_eq!(r(reg("wrong", "", usize::MAX, V)), Err(Reject::BadToken));
}

/// Two registered, ready nodes and the controller's outputs so far (the first plan).
fn ready_pair() -> (Controller, Vec<Output>, u32, u32) {
    let mut c = Controller::new(params(2)).unwrap();
    let mut out = Vec::new();
    let a = c.register(&reg(TOKEN, "a", 1, V), 0, &mut out).unwrap();
    let b = c.register(&reg(TOKEN, "b", 1, V), 0, &mut out).unwrap();
    for (id, port) in [(a, 7001), (b, 7002)] {
        let line = format!("{{\"Ready\":{{\"addr\":\"127.0.0.1:{port}\"}}}}");
        c.line(id, &line, 1, &mut out);
    }
    (c, out, a, b)
}

/// The `Reconfigure` commands in `out`, by node.
fn reconfigures(out: &[Output]) -> Vec<(u32, lazarus_executor::worker::Reconfigure)> {
    use lazarus_executor::worker::Command;
    out.iter()
        .filter_map(|o| match o {
            Output::Send(id, ToAgent::Worker { line }) => {
                match serde_json::from_str::<Command>(line).ok()? {
                    Command::Reconfigure(r) => Some((*id, r)),
                    _ => None,
                }
            }
            _ => None,
        })
        .collect()
}

/// A worker's error text reaches the controller's log: a newline or escape sequence in it
/// could forge log lines. It is escaped now.
#[test]
fn worker_errors_are_escaped_before_they_are_logged() {
    let (mut c, out, a, _) = ready_pair();
    let epoch = reconfigures(&out)[0].1.epoch;
    let error = "boom\n[lzrun] node 1 fenced: forged\u{1b}[31m";
    let line = serde_json::json!({
        "Failed": {"epoch": epoch, "step": 0, "error": error, "held": []}
    })
    .to_string();
    let mut out = Vec::new();
    c.line(a, &line, 2, &mut out);
    let logs: Vec<&String> = out
        .iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Log(l)) => Some(l),
            _ => None,
        })
        .collect();
    let failed = logs
        .iter()
        .find(|l| l.contains("failed"))
        .unwrap_or_else(|| panic!("no failure logged: {logs:?}"));
    assert!(failed.contains(r"boom\n[lzrun]"), "{failed}");
    assert!(failed.contains(r"\u{1b}[31m"), "{failed}");
    for l in &logs {
        assert!(!l.chars().any(char::is_control), "{l:?}");
    }
}

/// The agent prints the controller's rejection reason; from a rogue controller that text
/// could carry escape sequences. The agent escapes it.
#[tokio::test(start_paused = true)]
async fn an_agent_escapes_the_rejection_reason_it_prints() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rogue = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut conn = proto::framed(stream);
        let _ = proto::recv::<ToController>(&mut conn).await;
        let reason = "no\n[lzrun] all is well\u{1b}[2J".to_owned();
        proto::send(&mut conn, &ToAgent::Rejected { reason })
            .await
            .unwrap();
    });
    let cfg = AgentConfig::new(addr, TOKEN, "a", 1);
    let reason = match Agent::register(&cfg).await {
        Err(AgentError::Rejected { reason }) => reason,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert_eq!(reason, r"no\n[lzrun] all is well\u{1b}[2J");
    rogue.await.unwrap();
    // An agent whose Register would exceed the controller's first-frame cap says so itself.
    let cfg = AgentConfig::new("127.0.0.1:1", "t".repeat(5_000), "a", 1);
    assert!(matches!(
        Agent::register(&cfg).await,
        Err(AgentError::RegisterTooLarge { .. })
    ));
}

/// The workers' mesh ports are authenticated by a secret the controller sends with every
/// reconfiguration: the same for every member of an epoch, fresh for the next epoch.
#[test]
fn every_epoch_gets_a_fresh_mesh_secret_shared_by_its_members() {
    use lazarus_executor::comm::MeshSecret;
    let (mut c, out, a, b) = ready_pair();
    let first = reconfigures(&out);
    assert_eq!(first.len(), 2, "{out:?}");
    let epoch = first[0].1.epoch;
    let secret = first[0].1.secret.clone();
    assert!(
        first
            .iter()
            .all(|(_, r)| r.secret == secret && r.epoch == epoch)
    );
    assert_ne!(secret, MeshSecret::unset());
    assert_eq!(format!("{secret:?}"), "MeshSecret(..)");
    // Both members fail the start: the controller plans a new epoch.
    let mut out = Vec::new();
    for id in [a, b] {
        let line = serde_json::json!({
            "Failed": {"epoch": epoch, "step": 0, "error": "mesh lost", "held": []}
        })
        .to_string();
        c.line(id, &line, 2, &mut out);
    }
    let second = reconfigures(&out);
    assert_eq!(second.len(), 2, "{out:?}");
    assert!(second[0].1.epoch > epoch);
    assert_eq!(second[0].1.secret, second[1].1.secret);
    assert_ne!(second[0].1.secret, secret);
}
