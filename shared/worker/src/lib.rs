//! The one HTTP layer of pdserve's workers. A prefill or decode worker is
//! this crate's [`prefill::PrefillServer`] or [`decode::DecodeServer`] over
//! an engine backend: the real model (`pdserve-prefill`, `pdserve-decode`)
//! or the mock's latency model (`pdserve-mock-worker`). Everything a worker
//! does on the network is here, written once: routes, `/health`, `/ready`,
//! `/load`, `/metrics`, registration and heartbeats, the drain, KV ingest
//! under leases, KV upload, NDJSON streaming, and the mapping of errors to
//! statuses, and the trace spans of each call. Backends never see HTTP.

pub mod decode;
pub mod http;
pub mod kv;
pub mod prefill;
pub mod queue;
mod readiness;
pub mod registration;
pub mod server;
pub mod trace;
pub mod upload;
mod validate;

pub use readiness::Readiness;
pub use server::{serve, Served, ServerArgs, Service};
