//! Types that cross process boundaries in pdserve: the internal RPC between
//! router and workers with its error classes ([`internal`]), and the KV-cache
//! stream a prefill worker sends to a decode worker ([`kvwire`]). This crate
//! has no ML dependencies, so the router can use it without the model.

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
pub mod openai;
pub mod prefix;
