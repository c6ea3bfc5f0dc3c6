//! Conversions between the engine's types and their wire forms in `pdserve-protocol`.

use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use pdserve_protocol::kvwire;

use crate::kv::{KvDtype, KvError};

impl From<kvwire::KvDtype> for KvDtype {
    fn from(d: kvwire::KvDtype) -> Self {
        match d {
            kvwire::KvDtype::F32 => Self::F32,
            kvwire::KvDtype::F16 => Self::F16,
        }
    }
}

impl From<KvDtype> for kvwire::KvDtype {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => Self::F32,
            KvDtype::F16 => Self::F16,
        }
    }
}

impl From<&KvError> for ErrorBody {
    /// A full budget is retryable (another worker, or later, may do); any
    /// other KV error is the request's or the stream's fault.
    fn from(e: &KvError) -> Self {
        let kind = ErrorKind::from_name(e.kind());
        match e {
            KvError::Exhausted { .. } => Self::retryable(kind, e.to_string()),
            _ => Self::fatal(kind, e.to_string()),
        }
    }
}

impl crate::Model {
    /// The model as the KV stream sees it.
    pub fn kv_shape(&self) -> kvwire::KvShape {
        let layout = self.kv_layout();
        kvwire::KvShape {
            fingerprint: self.fingerprint(),
            n_layers: layout.n_layers as u32,
            n_kv_heads: layout.n_kv_heads as u32,
            head_dim: layout.head_dim as u32,
        }
    }
}
