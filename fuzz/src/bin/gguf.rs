//! AFL harness: `frugal_fuzz::gguf` on each input.
fn main() {
    afl::fuzz!(|data: &[u8]| frugal_fuzz::gguf(data));
}
