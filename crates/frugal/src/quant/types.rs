//! The ggml tensor type table: ids as stored in GGUF files, block sizes and bytes per block.
//!
//! Every type llama.cpp can write is listed here so that `frugal info` can describe any file and the
//! extent of every tensor can be validated, even for formats whose kernels frugal does not have.

use std::fmt;

/// A ggml tensor element type, identified by its GGUF type id.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    /// frugal-only: 2:4 sparse, kept values as Q8_0 (`quant::sparse`).
    Q8_0_24,
    /// frugal-only: 2:4 sparse, kept values as Q4_0 (`quant::sparse`).
    Q4_0_24,
}

/// (type, GGUF id, name, elements per block, bytes per block)
const TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    // frugal-only ids, far above ggml's: llama.cpp refuses them.
    (GgmlType::Q8_0_24, 1024, "Q8_0_24", 32, 22),
    (GgmlType::Q4_0_24, 1025, "Q4_0_24", 32, 14),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TABLE
            .iter()
            .find(|e| e.0 == self)
            .expect("every GgmlType variant is in TABLE")
    }

    /// The type with GGUF id `id`, or `None` for ids this build does not know.
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// Parses a type name case-insensitively (`q4_0`, `F16`, ...).
    pub fn from_name(name: &str) -> Option<Self> {
        TABLE
            .iter()
            .find(|e| e.2.eq_ignore_ascii_case(name))
            .map(|e| e.0)
    }

    pub fn id(self) -> u32 {
        self.entry().1
    }

    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block (1 for plain float and integer types).
    pub fn block_size(self) -> usize {
        self.entry().3
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.entry().4
    }

    /// Storage cost in bits per element, including block scales.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_size() as f64
    }

    /// Whether only frugal reads this type (llama.cpp and other GGUF readers refuse it).
    pub fn frugal_only(self) -> bool {
        self.id() >= 1024
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes() as u64)
    }
}

/// Serialized as its name (`"Q4_K"`), which is what reports and JSON output want.
impl serde::Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for e in TABLE {
            assert_eq!(GgmlType::from_id(e.1), Some(e.0));
            assert_eq!(GgmlType::from_name(&e.2.to_lowercase()), Some(e.0));
        }
        assert_eq!(
            GgmlType::from_id(4),
            None,
            "id 4 (Q4_2) was removed from ggml"
        );
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(GgmlType::Q4_1.bytes_for(63), None);
        assert!((GgmlType::Q8_0.bits_per_weight() - 8.5).abs() < 1e-12);
    }
}
