//! cargo-fuzz target `proxy_credentials`: see [`tether_fuzz::proxy_credentials`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::proxy_credentials(data));
