//! Process plumbing shared by every pdserve binary: metric names, logging and
//! graceful shutdown.

pub mod http;
pub mod kv_upload;
pub mod metrics;
pub mod queue;
pub mod registration;
pub mod shutdown;
pub mod telemetry;
pub mod testing;
