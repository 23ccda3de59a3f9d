// The autograd layer between Rust and the kernels: a torch::autograd::Function whose forward
// and backward call the CUDA kernels for CUDA tensors and a reference written with ATen ops
// for CPU tensors (the same maths, so CI exercises this layer without a GPU), exposed as an
// extern "C" function on at::Tensor* that Rust loads at run time.
//
// Semantics (see attention.cu): query r of (b, h) sits at position qpos[b, h, r] (or r) and
// attends keys k <= pos with pos - k < window (any window for rows r < nfull[b, h], where a
// routed list gives nfull); rows r >= nq[b, h] are inactive and give zeros. Inside this file
// the dense form carries empty qpos, nq and nfull tensors (autograd functions take no
// undefined tensors).

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "guard.h"
#include "walk.cuh"

#ifdef ATTNSWEEP_CUDA
#include "attention.cuh"
#include "decode.cuh"
#include "loss.cuh"
#include "norm.cuh"
#include "optim.cuh"
#include "rope.cuh"
#include "router.cuh"
#include "swiglu.cuh"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#else
namespace attnsweep {
struct AdamWStep {
    float lr, beta1, beta2, eps, weight_decay, bc1, bc2, clip;
};
}  // namespace attnsweep
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Says once per process, on standard error as the binary's own warnings are, that a kernel
// cannot serve a shape and the ATen form runs it instead (same result, slower).
void warn_once(const std::string& why) {
    static std::mutex lock;
    static std::set<std::string> said;
    const std::lock_guard<std::mutex> guard(lock);
    if (said.insert(why).second) std::fprintf(stderr, "warning: %s; it runs on ATen instead\n", why.c_str());
}

// The query list of a call in the reference's terms: positions [B, H, Lq] (int64), and
// masks [B, H, Lq] of the active rows and of the full-prefix rows.
struct Rows {
    at::Tensor pos, active, full;
};
Rows rows_of(const at::Tensor& q, const at::Tensor& qpos, const at::Tensor& nq, const at::Tensor& nfull) {
    const auto B = q.size(0), H = q.size(1), Lq = q.size(2);
    auto rows = at::arange(Lq, q.options().dtype(at::kLong)).view({1, 1, Lq}).expand({B, H, Lq});
    auto none = at::zeros({B, H, Lq}, q.options().dtype(at::kBool));
    if (qpos.numel() == 0) return {rows, none.logical_not(), none};
    auto full = nfull.numel() > 0 ? rows < nfull.to(at::kLong).unsqueeze(-1) : none;
    return {qpos.to(at::kLong), rows < nq.to(at::kLong).unsqueeze(-1), full};
}

// Visibility [B, H, Lq, L] of every (query, key) pair: the window (or the whole prefix, for
// full-prefix rows), plus the distances listed in offsets (PPA; empty otherwise) and the
// sequence's first `sinks` keys (attention sinks; 0 otherwise).
at::Tensor visibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qpos, const at::Tensor& nq,
                      const at::Tensor& nfull, int64_t window, const at::Tensor& offsets, int64_t sinks) {
    auto r = rows_of(q, qpos, nq, nfull);
    auto keys = at::arange(k.size(2), q.options().dtype(at::kLong)).view({1, 1, 1, -1});
    auto p = r.pos.unsqueeze(-1);
    auto seen = ((p - keys) < window) | r.full.unsqueeze(-1) | (keys < sinks);
    if (offsets.numel() > 0) seen = seen | at::isin(p - keys, offsets.to(at::kLong));
    return (keys <= p) & seen & r.active.unsqueeze(-1);
}

at::Tensor expand_kv(const at::Tensor& t, int64_t heads) {
    return t.repeat_interleave(heads / t.size(1), 1);
}

// Reference forward in fp32: returns (out, lse), zeros and -inf for inactive rows.
std::pair<at::Tensor, at::Tensor> reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& qpos, const at::Tensor& nq, const at::Tensor& nfull,
                                                    int64_t window, const at::Tensor& offsets, int64_t sinks) {
    const double scale = 1.0 / std::sqrt((double)q.size(3));
    auto kf = expand_kv(k, q.size(1)).to(at::kFloat), vf = expand_kv(v, q.size(1)).to(at::kFloat);
    auto s = at::matmul(q.to(at::kFloat), kf.transpose(-1, -2)) * scale;
    auto vis = visibility(q, k, qpos, nq, nfull, window, offsets, sinks);
    s = s.masked_fill(vis.logical_not(), -INFINITY);
    auto lse = at::logsumexp(s, -1);
    auto p = at::exp(s - lse.unsqueeze(-1)).nan_to_num(0.0);
    return {at::matmul(p, vf), lse};
}

// Reference backward: the same formulas as the kernels (dS = P (dP - delta)).
variable_list reference_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qpos,
                                 const at::Tensor& nq, const at::Tensor& nfull, int64_t window, const at::Tensor& offsets,
                                 int64_t sinks, const at::Tensor& lse, const at::Tensor& delta,
                                 const at::Tensor& dout) {
    const double scale = 1.0 / std::sqrt((double)q.size(3));
    const auto heads = q.size(1), group = heads / k.size(1);
    auto qf = q.to(at::kFloat), dof = dout.to(at::kFloat);
    auto kf = expand_kv(k, heads).to(at::kFloat), vf = expand_kv(v, heads).to(at::kFloat);
    auto vis = visibility(q, k, qpos, nq, nfull, window, offsets, sinks);
    auto s = at::matmul(qf, kf.transpose(-1, -2)) * scale;
    auto p = at::exp(s - lse.unsqueeze(-1)).masked_fill(vis.logical_not(), 0.0).nan_to_num(0.0);
    auto dp = at::matmul(dof, vf.transpose(-1, -2));
    auto ds = p * (dp - delta.unsqueeze(-1));
    auto dq = at::matmul(ds, kf) * scale;
    auto dk = at::matmul(ds.transpose(-1, -2), qf) * scale;
    auto dv = at::matmul(p.transpose(-1, -2), dof);
    // Sum the query heads of each KV head's group.
    auto fold = [&](const at::Tensor& t) {
        return t.view({t.size(0), k.size(1), group, t.size(2), t.size(3)}).sum(2);
    };
    return {dq.to(q.scalar_type()), fold(dk).to(k.scalar_type()), fold(dv).to(v.scalar_type())};
}

// delta = rowsum(dO * O) in fp32 of each list row (at perm's positions, for a list at
// positions), which the backward kernels and the reference take. On the GPU one kernel: the
// four fp32 passes of the formula below cost the backward more than its dQ kernel (SWA,
// L = 16384, D = 128; PERFORMANCE.md).
at::Tensor row_delta(const at::Tensor& dout, const at::Tensor& out, const at::Tensor* perm = nullptr) {
#ifdef ATTNSWEEP_CUDA
    if (dout.is_cuda()) return attnsweep::cuda_row_dot(dout, out.contiguous(), nullptr, perm);
#endif
    auto delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
    return perm ? delta.gather(2, perm->to(at::kLong)) : delta;
}

// The empty tensor that stands for "no list" (or no offsets) inside this file.
at::Tensor none(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kInt)); }

#ifdef ATTNSWEEP_CUDA
// far: PPA's far distances (cuda_far_table of offsets), or an empty tensor.
attnsweep::QueryList query_list(const at::Tensor& qpos, const at::Tensor& nq, const at::Tensor& far,
                                const at::Tensor& offsets) {
    attnsweep::QueryList list;
    if (qpos.numel() > 0) list.qpos = &qpos, list.nq = &nq;
    if (far.numel() > 0) list.far = &far, list.far_count = offsets.numel();
    return list;
}

// PPA's offsets and window as the kernels' far-distance table (empty without offsets).
at::Tensor far_table(const at::Tensor& offsets, const at::Tensor& k, int64_t window) {
    return offsets.numel() > 0 ? attnsweep::cuda_far_table(offsets, k.size(2), window) : none(k);
}

// The CUDA kernels' (out, lse) and (dq, dk, dv) for a query list, in fresh tensors.
std::pair<at::Tensor, at::Tensor> cuda_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const attnsweep::QueryList& list, int64_t window) {
    auto out = at::empty_like(q);
    auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    attnsweep::cuda_forward(q, k, v, list, window, out, lse);
    return {out, lse};
}
variable_list cuda_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const attnsweep::QueryList& list, int64_t window, const at::Tensor& lse,
                                      const at::Tensor& delta, const at::Tensor& dout) {
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    attnsweep::cuda_backward(q, k, v, list, window, lse, delta, dout, dq, dk, dv);
    return {dq, dk, dv};
}
#endif

// PPA's offsets split at pairs_from: the nearer ones run in the tile kernels (through their
// far-distance table), offsets[pairs_from:] pair by pair (attention.cuh, cuda_far_pairs_*);
// attention sinks, the first `sinks` keys, pair by pair beyond each query's window
// (cuda_sink_pairs_*). The reference path takes all of them at once.
struct ListAttention : public torch::autograd::Function<ListAttention> {
    static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor qpos,
                                 at::Tensor nq, int64_t window, at::Tensor offsets, int64_t pairs_from,
                                 int64_t sinks) {
        at::Tensor out, lse, far = none(q);  // far: the kernels' PPA table, built once for both passes
        auto near = offsets.slice(0, 0, pairs_from), pairs = offsets.slice(0, pairs_from);
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            far = far_table(near, k, window);
            std::tie(out, lse) = cuda_attention(q, k, v, query_list(qpos, nq, far, near), window);
            attnsweep::cuda_far_pairs_forward(q, k, v, pairs, out, lse);
            attnsweep::cuda_sink_pairs_forward(q, k, v, sinks, window, out, lse);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            auto r = reference_forward(q, k, v, qpos, nq, none(q), window, offsets, sinks);
            out = r.first.to(q.scalar_type());
            lse = r.second;
        }
        ctx->save_for_backward({q, k, v, qpos, nq, out, lse, offsets, far});
        ctx->saved_data["window"] = window;
        ctx->saved_data["pairs_from"] = pairs_from;
        ctx->saved_data["sinks"] = sinks;
        return {out};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &q = s[0], &k = s[1], &v = s[2], &qpos = s[3], &nq = s[4], &out = s[5], &lse = s[6], &offsets = s[7],
                   &far = s[8];
        const int64_t window = ctx->saved_data["window"].toInt(), pairs_from = ctx->saved_data["pairs_from"].toInt(),
                      sinks = ctx->saved_data["sinks"].toInt();
        auto dout = grads[0].contiguous();
        auto delta = row_delta(dout, out);
        variable_list g;
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            auto near = offsets.slice(0, 0, pairs_from), pairs = offsets.slice(0, pairs_from);
            g = cuda_attention_backward(q, k, v, query_list(qpos, nq, far, near), window, lse, delta, dout);
            attnsweep::cuda_far_pairs_backward(q, k, v, pairs, lse, delta, dout, g[0], g[1], g[2]);
            attnsweep::cuda_sink_pairs_backward(q, k, v, sinks, window, lse, delta, dout, g[0], g[1], g[2]);
#endif
        } else {
            g = reference_backward(q, k, v, qpos, nq, none(q), window, offsets, sinks, lse, delta, dout);
        }
        return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// Routed attention: per (b, h, position), path [B, H, L] (uint8) says what the query sees: 2
// its whole prefix, 1 its window, 0 nothing (zeros). One list per (b, h)
// holds the full-prefix rows, then the window rows (route_list), so one launch runs both paths
// and no query runs the one it did not pick. The kernels read q and dO and write O and dQ at
// the rows' positions (lse and delta stay in list order); the reference works on list-ordered
// copies.
struct RoutedAttention : public torch::autograd::Function<RoutedAttention> {
    // (perm, nq, nfull): the list (attention.cuh, cuda_route_list). The reference orders the
    // positions by sorting a key; the kernel counts.
    static std::tuple<at::Tensor, at::Tensor, at::Tensor> route_list(const at::Tensor& path) {
        const auto B = path.size(0), H = path.size(1), L = path.size(2);
        auto opts = path.options().dtype(at::kInt);
        if (path.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            auto perm = at::empty({B, H, L}, opts), nq = at::empty({B, H}, opts), nfull = at::empty({B, H}, opts);
            attnsweep::cuda_route_list(path, perm, nq, nfull);
            return std::make_tuple(perm, nq, nfull);
#endif
        }
        // Group 0 full prefix, 1 window, 2 nothing.
        auto group = 2 - path.to(at::kLong);
        auto pos = at::arange(L, group.options()).view({1, 1, L});
        auto perm = (group * L + pos).argsort(-1, false).to(at::kInt);
        return std::make_tuple(perm, (group < 2).sum(-1).to(at::kInt), (group == 0).sum(-1).to(at::kInt));
    }

    // Rows [B, H, L, D] of x in list order, and back.
    static at::Tensor row_index(const at::Tensor& x, const at::Tensor& perm) {
        return perm.to(at::kLong).unsqueeze(-1).expand_as(x);
    }
    static at::Tensor to_list(const at::Tensor& x, const at::Tensor& perm) { return x.gather(2, row_index(x, perm)); }
    static at::Tensor from_list(const at::Tensor& x, const at::Tensor& perm) {
        return at::zeros_like(x).scatter(2, row_index(x, perm), x);
    }

    static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor path,
                                 int64_t window) {
        auto [perm, nq, nfull] = route_list(path);
        at::Tensor out, lse;
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            std::tie(out, lse) = cuda_attention(q, k, v, {&perm, &nq, &nfull, true}, window);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            auto r = reference_forward(to_list(q, perm), k, v, perm, nq, nfull, window, none(q), 0);
            out = from_list(r.first.to(q.scalar_type()), perm);
            lse = r.second;
        }
        ctx->save_for_backward({q, k, v, perm, nq, nfull, out, lse});
        ctx->saved_data["window"] = window;
        return {out};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &q = s[0], &k = s[1], &v = s[2], &perm = s[3], &nq = s[4], &nfull = s[5], &out = s[6], &lse = s[7];
        const int64_t window = ctx->saved_data["window"].toInt();
        auto dout = grads[0].contiguous();
        auto delta = row_delta(dout, out, &perm);
        variable_list g;
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            g = cuda_attention_backward(q, k, v, {&perm, &nq, &nfull, true}, window, lse, delta, dout);
#endif
        } else {
            g = reference_backward(to_list(q, perm), k, v, perm, nq, nfull, window, none(q), 0, lse, delta,
                                   to_list(dout, perm));
            g[0] = from_list(g[0], perm);
        }
        return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
    }
};

// AHA's straight-through mix of one routed layer (attention.rs, SelfAttention::per_head):
// y = c + w (sg(c) - o), c the output of the paths the gates picked, o the other paths' output
// (no gradient), w one weight per row. Its value is c where w is 0; the gradients are dc = dy
// and dw = rowsum(dy (c - o)). One kernel each way on the GPU instead of ATen's subtract,
// broadcast multiply and add, and multiply and sum. The CPU reference computes in fp32, as
// the other references here do.
struct StraightThroughMix : public torch::autograd::Function<StraightThroughMix> {
    static variable_list forward(AutogradContext* ctx, at::Tensor c, at::Tensor o, at::Tensor w) {
        auto wf = w.to(at::kFloat).contiguous();
        at::Tensor y;
        if (c.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            y = attnsweep::cuda_st_mix(c, o, wf);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            auto cf = c.to(at::kFloat);
            y = (cf + wf.unsqueeze(-1) * (cf - o.to(at::kFloat))).to(c.scalar_type());
        }
        ctx->save_for_backward({c, o, w});
        return {y};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &c = s[0], &o = s[1], &w = s[2];
        auto dy = grads[0].to(c.scalar_type()).contiguous();
        if (!ctx->needs_input_grad(2)) return {dy, at::Tensor(), at::Tensor()};
        at::Tensor dw;
        if (c.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            dw = attnsweep::cuda_row_dot(dy, c, &o, nullptr);
#endif
        } else {
            dw = (dy.to(at::kFloat) * (c.to(at::kFloat) - o.to(at::kFloat))).sum(-1);
        }
        return {dy, at::Tensor(), dw.to(w.scalar_type())};
    }
};

// AHA's gates of one layer from its router scores s [B, L, H] (fp32): walk.cuh, aha_route, on
// both devices (one kernel on the GPU, the same function in a loop on the CPU; attention.rs
// computes the same gates in ATen on the reference path). Outputs: the mix weight w [B, H, L]
// (all zeros, so the straight-through mix returns the chosen output exactly) whose gradient
// reaches s as ds = coef dw, transposed; then, without gradient, hard [B, L, H], the paths
// chosen and other [B, H, L] (uint8) and the chosen paths' key-query pairs (fp64 scalar).
struct AhaGates : public torch::autograd::Function<AhaGates> {
    static variable_list forward(AutogradContext* ctx, at::Tensor s, double tau, double sample, int64_t seed,
                                 int64_t layer, int64_t start, int64_t window) {
        const auto B = s.size(0), L = s.size(1), H = s.size(2);
        auto f = s.options();
        auto hard = at::empty({B, L, H}, f), coef = at::empty({B, H, L}, f);
        auto chosen = at::empty({B, H, L}, f.dtype(at::kByte)), other = at::empty_like(chosen);
        auto pairs = at::zeros({}, f.dtype(at::kDouble));
        const uint32_t salt = attnsweep::aha_salt((uint64_t)seed, (uint64_t)layer);
        if (s.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            attnsweep::cuda_aha_gates(s, tau, sample, salt, start, window, hard, chosen, other, coef, pairs);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            const attnsweep::AhaGateArgs a{(float)tau, sample, salt, start, (int)window};
            auto sa = s.accessor<float, 3>();
            auto ha = hard.accessor<float, 3>(), ca = coef.accessor<float, 3>();
            auto cha = chosen.accessor<uint8_t, 3>(), oa = other.accessor<uint8_t, 3>();
            int64_t total = 0;
            for (int64_t b = 0; b < B; ++b)
                for (int64_t l = 0; l < L; ++l)
                    for (int64_t h = 0; h < H; ++h) {
                        const auto r = attnsweep::aha_route(a, sa[b][l][h], b, l, h);
                        ha[b][l][h] = r.on ? 1.f : 0.f;
                        cha[b][h][l] = r.chosen;
                        oa[b][h][l] = r.other;
                        ca[b][h][l] = r.coef;
                        total += r.pairs;
                    }
            pairs.fill_((double)total);
        }
        ctx->save_for_backward({coef});
        ctx->mark_non_differentiable({hard, chosen, other, pairs});
        return {at::zeros({B, H, L}, f), hard, chosen, other, pairs};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto ds = (grads[0] * ctx->get_saved_variables()[0]).transpose(1, 2);
        return {ds, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// A router's scores s = sigmoid(x w^T + b) (fp32) of x [..., d] (bf16 or fp32), w [heads, d]
// and b [heads] (fp32; empty: no bias), with autograd in all three (router.cu). The reference,
// for CPU tensors and shapes the kernels do not take, is the layer's own form: x in fp32,
// ATen's linear and sigmoid.
struct RouterFn : public torch::autograd::Function<RouterFn> {
    static bool fused(const at::Tensor& x, const at::Tensor& w) {
#ifdef ATTNSWEEP_CUDA
        if (!x.is_cuda()) return false;
        const auto why = attnsweep::cuda_router_misfit(x, w);
        if (!why.empty()) warn_once(why);
        return why.empty();
#else
        return false;
#endif
    }

    static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, at::Tensor b) {
        const bool bias = b.numel() > 0;
        at::Tensor s;
        if (fused(x, w)) {
#ifdef ATTNSWEEP_CUDA
            auto shape = x.sizes().vec();
            shape.back() = w.size(0);
            s = at::empty(shape, x.options().dtype(at::kFloat));
            attnsweep::cuda_router_forward(x, w, bias ? &b : nullptr, s);
#endif
        } else {
            s = at::sigmoid(at::linear(x.to(at::kFloat), w, bias ? std::optional<at::Tensor>(b) : std::nullopt));
        }
        ctx->save_for_backward({x, w, s});
        ctx->saved_data["bias"] = bias;
        return {s};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const auto &x = saved[0], &w = saved[1], &s = saved[2];
        const bool bias = ctx->saved_data["bias"].toBool();
        auto ds = grads[0].to(at::kFloat).contiguous();
        at::Tensor dx, dw, db;
        if (fused(x, w)) {
#ifdef ATTNSWEEP_CUDA
            dx = at::empty_like(x), dw = at::empty_like(w), db = at::empty({w.size(0)}, w.options());
            attnsweep::cuda_router_backward(ds, s, x, w, dx, dw, db);
#endif
        } else {
            auto dl = (ds * s * (1 - s)).reshape({-1, w.size(0)});
            auto xf = x.to(at::kFloat).reshape({-1, w.size(1)});
            dx = dl.mm(w).view(x.sizes()).to(x.scalar_type());
            dw = dl.t().mm(xf);
            db = dl.sum(0);
        }
        return {dx, dw, bias ? db : at::Tensor()};
    }
};

// Next-token cross-entropy: nll [N] (fp32) of logits x [N, V] at targets y [N]; the backward
// writes the logits' gradient in x's dtype (see loss.cu). Reference: log-softmax in fp32.
struct CrossEntropy : public torch::autograd::Function<CrossEntropy> {
    static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor y) {
        at::Tensor nll, lse;
        if (x.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            nll = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
            lse = at::empty_like(nll);
            attnsweep::cuda_cross_entropy(x, y, nll, lse);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            auto xf = x.to(at::kFloat);
            lse = at::logsumexp(xf, -1);
            nll = lse - xf.gather(-1, y.unsqueeze(-1)).squeeze(-1);
        }
        ctx->save_for_backward({x, y, lse});
        return {nll};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &x = s[0], &y = s[1], &lse = s[2];
        auto g = grads[0].to(at::kFloat).contiguous();
        at::Tensor dx;
        if (x.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            dx = at::empty_like(x);
            attnsweep::cuda_cross_entropy_backward(x, y, lse, g, dx);
#endif
        } else {
            auto p = at::exp(x.to(at::kFloat) - lse.unsqueeze(-1));
            auto onehot = at::zeros_like(p).scatter_(-1, y.unsqueeze(-1), 1.0);
            dx = ((p - onehot) * g.unsqueeze(-1)).to(x.scalar_type());
        }
        return {dx, at::Tensor()};
    }
};

// RMSNorm of x [..., d] with weight w [d] (fp32), computed in fp32, y in x's dtype (see
// norm.cu); the reference, for CPU tensors and rows wider than the kernels take, is the same
// formulas in ATen.
struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
    static bool fused(const at::Tensor& x) {
#ifdef ATTNSWEEP_CUDA
        if (!x.is_cuda()) return false;
        if (x.size(-1) <= attnsweep::cuda_norm_max_dim()) return true;
        warn_once("the RMSNorm kernel takes rows of at most " + std::to_string(attnsweep::cuda_norm_max_dim()) +
                  " values, not " + std::to_string(x.size(-1)));
        return false;
#else
        TORCH_CHECK(!x.is_cuda(), "this kernel library was built without CUDA; run `attnsweep kernels build`");
        return false;
#endif
    }

    // y = RMSNorm(x) with its rstd, or with r: h = x + r first (in x's dtype), normalised, by
    // the kernels or the reference. Returns (h, y, rstd), h being x itself without r.
    static std::tuple<at::Tensor, at::Tensor, at::Tensor> compute(const at::Tensor& x, const at::Tensor* r,
                                                                  const at::Tensor& w, double eps) {
        at::Tensor h = x, y, rstd;
        if (fused(x)) {
#ifdef ATTNSWEEP_CUDA
            y = at::empty_like(x);
            rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
            if (r) {
                h = at::empty_like(x);
                attnsweep::cuda_add_rms_norm(x, *r, w, eps, h, y, rstd);
            } else {
                attnsweep::cuda_rms_norm(x, w, eps, y, rstd);
            }
#endif
        } else {
            if (r) h = x + *r;
            auto hf = h.to(at::kFloat);
            rstd = at::rsqrt(hf.square().mean(-1) + eps);
            y = (w * (hf * rstd.unsqueeze(-1))).to(x.scalar_type());
        }
        return {h, y, rstd};
    }

    // The gradients (dx, dw) of the norm of x for dy, with dres (a gradient x also receives
    // past the norm) added to dx before its rounding where given.
    static std::pair<at::Tensor, at::Tensor> gradients(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy,
                                                       const at::Tensor& rstd, const at::Tensor* dres) {
        at::Tensor dx, dw;
        if (fused(x)) {
#ifdef ATTNSWEEP_CUDA
            dx = at::empty_like(x);
            attnsweep::cuda_rms_norm_backward(x, w, dy, rstd, dres, dx, dw);
#endif
        } else {
            auto r = rstd.unsqueeze(-1);
            auto n = x.to(at::kFloat) * r, g = dy.to(at::kFloat);
            auto gw = g * w;
            auto dxf = r * (gw - n * (gw * n).mean(-1, true));
            if (dres) dxf = dxf + dres->to(at::kFloat);
            dx = dxf.to(x.scalar_type());
            dw = (g * n).reshape({-1, x.size(-1)}).sum(0);
        }
        return {dx, dw};
    }

    static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, double eps) {
        auto [h, y, rstd] = compute(x, nullptr, w, eps);
        ctx->save_for_backward({x, w, rstd});
        return {y};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &x = s[0], &w = s[1], &rstd = s[2];
        auto [dx, dw] = gradients(x, w, grads[0].to(x.scalar_type()).contiguous(), rstd, nullptr);
        return {dx, dw, at::Tensor()};
    }
};

// What the RMSNorm entry points take: x [..., d] (d >= 1) in bf16 or fp32, its weight [d] in
// fp32 on x's device.
void check_norm(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "weight must be [d] for x [..., d]");
    TORCH_CHECK(x.size(-1) >= 1, "RMSNorm needs d >= 1");
    TORCH_CHECK(w.scalar_type() == at::kFloat, "RMSNorm weight must be fp32");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "RMSNorm input must be fp32 or bf16");
    TORCH_CHECK(x.device() == w.device(), "RMSNorm input and weight on different devices");
}

// The residual add and the RMSNorm after it: h = x + r (rounded to x's dtype), y = RMSNorm(h),
// both outputs differentiable. Fused (norm.cu), the add costs no pass of its own forward, and
// backward the stream's two gradients (dh from past the block, the norm's own) are summed
// inside the norm's backward: dx = dr = dh + RMSNorm'(dy), rounded once. The reference is the
// same formulas in ATen.
struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
    static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor r, at::Tensor w, double eps) {
        auto [h, y, rstd] = RmsNormFn::compute(x, &r, w, eps);
        ctx->save_for_backward({h, w, rstd});
        return {h, y};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &h = s[0], &w = s[1], &rstd = s[2];
        // An output left unused arrives as zeros (the Function materialises its gradients).
        auto dres = grads[0].to(h.scalar_type()).contiguous();
        auto [dx, dw] = RmsNormFn::gradients(h, w, grads[1].to(h.scalar_type()).contiguous(), rstd, &dres);
        return {dx, dx, dw, at::Tensor()};
    }
};

// The MLP's gate y = silu(g) u (see swiglu.cu), g and u of one shape. The reference is the
// same formula in ATen, in fp32.
struct SwiGluFn : public torch::autograd::Function<SwiGluFn> {
    static variable_list forward(AutogradContext* ctx, at::Tensor g, at::Tensor u) {
        at::Tensor y;
        if (g.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            y = at::empty_like(g);
            attnsweep::cuda_swiglu(g, u, y);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            y = (at::silu(g.to(at::kFloat)) * u.to(at::kFloat)).to(g.scalar_type());
        }
        ctx->save_for_backward({g, u});
        return {y};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &g = s[0], &u = s[1];
        auto dy = grads[0].to(g.scalar_type()).contiguous();
        at::Tensor dg, du;
        if (g.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            dg = at::empty_like(g), du = at::empty_like(u);
            attnsweep::cuda_swiglu_backward(dy, g, u, dg, du);
#endif
        } else {
            auto a = g.to(at::kFloat), d = dy.to(at::kFloat), sg = at::sigmoid(a);
            du = (d * a * sg).to(u.scalar_type());
            dg = (d * u.to(at::kFloat) * sg * (1 + a * (1 - sg))).to(g.scalar_type());
        }
        return {dg, du};
    }
};

// The head transpose x [B, L, H, D] <-> [B, H, L, D] (to_heads: rightwards), with the rotary
// embedding of cos, sin [L, D] where they are not empty (see rope.cu); transposed: the
// rotation's transpose. The reference is the same rotation in ATen, in fp32.
at::Tensor move_heads(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool to_heads,
                      bool transposed) {
    const bool rotate = cos.numel() > 0;
    if (x.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
        auto y = at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options());
        attnsweep::cuda_heads(x, rotate ? &cos : nullptr, rotate ? &sin : nullptr, to_heads, transposed, y);
        return y;
#else
        TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
    }
    auto t = (to_heads ? x.transpose(1, 2) : x).to(at::kFloat);  // [B, H, L, D]
    if (rotate) {
        const auto half = x.size(3) / 2;
        auto c = cos.to(at::kFloat), s = sin.to(at::kFloat);
        if (transposed) {
            auto ts = t * s;
            t = t * c + at::cat({ts.narrow(3, half, half), -ts.narrow(3, 0, half)}, 3);
        } else {
            t = t * c + at::cat({-t.narrow(3, half, half), t.narrow(3, 0, half)}, 3) * s;
        }
    }
    // A copy even where the move leaves the layout as it was (one head or one position): a
    // custom function returns no view of its input.
    return (to_heads ? t : t.transpose(1, 2)).to(x.scalar_type()).clone(at::MemoryFormat::Contiguous);
}

struct HeadsFn : public torch::autograd::Function<HeadsFn> {
    static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor cos, at::Tensor sin, bool to_heads) {
        ctx->save_for_backward({cos, sin});
        ctx->saved_data["to_heads"] = to_heads;
        return {move_heads(x, cos, sin, to_heads, false)};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const bool to_heads = ctx->saved_data["to_heads"].toBool();
        return {move_heads(grads[0].contiguous(), s[0], s[1], !to_heads, true), at::Tensor(), at::Tensor(),
                at::Tensor()};
    }
};

// Reference optimizer step: the per-tensor form of optim.cu's kernels (and of train.rs).
at::Tensor reference_grad_norm(const std::vector<at::Tensor>& grads) {
    auto total = at::zeros({}, grads[0].options());
    for (const auto& g : grads) total = total + g.square().sum();
    return total.sqrt();
}

void reference_adamw(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                     const std::vector<at::Tensor>& v, const attnsweep::AdamWStep& h) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < p.size(); ++i) {
        if (h.clip != 1.f) g[i].mul_(h.clip);
        m[i].mul_(h.beta1).add_(g[i] * (1.0 - h.beta1));
        v[i].mul_(h.beta2).add_(g[i].square() * (1.0 - h.beta2));
        if (p[i].dim() >= 2 && h.weight_decay > 0) p[i].mul_(1.0 - h.lr * h.weight_decay);
        p[i].sub_(m[i] / ((v[i] / h.bc2).sqrt() + h.eps) * (h.lr / h.bc1));
    }
}

// The tensors behind n pointers, checked to be fp32, contiguous and on one device.
std::vector<at::Tensor> tensor_list(const at::Tensor* const* ts, size_t n, const char* what) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < n; ++i) {
        const at::Tensor& t = *ts[i];
        TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
                    " tensors must be defined, fp32 and contiguous (entry ", i, ")");
        TORCH_CHECK(t.device() == ts[0]->device(), what, " tensors on different devices");
        out.push_back(t);
    }
    return out;
}

using attnsweep::guarded;
using attnsweep::write_error;

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qpos, const at::Tensor& nq,
                  int64_t window, const at::Tensor& offsets) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, H, L, D]");
    TORCH_CHECK(k.sizes() == v.sizes(), "k and v differ in shape");
    TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q and k differ in batch or head_dim");
    TORCH_CHECK(k.size(1) >= 1, "k and v need at least one key-value head");
    TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of key-value heads");
    TORCH_CHECK(window >= 1, "window must be at least 1");
    TORCH_CHECK(q.device() == k.device() && k.device() == v.device(), "q, k, v on different devices");
    if (qpos.numel() > 0 || nq.numel() > 0) {
        TORCH_CHECK(qpos.scalar_type() == at::kInt && nq.scalar_type() == at::kInt, "qpos and nq must be int32");
        TORCH_CHECK(qpos.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2)}), "qpos must be [B, H, Lq]");
        TORCH_CHECK(nq.sizes() == at::IntArrayRef({q.size(0), q.size(1)}), "nq must be [B, H]");
        TORCH_CHECK(qpos.device() == q.device() && nq.device() == q.device(), "qpos and nq on another device than q");
        // As for offsets below: the model builds the lists, and reading them back would stall.
        TORCH_CHECK(nq.is_cuda() || nq.numel() == 0 || (nq.min().item<int>() >= 0 && nq.max().item<int>() <= q.size(2)),
                    "nq must lie in [0, Lq]");
    } else {
        TORCH_CHECK(q.size(2) == k.size(2), "dense queries need Lq == L");
    }
    if (offsets.numel() > 0) {
        TORCH_CHECK(qpos.numel() == 0, "offsets (PPA) take dense queries");
        TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kInt, "offsets must be a 1-d int32 tensor");
        TORCH_CHECK(offsets.device() == q.device(), "offsets on another device than q");
        // Offsets on the GPU are trusted: the model builds them from KeyPattern (CPU calls check
        // the same lists), and reading them back would stall the stream at every call.
        if (!offsets.is_cuda()) {
            TORCH_CHECK(offsets.min().item<int>() >= window && offsets.max().item<int>() < k.size(2),
                        "offsets must lie in [window, L)");
            TORCH_CHECK(offsets.numel() == 1 || (offsets.slice(0, 1) > offsets.slice(0, 0, -1)).all().item<bool>(),
                        "offsets must be strictly ascending");
        }
    }
    if (q.is_cuda()) {
        TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
                    "the CUDA kernels take bf16 q, k, v");
        TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "the CUDA kernels take head_dim 64 or 128");
        TORCH_CHECK(k.size(2) < INT32_MAX && q.size(2) < INT32_MAX, "sequence too long for int32 positions");
    }
}

// Single-query attention over a decoding cache (decode.cuh states the arguments), in ATen: the
// CPU build's form of the decode kernel, and what the GPU tests compare it with.
at::Tensor decode_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kpos,
                            const at::Tensor& qpos, int64_t window, int64_t sinks, const at::Tensor* near) {
    auto d = qpos - kpos;
    auto reach = window < 0 ? at::ones_like(d, d.options().dtype(at::kBool)) : d.lt(window);
    if (sinks > 0) reach = reach.logical_or(kpos.lt(sinks));
    if (near) reach = reach.logical_or(near->index_select(0, d.clamp(0, near->size(0) - 1)));
    auto seen = reach.logical_and(kpos.ge(0)).logical_and(d.ge(0));
    const auto group = q.size(1) / k.size(1);
    auto kf = k.to(at::kFloat).repeat_interleave(group, 1), vf = v.to(at::kFloat).repeat_interleave(group, 1);
    auto s = at::matmul(q.to(at::kFloat), kf.transpose(-1, -2)) / std::sqrt((double)q.size(3));
    s = s.masked_fill(seen.logical_not(), -INFINITY);
    return at::matmul(at::softmax(s, -1).nan_to_num(0.0), vf).to(q.scalar_type());
}

// A CUDA graph captured from the work the caller queues between graph_begin and graph_end on
// this thread, on a stream of its own (a graph is not captured on the default stream).
#ifdef ATTNSWEEP_CUDA
struct Graph {
    at::cuda::CUDAGraph graph;
    c10::cuda::CUDAStream previous = c10::cuda::getCurrentCUDAStream();
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    bool capturing = false;
};
#endif

}  // namespace

extern "C" {

// Version of this C interface; Rust refuses a library whose version differs.
#ifndef ATTNSWEEP_ABI
#error "build with -DATTNSWEEP_ABI=<version> (the Rust side passes it)"
#endif
int64_t attnsweep_kernels_abi() { return ATTNSWEEP_ABI; }

// Whether the library was built with the CUDA kernels.
int attnsweep_kernels_cuda() {
#ifdef ATTNSWEEP_CUDA
    return 1;
#else
    return 0;
#endif
}

// Timing events on the current device's current stream, as the bench's PyTorch peers time theirs
// (torch.cuda.Event): a new event, or null with a message in err.
void* attnsweep_event_new(char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
#ifdef ATTNSWEEP_CUDA
        return new at::cuda::CUDAEvent(cudaEventDefault);
#else
        TORCH_CHECK(false, "this kernel library was built without CUDA");
#endif
    });
}

// Records the event on the current stream. Returns 0, or 1 with a message in err.
int attnsweep_event_record(void* event, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        static_cast<at::cuda::CUDAEvent*>(event)->record();
#endif
        return 0;
    });
}

// Waits for `end`, then writes the milliseconds between the two recorded events to *ms.
// Returns 0, or 1 with a message in err.
int attnsweep_event_elapsed(void* start, void* end, double* ms, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        auto* e = static_cast<at::cuda::CUDAEvent*>(end);
        e->synchronize();
        *ms = static_cast<at::cuda::CUDAEvent*>(start)->elapsed_time(*e);
#endif
        return 0;
    });
}

void attnsweep_event_free(void* event) {
#ifdef ATTNSWEEP_CUDA
    delete static_cast<at::cuda::CUDAEvent*>(event);
#endif
}

// Memory of CUDA device `device`, in bytes, written to out[0..5]: what the caching allocator
// holds in tensors now and at most since the last reset, what it has reserved from the driver
// (tensors and its cache), then the device's free and total memory (the driver's count, in
// which the allocator's cache is not free). Flags: 1, the peak starts again from now; 2, the
// allocator first gives its cached blocks back to the driver (a CUDA graph's capture then
// takes them into its own pool instead of taking as much again). Returns 0, or 1 with a message.
int attnsweep_cuda_memory(int64_t device, int flags, double* out, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        TORCH_CHECK(device >= 0 && device < c10::cuda::device_count(), "no CUDA device ", device);
        const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
        namespace alloc = c10::cuda::CUDACachingAllocator;
        if (flags & 2) alloc::emptyCache();
        const auto stats = alloc::getDeviceStats((c10::DeviceIndex)device);
        const auto& bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
        size_t free = 0, total = 0;
        C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
        out[0] = (double)bytes.current;
        out[1] = (double)bytes.peak;
        out[2] = (double)stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
        out[3] = (double)free;
        out[4] = (double)total;
        if (flags & 1) alloc::resetPeakStats((c10::DeviceIndex)device);
#else
        TORCH_CHECK(false, "this kernel library was built without CUDA");
#endif
        return 0;
    });
}

// The GPU's work between a start and a stop, as PyTorch's profiler (Kineto) records it: start
// (trace null) begins recording CUDA activity, kernels with their names and durations among it;
// stop ends it and writes the Chrome trace to the file trace. Returns 0, or 1 with a message.
int attnsweep_profile(int start, const char* trace, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        namespace prof = torch::profiler::impl;
        namespace kineto = torch::autograd::profiler;
        const std::set<prof::ActivityType> activities{prof::ActivityType::CUDA};
        if (start) {
            const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
            kineto::prepareProfiler(config, activities);
            kineto::enableProfiler(config, activities);
        } else {
            TORCH_CHECK(trace != nullptr, "stopping the profiler needs a trace file");
            kineto::disableProfiler()->save(trace);
        }
#else
        TORCH_CHECK(false, "this kernel library was built without CUDA");
#endif
        return 0;
    });
}

// out = attention of q over (k, v) for the query list (qpos, nq may be null: dense), each
// query seeing its window and, where offsets is not null, the keys at those distances (PPA;
// on the GPU, offsets from index pairs_from on run pair by pair), and the sequence's first
// `sinks` keys (dense lists; 0: none), with autograd. Returns a new at::Tensor* (the caller
// owns it), or null with a message in err.
void* attnsweep_list_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* qpos,
                               const at::Tensor* nq, int64_t window, const at::Tensor* offsets, int64_t pairs_from,
                               int64_t sinks, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK((qpos == nullptr) == (nq == nullptr), "qpos and nq come together");
        at::Tensor qp = qpos ? qpos->contiguous() : none(*q), n = nq ? nq->contiguous() : none(*q);
        at::Tensor off = offsets ? offsets->contiguous() : none(*q);
        check_inputs(*q, *k, *v, qp, n, window, off);
        TORCH_CHECK(pairs_from >= 0 && pairs_from <= off.numel(), "pairs_from must lie in [0, ", off.numel(),
                    "] (the offsets' count), not ", pairs_from);
        TORCH_CHECK(sinks >= 0, "sinks must be at least 0, not ", sinks);
        TORCH_CHECK(sinks == 0 || (qp.numel() == 0 && off.numel() == 0),
                    "attention sinks take dense queries and no PPA offsets");
        auto out = ListAttention::apply(q->contiguous(), k->contiguous(), v->contiguous(), qp, n, window, off,
                                        pairs_from, sinks);
        return new at::Tensor(out[0]);
    });
}

// out = routed attention of q over (k, v): per query, path [B, H, L] (uint8) 2 sees its whole
// prefix, 1 its window, 0 nothing (zeros), with autograd; other values are rejected for CPU
// tensors and read as 0 on the GPU. Returns a new at::Tensor* (the caller owns it), or null
// with a message in err.
void* attnsweep_routed_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* path,
                                 int64_t window, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        check_inputs(*q, *k, *v, none(*q), none(*q), window, none(*q));
        TORCH_CHECK(path->scalar_type() == at::kByte, "path must be uint8");
        TORCH_CHECK(path->sizes() == at::IntArrayRef({q->size(0), q->size(1), q->size(2)}), "path must be [B, H, L]");
        TORCH_CHECK(path->device() == q->device(), "path on another device than q");
        // Contents are checked where reading them costs no device synchronisation.
        TORCH_CHECK(path->is_cuda() || path->numel() == 0 || path->max().item<int>() <= 2,
                    "path values must be 0 (nothing), 1 (window) or 2 (full prefix)");
        auto out = RoutedAttention::apply(q->contiguous(), k->contiguous(), v->contiguous(), path->contiguous(), window);
        return new at::Tensor(out[0]);
    });
}

// AHA's straight-through mix y = c + w (sg(c) - o) of c, o [B, H, L, D] (fp32 or bf16; bf16 on
// the GPU) and w [B, H, L] (any float dtype), with autograd in c and w (o gets none). Returns a
// new at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_st_mix(const at::Tensor* c, const at::Tensor* o, const at::Tensor* w, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(c->dim() == 4 && o->sizes() == c->sizes(), "mix: c and o must be [B, H, L, D] of one shape");
        TORCH_CHECK(w->sizes() == c->sizes().slice(0, 3), "mix: the weight must be [B, H, L] for c [B, H, L, D]");
        TORCH_CHECK(c->scalar_type() == o->scalar_type(), "mix: c and o differ in dtype");
        TORCH_CHECK(at::isFloatingType(c->scalar_type()) && at::isFloatingType(w->scalar_type()),
                    "mix: inputs must be floating point");
        TORCH_CHECK(c->device() == o->device() && c->device() == w->device(), "mix: inputs on different devices");
        auto out = StraightThroughMix::apply(c->contiguous(), o->detach().contiguous(), *w);
        return new at::Tensor(out[0]);
    });
}

// A router's scores (RouterFn) of x [..., d] with w [heads, d] and b [heads] (empty: no bias):
// a new at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_router(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(x->dim() >= 1 && w->dim() == 2 && x->size(-1) == w->size(1),
                    "router: x must be [..., d] for a weight [heads, d]");
        TORCH_CHECK(x->scalar_type() == at::kBFloat16 || x->scalar_type() == at::kFloat, "router: x must be bf16 or fp32");
        TORCH_CHECK(w->scalar_type() == at::kFloat && b->scalar_type() == at::kFloat,
                    "router: the weight and the bias must be fp32");
        TORCH_CHECK(b->numel() == 0 || b->sizes() == at::IntArrayRef({w->size(0)}), "router: the bias must be [heads]");
        TORCH_CHECK(x->device() == w->device() && x->device() == b->device(), "router: inputs on different devices");
        auto out = RouterFn::apply(x->contiguous(), w->contiguous(), b->contiguous());
        return new at::Tensor(out[0]);
    });
}

// AHA's gates (AhaGates) of router scores s [B, L, H] (fp32) with threshold tau, probe rate
// sample in (0, 1], the draws' seed, the layer, the chunk's first position and the window: five
// new at::Tensor* written to out (the caller owns them): the mix weight (with autograd in s),
// hard, chosen, other and pairs. Returns 0, or -1 with a message in err.
int attnsweep_aha_gates(const at::Tensor* s, double tau, double sample, uint64_t seed, int64_t layer, int64_t start,
                        int64_t window, void** out, char* err, size_t err_len) {
    return guarded<int>(err, err_len, -1, [&]() -> int {
        TORCH_CHECK(s->dim() == 3 && s->scalar_type() == at::kFloat, "gates: scores must be [B, L, H] fp32");
        TORCH_CHECK(sample > 0.0 && sample <= 1.0, "gates: the probe rate must lie in (0, 1], not ", sample);
        TORCH_CHECK(window >= 1 && window <= INT32_MAX, "gates: window must be in [1, 2^31), not ", window);
        TORCH_CHECK(start >= 0 && layer >= 0, "gates: the start position and the layer must be non-negative");
        auto r = AhaGates::apply(s->contiguous(), tau, sample, (int64_t)seed, layer, start, window);
        for (size_t i = 0; i < r.size(); ++i) out[i] = new at::Tensor(r[i]);
        return 0;
    });
}

// Per-token negative log-likelihood of logits [..., V] at targets [...] (int64), fp32, shaped
// like targets, with autograd. Returns a new at::Tensor* (the caller owns it), or null with a
// message in err.
void* attnsweep_token_nll(const at::Tensor* logits, const at::Tensor* targets, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        const auto& x = *logits;
        const auto& y = *targets;
        TORCH_CHECK(x.dim() >= 1 && x.dim() == y.dim() + 1 && x.sizes().slice(0, y.dim()) == y.sizes(),
                    "logits must be targets' shape plus a vocabulary dimension");
        TORCH_CHECK(y.scalar_type() == at::kLong, "targets must be int64");
        TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "logits must be fp32 or bf16");
        TORCH_CHECK(x.device() == y.device(), "logits and targets on different devices");
        const auto vocab = x.size(-1);
        TORCH_CHECK(vocab > 0, "empty vocabulary");
        auto out = CrossEntropy::apply(x.reshape({-1, vocab}).contiguous(), y.reshape({-1}).contiguous());
        return new at::Tensor(out[0].view(y.sizes()));
    });
}

// The MLP's gate silu(g) u of g, u [...] (bf16 or fp32, alike), with autograd in both.
// Returns a new at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_swiglu(const at::Tensor* g, const at::Tensor* u, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(g->sizes() == u->sizes(), "SwiGLU: gate and up must have one shape");
        TORCH_CHECK(g->scalar_type() == u->scalar_type() &&
                        (g->scalar_type() == at::kFloat || g->scalar_type() == at::kBFloat16),
                    "SwiGLU: gate and up must both be fp32 or both bf16");
        TORCH_CHECK(g->device() == u->device(), "SwiGLU: gate and up on different devices");
        auto out = SwiGluFn::apply(g->contiguous(), u->contiguous());
        return new at::Tensor(out[0]);
    });
}

// Inference's SwiGLU gate from one joined projection gu [..., 2F] (each row the gate's F values,
// then the up projection's): y [..., F], no autograd (decoding's). The kernel on the GPU where
// each half starts 16-byte aligned, the formula in ATen otherwise. Returns a new at::Tensor*, or
// null with a message in err.
void* attnsweep_swiglu_joined(const at::Tensor* gu, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(gu->dim() >= 1 && gu->size(-1) % 2 == 0,
                    "SwiGLU: the joined projection needs an even last dimension");
        TORCH_CHECK(gu->scalar_type() == at::kFloat || gu->scalar_type() == at::kBFloat16,
                    "SwiGLU: the joined projection must be fp32 or bf16");
        auto x = gu->contiguous();
        const int64_t f = x.size(-1) / 2;
#ifdef ATTNSWEEP_CUDA
        if (x.is_cuda() && f % (16 / (int64_t)x.element_size()) == 0) {
            auto sizes = x.sizes().vec();
            sizes.back() = f;
            auto y = at::empty(sizes, x.options());
            attnsweep::cuda_swiglu_joined(x, y);
            return new at::Tensor(y);
        }
#endif
        auto g = x.narrow(-1, 0, f).to(at::kFloat), u = x.narrow(-1, f, f).to(at::kFloat);
        return new at::Tensor((at::silu(g) * u).to(x.scalar_type()));
    });
}

// RMSNorm of x [..., d] (bf16 or fp32) with weight w [d] (fp32), with autograd. Returns a new
// at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_rms_norm(const at::Tensor* x, const at::Tensor* w, double eps, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        check_norm(*x, *w);
        auto out = RmsNormFn::apply(x->contiguous(), w->contiguous(), eps);
        return new at::Tensor(out[0]);
    });
}

// The residual add and the RMSNorm after it, with autograd (AddRmsNormFn): h = x + r in x's
// dtype, y = RMSNorm(h) with weight w [d] (fp32), by the fused kernels (norm.cu) on the GPU, the
// same formulas in ATen otherwise. Returns 0 with out[0] = h, out[1] = y (new at::Tensor*, the
// caller owns them), or 1 with a message in err.
int attnsweep_add_rms_norm(const at::Tensor* x, const at::Tensor* r, const at::Tensor* w, double eps, void** out,
                           char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
        TORCH_CHECK(x->sizes() == r->sizes() && x->scalar_type() == r->scalar_type(),
                    "residual add: x and r must have one shape and dtype");
        TORCH_CHECK(x->device() == r->device(), "residual add: tensors on different devices");
        check_norm(*x, *w);
        auto hy = AddRmsNormFn::apply(x->contiguous(), r->contiguous(), w->contiguous(), eps);
        out[0] = new at::Tensor(hy[0]);
        out[1] = new at::Tensor(hy[1]);
        return 0;
    });
}

// One decoding step's projections into attention's layout and the cache (rope.cuh): qkv
// [B, 1, (H + 2 Hkv) D] gives q [B, H, 1, D] rotated by cos, sin [1, D]; the rotated key and
// the value go into entry entry[0] of the cache k, v [B, Hkv, S, D] (in place), pos[0] into
// kpos[entry[0]]. The kernel for bf16 CUDA tensors, the rotation and index copies in ATen
// otherwise. Returns a new at::Tensor* q, or null with a message in err.
void* attnsweep_decode_step(const at::Tensor* qkv, const at::Tensor* cos, const at::Tensor* sin,
                            const at::Tensor* entry, const at::Tensor* pos, int64_t heads, const at::Tensor* k,
                            const at::Tensor* v, const at::Tensor* kpos, char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(k->dim() == 4 && k->sizes() == v->sizes() && k->scalar_type() == v->scalar_type(),
                    "decode step: the cache's k and v must be [B, Hkv, S, D] alike");
        const int64_t b = k->size(0), kv = k->size(1), slots = k->size(2), d = k->size(3);
        TORCH_CHECK(heads > 0 && heads % kv == 0 && d % 2 == 0, "decode step: ", heads, " query heads for ", kv,
                    " KV heads of dimension ", d);
        TORCH_CHECK(qkv->dim() == 3 && qkv->size(0) == b && qkv->size(1) == 1 && qkv->size(2) == (heads + 2 * kv) * d,
                    "decode step: qkv must be [B, 1, (H + 2 Hkv) D] for the cache");
        TORCH_CHECK(qkv->scalar_type() == k->scalar_type(), "decode step: qkv and the cache must share a dtype");
        TORCH_CHECK(cos->dim() == 2 && cos->sizes() == sin->sizes() && cos->size(0) == 1 && cos->size(1) == d,
                    "decode step: cos and sin must be [1, D]");
        TORCH_CHECK(kpos->dim() == 1 && kpos->size(0) == slots && kpos->scalar_type() == at::kLong,
                    "decode step: kpos must be int64 [S]");
        TORCH_CHECK(entry->numel() == 1 && pos->numel() == 1 && entry->scalar_type() == at::kLong &&
                        pos->scalar_type() == at::kLong,
                    "decode step: entry and pos must be int64 [1]");
        TORCH_CHECK(k->is_contiguous() && v->is_contiguous() && kpos->is_contiguous(),
                    "decode step: the cache is written in place and must be contiguous");
        for (const at::Tensor* t : {cos, sin, entry, pos, k, v, kpos})
            TORCH_CHECK(t->device() == qkv->device(), "decode step: tensors on different devices");
        if (qkv->is_cuda() && qkv->scalar_type() == at::kBFloat16) {
#ifdef ATTNSWEEP_CUDA
            auto q = at::empty({b, heads, 1, d}, qkv->options());
            auto kind = cos->scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
            attnsweep::cuda_decode_step(qkv->contiguous(), cos->to(kind).contiguous(), sin->to(kind).contiguous(),
                                        *entry, *pos, heads, *k, *v, *kpos, q);
            return new at::Tensor(q);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        }
        auto x = qkv->view({b, 1, heads + 2 * kv, d});
        auto rotate = [&](const at::Tensor& t) { return move_heads(t.contiguous(), *cos, *sin, true, false); };
        auto q = rotate(x.narrow(2, 0, heads));
        k->index_copy_(2, *entry, rotate(x.narrow(2, heads, kv)));
        v->index_copy_(2, *entry, x.narrow(2, heads + kv, kv).transpose(1, 2));
        kpos->index_copy_(0, *entry, *pos);
        return new at::Tensor(q);
    });
}

// x [B, L, H, D] as [B, H, L, D] (to_heads), or x [B, H, L, D] as [B, L, H, D], bf16 or
// fp32, with autograd; rotated by cos, sin [L, D] (fp32 or x's dtype) where they are not null.
// Returns a new at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_heads(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin, int to_heads, char* err,
                      size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(x->dim() == 4 && x->size(3) % 2 == 0, "head transpose input must be 4-d with an even last dimension");
        TORCH_CHECK(x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16,
                    "head transpose input must be fp32 or bf16");
        TORCH_CHECK(!cos == !sin, "rotation needs both cos and sin");
        TORCH_CHECK(to_heads || !cos, "the rotation applies on the way to the heads");
        // Empty angles for no rotation: autograd takes no undefined tensors.
        auto c = at::empty({0}, x->options()), s = c;
        if (cos) {
            TORCH_CHECK(cos->sizes() == sin->sizes() && cos->dim() == 2 && cos->size(0) == x->size(1) &&
                            cos->size(1) == x->size(3),
                        "cos and sin must be [L, D] for x [B, L, H, D]");
            TORCH_CHECK(x->device() == cos->device() && x->device() == sin->device(), "rope inputs on different devices");
            // The kernel reads angles in fp32 or in x's dtype; others become fp32.
            const auto kind = cos->scalar_type() == x->scalar_type() ? x->scalar_type() : at::kFloat;
            c = cos->to(kind).contiguous();
            s = sin->to(kind).contiguous();
        }
        return new at::Tensor(HeadsFn::apply(x->contiguous(), c, s, to_heads != 0)[0]);
    });
}

// Global L2 norm of n gradients into *norm (the host waits for it). Returns 0, or 1 with a
// message in err.
int attnsweep_grad_norm(const at::Tensor* const* grads, size_t n, double* norm, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
        TORCH_CHECK(n > 0, "no gradients");
        auto g = tensor_list(grads, n, "gradient");
#ifdef ATTNSWEEP_CUDA
        auto total = g[0].is_cuda() ? attnsweep::cuda_grad_norm(g) : reference_grad_norm(g);
#else
        auto total = reference_grad_norm(g);
#endif
        *norm = total.item<double>();
        return 0;
    });
}

// One clipped AdamW step over n parameters with their gradients and moments, in place.
int attnsweep_adamw(const at::Tensor* const* params, const at::Tensor* const* grads, const at::Tensor* const* exp_avg,
                    const at::Tensor* const* exp_avg_sq, size_t n, const double* h, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
        TORCH_CHECK(n > 0, "no parameters");
        auto p = tensor_list(params, n, "parameter"), g = tensor_list(grads, n, "gradient");
        auto m = tensor_list(exp_avg, n, "exp_avg"), v = tensor_list(exp_avg_sq, n, "exp_avg_sq");
        for (size_t i = 0; i < n; ++i)
            TORCH_CHECK(g[i].sizes() == p[i].sizes() && m[i].sizes() == p[i].sizes() && v[i].sizes() == p[i].sizes(),
                        "parameter ", i, ": gradient or moments differ in shape");
        TORCH_CHECK(g[0].device() == p[0].device() && m[0].device() == p[0].device() && v[0].device() == p[0].device(),
                    "parameters, gradients and moments on different devices");
        // lr, beta1, beta2, eps, weight_decay, bc1, bc2, clip
        const attnsweep::AdamWStep step{(float)h[0], (float)h[1], (float)h[2], (float)h[3],
                                        (float)h[4], (float)h[5], (float)h[6], (float)h[7]};
#ifdef ATTNSWEEP_CUDA
        if (p[0].is_cuda()) {
            attnsweep::cuda_adamw(p, g, m, v, step);
            return 0;
        }
#endif
        reference_adamw(p, g, m, v, step);
        return 0;
    });
}

// Single-query attention over a decoding cache (decode.cuh), the CUDA kernel for bf16 CUDA
// tensors, the ATen reference otherwise. Returns a new at::Tensor* [B, H, 1, D], or null with
// a message in err.
void* attnsweep_decode_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* kpos,
                                 const at::Tensor* qpos, int64_t window, int64_t sinks, const at::Tensor* near,
                                 char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(q->dim() == 4 && q->size(2) == 1, "decode attention takes one query a row: q [B, H, 1, D]");
        TORCH_CHECK(k->dim() == 4 && k->sizes() == v->sizes() && k->size(0) == q->size(0) && k->size(3) == q->size(3),
                    "decode attention: k and v must be [B, Hkv, S, D] for q [B, H, 1, D]");
        TORCH_CHECK(q->size(1) % k->size(1) == 0, "decode attention: query heads must be a multiple of KV heads");
        TORCH_CHECK(kpos->dim() == 1 && kpos->size(0) == k->size(2) && kpos->scalar_type() == at::kLong,
                    "decode attention: kpos must be int64 [S]");
        TORCH_CHECK(qpos->numel() == 1 && qpos->scalar_type() == at::kLong, "decode attention: qpos must be int64 [1]");
        TORCH_CHECK(!near || (near->dim() == 1 && near->numel() > 0 && near->scalar_type() == at::kBool),
                    "decode attention: near must be a non-empty bool [T]");
        for (const at::Tensor* t : {k, v, kpos, qpos})
            TORCH_CHECK(t->device() == q->device(), "decode attention: tensors on different devices");
        TORCH_CHECK(!near || near->device() == q->device(), "decode attention: tensors on different devices");
        if (q->is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            TORCH_CHECK(q->scalar_type() == at::kBFloat16 && k->scalar_type() == at::kBFloat16 &&
                            v->scalar_type() == at::kBFloat16,
                        "the decode kernel takes bf16 q, k, v");
            TORCH_CHECK(q->size(3) == 64 || q->size(3) == 128, "the decode kernel takes head_dim 64 or 128");
            TORCH_CHECK(k->size(2) < INT32_MAX, "cache too long for int32 entries");
            auto qc = q->contiguous(), kc = k->contiguous(), vc = v->contiguous();
            auto out = at::empty_like(qc);
            attnsweep::cuda_decode_attention(qc, kc, vc, kpos->contiguous(), *qpos, window, sinks, near, out);
            return new at::Tensor(out);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        }
        return new at::Tensor(decode_reference(*q, *k, *v, *kpos, *qpos, window, sinks, near));
    });
}

// Begins capturing a CUDA graph: the work this thread queues until graph_end is recorded, not
// run. Returns the graph, or null with a message in err.
void* attnsweep_graph_begin(char* err, size_t err_len) {
    return guarded<void*>(err, err_len, nullptr, [&]() -> void* {
#ifdef ATTNSWEEP_CUDA
        auto g = std::make_unique<Graph>();
        // The side stream starts after the work queued so far.
        at::cuda::CUDAEvent queued;
        queued.record(g->previous);
        queued.block(g->side);
        c10::cuda::setCurrentCUDAStream(g->side);
        g->capturing = true;
        try {
            g->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        } catch (...) {
            c10::cuda::setCurrentCUDAStream(g->previous);
            throw;
        }
        return g.release();
#else
        TORCH_CHECK(false, "this kernel library was built without CUDA");
#endif
    });
}

// Ends the capture graph_begin began (whether the captured work succeeded or not: a caller
// unwinding from a failure ends it too) and restores the stream. Returns 0, or 1 with a
// message in err.
int attnsweep_graph_end(void* graph, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        auto* g = static_cast<Graph*>(graph);
        TORCH_CHECK(g->capturing, "the graph is not being captured");
        g->capturing = false;
        try {
            g->graph.capture_end();
        } catch (...) {
            c10::cuda::setCurrentCUDAStream(g->previous);
            throw;
        }
        c10::cuda::setCurrentCUDAStream(g->previous);
#endif
        return 0;
    });
}

// Runs the captured graph on the current stream. Returns 0, or 1 with a message in err.
int attnsweep_graph_replay(void* graph, char* err, size_t err_len) {
    return guarded(err, err_len, 1, [&] {
#ifdef ATTNSWEEP_CUDA
        static_cast<Graph*>(graph)->graph.replay();
#endif
        return 0;
    });
}

void attnsweep_graph_free(void* graph) {
#ifdef ATTNSWEEP_CUDA
    delete static_cast<Graph*>(graph);
#endif
}

}  // extern "C"
