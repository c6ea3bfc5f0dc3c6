//! KV-cache wire format (version 2).
//!
//! A prefill worker computes a prompt's KV cache and streams it, layer by
//! layer, to a decode worker. A stream is one **header** frame, zero or more
//! **layer** frames, then one **end** frame. All integers are little-endian.
//! Every frame starts with a 4-byte tag and ends with a CRC32C (Castagnoli)
//! of all the frame's preceding bytes, tag included.
//!
//! ```text
//! header  "PDKV" version:u16 flags:u16 body_len:u32
//!         body = id_len:u16 request_id fingerprint:u64 dtype:u8
//!                n_layers:u32 n_kv_heads:u32 head_dim:u32 n_tokens:u32
//!                start_token:u32 seed:u64
//!                [trace_id:16 bytes span_id:8 bytes trace_flags:u8]
//!         crc:u32
//! layer   "KVLF" layer_start:u32 layer_count:u32 token_start:u32 token_count:u32
//!         payload_len:u64 payload crc:u32
//! end     "KVND" first_token:u32 first_logprob:f32 n_top:u8
//!         n_top x (token:u32 logprob:f32) crc:u32
//! ```
//!
//! The header's only flag is [`FLAG_TRACE_CONTEXT`] (bit 0): the body ends
//! with the sender's W3C trace context (a `traceparent`'s fields in binary).
//! A stream without it is the same, byte for byte, as before the flag
//! existed; other bits are refused.
//!
//! A layer frame's payload holds, for each of its layers in order, the K
//! bytes of its tokens, then the V bytes (`token_count * n_kv_heads *
//! head_dim` values of the dtype each).
//!
//! Frames cover the KV cache in chunks of tokens (chunked prefill); within a
//! chunk, layers go in order, every frame of a chunk carrying the same token
//! range. The first chunk starts at `start_token`: the leading tokens the
//! receiver already holds (its prefix cache) are not sent. The end frame
//! is accepted only once tokens `start_token..n_tokens` are covered for all
//! layers.
//!
//! Encode with [`encode_header`], [`encode_layers`] (or
//! [`encode_layer_parts`]) and [`encode_end`] ([`with_trace`] adds a trace
//! context to an encoded header); decode incrementally with
//! [`KvStreamDecoder`]; check a decoded header against a decode worker's
//! reservation with [`validate_against`].

mod decode;
mod encode;
mod error;
mod frame;
mod shape;
mod types;
mod validate;

pub use decode::KvStreamDecoder;
pub use encode::{encode_end, encode_header, encode_layer_parts, encode_layers, with_trace};
pub use error::KvWireError;
pub use shape::KvShape;
pub use types::{
    ExpectedKv, KvDtype, KvEvent, KvHeader, KvLimits, KvTraceContext, KvTrailer, LayerFrame,
};
pub use validate::validate_against;

/// The only wire-format version this crate reads and writes.
pub const VERSION: u16 = 2;
/// Header flag: the header body ends with a [`KvTraceContext`].
pub const FLAG_TRACE_CONTEXT: u16 = 0x0001;
/// Tag of the header frame.
pub const HEADER_TAG: [u8; 4] = *b"PDKV";
/// Tag of a layer frame.
pub const LAYER_TAG: [u8; 4] = *b"KVLF";
/// Tag of the end frame.
pub const END_TAG: [u8; 4] = *b"KVND";
/// Largest allowed `request_id`, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Largest allowed number of top logprobs in the end frame.
pub const MAX_TOP_LOGPROBS: usize = 20;
