//! What the user asks of the optimized model: constraints (`decode >= 5x`, `kl <= 0.05`,
//! `memory <= 150MiB`, ...) and an objective to maximize among the points that meet them.
//!
//! Grammar: `METRIC OP VALUE`, spaces optional.
//! - `decode` / `prefill` `>=` `Nx` (relative to the base, measured back to back) or `N tok/s`;
//! - `kl` / `p99kl` `<=` nats (mean and 99th-percentile KL(base ‖ candidate));
//! - `ppl` `<=` `+N%` (perplexity change from the base's) or an absolute perplexity;
//! - `top1` `>=` a fraction or `N%` (positions where both put the same token first);
//! - `memory` `<=` `N` with `B`, `KB`/`KiB`, `MB`/`MiB`, `GB`/`GiB`: weights plus a batch-1 KV
//!   cache at `--context` tokens.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A measured quantity a target constrains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Decode,
    Prefill,
    Kl,
    P99Kl,
    Ppl,
    Top1,
    Memory,
}

impl Metric {
    const NAMES: [(&'static str, Metric); 7] = [
        ("decode", Metric::Decode),
        ("prefill", Metric::Prefill),
        ("kl", Metric::Kl),
        ("p99kl", Metric::P99Kl),
        ("ppl", Metric::Ppl),
        ("top1", Metric::Top1),
        ("memory", Metric::Memory),
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, m)| *m == self).unwrap().0
    }

    /// Whether more is better (speeds, top-1 agreement).
    pub fn higher_is_better(self) -> bool {
        matches!(self, Metric::Decode | Metric::Prefill | Metric::Top1)
    }

    /// Whether the metric needs a speed measurement.
    pub fn is_speed(self) -> bool {
        matches!(self, Metric::Decode | Metric::Prefill)
    }
}

impl FromStr for Metric {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|&(_, m)| m)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
                format!("unknown metric {s:?} (expected {})", names.join(", "))
            })
    }
}

/// How a bound's number reads.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    /// Times the base's figure (speeds).
    Ratio,
    /// Tokens per second.
    TokPerSec,
    /// Relative change from the base's (perplexity: 0.02 is +2%).
    Change,
    /// The metric's own unit: nats, a perplexity, a fraction, bytes.
    Plain,
}

/// One constraint: `metric` at least (speeds, top-1) or at most (the rest) `value`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub metric: Metric,
    pub value: f64,
    pub unit: Unit,
}

/// What a point measured, in the terms targets read. `None`: not measured (yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    pub kl: Option<f64>,
    pub p99kl: Option<f64>,
    pub ppl: Option<f64>,
    pub ppl_change: Option<f64>,
    pub top1: Option<f64>,
    pub memory: Option<f64>,
    pub decode: Option<f64>,
    pub decode_ratio: Option<f64>,
    pub prefill: Option<f64>,
    pub prefill_ratio: Option<f64>,
}

impl Target {
    /// The figure of `m` this target reads.
    pub fn read(&self, m: &Measured) -> Option<f64> {
        match (self.metric, self.unit) {
            (Metric::Decode, Unit::Ratio) => m.decode_ratio,
            (Metric::Decode, _) => m.decode,
            (Metric::Prefill, Unit::Ratio) => m.prefill_ratio,
            (Metric::Prefill, _) => m.prefill,
            (Metric::Kl, _) => m.kl,
            (Metric::P99Kl, _) => m.p99kl,
            (Metric::Ppl, Unit::Change) => m.ppl_change,
            (Metric::Ppl, _) => m.ppl,
            (Metric::Top1, _) => m.top1,
            (Metric::Memory, _) => m.memory,
        }
    }

    /// How far `m` is from meeting the target, relative to the bound: 0 when met, 0.5 when a
    /// speed is half short or a KL 50% over. `None` when not measured.
    pub fn shortfall(&self, m: &Measured) -> Option<f64> {
        let x = self.read(m)?;
        let b = self.value;
        let scale = b.abs().max(1e-12);
        Some(if self.metric.higher_is_better() {
            ((b - x) / scale).max(0.0)
        } else {
            ((x - b) / scale).max(0.0)
        })
    }

    /// Whether `m` meets the target (`None`: not measured).
    pub fn met(&self, m: &Measured) -> Option<bool> {
        self.shortfall(m).map(|s| s == 0.0)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.metric.higher_is_better() {
            ">="
        } else {
            "<="
        };
        let v = self.value;
        let value = match (self.metric, self.unit) {
            (_, Unit::Ratio) => format!("{v}x"),
            (_, Unit::TokPerSec) => format!("{v}tok/s"),
            (_, Unit::Change) => format!("{:+}%", v * 100.0),
            (Metric::Memory, _) => format!("{}MiB", v / (1024.0 * 1024.0)),
            _ => format!("{v}"),
        };
        write!(f, "{} {op} {value}", self.metric.name())
    }
}

fn number(s: &str, whole: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("target {whole:?}: {s:?} is not a number"))
}

impl FromStr for Target {
    type Err = String;
    fn from_str(whole: &str) -> Result<Self, String> {
        let s = whole.trim();
        let (at, op) = ["<=", ">="]
            .iter()
            .filter_map(|op| s.find(op).map(|i| (i, *op)))
            .min()
            .ok_or_else(|| {
                format!(
                    "target {whole:?}: no comparison (write METRIC >= VALUE or METRIC <= VALUE)"
                )
            })?;
        let metric: Metric = s[..at]
            .trim()
            .parse()
            .map_err(|e| format!("target {whole:?}: {e}"))?;
        let want = if metric.higher_is_better() {
            ">="
        } else {
            "<="
        };
        if op != want {
            return Err(format!(
                "target {whole:?}: {op:?} on {}: it can only be bounded with {want}",
                metric.name()
            ));
        }
        let raw = s[at + 2..].trim();
        if raw.is_empty() {
            return Err(format!("target {whole:?}: no value after {op}"));
        }
        let lower = raw.to_ascii_lowercase().replace(' ', "");
        let (value, unit) = match metric {
            Metric::Decode | Metric::Prefill => {
                if let Some(n) = lower.strip_suffix('x') {
                    (number(n, whole)?, Unit::Ratio)
                } else if let Some(n) = lower.strip_suffix("tok/s") {
                    (number(n, whole)?, Unit::TokPerSec)
                } else {
                    return Err(format!(
                        "target {whole:?}: a speed is Nx (times the base) or N tok/s, not {raw:?}"
                    ));
                }
            }
            Metric::Ppl => match lower.strip_suffix('%') {
                Some(n) => (number(n, whole)? / 100.0, Unit::Change),
                None if lower.starts_with('+') => {
                    return Err(format!(
                        "target {whole:?}: a perplexity change is +N% (e.g. ppl <= +2%)"
                    ));
                }
                None => (number(&lower, whole)?, Unit::Plain),
            },
            Metric::Top1 => match lower.strip_suffix('%') {
                Some(n) => (number(n, whole)? / 100.0, Unit::Plain),
                None => (number(&lower, whole)?, Unit::Plain),
            },
            Metric::Kl | Metric::P99Kl => (number(&lower, whole)?, Unit::Plain),
            Metric::Memory => (memory_bytes(&lower, whole)?, Unit::Plain),
        };
        if value <= 0.0 && metric != Metric::Ppl {
            return Err(format!("target {whole:?}: the bound must be positive"));
        }
        if metric == Metric::Top1 && value > 1.0 {
            return Err(format!(
                "target {whole:?}: top-1 agreement is at most 1 (100%)"
            ));
        }
        Ok(Target {
            metric,
            value,
            unit,
        })
    }
}

fn memory_bytes(s: &str, whole: &str) -> Result<f64, String> {
    const UNITS: [(&str, f64); 7] = [
        ("kib", 1024.0),
        ("mib", 1024.0 * 1024.0),
        ("gib", 1024.0 * 1024.0 * 1024.0),
        ("kb", 1e3),
        ("mb", 1e6),
        ("gb", 1e9),
        ("b", 1.0),
    ];
    for (u, scale) in UNITS {
        if let Some(n) = s.strip_suffix(u) {
            return Ok(number(n, whole)? * scale);
        }
    }
    Err(format!(
        "target {whole:?}: memory needs a unit (B, KB, KiB, MB, MiB, GB, GiB), got {s:?}"
    ))
}

/// What to maximize among the points that meet every target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Decode speed (the default).
    #[default]
    Decode,
    Prefill,
    /// The smallest memory (weights + KV at the context).
    Memory,
    /// The smallest mean KL.
    Kl,
}

impl Objective {
    /// Whether choosing by this objective needs speeds.
    pub fn needs_speed(self) -> bool {
        matches!(self, Objective::Decode | Objective::Prefill)
    }

    /// The score to maximize (`None` when not measured).
    pub fn score(self, m: &Measured) -> Option<f64> {
        match self {
            Objective::Decode => m.decode_ratio,
            Objective::Prefill => m.prefill_ratio,
            Objective::Memory => m.memory.map(|x| -x),
            Objective::Kl => m.kl.map(|x| -x),
        }
    }
}

impl FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "decode" => Ok(Objective::Decode),
            "prefill" => Ok(Objective::Prefill),
            "memory" | "size" => Ok(Objective::Memory),
            "kl" | "quality" => Ok(Objective::Kl),
            _ => Err(format!(
                "unknown objective {s:?} (expected decode, prefill, memory or kl)"
            )),
        }
    }
}

/// A time budget: `45m`, `90s`, `1h`, `1h30m`, or plain seconds.
pub fn parse_budget(s: &str) -> Result<f64, String> {
    let t = s.trim().to_ascii_lowercase();
    if let Ok(v) = t.parse::<f64>() {
        return Ok(v);
    }
    let (mut total, mut num) = (0.0, String::new());
    for c in t.chars() {
        match c {
            '0'..='9' | '.' => num.push(c),
            'h' | 'm' | 's' => {
                let v: f64 = num
                    .parse()
                    .map_err(|_| format!("budget {s:?}: no number before {c:?}"))?;
                total += v * match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                num.clear();
            }
            _ => {
                return Err(format!(
                    "budget {s:?}: unexpected {c:?} (write 45m, 90s or 1h30m)"
                ));
            }
        }
    }
    if !num.is_empty() || total <= 0.0 {
        return Err(format!("budget {s:?}: write 45m, 90s or 1h30m"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Target {
        s.parse().unwrap()
    }

    #[test]
    fn the_issue_targets_parse_as_written() {
        assert_eq!(
            t("decode >= 5x"),
            Target {
                metric: Metric::Decode,
                value: 5.0,
                unit: Unit::Ratio
            }
        );
        assert_eq!(t("prefill>=2x").unit, Unit::Ratio);
        assert_eq!(t("kl <= 0.05").value, 0.05);
        let p = t("ppl <= +2%");
        assert_eq!(p.unit, Unit::Change);
        assert!((p.value - 0.02).abs() < 1e-12);
        assert_eq!(t("memory <= 150MiB").value, 150.0 * 1048576.0);
        assert_eq!(t("memory <= 150 MB").value, 150e6);
        assert_eq!(t("memory <= 1.5GiB").value, 1.5 * 1073741824.0);
        assert_eq!(t("top1 >= 0.9").value, 0.9);
        assert_eq!(t("top1 >= 90%").value, 0.9);
        assert_eq!(t("p99kl <= 0.2").metric, Metric::P99Kl);
        let a = t("decode >= 300tok/s");
        assert_eq!((a.value, a.unit), (300.0, Unit::TokPerSec));
        assert_eq!(t("decode >= 300 tok/s").unit, Unit::TokPerSec);
    }

    #[test]
    fn bad_targets_name_the_bad_piece() {
        for (bad, needle) in [
            ("speed >= 5x", "\"speed\""),
            ("decode 5x", "no comparison"),
            ("decode <= 5x", "\"<=\" on decode"),
            ("kl >= 0.1", "\">=\" on kl"),
            ("decode >= 5", "Nx"),
            ("decode >= fastx", "\"fast\" is not a number"),
            ("memory <= 150", "needs a unit"),
            ("memory <= 150 parsecs", "needs a unit"),
            ("ppl <= +2", "+N%"),
            ("kl <= ", "no value"),
            ("top1 >= 1.5", "at most 1"),
            ("kl <= -1", "positive"),
        ] {
            let e = bad.parse::<Target>().unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn budgets_parse() {
        assert_eq!(parse_budget("45m"), Ok(2700.0));
        assert_eq!(parse_budget("1h30m"), Ok(5400.0));
        assert_eq!(parse_budget("90s"), Ok(90.0));
        assert_eq!(parse_budget("120"), Ok(120.0));
        assert!(parse_budget("soon").is_err());
        assert!(parse_budget("5x").unwrap_err().contains("'x'"));
    }

    #[test]
    fn shortfall_is_relative_and_zero_when_met() {
        let m = Measured {
            kl: Some(0.075),
            decode_ratio: Some(4.0),
            ..Default::default()
        };
        assert!((t("kl <= 0.05").shortfall(&m).unwrap() - 0.5).abs() < 1e-9);
        assert!((t("decode >= 5x").shortfall(&m).unwrap() - 0.2).abs() < 1e-9);
        assert_eq!(t("decode >= 3x").met(&m), Some(true));
        assert_eq!(t("memory <= 1MiB").met(&m), None);
        assert_eq!(t("decode >= 5x").to_string(), "decode >= 5x");
    }
}
