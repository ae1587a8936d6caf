//! cargo-fuzz target `konnectivity_packet`: see [`tether_fuzz::konnectivity_packet`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::konnectivity_packet(data));
