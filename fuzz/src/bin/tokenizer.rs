//! AFL harness: `frugal_fuzz::tokenizer` on each input.
fn main() {
    frugal_fuzz::warm_up();
    afl::fuzz!(|data: &[u8]| frugal_fuzz::tokenizer(data));
}
