//! `lzrun local`: a controller plus one agent (and worker) process per node on this machine,
//! with the faults of a schedule (`--kill`, `--join`, `--fault-trace`, `--storm`) injected
//! between steps.
//!
//! With `--gpus-per-node G` every node is a host of G workers: its agent process runs G
//! workers (children of it, in its process group) registered as the G GPUs of that host
//! (`n0-gpu0`, `n0-gpu1`, …), so a `--kill` of the node takes all G at once, and the
//! controller places replicas per host (see `lazarus_planner::job::hosts`). The schedule's
//! node indices and `--nodes` count hosts; the controller waits for N·G workers.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use lazarus_executor::control::JobHandle;
use lazarus_executor::faults::{self, Fault, FaultSchedule};
use lazarus_executor::metrics::StepRecord;
use lazarus_traces::duration::format_ms;

use crate::args::{Format, LocalArgs};
use crate::drive::{Failover, Hooks, drive, runtime, stop_signals};
use crate::job::job_from_args;
use crate::nodes::{Named, Nodes};
use crate::report::Report;
use crate::runinfo::Injection;

/// Nodes of a `--storm` without `--nodes`.
const STORM_NODES: usize = 6;

/// Starts the controller and the initial nodes, injects the scheduled faults, prints the report.
pub fn local(a: LocalArgs) -> Result<()> {
    // Before anything starts: `--device cuda` without CUDA support, a driver or a GPU is one
    // line and exit status 2.
    let choice = a.device.choice()?;
    choice.preflight()?;
    let gpus = choice.gpus_per_node;
    let schedule = fault_schedule(&a)?;
    ensure!(
        schedule.initial_nodes <= 64,
        "{} nodes is more than 64",
        schedule.initial_nodes
    );
    ensure!(
        schedule.initial_nodes * gpus <= 64,
        "{} nodes × --gpus-per-node {gpus} is more than 64 workers",
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
    // The job machine's nodes are workers: G per host.
    let mut job = job_from_args(&a.job, schedule.initial_nodes * gpus, &token, true)?;
    // Every worker runs on this machine: one that cannot hold the model is refused here, not
    // by an allocation abort in each of them.
    let held = job.params.rules.slots_per_node * job.params.config.n_layers;
    crate::config::check_fits_memory(&job.params.config, held, &choice)?;
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
    let (basis, mfu_line) =
        crate::report::mfu_basis(a.job.peak_tflops, &job.params.config, Some(&choice));
    report.set_mfu_basis(basis);
    let per_node = match gpus {
        1 => String::new(),
        g => format!(" × {g} GPUs (CPU workers)"),
    };
    // A storm's fault may be several injections (a burst kills several nodes at one step, a
    // join racing a kill is a join and a kill): count the faults asked for, and say so.
    let faults = match a.storm {
        Some(n) if n + a.kill_controller.len() != schedule.len() => format!(
            "{} faults scheduled ({} injections)",
            n + a.kill_controller.len(),
            schedule.len()
        ),
        _ => format!("{} faults scheduled", schedule.len()),
    };
    report.say(&format!(
        "lzrun local: {} nodes{per_node}, config {}, {} steps, {faults}, controller {addr}",
        schedule.initial_nodes,
        match (&a.job.init_from, &a.job.model.model_config) {
            (Some(p), _) => format!(
                "{} (--init-from; training knobs of {})",
                p.display(),
                a.job.model.config
            ),
            (None, Some(p)) =>
                format!("{} (training knobs of {})", p.display(), a.job.model.config),
            (None, None) => a.job.model.config.clone(),
        },
        a.job.model.steps,
    ));
    if let Some(line) = mfu_line {
        report.say(&line);
    }
    // An output that cannot be written already: no node is worth starting.
    if let Some(e) = crate::report::stdout_failure() {
        return Err(e.into());
    }
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    let mut nodes = Nodes::new(exe, addr, token, gpus);
    for (k, v) in choice.env() {
        nodes.set_env(k, v);
    }
    let disk_full = schedule
        .events
        .iter()
        .any(|e| matches!(e.fault, Fault::DiskFull { .. }))
        .then(DiskFull::new);
    if let Some(d) = &disk_full {
        nodes.set_env(faults::DISK_FULL_FAILPOINT_ENV, &d.marker);
    }
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
        disk_full,
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
    // A controller task still running (the job was interrupted) saves its state at its next
    // event: stop it before its temporary state directory is removed, or it writes it again.
    rt.shutdown_timeout(Duration::from_secs(5));
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
            faults::schedule_from_trace(&trace, a.time_scale, a.job.model.steps, a.nodes, a.map)
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
        None => match a.storm {
            Some(n) => faults::storm_schedule(
                a.storm_seed,
                a.nodes.unwrap_or(STORM_NODES),
                a.job.model.steps,
                n,
                a.storm_min_live,
            )
            .map_err(|e| anyhow!("--storm {n}: {e}"))?,
            None => faults::schedule_from_flags(
                a.nodes.unwrap_or(2),
                &a.kill,
                &a.join,
                a.job.model.steps,
            )
            .map_err(|e| anyhow!("{e}"))?,
        },
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
    /// The disk-full failpoint, when the schedule fills the disk.
    disk_full: Option<DiskFull>,
    /// The run's start (the report's), for the injection times.
    start: Instant,
    /// What was injected and when, for `run.json`.
    injected: Vec<crate::runinfo::Injection>,
}

impl Hooks for Faults {
    /// Injects the faults the schedule holds for the step `rec` completed: kills and joins.
    fn on_step(&mut self, rec: &StepRecord, job: &JobHandle) -> Result<()> {
        if let Some(d) = self.disk_full.as_mut().filter(|d| d.ends_after(rec.step)) {
            d.set(None)?;
            self.format.say(&format!(
                "lzrun local: the checkpoint disk has space again after step {}",
                rec.step
            ));
        }
        // Also the events of steps this launcher saw no record of (a controller that was
        // down while the workers trained on counts those steps without reporting them).
        let events = &self.schedule.events;
        let (due, late): (Vec<usize>, Vec<usize>) = (0..events.len())
            .filter(|i| events[*i].after_step <= rec.step && !self.fired.contains(i))
            .partition(|i| events[*i].after_step == rec.step);
        for i in late {
            let when = format!(
                "after step {} (scheduled after step {}, whose record was not seen)",
                rec.step, self.schedule.events[i].after_step
            );
            self.inject(&[i], &when, job)?;
        }
        self.inject(&due, &format!("after step {}", rec.step), job)
    }

    fn take_controller_kill(&mut self) -> bool {
        std::mem::take(&mut self.kill_controller)
    }

    /// A fenced node's processes may be stopped, not dead: kill them for good (with G GPUs
    /// per node, `name` is one worker of the host: the host goes, as the controller fenced
    /// its other workers too).
    fn on_fenced(&mut self, name: &str) {
        if let Some(i) = self.nodes.index_of_worker(name) {
            let _ = self.nodes.kill_group(i);
        }
    }

    /// No step completes while the job waits for nodes, so the joins scheduled after a later
    /// step would never come: start the next ones now. With none left the wait is hopeless,
    /// unless enough nodes are there and only not ready yet (a node that just joined).
    fn on_waiting(&mut self, job: &JobHandle, live: usize, needed: usize) -> Result<()> {
        let events = &self.schedule.events;
        let unfired: Vec<usize> = (0..events.len())
            .filter(|i| events[*i].fault.is_join() && !self.fired.contains(i))
            .collect();
        // Registered or started, ready or not (a frozen one is fenced, and the job asks again);
        // not one that exited already (its worker died: it will never register again).
        // `live` and `needed` count workers, G per node.
        for (name, status) in self.nodes.reap_exited() {
            self.format.say(&format!(
                "lzrun local: node {name} exited on its own ({status}); it is not waited for"
            ));
        }
        let gpus = self.nodes.gpus();
        let coming = live.max(self.nodes.running() * gpus);
        let Some(&first) = unfired.first() else {
            if coming >= needed {
                return Ok(());
            }
            bail!(
                "the job waits for nodes to join, and the fault schedule starts no more \
                 (add a --join, or give each node more --slots)"
            );
        };
        // The next step's joins, and later ones until enough nodes are coming (the job asks
        // again when the live count changes, and nodes already coming are not started twice).
        let first_step = events[first].after_step;
        let due: Vec<(usize, u64)> = unfired
            .into_iter()
            .enumerate()
            .take_while(|&(k, i)| events[i].after_step == first_step || coming + k * gpus < needed)
            .map(|(_, i)| (i, events[i].after_step))
            .collect();
        for (i, step) in due {
            self.inject(&[i], &format!("early (scheduled after step {step})"), job)?;
        }
        Ok(())
    }
}

impl Faults {
    /// Injects the schedule's events `due` that have not fired yet; `when` is for the log.
    fn inject(&mut self, due: &[usize], when: &str, handle: &JobHandle) -> Result<()> {
        for &i in due {
            // Stopped meanwhile (SIGTERM, Ctrl-C): start nothing more, end as the signal does.
            if let Some(name) = crate::drive::stop_requested() {
                return Err(crate::drive::Interrupted(name).into());
            }
            if !self.fired.insert(i) {
                continue;
            }
            let nodes = &mut self.nodes;
            let after_step = self.schedule.events[i].after_step;
            let t_s = self.start.elapsed().as_secs_f64();
            match &self.schedule.events[i].fault {
                // Fenced and killed by now (a storm may freeze or slow it first): nothing to do.
                Fault::Kill { node } if !nodes.is_running(*node) => self.format.say(&format!(
                    "lzrun local: node {} is gone already; no kill {when}",
                    nodes.label(*node)
                )),
                Fault::Kill { node } => {
                    let ranks = nodes.ranks(*node, handle);
                    let name = nodes.kill_group(*node)?;
                    handle.fault_injected();
                    self.injected.push(
                        Injection::new(t_s, after_step, "kill", Some(*node), &name, when)
                            .with_rank(ranks.first().copied()),
                    );
                    self.format.say(&format!(
                        "lzrun local: killed node {name}{} with SIGKILL {when}",
                        describe_ranks(&ranks, nodes.gpus())
                    ));
                }
                // As for `Kill`: fenced and killed by now (a frozen or silent node), or killed
                // already; nothing to do.
                Fault::KillName { name } if matches!(nodes.find_name(name), Named::Gone(_)) => {
                    self.format.say(&format!(
                        "lzrun local: node {name} is gone already; no kill {when}"
                    ))
                }
                Fault::KillName { name } => {
                    let Named::Running(i) = nodes.find_name(name) else {
                        bail!("the trace kills {name}, which no node was started as");
                    };
                    let ranks = nodes.ranks(i, handle);
                    nodes.kill_group(i)?;
                    handle.fault_injected();
                    self.injected.push(
                        Injection::new(t_s, after_step, "kill", Some(i), name, when)
                            .with_rank(ranks.first().copied()),
                    );
                    self.format.say(&format!(
                        "lzrun local: killed node {name}{} with SIGKILL {when}",
                        describe_ranks(&ranks, nodes.gpus())
                    ));
                }
                Fault::Join { name } => {
                    let name = name
                        .clone()
                        .unwrap_or_else(|| format!("n{}", nodes.launched()));
                    nodes.spawn(&name)?;
                    let index = nodes.launched() - 1;
                    self.injected.push(Injection::new(
                        t_s,
                        after_step,
                        "join",
                        Some(index),
                        &name,
                        when,
                    ));
                    self.format
                        .say(&format!("lzrun local: started node {name} {when}"));
                }
                // `drive` kills it once this step's events are in.
                Fault::KillController => {
                    self.kill_controller = true;
                    self.injected.push(Injection::new(
                        t_s,
                        after_step,
                        "kill-controller",
                        None,
                        "",
                        when,
                    ));
                }
                Fault::FreezeWorker { node } | Fault::FreezeAgent { node } => {
                    let fault = self.schedule.events[i].fault.clone();
                    self.freeze(&fault, *node, Injected { t_s, after_step }, when, handle);
                }
                Fault::DiskFull { steps } => {
                    let until = after_step + steps;
                    if let Some(d) = self.disk_full.as_mut() {
                        d.set(Some(until))?;
                    }
                    let at = Injected { t_s, after_step };
                    self.injected.push(at.of("disk-full", None, "", when));
                    self.format.say(&format!(
                        "lzrun local: the checkpoint disk is full {when} until after step {until}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// SIGSTOPs node `node`'s worker or agent (`fault` says which); a node that died meanwhile
    /// (fenced, say) has nothing to freeze, which is logged.
    fn freeze(&mut self, fault: &Fault, node: usize, at: Injected, when: &str, handle: &JobHandle) {
        let kind = fault.kind();
        let rank = self.nodes.name(node).and_then(|n| handle.rank_of(n));
        let frozen = if matches!(fault, Fault::FreezeWorker { .. }) {
            self.nodes.freeze_worker(node)
        } else {
            self.nodes.freeze_agent(node)
        };
        match frozen {
            Ok(name) => {
                handle.fault_injected();
                self.injected
                    .push(at.of(kind, Some(node), &name, when).with_rank(rank));
                self.format.say(&format!(
                    "lzrun local: froze node {name}: SIGSTOP to its {} {when}",
                    kind.trim_start_matches("freeze-")
                ));
            }
            Err(e) => self.format.say(&format!(
                "lzrun local: no {kind} of node {} {when}: {e}",
                self.nodes.label(node)
            )),
        }
    }
}

/// ` (ranks 2 and 3)` for the ranks a node's workers held (with several GPUs per node).
fn describe_ranks(ranks: &[usize], gpus: usize) -> String {
    match ranks {
        _ if gpus == 1 => String::new(),
        [] => " (no rank)".to_owned(),
        [r] => format!(" (rank {r})"),
        [rest @ .., last] => {
            let rest: Vec<String> = rest.iter().map(usize::to_string).collect();
            format!(" (ranks {} and {last})", rest.join(", "))
        }
    }
}

/// When an event was injected: seconds since the launch and the step it fired after.
#[derive(Clone, Copy)]
struct Injected {
    t_s: f64,
    after_step: u64,
}

impl Injected {
    fn of(self, kind: &'static str, node: Option<usize>, name: &str, when: &str) -> Injection {
        Injection::new(self.t_s, self.after_step, kind, node, name, when)
    }
}

/// The disk-full failpoint of a run: a file whose existence makes the nodes' checkpoint writes
/// fail with ENOSPC ([`faults::DISK_FULL_FAILPOINT_ENV`]); removed when dropped.
struct DiskFull {
    marker: PathBuf,
    /// The disk is full until this step completes.
    until_step: Option<u64>,
}

impl DiskFull {
    fn new() -> Self {
        let marker = std::env::temp_dir().join(format!("lzrun-disk-full-{}", std::process::id()));
        Self {
            marker,
            until_step: None,
        }
    }

    /// Fills the disk until step `until` completes (`Some`), or frees it (`None`).
    fn set(&mut self, until: Option<u64>) -> Result<()> {
        match until {
            Some(_) => std::fs::write(&self.marker, b"")
                .with_context(|| format!("creating {}", self.marker.display()))?,
            None => match std::fs::remove_file(&self.marker) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("removing {}", self.marker.display()));
                }
                _ => {}
            },
        }
        self.until_step = until;
        Ok(())
    }

    /// Whether the disk is full and its window ends once step `step` completed.
    fn ends_after(&self, step: u64) -> bool {
        self.until_step.is_some_and(|u| step >= u)
    }
}

impl Drop for DiskFull {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.marker);
    }
}
