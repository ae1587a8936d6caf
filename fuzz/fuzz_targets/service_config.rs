//! cargo-fuzz target `service_config`: see [`tether_fuzz::service_config`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::service_config(data));
