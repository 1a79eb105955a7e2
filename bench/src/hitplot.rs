//! PNG plots with `plotters` (bitmap backend; text through ab_glyph with a TrueType font found
//! on the machine, or no text at all when there is none).

use crate::replay::ReplayReport;
use plotters::prelude::*;
use std::path::Path;

// The error type, error mapping and font lookup are shared with the throughput plot.
use crate::plot::{draw_err, font, PlotError};

const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 215, 0),
];

/// Block hit rate vs capacity, one line per policy, the unlimited rate dashed-ish (thin black).
pub fn hit_rate_plot(path: &Path, r: &ReplayReport, caps: &[(f64, usize)]) -> Result<(), PlotError> {
    let text = font();
    let mut policies: Vec<&str> = Vec::new();
    for row in &r.rows {
        if !policies.contains(&row.policy.as_str()) {
            policies.push(&row.policy);
        }
    }
    let xmax = caps.iter().map(|c| c.0).fold(0.0, f64::max) * 1.05;
    let ymax = (r.unlimited_block_hit_rate * 1.15).max(0.05);
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let mut b = ChartBuilder::on(&root);
    b.margin(20);
    if text {
        b.caption("block hit rate vs cache capacity (fraction of distinct blocks)", ("sans-serif", 24))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = b.build_cartesian_2d(0.0..xmax, 0.0..ymax).map_err(draw_err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("capacity / distinct blocks").y_desc("block hit rate");
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(draw_err)?;
    for (i, p) in policies.iter().enumerate() {
        let mut pts: Vec<(f64, f64)> =
            r.rows.iter().filter(|x| x.policy == *p).map(|x| (x.fraction, x.block_hit_rate)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = COLORS[i % COLORS.len()];
        // libCacheSim lines thin, kvpool's thick, Belady thickest.
        let width = if p.starts_with("libcachesim/") {
            1
        } else if p.starts_with("offline/") {
            4
        } else {
            2
        };
        let s = chart.draw_series(LineSeries::new(pts, color.stroke_width(width))).map_err(draw_err)?;
        if text {
            s.label(p.to_string())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width)));
        }
    }
    let u = r.unlimited_block_hit_rate;
    let s = chart.draw_series(LineSeries::new(vec![(0.0, u), (xmax, u)], BLACK.stroke_width(1))).map_err(draw_err)?;
    if text {
        s.label("unlimited").legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(draw_err)?;
    }
    root.present().map_err(draw_err)?;
    Ok(())
}
