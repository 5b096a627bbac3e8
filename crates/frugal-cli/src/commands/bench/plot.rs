//! Log-log line charts written as SVG and PNG (plotters). Every chart of the bench commands is
//! log-log: sizes span orders of magnitude, and a power law `y ~ x^k` shows as a straight line
//! of slope k, which is what these measurements are about.

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Chart<'a> {
    pub title: String,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub series: Vec<Series>,
    /// Formats y tick labels.
    pub y_fmt: fn(f64) -> String,
}

/// Markdown for a report's charts: each chart with points written into `dir` (`write`) and
/// linked as `folder/stem.svg` (the folder `dir` is, next to the markdown), with `alt` as its
/// text; a chart that cannot be drawn leaves a line saying why, and one without points nothing.
pub fn embed(charts: &[(&Chart, &str, &str)], dir: &Path, folder: &str) -> String {
    let mut md = String::new();
    for &(chart, stem, alt) in charts {
        if chart.series.iter().all(|s| s.points.is_empty()) {
            continue;
        }
        md += &match write(chart, dir, stem) {
            Ok(_) => format!("![{alt}]({folder}/{stem}.svg)\n\n"),
            Err(e) => format!("(no chart {stem}: {e})\n\n"),
        };
    }
    md
}

/// Writes `dir/stem.svg` and `dir/stem.png`; returns their paths.
pub fn write(chart: &Chart, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    crate::commands::font::register_chart_font()?;
    std::fs::create_dir_all(dir).map_err(|e| anyhow!("creating {}: {e}", dir.display()))?;
    let size = (960u32, 640u32);
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    draw(SVGBackend::new(&svg, size).into_drawing_area(), chart)?;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), chart)?;
    Ok(vec![svg, png])
}

/// A plotters error as ours (every chart of the CLI draws through these helpers).
pub(crate) fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}

/// The series colours (matplotlib's), shared by the CLI's charts.
pub(crate) const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

/// Log-axis bounds around the positive values, padded so points do not sit on the frame.
pub(crate) fn bounds(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v
        .filter(|x| *x > 0.0 && x.is_finite())
        .fold((f64::INFINITY, 0f64), |(l, h), x| (l.min(x), h.max(x)));
    if !lo.is_finite() || hi <= 0.0 {
        return (0.1, 10.0);
    }
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        (lo / 2.0, hi * 2.0)
    };
    (lo / 1.3, hi * 1.3)
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Chart) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let (x0, x1) = bounds(c.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = bounds(c.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let mut ch = ChartBuilder::on(&root)
        .margin(16)
        .caption(&c.title, ("sans-serif", 20))
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(err)?;
    let y_fmt = c.y_fmt;
    ch.configure_mesh()
        .x_desc(c.x_desc)
        .y_desc(c.y_desc)
        .x_label_formatter(&|v: &f64| format!("{}", v.round()))
        .y_label_formatter(&|v: &f64| y_fmt(*v))
        .draw()
        .map_err(err)?;
    for (i, s) in c.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.1 > 0.0).collect();
        ch.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        ch.draw_series(PointSeries::of_element(
            pts,
            3,
            color.filled(),
            &|p, s, st| EmptyElement::at(p) + Circle::new((0, 0), s, st),
        ))
        .map_err(err)?;
    }
    ch.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Least-squares slope of log(y) against log(x): the exponent k of y ~ x^k.
pub fn fitted_exponent(points: &[(f64, f64)]) -> f64 {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.0 > 0.0 && p.1 > 0.0)
        .map(|&(x, y)| (x.ln(), y.ln()))
        .collect();
    let n = pts.len() as f64;
    if n < 2.0 {
        return f64::NAN;
    }
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    sxy / sxx
}

pub fn fmt_seconds(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.1} s")
    } else if v >= 1e-3 {
        format!("{:.1} ms", v * 1e3)
    } else {
        format!("{:.0} us", v * 1e6)
    }
}

pub fn fmt_bytes(v: f64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut x, mut i) = (v, 0);
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    if x >= 10.0 || i == 0 {
        format!("{x:.0} {}", U[i])
    } else {
        format!("{x:.1} {}", U[i])
    }
}
