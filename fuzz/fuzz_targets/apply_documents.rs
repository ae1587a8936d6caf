//! cargo-fuzz target `apply_documents`: see [`tether_fuzz::apply_documents`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::apply_documents(data));
