//! Research formats that have no GGUF type: INT8 and INT4 with per-tensor, per-output-channel or
//! per-block scales, FP8 (E4M3 and E5M2, OCP 8-bit floats) with a scale, and NF4 (QLoRA's 4-bit
//! NormalFloat code book).
//!
//! They exist to measure what a storage choice costs, not to store files: [`SimFormat::fake_quantize`]
//! encodes and decodes back to f32 ("simulated quantization"), and the model then runs on those
//! f32 values. The scale of every group is kept in f32, so the only error measured is that of the
//! element format and the grouping, which is the question these formats answer.
//!
//! The grouping is the whole story of the outlier problem: one large weight sets the scale of its
//! whole group, and every other weight of the group is rounded on a grid that is too coarse for it.
//! A per-tensor scale spreads that damage over millions of weights, a per-block scale over 32.

use rayon::prelude::*;

/// How many weights share one scale.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scaling {
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per output channel (row of the stored matrix).
    Channel,
    /// One scale per run of this many weights along a row (the last run of a row may be shorter).
    Block(usize),
}

/// The element encoding within a group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Element {
    /// Symmetric integers -127..=127.
    Int8,
    /// Symmetric integers -7..=7.
    Int4,
    /// OCP FP8 E4M3 (bias 7, no infinities, largest 448): more precision, less range.
    Fp8E4M3,
    /// OCP FP8 E5M2 (bias 15, IEEE-like, largest 57344): more range, less precision.
    Fp8E5M2,
    /// NF4: 16 levels at quantiles of a normal distribution, scaled by the group's absmax.
    Nf4,
}

/// A research format: an element encoding and a grouping.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SimFormat {
    pub element: Element,
    pub scaling: Scaling,
}

/// The 16 NF4 levels (Dettmers et al., QLoRA, 2023), in code order.
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// An 8-bit float layout: sign, `exp_bits` exponent bits with `bias`, `man_bits` mantissa bits.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Fp8 {
    pub man_bits: u32,
    pub bias: i32,
    /// The largest finite code (sign bit clear): saturation target.
    pub max_code: u8,
    /// E5M2 keeps IEEE infinities and NaNs (exponent all ones); E4M3 only has NaN at 0x7F.
    pub ieee_specials: bool,
}

impl Fp8 {
    pub const E4M3: Fp8 = Fp8 {
        man_bits: 3,
        bias: 7,
        max_code: 0x7e,
        ieee_specials: false,
    };
    pub const E5M2: Fp8 = Fp8 {
        man_bits: 2,
        bias: 15,
        max_code: 0x7b,
        ieee_specials: true,
    };

    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let c = code & 0x7f;
        let m = self.man_bits;
        let exp = i32::from(c >> m);
        let man = f32::from(c & ((1 << m) - 1));
        let exp_all_ones = (1 << (7 - m)) - 1;
        if self.ieee_specials && exp == exp_all_ones {
            return if man == 0.0 {
                sign * f32::INFINITY
            } else {
                f32::NAN
            };
        }
        if !self.ieee_specials && c == 0x7f {
            return f32::NAN;
        }
        let scale = (1 << m) as f32;
        if exp == 0 {
            sign * man / scale * 2f32.powi(1 - self.bias)
        } else {
            sign * (1.0 + man / scale) * 2f32.powi(exp - self.bias)
        }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        self.decode(self.max_code)
    }

    /// Round to nearest even, saturating at the largest finite value (the usual choice when
    /// quantizing weights, where an infinity would be a bug, not an overflow signal).
    pub fn encode(self, v: f32) -> u8 {
        if v.is_nan() {
            return 0x7f;
        }
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = v.abs();
        if a >= self.max() {
            return sign | self.max_code;
        }
        let m = self.man_bits;
        let steps = (1u32 << m) as f32;
        let e = ((a.to_bits() >> 23) as i32) - 127;
        let code = if e < 1 - self.bias {
            // Subnormal: multiples of 2^(1 - bias - m); the count may round up into the first
            // normal binade, whose code follows on directly.
            (a / 2f32.powi(1 - self.bias - m as i32)).round_ties_even() as u32
        } else {
            let mut e = e;
            let mut man = ((a / 2f32.powi(e) - 1.0) * steps).round_ties_even() as u32;
            if man == 1 << m {
                e += 1;
                man = 0;
            }
            (((e + self.bias) as u32) << m) | man
        };
        sign | code.min(u32::from(self.max_code)) as u8
    }
}

impl Element {
    /// The value a group's absmax maps to.
    fn qmax(self) -> f32 {
        match self {
            Element::Int8 => 127.0,
            Element::Int4 => 7.0,
            Element::Fp8E4M3 => Fp8::E4M3.max(),
            Element::Fp8E5M2 => Fp8::E5M2.max(),
            Element::Nf4 => 1.0,
        }
    }

    fn bits(self) -> f64 {
        match self {
            Element::Int8 | Element::Fp8E4M3 | Element::Fp8E5M2 => 8.0,
            Element::Int4 | Element::Nf4 => 4.0,
        }
    }

    /// Rounds `v` (already divided by the group scale) to the nearest representable value.
    fn round(self, v: f32) -> f32 {
        match self {
            Element::Int8 => v.round().clamp(-127.0, 127.0),
            Element::Int4 => v.round().clamp(-7.0, 7.0),
            Element::Fp8E4M3 => Fp8::E4M3.decode(Fp8::E4M3.encode(v)),
            Element::Fp8E5M2 => Fp8::E5M2.decode(Fp8::E5M2.encode(v)),
            Element::Nf4 => NF4_LEVELS[nf4_code(v) as usize],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Element::Int8 => "int8",
            Element::Int4 => "int4",
            Element::Fp8E4M3 => "fp8-e4m3",
            Element::Fp8E5M2 => "fp8-e5m2",
            Element::Nf4 => "nf4",
        }
    }
}

/// The NF4 code nearest to `v` (in units of the group absmax).
pub fn nf4_code(v: f32) -> u8 {
    let mut best = 0usize;
    for (i, &l) in NF4_LEVELS.iter().enumerate() {
        if (l - v).abs() < (NF4_LEVELS[best] - v).abs() {
            best = i;
        }
    }
    best as u8
}

impl SimFormat {
    /// Canonical names, for help texts and error messages.
    pub const NAMES: &'static [&'static str] = &[
        "int8-tensor",
        "int8-channel",
        "int8-b32",
        "int8-b64",
        "int8-b128",
        "int4-tensor",
        "int4-channel",
        "int4-b32",
        "int4-b64",
        "int4-b128",
        "fp8-e4m3",
        "fp8-e5m2",
        "nf4",
    ];

    pub fn new(element: Element, scaling: Scaling) -> Self {
        SimFormat { element, scaling }
    }

    /// Parses `ELEMENT[-SCALING]`: elements int8, int4, fp8-e4m3, fp8-e5m2, nf4; scalings
    /// `tensor`, `channel`, `bN` (N > 0). Defaults: per channel for integers, blocks of 32 for
    /// FP8 (the MX block size), blocks of 64 for NF4 (QLoRA's).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.to_ascii_lowercase();
        let elements = [
            ("fp8-e4m3", Element::Fp8E4M3),
            ("fp8-e5m2", Element::Fp8E5M2),
            ("int8", Element::Int8),
            ("int4", Element::Int4),
            ("nf4", Element::Nf4),
        ];
        let (prefix, element) = elements.into_iter().find(|(p, _)| s.starts_with(p))?;
        let rest = &s[prefix.len()..];
        let scaling = match rest {
            "" => match element {
                Element::Int8 | Element::Int4 => Scaling::Channel,
                Element::Fp8E4M3 | Element::Fp8E5M2 => Scaling::Block(32),
                Element::Nf4 => Scaling::Block(64),
            },
            "-tensor" => Scaling::Tensor,
            "-channel" => Scaling::Channel,
            r => {
                let n: usize = r.strip_prefix("-b")?.parse().ok()?;
                if n == 0 {
                    return None;
                }
                Scaling::Block(n)
            }
        };
        Some(SimFormat { element, scaling })
    }

    pub fn name(&self) -> String {
        let scaling = match self.scaling {
            Scaling::Tensor => "tensor".to_string(),
            Scaling::Channel => "channel".to_string(),
            Scaling::Block(n) => format!("b{n}"),
        };
        format!("{}-{scaling}", self.element.name())
    }

    /// Storage cost per weight if the group scales were kept as f16 (what a real implementation
    /// would store; the simulation itself keeps them in f32).
    pub fn bits_per_weight(&self, cols: usize) -> f64 {
        let group = match self.scaling {
            Scaling::Tensor => f64::INFINITY,
            Scaling::Channel => cols as f64,
            Scaling::Block(n) => n as f64,
        };
        self.element.bits() + 16.0 / group
    }

    /// Encodes and decodes a row-major matrix with rows of `cols` elements.
    pub fn fake_quantize(&self, x: &[f32], cols: usize) -> Vec<f32> {
        let mut out = x.to_vec();
        self.fake_quantize_in_place(&mut out, cols);
        out
    }

    /// [`fake_quantize`](Self::fake_quantize) over `x` itself.
    pub fn fake_quantize_in_place(&self, x: &mut [f32], cols: usize) {
        let el = self.element;
        let group = |g: &mut [f32], amax: f32| {
            let s = amax / el.qmax();
            if s == 0.0 || !s.is_finite() {
                return;
            }
            let inv = 1.0 / s;
            for v in g.iter_mut() {
                *v = el.round(*v * inv) * s;
            }
        };
        let absmax = |g: &[f32]| g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let cols = cols.max(1);
        match self.scaling {
            Scaling::Tensor => {
                let amax = x.par_chunks(cols).map(absmax).reduce(|| 0.0, f32::max);
                x.par_chunks_mut(cols).for_each(|row| group(row, amax));
            }
            Scaling::Channel => x.par_chunks_mut(cols).for_each(|row| {
                let amax = absmax(row);
                group(row, amax)
            }),
            Scaling::Block(n) => x.par_chunks_mut(cols).for_each(|row| {
                for b in row.chunks_mut(n) {
                    let amax = absmax(b);
                    group(b, amax);
                }
            }),
        }
    }
}

impl std::fmt::Display for SimFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Signal-to-quantization-noise ratio in dB: 10 log10(sum x^2 / sum (x - y)^2). Infinite when
/// the reconstruction is exact.
pub fn snr_db(x: &[f32], y: &[f32]) -> f64 {
    let (sig, err) = x.iter().zip(y).fold((0f64, 0f64), |(s, e), (&a, &b)| {
        (
            s + f64::from(a) * f64::from(a),
            e + f64::from(a - b).powi(2),
        )
    });
    if err == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (sig / err).log10()
    }
}

/// Shape statistics of a tensor's values: how heavy its tails are.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Moments {
    pub absmax: f64,
    pub rms: f64,
    /// absmax / RMS: how many RMS units the largest value sits away (about 4-5 for a Gaussian
    /// of a million samples; far more when one outlier dominates).
    pub absmax_over_rms: f64,
    /// Pearson kurtosis E[(x-mean)^4] / var^2: 3 for a Gaussian, larger for heavy tails.
    pub kurtosis: f64,
}

pub fn moments(x: &[f32]) -> Moments {
    let n = x.len().max(1) as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let (mut m2, mut m4, mut sq, mut amax) = (0f64, 0f64, 0f64, 0f64);
    for &v in x {
        let v = f64::from(v);
        let d = v - mean;
        m2 += d * d;
        m4 += d * d * d * d;
        sq += v * v;
        amax = amax.max(v.abs());
    }
    let (m2, m4) = (m2 / n, m4 / n);
    let rms = (sq / n).sqrt();
    Moments {
        absmax: amax,
        rms,
        absmax_over_rms: if rms > 0.0 { amax / rms } else { 0.0 },
        kurtosis: if m2 > 0.0 { m4 / (m2 * m2) } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_codes_decode_to_known_values() {
        let e4 = Fp8::E4M3;
        assert_eq!(e4.decode(0x7e), 448.0, "E4M3 max: S.1111.110");
        assert!(e4.decode(0x7f).is_nan());
        assert_eq!(e4.decode(0x38), 1.0, "exponent 7 = bias");
        assert_eq!(e4.decode(0x08), 2f32.powi(-6), "smallest normal");
        assert_eq!(e4.decode(0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(e4.decode(0xc0), -2.0);
        let e5 = Fp8::E5M2;
        assert_eq!(e5.decode(0x7b), 57344.0, "E5M2 max");
        assert_eq!(e5.decode(0x7c), f32::INFINITY);
        assert_eq!(e5.decode(0x3c), 1.0);
        assert_eq!(e5.decode(0x01), 2f32.powi(-16));
    }

    #[test]
    fn fp8_encode_inverts_decode_and_rounds_to_nearest_even() {
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            for code in 0..=255u8 {
                let v = fmt.decode(code);
                if v.is_finite() && !(v == 0.0 && code == 0x80) {
                    assert_eq!(fmt.encode(v), code, "{fmt:?} code {code:#x} = {v}");
                }
            }
            // Saturation instead of infinity.
            assert_eq!(fmt.encode(1e9), fmt.max_code);
            assert_eq!(fmt.encode(-1e9), 0x80 | fmt.max_code);
        }
        // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39) in E4M3: ties to even (0x38);
        // 1.1875 between 1.125 and 1.25 goes to 1.25 (0x3a, even mantissa).
        assert_eq!(Fp8::E4M3.encode(1.0625), 0x38);
        assert_eq!(Fp8::E4M3.encode(1.1875), 0x3a);
        // Half the smallest subnormal rounds to zero (even), a bit more rounds up.
        assert_eq!(Fp8::E4M3.encode(2f32.powi(-10)), 0x00);
        assert_eq!(Fp8::E4M3.encode(2f32.powi(-10) * 1.01), 0x01);
    }

    #[test]
    fn nf4_levels_are_symmetric_enough_and_sorted() {
        assert!(NF4_LEVELS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(nf4_code(0.0), 7);
        assert_eq!(nf4_code(1.0), 15);
        assert_eq!(nf4_code(-0.7), 1);
        let f = SimFormat::parse("nf4").unwrap();
        assert_eq!(f.scaling, Scaling::Block(64));
        let y = f.fake_quantize(&[2.0, -1.3922, 0.0, 0.9], 4);
        // absmax 2: levels * 2 -> 2, -1.39238, 0, 0.88142 (0.9/2 = 0.45 is nearest 0.4407).
        assert_eq!(y[0], 2.0);
        assert!((y[1] + 1.392_385_6).abs() < 1e-5);
        assert_eq!(y[2], 0.0);
        assert!((y[3] - 0.881_419_7).abs() < 1e-5);
    }

    #[test]
    fn names_parse_and_print() {
        for name in SimFormat::NAMES {
            let f = SimFormat::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(SimFormat::parse(&f.name()), Some(f));
        }
        assert_eq!(SimFormat::parse("int8").unwrap().scaling, Scaling::Channel);
        assert_eq!(
            SimFormat::parse("FP8-E5M2-TENSOR").unwrap(),
            SimFormat::new(Element::Fp8E5M2, Scaling::Tensor)
        );
        for bad in ["int3", "int8-b0", "int8-bx", "int8-row", "fp8", ""] {
            assert_eq!(SimFormat::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn int_schemes_round_trip_within_half_a_step() {
        let (rows, cols) = (4, 96);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 31 % 47) as f32 - 23.0) * 0.01 * (1 + i / cols) as f32)
            .collect();
        for name in SimFormat::NAMES.iter().filter(|n| n.starts_with("int")) {
            let f = SimFormat::parse(name).unwrap();
            let y = f.fake_quantize(&x, cols);
            let qmax = if f.element == Element::Int8 {
                127.0
            } else {
                7.0
            };
            let group = match f.scaling {
                Scaling::Tensor => rows * cols,
                Scaling::Channel => cols,
                Scaling::Block(n) => n,
            };
            // Groups never straddle rows; half a step of the group's absmax / qmax, with a
            // relative slack of 1e-6 for the f32 division and multiplication.
            for r in 0..rows {
                let row = r * cols..(r + 1) * cols;
                for (g, (bx, by)) in x[row.clone()]
                    .chunks(group.min(cols))
                    .zip(y[row].chunks(group.min(cols)))
                    .enumerate()
                {
                    let amax = if f.scaling == Scaling::Tensor {
                        x.iter().fold(0f32, |m, v| m.max(v.abs()))
                    } else {
                        bx.iter().fold(0f32, |m, v| m.max(v.abs()))
                    };
                    let tol = amax / qmax * 0.5 * (1.0 + 1e-6) + 1e-7;
                    for (a, b) in bx.iter().zip(by) {
                        assert!((a - b).abs() <= tol, "{name} row {r} group {g}: {a} vs {b}");
                    }
                }
            }
        }
    }

    /// The outlier problem in one test: a single value 1000x the others ruins a per-tensor INT8
    /// scale for every other weight, while per-block scales confine the damage to its block.
    #[test]
    fn one_planted_outlier_breaks_per_tensor_int8_but_not_per_block() {
        let (rows, cols) = (64, 256);
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32 * 0.618).fract() - 0.5) * 0.02)
            .collect();
        let clean_snr = |f: SimFormat, x: &[f32]| snr_db(x, &f.fake_quantize(x, cols));
        let tensor = SimFormat::new(Element::Int8, Scaling::Tensor);
        let block = SimFormat::new(Element::Int8, Scaling::Block(32));
        let before = (clean_snr(tensor, &x), clean_snr(block, &x));
        x[1000] = 10.0; // 1000x the others' absmax of 0.01
        // Measure the error on everything except the outlier itself (it is stored exactly: it
        // defines the scale), so the figure is the damage done to the other weights.
        let others = |f: SimFormat| {
            let y = f.fake_quantize(&x, cols);
            let (a, b): (Vec<f32>, Vec<f32>) = x
                .iter()
                .zip(&y)
                .enumerate()
                .filter(|(i, _)| *i != 1000)
                .map(|(_, (a, b))| (*a, *b))
                .unzip();
            snr_db(&a, &b)
        };
        let (t, b) = (others(tensor), others(block));
        // Uniform data on a grid of step absmax/127: SNR = 10 log10(4 * 127^2) ~ 48 dB before.
        // After, the per-tensor step is 10/127 ~ 0.08, 4x the whole data range, so every other
        // weight rounds to zero: SNR ~ 0 dB. Per block, only the outlier's block loses its 31
        // other weights (31 of 16383, about 27 dB below the total signal); every other block
        // keeps its ~48 dB. Thresholds leave several dB of margin on each side.
        assert!(before.0 > 40.0 && before.1 > 40.0, "{before:?}");
        assert!(t < 3.0, "per-tensor INT8 after the outlier: {t:.1} dB");
        assert!(b > 20.0, "per-block INT8 after the outlier: {b:.1} dB");
        let m = moments(&x);
        assert!(m.absmax_over_rms > 100.0 && m.kurtosis > 1000.0, "{m:?}");
    }

    #[test]
    fn e4m3_has_precision_and_e5m2_has_range() {
        // Per-block scaled Gaussian-ish data: E4M3's extra mantissa bit gives ~6 dB more SNR.
        let x: Vec<f32> = (0..4096)
            .map(|i| ((i as f32 * 0.7548).fract() - 0.5) * ((i as f32 * 0.31).sin() + 1.2))
            .collect();
        let snr = |el| {
            snr_db(
                &x,
                &SimFormat::new(el, Scaling::Block(32)).fake_quantize(&x, 4096),
            )
        };
        let (e4, e5) = (snr(Element::Fp8E4M3), snr(Element::Fp8E5M2));
        assert!(e4 > e5 + 4.0, "E4M3 {e4:.1} dB vs E5M2 {e5:.1} dB");
        // Values spread over 2^-20 .. 1 under one per-tensor scale (absmax -> the format's
        // maximum): the smallest becomes 2^-20 * 448 ~ 4e-4 in E4M3, below its smallest
        // subnormal 2^-9, so it flushes to zero; in E5M2 it becomes 2^-20 * 57344 ~ 0.055, still a
        // normal number, with at most 12.5% relative rounding error (2 mantissa bits).
        let wide: Vec<f32> = (0..64)
            .map(|i| 2f32.powf(-(i as f32) * 20.0 / 63.0))
            .collect();
        let rel_err = |el| {
            let y = SimFormat::new(el, Scaling::Tensor).fake_quantize(&wide, 64);
            (wide[63] - y[63]).abs() / wide[63]
        };
        assert!(rel_err(Element::Fp8E4M3) > 0.5);
        assert!(rel_err(Element::Fp8E5M2) < 0.15);
    }
}
