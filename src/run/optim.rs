//! The optimizer and its schedules: AdamW with its moments saved and restored exactly (a
//! resumed run matches an uninterrupted one, which `tch::nn::Optimizer` cannot promise), the
//! learning rate's warm-up and cosine decay, and the routers' penalty ramp.

use crate::config::TrainConfig;
use crate::io::checkpoint;
use crate::model::kernels::{AdamWStep, Kernels};
use anyhow::{ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// Learning rate after `step` completed steps: linear warm-up to `lr`, then cosine decay to
/// `lr * min_lr_ratio` at the last step.
pub(crate) fn learning_rate(cfg: &TrainConfig, step: usize) -> f64 {
    if step < cfg.warmup_steps {
        return cfg.lr * (step + 1) as f64 / cfg.warmup_steps as f64;
    }
    let span = (cfg.steps - cfg.warmup_steps).max(1) as f64;
    let progress = ((step - cfg.warmup_steps) as f64 / span).min(1.0);
    let min = cfg.lr * cfg.min_lr_ratio;
    min + 0.5 * (cfg.lr - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The share of `attention.lambda` the routers' penalty carries at `step` (0-based): all of it,
/// or under `train.lambda_ramp` none during warmup, then `k / (steps - warmup)` at the k-th step
/// after it, so the last step carries all of it.
pub(crate) fn penalty_scale(cfg: &TrainConfig, step: usize) -> f64 {
    if !cfg.lambda_ramp {
        return 1.0;
    }
    if step < cfg.warmup_steps {
        return 0.0;
    }
    let span = (cfg.steps - cfg.warmup_steps).max(1) as f64;
    ((step + 1 - cfg.warmup_steps) as f64 / span).min(1.0)
}

/// Whether parameter `name` is a router's (`train.router_lr_mult` scales its rate).
pub(crate) fn is_router(name: &str) -> bool {
    name.contains(".router.")
}

/// AdamW (Loshchilov & Hutter) with PyTorch's defaults for bias correction; weight decay
/// only on matrices, as nanoGPT does, since decaying gains and biases hurts small models.
///
/// With a kernel library the step runs fused (`kernels/optim.cu`: one launch for the norm, one
/// for clipping and the update), the same maths as the per-tensor form below.
pub(crate) struct AdamW {
    params: Vec<(String, Tensor)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    pub(crate) step: i64,
    kernels: Option<&'static Kernels>,
    /// Clipping factor the fused path applies inside the next update.
    clip: f64,
}

impl AdamW {
    pub(crate) fn new(
        params: &BTreeMap<String, Tensor>,
        kernels: Option<&'static Kernels>,
    ) -> Self {
        let params: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let zeros = |ps: &Vec<(String, Tensor)>| ps.iter().map(|(_, t)| t.zeros_like()).collect();
        AdamW {
            exp_avg: zeros(&params),
            exp_avg_sq: zeros(&params),
            params,
            step: 0,
            kernels,
            clip: 1.0,
        }
    }

    /// Parameters with a gradient, with their names, gradients and moments, for the fused
    /// step.
    #[allow(clippy::type_complexity)]
    fn with_grads(
        &self,
    ) -> (
        Vec<String>,
        Vec<Tensor>,
        Vec<Tensor>,
        Vec<Tensor>,
        Vec<Tensor>,
    ) {
        let mut out = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (n, p)) in self.params.iter().enumerate() {
            let g = p.grad();
            if g.defined() {
                out.0.push(n.clone());
                out.1.push(p.shallow_clone());
                out.2.push(g);
                out.3.push(self.exp_avg[i].shallow_clone());
                out.4.push(self.exp_avg_sq[i].shallow_clone());
            }
        }
        out
    }

    pub(crate) fn zero_grad(&self) {
        for (_, p) in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// Global gradient norm before clipping; gradients are scaled down to `max_norm` when
    /// it is exceeded (0 disables clipping).
    pub(crate) fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        if let Some(k) = self.kernels {
            let (_, _, grads, _, _) = self.with_grads();
            let total = k
                .grad_norm(&grads)
                .expect("gradient norm kernel on validated tensors");
            self.clip = match max_norm > 0.0 && total > max_norm {
                true => max_norm / (total + 1e-6),
                false => 1.0,
            };
            return total;
        }
        tch::no_grad(|| {
            let grads: Vec<Tensor> = self
                .params
                .iter()
                .map(|(_, p)| p.grad())
                .filter(|g| g.defined())
                .collect();
            let total = grads
                .iter()
                .map(|g| g.to_kind(Kind::Float).square().sum(Kind::Float))
                .fold(
                    Tensor::zeros([], (Kind::Float, grads[0].device())),
                    |a, b| a + b,
                )
                .sqrt()
                .double_value(&[]);
            if max_norm > 0.0 && total > max_norm {
                let scale = max_norm / (total + 1e-6);
                for g in &grads {
                    let _ = g.shallow_clone().g_mul_scalar_(scale);
                }
            }
            total
        })
    }

    /// One step at rate `lr`, the routers' at `lr * t.router_lr_mult`.
    pub(crate) fn update(&mut self, lr: f64, t: &TrainConfig) {
        self.step += 1;
        let bc1 = 1.0 - t.beta1.powi(self.step as i32);
        let bc2 = 1.0 - t.beta2.powi(self.step as i32);
        let rate = |name: &str| match is_router(name) {
            true => lr * t.router_lr_mult,
            false => lr,
        };
        if let Some(k) = self.kernels {
            let (names, p, g, m, v) = self.with_grads();
            let clip = std::mem::replace(&mut self.clip, 1.0);
            // One fused launch per rate: the routers' and everything else's.
            for router in [false, true] {
                let pick = |xs: &Vec<Tensor>| -> Vec<Tensor> {
                    xs.iter()
                        .zip(&names)
                        .filter(|(_, n)| is_router(n) == router)
                        .map(|(x, _)| x.shallow_clone())
                        .collect()
                };
                let group = pick(&p);
                if group.is_empty() {
                    continue;
                }
                let h = AdamWStep {
                    lr: if router { lr * t.router_lr_mult } else { lr },
                    beta1: t.beta1,
                    beta2: t.beta2,
                    eps: t.adam_eps,
                    weight_decay: t.weight_decay,
                    bc1,
                    bc2,
                    clip,
                };
                k.adamw(&group, &pick(&g), &pick(&m), &pick(&v), &h)
                    .expect("adamw kernel on validated tensors");
            }
            return;
        }
        tch::no_grad(|| {
            for (i, (name, p)) in self.params.iter().enumerate() {
                let lr = rate(name);
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let (m, v) = (&mut self.exp_avg[i], &mut self.exp_avg_sq[i]);
                let _ = m.g_mul_scalar_(t.beta1).g_add_(&(&g * (1.0 - t.beta1)));
                let _ = v
                    .g_mul_scalar_(t.beta2)
                    .g_add_(&(g.square() * (1.0 - t.beta2)));
                let mut p = p.shallow_clone();
                if p.dim() >= 2 && t.weight_decay > 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - lr * t.weight_decay);
                }
                let denom = (&*v / bc2).sqrt() + t.adam_eps;
                let _ = p.g_sub_(&(&*m / &denom * (lr / bc1)));
            }
        });
    }

    /// Moments under PyTorch's state names, for the checkpoint.
    pub(crate) fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, (n, _)) in self.params.iter().enumerate() {
            out.push((format!("exp_avg.{n}"), self.exp_avg[i].shallow_clone()));
            out.push((
                format!("exp_avg_sq.{n}"),
                self.exp_avg_sq[i].shallow_clone(),
            ));
        }
        out
    }

    pub(crate) fn load_state(&mut self, path: &Path, step: usize) -> Result<()> {
        let file = checkpoint::read_tensors(path)?;
        tch::no_grad(|| -> Result<()> {
            for (i, (n, p)) in self.params.iter().enumerate() {
                for (prefix, dst) in [
                    ("exp_avg", &mut self.exp_avg[i]),
                    ("exp_avg_sq", &mut self.exp_avg_sq[i]),
                ] {
                    let key = format!("{prefix}.{n}");
                    let src = file
                        .get(&key)
                        .with_context(|| format!("{} lacks {key}", path.display()))?;
                    ensure!(
                        src.size() == p.size(),
                        "{}: {key} has shape {:?}, expected {:?}",
                        path.display(),
                        src.size(),
                        p.size()
                    );
                    dst.copy_(src);
                }
            }
            Ok(())
        })?;
        self.step = step as i64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels;
    use crate::model::kernels::tests;
    use tch::Device;

    /// The ramp: nothing during warmup, then 1/(steps - warmup) more each step, all of it at
    /// the last step; without the ramp always all of it.
    #[test]
    fn the_penalty_ramps_after_warmup() {
        let mut t = TrainConfig {
            steps: 10,
            warmup_steps: 2,
            ..TrainConfig::default()
        };
        assert!((0..10).all(|s| penalty_scale(&t, s) == 1.0));
        t.lambda_ramp = true;
        let got: Vec<f64> = (0..10).map(|s| penalty_scale(&t, s)).collect();
        let want = [0.0, 0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0];
        assert_eq!(got, want);
    }

    #[test]
    fn schedule_warms_up_then_decays_to_floor() {
        let t = TrainConfig {
            steps: 100,
            warmup_steps: 10,
            lr: 1.0,
            min_lr_ratio: 0.1,
            ..Default::default()
        };
        assert!((learning_rate(&t, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&t, 9) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&t, 10) - 1.0).abs() < 1e-12);
        assert!(
            (learning_rate(&t, 55) - 0.55).abs() < 1e-12,
            "midpoint of the cosine"
        );
        assert!((learning_rate(&t, 100) - 0.1).abs() < 1e-12);
        assert!((11..=100).all(|s| learning_rate(&t, s) <= learning_rate(&t, s - 1) + 1e-12));
    }

    /// The fused optimizer step of a kernel library (norm, clipping, AdamW) against the
    /// per-tensor form, over tensors that span several chunks, a vector (no decay), a router
    /// at its own rate and a parameter without gradient, for three clipped steps.
    fn fused_step_matches_per_tensor(kern: &'static Kernels, device: Device) {
        tch::manual_seed(5);
        let shapes: [&[i64]; 4] = [&[300, 257], &[70001], &[3, 4], &[5]];
        // p2 is a router's.
        let name = |i: usize| match i {
            2 => "layers.0.router.p2".to_string(),
            _ => format!("p{i}"),
        };
        // One draw for both paths, and the gradients' multipliers below drawn once a step: the
        // generator is global, and tests running beside this one draw from it too.
        let a: BTreeMap<String, Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = Tensor::randn(*s, (Kind::Float, device)).set_requires_grad(true);
                (name(i), t)
            })
            .collect();
        let b: BTreeMap<String, Tensor> = a
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().copy().set_requires_grad(true)))
            .collect();
        let mut oa = AdamW::new(&a, None);
        let mut ob = AdamW::new(&b, Some(kern));
        let t = TrainConfig {
            weight_decay: 0.1,
            router_lr_mult: 30.0,
            ..Default::default()
        };
        for _ in 0..3 {
            let noise: Vec<Tensor> = (0..3).map(|i| a[&name(i)].randn_like()).collect();
            for (params, opt) in [(&a, &mut oa), (&b, &mut ob)] {
                opt.zero_grad();
                // p3 gets no gradient.
                let loss = (0..3)
                    .map(|i| (&params[&name(i)] * &noise[i]).sum(Kind::Float))
                    .fold(Tensor::zeros([], (Kind::Float, device)), |x, y| x + y);
                loss.backward();
                let norm = opt.clip_grad_norm(100.0);
                assert!(norm > 100.0, "the test must clip (norm {norm})");
                opt.update(1e-2, &t);
            }
            let (na, nb) = (oa.clip_grad_norm(0.0), ob.clip_grad_norm(0.0));
            assert!((na - nb).abs() <= 1e-5 * na, "norms {na} and {nb}");
        }
        let rel = |x: &Tensor, y: &Tensor| {
            (x - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-12)
        };
        for (n, pa) in &a {
            let e = rel(&b[n], pa);
            assert!(e < 1e-6, "{n}: fused step differs by {e:.2e}");
        }
        for (x, y) in ob.exp_avg_sq.iter().zip(&oa.exp_avg_sq) {
            assert!(rel(x, y) < 1e-5);
        }
    }

    #[test]
    fn fused_optimizer_matches_per_tensor_path_cpu() {
        let kern = kernels::cpu().expect("the CPU kernel library builds");
        fused_step_matches_per_tensor(kern, Device::Cpu);
    }

    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn cuda_fused_optimizer_matches_per_tensor_path() {
        tests::on_cuda("cuda_fused_optimizer_matches_per_tensor_path", |k| {
            fused_step_matches_per_tensor(k, Device::Cuda(0))
        });
    }

    #[test]
    fn adamw_matches_hand_computation() {
        let init = || {
            Tensor::from_slice(&[1.0f64, -2.0])
                .view([1, 2])
                .set_requires_grad(true)
        };
        let (w, r) = (init(), init());
        let params: BTreeMap<String, Tensor> = [
            ("w".to_string(), w.shallow_clone()),
            ("layers.0.router.weight".to_string(), r.shallow_clone()),
        ]
        .into();
        let mut opt = AdamW::new(&params, None);
        let t = TrainConfig {
            beta1: 0.9,
            beta2: 0.99,
            adam_eps: 1e-8,
            weight_decay: 0.5,
            router_lr_mult: 3.0,
            ..Default::default()
        };
        let g = [0.5f64, -1.0];
        for step in 1..=2 {
            opt.zero_grad();
            let gt = Tensor::from_slice(&g).view([1, 2]);
            ((&w * &gt).sum(Kind::Double) + (&r * &gt).sum(Kind::Double)).backward();
            opt.update(0.1, &t);
            assert_eq!(opt.step, step);
        }
        // Constant gradient: m_hat = g and v_hat = g^2 after bias correction, so each step
        // moves by lr * sign(g) (up to eps) after decaying by (1 - lr * wd); the router at
        // three times the rate.
        for (p, lr) in [(&w, 0.1), (&r, 0.3)] {
            let mut want = [1.0f64, -2.0];
            for _ in 0..2 {
                for (x, gi) in want.iter_mut().zip(g) {
                    *x = *x * (1.0 - lr * 0.5) - lr * gi / (gi.abs() + 1e-8);
                }
            }
            for (i, wv) in want.iter().enumerate() {
                assert!((p.double_value(&[0, i as i64]) - wv).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let w = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        let params: BTreeMap<String, Tensor> = [("w".to_string(), w.shallow_clone())].into();
        let mut opt = AdamW::new(&params, None);
        (&w * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        assert!((opt.clip_grad_norm(1.0) - 5.0).abs() < 1e-5);
        let g = w.grad();
        assert!(
            (g.double_value(&[0]) - 0.6).abs() < 1e-5 && (g.double_value(&[1]) - 0.8).abs() < 1e-5
        );
    }
}
