//! The MoE model of the executor: gradients reach the router, routing bookkeeping, replica
//! export/import, forced routing, determinism, and that training learns.
//!
//! Candle is slow in debug builds, so these models are tiny (a few dozen tokens per step).

use candle_core::{Device, Result, Tensor};
use lazarus_executor::model::{
    Corpus, DenseModel, ExpertExec, ExpertStore, LocalExperts, MoeConfig, Precision, RoutingStats,
    Trainer,
};
use proptest::prelude::*;

/// A model small enough for debug builds: 4×16 tokens per step.
fn small(top_k: usize) -> MoeConfig {
    MoeConfig {
        vocab: 256,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        d_ff: 64,
        experts: 4,
        top_k,
        seq_len: 16,
        batch: 4,
        lb_loss_coef: 0.01,
        lr: 1e-2,
        adam_beta2: 0.999,
        grad_clip_norm: 0.0,
        seed: 7,
        precision: Precision::Auto,
        hf: None,
    }
}

fn batch(cfg: &MoeConfig, step: u64) -> Result<Tensor> {
    Corpus::embedded().batch(cfg.seed, step, 0, cfg.batch, cfg.seq_len + 1, &Device::Cpu)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn grad_norm(grads: &candle_core::backprop::GradStore, t: &Tensor) -> Result<f32> {
    match grads.get(t) {
        Some(g) => g.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>(),
        None => Ok(0.0),
    }
}

/// Guards the `softmax_last_dim` / fused layer-norm traps: with the balancing loss off, the
/// router learns only through the gates, for top-1 and top-2; gradients also reach the
/// position embedding (through every layer norm) and the experts.
#[test]
fn router_gets_gradient_through_gates() -> Result<()> {
    for k in [1, 2] {
        let cfg = MoeConfig {
            lb_loss_coef: 0.0,
            ..small(k)
        };
        let model = DenseModel::new(&cfg, &Device::Cpu)?;
        let experts = ExpertStore::all(&cfg, &Device::Cpu)?;
        let mut stats = RoutingStats::default();
        let loss = model.loss(&batch(&cfg, 0)?, &mut LocalExperts(&experts), &mut stats)?;
        let grads = loss.backward()?;
        for l in 0..cfg.n_layers {
            let router = model.var(&format!("h.{l}.router.weight")).unwrap();
            let g = grad_norm(&grads, router.as_tensor())?;
            assert!(
                g > 1e-7 && g.is_finite(),
                "top-{k} layer {l}: |grad router| = {g}"
            );
            for name in [
                format!("h.{l}.attn.qkv.weight"),
                format!("h.{l}.ln1.weight"),
            ] {
                let g = grad_norm(&grads, model.var(&name).unwrap().as_tensor())?;
                assert!(g > 0.0, "top-{k}: no gradient for {name}");
            }
        }
        let g = grad_norm(&grads, model.var("wpe").unwrap().as_tensor())?;
        assert!(g > 0.0, "top-{k}: no gradient for wpe");
        for (l, e) in experts.replicas() {
            if stats.counts[l][e] == 0 {
                continue;
            }
            let (w1, w2) = experts.vars(l, e).unwrap();
            assert!(
                grad_norm(&grads, w1.as_tensor())? > 0.0,
                "expert ({l},{e}) w1"
            );
            assert!(
                grad_norm(&grads, w2.as_tensor())? > 0.0,
                "expert ({l},{e}) w2"
            );
        }
    }
    Ok(())
}

/// The balancing loss alone also trains the router.
#[test]
fn balancing_loss_reaches_router() -> Result<()> {
    let cfg = small(2);
    let model = DenseModel::new(&cfg, &Device::Cpu)?;
    let experts = ExpertStore::all(&cfg, &Device::Cpu)?;
    let mut stats = RoutingStats::default();
    let ce_only = MoeConfig {
        lb_loss_coef: 0.0,
        ..cfg.clone()
    };
    let plain = DenseModel::new(&ce_only, &Device::Cpu)?;
    let tokens = batch(&cfg, 0)?;
    let with_lb = model.loss(&tokens, &mut LocalExperts(&experts), &mut stats)?;
    let without = plain.loss(&tokens, &mut LocalExperts(&experts), &mut stats)?;
    let diff = (with_lb - without)?.to_scalar::<f32>()?;
    let lb_mean = stats.lb_loss.iter().sum::<f32>() / stats.lb_loss.len() as f32;
    assert!((diff - 0.01 * lb_mean).abs() < 1e-5, "{diff} vs {lb_mean}");
    assert!(
        stats.lb_loss.iter().all(|x| (0.5..4.0).contains(x)),
        "{:?}",
        stats.lb_loss
    );
    Ok(())
}

#[test]
fn top1_and_top2_run_and_count_tokens_times_k() -> Result<()> {
    for k in [1, 2] {
        let cfg = small(k);
        let model = DenseModel::new(&cfg, &Device::Cpu)?;
        let experts = ExpertStore::all(&cfg, &Device::Cpu)?;
        let mut stats = RoutingStats::default();
        let loss = model.loss(&batch(&cfg, 3)?, &mut LocalExperts(&experts), &mut stats)?;
        let loss = loss.to_scalar::<f32>()?;
        // Initial loss of a near-uniform byte model is about ln 256 = 5.55.
        assert!((loss - 256f32.ln()).abs() < 0.5, "top-{k}: loss {loss}");
        let tokens = (cfg.batch * cfg.seq_len) as u64;
        assert_eq!(stats.counts.len(), cfg.n_layers);
        for l in 0..cfg.n_layers {
            assert_eq!(stats.counts[l].len(), cfg.experts);
            assert_eq!(stats.routed(l), tokens * k as u64, "top-{k} layer {l}");
            assert_eq!(stats.choices[l].len(), tokens as usize * k);
            for row in stats.choices[l].chunks(k) {
                assert!(k == 1 || row[0] != row[1], "top-2 picked one expert twice");
            }
        }
        let logits = model.logits(
            &batch(&cfg, 3)?.narrow(1, 0, cfg.seq_len)?,
            &mut LocalExperts(&experts),
            &mut stats,
        )?;
        assert_eq!(logits.dims(), &[cfg.batch, cfg.seq_len, cfg.vocab]);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Counts sum to tokens × k for any shape, and match the recorded choices.
    #[test]
    fn counts_match_choices(b in 1usize..4, s in 1usize..6, experts in 2usize..6, k in 1usize..3, seed in 0u64..1000) {
        let cfg = MoeConfig { vocab: 256, d_model: 8, n_layers: 2, n_heads: 2, d_ff: 8, experts, top_k: k, seq_len: s, batch: b, lb_loss_coef: 0.01, lr: 1e-3, adam_beta2: 0.999, grad_clip_norm: 0.0, seed, precision: Precision::Auto, hf: None };
        let model = DenseModel::new(&cfg, &Device::Cpu).unwrap();
        let store = ExpertStore::all(&cfg, &Device::Cpu).unwrap();
        let mut stats = RoutingStats::default();
        let tokens = batch(&cfg, seed).unwrap();
        let loss = model.loss(&tokens, &mut LocalExperts(&store), &mut stats).unwrap();
        prop_assert!(loss.to_scalar::<f32>().unwrap().is_finite());
        for l in 0..cfg.n_layers {
            prop_assert_eq!(stats.routed(l), (b * s * k) as u64);
            let mut hist = vec![0u64; experts];
            for &e in &stats.choices[l] { hist[e as usize] += 1; }
            prop_assert_eq!(&hist, &stats.counts[l]);
        }
    }
}

/// Forced routing fixes the loads exactly; the gates still come from the router.
#[test]
fn forced_routing_sets_counts() -> Result<()> {
    for k in [1, 2] {
        let cfg = small(k);
        let n = cfg.batch * cfg.seq_len;
        let mut model = DenseModel::new(&cfg, &Device::Cpu)?;
        let experts = ExpertStore::all(&cfg, &Device::Cpu)?;
        // Layer 0: token t → t mod 3 (expert 3 idle), then (t+1) mod 4 when k = 2;
        // layer 1: everything to expert 2 (and 0).
        let l0: Vec<u32> = (0..n)
            .flat_map(|t| {
                let a = (t % 3) as u32;
                let b = (a + 1) % 4;
                [a, b].into_iter().take(k)
            })
            .collect();
        let l1: Vec<u32> = (0..n).flat_map(|_| [2u32, 0].into_iter().take(k)).collect();
        model.set_forced_routing(Some(vec![l0.clone(), l1.clone()]));
        let mut stats = RoutingStats::default();
        let loss = model.loss(&batch(&cfg, 1)?, &mut LocalExperts(&experts), &mut stats)?;
        let hist = |c: &[u32]| {
            let mut h = vec![0u64; cfg.experts];
            c.iter().for_each(|&e| h[e as usize] += 1);
            h
        };
        assert_eq!(stats.counts, vec![hist(&l0), hist(&l1)]);
        assert_eq!(stats.choices, vec![l0, l1]);
        // Gates still depend on the router: gradient reaches it.
        let grads = loss.backward()?;
        let router = model.var("h.1.router.weight").unwrap();
        assert!(grad_norm(&grads, router.as_tensor())? > 0.0, "top-{k}");
        // Wrong shapes are refused.
        model.set_forced_routing(Some(vec![vec![0; n * k]]));
        assert!(
            model
                .loss(&batch(&cfg, 1)?, &mut LocalExperts(&experts), &mut stats)
                .is_err()
        );
        model.set_forced_routing(Some(vec![vec![9; n * k], vec![0; n * k]]));
        assert!(
            model
                .loss(&batch(&cfg, 1)?, &mut LocalExperts(&experts), &mut stats)
                .is_err()
        );
    }
    Ok(())
}

/// Replaying the recorded choices reproduces the free-running step bit for bit.
#[test]
fn replaying_recorded_routing_is_bit_exact() -> Result<()> {
    let cfg = small(2);
    let mut model = DenseModel::new(&cfg, &Device::Cpu)?;
    let experts = ExpertStore::all(&cfg, &Device::Cpu)?;
    let tokens = batch(&cfg, 5)?;
    let mut free = RoutingStats::default();
    let a = model.loss(&tokens, &mut LocalExperts(&experts), &mut free)?;
    model.set_forced_routing(Some(free.choices.clone()));
    let mut replay = RoutingStats::default();
    let b = model.loss(&tokens, &mut LocalExperts(&experts), &mut replay)?;
    assert_eq!(bits(&a)?, bits(&b)?);
    assert_eq!(free, replay);
    model.set_forced_routing(None);
    assert!(model.forced_routing().is_none());
    Ok(())
}

/// Train one store a little (non-zero moments), move every replica into an empty store, and
/// check the copy computes the same logits bit for bit and hashes the same.
#[test]
fn export_import_round_trip_is_bit_exact() -> Result<()> {
    let cfg = small(2);
    let mut t = Trainer::with_corpus(&cfg, Corpus::embedded(), &Device::Cpu)?;
    for _ in 0..2 {
        t.step()?;
    }
    let mut copy = ExpertStore::empty(&cfg, &Device::Cpu);
    for (l, e) in t.experts.replicas() {
        let st = t.experts.export(l, e)?;
        assert!(
            st.step > 0 && st.m1.iter().any(|&m| m != 0.0),
            "({l},{e}) untrained"
        );
        copy.import(&st)?;
        assert_eq!(copy.export(l, e)?, st);
        assert_eq!(copy.checksum(l, e), t.experts.checksum(l, e));
        assert_eq!(copy.checksum(l, e), Some(st.checksum()));
        assert_eq!(copy.weights_checksum(l, e), Some(st.weights_checksum()));
    }
    let tokens = batch(&cfg, 9)?.narrow(1, 0, cfg.seq_len)?;
    let mut s1 = RoutingStats::default();
    let mut s2 = RoutingStats::default();
    let a = t
        .model
        .logits(&tokens, &mut LocalExperts(&t.experts), &mut s1)?;
    let b = t.model.logits(&tokens, &mut LocalExperts(&copy), &mut s2)?;
    assert_eq!(bits(&a)?, bits(&b)?);
    assert_eq!(s1, s2);

    // Import over an existing (freshly initialised) replica overwrites it in place.
    let mut fresh = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(1, 3)])?;
    let w = fresh.weights(1, 3).unwrap();
    assert_ne!(fresh.checksum(1, 3), t.experts.checksum(1, 3));
    fresh.import(&t.experts.export(1, 3)?)?;
    assert_eq!(fresh.checksum(1, 3), t.experts.checksum(1, 3));
    assert_eq!(
        bits(&w.w1)?,
        t.experts
            .export(1, 3)?
            .w1
            .iter()
            .map(|f| f.to_bits())
            .collect::<Vec<_>>()
    );

    // A wrongly shaped state is refused.
    let mut bad = t.experts.export(0, 0)?;
    bad.w2.pop();
    assert!(copy.import(&bad).is_err());
    assert!(copy.export(5, 0).is_err());
    assert_eq!(copy.checksum(5, 0), None);
    Ok(())
}

/// Two workers holding the same replica stay bit-identical when they apply the same gradients,
/// and the checksum notices a replica that missed an update.
#[test]
fn replicas_with_equal_gradients_stay_identical() -> Result<()> {
    let cfg = small(1);
    let mut a = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 1), (1, 2)])?;
    let mut b = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 1)])?;
    assert_eq!(a.checksum(0, 1), b.checksum(0, 1), "same seed, same init");
    let x = Tensor::arange(0f32, (3 * cfg.d_model) as f32, &Device::Cpu)?
        .reshape((3, cfg.d_model))?
        .affine(1e-2, -0.4)?;
    for step in 0..3 {
        let y = LocalExperts(&a).run(0, 1, &x)?;
        let grads = y.sqr()?.sum_all()?.backward()?;
        let (w1, w2) = a.vars(0, 1).unwrap();
        let (g1, g2) = (
            grads.get(w1.as_tensor()).unwrap().clone(),
            grads.get(w2.as_tensor()).unwrap().clone(),
        );
        a.step_replica(0, 1, &g1, &g2)?;
        if step < 2 {
            b.step_replica(0, 1, &g1, &g2)?;
            assert_eq!(a.checksum(0, 1), b.checksum(0, 1), "step {step}");
        }
    }
    assert_ne!(a.checksum(0, 1), b.checksum(0, 1), "b missed one update");
    assert!(
        LocalExperts(&b).run(1, 2, &x).is_err(),
        "b does not hold (1,2)"
    );
    assert!(b.step_replica(1, 2, &x, &x).is_err());
    Ok(())
}

/// Experts split over two "workers" behind one ExpertExec give the same loss and gradients as
/// a single local store: the seam the distributed runtime plugs into.
#[test]
fn experts_on_two_workers_match_local() -> Result<()> {
    struct TwoWorkers<'a>(&'a ExpertStore, &'a ExpertStore);
    impl ExpertExec for TwoWorkers<'_> {
        fn run(&mut self, layer: usize, expert: usize, x: &Tensor) -> Result<Tensor> {
            let store = if self.0.contains(layer, expert) {
                self.0
            } else {
                self.1
            };
            LocalExperts(store).run(layer, expert, x)
        }
    }
    let cfg = small(2);
    let model = DenseModel::new(&cfg, &Device::Cpu)?;
    let all = ExpertStore::all(&cfg, &Device::Cpu)?;
    let w0 = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 0), (0, 1), (1, 0), (1, 1)])?;
    let w1 = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 2), (0, 3), (1, 2), (1, 3)])?;
    let tokens = batch(&cfg, 2)?;
    let mut s = RoutingStats::default();
    let a = model.loss(&tokens, &mut LocalExperts(&all), &mut s)?;
    let b = model.loss(&tokens, &mut TwoWorkers(&w0, &w1), &mut s)?;
    assert_eq!(bits(&a)?, bits(&b)?);
    let (ga, gb) = (a.backward()?, b.backward()?);
    let router = model.var("h.0.router.weight").unwrap().as_tensor();
    assert_eq!(
        bits(ga.get(router).unwrap())?,
        bits(gb.get(router).unwrap())?
    );
    let (x1, _) = all.vars(1, 2).unwrap();
    let (y1, _) = w1.vars(1, 2).unwrap();
    if s.counts[1][2] > 0 {
        assert_eq!(
            bits(ga.get(x1.as_tensor()).unwrap())?,
            bits(gb.get(y1.as_tensor()).unwrap())?
        );
    }
    Ok(())
}

fn mean(xs: &[f32]) -> f32 {
    xs.iter().sum::<f32>() / xs.len() as f32
}

/// Thirty steps of the small model on the embedded corpus lower the loss clearly.
#[test]
fn training_lowers_the_loss() -> Result<()> {
    let cfg = small(2);
    let mut t = Trainer::new(&cfg)?;
    let losses: Vec<f32> = (0..30)
        .map(|_| t.step().map(|r| r.ce_loss))
        .collect::<Result<_>>()?;
    let (first, last) = (mean(&losses[..3]), mean(&losses[27..]));
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(
        last < first - 1.0,
        "first {first:.3} last {last:.3}: {losses:?}"
    );
    assert_eq!(t.step_count(), 30);
    assert_eq!(t.dense_optimizer().step_count(), 30);
    // Every replica that received tokens advanced; none advanced more than the trainer.
    for (l, e) in t.experts.replicas() {
        let st = t.experts.export(l, e)?;
        assert!(st.step > 0 && st.step <= 30, "({l},{e}) step {}", st.step);
    }
    Ok(())
}

/// Same seed ⇒ the same loss sequence bit for bit; another seed ⇒ another one.
#[test]
fn same_seed_same_losses() -> Result<()> {
    let run = |seed: u64| -> Result<Vec<u32>> {
        let mut t = Trainer::new(&MoeConfig { seed, ..small(2) })?;
        (0..4).map(|_| t.step().map(|r| r.loss.to_bits())).collect()
    };
    let a = run(11)?;
    assert_eq!(a, run(11)?);
    assert_ne!(a, run(12)?);
    Ok(())
}

/// Mixed precision: bf16 products with f32 master weights and moments track the f32 run (the
/// same data, 20 steps) within bf16's rounding, yet are not the f32 run (the path is taken),
/// and every trainable variable and exported moment stays f32.
#[test]
fn bf16_products_track_f32_with_f32_masters() -> Result<()> {
    let run = |precision: Precision| -> Result<(Vec<f32>, Trainer)> {
        let mut t = Trainer::new(&MoeConfig {
            precision,
            ..small(2)
        })?;
        let losses = (0..20)
            .map(|_| t.step().map(|r| r.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, t))
    };
    let (f32_losses, _) = run(Precision::F32)?;
    // `auto` is f32 on the CPU: the same bits.
    assert_eq!(run(Precision::Auto)?.0, f32_losses);
    let (bf16_losses, t) = run(Precision::Bf16)?;
    assert_ne!(bf16_losses, f32_losses, "bf16 computed exactly like f32");
    for (i, (a, b)) in bf16_losses.iter().zip(&f32_losses).enumerate() {
        // bf16 keeps 8 significant bits (relative rounding 2^-9 per product); over 20 steps of
        // training the trajectories drift apart slowly (0.4 % at most here), never by a
        // loss-sized amount.
        assert!(
            ((a - b) / b).abs() < 0.01,
            "step {i}: bf16 loss {a} vs f32 {b}"
        );
    }
    assert!(bf16_losses[19] < bf16_losses[0] - 0.3, "{bf16_losses:?}");
    for (name, v) in t.model.named_vars() {
        assert_eq!(v.dtype(), candle_core::DType::F32, "{name}");
    }
    for (l, e) in t.experts.replicas() {
        let (w1, w2) = t.experts.vars(l, e).expect("held");
        assert_eq!(
            (w1.dtype(), w2.dtype()),
            (candle_core::DType::F32, candle_core::DType::F32)
        );
    }
    Ok(())
}

/// Dense state (weights, moments, step) moves to a fresh trainer, which then continues
/// exactly like the original.
#[test]
fn dense_and_expert_state_resume_exactly() -> Result<()> {
    let cfg = small(1);
    let mut a = Trainer::new(&cfg)?;
    a.step()?;
    a.step()?;
    let mut b = Trainer::new(&MoeConfig {
        seed: 99,
        ..cfg.clone()
    })?;
    b.import_dense(&a.export_dense()?)?;
    for (l, e) in a.experts.replicas() {
        b.experts.import(&a.experts.export(l, e)?)?;
    }
    // b draws data with its own seed; compare on a's batches explicitly.
    let tokens = a.batch(2)?;
    let mut s = RoutingStats::default();
    let la = a
        .model
        .loss(&tokens, &mut LocalExperts(&a.experts), &mut s)?;
    let lb = b
        .model
        .loss(&tokens, &mut LocalExperts(&b.experts), &mut s)?;
    assert_eq!(bits(&la)?, bits(&lb)?);
    assert_eq!(a.export_dense()?, b.export_dense()?);
    Ok(())
}

#[test]
fn presets_validate() {
    for (cfg, d, e) in [
        (MoeConfig::gpt_s(), 768, 8),
        (MoeConfig::gpt_m(), 1024, 12),
        (MoeConfig::gpt_l(), 1024, 16),
    ] {
        assert_eq!(cfg.validate(), Ok(()));
        assert_eq!((cfg.d_model, cfg.experts, cfg.top_k), (d, e, 1));
        assert_eq!(
            (cfg.n_layers, cfg.seq_len, cfg.batch, cfg.vocab),
            (12, 1024, 4, 50257)
        );
        assert_eq!(cfg.d_ff, 4 * d);
    }
    let tiny = MoeConfig::tiny();
    assert_eq!(tiny.validate(), Ok(()));
    assert_eq!((tiny.vocab, tiny.top_k), (256, 2));
    // GPT-S: one expert replica's f32 state (weights + 2 moments) is about 57 MB.
    assert_eq!(MoeConfig::gpt_s().expert_state_bytes(), 12 * 2 * 768 * 3072);
    let bad = MoeConfig {
        n_heads: 5,
        ..MoeConfig::tiny()
    };
    assert!(bad.validate().is_err());
    assert!(DenseModel::new(&bad, &Device::Cpu).is_err());
    assert!(
        MoeConfig {
            top_k: 5,
            ..MoeConfig::tiny()
        }
        .validate()
        .is_err()
    );
    assert!(
        MoeConfig {
            batch: 0,
            ..MoeConfig::tiny()
        }
        .validate()
        .is_err()
    );
}

/// The recipe fields: validated, and a config written before they existed (a TOML file or a
/// checkpoint manifest) reads as the old recipe (β2 0.999, no clipping).
#[test]
fn recipe_fields_are_validated_and_default_to_the_old_recipe() {
    let tiny = MoeConfig::tiny();
    assert_eq!(
        (tiny.lr, tiny.adam_beta2, tiny.grad_clip_norm),
        (1e-3, 0.999, 1.0)
    );
    assert_eq!(tiny.adam_params().beta2, 0.999);
    for bad in [
        MoeConfig {
            adam_beta2: 1.0,
            ..MoeConfig::tiny()
        },
        MoeConfig {
            adam_beta2: f64::NAN,
            ..MoeConfig::tiny()
        },
        MoeConfig {
            grad_clip_norm: -1.0,
            ..MoeConfig::tiny()
        },
        MoeConfig {
            grad_clip_norm: f64::INFINITY,
            ..MoeConfig::tiny()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    let mut json = serde_json::to_value(MoeConfig::tiny()).unwrap();
    let obj = json.as_object_mut().unwrap();
    obj.remove("adam_beta2");
    obj.remove("grad_clip_norm");
    let old: MoeConfig = serde_json::from_value(json).unwrap();
    assert_eq!((old.adam_beta2, old.grad_clip_norm), (0.999, 0.0));
}

/// The dense parameter count formula matches the model's variables.
#[test]
fn dense_param_count_matches_vars() -> Result<()> {
    let cfg = small(2);
    let model = DenseModel::new(&cfg, &Device::Cpu)?;
    let n: usize = model.named_vars().iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(n, cfg.dense_params());
    assert_eq!(model.varmap().all_vars().len(), model.named_vars().len());
    let store = ExpertStore::with_replicas(&cfg, &Device::Cpu, [(0, 0)])?;
    let (w1, w2) = store.vars(0, 0).unwrap();
    assert_eq!(w1.elem_count() + w2.elem_count(), cfg.expert_params());
    assert!(ExpertStore::with_replicas(&cfg, &Device::Cpu, [(2, 0)]).is_err());
    Ok(())
}

/// Release timing of `MoeConfig::tiny()`:
/// `cargo test --release -p lazarus-executor --test model -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run in release"]
fn tiny_config_seconds_per_step() -> Result<()> {
    let cfg = MoeConfig::tiny();
    let mut t = Trainer::new(&cfg)?;
    let steps = 60;
    let mut losses = Vec::new();
    let start = std::time::Instant::now();
    for _ in 0..steps {
        losses.push(t.step()?.ce_loss);
    }
    let secs = start.elapsed().as_secs_f64() / f64::from(steps);
    let (first, last) = (mean(&losses[..5]), mean(&losses[steps as usize - 5..]));
    println!(
        "tiny(): {secs:.4} s/step over {steps} steps ({} tokens/step); ce {first:.3} -> {last:.3}",
        cfg.batch * cfg.seq_len
    );
    assert!(last < first - 1.0, "first {first:.3} last {last:.3}");
    Ok(())
}
