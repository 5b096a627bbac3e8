//! CPU capabilities: the one place that detects the instruction sets the kernels use, and the
//! capability tokens that prove them.
//!
//! # Levels
//!
//! Every SIMD kernel belongs to one [`Level`]; each level includes the ones before it:
//!
//! | level         | `FRUGAL_ISA`  | features                                                      |
//! |---------------|---------------|---------------------------------------------------------------|
//! | `scalar`      | `scalar`      | none: the portable code (every kernel's reference twin)       |
//! | `avx2`        | `avx2`        | AVX2, FMA, F16C                                               |
//! | `avx512`      | `avx512`      | AVX-512 F, BW, VL, DQ                                         |
//! | `avx512-vnni` | `avx512-vnni` | AVX-512 VNNI; and where the CPU has them, VBMI2 and BF16      |
//! | `amx`         | `amx`         | AMX TILE, INT8, BF16 (and Linux's permission to use the tiles) |
//!
//! VBMI2 (the 2:4 sparse kernels, [`Vbmi2`]) and AVX-512 BF16 (the training GEMM's
//! `VDPBF16PS` kernel, [`Avx512Bf16`]) came after VNNI and are optional at its level: their
//! tokens exist where the level is allowed and the CPU has the feature.
//!
//! `FRUGAL_ISA=<level>` caps the level every kernel runs at (quantized products, attention,
//! KV cache formats, element-wise ops, the training GEMM), to compare levels on a real model or
//! to reproduce a smaller CPU's path; unset, empty or `native`, the CPU's best. A level above
//! the CPU's changes nothing; an unknown value is reported on stderr once and ignored.
//!
//! # Tokens
//!
//! A token ([`Avx2`], [`Avx512`], [`Avx512Vnni`], [`Vbmi2`], [`Avx512Bf16`], [`Amx`]) is a
//! zero-sized value only this module creates, and only where the CPU has its features and
//! `FRUGAL_ISA` allows its level: holding one proves both. A kernel takes its level's token as
//! an argument and is a `#[target_feature]` function; the call from code compiled without those
//! features is the one `unsafe` site, and its SAFETY comment names the token. Inside the kernel
//! only pointer work is `unsafe`. Tokens convert down (`Avx512Vnni::avx512`, `Avx512::avx2`),
//! so a kernel of a higher level calls the lower levels' helpers with the token it holds.
//!
//! Detection runs once per process (std caches the CPUID bits; the level and the cap are kept
//! in a `OnceLock`), so asking for a token on every call costs one load and a compare.
//!
//! Only this module calls `is_x86_feature_detected!`.

use std::sync::OnceLock;

/// An instruction-set level (see the module documentation); ordered, `Scalar` lowest.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable code only.
    Scalar,
    /// AVX2, FMA and F16C.
    Avx2,
    /// Plus AVX-512 F, BW, VL and DQ.
    Avx512,
    /// Plus AVX-512 VNNI (VBMI2 and BF16 optional at this level).
    Avx512Vnni,
    /// Plus AMX TILE, INT8 and BF16.
    Amx,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 5] = [
        Level::Scalar,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Vnni,
        Level::Amx,
    ];

    /// The level's name, as `FRUGAL_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Vnni => "avx512-vnni",
            Level::Amx => "amx",
        }
    }

    /// The level `FRUGAL_ISA` names (case-insensitive; `_` for `-` and `vnni` alone accepted).
    /// `None` for a value that is not a level.
    pub fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "scalar" | "none" => Some(Level::Scalar),
            "avx2" => Some(Level::Avx2),
            "avx512" => Some(Level::Avx512),
            "avx512-vnni" | "avx512vnni" | "vnni" => Some(Level::Avx512Vnni),
            "amx" | "native" | "" => Some(Level::Amx),
            _ => None,
        }
    }

    /// This level's [`Avx2`] token, where the level includes it and runs here.
    pub fn avx2(self) -> Option<Avx2> {
        (self >= Level::Avx2).then(Avx2::get).flatten()
    }

    /// This level's [`Avx512`] token, where the level includes it and runs here.
    pub fn avx512(self) -> Option<Avx512> {
        (self >= Level::Avx512).then(Avx512::get).flatten()
    }

    /// This level's [`Avx512Vnni`] token, where the level includes it and runs here.
    pub fn avx512_vnni(self) -> Option<Avx512Vnni> {
        (self >= Level::Avx512Vnni).then(Avx512Vnni::get).flatten()
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the CPU (and the OS) offers, detected once, before any cap.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512dq: bool,
    pub avx512vnni: bool,
    pub avx512vbmi2: bool,
    pub avx512bf16: bool,
    /// CPUID's AMX-TILE bit (the permission to use the tiles is asked for separately).
    pub amx_tile: bool,
    pub amx_int8: bool,
    pub amx_bf16: bool,
}

impl Features {
    /// The highest level whose features are all here.
    pub fn level(&self) -> Level {
        if !(self.avx2 && self.fma && self.f16c) {
            Level::Scalar
        } else if !(self.avx512f && self.avx512bw && self.avx512vl && self.avx512dq) {
            Level::Avx2
        } else if !self.avx512vnni {
            Level::Avx512
        } else if !(self.amx_tile && self.amx_int8 && self.amx_bf16) {
            Level::Avx512Vnni
        } else {
            Level::Amx
        }
    }
}

/// The CPU's features (detected once).
pub fn features() -> &'static Features {
    static F: OnceLock<Features> = OnceLock::new();
    F.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Features {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7's EDX: AMX-BF16 bit 22, AMX-TILE 24, AMX-INT8 25.
    let edx7 = if __cpuid_count(0, 0).eax >= 7 {
        __cpuid_count(7, 0).edx
    } else {
        0
    };
    Features {
        avx2: is_x86_feature_detected!("avx2"),
        fma: is_x86_feature_detected!("fma"),
        f16c: is_x86_feature_detected!("f16c"),
        avx512f: is_x86_feature_detected!("avx512f"),
        avx512bw: is_x86_feature_detected!("avx512bw"),
        avx512vl: is_x86_feature_detected!("avx512vl"),
        avx512dq: is_x86_feature_detected!("avx512dq"),
        avx512vnni: is_x86_feature_detected!("avx512vnni"),
        avx512vbmi2: is_x86_feature_detected!("avx512vbmi2"),
        avx512bf16: is_x86_feature_detected!("avx512bf16"),
        amx_bf16: edx7 & (1 << 22) != 0,
        amx_tile: edx7 & (1 << 24) != 0,
        amx_int8: edx7 & (1 << 25) != 0,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Features {
    Features::default()
}

/// The level `FRUGAL_ISA` caps the kernels at ([`Level::Amx`], no cap, when unset); an unknown
/// value is reported on stderr (once) and ignored.
pub fn cap() -> Level {
    static CAP: OnceLock<Level> = OnceLock::new();
    *CAP.get_or_init(|| {
        let Ok(v) = std::env::var("FRUGAL_ISA") else {
            return Level::Amx;
        };
        Level::parse(&v).unwrap_or_else(|| {
            eprintln!(
                "frugal: FRUGAL_ISA={v:?} is not a level (scalar, avx2, avx512, avx512-vnni, \
                 amx or native); running at the CPU's best level ({})",
                features().level()
            );
            Level::Amx
        })
    })
}

/// The level the kernels run at: the CPU's best, capped by `FRUGAL_ISA`.
#[inline]
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| features().level().min(cap()))
}

/// Every level the kernels may run at here (those up to [`level`]), lowest first, for tests
/// that compare each SIMD level with the scalar twin. The levels left out (the CPU lacks them,
/// `FRUGAL_ISA` caps them, or the OS refuses AMX) are printed on stderr, so a test that checked
/// less than it could says so.
pub fn levels_for_tests() -> Vec<Level> {
    let top = level();
    let (run, skipped): (Vec<Level>, Vec<Level>) = Level::ALL
        .into_iter()
        .partition(|&l| l <= top && (l != Level::Amx || Amx::get().is_some()));
    if !skipped.is_empty() {
        let names: Vec<&str> = skipped.iter().map(|l| l.name()).collect();
        eprintln!(
            "cpu: skipping level(s) {} (CPU level {}, FRUGAL_ISA cap {})",
            names.join(", "),
            features().level(),
            cap()
        );
    }
    run
}

/// `T`'s token for a test that needs it, or `None` after printing on stderr that `test` is
/// skipped (so a test that could not run here says so rather than passing silently).
pub fn token_for_test<T: Token>(test: &str) -> Option<T> {
    let t = T::get();
    if t.is_none() {
        eprintln!(
            "cpu: skipping {test}: level {} not available (CPU level {}, FRUGAL_ISA cap {})",
            T::LEVEL,
            features().level(),
            cap()
        );
    }
    t
}

/// A capability token: a zero-sized proof that the CPU has a set of features and `FRUGAL_ISA`
/// allows them. Only this module makes tokens.
pub trait Token: Copy + Send + Sync + 'static {
    /// The level the token's features belong to.
    const LEVEL: Level;
    /// The token, where the CPU has the features and the cap allows them.
    fn get() -> Option<Self>;
}

macro_rules! token {
    ($(#[$doc:meta])* $name:ident, $level:ident, $extra:expr) => {
        $(#[$doc])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq)]
        pub struct $name(());

        impl $name {
            /// The token, where the CPU has the features and `FRUGAL_ISA` allows them
            /// (detection is cached: one load and a compare).
            #[inline]
            pub fn get() -> Option<Self> {
                (level() >= Level::$level && $extra).then_some($name(()))
            }
        }

        impl Token for $name {
            const LEVEL: Level = Level::$level;
            #[inline]
            fn get() -> Option<Self> {
                $name::get()
            }
        }
    };
}

token!(
    /// AVX2, FMA and F16C: `#[target_feature(enable = "avx2,fma,f16c")]`.
    Avx2,
    Avx2,
    true
);
token!(
    /// AVX-512 F, BW, VL and DQ, with everything [`Avx2`] proves:
    /// `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]`.
    Avx512,
    Avx512,
    true
);
token!(
    /// AVX-512 VNNI, with everything [`Avx512`] proves.
    Avx512Vnni,
    Avx512Vnni,
    true
);
token!(
    /// AVX-512 VBMI2, with everything [`Avx512Vnni`] proves (the 2:4 sparse kernels).
    Vbmi2,
    Avx512Vnni,
    features().avx512vbmi2
);
token!(
    /// AVX-512 BF16, with everything [`Avx512Vnni`] proves (the training GEMM's `VDPBF16PS`).
    Avx512Bf16,
    Avx512Vnni,
    features().avx512bf16
);
token!(
    /// AMX TILE, INT8 and BF16, with everything [`Avx512Vnni`] proves, and Linux's permission
    /// for this process to use the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked for the
    /// first time this token is: process-wide, and only by programs that want the tiles).
    Amx,
    Amx,
    amx_permitted()
);

impl Avx512 {
    /// The [`Avx2`] token AVX-512's level includes.
    #[inline]
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

impl Avx512Vnni {
    /// The [`Avx512`] token this level includes.
    #[inline]
    pub fn avx512(self) -> Avx512 {
        Avx512(())
    }

    /// The [`Avx2`] token this level includes.
    #[inline]
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

impl Vbmi2 {
    /// The [`Avx512Vnni`] token VBMI2 comes with.
    #[inline]
    pub fn avx512_vnni(self) -> Avx512Vnni {
        Avx512Vnni(())
    }
}

impl Avx512Bf16 {
    /// The [`Avx512`] token AVX-512 BF16 comes with.
    #[inline]
    pub fn avx512(self) -> Avx512 {
        Avx512(())
    }
}

impl Amx {
    /// The [`Avx2`] token every AMX CPU has.
    #[inline]
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }

    /// The [`Avx512`] token every AMX CPU has.
    #[inline]
    pub fn avx512(self) -> Avx512 {
        Avx512(())
    }

    /// Loads `config` as this thread's tile configuration (`LDTILECFG`).
    #[cfg(target_arch = "x86_64")]
    pub fn load_tiles(self, config: &'static TileConfig) {
        // SAFETY: the token proves AMX and the OS's permission; a TileConfig is a valid
        // palette-1 configuration, 64-byte aligned.
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly)) };
    }

    /// Returns the tiles to their initial state (`TILERELEASE`: the thread's XSAVE area stops
    /// carrying them).
    #[cfg(target_arch = "x86_64")]
    pub fn release_tiles(self) {
        // SAFETY: the token proves AMX; TILERELEASE has no operands.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The 64-byte `LDTILECFG` operand, palette 1: bytes per row and rows of each of the 8 tiles.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    /// Tiles `tmm0..tmm7` of `colsb[i]` bytes by `rows[i]` rows (at most 64 and 16).
    pub const fn palette1(colsb: [u16; 8], rows: [u8; 8]) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let mut i = 0;
        while i < 8 {
            assert!(colsb[i] <= 64 && rows[i] <= 16);
            c.colsb[i] = colsb[i];
            c.rows[i] = rows[i];
            i += 1;
        }
        c
    }
}

/// Whether the CPU is Intel's (CPUID's vendor string; some tunings differ by vendor).
pub fn vendor_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &v == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether Linux lets this process use the AMX tile data (asked for once; the answer is
/// process-wide). Only asked where the CPU has AMX.
fn amx_permitted() -> bool {
    static PERMITTED: OnceLock<bool> = OnceLock::new();
    *PERMITTED.get_or_init(request_amx)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes the process's permitted XSAVE
    // features; it reads no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_amx() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_order() {
        for l in Level::ALL {
            assert_eq!(Level::parse(l.name()), Some(l));
        }
        assert_eq!(Level::parse("AVX512_VNNI"), Some(Level::Avx512Vnni));
        assert_eq!(Level::parse("native"), Some(Level::Amx));
        assert_eq!(Level::parse("avx3"), None);
        assert!(Level::ALL.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn tokens_follow_the_level() {
        let top = level();
        assert_eq!(Avx2::get().is_some(), top >= Level::Avx2);
        assert_eq!(Avx512::get().is_some(), top >= Level::Avx512);
        assert_eq!(Avx512Vnni::get().is_some(), top >= Level::Avx512Vnni);
        assert!(Vbmi2::get().is_none() || top >= Level::Avx512Vnni);
        assert!(Avx512Bf16::get().is_none() || top >= Level::Avx512Vnni);
        assert!(Amx::get().is_none() || top == Level::Amx);
        assert!(top <= features().level() && top <= cap());
        let levels = levels_for_tests();
        assert_eq!(levels[0], Level::Scalar);
        for l in levels {
            assert_eq!(l.avx2().is_some(), l >= Level::Avx2);
            assert_eq!(l.avx512().is_some(), l >= Level::Avx512);
            assert_eq!(l.avx512_vnni().is_some(), l >= Level::Avx512Vnni);
        }
    }
}
