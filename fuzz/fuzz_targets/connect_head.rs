//! cargo-fuzz target `connect_head`: see [`tether_fuzz::connect_head`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::connect_head(data));
