//! `lzrun controller`: the controller of a multi-machine job, or (`--recover DIR`) the
//! replacement of one that died.

use std::net::{SocketAddr, TcpListener};

use anyhow::{Context, Result, ensure};

use crate::args::ControllerArgs;
use crate::drive::{NoHooks, drive, runtime, stop_signals};
use crate::job::{Job, job_from_args};
use crate::report::Report;

/// Where agents find the controller unless `--listen` (or the saved job) says otherwise.
const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 29400);

/// Listens for agents, waits for `--nodes` of them, runs the job and prints its report; with
/// `--recover DIR`, takes back the job saved in DIR instead.
pub fn controller(a: ControllerArgs) -> Result<()> {
    ensure!(!a.token.is_empty(), "the token is empty");
    let rt = runtime()?;
    // Before the checkpoint directory is locked: a stop signal from here on ends the job
    // cleanly (agents told to stop, staging directories removed).
    let stop = {
        let _guard = rt.enter();
        stop_signals()?
    };
    let (mut job, recovered) = match &a.recover {
        Some(dir) => {
            let (job, controller) = Job::recover(dir, &a.token)?;
            (job, Some(controller))
        }
        None => (job_from_args(&a.job, a.nodes, &a.token, false)?, None),
    };
    let saved_listen = recovered.as_ref().and_then(|c| c.saved_listen_addr());
    let listen = a.listen.or(saved_listen).unwrap_or(DEFAULT_LISTEN);
    let listener = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let controller = match recovered {
        Some(c) => c,
        None => job.controller(bound)?,
    };
    let steps = job.params.rules.total_steps;
    let mut report = Report::new(a.job.format, steps);
    // A recovered job's peak is this command's --peak-tflops too: a reporting option.
    let (basis, mfu_line) = crate::report::mfu_basis(a.job.peak_tflops, &job.params.config, None);
    report.set_mfu_basis(basis);
    match (&a.recover, &job.state_dir) {
        (Some(dir), _) => report.say(&format!(
            "lzrun controller: listening on {bound}, taking back the job saved in {}",
            dir.display()
        )),
        (None, Some(dir)) => report.say(&format!(
            "lzrun controller: listening on {bound}, waiting for {} agents; job state saved in \
             {} (--recover it if this controller dies)",
            a.nodes,
            dir.display()
        )),
        (None, None) => report.say(&format!(
            "lzrun controller: listening on {bound}, waiting for {} agents (no --state-dir: \
             the job cannot outlive this controller)",
            a.nodes
        )),
    }
    if let Some(line) = mfu_line {
        report.say(&line);
    }
    let config = job.params.config.clone();
    let result = rt.block_on(drive(
        listener,
        job.server,
        controller,
        None,
        &mut report,
        &mut NoHooks,
        stop,
    ));
    job.clean_up(&result);
    result?;
    report.finish(&a.job, &config)
}
