//! cargo-fuzz target `nats_payload`: see [`tether_fuzz::nats_payload`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::nats_payload(data));
