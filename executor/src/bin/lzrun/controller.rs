//! `lzrun controller`: the controller of a multi-machine job.

use anyhow::{Context, Result, ensure};

use crate::args::ControllerArgs;
use crate::drive::{NoHooks, drive, runtime, stop_signals};
use crate::job::job_from_args;
use crate::report::Report;

/// Listens for agents, waits for `--nodes` of them, runs the job and prints its report.
pub fn controller(a: ControllerArgs) -> Result<()> {
    ensure!(!a.token.is_empty(), "the token is empty");
    let rt = runtime()?;
    // Before the checkpoint directory is locked: a stop signal from here on ends the job
    // cleanly (agents told to stop, staging directories removed).
    let stop = {
        let _guard = rt.enter();
        stop_signals()?
    };
    let job = job_from_args(&a.job, a.nodes, &a.token)?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(a.listen))
        .with_context(|| format!("listening on {}", a.listen))?;
    let mut report = Report::new(a.job.format, a.job.model.steps);
    report.say(&format!(
        "lzrun controller: listening on {}, waiting for {} agents",
        a.listen, a.nodes
    ));
    let config = job.params.config.clone();
    let result = rt.block_on(drive(
        listener,
        job.server,
        job.params.clone(),
        &mut report,
        &mut NoHooks,
        stop,
    ));
    job.clean_up(&result);
    result?;
    report.finish(&a.job, &config)
}
