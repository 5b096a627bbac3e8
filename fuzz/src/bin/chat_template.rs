//! AFL harness: `frugal_fuzz::chat_template` on each input.
fn main() {
    afl::fuzz!(|data: &[u8]| frugal_fuzz::chat_template(data));
}
