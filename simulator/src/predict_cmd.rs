//! `lzsim predict`: see [`crate::predict`].

use crate::cost;
use crate::predict::{self, RunDir};
use crate::replay::output;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct PredictArgs {
    /// Run directory written by `lzrun local --metrics-out DIR` (run.json, summary.json,
    /// steps.csv, reconfigurations.jsonl; routing.csv when present, else uniform loads).
    pub run_dir: PathBuf,
    /// Hardware profile: a TOML file written by `lzrun calibrate` (or a built-in name).
    /// Default: RUN_DIR/hardware.toml.
    #[arg(long, value_name = "FILE.toml")]
    pub hardware: Option<String>,
    /// Output: a side-by-side table, or JSON {"measured", "predicted", "relative_error"}.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
    /// Also write the prediction into DIR: prediction.json, the replay's timeseries.csv (t_s
    /// from the launch, the simulator's columns) and events.jsonl, and overlay.svg (measured
    /// and predicted throughput and samples over time).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

pub fn run(args: &PredictArgs) -> Result<()> {
    let run = RunDir::load(&args.run_dir)?;
    let hw_spec = match &args.hardware {
        Some(h) => h.clone(),
        None => {
            let p = args.run_dir.join("hardware.toml");
            if !p.is_file() {
                bail!(
                    "no hardware profile: pass --hardware FILE.toml (written by `lzrun \
                     calibrate`), or put it at {}",
                    p.display()
                );
            }
            p.display().to_string()
        }
    };
    let hw = cost::hardware(&hw_spec)?;
    let p = predict::predict(&run, &hw)?;
    let json = p.json();
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut bytes = serde_json::to_vec_pretty(&json)?;
        bytes.push(b'\n');
        output::write_atomic(&dir.join("prediction.json"), &bytes)?;
        let mut csv = csv::Writer::from_writer(Vec::new());
        for row in p.predicted_timeseries() {
            csv.serialize(row)?;
        }
        output::write_atomic(&dir.join("timeseries.csv"), &csv.into_inner()?)?;
        let mut events = Vec::new();
        for e in &p.replay.events {
            serde_json::to_writer(&mut events, e)?;
            events.push(b'\n');
        }
        output::write_atomic(&dir.join("events.jsonl"), &events)?;
        let measured = predict::measured_curve(&args.run_dir, &run)?;
        let title = format!(
            "{} nodes, {} steps, {} faults",
            run.config.nodes,
            run.config.steps,
            run.config.faults.events.len()
        );
        predict::overlay_chart(
            &dir.join("overlay.svg"),
            &title,
            &measured,
            &p.predicted_curve(),
        )?;
    }
    if args.format == "json" {
        crate::stdout::println(&serde_json::to_string_pretty(&json)?)?;
    } else {
        let c = &run.config;
        let faults = c.faults.events.len();
        let head = format!(
            "lzsim predict: {} nodes, {} steps, {faults} faults ({}), checkpoint every {}, \
             hardware {}\n",
            c.nodes,
            c.steps,
            c.faults.source,
            c.checkpoint
                .as_ref()
                .map_or("never".to_string(), |k| format!("{} steps", k.every_steps)),
            hw.name
        );
        crate::stdout::print(&(head + &p.text()))?;
    }
    Ok(())
}
