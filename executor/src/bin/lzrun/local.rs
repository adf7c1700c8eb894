//! `lzrun local`: a controller plus one agent (and worker) process per node on this machine,
//! with the faults of a schedule (`--kill`, `--join`, `--fault-trace`) injected between steps.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use lazarus_executor::control::JobHandle;
use lazarus_executor::faults::{self, Fault, FaultSchedule};
use lazarus_executor::metrics::StepRecord;
use lazarus_traces::duration::format_ms;

use crate::args::{Format, LocalArgs};
use crate::drive::{Failover, Hooks, drive, runtime, stop_signals};
use crate::job::job_from_args;
use crate::nodes::Nodes;
use crate::report::Report;
use crate::runinfo::Injection;

/// Starts the controller and the initial nodes, injects the scheduled faults, prints the report.
pub fn local(a: LocalArgs) -> Result<()> {
    let schedule = fault_schedule(&a)?;
    ensure!(
        schedule.initial_nodes <= 64,
        "{} nodes is more than 64",
        schedule.initial_nodes
    );
    let rt = runtime()?;
    // Before anything that needs cleaning up exists: from here SIGINT, SIGTERM and SIGHUP stop
    // the job cleanly instead of killing this process and orphaning its nodes.
    let stop = {
        let _guard = rt.enter();
        stop_signals()?
    };
    // Keeps stray agents of other local runs out; not a secret against local users.
    let token = format!("{:016x}", rand::random::<u64>());
    let job = job_from_args(&a.job, schedule.initial_nodes, &token, true)?;
    if let Some(dir) = &a.job.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let (listener, addr) = bind_controller()?;
    let controller = job.controller(addr)?;
    let failover = job.state_dir.clone().map(|state_dir| Failover {
        state_dir,
        token: token.clone(),
        down: Duration::from_millis(a.controller_down_ms),
    });
    let mut report = Report::new(a.job.format, a.job.model.steps);
    report.say(&format!(
        "lzrun local: {} nodes, config {}, {} steps, {} faults scheduled, controller {addr}",
        schedule.initial_nodes,
        a.job.model.config,
        a.job.model.steps,
        schedule.len()
    ));
    // An output that cannot be written already: no node is worth starting.
    if let Some(e) = crate::report::stdout_failure() {
        return Err(e.into());
    }
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    let mut nodes = Nodes::new(exe, addr, token);
    for name in &schedule.initial_names {
        nodes.spawn(name)?;
    }
    let config = job.params.config.clone();
    let format = a.job.format;
    let mut faults = Faults {
        nodes,
        schedule,
        format,
        fired: BTreeSet::new(),
        kill_controller: false,
        start: report.started(),
        injected: Vec::new(),
    };
    let result = rt.block_on(drive(
        listener,
        job.server,
        controller,
        failover,
        &mut report,
        &mut faults,
        stop,
    ));
    faults.nodes.reap(Duration::from_secs(5));
    job.clean_up(&result);
    result?;
    report.finish(&a.job, &config)?;
    if let Some(dir) = &a.job.metrics_out {
        let info = crate::runinfo::RunInfo {
            args: &a,
            params: &job.params,
            schedule: &faults.schedule,
            injected: &faults.injected,
            report: &report,
        };
        crate::runinfo::write(dir, &info)?;
    }
    if format == Format::Text {
        report.print_mean_loss_per_step()?;
    }
    Ok(())
}

/// The faults to inject: from `--fault-trace`, else from `--nodes`, `--kill` and `--join`.
fn fault_schedule(a: &LocalArgs) -> Result<FaultSchedule> {
    let mut schedule = match &a.fault_trace {
        Some(path) => {
            // The trace error names the file and carries its cause as the source.
            let mut trace = lazarus_traces::load(path).context("--fault-trace")?;
            if let Some((start_ms, end_ms)) = a.window {
                trace = trace.window(start_ms, end_ms);
                ensure!(
                    !trace.is_empty(),
                    "--fault-trace {}: no node is live in --window {}..{}",
                    path.display(),
                    format_ms(start_ms),
                    format_ms(end_ms)
                );
            }
            let start_ms = a.window.map_or(0, |w| w.0);
            faults::schedule_from_trace(&trace, a.time_scale, a.job.model.steps, a.nodes)
                .map_err(|e| match e {
                    // Times of the original trace, so the suggested --window is right.
                    faults::FaultError::NoInitialNodes {
                        first_event_ms,
                        last_event_ms,
                    } => faults::FaultError::NoInitialNodes {
                        first_event_ms: first_event_ms.saturating_add(start_ms),
                        last_event_ms: last_event_ms.saturating_add(start_ms),
                    },
                    other => other,
                })
                .map_err(|e| anyhow!("--fault-trace {}: {e}", path.display()))?
        }
        None => {
            faults::schedule_from_flags(a.nodes.unwrap_or(2), &a.kill, &a.join, a.job.model.steps)
                .map_err(|e| anyhow!("{e}"))?
        }
    };
    schedule
        .add_controller_kills(&a.kill_controller, a.job.model.steps)
        .map_err(|e| anyhow!("{e}"))?;
    ensure!(
        a.controller_down_ms <= 600_000,
        "--controller-down-ms {} is more than 10 minutes",
        a.controller_down_ms
    );
    Ok(schedule)
}

/// The controller's listener on a free loopback port, and its address. `lzrun local` keeps it
/// open for the whole job: a restarted controller serves the same socket.
fn bind_controller() -> Result<(StdListener, SocketAddr)> {
    let listener = StdListener::bind(("127.0.0.1", 0)).context("binding the controller")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// The schedule's faults, injected as the job goes.
struct Faults {
    nodes: Nodes,
    schedule: FaultSchedule,
    format: Format,
    /// Indices of the schedule's events already injected.
    fired: BTreeSet<usize>,
    /// A controller kill is due (taken by `drive`).
    kill_controller: bool,
    /// The run's start (the report's), for the injection times.
    start: Instant,
    /// What was injected and when, for `run.json`.
    injected: Vec<crate::runinfo::Injection>,
}

impl Hooks for Faults {
    /// Injects the faults the schedule holds for the step `rec` completed: kills and joins.
    fn on_step(&mut self, rec: &StepRecord, job: &JobHandle) -> Result<()> {
        let due: Vec<usize> = (0..self.schedule.events.len())
            .filter(|i| self.schedule.events[*i].after_step == rec.step)
            .collect();
        self.inject(&due, &format!("after step {}", rec.step), job)
    }

    fn take_controller_kill(&mut self) -> bool {
        std::mem::take(&mut self.kill_controller)
    }

    /// A fenced node's processes may be stopped, not dead: kill them for good.
    fn on_fenced(&mut self, name: &str) {
        if let Some(i) = self.nodes.index_of(name) {
            let _ = self.nodes.kill_group(i);
        }
    }

    /// No step completes while the job waits for nodes, so the joins scheduled after a later
    /// step would never come: start the next ones now. With none left the wait is hopeless.
    fn on_waiting(&mut self, job: &JobHandle) -> Result<()> {
        let next = self
            .schedule
            .events
            .iter()
            .enumerate()
            .find(|(i, e)| e.fault.is_join() && !self.fired.contains(i))
            .map(|(_, e)| e.after_step);
        let Some(step) = next else {
            bail!(
                "the job waits for nodes to join, and the fault schedule starts no more \
                 (add a --join, or give each node more --slots)"
            );
        };
        let due: Vec<usize> = (0..self.schedule.events.len())
            .filter(|&i| {
                let e = &self.schedule.events[i];
                e.after_step == step && e.fault.is_join() && !self.fired.contains(&i)
            })
            .collect();
        self.inject(&due, &format!("early (scheduled after step {step})"), job)
    }
}

impl Faults {
    /// Injects the schedule's events `due` that have not fired yet; `when` is for the log.
    fn inject(&mut self, due: &[usize], when: &str, handle: &JobHandle) -> Result<()> {
        for &i in due {
            if !self.fired.insert(i) {
                continue;
            }
            let nodes = &mut self.nodes;
            let after_step = self.schedule.events[i].after_step;
            let t_s = self.start.elapsed().as_secs_f64();
            match &self.schedule.events[i].fault {
                Fault::Kill { node } => {
                    let rank = nodes.name(*node).and_then(|n| handle.rank_of(n));
                    let name = nodes.kill_group(*node)?;
                    handle.fault_injected();
                    self.injected.push(
                        Injection::new(t_s, after_step, "kill", *node, &name, when).with_rank(rank),
                    );
                    self.format.say(&format!(
                        "lzrun local: killed node {node} ({name}) with SIGKILL {when}"
                    ));
                }
                Fault::KillName { name } => {
                    let i = nodes
                        .index_of(name)
                        .ok_or_else(|| anyhow!("trace kills {name}, which is not running"))?;
                    let rank = handle.rank_of(name);
                    nodes.kill_group(i)?;
                    handle.fault_injected();
                    self.injected.push(
                        Injection::new(t_s, after_step, "kill", i, name, when).with_rank(rank),
                    );
                    self.format.say(&format!(
                        "lzrun local: killed node {i} ({name}) with SIGKILL {when}"
                    ));
                }
                Fault::Join { name } => {
                    let name = name
                        .clone()
                        .unwrap_or_else(|| format!("n{}", nodes.launched()));
                    nodes.spawn(&name)?;
                    let index = nodes.launched() - 1;
                    self.injected
                        .push(Injection::new(t_s, after_step, "join", index, &name, when));
                    self.format.say(&format!(
                        "lzrun local: started node {} ({name}) {when}",
                        nodes.launched() - 1
                    ));
                }
                // `drive` kills it once this step's events are in.
                Fault::KillController => self.kill_controller = true,
            }
        }
        Ok(())
    }
}
