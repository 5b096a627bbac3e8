//! A measured candidate: what a comparison of models made from one base needs of each of them
//! (its name, its size, its quality against the base and its speed against its baseline).
//! The studies add what is particular to their rows beside it.

use crate::quality::Quality;
use crate::size::Footprint;
use crate::timing::Paired;

/// One model made from a base, measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Candidate {
    pub name: String,
    /// Parameters and bytes as the file stores them.
    pub size: Footprint,
    /// Against the base, on the study's text.
    pub quality: Quality,
    /// Its own speed and, timed back to back, its ratio to its baseline's.
    pub speed: Paired,
}
