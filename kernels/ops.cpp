// The autograd layer between Rust and the kernels: a torch::autograd::Function whose forward
// and backward call the CUDA kernels for CUDA tensors and a reference written with ATen ops
// for CPU tensors (the same maths, so CI exercises this layer without a GPU), exposed as an
// extern "C" function on at::Tensor* that Rust loads at run time.
//
// Semantics (see attention.cu): query r of (b, h) sits at position qpos[b, h, r] (or r) and
// attends keys k <= pos with pos - k < window; rows r >= nq[b, h] are inactive and give zeros.
// Inside this file the dense form carries empty qpos and nq tensors (autograd functions take
// no undefined tensors).

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <string>

#ifdef ATTNSWEEP_CUDA
#include "attention.cuh"
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Positions [B, H, Lq] (int64) and an active-row mask [B, H, Lq] for either form.
std::pair<at::Tensor, at::Tensor> positions(const at::Tensor& q, const at::Tensor& qpos, const at::Tensor& nq) {
    const auto B = q.size(0), H = q.size(1), Lq = q.size(2);
    auto rows = at::arange(Lq, q.options().dtype(at::kLong)).view({1, 1, Lq}).expand({B, H, Lq});
    if (qpos.numel() == 0) return {rows, at::ones({B, H, Lq}, q.options().dtype(at::kBool))};
    return {qpos.to(at::kLong), rows < nq.to(at::kLong).unsqueeze(-1)};
}

// Visibility [B, H, Lq, L] of every (query, key) pair.
at::Tensor visibility(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qpos, const at::Tensor& nq, int64_t window) {
    auto [pos, active] = positions(q, qpos, nq);
    auto keys = at::arange(k.size(2), q.options().dtype(at::kLong)).view({1, 1, 1, -1});
    auto p = pos.unsqueeze(-1);
    return (keys <= p) & ((p - keys) < window) & active.unsqueeze(-1);
}

at::Tensor expand_kv(const at::Tensor& t, int64_t heads) {
    return t.repeat_interleave(heads / t.size(1), 1);
}

// Reference forward in fp32: returns (out, lse), zeros and -inf for inactive rows.
std::pair<at::Tensor, at::Tensor> reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& qpos, const at::Tensor& nq, int64_t window) {
    const double scale = 1.0 / std::sqrt((double)q.size(3));
    auto kf = expand_kv(k, q.size(1)).to(at::kFloat), vf = expand_kv(v, q.size(1)).to(at::kFloat);
    auto s = at::matmul(q.to(at::kFloat), kf.transpose(-1, -2)) * scale;
    auto vis = visibility(q, k, qpos, nq, window);
    s = s.masked_fill(vis.logical_not(), -INFINITY);
    auto lse = at::logsumexp(s, -1);
    auto p = at::exp(s - lse.unsqueeze(-1)).nan_to_num(0.0);
    return {at::matmul(p, vf), lse};
}

// Reference backward: the same formulas as the kernels (dS = P (dP - delta)).
variable_list reference_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qpos,
                                 const at::Tensor& nq, int64_t window, const at::Tensor& lse, const at::Tensor& delta,
                                 const at::Tensor& dout) {
    const double scale = 1.0 / std::sqrt((double)q.size(3));
    const auto heads = q.size(1), group = heads / k.size(1);
    auto qf = q.to(at::kFloat), dof = dout.to(at::kFloat);
    auto kf = expand_kv(k, heads).to(at::kFloat), vf = expand_kv(v, heads).to(at::kFloat);
    auto vis = visibility(q, k, qpos, nq, window);
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

struct ListAttention : public torch::autograd::Function<ListAttention> {
    static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor qpos,
                                 at::Tensor nq, int64_t window) {
        at::Tensor out, lse;
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            out = at::empty_like(q);
            lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
            const bool list = qpos.numel() > 0;
            attnsweep::cuda_forward(q, k, v, list ? &qpos : nullptr, list ? &nq : nullptr, window, out, lse);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA; run `attnsweep kernels build`");
#endif
        } else {
            auto r = reference_forward(q, k, v, qpos, nq, window);
            out = r.first.to(q.scalar_type());
            lse = r.second;
        }
        ctx->save_for_backward({q, k, v, qpos, nq, out, lse});
        ctx->saved_data["window"] = window;
        return {out};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto s = ctx->get_saved_variables();
        const auto &q = s[0], &k = s[1], &v = s[2], &qpos = s[3], &nq = s[4], &out = s[5], &lse = s[6];
        const int64_t window = ctx->saved_data["window"].toInt();
        auto dout = grads[0].contiguous();
        auto delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
        variable_list g;
        if (q.is_cuda()) {
#ifdef ATTNSWEEP_CUDA
            auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
            const bool list = qpos.numel() > 0;
            attnsweep::cuda_backward(q, k, v, list ? &qpos : nullptr, list ? &nq : nullptr, window, lse, delta, dout, dq, dk,
                                     dv);
            g = {dq, dk, dv};
#endif
        } else {
            g = reference_backward(q, k, v, qpos, nq, window, lse, delta, dout);
        }
        return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

void write_error(char* err, size_t len, const std::string& msg) {
    if (!err || len == 0) return;
    std::strncpy(err, msg.c_str(), len - 1);
    err[len - 1] = '\0';
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qpos, const at::Tensor& nq,
                  int64_t window) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, H, L, D]");
    TORCH_CHECK(k.sizes() == v.sizes(), "k and v differ in shape");
    TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q and k differ in batch or head_dim");
    TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of key-value heads");
    TORCH_CHECK(window >= 1, "window must be at least 1");
    TORCH_CHECK(q.device() == k.device() && k.device() == v.device(), "q, k, v on different devices");
    if (qpos.numel() > 0 || nq.numel() > 0) {
        TORCH_CHECK(qpos.scalar_type() == at::kInt && nq.scalar_type() == at::kInt, "qpos and nq must be int32");
        TORCH_CHECK(qpos.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2)}), "qpos must be [B, H, Lq]");
        TORCH_CHECK(nq.sizes() == at::IntArrayRef({q.size(0), q.size(1)}), "nq must be [B, H]");
    } else {
        TORCH_CHECK(q.size(2) == k.size(2), "dense queries need Lq == L");
    }
    if (q.is_cuda()) {
        TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
                    "the CUDA kernels take bf16 q, k, v");
        TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "the CUDA kernels take head_dim 64 or 128");
        TORCH_CHECK(k.size(2) < INT32_MAX && q.size(2) < INT32_MAX, "sequence too long for int32 positions");
    }
}

}  // namespace

extern "C" {

// Version of this C interface; Rust refuses a library whose version differs.
int64_t attnsweep_kernels_abi() { return 1; }

// Whether the library was built with the CUDA kernels.
int attnsweep_kernels_cuda() {
#ifdef ATTNSWEEP_CUDA
    return 1;
#else
    return 0;
#endif
}

// out = attention of q over (k, v) for the query list (qpos, nq may be null: dense), with
// autograd. Returns a new at::Tensor* (the caller owns it), or null with a message in err.
void* attnsweep_list_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* qpos,
                               const at::Tensor* nq, int64_t window, char* err, size_t err_len) {
    try {
        TORCH_CHECK((qpos == nullptr) == (nq == nullptr), "qpos and nq come together");
        auto none = at::empty({0}, q->options().dtype(at::kInt));
        at::Tensor qp = qpos ? qpos->contiguous() : none, n = nq ? nq->contiguous() : none;
        check_inputs(*q, *k, *v, qp, n, window);
        auto out = ListAttention::apply(q->contiguous(), k->contiguous(), v->contiguous(), qp, n, window);
        return new at::Tensor(out[0]);
    } catch (const c10::Error& e) {
        write_error(err, err_len, e.what_without_backtrace());
        return nullptr;
    } catch (const std::exception& e) {
        write_error(err, err_len, e.what());
        return nullptr;
    }
}

}  // extern "C"
