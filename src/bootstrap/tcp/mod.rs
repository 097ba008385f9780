//! The embedded store and its client, in five parts: [`wire`] (the
//! messages), [`addr`] (listen and advertised addresses), [`stream`] (TCP
//! and abstract Unix sockets behind one type), [`server`] (the store) and
//! [`client`] ([`TcpBootstrap`]).
//!
//! `create_unique_id` starts (once per listen address and process) a small
//! TCP server on background threads and returns an id carrying its address
//! and a fresh secret. Every rank then opens one persistent connection with
//! [`TcpBootstrap::connect`] and runs all-gather rounds through it. The env
//! bootstrap uses the same store: over TCP across hosts ([`join_store`]),
//! or on one host over an abstract Unix socket that admits only this
//! user's processes and serves one group ([`join_unix`]).
//!
//! Each secret is its own namespace (one group): the store runs an
//! `Exchange` per secret, keyed by the clients' sequence numbers, so groups
//! sharing a store never see each other's rounds. The store also remembers
//! which connection holds each rank, so two processes claiming one rank
//! break the group loudly (every participant gets `Mismatch`) rather than
//! mixing their data.
//!
//! What the store holds is bounded: a finished round's data is dropped as
//! soon as every rank has received it; a namespace is dropped once every
//! rank of its group has joined and left (an id serves one group); ids
//! never used are capped, and so are connections still in their handshake,
//! each of which has one deadline for its whole hello (`server::Limits`).
//! A TCP store itself lives until the process exits.

mod addr;
mod client;
mod server;
mod stream;
#[cfg(test)]
mod tests;
pub(crate) mod wire;

pub(crate) use addr::resolve;
pub use client::TcpBootstrap;
use stream::Target;

use super::unique_id::{random_secret, UniqueId, SECRET_BYTES};
use crate::error::{ensure, Result};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
    Ok(UniqueId::new(server.tcp_addr(), secret))
}

/// Hosts a store on exactly `listen` (reusing this process's store there, if
/// any) for the group with `secret`. Used by the env bootstrap on rank 0.
pub fn host_store(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<UniqueId> {
    let server = server::server_for(listen, secret)?;
    Ok(UniqueId::new(server.tcp_addr(), secret))
}

/// Joins the group of `secret` at the TCP store on `addr` as `rank` of
/// `world` (env groups across hosts). The store's host may make the group
/// after this rank arrives: until `timeout` that is waited for.
pub fn join_store(
    addr: SocketAddr,
    secret: [u8; SECRET_BYTES],
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<TcpBootstrap> {
    let hosted = server::hosted_namespace(addr, &secret);
    TcpBootstrap::join(&Target::Tcp(addr), &secret, rank, world, timeout, true, hosted)
}

/// Joins the group of `secret` on the abstract Unix socket `name` (env
/// groups on one host) as `rank` of `world`; rank 0 hosts it (`host`). The
/// socket admits only this user's processes and closes once every rank has
/// joined, or at the timeout; until then the others wait for it to open.
pub fn join_unix(
    name: &[u8],
    secret: [u8; SECRET_BYTES],
    rank: usize,
    world: usize,
    host: bool,
    timeout: Duration,
) -> Result<TcpBootstrap> {
    check_rank(rank, world)?;
    let hosted = if host {
        let now = Instant::now();
        let until = now.checked_add(timeout).unwrap_or(now + Duration::from_millis(MAX_ROUND_TIMEOUT_MS));
        Some(server::host_unix(name, secret, until)?)
    } else {
        None
    };
    TcpBootstrap::join(&Target::Unix(name.to_vec()), &secret, rank, world, timeout, true, hosted)
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
