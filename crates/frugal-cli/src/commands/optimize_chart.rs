//! The frontier chart of `frugal optimize`: `frontier.svg` and `frontier.html`, written beside
//! `frontier.json` after every run (and again from it by `frugal optimize --chart DIR`).
//!
//! What the chart shows, and why it is laid out this way:
//! - y, in every panel: the mean KL to the base at the point's latest rung, on a log axis (KL
//!   spans orders of magnitude between formats). A KL of 0 (a point that rounds to the base)
//!   has no place on a log axis, so KL below [`KL_FLOOR`] is drawn at it; the axis says so.
//! - Left panel, when some point was timed: x is decode speed relative to the base (log: a
//!   ratio's steps are multiplicative). The funnel times only the few contenders, so most
//!   points have no speed.
//! - Right panel (the whole chart when nothing was timed): x is bits per weight, for every
//!   point with a quality measurement. Decode reads the weights, so bits per weight is what
//!   the untimed points' speed follows; a second panel on the same KL axis places them where a
//!   strip of "not timed" markers would only have listed them, and a point's height reads the
//!   same in both panels.
//! - Colour: memory (weights plus the KV cache at the config's context), with a colour bar.
//!   Size and outline carry the point's fate instead: on the frontier (dark outline), dropped
//!   by the funnel (faded), the chosen point ringed and named.
//! - Targets on these axes as dashed lines: `kl <= X` across both panels, `decode >= Nx` in
//!   the speed panel, `memory <= N` as a mark on the colour bar.
//!
//! The page is self-contained (no script, no network): the SVG inline, the targets, the chosen
//! point or the binding constraints, the warnings, then a table of every point.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;
use frugal_lab::optimize::search;
use frugal_lab::optimize::target::{Metric, Unit};
use frugal_lab::optimize::{Point, State, write_atomic};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::bench::plot::{COLORS, bounds, err};

/// KL at or below this (0 included) is drawn at it: a log axis has no 0.
pub const KL_FLOOR: f64 = 1e-5;
const SIZE: (u32, u32) = (1200, 720);
const BAR_WIDTH: u32 = 140;
/// Characters of footer text per line at its font size across the chart's width.
const FOOT_CHARS: usize = 150;
const FOOT_LINES: usize = 6;
const Y_DESC: &str = "mean KL to the base, nats (log; below 1e-5 drawn at 1e-5)";

/// What [`write`] wrote.
pub struct Written {
    pub html: PathBuf,
    /// `frontier.svg`, or why the chart could not be drawn (no font, a plotting error): the
    /// page is written either way, since its table is the measurement.
    pub svg: std::result::Result<PathBuf, String>,
}

/// Writes `frontier.svg` (when it can be drawn) and `frontier.html` into `dir`.
pub fn write(state: &State, dir: &Path) -> Result<Written> {
    let drawn = svg(state).map_err(|e| format!("{e:#}"));
    let svg = match &drawn {
        Ok(text) => {
            let p = dir.join("frontier.svg");
            write_atomic(&p, text.as_bytes())?;
            Ok(p)
        }
        Err(e) => Err(e.clone()),
    };
    let html = dir.join("frontier.html");
    let page = page(state, drawn.as_deref().map_err(String::as_str));
    write_atomic(&html, page.as_bytes())?;
    Ok(Written { html, svg })
}

/// The chart as an SVG document, its `<title>` naming the chosen point in full (the visible
/// footer wraps and may shorten a long key).
pub fn svg(state: &State) -> Result<String> {
    super::font::register_chart_font()?;
    let mut buf = String::new();
    draw(
        SVGBackend::with_string(&mut buf, SIZE).into_drawing_area(),
        state,
    )?;
    let title = match &state.chosen {
        Some(k) => format!("frugal optimize frontier; chosen: {k}"),
        None => "frugal optimize frontier; no point meets every target".to_string(),
    };
    if let Some(i) = buf.find('>') {
        buf.insert_str(i + 1, &format!("\n<title>{}</title>", esc(&title)));
    }
    Ok(buf)
}

fn kl(p: &Point) -> Option<f64> {
    p.latest().map(|q| q.kl_mean.max(KL_FLOOR))
}

fn mib(p: &Point) -> Option<f64> {
    p.memory.map(|m| m.total() as f64 / 1048576.0)
}

/// How a point is drawn: the outline says frontier, the fade says dropped.
#[derive(Clone, Copy, PartialEq)]
struct Kind {
    frontier: bool,
    dropped: bool,
}

impl Kind {
    /// Drawn in this order, so that the frontier sits on top of what it beat.
    const ALL: [Kind; 4] = [
        Kind {
            frontier: false,
            dropped: true,
        },
        Kind {
            frontier: false,
            dropped: false,
        },
        Kind {
            frontier: true,
            dropped: true,
        },
        Kind {
            frontier: true,
            dropped: false,
        },
    ];

    fn of(p: &Point) -> Kind {
        Kind {
            frontier: p.pareto,
            dropped: p.dropped.is_some(),
        }
    }

    fn label(self) -> &'static str {
        match (self.frontier, self.dropped) {
            (true, false) => "on the frontier",
            (true, true) => "on the frontier, dropped by the funnel",
            (false, false) => "not on the frontier",
            (false, true) => "dropped by the funnel",
        }
    }

    /// Fill, outline and radius.
    fn style(self, c: RGBColor) -> (ShapeStyle, ShapeStyle, i32) {
        let fill = if self.dropped {
            c.mix(0.3).filled()
        } else {
            c.filled()
        };
        if self.frontier {
            (fill, RGBColor(30, 30, 30).stroke_width(2), 6)
        } else if self.dropped {
            (fill, c.mix(0.5).stroke_width(1), 4)
        } else {
            (fill, c.stroke_width(1), 5)
        }
    }
}

/// Memory (MiB) to colour: viridis between the smallest and largest memory measured.
struct MemScale {
    lo: f64,
    hi: f64,
}

const VIRIDIS: [(f64, f64, f64); 5] = [
    (68.0, 1.0, 84.0),
    (59.0, 82.0, 139.0),
    (33.0, 145.0, 140.0),
    (94.0, 201.0, 98.0),
    (253.0, 231.0, 37.0),
];
const NO_MEMORY: RGBColor = RGBColor(160, 160, 160);

impl MemScale {
    fn of(points: &[&Point]) -> Option<MemScale> {
        let v: Vec<f64> = points.iter().filter_map(|p| mib(p)).collect();
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        lo.is_finite().then_some(MemScale { lo, hi })
    }

    /// Where `m` falls between the ends (the middle when every point has the same memory).
    fn t(&self, m: f64) -> f64 {
        if self.hi > self.lo {
            ((m - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0)
        } else {
            0.5
        }
    }

    fn color(&self, m: Option<f64>) -> RGBColor {
        m.map_or(NO_MEMORY, |m| viridis(self.t(m)))
    }
}

fn viridis(t: f64) -> RGBColor {
    let x = t.clamp(0.0, 1.0) * (VIRIDIS.len() - 1) as f64;
    let i = (x.floor() as usize).min(VIRIDIS.len() - 2);
    let f = x - i as f64;
    let (a, b) = (VIRIDIS[i], VIRIDIS[i + 1]);
    let mix = |p: f64, q: f64| (p + (q - p) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// One panel: which x a point has, the axis' ticks and the vertical target lines.
struct Panel {
    title: &'static str,
    x_desc: &'static str,
    x: fn(&Point) -> Option<f64>,
    ticks: &'static [f64],
    x_fmt: fn(f64) -> String,
    vlines: Vec<(f64, String)>,
    legend: bool,
}

/// Everything the panels share.
struct Common<'a> {
    points: Vec<&'a Point>,
    y: (f64, f64),
    hlines: Vec<(f64, String)>,
    mem: Option<MemScale>,
    chosen: Option<&'a str>,
}

const TARGET: RGBColor = COLORS[1];

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, s: &State) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let name = Path::new(&s.base.path)
        .file_name()
        .map_or(s.base.path.clone(), |n| n.to_string_lossy().into_owned());
    let root = root
        .titled(
            &format!("frugal optimize, {name}: quality against speed, memory in colour"),
            ("sans-serif", 20),
        )
        .map_err(err)?;
    let foot = footer(s);
    let (w, h) = root.dim_in_pixel();
    let (main, bottom) = root.split_vertically(h - (foot.len() as u32 * 17 + 14));
    let (plots, bar) = main.split_horizontally(w - BAR_WIDTH);

    let points: Vec<&Point> = s.points.iter().filter(|p| p.latest().is_some()).collect();
    let targets = &s.config.targets;
    let hlines: Vec<(f64, String)> = targets
        .iter()
        .filter(|t| t.metric == Metric::Kl)
        .map(|t| (t.value, t.to_string()))
        .collect();
    let y = bounds(
        points
            .iter()
            .filter_map(|p| kl(p))
            .chain(hlines.iter().map(|l| l.0)),
    );
    let common = Common {
        mem: MemScale::of(&points),
        points,
        y,
        hlines,
        chosen: s.chosen.as_deref(),
    };
    let bpw = Panel {
        title: "every point with a quality measurement",
        x_desc: "bits per weight (log)",
        x: |p| Some(p.bpw),
        ticks: &[
            1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0,
        ],
        x_fmt: |v| format!("{v}"),
        vlines: Vec::new(),
        legend: true,
    };
    if common.points.iter().any(|p| p.speed.is_some()) {
        let speed = Panel {
            title: "the timed points",
            x_desc: "decode speed, times the base's (log)",
            x: |p| p.speed.map(|s| s.decode_ratio),
            ticks: &[
                0.1, 0.2, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 50.0,
                100.0,
            ],
            x_fmt: |v| format!("{v}x"),
            vlines: targets
                .iter()
                .filter(|t| t.metric == Metric::Decode && t.unit == Unit::Ratio)
                .map(|t| (t.value, t.to_string()))
                .collect(),
            legend: false,
        };
        let (left, right) = plots.split_horizontally(plots.dim_in_pixel().0 * 2 / 5);
        panel(&left, &speed, &common)?;
        panel(&right, &bpw, &common)?;
    } else {
        panel(&plots, &bpw, &common)?;
    }
    color_bar(&bar, s, common.mem.as_ref())?;
    let font = ("sans-serif", 13).into_font();
    for (i, line) in foot.iter().enumerate() {
        bottom
            .draw(&Text::new(
                line.clone(),
                (16, 4 + 17 * i as i32),
                font.clone(),
            ))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

fn panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, pan: &Panel, c: &Common) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let placed: Vec<(f64, f64, &Point)> = c
        .points
        .iter()
        .filter_map(|p| Some(((pan.x)(p)?, kl(p)?, *p)))
        .collect();
    let (x0, x1) = bounds(
        placed
            .iter()
            .map(|q| q.0)
            .chain(pan.vlines.iter().map(|l| l.0)),
    );
    let mut ticks: Vec<f64> = pan
        .ticks
        .iter()
        .copied()
        .filter(|t| (x0..=x1).contains(t))
        .collect();
    if ticks.len() < 2 {
        ticks = vec![x0, (x0 * x1).sqrt(), x1];
    }
    let (y0, y1) = c.y;
    let mut ch = ChartBuilder::on(area)
        .margin(12)
        .caption(pan.title, ("sans-serif", 16))
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(
            (x0..x1).log_scale().with_key_points(ticks),
            (y0..y1).log_scale(),
        )
        .map_err(err)?;
    let x_fmt = pan.x_fmt;
    ch.configure_mesh()
        .x_desc(pan.x_desc)
        .y_desc(Y_DESC)
        .x_label_formatter(&|v: &f64| x_fmt(round3(*v)))
        .y_label_formatter(&|v: &f64| fmt_kl(*v))
        .draw()
        .map_err(err)?;

    let label_font = ("sans-serif", 13).into_font().color(&TARGET);
    let dashed = |pts: Vec<(f64, f64)>| DashedLineSeries::new(pts, 8, 5, TARGET.stroke_width(2));
    for (v, name) in &c.hlines {
        ch.draw_series(dashed(vec![(x0, *v), (x1, *v)]))
            .map_err(err)?;
        ch.draw_series(std::iter::once(
            EmptyElement::at((x0, *v)) + Text::new(name.clone(), (6, -16), label_font.clone()),
        ))
        .map_err(err)?;
    }
    for (v, name) in &pan.vlines {
        ch.draw_series(dashed(vec![(*v, y0), (*v, y1)]))
            .map_err(err)?;
        ch.draw_series(std::iter::once(
            EmptyElement::at((*v, y1)) + Text::new(name.clone(), (6, 6), label_font.clone()),
        ))
        .map_err(err)?;
    }

    let legend_color = viridis(0.5);
    for kind in Kind::ALL {
        let these: Vec<(f64, f64, RGBColor)> = placed
            .iter()
            .filter(|q| Kind::of(q.2) == kind)
            .map(|&(x, y, p)| (x, y, c.mem.as_ref().map_or(NO_MEMORY, |m| m.color(mib(p)))))
            .collect();
        if these.is_empty() {
            continue;
        }
        let anno = ch
            .draw_series(these.into_iter().map(move |(x, y, color)| {
                let (fill, line, r) = kind.style(color);
                EmptyElement::at((x, y))
                    + Circle::new((0, 0), r, fill)
                    + Circle::new((0, 0), r, line)
            }))
            .map_err(err)?;
        if pan.legend {
            anno.label(kind.label()).legend(move |(x, y)| {
                let (fill, line, r) = kind.style(legend_color);
                EmptyElement::at((x + 10, y))
                    + Circle::new((0, 0), r, fill)
                    + Circle::new((0, 0), r, line)
            });
        }
    }
    if let Some(&(x, y, _)) = placed.iter().find(|q| Some(q.2.key.as_str()) == c.chosen) {
        let bold = ("sans-serif", 14).into_font().style(FontStyle::Bold);
        let anno = ch
            .draw_series(std::iter::once(
                EmptyElement::at((x, y))
                    + Circle::new((0, 0), 11, BLACK.stroke_width(2))
                    + Text::new("chosen", (12, -24), bold),
            ))
            .map_err(err)?;
        if pan.legend {
            anno.label("chosen").legend(|(x, y)| {
                EmptyElement::at((x + 10, y)) + Circle::new((0, 0), 8, BLACK.stroke_width(2))
            });
        }
    }
    if placed.is_empty() {
        area.draw(&Text::new(
            "no point to place here yet",
            (90, 60),
            ("sans-serif", 14),
        ))
        .map_err(err)?;
    }
    if pan.legend {
        ch.configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

/// The memory colour bar, with the `memory <= N` target marked on it.
fn color_bar<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    s: &State,
    mem: Option<&MemScale>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let (_, h) = area.dim_in_pixel();
    let font = ("sans-serif", 13).into_font();
    area.draw(&Text::new("memory, MiB", (4, 40), font.clone()))
        .map_err(err)?;
    area.draw(&Text::new(
        format!("at {} tokens", s.config.context),
        (4, 58),
        font.clone(),
    ))
    .map_err(err)?;
    let Some(mem) = mem else {
        area.draw(&Text::new("none measured", (4, 84), font))
            .map_err(err)?;
        return Ok(());
    };
    let (top, bottom, x0, x1) = (84i32, h as i32 - 70, 8i32, 30i32);
    let steps = 64;
    let len = (bottom - top) as f64;
    let y_of = |t: f64| bottom - (t * len).round() as i32;
    for i in 0..steps {
        let (t0, t1) = (i as f64 / steps as f64, (i + 1) as f64 / steps as f64);
        area.draw(&Rectangle::new(
            [(x0, y_of(t1)), (x1, y_of(t0))],
            viridis((t0 + t1) / 2.0).filled(),
        ))
        .map_err(err)?;
    }
    area.draw(&Rectangle::new(
        [(x0, top), (x1, bottom)],
        BLACK.stroke_width(1),
    ))
    .map_err(err)?;
    let tick = TextStyle::from(font.clone()).pos(Pos::new(HPos::Left, VPos::Center));
    let one_decimal = mem.hi - mem.lo < 10.0;
    let n = if mem.hi > mem.lo { 4 } else { 0 };
    for i in 0..=n {
        let t = if n == 0 { 0.5 } else { i as f64 / n as f64 };
        let v = mem.lo + (mem.hi - mem.lo) * t;
        let text = if one_decimal {
            format!("{v:.1}")
        } else {
            format!("{v:.0}")
        };
        let y = y_of(t);
        area.draw(&PathElement::new(vec![(x1, y), (x1 + 4, y)], BLACK))
            .map_err(err)?;
        area.draw(&Text::new(text, (x1 + 7, y), tick.clone()))
            .map_err(err)?;
    }
    for t in s
        .config
        .targets
        .iter()
        .filter(|t| t.metric == Metric::Memory)
    {
        // The bound in words under the bar; a red mark on the bar where it falls inside.
        let v = t.value / 1048576.0;
        let label = TextStyle::from(font.clone()).color(&TARGET);
        area.draw(&Text::new(t.to_string(), (4, bottom + 24), label))
            .map_err(err)?;
        if (mem.lo..=mem.hi).contains(&v) && mem.hi > mem.lo {
            let y = y_of(mem.t(v));
            area.draw(&PathElement::new(
                vec![(x0 - 4, y), (x1 + 4, y)],
                TARGET.stroke_width(3),
            ))
            .map_err(err)?;
        }
    }
    Ok(())
}

/// The lines under the chart: what was measured, and the chosen point's key in full (wrapped,
/// cut after a few lines; the page's table has every key).
fn footer(s: &State) -> Vec<String> {
    let with_q = s.points.iter().filter(|p| p.latest().is_some()).count();
    let timed = s.points.iter().filter(|p| p.speed.is_some()).count();
    let mut lines = vec![format!(
        "{with_q} points with a quality measurement, {timed} timed; KL at each point's latest rung; status: {}",
        s.status
    )];
    let mut rest = Vec::new();
    match &s.chosen {
        Some(k) => rest.extend(wrap(&format!("chosen: {k}"), FOOT_CHARS)),
        None => {
            rest.push("no point meets every target".to_string());
            for b in &s.binding {
                rest.extend(wrap(b, FOOT_CHARS));
            }
        }
    }
    if rest.len() > FOOT_LINES - 1 {
        rest.truncate(FOOT_LINES - 1);
        if let Some(last) = rest.last_mut() {
            last.push_str(" ...");
        }
    }
    lines.extend(rest);
    lines
}

/// `text` in lines of at most `width` characters, broken after spaces and `+` (a recipe's
/// rules); a piece longer than a line stays whole.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for piece in text.split_inclusive([' ', '+']) {
        let cur = lines.last_mut().expect("a line");
        if !cur.is_empty() && cur.chars().count() + piece.chars().count() > width {
            lines.push(piece.to_string());
        } else {
            cur.push_str(piece);
        }
    }
    lines
}

/// Tick values are computed in floating point: 2.9999999 prints as 3.
fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn fmt_kl(v: f64) -> String {
    if v >= 0.01 {
        format!("{}", round3(v))
    } else {
        format!("{v:.0e}")
    }
}

/// `s` safe as HTML text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em;color:#222;max-width:1400px}
svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:13px}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f3f3f3}
td.key{text-align:left;font-family:monospace;word-break:break-all;max-width:46em}
td.why{text-align:left;max-width:24em}
tr.dropped{color:#888}
tr.frontier td.key{font-weight:bold}
tr.chosen{background:#fff3c4}
code{word-break:break-all}";

/// `frontier.html`: the chart inline (or why there is none), the targets and the chosen point
/// (or what binds), the warnings, then a table of every point: what a reader wants first comes
/// first, the long table last. Every string from the state is escaped.
pub fn page(s: &State, svg: std::result::Result<&str, &str>) -> String {
    let mut h = String::new();
    let name = esc(&s.base.path);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>frugal optimize: {name}</title>\n<style>\n{STYLE}\n</style>\n</head>\n<body>\n\
         <h1>frugal optimize: the frontier</h1>\n<p>Base <code>{name}</code> (sha256 {}), \
         frugal {}, status <b>{}</b>. Memory counts a KV cache of {} tokens.</p>\n",
        esc(s.base.sha256.get(..12).unwrap_or(&s.base.sha256)),
        esc(&s.frugal_version),
        esc(&s.status),
        s.config.context
    );
    h += "<h2>Chart</h2>\n";
    match svg {
        Ok(svg) => {
            h += "<figure>\n";
            h += svg;
            h += "</figure>\n";
        }
        Err(e) => {
            let _ = writeln!(h, "<p>No chart: {}</p>", esc(e));
        }
    }
    h += "<h2>Targets</h2>\n<ul>\n";
    for t in &s.config.targets {
        let _ = writeln!(h, "<li><code>{}</code></li>", esc(&t.to_string()));
    }
    let _ = writeln!(
        h,
        "</ul>\n<p>Objective among the points that meet every target: {}.</p>",
        format!("{:?}", s.config.objective).to_lowercase()
    );
    match s.chosen.as_deref().and_then(|k| s.point(k)) {
        Some(p) => {
            let met: Vec<String> = search::readings(&s.config.targets, &p.measured())
                .into_iter()
                .map(|(t, v)| format!("{}: {}", esc(&t), esc(&v)))
                .collect();
            let r = p.recipe.runtime;
            let _ = write!(
                h,
                "<h2>Chosen</h2>\n<p><code class=\"chosen\">{}</code></p>\n<p>{}</p>\n\
                 <p>Run it with <code>frugal serve -m model.gguf --kv-type {} --activations {}</code> \
                 (in this directory, beside <code>recipe.toml</code>).</p>\n",
                esc(&p.key),
                met.join("; "),
                esc(&r.kv.to_string()),
                esc(&r.activations.to_string())
            );
        }
        None => {
            h += "<h2>No point meets every target</h2>\n<ul>\n";
            for b in &s.binding {
                let _ = writeln!(h, "<li>{}</li>", esc(b));
            }
            for k in &s.closest {
                let _ = writeln!(h, "<li>closest: <code>{}</code></li>", esc(k));
            }
            h += "</ul>\n";
        }
    }
    if !s.warnings.is_empty() {
        h += "<h2>Warnings</h2>\n<ul>\n";
        for w in &s.warnings {
            let _ = writeln!(h, "<li>{}</li>", esc(w));
        }
        h += "</ul>\n";
    }
    if !s.refused.is_empty() {
        h += "<h2>Not searched</h2>\n<ul>\n";
        for r in &s.refused {
            let _ = writeln!(h, "<li>{}</li>", esc(r));
        }
        h += "</ul>\n";
    }
    if !s.gates.is_empty() {
        h += "<h2>Cuts timed against their dense twin</h2>\n<ul>\n";
        for g in &s.gates {
            let _ = writeln!(
                h,
                "<li>{} as {}: {}</li>",
                esc(&g.cut.to_string()),
                esc(&g.format),
                esc(&g.reason)
            );
        }
        h += "</ul>\n";
    }
    if !s.speculation.is_empty() {
        h += "<h2>Speculative decoding with the chosen point</h2>\n<ul>\n";
        for t in &s.speculation {
            let _ = writeln!(
                h,
                "<li>{}: {:.2}x over plain decoding, {:.2}x over the base (acceptance {:.2}){}</li>",
                esc(&t.drafter),
                t.speedup,
                t.over_base,
                t.acceptance,
                if t.taken { ", paired" } else { "" }
            );
        }
        h += "</ul>\n";
    }
    table(&mut h, s);
    h += "</body>\n</html>\n";
    h
}

/// Every point, smallest weights first (as the command prints them).
fn table(h: &mut String, s: &State) {
    let mut pts: Vec<&Point> = s.points.iter().collect();
    pts.sort_by_key(|p| p.weight_bytes);
    let _ = writeln!(
        h,
        "<h2>Points</h2>\n<p>{} points; KL, its standard error and top-1 agreement at each \
         point's latest rung (tokens); decode relative to the base, timed back to back.</p>",
        pts.len()
    );
    h.push_str(
        "<table>\n<tr><th>recipe</th><th>bits/weight</th><th>KL</th><th>± KL</th>\
         <th>tokens</th><th>top-1</th><th>decode</th><th>memory MiB</th><th>frontier</th>\
         <th>chosen</th><th>dropped</th></tr>\n",
    );
    let dash = || "-".to_string();
    for p in pts {
        let chosen = s.chosen.as_deref() == Some(p.key.as_str());
        let mut class = Vec::new();
        if chosen {
            class.push("chosen");
        }
        if p.pareto {
            class.push("frontier");
        }
        if p.dropped.is_some() {
            class.push("dropped");
        }
        let q = p.latest();
        let _ = writeln!(
            h,
            "<tr class=\"{}\"><td class=\"key\">{}</td><td>{:.2}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td class=\"why\">{}</td></tr>",
            class.join(" "),
            esc(&p.key),
            p.bpw,
            q.map_or_else(dash, |q| format!("{:.5}", q.kl_mean)),
            q.map_or_else(dash, |q| format!("{:.5}", q.kl_stderr)),
            p.quality.last().map_or_else(dash, |r| r.tokens.to_string()),
            q.map_or_else(dash, |q| format!("{:.2}%", q.top1 * 100.0)),
            p.speed
                .map_or_else(dash, |s| format!("{:.2}x", s.decode_ratio)),
            mib(p).map_or_else(dash, |m| format!("{m:.1}")),
            if p.pareto { "yes" } else { "" },
            if chosen { "yes" } else { "" },
            p.dropped.as_deref().map_or_else(String::new, esc),
        );
    }
    h.push_str("</table>\n");
}
