//! Types that cross process boundaries in pdserve: the internal RPC between
//! router and workers with its error classes ([`internal`]), the KV-cache
//! stream a prefill worker sends to a decode worker ([`kvwire`]), and the
//! engine latency model that benchmarks write and others read
//! ([`latency`]). This crate has no ML dependencies, so the router can use
//! it without the model.

#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod error;
pub mod hash;
pub mod internal;
pub mod kvwire;
pub mod latency;
pub mod openai;
pub mod prefix;
