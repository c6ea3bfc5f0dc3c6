//! The model as the KV stream sees it: what a header carries and what a
//! decode worker's reservation accepts.

use super::types::{ExpectedKv, KvDtype, KvHeader};

/// The dimensions and identity that a KV stream must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Workers exchange KV only when their fingerprints match.
    pub fingerprint: u64,
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
}

impl KvShape {
    /// The header of a KV stream of the tokens `start_token..n_tokens` of a
    /// sequence.
    pub fn header(
        &self,
        request_id: &str,
        (start_token, n_tokens): (u32, u32),
        seed: u64,
        dtype: KvDtype,
    ) -> KvHeader {
        KvHeader {
            request_id: request_id.to_string(),
            model_fingerprint: self.fingerprint,
            dtype,
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            n_tokens,
            start_token,
            seed,
            trace: None,
        }
    }

    /// What a reservation for a prompt of `n_tokens`, holding its first
    /// `start_token` already, accepts.
    pub fn expected(&self, request_id: &str, (start_token, n_tokens): (u32, u32)) -> ExpectedKv {
        ExpectedKv {
            request_id: request_id.to_string(),
            model_fingerprint: self.fingerprint,
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            max_tokens: n_tokens,
            start_token,
        }
    }
}
