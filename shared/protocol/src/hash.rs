//! FNV-1a, 64-bit: a hash that stays the same across builds and platforms
//! (unlike `std`'s `DefaultHasher`), for model fingerprints.

/// FNV-1a, 64-bit.
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv64 {
    pub fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= *b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// A hasher for keys that are already hashes (block hashes and their
/// digest keys): one multiply (Fibonacci hashing) spreads them over the
/// 64 bits a hash table reads, where SipHash would cost ten times as much.
/// Only for values a peer cannot choose to collide: block hashes come from
/// token ids through FNV, digest keys from authenticated workers.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrehashedHasher(u64);

impl std::hash::Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A `HashMap`/`HashSet` hasher for pre-hashed keys ([`PrehashedHasher`]).
pub type Prehashed = std::hash::BuildHasherDefault<PrehashedHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prehashed_keys_reach_the_top_bits() {
        use std::hash::BuildHasher;
        // hashbrown picks a group by the low bits and tags by the top 7.
        let tags: std::collections::HashSet<u64> = (0..1000u32)
            .map(|k| Prehashed::default().hash_one(k) >> 57)
            .collect();
        assert!(tags.len() > 100, "{} distinct tags", tags.len());
    }

    #[test]
    fn matches_the_published_fnv1a_vectors() {
        let hash = |s: &[u8]| {
            let mut h = Fnv64::default();
            h.write(s);
            h.finish()
        };
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
