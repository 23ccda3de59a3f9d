// Data-parallel training through libtorch's own distributed engine (c10d): a rendezvous store
// (TCPStore), a process group (NCCL on GPUs, Gloo on the CPU) and DDP's gradient reducer
// (c10d::Reducer), which reduces gradients in buckets as the backward produces them, each
// bucket's all-reduce overlapped with the rest of the backward, and averages them over the
// ranks. Rust drives it through the extern "C" functions below (`src/model/kernels/dist.rs`).
//
// The reducer reduces once per optimizer step: the trainer arms it before the step's last
// micro-batch (the others accumulate locally, as DDP's no_sync does), and `finish` after that
// micro-batch's backward hands zeros to every parameter the backward did not reach on this
// rank (a gate that opened nowhere in its batch leaves a router without a gradient), so each
// rank's reducer sees every parameter once and the collectives match across ranks.
//
// Gloo's own headers are not in the torch wheel; `gloo/` beside this file declares the little
// of them that ProcessGroupGloo.hpp names (every Gloo object there is held by pointer).

#include <torch/torch.h>

#define USE_C10D_GLOO
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#ifdef ATTNSWEEP_CUDA
#define USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "guard.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

// One rank's membership of the job: the store, the process group, and, once the trainer has
// named its parameters, their reducer with the marks of which parameters the armed backward
// reached.
struct Dist {
    int rank = 0, world = 1;
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::vector<at::Tensor> params;
    std::unique_ptr<c10d::Reducer> reducer;
    // Set by each parameter's post-accumulation hook while armed.
    std::shared_ptr<std::vector<char>> reached = std::make_shared<std::vector<char>>();
    std::shared_ptr<bool> armed = std::make_shared<bool>(false);
    // Keeps the gradient accumulators (and so their hooks) alive.
    std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
};

std::vector<at::Tensor> tensors_of(void* const* ts, size_t n) {
    std::vector<at::Tensor> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) out.push_back(*static_cast<at::Tensor*>(ts[i]));
    return out;
}

}  // namespace

extern "C" {

// Joins the job as `rank` of `world`: rank 0 serves the store at host:port, the others connect
// to it, all within timeout_s. device < 0: the CPU (Gloo); else that CUDA device (NCCL).
// Returns the membership, or null with a message in err.
void* attnsweep_dist_new(const char* host, int64_t port, int64_t rank, int64_t world, int64_t device,
                         double timeout_s, char* err, size_t err_len) {
    return attnsweep::guarded<void*>(err, err_len, nullptr, [&]() -> void* {
        TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of ", world, " ranks");
        TORCH_CHECK(port > 0 && port < 65536, "port ", port, " is not a TCP port");
        const auto timeout = std::chrono::milliseconds((int64_t)(timeout_s * 1000.0));
        auto d = std::make_unique<Dist>();
        d->rank = (int)rank;
        d->world = (int)world;
        c10d::TCPStoreOptions o;
        o.port = (uint16_t)port;
        o.isServer = rank == 0;
        o.numWorkers = (size_t)world;
        o.waitWorkers = true;
        o.timeout = timeout;
        d->store = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
        d->group = c10::make_intrusive<c10d::ProcessGroup>(d->store, (int)rank, (int)world);
        if (device < 0) {
            auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
            opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
            auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(d->store, (int)rank, (int)world, opts);
            d->group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
            d->group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        } else {
#ifdef ATTNSWEEP_CUDA
            c10::cuda::set_device((c10::DeviceIndex)device);
            auto opts = c10d::ProcessGroupNCCL::Options::create();
            opts->timeout = timeout;
            auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(d->store, (int)rank, (int)world, opts);
            d->group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
            d->group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
            TORCH_CHECK(false, "this kernel library was built without CUDA: GPU ranks need the CUDA build");
#endif
        }
        return d.release();
    });
}

void attnsweep_dist_free(void* dist) {
    auto* d = static_cast<Dist*>(dist);
    if (d == nullptr) return;
    d->reducer.reset();
    delete d;
}

// Ends the membership of a rank whose work is done: its backends shut down as at a normal
// exit (NCCL destroys its communicators once their work is done; a process group destroyed
// without it warns that it may leak them). Returns 0, or 1 with a message; either way the
// membership is to be freed after.
int attnsweep_dist_close(void* dist, char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        d->reducer.reset();
        d->group->shutdown();
        return 0;
    });
}

// Sums each of the n tensors over the ranks, in place. Returns 0, or 1 with a message.
int attnsweep_dist_sum(void* dist, void* const* ts, size_t n, char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        auto tensors = tensors_of(ts, n);
        for (auto& t : tensors) {
            std::vector<at::Tensor> one{t};
            d->group->allreduce(one, c10d::AllreduceOptions{})->wait();
        }
        return 0;
    });
}

// Gives every rank rank 0's values of the n tensors, in place. Returns 0, or 1 with a message.
int attnsweep_dist_broadcast(void* dist, void* const* ts, size_t n, char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        auto tensors = tensors_of(ts, n);
        c10d::BroadcastOptions o;
        o.rootRank = 0;
        for (auto& t : tensors) {
            std::vector<at::Tensor> one{t};
            d->group->broadcast(one, o)->wait();
        }
        return 0;
    });
}

// (Re)builds the reducer over the n parameters, given in the order the forward uses them:
// buckets of at most bucket_bytes (the first of at most first_bytes, so the first all-reduce
// starts early), filled in reverse, as the backward produces the gradients. Returns 0, or 1.
int attnsweep_dist_reducer(void* dist, void* const* ts, size_t n, int64_t first_bytes, int64_t bucket_bytes,
                           char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        d->reducer.reset();
        d->accumulators.clear();
        d->params = tensors_of(ts, n);
        TORCH_CHECK(!d->params.empty(), "no parameter to reduce");
        const std::vector<bool> sparse(n, false);
        auto assigned = c10d::compute_bucket_assignment_by_size(
            d->params, {(size_t)first_bytes, (size_t)bucket_bytes}, sparse);
        auto buckets = std::get<0>(assigned);
        std::reverse(buckets.begin(), buckets.end());
        std::vector<int64_t> caps;
        for (auto limit : std::get<1>(assigned)) caps.push_back((int64_t)limit);
        std::reverse(caps.begin(), caps.end());
        std::unordered_map<size_t, std::string> names;
        d->reducer = std::make_unique<c10d::Reducer>(d->params, buckets, d->group, sparse, bucket_bytes,
                                                     /*find_unused_parameters=*/false,
                                                     /*gradient_as_bucket_view=*/false, names, first_bytes,
                                                     /*skip_all_reduce_unused_params=*/false,
                                                     /*use_python_reducer=*/false, caps);
        d->reached->assign(n, 0);
        for (size_t i = 0; i < n; ++i) {
            auto acc = torch::autograd::impl::grad_accumulator(d->params[i]);
            TORCH_CHECK(acc != nullptr, "parameter ", i, " does not require a gradient");
            auto reached = d->reached;
            auto armed = d->armed;
            acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
                [reached, armed, i](const torch::autograd::variable_list& outputs,
                                    const torch::autograd::variable_list&) {
                    if (*armed) (*reached)[i] = 1;
                    return outputs;
                }));
            d->accumulators.push_back(acc);
        }
        return 0;
    });
}

// Arms the reducer for the next backward: the step's last micro-batch. Returns 0, or 1.
int attnsweep_dist_arm(void* dist, char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        TORCH_CHECK(d->reducer != nullptr, "the reducer is not built");
        // After the first reduced step, the buckets follow the order the gradients came in
        // (every rank at once: it broadcasts rank 0's order).
        d->reducer->rebuild_buckets();
        std::fill(d->reached->begin(), d->reached->end(), 0);
        *d->armed = true;
        d->reducer->prepare_for_forward();
        d->reducer->prepare_for_backward({});
        return 0;
    });
}

// After the armed backward: zeros through every parameter it did not reach (so the reducer
// sees each once), then the check that every bucket was reduced and the averaged gradients
// copied back. Writes the number of parameters given zeros to *unreached. Returns 0, or 1.
int attnsweep_dist_finish(void* dist, int64_t* unreached, char* err, size_t err_len) {
    return attnsweep::guarded(err, err_len, 1, [&] {
        auto* d = static_cast<Dist*>(dist);
        TORCH_CHECK(d->reducer != nullptr && *d->armed, "the reducer is not armed");
        std::vector<at::Tensor> zeros;
        for (size_t i = 0; i < d->params.size(); ++i) {
            if (!(*d->reached)[i]) zeros.push_back((d->params[i] * 0).sum());
        }
        *unreached = (int64_t)zeros.size();
        if (!zeros.empty()) torch::autograd::backward({at::stack(zeros).sum()});
        *d->armed = false;
        d->reducer->check_finalized();
        return 0;
    });
}

}  // extern "C"
