//! AFL harness: `frugal_fuzz::tokenizer` on each input.
fn main() {
    afl::fuzz!(|data: &[u8]| frugal_fuzz::tokenizer(data));
}
