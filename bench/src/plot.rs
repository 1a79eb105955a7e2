//! PNG plot of `throughput` results: MB/s per system (and memcpy) vs block size, one line per
//! system and operation (bitmap backend; text through ab_glyph with a TrueType font found on the
//! machine, an error when there is none).

use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// One measured configuration.
#[derive(Debug, Clone)]
pub struct Point {
    pub system: String,
    pub op: &'static str,
    pub block_size: usize,
    pub mb_per_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("no TrueType font found under /usr/share/fonts")]
    NoFont,
    #[error("nothing to plot")]
    Empty,
    #[error("drawing: {0}")]
    Draw(String),
}

pub fn draw_err<E: std::fmt::Display>(e: E) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Register a sans-serif font once; false when none is found.
pub fn font() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let mut candidates: Vec<std::path::PathBuf> = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        ]
        .iter()
        .map(Into::into)
        .collect();
        if let Ok(d) = std::fs::read_dir("/usr/share/fonts/truetype") {
            for sub in d.flatten() {
                if let Ok(files) = std::fs::read_dir(sub.path()) {
                    candidates.extend(
                        files.flatten().map(|f| f.path()).filter(|p| p.extension().is_some_and(|e| e == "ttf")),
                    );
                }
            }
        }
        for c in candidates {
            if let Ok(bytes) = std::fs::read(&c) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

// Twelve: five systems and memcpy, a put and a get line each, all told apart.
const COLORS: [RGBColor; 18] = [
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
    RGBColor(0, 0, 128),
    RGBColor(0, 0, 0),
    RGBColor(128, 0, 0),
    RGBColor(0, 128, 128),
    RGBColor(255, 215, 0),
    RGBColor(128, 128, 0),
    RGBColor(255, 0, 255),
    RGBColor(0, 255, 0),
];

/// MB/s (log scale) vs block size (log scale), one line per (system, op), the best MB/s of each
/// block size (over batch and concurrency).
pub fn write_png(path: &Path, points: &[Point], title: &str) -> Result<(), PlotError> {
    if !font() {
        return Err(PlotError::NoFont);
    }
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for p in points {
        let label = format!("{} {}", p.system, p.op);
        let i = match series.iter().position(|s| s.0 == label) {
            Some(i) => i,
            None => {
                series.push((label, Vec::new()));
                series.len() - 1
            }
        };
        let x = p.block_size as f64;
        match series[i].1.iter_mut().find(|q| q.0 == x) {
            Some(q) => q.1 = q.1.max(p.mb_per_s),
            None => series[i].1.push((x, p.mb_per_s)),
        }
    }
    for s in &mut series {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).filter(|p| p.1 > 0.0).collect();
    if all.is_empty() {
        return Err(PlotError::Empty);
    }
    let (xmin, xmax) = all.iter().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (ymin, ymax) = all.iter().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let mut chart = ChartBuilder::on(&root)
        .margin(20)
        .caption(title, ("sans-serif", 24))
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((xmin / 1.5..xmax * 1.5).log_scale(), (ymin / 2.0..ymax * 2.0).log_scale())
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("block size (bytes)")
        .y_desc("MB/s (best over batch and concurrency)")
        .draw()
        .map_err(draw_err)?;
    let series = series.into_iter().map(|(l, pts)| (l, pts.into_iter().filter(|p| p.1 > 0.0).collect())).collect();
    draw_lines(&mut chart, series)?;
    root.present().map_err(draw_err)?;
    Ok(())
}

/// `scale` results: bytes per block (left) and lookup latency (right) against the block count,
/// both on log-log axes.
pub fn scale_plot(path: &Path, r: &crate::scale::ScaleReport) -> Result<(), PlotError> {
    if !font() {
        return Err(PlotError::NoFont);
    }
    if r.rows.is_empty() {
        return Err(PlotError::Empty);
    }
    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let (left, right) = root.split_horizontally(700);
    let x = |b: u64| b as f64;
    let bytes: Vec<(f64, f64)> = r.rows.iter().map(|w| (x(w.blocks), w.bytes_per_block.max(1.0))).collect();
    let p50: Vec<(f64, f64)> = r.rows.iter().map(|w| (x(w.blocks), w.lookup_p50_us.max(1) as f64)).collect();
    let p99: Vec<(f64, f64)> = r.rows.iter().map(|w| (x(w.blocks), w.lookup_p99_us.max(1) as f64)).collect();
    let l50: Vec<(f64, f64)> =
        r.rows.iter().filter_map(|w| w.local_p50_us.map(|v| (x(w.blocks), v.max(1) as f64))).collect();
    let l99: Vec<(f64, f64)> =
        r.rows.iter().filter_map(|w| w.local_p99_us.map(|v| (x(w.blocks), v.max(1) as f64))).collect();
    let goal_bytes: Vec<(f64, f64)> = bytes.iter().map(|p| (p.0, 200.0)).collect();
    let goal_p99: Vec<(f64, f64)> = p99.iter().map(|p| (p.0, 200.0)).collect();
    type Series<'a> = Vec<(&'a str, Vec<(f64, f64)>)>;
    let panels: [(&DrawingArea<BitMapBackend<'_>, _>, &str, &str, Series<'_>); 2] = [
        (&left, "server RSS per block", "bytes per block", vec![("measured", bytes), ("goal 200 B", goal_bytes)]),
        (
            &right,
            "lookup of a 64-block chain (client-side)",
            "microseconds",
            vec![
                ("QUIC p50", p50),
                ("QUIC p99", p99),
                ("same-host p50", l50),
                ("same-host p99", l99),
                ("goal p99 200 us", goal_p99),
            ],
        ),
    ];
    for (area, title, ylabel, series) in panels {
        let series: Series<'_> = series.into_iter().filter(|s| !s.1.is_empty()).collect();
        let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
        let (xmin, xmax) = all.iter().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (ymin, ymax) = all.iter().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let mut chart = ChartBuilder::on(area)
            .margin(20)
            .caption(title, ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((xmin / 1.5..xmax * 1.5).log_scale(), (ymin / 2.0..ymax * 2.0).log_scale())
            .map_err(draw_err)?;
        chart.configure_mesh().x_desc("resident blocks").y_desc(ylabel).draw().map_err(draw_err)?;
        draw_lines(&mut chart, series.into_iter().map(|(l, pts)| (l.to_string(), pts)).collect())?;
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

type LogLog<'a> = ChartContext<'a, BitMapBackend<'a>, Cartesian2d<LogCoord<f64>, LogCoord<f64>>>;

/// One coloured line per series, and the legend in the upper left.
fn draw_lines(chart: &mut LogLog<'_>, series: Vec<(String, Vec<(f64, f64)>)>) -> Result<(), PlotError> {
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(draw_err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)?;
    Ok(())
}
