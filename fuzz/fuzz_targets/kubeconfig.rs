//! cargo-fuzz target `kubeconfig`: see [`tether_fuzz::kubeconfig`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::kubeconfig(data));
