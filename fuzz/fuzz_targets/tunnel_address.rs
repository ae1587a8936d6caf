//! cargo-fuzz target `tunnel_address`: see [`tether_fuzz::tunnel_address`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::tunnel_address(data));
