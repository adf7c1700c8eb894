//! Control plane: the controller's registration checks, the wire protocol, and the job
//! controller on loopback under paused tokio time (instant and deterministic). The control
//! rules themselves are the planner's job state machine, tested in `planner/tests/job.rs` and
//! by the swarm test.

use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use lazarus_executor::control::proto::{self, ProtoError, Registration};
use lazarus_executor::control::{
    Controller, JobParams, Notice, PROTOCOL_VERSION, Reject, ServerConfig, ToAgent, ToController,
    run_job,
};
use lazarus_executor::model::MoeConfig;
use lazarus_planner::ModelSpec;
use lazarus_planner::job::JobConfig;
use proptest::prelude::*;
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
    }
}

fn reg(token: &str, node: &str, devices: usize, version: u16) -> Registration {
    Registration {
        version,
        token: token.into(),
        node: node.into(),
        devices,
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
        },
        ToController::Heartbeat {
            node_id: 3,
            step: u64::MAX,
        },
        ToController::Bye { node_id: 0 },
        ToController::Worker {
            node_id: 2,
            line: "{\"step\":1}".into(),
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

async fn start(params: JobParams) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, notices) = mpsc::unbounded_channel();
    let (stop, stop_rx) = watch::channel(false);
    let server = ServerConfig {
        tick_ms: 50,
        io_timeout_ms: 1_000,
    };
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
    };
    proto::send(&mut conn, &dup).await.unwrap();
    let reason = expect_rejected(proto::recv(&mut conn).await.unwrap());
    assert!(reason.contains("dup"), "{reason}");
    // The controller survived all of that.
    let (_ok, id) = register(&addr, "after").await;
    assert!(id >= 1);
    server.shutdown().await;
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
    assert!(reason.contains(&format!("node {id} fenced")), "{reason}");
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
        proto::send(conn, &ToController::Worker { node_id: id, line })
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
    let plan = server.log_with("epoch 1: plan v1").await;
    assert!(plan.contains(&format!("[{a}, {b}]")), "{plan}");
    server.shutdown().await;
}
