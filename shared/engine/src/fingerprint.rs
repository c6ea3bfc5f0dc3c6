//! A stable 64-bit identity for "this model file, loaded this way".
//!
//! Two processes exchange KV only when their fingerprints match, so the hash
//! covers what changes the KV: architecture metadata, every tensor's name,
//! shape, type and offset, and the weight format. FNV-1a keeps it stable
//! across builds and platforms (unlike `std`'s `DefaultHasher`).

use candle_core::quantized::gguf_file::{Content, Value};

use pdserve_text::hash::Fnv64;

use crate::kv::KvDtype;
use crate::weights::WeightFormat;

pub(crate) fn of_content(content: &Content, format: WeightFormat) -> u64 {
    let mut h = Fnv64::default();
    let mut keys: Vec<&String> = content
        .metadata
        .keys()
        .filter(|k| !k.starts_with("tokenizer.") && !k.starts_with("general."))
        .collect();
    keys.sort();
    for k in keys {
        h.write(k.as_bytes());
        h.write(format_value(&content.metadata[k]).as_bytes());
    }
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for n in names {
        let info = &content.tensor_infos[n];
        h.write(n.as_bytes());
        h.write(
            format!(
                "{:?}{:?}{}",
                info.shape.dims(),
                info.ggml_dtype,
                info.offset
            )
            .as_bytes(),
        );
    }
    h.write(format.as_str().as_bytes());
    h.finish()
}

/// The fingerprint of `model` with a KV cache of `cache`: what workers
/// register, what KV streams carry and what block hashes chain from. A
/// cache of another element type holds other values for the same prompt,
/// so prefill and decode workers pair, and cached blocks match, only when
/// both the model and the cache type do.
pub(crate) fn with_kv_cache(model: u64, cache: KvDtype) -> u64 {
    let mut h = Fnv64::default();
    h.write(&model.to_le_bytes());
    h.write(format!("kv-cache:{cache:?}").as_bytes());
    h.finish()
}

fn format_value(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("[{} items]", items.len()),
        other => format!("{other:?}"),
    }
}
