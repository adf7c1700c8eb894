//! `lzrun agent`: one node's agent (registers, heartbeats, runs the node's worker).

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{AgentConfig, WorkerLaunch, run_agent};
use tokio::sync::watch;

use crate::args::AgentArgs;
use crate::drive::{runtime, stop_signals};

/// Registers with the controller and runs this node until the job ends (or Ctrl-C).
pub fn agent(a: AgentArgs) -> Result<()> {
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| format!("agent-{}", std::process::id()));
    let mut cfg = AgentConfig::new(&a.controller, &a.token, &name, 1);
    cfg.heartbeat_every_ms = a.heartbeat_ms;
    cfg.register_timeout_ms = a.register_timeout_ms;
    cfg.reconnect_grace_ms = a.reconnect_grace_ms;
    if let Some(v) = a.protocol_version {
        cfg.protocol_version = v;
    }
    let launch = WorkerLaunch {
        exe: std::env::current_exe().context("locating the lzrun executable")?,
        listen: a.data_addr,
    };
    let rt = runtime()?;
    let stop = {
        let _guard = rt.enter();
        stop_signals()?
    };
    rt.block_on(async {
        let (stop_tx, stop_rx) = watch::channel(false);
        // SIGTERM and SIGHUP too: a scheduler stopping this node should see it say goodbye
        // (the controller then replans at once instead of waiting for a heartbeat timeout).
        tokio::spawn(async move {
            stop.await;
            let _ = stop_tx.send(true);
        });
        run_agent(&cfg, &launch, stop_rx)
            .await
            .map(|_| ())
            .map_err(|e| anyhow!("agent {name}: {e}"))
    })
}
