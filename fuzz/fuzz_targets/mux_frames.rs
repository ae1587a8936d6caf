//! cargo-fuzz target `mux_frames`: see [`tether_fuzz::mux_frames`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::mux_frames(data));
