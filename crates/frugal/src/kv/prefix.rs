//! Block hashes for automatic prefix caching.
//!
//! A full block of `block_size` tokens is identified by its tokens *and everything before it*:
//! its hash is SHA-256 over the previous block's hash and the block's token ids (vLLM's chain).
//! Two prompts share cached blocks exactly as far as their tokens agree, block by block, and a
//! block's keys and values depend on nothing else (the forward pass is deterministic and a row's
//! result does not depend on the rest of the batch). 128 bits of the digest: a collision, which
//! would silently give a sequence another prompt's cache, is out of reach (~2^64 blocks).

use sha2::{Digest, Sha256};

/// The identity of a full block and its whole prefix.
pub type BlockHash = u128;

/// The chained hashes of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(&mut out, tokens, block_size);
    out
}

/// Appends to `hashes` (those of the first blocks of `tokens`) the hashes of the further full
/// blocks of `tokens`, so a growing sequence hashes each block once.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    for b in hashes.len()..full {
        let mut h = Sha256::new();
        if let Some(prev) = b.checked_sub(1).map(|p| hashes[p]) {
            h.update(prev.to_le_bytes());
        }
        for t in &tokens[b * block_size..(b + 1) * block_size] {
            h.update(t.to_le_bytes());
        }
        let d = h.finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&d[..16]);
        hashes.push(u128::from_le_bytes(first));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_extend() {
        let a: Vec<u32> = (0..50).collect();
        let mut b = a.clone();
        b[20] = 999; // second block differs
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2], "a difference carries into every later block");
        let mut grown = block_hashes(&a[..20], 16);
        extend_block_hashes(&mut grown, &a, 16);
        assert_eq!(grown, ha);
        // The same tokens in another position of the chain hash differently.
        let shifted: Vec<u32> = (16..32).chain(0..16).collect();
        assert_ne!(block_hashes(&shifted, 16)[1], ha[0]);
    }
}
