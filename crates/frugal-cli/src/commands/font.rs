//! The one TrueType font every chart's text is drawn with. frugal ships none: it uses
//! `$FRUGAL_FONT` or a font found at a common path, registered with plotters once per process.

use std::path::PathBuf;

use anyhow::{Result, anyhow};
use plotters::style::FontStyle;

/// Common places for a TrueType font.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers the chart font as "sans-serif" (once); an error says how to provide one.
pub fn register_chart_font() -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(p) = std::env::var_os("FRUGAL_FONT") {
            candidates.push(PathBuf::from(p));
        }
        candidates.extend(FONT_PATHS.iter().map(PathBuf::from));
        for p in &candidates {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps fonts for the life of the program.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(
            "chart text needs a TrueType font and none was found; set FRUGAL_FONT to a .ttf file"
                .to_string(),
        )
    })
    .clone()
    .map_err(|e| anyhow!(e))
}
