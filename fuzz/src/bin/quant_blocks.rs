//! AFL harness: `frugal_fuzz::quant_blocks` on each input.
fn main() {
    afl::fuzz!(|data: &[u8]| frugal_fuzz::quant_blocks(data));
}
