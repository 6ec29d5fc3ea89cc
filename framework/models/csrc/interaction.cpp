// DLRM's pairwise interaction as one autograd function on CPU tensors (fp32, bf16 or fp16):
// `[d, <x_i, x_j> for i < j]` over `x = [d, e_0, ..]`, the pairs in `triu_indices` order.
//
// Forward: the Gram matrix `X X^T` (one batched product), then each sample's output row is
// written in one pass: `d`, then row `i` of the Gram matrix right of its diagonal, for each `i`
// (the upper triangle's rows are contiguous). Backward: the pairs' gradient is written into
// both mirrored entries of a symmetric `G` (zero diagonal), and the inputs' gradient is the one
// batched product `G X` (the Gram matrix's gradient is `(H + H^T) X` for the upper-triangle
// gradient `H`). libtorch's gather / scatter_add, which the same computation takes through
// autograd, cast bf16 to fp32 buffers and back; these loops only copy values.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdio>
#include <cstring>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Interaction : public torch::autograd::Function<Interaction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& d, const at::Tensor& emb) {
    const auto all = at::cat({d.unsqueeze(1), emb}, 1).contiguous();  // [B, n, D]
    const auto gram = at::bmm(all, all.transpose(1, 2)).contiguous();  // [B, n, n]
    const int64_t batch = all.size(0), n = all.size(1), dim = all.size(2), pairs = n * (n - 1) / 2;
    auto out = at::empty({batch, dim + pairs}, all.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, all.scalar_type(), "trainrec_interaction", [&] {
      const scalar_t* x = all.const_data_ptr<scalar_t>();
      const scalar_t* g = gram.const_data_ptr<scalar_t>();
      scalar_t* o = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, batch, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          scalar_t* row = o + b * (dim + pairs);
          std::memcpy(row, x + b * n * dim, dim * sizeof(scalar_t));  // d is x's first row
          const scalar_t* gb = g + b * n * n;
          int64_t k = dim;
          for (int64_t i = 0; i + 1 < n; ++i) {
            std::memcpy(row + k, gb + i * n + i + 1, (n - 1 - i) * sizeof(scalar_t));
            k += n - 1 - i;
          }
        }
      });
    });
    ctx->save_for_backward({all});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto all = ctx->get_saved_variables()[0];
    const auto grad = grads[0].contiguous();
    const int64_t batch = all.size(0), n = all.size(1), dim = all.size(2), pairs = n * (n - 1) / 2;
    auto sym = at::empty({batch, n, n}, grad.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "trainrec_interaction_grad", [&] {
      const scalar_t* gr = grad.const_data_ptr<scalar_t>();
      scalar_t* s = sym.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, batch, 16, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const scalar_t* gp = gr + b * (dim + pairs) + dim;
          scalar_t* sb = s + b * n * n;
          int64_t k = 0;
          for (int64_t i = 0; i < n; ++i) {
            sb[i * n + i] = scalar_t(0);
            for (int64_t j = i + 1; j < n; ++j, ++k) {
              sb[i * n + j] = gp[k];
              sb[j * n + i] = gp[k];
            }
          }
        }
      });
    });
    const auto grad_all = at::bmm(sym, all);  // [B, n, D]
    auto grad_d = grad_all.select(1, 0) + grad.narrow(1, 0, dim);
    auto grad_emb = grad_all.narrow(1, 1, n - 1);
    return {grad_d, grad_emb};
  }
};

}  // namespace

extern "C" {

// `*out` = the interaction of `d` [B, D] and `emb` [B, F, D] (CPU, same floating dtype), with
// autograd when either needs a gradient. Returns 0, or -1 with libtorch's message in `err`.
int trainrec_dlrm_interaction(const at::Tensor* d, const at::Tensor* emb, at::Tensor** out, char* err,
                              size_t err_len) {
  try {
    *out = new at::Tensor(Interaction::apply(*d, *emb));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return -1;
  }
}

}  // extern "C"
