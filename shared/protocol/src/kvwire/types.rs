//! Data types carried by a KV stream.

use super::KvWireError;

/// Element type of the K and V values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit IEEE float (wire code 0).
    F32,
    /// 16-bit IEEE float (wire code 1).
    F16,
}

impl KvDtype {
    /// Size of one value in bytes.
    pub fn size(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }

    /// The dtype's code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
        }
    }

    /// The dtype with wire code `code`, or [`KvWireError::InvalidField`].
    pub fn from_code(code: u8) -> Result<Self, KvWireError> {
        match code {
            0 => Ok(Self::F32),
            1 => Ok(Self::F16),
            other => Err(KvWireError::invalid(
                "dtype",
                format!("unknown dtype code {other} (0 = f32, 1 = f16)"),
            )),
        }
    }
}

/// `f32` or `f16`, as flags and configuration name them.
impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            other => Err(format!("unknown KV dtype `{other}` (expected f32 or f16)")),
        }
    }
}

/// The header frame: what the stream carries and for which request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvHeader {
    /// Request id, 1..=128 bytes of printable ASCII without spaces.
    pub request_id: String,
    /// Fingerprint of the model (and its weights) that computed the KV.
    pub model_fingerprint: u64,
    /// Element type of the K and V values.
    pub dtype: KvDtype,
    /// Number of transformer layers.
    pub n_layers: u32,
    /// Number of KV heads per layer.
    pub n_kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Number of prompt tokens of the sequence (at least 1).
    pub n_tokens: u32,
    /// Leading tokens the receiver already holds (its prefix cache): the
    /// stream carries the KV of tokens `start_token..n_tokens` only.
    pub start_token: u32,
    /// Sampling seed of the request.
    pub seed: u64,
    /// The sender's span (flag [`FLAG_TRACE_CONTEXT`]): the receiver's
    /// spans for this stream join the sender's trace.
    ///
    /// [`FLAG_TRACE_CONTEXT`]: super::FLAG_TRACE_CONTEXT
    pub trace: Option<KvTraceContext>,
}

/// A W3C Trace Context in binary form, as the header frame carries it: the
/// fields of a `traceparent` (version 00) without the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTraceContext {
    /// The trace's id; never all zeros.
    pub trace_id: [u8; 16],
    /// The id of the sender's span, the parent of the receiver's; never all
    /// zeros.
    pub span_id: [u8; 8],
    /// The `traceparent` flags; bit 0 is `sampled`.
    pub trace_flags: u8,
}

impl KvHeader {
    /// Bytes of K (or of V) for one token of one layer, or `None` on overflow.
    pub fn token_bytes(&self) -> Option<u64> {
        u64::from(self.n_kv_heads)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(self.dtype.size())
    }

    /// The exact `payload_len` of a layer frame with `layer_count` layers
    /// and `token_count` tokens, or `None` on overflow.
    pub fn layer_payload_len(&self, layer_count: u32, token_count: u32) -> Option<u64> {
        payload_len(self.token_bytes()?, layer_count, token_count)
    }
}

/// `layer_count * 2 * token_count * token_bytes`, or `None` on overflow.
pub(crate) fn payload_len(token_bytes: u64, layer_count: u32, token_count: u32) -> Option<u64> {
    u64::from(layer_count)
        .checked_mul(2)?
        .checked_mul(u64::from(token_count))?
        .checked_mul(token_bytes)
}

/// A layer frame: K and V of `layer_count` consecutive layers for
/// `token_count` consecutive tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFrame {
    /// First layer carried.
    pub layer_start: u32,
    /// Number of layers carried (at least 1).
    pub layer_count: u32,
    /// First token carried.
    pub token_start: u32,
    /// Number of tokens carried (at least 1).
    pub token_count: u32,
    /// For each layer in order: its K bytes, then its V bytes.
    pub payload: Vec<u8>,
}

impl LayerFrame {
    /// The `(K, V)` bytes of absolute layer `layer`, or `None` if the frame
    /// does not carry that layer (or its payload is not evenly laid out).
    pub fn layer_kv(&self, layer: u32) -> Option<(&[u8], &[u8])> {
        let index = layer.checked_sub(self.layer_start)?;
        if index >= self.layer_count {
            return None;
        }
        let count = usize::try_from(self.layer_count).ok()?;
        let per_layer = self.payload.len().checked_div(count)?;
        if per_layer.checked_mul(count)? != self.payload.len() || per_layer % 2 != 0 {
            return None;
        }
        let start = per_layer.checked_mul(usize::try_from(index).ok()?)?;
        let bytes = self.payload.get(start..start.checked_add(per_layer)?)?;
        bytes.split_at_checked(per_layer / 2)
    }
}

/// The end frame: the first sampled token and its logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTrailer {
    /// First token sampled from the prompt's last position.
    pub first_token: u32,
    /// Its logprob (never NaN).
    pub first_logprob: f32,
    /// Up to 20 `(token, logprob)` alternatives (logprobs never NaN).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One decoded frame of a KV stream.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// The header (always the first event).
    Header(KvHeader),
    /// A layer frame.
    Layers(LayerFrame),
    /// The end frame (always the last event).
    End(KvTrailer),
}

/// Bounds a decoder enforces before allocating anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLimits {
    /// Largest allowed `n_layers`.
    pub max_layers: u32,
    /// Largest allowed `n_kv_heads`.
    pub max_kv_heads: u32,
    /// Largest allowed `head_dim`.
    pub max_head_dim: u32,
    /// Largest allowed `n_tokens`.
    pub max_tokens: u32,
    /// Largest allowed layer-frame `payload_len`, in bytes.
    pub max_frame_bytes: u64,
}

impl KvLimits {
    /// Limits that only the integer types bound (used by the encoder).
    pub fn unlimited() -> Self {
        Self {
            max_layers: u32::MAX,
            max_kv_heads: u32::MAX,
            max_head_dim: u32::MAX,
            max_tokens: u32::MAX,
            max_frame_bytes: u64::MAX,
        }
    }
}

impl Default for KvLimits {
    /// 1024 layers, 1024 KV heads, head_dim 1024, 1 Mi tokens, 256 MiB frames.
    fn default() -> Self {
        Self {
            max_layers: 1024,
            max_kv_heads: 1024,
            max_head_dim: 1024,
            max_tokens: 1 << 20,
            max_frame_bytes: 256 << 20,
        }
    }
}

/// What a decode worker expects of a stream: its reservation and its model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedKv {
    /// The request the worker reserved room for.
    pub request_id: String,
    /// Fingerprint of the worker's model.
    pub model_fingerprint: u64,
    /// The model's number of layers.
    pub n_layers: u32,
    /// The model's number of KV heads.
    pub n_kv_heads: u32,
    /// The model's head dimension.
    pub head_dim: u32,
    /// Most prompt tokens the reservation has room for.
    pub max_tokens: u32,
    /// Leading tokens the reservation already holds: the stream must start there.
    pub start_token: u32,
}
