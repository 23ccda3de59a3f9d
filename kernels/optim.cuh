// The fused optimizer step (optim.cu), called by ops.cpp. All tensors fp32, contiguous, on
// one CUDA device.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace attnsweep {

// One AdamW step's scalars, as the kernel reads them; bc1 and bc2 are the bias corrections
// 1 - beta^t, clip the factor the gradients are scaled by (1: no clipping).
struct AdamWStep {
    float lr, beta1, beta2, eps, weight_decay, bc1, bc2, clip;
};

// sqrt(sum of squares) over all of `grads`, as a 0-d tensor on their device.
at::Tensor cuda_grad_norm(const std::vector<at::Tensor>& grads);

// Clipping and AdamW over every (p, g, m, v), in place (g keeps the clipped value).
void cuda_adamw(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                const std::vector<at::Tensor>& v, const AdamWStep& h);

}  // namespace attnsweep
