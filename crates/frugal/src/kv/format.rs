//! Element formats of cached keys and values.
//!
//! A cached row (one position, all KV heads) is stored as raw little-endian bytes in one of
//! these formats; attention decodes it tile by tile (never the whole cache) straight from the
//! stored bytes. The layouts are ggml's, so a Q8_0 row here is byte-identical to a Q8_0 row in a
//! GGUF file and `quant::dequantize` is an independent reference decoder for the tests.
//!
//! Q8_0 blocks hold 32 values, so a Q8_0 cache needs a head dimension that is a multiple of 32
//! (each head then starts on a block boundary and can be decoded on its own).

use half::{bf16, f16};

/// Storage format of cached keys or values.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvType {
    /// Exact: what the model computed.
    #[default]
    F32,
    /// IEEE half: 10-bit mantissa, range up to 65504.
    F16,
    /// bfloat16: f32's range with an 8-bit mantissa.
    Bf16,
    /// Blocks of 32 signed bytes sharing an f16 scale (8.5 bits per value).
    Q8_0,
}

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
const Q8_0_BYTES: usize = 34;

/// An unknown format name (from a flag or a config file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV cache type {0:?}: expected one of f32, f16, bf16, q8_0")]
pub struct UnknownKvType(pub String);

impl std::str::FromStr for KvType {
    type Err = UnknownKvType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "bf16" => Ok(KvType::Bf16),
            "q8_0" | "q8" => Ok(KvType::Q8_0),
            _ => Err(UnknownKvType(s.to_string())),
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl KvType {
    pub const ALL: [KvType; 4] = [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0];

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Values per independently decodable group (a row length must be a multiple of it).
    pub fn granule(self) -> usize {
        match self {
            KvType::Q8_0 => Q8_0_BLOCK,
            _ => 1,
        }
    }

    /// Bytes that `n` values occupy (`n` a multiple of [`KvType::granule`]).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 | KvType::Bf16 => 2 * n,
            KvType::Q8_0 => n / Q8_0_BLOCK * Q8_0_BYTES,
        }
    }

    /// Encodes `src` into `dst` (`dst.len() == self.bytes(src.len())`). Rounding: f16/bf16 round
    /// to nearest even; Q8_0 uses ggml's reference rule (scale = absmax/127, round half away).
    pub fn encode(self, src: &[f32], dst: &mut [u8]) {
        debug_assert_eq!(dst.len(), self.bytes(src.len()));
        match self {
            KvType::F32 => {
                for (d, &x) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }
            KvType::F16 => {
                #[cfg(target_arch = "x86_64")]
                let done = if let Some(t) = crate::cpu::Avx2::get() {
                    // SAFETY: the token proves the encoder's features.
                    unsafe { super::format_x86::encode_f16(t, src, dst) }
                } else {
                    0
                };
                #[cfg(not(target_arch = "x86_64"))]
                let done = 0;
                for (d, &x) in dst[2 * done..].chunks_exact_mut(2).zip(&src[done..]) {
                    d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            KvType::Bf16 => {
                for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            KvType::Q8_0 => {
                for (d, x) in dst
                    .chunks_exact_mut(Q8_0_BYTES)
                    .zip(src.chunks_exact(Q8_0_BLOCK))
                {
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = amax / 127.0;
                    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                    d[..2].copy_from_slice(&f16::from_f32(scale).to_bits().to_le_bytes());
                    for (q, &v) in d[2..].iter_mut().zip(x) {
                        *q = (v * inv).round() as i8 as u8;
                    }
                }
            }
        }
    }

    /// Decodes `out.len()` values from `src` (`src.len() == self.bytes(out.len())`), with the
    /// vector decoders where the CPU has them (the same bits as [`KvType::decode_scalar`]).
    #[inline]
    pub fn decode(self, src: &[u8], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self != KvType::F32
            && let Some(t) = crate::cpu::Avx2::get()
        {
            // SAFETY: the token proves the decoders' features.
            let done = unsafe {
                match self {
                    KvType::F16 => super::format_x86::decode_f16(t, src, out),
                    KvType::Bf16 => super::format_x86::decode_bf16(t, src, out),
                    KvType::Q8_0 => {
                        super::format_x86::decode_q8_0(t, src, out);
                        out.len()
                    }
                    KvType::F32 => unreachable!(),
                }
            };
            // Values past the last whole vector (none for Q8_0, whose blocks are whole).
            if done < out.len() {
                self.decode_scalar(&src[self.bytes(done)..], &mut out[done..]);
            }
            return;
        }
        self.decode_scalar(src, out);
    }

    /// The portable decoder: the reference the vector ones are tested against.
    pub fn decode_scalar(self, src: &[u8], out: &mut [f32]) {
        debug_assert_eq!(src.len(), self.bytes(out.len()));
        match self {
            KvType::F32 => {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            KvType::F16 => {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            KvType::Bf16 => {
                // bf16 is the top half of an f32: a shift, no rounding.
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
            KvType::Q8_0 => {
                for (o, b) in out
                    .chunks_exact_mut(Q8_0_BLOCK)
                    .zip(src.chunks_exact(Q8_0_BYTES))
                {
                    let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    for (x, &q) in o.iter_mut().zip(&b[2..]) {
                        *x = d * f32::from(q as i8);
                    }
                }
            }
        }
    }
}

/// The formats of keys and of values (settable separately: keys are usually the more sensitive,
/// since their errors pass through the exponential of the softmax).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct KvFormat {
    pub k: KvType,
    pub v: KvType,
}

impl KvFormat {
    pub fn both(t: KvType) -> Self {
        KvFormat { k: t, v: t }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.k == self.v {
            write!(f, "{}", self.k)
        } else {
            write!(f, "K {} / V {}", self.k, self.v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37).sin() * 3.0) + if i % 7 == 0 { 9.0 } else { 0.0 })
            .collect()
    }

    #[test]
    fn names_parse_and_unknown_names_are_typed_errors() {
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
        }
        assert_eq!("Q8_0".parse::<KvType>(), Ok(KvType::Q8_0));
        let e = "q4_0".parse::<KvType>().unwrap_err();
        assert!(e.to_string().contains("q4_0") && e.to_string().contains("f16"));
    }

    /// The decoders here are checked against the independent ggml-layout decoders of `quant`,
    /// and the round trip error against each format's stated precision.
    #[test]
    fn round_trip_matches_ggml_layouts() {
        let x = sample(128);
        for (t, g, tol) in [
            (KvType::F32, GgmlType::F32, 0.0),
            (KvType::F16, GgmlType::F16, 1.0 / 2048.0), // 11-bit significand
            (KvType::Bf16, GgmlType::BF16, 1.0 / 256.0), // 8-bit significand
            (KvType::Q8_0, GgmlType::Q8_0, 1.0 / 254.0), // half a step of absmax/127
        ] {
            let mut bytes = vec![0u8; t.bytes(x.len())];
            t.encode(&x, &mut bytes);
            let mut y = vec![0f32; x.len()];
            t.decode(&bytes, &mut y);
            assert_eq!(y, dequantize_to_vec(g, &bytes, x.len()).unwrap(), "{t}");
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in x.iter().zip(&y) {
                let scale = if t == KvType::Q8_0 { amax } else { a.abs() };
                assert!((a - b).abs() <= tol * scale + 1e-7, "{t}: {a} vs {b}");
            }
        }
    }

    /// The vector f16 encoder gives the scalar encoder's bits: values at every scale from
    /// f16's subnormals past its largest finite value (to infinity), values exactly halfway
    /// between two f16 values (ties go to the even one), signed zeros and infinities, and a
    /// length that leaves a scalar tail; a NaN stays a NaN.
    #[test]
    fn vector_f16_encoder_matches_the_scalar_one() {
        let mut x: Vec<f32> = (0..4000)
            .map(|i| {
                let e = (i % 46) - 30; // 2^-30 .. 2^15
                let m = 1.0 + ((i * 7919) % 1024) as f32 / 1024.0 + (i % 3) as f32 / 4096.0;
                if i % 2 == 0 {
                    m * 2f32.powi(e)
                } else {
                    -m * 2f32.powi(e)
                }
            })
            .collect();
        // Halfway between 1 and its f16 successor (1 + 2^-10), and between the next two.
        x.extend([
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            65519.0,
            65520.0,
        ]);
        x.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            6e-8,
            3e-8,
            2.9e-8,
            f32::NAN,
        ]);
        x.extend([1e-3, -7.5]);
        let mut fast = vec![0u8; 2 * x.len()];
        KvType::F16.encode(&x, &mut fast);
        for (i, (&v, b)) in x.iter().zip(fast.chunks_exact(2)).enumerate() {
            let got = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
            let want = f16::from_f32(v);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "value {i} ({v:e}): {got} against {want}"
            );
        }
    }

    /// The vector decoders give the scalar decoder's bits, on lengths that are not multiples
    /// of the vector width, on extreme values (subnormals, infinities, the largest finite f16)
    /// and on NaNs (compared as NaN: a conversion may quiet a signalling payload).
    #[test]
    fn vector_decoders_match_the_scalar_one() {
        let mut x = sample(200);
        x.extend([
            65504.0,
            -65504.0,
            1e-7,
            -3e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        x.extend([1e30, -1e-30, f32::MIN_POSITIVE, 123.456]);
        x.truncate(192 + 8);
        for t in KvType::ALL {
            let n = if t == KvType::Q8_0 { 192 } else { x.len() - 3 };
            let mut bytes = vec![0u8; t.bytes(n)];
            t.encode(&x[..n], &mut bytes);
            if t == KvType::F16 || t == KvType::Bf16 {
                // A NaN with a payload in the middle of the row.
                let nan: u16 = if t == KvType::F16 { 0x7c01 } else { 0x7f81 };
                bytes[20..22].copy_from_slice(&nan.to_le_bytes());
            }
            let (mut fast, mut slow) = (vec![0f32; n], vec![0f32; n]);
            t.decode(&bytes, &mut fast);
            t.decode_scalar(&bytes, &mut slow);
            for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{t} value {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn bytes_per_token_of_the_reference_model() {
        // 30 layers, 3 KV heads x 64.
        let shape = crate::kv::CacheShape::new(3, 64);
        let per_token = |t| shape.bytes_per_token(30, KvFormat::both(t));
        assert_eq!(per_token(KvType::F32), 46_080);
        assert_eq!(per_token(KvType::F16), 23_040);
        assert_eq!(per_token(KvType::Q8_0), 12_240);
        // A keys-only latent row of 96 + 32 stores no values.
        let latent = crate::kv::CacheShape::keys_only(128);
        assert_eq!(
            latent.bytes_per_token(30, KvFormat::both(KvType::F32)),
            15_360
        );
    }
}
