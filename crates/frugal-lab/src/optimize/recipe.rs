//! A recipe: how to rebuild a point of the search from its base, byte for byte.
//!
//! The ladder's stages apply in the order the recipe lists them; each stage is one lever's
//! settings. Structural changes usually come first and quantization last (the literature's and
//! the vendors' order), but the order is the recipe's: pruning after quantization is a
//! candidate too. Built: [`Stage::Prune`] and [`Stage::Quant`]; attention layout, MoE
//! conversion and distillation become further variants. A stage that reads activations
//! (pruning) reads them on the calibration text the recipe names ([`CalibrationId`]). Settings
//! that change how the file runs, not the file (KV-cache format, activation precision, later
//! speculative decoding), are in [`Runtime`].

use std::fmt;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use frugal::convert::{Policy, Rule, Target, quantize_in_memory};
use frugal::gguf::GgufFile;
use frugal::kv::KvType;
use frugal::quant::act::Activations;
use frugal::surgery::importance::Importance;
use frugal::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The version written into recipes: a recipe from another version is refused (its encoders
/// may round differently, so the bytes would not be the same).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// What this build's encoders write: the sha256 of a fixed pseudo-random block of weights
/// encoded in every format the quantization stage uses, plainly and weighted by importance.
/// Two builds of one version whose encoders round differently write different fingerprints,
/// so a recipe checks the encoders themselves, not only the version's name.
pub fn encoder_fingerprint() -> &'static str {
    static F: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        // 4 rows of 256: every format's block divides them.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let x: Vec<f32> = (0..1024)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        let importance: Vec<f32> = (0..256).map(|j| 1.0 + (j % 7) as f32).collect();
        let mut h = Sha256::new();
        for t in super::quant::uniform() {
            h.update(t.name().as_bytes());
            if let Ok(b) = frugal::quant::quantize(t, &x) {
                h.update(&b);
            }
            if frugal::quant::weighted::has_weighted_encoder(t)
                && let Ok(b) = frugal::quant::weighted::quantize_weighted(t, &x, &importance)
            {
                h.update(&b);
            }
        }
        format!("{:x}", h.finalize())
    })
}

/// The levers of the ladder, in the order they apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lever {
    Prune,
    Attention,
    Moe,
    Distill,
    Quant,
    Kv,
    Speculate,
}

impl Lever {
    pub const ALL: [Lever; 7] = [
        Lever::Prune,
        Lever::Attention,
        Lever::Moe,
        Lever::Distill,
        Lever::Quant,
        Lever::Kv,
        Lever::Speculate,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Lever::Prune => "prune",
            Lever::Attention => "attention",
            Lever::Moe => "moe",
            Lever::Distill => "distill",
            Lever::Quant => "quant",
            Lever::Kv => "kv",
            Lever::Speculate => "speculate",
        }
    }

    /// Parses a comma-separated list (`quant,kv`), refusing unknown levers by name.
    pub fn parse_list(s: &str) -> Result<Vec<Lever>> {
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some(l) = Lever::ALL.iter().find(|l| l.name() == name) else {
                let all: Vec<&str> = Lever::ALL.iter().map(|l| l.name()).collect();
                bail!("unknown lever {name:?} (levers: {})", all.join(", "));
            };
            if !out.contains(l) {
                out.push(*l);
            }
        }
        ensure!(!out.is_empty(), "--levers names no lever");
        Ok(out)
    }
}

/// One lever's settings in the ladder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "lever", rename_all = "snake_case")]
pub enum Stage {
    /// A cut: structured removal or sparse zeros ([`super::prune`]).
    Prune(super::prune::Prune),
    /// An attention layout (`gqa:G`, `mqa`, `mla:RANK`; [`super::attention`]).
    Attention { layout: String },
    /// The FFN split into experts (`frugal moefy`; [`super::experts`]): `variant` as
    /// `frugal report moe` writes it (`s512+8x2`: a shared expert of 512 neurons and 8 routed
    /// experts, 2 per token), the split and routers from the calibration text, seeded.
    Moe { variant: String, seed: u64 },
    /// Distillation from the base on the calibration text ([`super::distill`]), `tokens`
    /// training tokens, seeded.
    Distill { tokens: usize, seed: u64 },
    /// Weight formats: `format` for the bulk of the matrices, `keep` rules (`GLOB=TYPE`, first
    /// match wins, as `frugal quantize --keep`) for the tensors the allocation chose otherwise;
    /// with `imatrix`, the formats that have a weighted encoder (q4_0, q5_0, q4_k) round each
    /// column by its importance on the calibration text (`frugal quantize --calibration`, as
    /// llama.cpp's imatrix), measured through the file being quantized.
    Quant {
        format: String,
        keep: Vec<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        imatrix: bool,
    },
}

impl Stage {
    /// `file` with this stage applied (`base`: the teacher of distillation; `cal`: the text
    /// cuts score weights on and distillation trains on).
    pub fn apply(
        &self,
        file: &GgufFile,
        base: &GgufFile,
        cal: &super::prune::Calibration,
    ) -> Result<GgufFile> {
        match self {
            Stage::Prune(p) => p.apply(file, cal),
            Stage::Attention { layout } => super::attention::apply(file, layout, cal),
            Stage::Moe { variant, seed } => super::experts::apply(file, variant, cal, *seed),
            Stage::Distill { tokens, seed } => {
                super::distill::apply(file, base, cal, *tokens, *seed)
            }
            Stage::Quant {
                format,
                keep,
                imatrix,
            } => {
                let mut policy = Policy::new(format.parse::<Target>()?);
                policy.rules = keep
                    .iter()
                    .map(|r| r.parse::<Rule>())
                    .collect::<Result<_, _>>()?;
                if *imatrix {
                    let tokens = cal.for_cuts();
                    ensure!(
                        cal.ctx > 0 && tokens.len() >= cal.ctx,
                        "{self}: needs calibration text (at least one window of {} tokens)",
                        cal.ctx
                    );
                    let model = crate::build::load_file(
                        GgufFile::from_bytes(file.raw_bytes().to_vec())?,
                        false,
                    )?;
                    policy = policy.with_importance(Importance::collect(&model, tokens, cal.ctx)?);
                }
                let (q, _) = quantize_in_memory(file, &policy, |_, _| {})
                    .with_context(|| format!("quantizing to {format}"))?;
                Ok(q)
            }
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stage::Prune(p) => write!(f, "{p}"),
            Stage::Attention { layout } => write!(f, "attention {layout}"),
            Stage::Moe { variant, seed } => write!(f, "moe {variant} seed {seed}"),
            Stage::Distill { tokens, seed } => write!(f, "distill {tokens} tokens seed {seed}"),
            Stage::Quant { format, keep, .. } if keep.is_empty() => write!(f, "{format}"),
            Stage::Quant { format, keep, .. } => write!(f, "{format}+{}", keep.join("+")),
        }?;
        match self {
            Stage::Quant { imatrix: true, .. } => write!(f, " imatrix"),
            _ => Ok(()),
        }
    }
}

/// How the built file runs: settings the file does not carry (`frugal serve --kv-type ...
/// --activations ...` applies them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runtime {
    /// KV-cache format of keys and values.
    #[serde(with = "by_name")]
    pub kv: KvType,
    #[serde(with = "by_name")]
    pub activations: Activations,
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime {
            kv: KvType::F32,
            activations: Activations::Q8,
        }
    }
}

/// Serde by the names the command line takes (`Display` / `FromStr`).
mod by_name {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr<Err: Display>,
        D: Deserializer<'de>,
    {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Which base file a recipe applies to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseId {
    /// Where it was when the recipe was made (a hint: the hash decides).
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

impl BaseId {
    /// Hashes the file at `path`.
    pub fn of(path: &Path) -> Result<BaseId> {
        let mut f =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut h = Sha256::new();
        let bytes = std::io::copy(&mut f, &mut h)?;
        Ok(BaseId {
            path: path.display().to_string(),
            sha256: format!("{:x}", h.finalize()),
            bytes,
        })
    }
}

/// The calibration a recipe's stages read: the file (by hash), how many of its tokens are
/// kept, how many the cuts read, and in which windows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalibrationId {
    pub file: BaseId,
    /// Tokens kept from its start (what distillation trains on).
    pub tokens: usize,
    /// Tokens the cuts score weights on.
    pub cut_tokens: usize,
    pub ctx: usize,
}

impl CalibrationId {
    /// The identity of `cal`, read from `path`.
    pub fn of(path: &Path, cal: &super::prune::Calibration) -> Result<CalibrationId> {
        Ok(CalibrationId {
            file: BaseId::of(path)?,
            tokens: cal.tokens.len(),
            cut_tokens: cal.cut_tokens,
            ctx: cal.ctx,
        })
    }

    /// Reads the tokens back from `path` (the recorded one unless given), refusing another
    /// text than the one the recipe was made with.
    pub fn load(&self, path: Option<&Path>, base: &GgufFile) -> Result<super::prune::Calibration> {
        let path = path.unwrap_or(Path::new(&self.file.path));
        let id = BaseId::of(path).with_context(|| {
            format!(
                "the recipe's stages read {}: give it with --calibration",
                self.file.path
            )
        })?;
        ensure!(
            id.sha256 == self.file.sha256,
            "{} is not the calibration text the recipe was made with ({}, sha256 {}…): its cuts would select other weights",
            path.display(),
            self.file.path,
            &self.file.sha256[..12.min(self.file.sha256.len())]
        );
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut tokens = Tokenizer::from_gguf(base)?.encode(&text, false)?;
        tokens.truncate(self.tokens);
        Ok(super::prune::Calibration {
            tokens,
            ctx: self.ctx,
            cut_tokens: self.cut_tokens,
        })
    }
}

/// A point of the search: the ladder's stages and the runtime settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recipe {
    pub stages: Vec<Stage>,
    pub runtime: Runtime,
}

impl Recipe {
    /// The base with every stage applied, in order (the base itself for no stages).
    pub fn build(&self, base: &GgufFile, cal: &super::prune::Calibration) -> Result<GgufFile> {
        let mut file = GgufFile::from_bytes(base.raw_bytes().to_vec())?;
        for s in &self.stages {
            file = s.apply(&file, base, cal)?;
        }
        Ok(file)
    }

    /// Whether a stage reads calibration activations (of this recipe or of `draft`, the
    /// draft model's paired with it).
    pub fn needs_calibration_with(&self, draft: Option<&Recipe>) -> bool {
        self.needs_calibration() || draft.is_some_and(Recipe::needs_calibration)
    }

    /// Whether a stage reads calibration activations.
    pub fn needs_calibration(&self) -> bool {
        self.stages
            .iter()
            .any(|s| !matches!(s, Stage::Quant { imatrix: false, .. }))
    }

    /// Whether every stage is a plain quantization (the weights the bank assembles; an
    /// importance-weighted one is encoded on its own).
    pub fn quant_only(&self) -> bool {
        self.stages
            .iter()
            .all(|s| matches!(s, Stage::Quant { imatrix: false, .. }))
    }

    /// A stable key naming the recipe (what `--resume` matches finished candidates by).
    pub fn key(&self) -> String {
        let stages: Vec<String> = self.stages.iter().map(|s| s.to_string()).collect();
        let stages = if stages.is_empty() {
            "base".to_string()
        } else {
            stages.join(" | ")
        };
        format!(
            "{stages} | kv {} | act {}",
            self.runtime.kv, self.runtime.activations
        )
    }

    /// The same weights run another way.
    pub fn with_runtime(&self, runtime: Runtime) -> Recipe {
        Recipe {
            stages: self.stages.clone(),
            runtime,
        }
    }
}

/// `recipe.toml`: the chosen point, the base it applies to and the version that made it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecipeFile {
    pub frugal_version: String,
    /// [`encoder_fingerprint`] of the build that wrote it (absent in older recipes: then the
    /// version alone is checked).
    #[serde(default)]
    pub encoders: Option<String>,
    pub base: BaseId,
    pub recipe: Recipe,
    /// The text the recipe's cuts were scored on (when a stage reads activations).
    #[serde(default)]
    pub calibration: Option<CalibrationId>,
    /// What the search measured for it (for the reader; rebuilding ignores it).
    #[serde(default)]
    pub measured: Option<super::target::Measured>,
    /// The drafter paired with it (a runtime setting; a draft model is rebuilt beside it).
    #[serde(default)]
    pub speculate: Option<super::speculate::Pairing>,
}

impl RecipeFile {
    pub fn read(path: &Path) -> Result<RecipeFile> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let text = toml::to_string(self)?;
        super::write_atomic(path, text.as_bytes())
    }

    /// Refuses a recipe made by another version or from another base (`base` is the hash of
    /// the file it is to be applied to), with the reason.
    pub fn check(&self, base: &BaseId) -> Result<()> {
        ensure!(
            self.frugal_version == VERSION,
            "the recipe was made by frugal {} and this is {VERSION}: its encoders may round differently, so the model would not be the same; rerun the search",
            self.frugal_version
        );
        if let Some(e) = &self.encoders {
            ensure!(
                e == encoder_fingerprint(),
                "the recipe was made by a build of frugal {VERSION} whose encoders round differently from this one's (fingerprint {}… against {}…): the model would not be the same; rerun the search",
                &e[..12.min(e.len())],
                &encoder_fingerprint()[..12]
            );
        }
        ensure!(
            self.base.sha256 == base.sha256,
            "the recipe was made from another base model ({}, sha256 {}…, {} bytes) than {} (sha256 {}…, {} bytes): its formats were chosen by that model's measurements",
            self.base.path,
            &self.base.sha256[..12.min(self.base.sha256.len())],
            self.base.bytes,
            base.path,
            &base.sha256[..12],
            base.bytes
        );
        Ok(())
    }
}
