//! The embedded TCP store and its client, in four parts: [`wire`] (the
//! messages), [`addr`] (listen and advertised addresses), [`server`] (the
//! store) and [`client`] ([`TcpBootstrap`]).
//!
//! `create_unique_id` starts (once per listen address and process) a small
//! server on background threads and returns an id carrying its address and
//! a fresh secret. Every rank then opens one persistent connection with
//! [`TcpBootstrap::connect`] and runs all-gather rounds through it.
//!
//! Each secret is its own namespace (one group): the store runs an
//! `Exchange` per secret, keyed by the clients' sequence numbers, so groups
//! sharing a store never see each other's rounds. The store also remembers
//! which connection holds each rank, so two processes claiming one rank
//! break the group loudly (every participant gets `Mismatch`) rather than
//! mixing their data.
//!
//! The store lives until the process exits; a finished round's data is
//! dropped as soon as every rank has received it.

mod addr;
mod client;
mod server;
#[cfg(test)]
mod tests;
pub(crate) mod wire;

pub(crate) use addr::resolve;
pub use client::TcpBootstrap;

use super::unique_id::{random_secret, UniqueId, SECRET_BYTES};
use crate::error::{ensure, Result};
use std::net::SocketAddr;

/// Largest world size the store accepts (a sanity bound, not a design limit).
const MAX_WORLD: usize = 1 << 16;
/// Round timeouts are clamped to this so deadline arithmetic cannot overflow.
const MAX_ROUND_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;

/// Starts (or reuses) this process's store on the listen address and returns
/// a new group id with a fresh secret.
///
/// The address comes from `listen`, else `$SYMM_BOOTSTRAP_ADDR`, else
/// `127.0.0.1:0`. Accepted forms: `ip:port`, `[ipv6]:port`, `host:port`,
/// `ip`, `host` (a missing port means an ephemeral one). When the address is
/// unspecified (`0.0.0.0`, `::`) the id carries a routable address of this
/// host instead, so peers on other hosts can dial it.
pub fn create_unique_id(listen: Option<&str>) -> Result<UniqueId> {
    let addr = addr::listen_addr(listen)?;
    let secret = random_secret()?;
    let server = server::server_for(addr, secret)?;
    Ok(UniqueId::new(server.advertised, secret))
}

/// Hosts a store on exactly `listen` (reusing this process's store there, if
/// any) for the group with `secret`. Used by the env bootstrap on rank 0.
pub fn host_store(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<UniqueId> {
    let server = server::server_for(listen, secret)?;
    Ok(UniqueId::new(server.advertised, secret))
}

/// Validates a rank and world size (the client's own, and what a client
/// tells the store).
fn check_rank(rank: usize, world: usize) -> Result<()> {
    ensure!(
        (1..=MAX_WORLD).contains(&world),
        InvalidArgument,
        "bootstrap: world size {world} is out of range (1..={MAX_WORLD})"
    );
    ensure!(rank < world, InvalidArgument, "bootstrap: rank {rank} is out of range for world size {world}");
    Ok(())
}
