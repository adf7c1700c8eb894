//! `lzrun local`: a controller plus one agent (and worker) process per node on this machine,
//! with the faults of a schedule (`--kill`, `--join`, `--fault-trace`) injected between steps.

use std::cell::RefCell;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use lazarus_executor::control::JobHandle;
use lazarus_executor::faults::{self, Fault, FaultSchedule};
use lazarus_executor::metrics::StepRecord;
use tokio::runtime::Runtime;

use crate::args::{Format, LocalArgs};
use crate::drive::{drive, runtime, stop_signals};
use crate::job::job_from_args;
use crate::nodes::Nodes;
use crate::report::Report;

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
    let job = job_from_args(&a.job, schedule.initial_nodes, &token)?;
    if let Some(dir) = &a.job.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let (listener, addr) = bind_controller(&rt)?;
    let mut report = Report::new(a.job.format, a.job.model.steps);
    report.say(&format!(
        "lzrun local: {} nodes, config {}, {} steps, {} faults scheduled, controller {addr}",
        schedule.initial_nodes,
        a.job.model.config,
        a.job.model.steps,
        schedule.len()
    ));
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    let mut nodes = Nodes::new(exe, addr, token);
    for name in &schedule.initial_names {
        nodes.spawn(name)?;
    }
    let config = job.params.config.clone();
    let format = a.job.format;
    let nodes = RefCell::new(nodes);
    let result = rt.block_on(drive(
        listener,
        job.server,
        job.params.clone(),
        &mut report,
        |name| {
            // A fenced node's processes may be stopped, not dead: kill them for good.
            let mut nodes = nodes.borrow_mut();
            if let Some(i) = nodes.index_of(name) {
                let _ = nodes.kill_group(i);
            }
        },
        |rec, handle| inject_faults(&mut nodes.borrow_mut(), &schedule, rec, handle, format),
        stop,
    ));
    nodes.borrow_mut().reap(Duration::from_secs(5));
    job.clean_up(&result);
    result?;
    report.finish(&a.job, &config)?;
    if format == Format::Text {
        report.print_mean_loss_per_step();
    }
    Ok(())
}

/// The faults to inject: from `--fault-trace`, else from `--nodes`, `--kill` and `--join`.
fn fault_schedule(a: &LocalArgs) -> Result<FaultSchedule> {
    Ok(match &a.fault_trace {
        Some(path) => {
            let trace = lazarus_traces::load(path)
                .map_err(|e| anyhow!("--fault-trace {}: {e}", path.display()))?;
            faults::schedule_from_trace(&trace, a.time_scale, a.job.model.steps, a.nodes)
                .map_err(|e| anyhow!("--fault-trace {}: {e}", path.display()))?
        }
        None => {
            faults::schedule_from_flags(a.nodes.unwrap_or(2), &a.kill, &a.join, a.job.model.steps)
                .map_err(|e| anyhow!("{e}"))?
        }
    })
}

/// The controller's listener on a free loopback port, and its address.
fn bind_controller(rt: &Runtime) -> Result<(tokio::net::TcpListener, SocketAddr)> {
    let std_listener = StdListener::bind(("127.0.0.1", 0)).context("binding the controller")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let listener = {
        let _guard = rt.enter();
        tokio::net::TcpListener::from_std(std_listener)?
    };
    Ok((listener, addr))
}

/// Injects the faults the schedule holds for the step `rec` completed: kills and joins.
fn inject_faults(
    nodes: &mut Nodes,
    schedule: &FaultSchedule,
    rec: &StepRecord,
    handle: &JobHandle,
    format: Format,
) -> Result<()> {
    for fault in schedule.at(rec.step) {
        match fault {
            Fault::Kill { node } => {
                let name = nodes.kill_group(*node)?;
                handle.fault_injected();
                format.say(&format!(
                    "lzrun local: killed node {node} ({name}) with SIGKILL after step {}",
                    rec.step
                ));
            }
            Fault::KillName { name } => {
                let i = nodes
                    .index_of(name)
                    .ok_or_else(|| anyhow!("trace kills {name}, which is not running"))?;
                nodes.kill_group(i)?;
                handle.fault_injected();
                format.say(&format!(
                    "lzrun local: killed node {i} ({name}) with SIGKILL after step {}",
                    rec.step
                ));
            }
            Fault::Join { name } => {
                let name = name
                    .clone()
                    .unwrap_or_else(|| format!("n{}", nodes.launched()));
                nodes.spawn(&name)?;
                format.say(&format!(
                    "lzrun local: started node {} ({name}) after step {}",
                    nodes.launched() - 1,
                    rec.step
                ));
            }
        }
    }
    Ok(())
}
