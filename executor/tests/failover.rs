//! Controller fail-over (issue 14 item 9): the controller saves its job state at every change,
//! a controller rebuilt from that state takes the job back, agents reattach and send again the
//! lines its saved state lacks. Here at the level of the [`Controller`] (deterministic, no
//! sockets) and of the tokio server under paused time; end to end (real processes, SIGKILL) in
//! `tests/lzrun.rs`. The decisions themselves are the planner's (`job::reconcile`).

use std::path::PathBuf;
use std::time::Duration;

use lazarus_executor::control::proto::{self, Reattachment, Registration};
use lazarus_executor::control::{
    Controller, JobParams, Notice, Output, PROTOCOL_VERSION, Reject, ServerConfig, StateError,
    ToAgent, ToController, serve_controller,
};
use lazarus_executor::model::MoeConfig;
use lazarus_executor::worker::{Command, Reconfigure};
use lazarus_planner::ModelSpec;
use lazarus_planner::job::JobConfig;
use lazarus_planner::job::reconcile::{WorkerProcess, WorkerReport};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

const TOKEN: &str = "cluster-secret";

fn params(nodes: usize, heartbeat_timeout_ms: u64) -> JobParams {
    let config = MoeConfig::tiny();
    let model = ModelSpec {
        experts: config.experts,
        layers: config.n_layers,
        f: 2,
    };
    let mut rules = JobConfig::new(model, 4, 20);
    rules.initial_nodes = nodes;
    rules.heartbeat_timeout_ms = heartbeat_timeout_ms;
    rules.member_timeout_ms = 5 * heartbeat_timeout_ms;
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

fn state_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("failover-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn reg(node: &str) -> Registration {
    Registration {
        version: PROTOCOL_VERSION,
        token: TOKEN.into(),
        node: node.into(),
        devices: 1,
        host: String::new(),
    }
}

fn reattachment(node: &str, node_id: u32, worker: WorkerReport) -> Reattachment {
    Reattachment {
        registration: reg(node),
        node_id,
        last_seq: 0,
        worker,
    }
}

fn running(epoch: u64, plan_version: u64, next_step: u64) -> WorkerReport {
    WorkerReport {
        process: WorkerProcess::Running,
        epoch,
        plan_version,
        next_step,
    }
}

fn ready_line(port: u16) -> String {
    format!("{{\"Ready\":{{\"addr\":\"127.0.0.1:{port}\"}}}}")
}

fn migrated_line(epoch: u64) -> String {
    serde_json::json!({"Migrated": {
        "epoch": epoch, "rank": 0, "world": 2, "resume_step": 0, "bytes_in": 0, "ms": 1.0
    }})
    .to_string()
}

fn step_line(epoch: u64, step: u64) -> String {
    serde_json::json!({"step": step, "epoch": epoch, "loss": 3.0, "tokens": 8, "ms": 1.0})
        .to_string()
}

/// The `Reconfigure` commands in `out`, by node.
fn reconfigures(out: &[Output]) -> Vec<(u32, Reconfigure)> {
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

/// A step report with routed tokens `[layer][expert]` (2 layers, 4 experts: the tiny model).
fn routed_step_line(epoch: u64, step: u64, routing: &[[u64; 4]; 2]) -> String {
    serde_json::json!({"step": step, "epoch": epoch, "loss": 3.0, "tokens": 8, "ms": 1.0,
        "routing": routing})
    .to_string()
}

/// The numbered step records in `out`: (sequence number, step, handed out again).
fn numbered_steps(out: &[Output]) -> Vec<(u64, u64, bool)> {
    out.iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Step { seq, record, again }) => {
                Some((*seq, record.step, *again))
            }
            _ => None,
        })
        .collect()
}

fn steps(out: &[Output]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Step { record: r, .. }) => Some(r.step),
            _ => None,
        })
        .collect()
}

fn logs(out: &[Output]) -> String {
    out.iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Log(l)) => Some(l.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Two nodes registered, ready and migrated into epoch 1 on a controller that saves into `dir`.
fn started(dir: &std::path::Path) -> (Controller, u32, u32, Reconfigure) {
    let mut c = Controller::new(params(2, 1_000)).unwrap();
    c.save_to(dir, None).unwrap();
    let mut out = Vec::new();
    let a = c.register(&reg("a"), 0, &mut out).unwrap();
    let b = c.register(&reg("b"), 0, &mut out).unwrap();
    for (id, port) in [(a, 7001), (b, 7002)] {
        c.worker_line(id, 1, &ready_line(port), 1, &mut out);
    }
    let first = reconfigures(&out);
    assert_eq!(first.len(), 2, "{out:?}");
    for id in [a, b] {
        c.worker_line(id, 2, &migrated_line(1), 2, &mut out);
    }
    (c, a, b, first[0].1.clone())
}

/// The core of issue 14 item 9, without sockets: what is saved, what is acknowledged, and how a
/// controller rebuilt from the directory takes the job back in place from the lines agents
/// send again.
#[test]
fn a_controller_rebuilt_from_its_saved_state_takes_the_job_back_in_place() {
    let dir = state_dir("in-place");
    let (mut c, a, b, _) = started(&dir);
    let mut out = Vec::new();
    // Step 0 completes (a change: saved); node a's report of step 1 changes nothing saved.
    c.worker_line(a, 3, &step_line(1, 0), 10, &mut out);
    c.worker_line(b, 3, &step_line(1, 0), 11, &mut out);
    c.worker_line(a, 4, &step_line(1, 1), 12, &mut out);
    assert_eq!(steps(&out), vec![0]);
    assert_eq!(
        (c.acked(a), c.acked(b)),
        (3, 3),
        "the step-1 report is not saved yet"
    );
    // A line sent again (after a reattach) is handled once.
    c.worker_line(a, 3, &step_line(1, 0), 13, &mut out);
    drop(c); // the crash: nothing more is written

    let mut c = Controller::recover(&dir, TOKEN).unwrap();
    assert_eq!(
        c.clock_start_ms(),
        11,
        "the clock goes on from the last save"
    );
    let mut out = Vec::new();
    c.start(20, &mut out);
    assert!(
        logs(&out).contains("1 of 20 steps counted"),
        "{}",
        logs(&out)
    );
    // The agents come back: a holds steps up to 2 (it trained on), b up to 1.
    let mut out = Vec::new();
    assert_eq!(
        c.reattach(&reattachment("a", a, running(1, 1, 3)), 30, &mut out),
        Ok((a, 3))
    );
    assert_eq!(
        c.reattach(&reattachment("b", b, running(1, 1, 2)), 31, &mut out),
        Ok((b, 3))
    );
    assert!(
        reconfigures(&out).is_empty(),
        "in place: nothing is reconfigured"
    );
    assert!(
        logs(&out).contains("training resumes in place"),
        "{}",
        logs(&out)
    );
    // They send again what the saved state lacks; training counts on as if nothing happened.
    let mut out = Vec::new();
    c.worker_line(a, 4, &step_line(1, 1), 32, &mut out);
    c.worker_line(a, 5, &step_line(1, 2), 33, &mut out);
    c.worker_line(b, 4, &step_line(1, 1), 34, &mut out);
    c.worker_line(b, 5, &step_line(1, 2), 35, &mut out);
    assert_eq!(steps(&out), vec![1, 2]);
    assert!(reconfigures(&out).is_empty());
    assert_eq!((c.acked(a), c.acked(b)), (5, 5));
    assert_eq!(c.machine().epoch(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The soak defect of issue 33 item 7: a controller that counted (and saved) steps whose records
/// whoever runs the job had not received yet, and then died, lost those records (`steps.csv`
/// missed steps 238–249 of 250). Records are numbered and kept with the saved state until
/// acknowledged; the controller rebuilt from it hands out again, in order and under the same
/// numbers, those not acknowledged (routing included), and numbers on from there.
#[test]
fn records_counted_but_not_delivered_before_a_crash_are_handed_out_again_in_order() {
    let dir = state_dir("records");
    let (mut c, a, b, _) = started(&dir);
    let routing = |s: u64| [[s, 1, 2, 3], [4, 5, 6, s + 7]];
    // Steps 0 and 1 are counted and reach the launcher, which acknowledges them.
    let mut out = Vec::new();
    let mut seq = 3;
    for step in 0..2 {
        for id in [a, b] {
            c.worker_line(
                id,
                seq,
                &routed_step_line(1, step, &routing(step)),
                10,
                &mut out,
            );
        }
        seq += 1;
    }
    // Number 1 is the start's reconfiguration record.
    assert_eq!(numbered_steps(&out), vec![(2, 0, false), (3, 1, false)]);
    c.delivered(3);
    assert_eq!(c.undelivered(), Vec::<u64>::new());
    // Steps 2 and 3 are counted and saved; their records die with the controller.
    let mut lost = Vec::new();
    for step in 2..4 {
        for id in [a, b] {
            c.worker_line(
                id,
                seq,
                &routed_step_line(1, step, &routing(step)),
                20,
                &mut lost,
            );
        }
        seq += 1;
    }
    assert_eq!(numbered_steps(&lost), vec![(4, 2, false), (5, 3, false)]);
    assert_eq!(c.undelivered(), vec![4, 5]);
    drop(c);

    let mut c = Controller::recover(&dir, TOKEN).unwrap();
    let mut out = Vec::new();
    c.start(30, &mut out);
    assert_eq!(
        numbered_steps(&out),
        vec![(4, 2, true), (5, 3, true)],
        "{}",
        logs(&out)
    );
    assert!(
        logs(&out).contains("handing out again the 2 step and reconfiguration records"),
        "{}",
        logs(&out)
    );
    let again: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Step { record, .. }) => Some((**record).clone()),
            _ => None,
        })
        .collect();
    let first: Vec<_> = lost
        .iter()
        .filter_map(|o| match o {
            Output::Notice(Notice::Step { record, .. }) => Some((**record).clone()),
            _ => None,
        })
        .collect();
    // MFU is NaN without a peak (NaN ≠ NaN): compare the records with it set aside.
    let no_mfu = |v: &[lazarus_executor::metrics::StepRecord]| {
        v.iter()
            .map(|r| {
                assert!(r.mfu.is_nan());
                lazarus_executor::metrics::StepRecord {
                    mfu: 0.0,
                    ..r.clone()
                }
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        no_mfu(&again),
        no_mfu(&first),
        "the same records, routing included"
    );
    assert_eq!(
        again[1].routing,
        vec![vec![6, 2, 4, 6], vec![8, 10, 12, 20]]
    );
    // The nodes come back and train on: the next record is number 6.
    let mut out = Vec::new();
    for (name, id) in [("a", a), ("b", b)] {
        assert_eq!(
            c.reattach(&reattachment(name, id, running(1, 1, 4)), 40, &mut out),
            Ok((id, seq - 1))
        );
    }
    for id in [a, b] {
        c.worker_line(id, seq, &routed_step_line(1, 4, &routing(4)), 41, &mut out);
    }
    assert_eq!(numbered_steps(&out), vec![(6, 4, false)]);
    // An acknowledgement is saved with the next change: a later fail-over hands out again only
    // what was not acknowledged then.
    c.delivered(6);
    assert_eq!(c.undelivered(), Vec::<u64>::new());
    for (i, step) in [(1, 5), (2, 6)] {
        for id in [a, b] {
            c.worker_line(id, seq + i, &step_line(1, step), 42, &mut out);
        }
        c.delivered(6 + i);
    }
    c.worker_line(a, seq + 3, &step_line(1, 7), 44, &mut out);
    assert_eq!(c.undelivered(), Vec::<u64>::new());
    drop(c);
    let mut c = Controller::recover(&dir, TOKEN).unwrap();
    let mut out = Vec::new();
    c.start(50, &mut out);
    assert_eq!(numbered_steps(&out), vec![(8, 6, true)], "{}", logs(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Write-ahead: a reconfiguration is saved before it is sent, so a member that never got it
/// (the crash came first) gets the same command again — same epoch, same mesh secret — and a
/// member that did get it gets nothing. A node the state does not know, or with the wrong
/// token, cannot come back.
#[test]
fn a_reconfiguration_saved_before_the_crash_is_sent_again_to_whoever_missed_it() {
    let dir = state_dir("resend");
    let (mut c, a, b, _) = started(&dir);
    let mut out = Vec::new();
    c.gone(b, "connection closed", 10, &mut out);
    // Node a holds a replica of every expert (2 nodes × 4 slots, 4 experts, f = 2).
    let held: Vec<(usize, usize)> = (0..2).flat_map(|l| (0..4).map(move |e| (l, e))).collect();
    let failed =
        serde_json::json!({"Failed": {"epoch": 1, "step": 0, "error": "peer", "held": held}});
    let mut out = Vec::new();
    c.worker_line(a, 3, &failed.to_string(), 11, &mut out);
    // Its 4 slots hold the tiny model's 4 experts: a replans in place alone.
    let sent = reconfigures(&out);
    assert_eq!(sent.len(), 1, "{out:?}");
    let (_, epoch2) = &sent[0];
    drop(c);

    let mut c = Controller::recover(&dir, TOKEN).unwrap();
    let mut out = Vec::new();
    c.start(20, &mut out);
    // Node a says it never got epoch 2: it gets the very same command again.
    let mut out = Vec::new();
    let back = c.reattach(&reattachment("a", a, running(1, 1, 0)), 21, &mut out);
    assert_eq!(back, Ok((a, 3)));
    let again = reconfigures(&out);
    assert_eq!(again.len(), 1, "{out:?}");
    assert_eq!(&again[0].1, epoch2, "same epoch, plan and mesh secret");
    assert!(logs(&out).contains("sent again"), "{}", logs(&out));
    // b was lost before the crash: it is not part of the job any more.
    let mut out = Vec::new();
    let gone = c.reattach(&reattachment("b", b, running(1, 1, 0)), 22, &mut out);
    assert!(matches!(gone, Err(Reject::UnknownNode { .. })), "{gone:?}");
    let mut wrong = reattachment("a", a, running(2, 2, 0));
    wrong.registration.token = "guess".into();
    assert_eq!(c.reattach(&wrong, 23, &mut out), Err(Reject::BadToken));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker that died while the controller was away is dropped when its agent comes back (with
/// the reason), and the survivor is told to abort: the usual failure path, no waiting.
#[test]
fn a_worker_that_died_meanwhile_is_dropped_and_the_survivor_aborts() {
    let dir = state_dir("died");
    let (c, a, b, _) = started(&dir);
    drop(c);
    let mut c = Controller::recover(&dir, TOKEN).unwrap();
    let mut out = Vec::new();
    c.start(20, &mut out);
    let died = WorkerReport {
        process: WorkerProcess::Died,
        ..running(1, 1, 0)
    };
    let mut out = Vec::new();
    match c.reattach(&reattachment("b", b, died), 21, &mut out) {
        Err(Reject::Dropped { reason, .. }) => assert!(reason.contains("died"), "{reason}"),
        other => panic!("expected the node dropped, got {other:?}"),
    }
    let abort = out.iter().any(|o| {
        matches!(o, Output::Send(id, ToAgent::Worker { line }) if *id == a && line.contains("Abort"))
    });
    assert!(abort, "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A missing, cut or damaged state file is an error naming the file, never a panic.
#[test]
fn a_missing_or_damaged_state_is_a_clear_error() {
    let dir = state_dir("damaged");
    let missing = Controller::recover(&dir, TOKEN).unwrap_err();
    assert!(matches!(missing, StateError::Missing { .. }), "{missing}");
    let (c, ..) = started(&dir);
    drop(c);
    let path = dir.join(lazarus_executor::control::state::STATE_FILE);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 10, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = Controller::recover(&dir, TOKEN).unwrap_err().to_string();
        assert!(
            e.contains("is damaged") && e.contains("controller-state"),
            "{e}"
        );
    }
    let mut flipped = bytes.clone();
    let i = bytes.len() - 10;
    flipped[i] ^= 0x20;
    std::fs::write(&path, &flipped).unwrap();
    let e = Controller::recover(&dir, TOKEN).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    std::fs::write(&path, &bytes).unwrap();
    assert!(Controller::recover(&dir, TOKEN).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Over TCP
// ---------------------------------------------------------------------------------------------

/// Bound on every wait (nothing here waits for a timeout: the run takes well under a second).
const WAIT: Duration = Duration::from_secs(60);

async fn serve(
    controller: Controller,
) -> (
    String,
    mpsc::UnboundedReceiver<Notice>,
    tokio::task::JoinHandle<()>,
    watch::Sender<bool>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, notices) = mpsc::unbounded_channel();
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        serve_controller(
            listener,
            ServerConfig::new(50, 1_000),
            controller,
            tx,
            stop_rx,
            |_| {},
        )
        .await
        .unwrap();
    });
    (addr, notices, task, stop)
}

async fn next_message(conn: &mut proto::Framed) -> ToAgent {
    tokio::time::timeout(WAIT, proto::recv::<ToAgent>(conn))
        .await
        .expect("a message in time")
        .unwrap()
        .expect("the connection is open")
}

/// The server's side: heartbeats are answered with the acknowledgement of the saved lines, a
/// killed server's successor answers `Reattach` with the last line it has, and a reattached
/// node's lines count where they left off. Real time, not paused: nothing here depends on a
/// timeout (heartbeat timeout 60 s), and a paused clock auto-advances past the 60 s while
/// real loopback sockets still carry the frames (measured: the second frame of a connection
/// was never read before every node expired).
#[tokio::test]
async fn agents_reattach_over_tcp_to_a_restarted_server_and_send_again_what_it_lacks() {
    let dir = state_dir("tcp");
    let mut c = Controller::new(params(2, 60_000)).unwrap();
    c.save_to(&dir, None).unwrap();
    let (addr, mut notices, task, _stop) = serve(c).await;
    let mut conns = Vec::new();
    for (name, port) in [("a", 7001), ("b", 7002)] {
        let mut conn = proto::framed(TcpStream::connect(&addr).await.unwrap());
        let register = ToController::Register {
            version: PROTOCOL_VERSION,
            token: TOKEN.into(),
            node: name.into(),
            devices: 1,
            host: String::new(),
        };
        proto::send(&mut conn, &register).await.unwrap();
        let ToAgent::Registered { node_id } = next_message(&mut conn).await else {
            panic!("not registered");
        };
        assert!(
            matches!(next_message(&mut conn).await, ToAgent::Worker { .. }),
            "the Job"
        );
        let line = ready_line(port);
        proto::send(
            &mut conn,
            &ToController::Worker {
                node_id,
                seq: 1,
                line,
            },
        )
        .await
        .unwrap();
        conns.push((conn, node_id));
    }
    for (conn, node_id) in conns.iter_mut() {
        assert!(
            matches!(next_message(conn).await, ToAgent::Worker { line } if line.contains("Reconfigure"))
        );
        let lines = [migrated_line(1), step_line(1, 0)];
        for (i, line) in lines.into_iter().enumerate() {
            let msg = ToController::Worker {
                node_id: *node_id,
                seq: 2 + i as u64,
                line,
            };
            proto::send(conn, &msg).await.unwrap();
        }
    }
    loop {
        match tokio::time::timeout(WAIT, notices.recv()).await.unwrap() {
            Some(Notice::Step { record: r, .. }) if r.step == 0 => break,
            Some(_) => {}
            None => panic!("the server ended"),
        }
    }
    // Step 0 counted and saved: a heartbeat gets the acknowledgement of lines 1..=3.
    let (conn, node_id) = &mut conns[0];
    let hb = ToController::Heartbeat {
        node_id: *node_id,
        step: 0,
    };
    proto::send(conn, &hb).await.unwrap();
    assert_eq!(next_message(conn).await, ToAgent::Ack { seq: 3 });

    // The controller dies; its successor is rebuilt from the directory.
    task.abort();
    let _ = task.await;
    for (conn, _) in conns.iter_mut() {
        let closed = tokio::time::timeout(WAIT, proto::recv::<ToAgent>(conn))
            .await
            .unwrap();
        assert!(!matches!(closed, Ok(Some(_))), "{closed:?}");
    }
    let c = Controller::recover(&dir, TOKEN).unwrap();
    let (addr, mut notices, _task, _stop) = serve(c).await;
    let ids: Vec<u32> = conns.iter().map(|(_, id)| *id).collect();
    let mut conns = Vec::new();
    for (name, node_id) in [("a", ids[0]), ("b", ids[1])] {
        let mut conn = proto::framed(TcpStream::connect(&addr).await.unwrap());
        let reattach = ToController::Reattach {
            version: PROTOCOL_VERSION,
            token: TOKEN.into(),
            node: name.into(),
            devices: 1,
            node_id,
            last_seq: 4,
            worker: running(1, 1, 2),
        };
        proto::send(&mut conn, &reattach).await.unwrap();
        assert_eq!(
            next_message(&mut conn).await,
            ToAgent::Reattached {
                node_id,
                acked_seq: 3
            }
        );
        // It sends again what came after the acknowledged lines: its report of step 1.
        let line = step_line(1, 1);
        proto::send(
            &mut conn,
            &ToController::Worker {
                node_id,
                seq: 4,
                line,
            },
        )
        .await
        .unwrap();
        conns.push(conn);
    }
    // Step 0's record was never acknowledged (nobody here does): it is handed out again,
    // under its number, before anything new; nothing is counted twice.
    let mut numbered = Vec::new();
    let mut done = String::new();
    loop {
        match tokio::time::timeout(WAIT, notices.recv()).await.unwrap() {
            Some(Notice::Log(l)) if l.contains("controller recovery complete") => done = l,
            Some(Notice::Step { seq, record, again }) => {
                numbered.push((seq, record.step, again));
                if record.step == 1 {
                    break;
                }
            }
            Some(_) => {}
            None => panic!("the server ended"),
        }
    }
    assert!(done.contains("resumes in place"), "{done}");
    assert_eq!(numbered, vec![(2, 0, true), (3, 1, false)]);
    let _ = std::fs::remove_dir_all(&dir);
}
