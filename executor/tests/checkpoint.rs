//! Checkpoints: encoding round trips, who writes which part, atomic commit, and every way
//! `load_latest` must reject a damaged checkpoint and fall back to an older one.

use candle_core::Device;
use lazarus_executor::checkpoint::{
    self, CheckpointError, FORMAT_VERSION, Loaded, MANIFEST, Manifest, POINTER, PartInfo,
    all_parts, commit, decode_dense, decode_expert, dense_part, encode_dense, encode_expert,
    expert_part, load_latest, parts_of, staging_dir, step_dir_name, write_part, writer_of,
};
use lazarus_executor::model::{
    ExpertState, ExpertStore, MoeConfig, OptimState, ParamState, Precision,
};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

const LAYERS: usize = 2;
const EXPERTS: usize = 3;

fn cfg() -> MoeConfig {
    MoeConfig {
        vocab: 256,
        d_model: 4,
        n_layers: LAYERS,
        n_heads: 2,
        d_ff: 6,
        experts: EXPERTS,
        top_k: 2,
        seq_len: 8,
        batch: 2,
        lb_loss_coef: 0.01,
        lr: 3e-3,
        adam_beta2: 0.999,
        grad_clip_norm: 0.0,
        seed: 7,
        precision: Precision::Auto,
        hf: None,
    }
}

/// A fresh, empty directory for one test.
fn temp_root(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("checkpoint-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root).expect("create temp root");
    root
}

/// Deterministic values that differ per `(seed, i)`, including -0.0 and a subnormal so the
/// round trip must be bit-exact, not just approximately equal.
fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match i {
            0 => -0.0,
            1 => f32::from_bits(1),
            _ => ((seed as f32) * 0.37 + i as f32 * 0.011).sin(),
        })
        .collect()
}

fn dense_state(step: u64) -> OptimState {
    let param = |name: &str, shape: Vec<usize>, k: u64| {
        let n = shape.iter().product();
        ParamState {
            name: name.into(),
            shape,
            value: values(step * 100 + k, n),
            m: values(step * 100 + k + 1, n),
            v: values(step * 100 + k + 2, n),
        }
    };
    OptimState {
        step,
        params: vec![
            param("wte", vec![16, 4], 0),
            param("h.0.attn.w", vec![4, 4], 10),
        ],
    }
}

fn expert_state(cfg: &MoeConfig, step: u64, layer: usize, expert: usize) -> ExpertState {
    let n = cfg.d_model * cfg.d_ff;
    let k = step * 1000 + layer as u64 * 10 + expert as u64 * 100;
    ExpertState {
        layer,
        expert,
        d_model: cfg.d_model,
        d_ff: cfg.d_ff,
        w1: values(k, n),
        w2: values(k + 1, n),
        m1: values(k + 2, n),
        v1: values(k + 3, n),
        m2: values(k + 4, n),
        v2: values(k + 5, n),
        step: step / 2 + expert as u64,
    }
}

/// Expert e of every layer on ranks e % world and (e + 1) % world.
fn plan(world: usize) -> Vec<Vec<Vec<u32>>> {
    (0..LAYERS)
        .map(|_| {
            (0..EXPERTS)
                .map(|e| {
                    let mut row = vec![0; world];
                    row[e % world] += 1;
                    row[(e + 1) % world] += 1;
                    row
                })
                .collect()
        })
        .collect()
}

/// The encoded contents of every part of the checkpoint at `step`.
fn payloads(cfg: &MoeConfig, step: u64) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    out.insert(dense_part().to_owned(), encode_dense(&dense_state(step)));
    for l in 0..cfg.n_layers {
        for e in 0..cfg.experts {
            out.insert(
                expert_part(l, e),
                encode_expert(&expert_state(cfg, step, l, e)),
            );
        }
    }
    out
}

/// Every rank writes its parts (as the workers would), except those in `skip`; returns the
/// reported infos.
fn write_parts(root: &Path, cfg: &MoeConfig, step: u64, skip: &[String]) -> Vec<PartInfo> {
    let world = 2;
    let replicas = plan(world);
    let data = payloads(cfg, step);
    let mut infos = Vec::new();
    for rank in 0..world {
        for name in parts_of(&replicas, rank) {
            if skip.contains(&name) {
                continue;
            }
            infos.push(write_part(root, step, &name, &data[&name]).expect("write part"));
        }
    }
    infos
}

fn manifest(cfg: &MoeConfig, step: u64, parts: Vec<PartInfo>) -> Manifest {
    Manifest::new(step, 2, 5, cfg.clone(), parts)
}

/// A complete, committed checkpoint of `step`.
fn save(root: &Path, cfg: &MoeConfig, step: u64, keep: usize) -> PathBuf {
    let infos = write_parts(root, cfg, step, &[]);
    commit(
        root,
        manifest(cfg, step, infos),
        &all_parts(cfg.n_layers, cfg.experts),
        keep,
    )
    .expect("commit")
}

fn load(root: &Path) -> Loaded {
    load_latest(root, &cfg()).expect("a valid checkpoint")
}

fn step_dirs(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root)
        .expect("list root")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    names
}

fn flip_byte(path: &Path, at: usize) {
    let mut b = fs::read(path).expect("read part");
    b[at] ^= 0x40;
    fs::write(path, b).expect("write part");
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

fn assert_dense_eq(a: &OptimState, b: &OptimState) {
    assert_eq!(a.step, b.step);
    assert_eq!(a.params.len(), b.params.len());
    for (x, y) in a.params.iter().zip(&b.params) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        assert_eq!(bits(&x.value), bits(&y.value));
        assert_eq!(bits(&x.m), bits(&y.m));
        assert_eq!(bits(&x.v), bits(&y.v));
    }
}

#[test]
fn names() {
    assert_eq!(step_dir_name(12), "step-00000012");
    assert_eq!(step_dir_name(123_456_789), "step-123456789");
    assert_eq!(checkpoint::parse_step_dir_name("step-00000012"), Some(12));
    assert_eq!(checkpoint::parse_step_dir_name("step-012"), None);
    assert_eq!(checkpoint::parse_step_dir_name("step-000000012"), None);
    assert_eq!(
        staging_dir(Path::new("/r"), 12),
        Path::new("/r/.staging-step-00000012")
    );
    assert_eq!(dense_part(), "dense.bin");
    assert_eq!(expert_part(3, 12), "expert-l003-e0012.bin");
    assert_eq!(
        all_parts(1, 2),
        [
            "dense.bin",
            "expert-l000-e0000.bin",
            "expert-l000-e0001.bin"
        ]
    );
}

#[test]
fn round_trip_dense_and_experts() {
    let root = temp_root("round-trip");
    let cfg = cfg();
    let dir = save(&root, &cfg, 12, 3);
    assert_eq!(dir, root.join("step-00000012"));
    assert_eq!(
        fs::read_to_string(root.join(POINTER)).expect("pointer"),
        "step-00000012\n"
    );
    assert!(!staging_dir(&root, 12).exists());

    let loaded = load(&root);
    assert_eq!(loaded.dir, dir);
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    let m = &loaded.manifest;
    assert_eq!(
        (m.format_version, m.step, m.world, m.plan_version),
        (FORMAT_VERSION, 12, 2, 5)
    );
    assert_eq!(m.config, cfg);
    let names: Vec<&str> = m.parts.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, all_parts(LAYERS, EXPERTS));

    assert_dense_eq(&loaded.dense().expect("dense"), &dense_state(12));
    for l in 0..LAYERS {
        for e in 0..EXPERTS {
            let want = expert_state(&cfg, 12, l, e);
            let got = loaded.expert(l, e).expect("expert");
            assert_eq!(got.checksum(), want.checksum());
            assert_eq!(bits(&got.w1), bits(&want.w1));
            assert_eq!(bits(&got.v2), bits(&want.v2));
            assert_eq!(got, want);
        }
    }
    let err = loaded.expert(LAYERS, 0).expect_err("no such expert");
    assert!(
        err.to_string()
            .contains("expert-l002-e0000.bin is not listed"),
        "{err}"
    );
}

/// A real replica exported from an `ExpertStore` survives encode → decode → import.
#[test]
fn real_expert_store_round_trip() -> candle_core::Result<()> {
    let cfg = cfg();
    let store = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(1, 2)])?;
    let state = store.export(1, 2)?;
    let decoded = decode_expert(&encode_expert(&state)).expect("decode");
    assert_eq!(decoded.checksum(), state.checksum());
    let mut other = ExpertStore::empty(&cfg, &Device::Cpu);
    other.import(&decoded)?;
    assert_eq!(other.checksum(1, 2), store.checksum(1, 2));
    Ok(())
}

#[test]
fn decode_rejects_garbage_and_trailing_bytes() {
    let dense = encode_dense(&dense_state(3));
    assert_dense_eq(&decode_dense(&dense).expect("decode"), &dense_state(3));
    let err = decode_dense(&dense[..dense.len() / 2]).expect_err("truncated");
    assert!(
        err.to_string().starts_with("cannot decode dense state"),
        "{err}"
    );

    let mut expert = encode_expert(&expert_state(&cfg(), 3, 0, 1));
    expert.push(0);
    let err = decode_expert(&expert).expect_err("trailing byte");
    assert!(err.to_string().contains("1 bytes left"), "{err}");

    let mut bad = expert_state(&cfg(), 3, 0, 1);
    bad.m2.pop();
    let err = decode_expert(&encode_expert(&bad)).expect_err("short m2");
    assert!(err.to_string().contains("m2 has 23 values"), "{err}");
}

#[test]
fn writer_of_prefers_lowest_rank_and_handles_gaps() {
    let replicas = vec![vec![vec![0, 2, 1], vec![0, 0, 0], vec![1, 0, 1]]];
    assert_eq!(writer_of(&replicas, 0, 0), Some(1));
    assert_eq!(writer_of(&replicas, 0, 1), None);
    assert_eq!(writer_of(&replicas, 0, 2), Some(0));
    assert_eq!(writer_of(&replicas, 1, 0), None);
    assert_eq!(writer_of(&replicas, 0, 3), None);
    assert_eq!(
        parts_of(&replicas, 0),
        ["dense.bin", "expert-l000-e0002.bin"]
    );
    assert_eq!(parts_of(&replicas, 1), ["expert-l000-e0000.bin"]);
    assert!(parts_of(&replicas, 2).is_empty());
}

proptest! {
    /// With every expert held somewhere, the ranks' parts are exactly all parts, each once.
    #[test]
    fn parts_of_covers_every_part_exactly_once(
        world in 1usize..6,
        layers in 1usize..4,
        experts in 1usize..6,
        seed in any::<u64>(),
    ) {
        let mut x = seed | 1;
        let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
        let replicas: Vec<Vec<Vec<u32>>> = (0..layers)
            .map(|_| (0..experts).map(|_| {
                let mut row: Vec<u32> = (0..world).map(|_| (next() % 3) as u32).collect();
                let r = (next() % world as u64) as usize;
                row[r] = row[r].max(1);
                row
            }).collect())
            .collect();
        let mut got: Vec<String> = (0..world).flat_map(|r| parts_of(&replicas, r)).collect();
        got.sort();
        prop_assert_eq!(got, all_parts(layers, experts));
        for l in 0..layers {
            for e in 0..experts {
                let w = writer_of(&replicas, l, e).expect("held somewhere");
                prop_assert!(replicas[l][e][w] > 0);
                prop_assert!(replicas[l][e][..w].iter().all(|&n| n == 0));
            }
        }
    }
}

#[test]
fn commit_without_a_part_fails_and_previous_checkpoint_still_loads() {
    let root = temp_root("missing-part");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    let expected = all_parts(LAYERS, EXPERTS);

    // The writer of expert (1, 2) never reported.
    let lost = expert_part(1, 2);
    let infos = write_parts(&root, &cfg, 20, std::slice::from_ref(&lost));
    let err = commit(&root, manifest(&cfg, 20, infos), &expected, 3).expect_err("incomplete");
    assert!(matches!(
        err,
        CheckpointError::ExpectedPartMissing { step: 20, .. }
    ));
    assert!(
        err.to_string()
            .contains("expected part expert-l001-e0002.bin is not in the manifest"),
        "{err}"
    );

    // Reported, but the file is gone (and another one was rewritten behind our back).
    let infos = write_parts(&root, &cfg, 20, &[]);
    fs::remove_file(staging_dir(&root, 20).join(&lost)).expect("remove part");
    let err =
        commit(&root, manifest(&cfg, 20, infos.clone()), &expected, 3).expect_err("file missing");
    assert!(
        err.to_string().contains("part expert-l001-e0002.bin in ")
            && err.to_string().ends_with(": missing"),
        "{err}"
    );
    write_part(&root, 20, &lost, &payloads(&cfg, 20)[&lost]).expect("rewrite");
    write_part(&root, 20, dense_part(), b"not what rank 0 reported").expect("overwrite");
    let err = commit(&root, manifest(&cfg, 20, infos), &expected, 3).expect_err("changed");
    assert!(err.to_string().contains("part dense.bin in "), "{err}");

    assert!(!root.join(step_dir_name(20)).exists());
    assert_eq!(
        fs::read_to_string(root.join(POINTER)).expect("pointer"),
        "step-00000010\n"
    );
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 10);
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
}

/// Commits 10 and 20, damages 20 with `damage`, and checks that loading falls back to 10 with
/// one rejection of 20 whose reason contains every one of `reason`.
fn falls_back(name: &str, damage: impl FnOnce(&Path), reason: &[&str]) {
    let root = temp_root(name);
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    let newest = save(&root, &cfg, 20, 3);
    damage(&newest);
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 10);
    assert_eq!(loaded.dir, root.join("step-00000010"));
    assert_eq!(loaded.rejected.len(), 1, "{:?}", loaded.rejected);
    let (path, why) = &loaded.rejected[0];
    assert_eq!(path, &newest);
    for r in reason {
        assert!(why.contains(r), "{why:?} lacks {r:?}");
    }
    assert_dense_eq(&loaded.dense().expect("dense"), &dense_state(10));
}

/// Commits 10, then 20 with the payload of part `bad` replaced by `payload` (its size and
/// checksum in the manifest are right), and loads.
fn load_with_part(name: &str, bad: &str, payload: Vec<u8>) -> (Loaded, PathBuf) {
    let root = temp_root(name);
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    let mut data = payloads(&cfg, 20);
    data.insert(bad.to_owned(), payload);
    let replicas = plan(2);
    let mut infos = Vec::new();
    for rank in 0..2 {
        for name in parts_of(&replicas, rank) {
            infos.push(write_part(&root, 20, &name, &data[&name]).expect("write part"));
        }
    }
    let all = all_parts(cfg.n_layers, cfg.experts);
    let newest = commit(&root, manifest(&cfg, 20, infos), &all, 3).expect("commit");
    (load(&root), newest)
}

/// Issue 33 item 6.5: a checkpoint holding a NaN with valid checksums was restored, and the job
/// then failed blaming the learning rate. Loading decodes every part and refuses a non-finite
/// value, naming the part and the tensor, so it falls back to an older checkpoint like any
/// other rejected one.
#[test]
fn a_non_finite_value_with_valid_checksums_is_refused_naming_the_tensor() {
    let cfg = cfg();
    let mut expert = expert_state(&cfg, 20, 1, 2);
    expert.w2[5] = f32::NAN;
    let (loaded, newest) = load_with_part("nan-expert", &expert_part(1, 2), encode_expert(&expert));
    assert_eq!(loaded.manifest.step, 10, "{:?}", loaded.rejected);
    assert_eq!(loaded.rejected.len(), 1, "{:?}", loaded.rejected);
    let (path, why) = &loaded.rejected[0];
    assert_eq!(path, &newest);
    for want in [
        "expert-l001-e0002.bin",
        "expert 2 of layer 1",
        "w2[5] is NaN",
        "non-finite",
    ] {
        assert!(why.contains(want), "{why:?} lacks {want:?}");
    }
    let mut dense = dense_state(20);
    dense.params[1].v[3] = f32::INFINITY;
    let (loaded, _) = load_with_part("inf-dense", dense_part(), encode_dense(&dense));
    assert_eq!(loaded.manifest.step, 10, "{:?}", loaded.rejected);
    let (_, why) = &loaded.rejected[0];
    for want in ["dense.bin", "h.0.attn.w.v[3] is inf"] {
        assert!(why.contains(want), "{why:?} lacks {want:?}");
    }
    assert_dense_eq(&loaded.dense().expect("dense"), &dense_state(10));
}

#[test]
fn flipped_byte_falls_back_to_older() {
    falls_back(
        "flipped",
        |dir| flip_byte(&dir.join(expert_part(1, 2)), 17),
        &["part expert-l001-e0002.bin", "checksum mismatch"],
    );
}

#[test]
fn truncated_part_falls_back_to_older() {
    falls_back(
        "truncated",
        |dir| {
            let path = dir.join(dense_part());
            let b = fs::read(&path).expect("read");
            fs::write(&path, &b[..b.len() - 3]).expect("truncate");
        },
        &[
            "part dense.bin",
            "bytes on disk, manifest says",
            "truncated",
        ],
    );
}

#[test]
fn deleted_part_falls_back_to_older() {
    falls_back(
        "deleted-part",
        |dir| fs::remove_file(dir.join(expert_part(0, 0))).expect("remove"),
        &["part expert-l000-e0000.bin", "missing"],
    );
}

#[test]
fn deleted_manifest_falls_back_to_older() {
    falls_back(
        "no-manifest",
        |dir| fs::remove_file(dir.join(MANIFEST)).expect("remove"),
        &["manifest.json missing"],
    );
}

#[test]
fn garbage_manifest_falls_back_to_older() {
    falls_back(
        "bad-manifest",
        |dir| fs::write(dir.join(MANIFEST), b"{\"format_version\": 1, ").expect("write"),
        &["manifest.json unparseable"],
    );
}

#[test]
fn pointer_to_missing_dir_falls_back_to_newest_valid() {
    let root = temp_root("pointer-missing");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    save(&root, &cfg, 20, 3);
    fs::write(root.join(POINTER), "step-00000099\n").expect("pointer");
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 20);
    assert_eq!(loaded.rejected.len(), 1);
    assert_eq!(loaded.rejected[0].0, root.join("step-00000099"));
    assert!(
        loaded.rejected[0].1.contains("named by latest but missing"),
        "{:?}",
        loaded.rejected
    );
}

#[test]
fn garbage_pointer_falls_back_to_newest_valid() {
    let root = temp_root("pointer-garbage");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    save(&root, &cfg, 20, 3);
    fs::write(root.join(POINTER), b"../../etc\xff").expect("pointer");
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 20);
    assert_eq!(loaded.rejected.len(), 1);
    assert_eq!(loaded.rejected[0].0, root.join(POINTER));
    assert!(
        loaded.rejected[0]
            .1
            .contains("does not name a checkpoint directory"),
        "{:?}",
        loaded.rejected
    );
}

#[test]
fn leftover_staging_dirs_are_ignored_and_cleaned() {
    let root = temp_root("staging");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    // A crash while writing step 20: some parts, no manifest, never committed.
    write_parts(&root, &cfg, 20, &[expert_part(0, 1)]);
    // Even with a manifest inside, a staging dir is not a checkpoint.
    fs::copy(
        root.join("step-00000010").join(MANIFEST),
        staging_dir(&root, 20).join(MANIFEST),
    )
    .expect("copy manifest");
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 10);
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);

    // Workers already writing step 40 while step 30 commits.
    write_part(&root, 40, dense_part(), b"in flight").expect("write");
    save(&root, &cfg, 30, 3);
    assert!(!staging_dir(&root, 20).exists(), "stale staging removed");
    assert!(staging_dir(&root, 40).exists(), "newer staging kept");
    assert_eq!(load(&root).manifest.step, 30);
}

#[test]
fn prune_keeps_exactly_keep() {
    let root = temp_root("prune");
    let cfg = cfg();
    for step in 1..=6 {
        save(&root, &cfg, step, 3);
        let n = step_dirs(&root).len();
        assert_eq!(n, (step as usize).min(3));
    }
    assert_eq!(
        step_dirs(&root),
        ["step-00000004", "step-00000005", "step-00000006"]
    );
    save(&root, &cfg, 7, 1);
    assert_eq!(step_dirs(&root), ["step-00000007"]);
    assert_eq!(load(&root).manifest.step, 7);
    let leftovers: Vec<_> = fs::read_dir(&root)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let err = commit(&root, manifest(&cfg, 8, Vec::new()), &[], 0).expect_err("keep 0");
    assert!(err.to_string().contains("keep must be at least 1"), "{err}");
}

#[test]
fn config_mismatch_is_rejected() {
    let root = temp_root("config");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    let other = MoeConfig {
        d_model: 8,
        ..cfg.clone()
    };
    let infos = write_parts(&root, &other, 20, &[]);
    commit(
        &root,
        manifest(&other, 20, infos),
        &all_parts(LAYERS, EXPERTS),
        3,
    )
    .expect("commit");

    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 10);
    assert_eq!(loaded.rejected.len(), 1);
    assert!(
        loaded.rejected[0]
            .1
            .starts_with("config differs: d_model: checkpoint 8, requested 4"),
        "{:?}",
        loaded.rejected
    );

    let third = MoeConfig { lr: 0.1, ..cfg };
    let err = load_latest(&root, &third).expect_err("nothing matches");
    let CheckpointError::NoCheckpoint { rejected, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(rejected.len(), 2);
    assert!(
        rejected
            .iter()
            .all(|(_, why)| why.contains("lr: checkpoint"))
    );
}

/// The precision is arithmetic, not state: a checkpoint written by an f32 run loads for a bf16
/// run (and a bf16 one's for f32), while any other difference still rejects it.
#[test]
fn another_precision_resumes_the_same_checkpoint() {
    let root = temp_root("precision");
    let cfg = MoeConfig {
        precision: Precision::F32,
        ..cfg()
    };
    save(&root, &cfg, 10, 3);
    for precision in [Precision::Bf16, Precision::Auto, Precision::F32] {
        let loaded = load_latest(
            &root,
            &MoeConfig {
                precision,
                ..cfg.clone()
            },
        )
        .expect("loads");
        assert_eq!(loaded.manifest.step, 10, "{precision}");
        assert_eq!(loaded.manifest.config.precision, Precision::F32);
    }
    let err = load_latest(
        &root,
        &MoeConfig {
            precision: Precision::Bf16,
            lr: 0.1,
            ..cfg
        },
    )
    .expect_err("lr differs");
    let CheckpointError::NoCheckpoint { rejected, .. } = &err else {
        panic!("{err}")
    };
    assert!(rejected[0].1.contains("lr: checkpoint"), "{rejected:?}");
    assert!(!rejected[0].1.contains("precision"), "{rejected:?}");
}

#[test]
fn no_checkpoint_is_an_error_naming_the_root() {
    let root = temp_root("empty");
    let err = load_latest(&root, &cfg()).expect_err("empty root");
    assert!(matches!(err, CheckpointError::NoCheckpoint { .. }));
    assert!(
        err.to_string()
            .contains(&format!("no valid checkpoint under {}", root.display())),
        "{err}"
    );
    let missing = root.join("does-not-exist");
    let err = load_latest(&missing, &cfg()).expect_err("missing root");
    assert!(err.to_string().contains(&missing.display().to_string()));

    // A lone staging dir and a broken pointer do not make a checkpoint either.
    write_part(&root, 5, dense_part(), b"x").expect("write");
    fs::write(root.join(POINTER), "step-00000005\n").expect("pointer");
    let err = load_latest(&root, &cfg()).expect_err("only staging");
    assert!(
        err.to_string().contains("named by latest but missing"),
        "{err}"
    );
}

#[test]
fn retried_commit_is_idempotent_and_a_different_one_is_refused() {
    let root = temp_root("retry");
    let cfg = cfg();
    let infos = write_parts(&root, &cfg, 10, &[]);
    let expected = all_parts(LAYERS, EXPERTS);
    let m = manifest(&cfg, 10, infos);
    let dir = commit(&root, m.clone(), &expected, 3).expect("commit");
    // The coordinator retries after losing the reply.
    assert_eq!(commit(&root, m.clone(), &expected, 3).expect("retry"), dir);

    let changed = Manifest {
        plan_version: 6,
        ..m.clone()
    };
    let err = commit(&root, changed, &expected, 3).expect_err("different manifest");
    assert!(matches!(err, CheckpointError::AlreadyCommitted { .. }));
    assert!(err.to_string().contains("step-00000010"), "{err}");
    assert_eq!(load(&root).manifest, m);
}

/// A crash between the directory rename and the pointer update leaves a complete step-20 that
/// `latest` does not name; the run restores 10, retrains, and must be able to commit 20 again.
#[test]
fn orphan_of_a_crash_before_the_pointer_update_is_replaced() {
    let root = temp_root("orphan");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    save(&root, &cfg, 20, 3);
    fs::write(root.join(POINTER), "step-00000010\n").expect("simulate crash");
    assert_eq!(load(&root).manifest.step, 10);

    let infos = write_parts(&root, &cfg, 20, &[]);
    let retrained = Manifest::new(20, 3, 9, cfg.clone(), infos);
    commit(&root, retrained.clone(), &all_parts(LAYERS, EXPERTS), 3).expect("replace orphan");
    assert_eq!(load(&root).manifest, retrained);
}

/// After restoring 10 because 20 was damaged, committing 12 discards the abandoned 20.
#[test]
fn commit_after_fallback_discards_the_abandoned_newer_checkpoint() {
    let root = temp_root("abandoned");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    let newest = save(&root, &cfg, 20, 3);
    flip_byte(&newest.join(dense_part()), 3);
    assert_eq!(load(&root).manifest.step, 10);
    save(&root, &cfg, 12, 3);
    assert_eq!(step_dirs(&root), ["step-00000010", "step-00000012"]);
    let loaded = load(&root);
    assert_eq!(loaded.manifest.step, 12);
    assert!(loaded.rejected.is_empty());
}

#[test]
fn loaded_read_verifies_again() {
    let root = temp_root("reread");
    let cfg = cfg();
    let dir = save(&root, &cfg, 10, 3);
    let loaded = load(&root);
    flip_byte(&dir.join(expert_part(0, 1)), 0);
    let err = loaded.expert(0, 1).expect_err("changed after load");
    assert!(
        err.to_string().contains("part expert-l000-e0001.bin in")
            && err.to_string().contains("checksum mismatch"),
        "{err}"
    );
    assert!(loaded.expert(0, 0).is_ok());
}

#[test]
fn bad_part_names_are_refused() {
    let root = temp_root("names");
    for name in ["", "../x", "a/b", ".hidden", MANIFEST] {
        let err = write_part(&root, 1, name, b"x").expect_err(name);
        assert!(err.to_string().contains("invalid part name"), "{err}");
    }
}

/// Issue 14: after a fallback from a damaged checkpoint of step 20 (the one `latest` names),
/// the run trains step 20 again and could never checkpoint it: the commit refused to replace
/// the damaged directory, whatever the new manifest.
#[test]
fn a_damaged_checkpoint_of_a_step_does_not_block_committing_that_step_again() {
    let cfg = cfg();
    let expected = all_parts(LAYERS, EXPERTS);
    for retrained in [false, true] {
        let root = temp_root(&format!("damaged-again-{retrained}"));
        save(&root, &cfg, 10, 3);
        let damaged = save(&root, &cfg, 20, 3);
        flip_byte(&damaged.join(dense_part()), 3);
        assert_eq!(load(&root).manifest.step, 10, "falls back");
        let infos = write_parts(&root, &cfg, 20, &[]);
        // The same bytes again (a deterministic replay), or another history's.
        let m = if retrained {
            Manifest::new(20, 3, 9, cfg.clone(), infos)
        } else {
            manifest(&cfg, 20, infos)
        };
        commit(&root, m.clone(), &expected, 3).expect("replaces the damaged checkpoint");
        let loaded = load(&root);
        assert_eq!(loaded.manifest, m);
        assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    }
}

/// Issue 14: pruning counted a damaged checkpoint as one of the `keep` and deleted a valid
/// older one in its place.
#[test]
fn prune_counts_only_checkpoints_that_verify() {
    let root = temp_root("prune-valid");
    let cfg = cfg();
    save(&root, &cfg, 10, 2);
    let damaged = save(&root, &cfg, 20, 2);
    flip_byte(&damaged.join(expert_part(1, 2)), 5);
    save(&root, &cfg, 30, 2);
    // 20 is left where it is (among the kept), but 10 stays too: two valid ones.
    assert_eq!(
        step_dirs(&root),
        ["step-00000010", "step-00000020", "step-00000030"]
    );
    save(&root, &cfg, 40, 2);
    assert_eq!(step_dirs(&root), ["step-00000030", "step-00000040"]);

    // A damaged current checkpoint is kept (`latest` names it) and not counted either.
    let current = root.join(step_dir_name(40));
    flip_byte(&current.join(dense_part()), 1);
    // Something that is not a directory under a staging name (a failed write) goes too.
    fs::write(staging_dir(&root, 35), b"not a directory").expect("write");
    let removed = checkpoint::prune(&root, 1).expect("prune");
    assert!(removed.contains(&staging_dir(&root, 35)), "{removed:?}");
    assert_eq!(step_dirs(&root), ["step-00000030", "step-00000040"]);
    assert_eq!(load(&root).manifest.step, 30);
}

#[test]
fn remove_staging_keeps_committed_checkpoints() {
    let root = temp_root("remove-staging");
    let cfg = cfg();
    save(&root, &cfg, 10, 3);
    write_parts(&root, &cfg, 20, &[expert_part(0, 0)]);
    fs::write(staging_dir(&root, 30), b"x").expect("write");
    let removed = checkpoint::remove_staging(&root).expect("remove");
    assert_eq!(removed.len(), 2, "{removed:?}");
    let names: Vec<String> = fs::read_dir(&root)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(names.is_empty(), "{names:?}");
    assert_eq!(load(&root).manifest.step, 10);
}

/// Issue 14: two jobs on one checkpoint directory pruned and overwrote each other's
/// checkpoints. The lock is exclusive, names its holder, and goes with its owner.
#[test]
fn a_checkpoint_root_is_locked_by_one_job_at_a_time() {
    let root = temp_root("lock");
    let lock = checkpoint::lock_root(&root, "job A, pid 1").expect("first lock");
    assert_eq!(lock.path(), root.join(checkpoint::LOCK_FILE));
    let err = checkpoint::lock_root(&root, "job B").expect_err("taken");
    assert!(matches!(err, CheckpointError::Locked { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("in use by another job (job A, pid 1)"),
        "{err}"
    );
    drop(lock);
    let again = checkpoint::lock_root(&root, "job B").expect("free again");
    drop(again);
    // The lock file is no checkpoint and in nobody's way.
    save(&root, &cfg(), 10, 3);
    assert_eq!(load(&root).manifest.step, 10);

    let missing = root.join("no-such-dir");
    let err = checkpoint::lock_root(&missing, "x").expect_err("no directory");
    assert!(err.to_string().contains("create lock file"), "{err}");
}

/// Issue 14: a diverged run committed a checkpoint full of NaN as `latest`.
#[test]
fn non_finite_states_are_refused() {
    let cfg = cfg();
    let mut dense = dense_state(3);
    checkpoint::check_dense_finite(&dense).expect("finite");
    dense.params[1].v[2] = f32::NAN;
    let err = checkpoint::check_dense_finite(&dense).expect_err("NaN");
    assert!(err.to_string().contains("h.0.attn.w.v[2] is NaN"), "{err}");
    let mut expert = expert_state(&cfg, 3, 1, 2);
    checkpoint::check_expert_finite(&expert).expect("finite");
    expert.w2[0] = f32::NEG_INFINITY;
    let err = checkpoint::check_expert_finite(&expert).expect_err("inf");
    assert!(
        err.to_string()
            .contains("expert 2 of layer 1: w2[0] is -inf"),
        "{err}"
    );
}
