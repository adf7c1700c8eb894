//! `lzrun agent`: one node's agent (registers, heartbeats, runs the node's worker). With
//! `--gpus-per-node G` the process runs G agents, one worker per GPU each (device ordinals
//! 0..G, names `<name>-gpu<i>`, data ports `port + i`), registered as the G GPUs of host
//! `<name>`: the controller places expert replicas per host and fails the host whole (a
//! worker or GPU lost fences its siblings; see `lazarus_planner::job::hosts`). Killing the
//! process (a node failure) takes all G. The controller counts workers: `--nodes N·G`.

use anyhow::{Context, Result, anyhow};
use lazarus_executor::control::{AgentConfig, WorkerLaunch, run_agent};
use lazarus_executor::device::{ENV_DEVICE_ORDINAL, set_process_choice};
use tokio::sync::watch;

use crate::args::AgentArgs;
use crate::drive::{runtime, stop_signals};

/// Registers with the controller and runs this node until the job ends (or Ctrl-C).
pub fn agent(a: AgentArgs) -> Result<()> {
    let choice = a.device.choice()?;
    choice.preflight()?;
    set_process_choice(choice);
    let gpus = choice.gpus_per_node;
    let host = a
        .name
        .clone()
        .unwrap_or_else(|| format!("agent-{}", std::process::id()));
    let exe = std::env::current_exe().context("locating the lzrun executable")?;
    let mut agents = Vec::with_capacity(gpus);
    for i in 0..gpus {
        let (name, listen) = if gpus == 1 {
            (host.clone(), a.data_addr)
        } else {
            let mut listen = a.data_addr;
            if listen.port() != 0 {
                let port = u16::try_from(usize::from(listen.port()) + i).map_err(|_| {
                    anyhow!("--data-addr {}: port + {i} exceeds 65535", a.data_addr)
                })?;
                listen.set_port(port);
            }
            (format!("{host}-gpu{i}"), listen)
        };
        let mut cfg = AgentConfig::new(&a.controller, &a.token, &name, 1);
        if gpus > 1 {
            cfg.host = host.clone();
        }
        cfg.heartbeat_every_ms = a.heartbeat_ms;
        cfg.register_timeout_ms = a.register_timeout_ms;
        cfg.reconnect_grace_ms = a.reconnect_grace_ms;
        if let Some(v) = a.protocol_version {
            cfg.protocol_version = v;
        }
        let mut env: Vec<(String, String)> = choice
            .env()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        env.push((ENV_DEVICE_ORDINAL.to_owned(), i.to_string()));
        let launch = WorkerLaunch {
            exe: exe.clone(),
            listen,
            env,
        };
        agents.push((name, cfg, launch));
    }
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
        let runs = agents.into_iter().map(|(name, cfg, launch)| {
            let stop_rx = stop_rx.clone();
            async move {
                run_agent(&cfg, &launch, stop_rx)
                    .await
                    .map(|_| ())
                    .map_err(|e| anyhow!("agent {name}: {e}"))
            }
        });
        // Every agent of the node runs to its end; the first error is the node's.
        futures_util::future::join_all(runs)
            .await
            .into_iter()
            .collect::<Result<()>>()
    })
}
