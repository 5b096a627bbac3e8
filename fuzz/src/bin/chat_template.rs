//! AFL harness: `frugal_fuzz::chat_template` on each input.
fn main() {
    frugal_fuzz::warm_up();
    afl::fuzz!(|data: &[u8]| frugal_fuzz::chat_template(data));
}
