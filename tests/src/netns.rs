//! Network namespace plumbing for the tests and tools that put hub, proxy and edges in their
//! own namespaces (`tests/tests/addon_netns.rs`, `registration::Topology`, `tether-demo`): run
//! `ip`, add namespaces with loopback up, join two namespaces with a veth pair addressed in a
//! /24, add a route, turn forwarding off (a proxy namespace that does not route). Removing the
//! namespaces is the caller's (its topology's `Drop`).

use std::process::Command;

use anyhow::bail;

/// Runs `ip args…`; an error with its stderr if it fails.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let o = Command::new("ip").args(args).output()?;
    if !o.status.success() {
        bail!("ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

/// Adds each namespace and sets its loopback up.
pub fn add<S: AsRef<str>>(namespaces: &[S]) -> anyhow::Result<()> {
    for ns in namespaces {
        let ns = ns.as_ref();
        ip(&["netns", "add", ns])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
    }
    Ok(())
}

/// One end of a veth pair: namespace, interface name, IPv4 address (in a /24).
pub type End<'a> = (&'a str, &'a str, &'a str);

/// A veth pair between `a` and `b`, created in `a`'s namespace, each end addressed and up.
pub fn veth(a: End<'_>, b: End<'_>) -> anyhow::Result<()> {
    let ((a_ns, a_if, _), (b_ns, b_if, _)) = (a, b);
    ip(&[
        "-n", a_ns, "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b_ns,
    ])?;
    for (ns, dev, addr) in [a, b] {
        ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
    }
    for (ns, dev, _) in [a, b] {
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    Ok(())
}

/// A route in `ns` to `subnet` via `gateway`.
pub fn route(ns: &str, subnet: &str, gateway: &str) -> anyhow::Result<()> {
    ip(&["-n", ns, "route", "add", subnet, "via", gateway])
}

/// Turns IPv4 forwarding off in `ns`: what reaches it is not routed on.
pub fn no_forwarding(ns: &str) -> anyhow::Result<()> {
    ip(&[
        "netns",
        "exec",
        ns,
        "sysctl",
        "-qw",
        "net.ipv4.ip_forward=0",
    ])
}
