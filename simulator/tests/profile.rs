//! The built-in hardware profiles through TOML. The calibrated profile `lzrun calibrate` writes
//! is checked with the runs it predicts, in the workspace's cross-crate tests
//! (`tests/tests/predict.rs`, package `lazarus-tests`).

use lazarus_simulator::cost;

#[test]
fn a_built_in_profile_keeps_its_costs() {
    // The optional host terms are absent from the built-ins, and serialising them adds none.
    let hw = cost::hardware("rtx3090-100g").unwrap();
    assert!(hw.host_cores.is_none() && hw.replan_s.is_none());
    let text = toml::to_string(&hw).unwrap();
    assert!(
        !text.contains("host_cores") && !text.contains("job_start_s"),
        "{text}"
    );
}
