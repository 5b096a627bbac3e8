//! AFL harness: `frugal_fuzz::serve_request` on each input.
fn main() {
    frugal_fuzz::warm_up();
    afl::fuzz!(|data: &[u8]| frugal_fuzz::serve_request(data));
}
