//! # Taking a job back after its driver restarted (controller fail-over)
//!
//! A driver that crashes and restarts rebuilds the [`JobMachine`](super::JobMachine) from the
//! state it saved (the machine is serde-serialisable and saved whole) and calls
//! [`JobMachine::recover`](super::JobMachine::recover). The saved state is at least as new as
//! everything the old driver *did* (it saves before it sends a command: write-ahead), but it
//! may be newer than what reached the nodes (the driver saved, then crashed before its
//! commands left). Workers keep training while the driver is away: a step needs no driver.
//!
//! Each node that comes back ([`Event::Reattached`](super::Event::Reattached)) says what its
//! worker holds ([`WorkerReport`]). [`verdict`] compares that with the machine's view of the
//! node ([`NodeView`]) and decides, for that node alone:
//!
//! * **keep** it, and re-issue the commands the crash may have swallowed ([`Reissue`]): the
//!   reconfiguration of the current epoch to a member that never got it, the `Abort`/`Pause`
//!   of a quiescing phase, the `Stop` of a stopping one, the `Job` of a worker never started.
//!   Every re-issued command is harmless to a worker that did get it (idle workers ignore
//!   `Abort` and `Pause`, a stopped one has exited, an agent with a worker ignores a second
//!   `Job`, and a reconfiguration is only re-sent to a worker that reports an older epoch);
//! * **drop** it (the machine fences it, which is a loss like any other): its worker died,
//!   exited unasked, or holds state the machine cannot place — an epoch newer than the saved
//!   state's (a stale state directory), another plan version in the same epoch, fewer steps
//!   than the machine already counted from it.
//!
//! Nodes that do not come back within one heartbeat timeout of the restart are lost too.
//! Once every node the saved state knew came back or was lost, [`outcome`] says what the
//! recovery amounts to: **in place** when every node came back consistent — training was never
//! interrupted and goes on with the same epoch, plan and mesh, no reconfiguration and no
//! checkpoint restore — or the **usual path** otherwise: the losses go through the machine's
//! failure rules (survivors abort, replan in place on what they report holding, or restore the
//! newest checkpoint when some expert lost every replica).

use serde::{Deserialize, Serialize};

use super::Phase;

/// The state of a node's worker process, as its agent saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum WorkerProcess {
    /// The agent never got the job (no worker was started).
    #[default]
    NotStarted,
    Running,
    /// Exited with status 0 (after `Stop`: its checksums are among the lines to come).
    Stopped,
    /// Exited otherwise (killed, crashed, an error).
    Died,
}

/// What a reattaching node says its worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    pub process: WorkerProcess,
    /// The newest epoch the worker was told to reconfigure to (0: none yet).
    pub epoch: u64,
    /// The plan version of that reconfiguration.
    pub plan_version: u64,
    /// The next step the worker trains (one past the last step it reported, or the resume step
    /// of its last completed reconfiguration).
    pub next_step: u64,
}

/// The machine's view of one node, what [`verdict`] compares a [`WorkerReport`] with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeView {
    pub phase: Phase,
    /// The machine's epoch and plan version.
    pub epoch: u64,
    pub plan_version: u64,
    /// Steps counted so far in the current lineage.
    pub next_step: u64,
    /// A member of the current epoch.
    pub member: bool,
    /// Its worker reported ready.
    pub ready: bool,
    /// Reported idle in the current epoch.
    pub idle: bool,
    /// The current reconfiguration still waits for its `Migrated`.
    pub migrating: bool,
    /// Sent its final checksums.
    pub done: bool,
    /// The members are being paused for a join or a rebalance (not aborted after a failure).
    pub pausing: bool,
    /// The plan version of a layout switch in flight ([`super::LayoutSwitch`]): a worker may
    /// already train on it (its agent saw its step lines) before the machine counted them.
    pub switching_to: Option<u64>,
}

/// A command the crash may have swallowed, to send again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reissue {
    StartWorker,
    /// The node's part of the current epoch's reconfiguration.
    Reconfigure,
    Abort,
    Pause,
    Stop,
}

/// What to do with a reattaching node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Keep(Vec<Reissue>),
    /// Treat the node as failed, for this reason.
    Drop(String),
}

/// Decides what to do with one reattaching node (see the [module docs](self)).
pub fn verdict(v: &NodeView, r: &WorkerReport) -> Verdict {
    let stopping = matches!(v.phase, Phase::Stopping | Phase::Over);
    match r.process {
        WorkerProcess::Died => {
            return Verdict::Drop("its worker died while the controller was away".into());
        }
        WorkerProcess::Stopped if stopping => return Verdict::Keep(Vec::new()),
        WorkerProcess::Stopped => {
            return Verdict::Drop("its worker exited without being told to stop".into());
        }
        WorkerProcess::NotStarted if v.ready || v.member => {
            return Verdict::Drop(
                "it has no worker, but its worker had reported ready (a new agent under an old \
                 name?)"
                    .into(),
            );
        }
        WorkerProcess::NotStarted if stopping => return Verdict::Keep(vec![Reissue::Stop]),
        WorkerProcess::NotStarted => return Verdict::Keep(vec![Reissue::StartWorker]),
        WorkerProcess::Running => {}
    }
    if r.epoch > v.epoch {
        return Verdict::Drop(format!(
            "its worker was told epoch {}, newer than the saved state's epoch {} (the state \
             directory is stale)",
            r.epoch, v.epoch
        ));
    }
    let mut reissue = Vec::new();
    if v.member {
        if r.epoch == v.epoch {
            if r.plan_version != v.plan_version && Some(r.plan_version) != v.switching_to {
                return Verdict::Drop(format!(
                    "its worker holds plan v{} in epoch {}, the saved state plan v{}",
                    r.plan_version, r.epoch, v.plan_version
                ));
            }
            if !v.migrating && r.next_step < v.next_step {
                return Verdict::Drop(format!(
                    "its worker is at step {}, behind the {} steps already counted",
                    r.next_step, v.next_step
                ));
            }
        } else {
            // The reconfiguration of this epoch was saved but never reached the worker. Only a
            // phase that can still be waiting for it may send it again.
            if !matches!(v.phase, Phase::Reconfiguring | Phase::Quiescing) || v.idle {
                return Verdict::Drop(format!(
                    "its worker is in epoch {}, but every member of epoch {} had completed it",
                    r.epoch, v.epoch
                ));
            }
            reissue.push(Reissue::Reconfigure);
        }
        if v.phase == Phase::Quiescing && !v.idle {
            reissue.push(if v.pausing {
                Reissue::Pause
            } else {
                Reissue::Abort
            });
        }
    }
    if stopping && !v.done {
        reissue.push(Reissue::Stop);
    }
    Verdict::Keep(reissue)
}

/// What a completed recovery amounts to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every node came back consistent: nothing to redo, training goes on undisturbed.
    InPlace { nodes: usize },
    /// Some nodes did not come back or were dropped (node name, reason): they go through the
    /// failure rules — replan on the survivors, or restore if an expert lost every replica.
    Reconfigure {
        back: usize,
        lost: Vec<(String, String)>,
    },
}

/// The outcome of a recovery in which `back` nodes came back consistent and `lost` did not.
pub fn outcome(back: usize, lost: &[(String, String)]) -> Outcome {
    if lost.is_empty() {
        Outcome::InPlace { nodes: back }
    } else {
        Outcome::Reconfigure {
            back,
            lost: lost.to_vec(),
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::InPlace { nodes } => write!(
                f,
                "all {nodes} nodes came back consistent: training resumes in place (same epoch, \
                 plan and mesh; no reconfiguration, no checkpoint restore)"
            ),
            Outcome::Reconfigure { back, lost } => {
                let who: Vec<String> = lost
                    .iter()
                    .take(8)
                    .map(|(n, why)| format!("{n} ({why})"))
                    .collect();
                let more = lost.len().saturating_sub(who.len());
                write!(
                    f,
                    "{back} nodes came back, {} did not: {}{}; the job goes on through the \
                     failure rules (replan on the survivors, or restore the newest checkpoint if \
                     an expert lost every replica)",
                    lost.len(),
                    who.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn training_member() -> NodeView {
        NodeView {
            phase: Phase::Training,
            epoch: 3,
            plan_version: 5,
            next_step: 10,
            member: true,
            ready: true,
            idle: false,
            migrating: false,
            done: false,
            pausing: false,
            switching_to: None,
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

    #[test]
    fn a_member_in_the_saved_epoch_and_plan_is_kept_with_nothing_to_resend() {
        let v = training_member();
        // It trained on while the controller was away: ahead of the counted steps is normal.
        for step in [10, 11, 40] {
            assert_eq!(verdict(&v, &running(3, 5, step)), Verdict::Keep(vec![]));
        }
    }

    /// An FSEP layout switch was pending when the controller died: a worker that already
    /// trains on the new layout (its agent saw the step lines) is as consistent as one that
    /// does not yet; any other plan is not.
    #[test]
    fn a_member_on_the_pending_layout_switch_is_kept() {
        let v = NodeView {
            switching_to: Some(6),
            ..training_member()
        };
        assert_eq!(verdict(&v, &running(3, 5, 10)), Verdict::Keep(vec![]));
        assert_eq!(verdict(&v, &running(3, 6, 12)), Verdict::Keep(vec![]));
        assert!(matches!(verdict(&v, &running(3, 7, 12)), Verdict::Drop(_)));
        assert!(matches!(
            verdict(&training_member(), &running(3, 6, 12)),
            Verdict::Drop(_)
        ));
    }

    #[test]
    fn a_dead_or_unasked_exited_worker_is_dropped() {
        let v = training_member();
        for process in [WorkerProcess::Died, WorkerProcess::Stopped] {
            let r = WorkerReport {
                process,
                ..running(3, 5, 10)
            };
            assert!(matches!(verdict(&v, &r), Verdict::Drop(_)), "{process:?}");
        }
        // After Stop a clean exit is the expected end; its checksums are still to come.
        let stopping = NodeView {
            phase: Phase::Stopping,
            ..v
        };
        let r = WorkerReport {
            process: WorkerProcess::Stopped,
            ..running(3, 5, 10)
        };
        assert_eq!(verdict(&stopping, &r), Verdict::Keep(vec![]));
    }

    #[test]
    fn a_worker_that_cannot_be_placed_in_the_saved_state_is_dropped() {
        let v = training_member();
        let why = |r| match verdict(&v, &r) {
            Verdict::Drop(why) => why,
            other => panic!("expected a drop, got {other:?}"),
        };
        assert!(why(running(4, 6, 10)).contains("stale"));
        assert!(why(running(3, 4, 10)).contains("plan v4"));
        assert!(why(running(3, 5, 9)).contains("behind"));
        // Training means every member completed epoch 3: an older epoch cannot be.
        assert!(why(running(2, 4, 10)).contains("epoch 2"));
    }

    #[test]
    fn a_reconfiguration_that_never_arrived_is_sent_again() {
        let v = NodeView {
            phase: Phase::Reconfiguring,
            migrating: true,
            next_step: 8,
            ..training_member()
        };
        assert_eq!(
            verdict(&v, &running(2, 4, 8)),
            Verdict::Keep(vec![Reissue::Reconfigure])
        );
        // It did arrive: the worker is forming the mesh or migrating; nothing to send.
        assert_eq!(verdict(&v, &running(3, 5, 8)), Verdict::Keep(vec![]));
        // A failure since made the phase quiescing: send it, and abort it at once.
        let q = NodeView {
            phase: Phase::Quiescing,
            ..v
        };
        assert_eq!(
            verdict(&q, &running(2, 4, 8)),
            Verdict::Keep(vec![Reissue::Reconfigure, Reissue::Abort])
        );
    }

    #[test]
    fn a_quiescing_or_stopping_phase_repeats_its_command() {
        let q = NodeView {
            phase: Phase::Quiescing,
            ..training_member()
        };
        assert_eq!(
            verdict(&q, &running(3, 5, 12)),
            Verdict::Keep(vec![Reissue::Abort])
        );
        let p = NodeView { pausing: true, ..q };
        assert_eq!(
            verdict(&p, &running(3, 5, 12)),
            Verdict::Keep(vec![Reissue::Pause])
        );
        let idle = NodeView { idle: true, ..q };
        assert_eq!(verdict(&idle, &running(3, 5, 12)), Verdict::Keep(vec![]));
        let s = NodeView {
            phase: Phase::Stopping,
            ..training_member()
        };
        assert_eq!(
            verdict(&s, &running(3, 5, 20)),
            Verdict::Keep(vec![Reissue::Stop])
        );
        let done = NodeView { done: true, ..s };
        assert_eq!(verdict(&done, &running(3, 5, 20)), Verdict::Keep(vec![]));
    }

    #[test]
    fn a_node_without_a_worker_gets_its_job_again_unless_it_had_one() {
        let newcomer = NodeView {
            phase: Phase::Gathering,
            member: false,
            ready: false,
            ..training_member()
        };
        let none = WorkerReport::default();
        assert_eq!(
            verdict(&newcomer, &none),
            Verdict::Keep(vec![Reissue::StartWorker])
        );
        assert!(matches!(
            verdict(&training_member(), &none),
            Verdict::Drop(_)
        ));
        // A ready newcomer (not a member yet) that is still running is simply kept.
        let ready = NodeView {
            ready: true,
            phase: Phase::Training,
            ..newcomer
        };
        assert_eq!(verdict(&ready, &running(0, 0, 0)), Verdict::Keep(vec![]));
    }

    #[test]
    fn the_outcome_is_in_place_only_when_nobody_was_lost() {
        assert_eq!(outcome(4, &[]), Outcome::InPlace { nodes: 4 });
        let lost = vec![("n2".to_owned(), "did not come back".to_owned())];
        let o = outcome(3, &lost);
        assert!(matches!(&o, Outcome::Reconfigure { back: 3, lost } if lost.len() == 1));
        let text = o.to_string();
        assert!(text.contains("n2 (did not come back)"), "{text}");
        assert!(
            Outcome::InPlace { nodes: 2 }
                .to_string()
                .contains("no checkpoint restore")
        );
    }
}
