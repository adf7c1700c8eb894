//! Replay charts: throughput over time with live nodes and preemption markers, and cumulative
//! samples, per system (PNG and SVG, embedded font).

use super::RunResult;
use crate::plot::{COLORS, register_font};
use anyhow::{Result, anyhow};
use plotters::prelude::*;
use std::path::Path;

/// `throughput.{png,svg}` and `samples.{png,svg}` for a replay: per system, throughput over time
/// with the live-node count (right axis) and failure markers, and cumulative samples.
pub fn replay_charts(dir: &Path, title: &str, results: &[RunResult]) -> Result<()> {
    register_font();
    for ext in ["png", "svg"] {
        let t = dir.join(format!("throughput.{ext}"));
        let s = dir.join(format!("samples.{ext}"));
        let size = (1000, 560);
        if ext == "svg" {
            draw_throughput(
                SVGBackend::new(&t, size).into_drawing_area(),
                title,
                results,
            )?;
            draw_samples(
                SVGBackend::new(&s, size).into_drawing_area(),
                title,
                results,
            )?;
        } else {
            draw_throughput(
                BitMapBackend::new(&t, size).into_drawing_area(),
                title,
                results,
            )?;
            draw_samples(
                BitMapBackend::new(&s, size).into_drawing_area(),
                title,
                results,
            )?;
        }
    }
    Ok(())
}

/// Largest time (minutes) and largest `y` over every system's time series (at least 1 each).
fn extent(results: &[RunResult], y: impl Fn(&super::Sample) -> f64) -> (f64, f64) {
    let all = || results.iter().flat_map(|r| r.timeseries.iter());
    (
        all().map(|s| s.t_s / 60.0).fold(1.0, f64::max),
        all().map(y).fold(1.0, f64::max),
    )
}

fn draw_throughput<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    results: &[RunResult],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{x:?}");
    root.fill(&WHITE).map_err(e)?;
    let (t_max, y_max) = extent(results, |s| s.throughput_samples_per_s);
    let y_max = y_max * 1.15;
    let n_max = results
        .iter()
        .flat_map(|r| r.timeseries.iter())
        .map(|s| s.live_nodes)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("throughput — {title}"), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .right_y_label_area_size(55)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(e)?
        .set_secondary_coord(0.0..t_max, 0.0..n_max);
    chart
        .configure_mesh()
        .x_desc("time (min)")
        .y_desc("samples / s")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    chart
        .configure_secondary_axes()
        .y_desc("live nodes")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    if let Some(first) = results.first() {
        let grey = RGBColor(120, 120, 120);
        chart
            .draw_secondary_series(LineSeries::new(
                first
                    .timeseries
                    .iter()
                    .map(|s| (s.t_s / 60.0, s.live_nodes as f64)),
                grey.stroke_width(1),
            ))
            .map_err(e)?
            .label("live nodes")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
        let red = RGBColor(200, 0, 0);
        chart
            .draw_secondary_series(
                first
                    .events
                    .iter()
                    .filter(|ev| ev.kind == "node_remove")
                    .map(|ev| TriangleMarker::new((ev.t_s / 60.0, n_max * 0.97), 5, red.filled())),
            )
            .map_err(e)?
            .label("preemption")
            .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 5, red.filled()));
    }
    for (i, r) in results.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                r.timeseries
                    .iter()
                    .map(|s| (s.t_s / 60.0, s.throughput_samples_per_s)),
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(r.summary.system.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

fn draw_samples<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    results: &[RunResult],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{x:?}");
    root.fill(&WHITE).map_err(e)?;
    let (t_max, y_max) = extent(results, |s| s.samples as f64);
    let y_max = y_max * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("cumulative samples — {title}"), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("time (min)")
        .y_desc("samples trained")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    for (i, r) in results.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                r.timeseries
                    .iter()
                    .map(|s| (s.t_s / 60.0, s.samples as f64)),
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(r.summary.system.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
