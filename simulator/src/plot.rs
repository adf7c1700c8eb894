//! Charts of the domain modules' rows ([`crate::recovery`], [`crate::relayout`]; the replay's
//! are in [`crate::replay::plot`]), drawn with plotters and the DejaVu Sans font embedded by
//! the `dejavu` crate, so no system font is needed. PNG or SVG by file extension.

use crate::recovery::Row;
use crate::relayout::PolicyResult;
use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

static FONT: Once = Once::new();

pub(crate) fn register_font() {
    FONT.call_once(|| {
        // The bytes are a valid TTF shipped by the `dejavu` crate; failure would be a build bug.
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| ())
            .expect("embedded DejaVu Sans is a valid font");
    });
}

pub(crate) const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Recovery probability against failures, one line per placement (with 95 % bars for MC).
pub fn recovery_chart(path: &Path, title: &str, x_label: &str, rows: &[Row]) -> Result<()> {
    register_font();
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let size = (800, 500);
    if svg {
        draw_recovery(
            SVGBackend::new(path, size).into_drawing_area(),
            title,
            x_label,
            rows,
        )
    } else {
        draw_recovery(
            BitMapBackend::new(path, size).into_drawing_area(),
            title,
            x_label,
            rows,
        )
    }
    .with_context(|| format!("cannot draw {}", path.display()))
}

fn draw_recovery<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    rows: &[Row],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{x:?}");
    root.fill(&WHITE).map_err(e)?;
    let max_k = rows.iter().map(|r| r.failed).max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.2f64..max_k as f64 + 0.2, 0.0f64..1.05)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("recovery probability")
        .x_labels(max_k + 1)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(e)?;
    let mut places: Vec<&str> = Vec::new();
    for r in rows {
        if !places.contains(&r.place.as_str()) {
            places.push(&r.place);
        }
    }
    for (i, place) in places.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<&Row> = rows.iter().filter(|r| r.place == *place).collect();
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|r| (r.failed as f64, r.probability)),
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(*place)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                pts.iter()
                    .map(|r| Circle::new((r.failed as f64, r.probability), 4, color.filled())),
            )
            .map_err(e)?;
        chart
            .draw_series(pts.iter().filter_map(|r| {
                Some(ErrorBar::new_vertical(
                    r.failed as f64,
                    r.ci_low?,
                    r.probability,
                    r.ci_high?,
                    color.stroke_width(1),
                    6,
                ))
            }))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// `relayout.{png,svg}`: per policy, the mean max/mean device-load ratio over layers (top) and
/// the cumulative migrated bytes (bottom) against the training step.
pub fn relayout_charts(dir: &Path, results: &[PolicyResult]) -> Result<()> {
    register_font();
    for ext in ["png", "svg"] {
        let path = dir.join(format!("relayout.{ext}"));
        let size = (1000, 700);
        if ext == "svg" {
            draw_relayout(SVGBackend::new(&path, size).into_drawing_area(), results)?;
        } else {
            draw_relayout(BitMapBackend::new(&path, size).into_drawing_area(), results)?;
        }
    }
    Ok(())
}

fn draw_relayout<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    results: &[PolicyResult],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{x:?}");
    root.fill(&WHITE).map_err(e)?;
    let (top, bottom) = root.split_vertically(350);
    let rows = || results.iter().flat_map(|(_, r)| r.iter());
    let x_max = rows().map(|r| r.step as f64).fold(1.0, f64::max);
    let ratio_max = rows().map(|r| r.load_ratio).fold(1.0, f64::max) * 1.05;
    let gb_max = rows()
        .map(|r| r.migrated_bytes_cumulative as f64 / 1e9)
        .fold(1e-3, f64::max)
        * 1.05;
    let mut a = ChartBuilder::on(&top)
        .caption(
            "max/mean device load (mean over layers)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 1.0..ratio_max)
        .map_err(e)?;
    a.configure_mesh()
        .x_desc("step")
        .y_desc("load ratio")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    let mut b = ChartBuilder::on(&bottom)
        .caption("cumulative migrated state (GB)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..gb_max)
        .map_err(e)?;
    b.configure_mesh()
        .x_desc("step")
        .y_desc("GB")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    for (i, (p, r)) in results.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        a.draw_series(LineSeries::new(
            r.iter().map(|x| (x.step as f64, x.load_ratio)),
            color.stroke_width(2),
        ))
        .map_err(e)?
        .label(p.policy.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        b.draw_series(LineSeries::new(
            r.iter()
                .map(|x| (x.step as f64, x.migrated_bytes_cumulative as f64 / 1e9)),
            color.stroke_width(2),
        ))
        .map_err(e)?;
    }
    a.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
