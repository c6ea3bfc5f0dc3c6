//! Prefix-cache identities shared by workers and the router.
//!
//! A KV block is identified by a chained hash: the hash of the block before
//! it (0 for the first), the model's fingerprint and the block's token ids.
//! Two sequences whose first `k` blocks hash alike share their first
//! `k · block_tokens` tokens, so the hash of a prompt's blocks tells which
//! part of it a worker's prefix cache already holds.
//!
//! Workers publish the blocks they hold as a [`PrefixDigest`] in every load
//! report (heartbeat or `/load` poll): a compact list of 32-bit block keys.
//! A digest, not store/evict events: it needs no per-router cursor, works the
//! same for pushed heartbeats and pulled polls, and heals by itself after a
//! router restart or a lost report. At 8 bytes of JSON per block it costs
//! about 32 KB per report for the default 65,536-token budget.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::hash::{Fnv64, Prehashed};

/// Most blocks one digest lists; a worker holding more lists those it holds
/// for running sequences first, then its most recently used cached ones.
pub const MAX_DIGEST_BLOCKS: usize = 16_384;

/// Characters per block in [`PrefixDigest::blocks`].
const HEX_PER_BLOCK: usize = 8;

/// The identity of a full block: the hash of the block before it (0 for the
/// first), the model (`seed`, its fingerprint) and the block's tokens.
pub fn block_hash(parent: u64, tokens: &[u32], seed: u64) -> u64 {
    let mut h = Fnv64::default();
    h.write(&parent.to_le_bytes());
    h.write(&seed.to_le_bytes());
    for t in tokens {
        h.write(&t.to_le_bytes());
    }
    h.finish()
}

/// The chained hashes of the full blocks of `tokens`, in order; a partial
/// last block has none.
pub fn block_hashes(tokens: &[u32], block_tokens: usize, seed: u64) -> Vec<u64> {
    let mut parent = 0;
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|chunk| {
            parent = block_hash(parent, chunk, seed);
            parent
        })
        .collect()
}

/// The key a digest lists for a block hash: its low 32 bits. A collision
/// only misleads a routing score; workers check the full hash and tokens.
pub fn digest_key(hash: u64) -> u32 {
    (hash & 0xffff_ffff) as u32
}

/// The blocks a worker's prefix cache holds, as it reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixDigest {
    /// Tokens per block.
    pub block_tokens: u32,
    /// The seed of the block hashes (the model's fingerprint).
    pub seed: u64,
    /// [`digest_key`] of every listed block, 8 lowercase hex digits each.
    pub blocks: String,
}

/// A digest that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    #[error("prefix digest: block_tokens must be at least 1")]
    NoBlockTokens,
    #[error("prefix digest: blocks is not a sequence of 8-digit hex keys")]
    BadBlocks,
    #[error("prefix digest: {0} blocks listed, at most {MAX_DIGEST_BLOCKS}")]
    TooMany(usize),
}

impl PrefixDigest {
    /// The digest of the blocks hashed `hashes` (at most
    /// [`MAX_DIGEST_BLOCKS`] are listed).
    pub fn new(block_tokens: u32, seed: u64, hashes: impl IntoIterator<Item = u64>) -> Self {
        let mut blocks = String::new();
        for h in hashes.into_iter().take(MAX_DIGEST_BLOCKS) {
            blocks.push_str(&format!("{:08x}", digest_key(h)));
        }
        Self {
            block_tokens,
            seed,
            blocks,
        }
    }

    /// Blocks listed.
    pub fn len(&self) -> usize {
        self.blocks.len() / HEX_PER_BLOCK
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The digest as a set to match prompts against.
    pub fn parse(&self) -> Result<PrefixSet, DigestError> {
        if self.block_tokens == 0 {
            return Err(DigestError::NoBlockTokens);
        }
        let bytes = self.blocks.as_bytes();
        if !bytes.len().is_multiple_of(HEX_PER_BLOCK) {
            return Err(DigestError::BadBlocks);
        }
        let n = self.len();
        if n > MAX_DIGEST_BLOCKS {
            return Err(DigestError::TooMany(n));
        }
        let mut keys = HashSet::with_capacity_and_hasher(n, Prehashed::default());
        for chunk in bytes.chunks_exact(HEX_PER_BLOCK) {
            let s = std::str::from_utf8(chunk).map_err(|_| DigestError::BadBlocks)?;
            keys.insert(u32::from_str_radix(s, 16).map_err(|_| DigestError::BadBlocks)?);
        }
        Ok(PrefixSet {
            block_tokens: self.block_tokens,
            seed: self.seed,
            keys,
        })
    }
}

/// A parsed [`PrefixDigest`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixSet {
    pub block_tokens: u32,
    pub seed: u64,
    keys: HashSet<u32, Prehashed>,
}

impl PrefixSet {
    /// The set a digest of the blocks hashed `hashes` parses to (at most
    /// [`MAX_DIGEST_BLOCKS`], as [`PrefixDigest::new`] lists), without the
    /// text in between: for a simulated router that sees a worker's cache.
    pub fn from_hashes(
        block_tokens: u32,
        seed: u64,
        hashes: impl IntoIterator<Item = u64>,
    ) -> Self {
        Self {
            block_tokens,
            seed,
            keys: hashes
                .into_iter()
                .take(MAX_DIGEST_BLOCKS)
                .map(digest_key)
                .collect(),
        }
    }

    /// Adds (`present`) or removes the block hashed `hash`, and tells
    /// whether the set changed: a simulated router's copy of a worker's
    /// digest, kept as its blocks come and go.
    pub fn update(&mut self, hash: u64, present: bool) -> bool {
        match present {
            true => self.keys.insert(digest_key(hash)),
            false => self.keys.remove(&digest_key(hash)),
        }
    }

    /// Blocks in the set.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many of the leading blocks hashed `hashes` (from
    /// [`block_hashes`] with this set's block size and seed) the worker
    /// holds: the prefix it would not have to compute.
    pub fn leading_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.keys.contains(&digest_key(**h)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_hash_depends_on_parent_tokens_and_model() {
        let h = block_hash(0, &[1, 2], 9);
        assert_ne!(h, block_hash(1, &[1, 2], 9));
        assert_ne!(h, block_hash(0, &[2, 1], 9));
        assert_ne!(h, block_hash(0, &[1, 2], 8));
        assert_eq!(h, block_hash(0, &[1, 2], 9));
    }

    #[test]
    fn block_hashes_chain_over_full_blocks_only() {
        let t: Vec<u32> = (0..10).collect();
        let h = block_hashes(&t, 4, 7);
        assert_eq!(h.len(), 2, "the partial third block has no hash");
        assert_eq!(h[0], block_hash(0, &t[..4], 7));
        assert_eq!(h[1], block_hash(h[0], &t[4..8], 7));
    }

    #[test]
    fn a_digest_round_trips_and_matches_leading_blocks_only() {
        let a: Vec<u32> = (0..64).collect();
        let ha = block_hashes(&a, 16, 3);
        // The worker holds blocks 0, 1 and 3 of `a`.
        let d = PrefixDigest::new(16, 3, [ha[0], ha[1], ha[3]]);
        assert_eq!(d.len(), 3);
        let json = serde_json::to_string(&d).unwrap();
        let set = serde_json::from_str::<PrefixDigest>(&json)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(set.len(), 3);
        assert_eq!(
            set.leading_blocks(&ha),
            2,
            "block 2 is missing, so block 3 does not count"
        );
        let mut built = PrefixSet::from_hashes(16, 3, [ha[0], ha[1], ha[2], ha[3]]);
        assert!(built.update(ha[2], false) && !built.update(ha[2], false));
        assert_eq!(set, built);
        let mut b = a.clone();
        b[0] = 99;
        assert_eq!(set.leading_blocks(&block_hashes(&b, 16, 3)), 0);
    }

    #[test]
    fn bad_digests_are_refused() {
        let bad = |blocks: &str, block_tokens| PrefixDigest {
            block_tokens,
            seed: 0,
            blocks: blocks.into(),
        };
        assert_eq!(bad("0000000", 16).parse(), Err(DigestError::BadBlocks));
        assert_eq!(bad("0000000g", 16).parse(), Err(DigestError::BadBlocks));
        assert_eq!(bad("00000000", 0).parse(), Err(DigestError::NoBlockTokens));
        let many = "00000000".repeat(MAX_DIGEST_BLOCKS + 1);
        assert_eq!(
            bad(&many, 16).parse(),
            Err(DigestError::TooMany(MAX_DIGEST_BLOCKS + 1))
        );
        assert!(bad("", 16).parse().unwrap().is_empty());
    }
}
