//! cargo-fuzz target `dial_frame`: see [`tether_fuzz::dial_frame`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::dial_frame(data));
