// A whole decoder layer of the dense families (Llama's block and its variants: Qwen3's per-head QK norms, Gemma 3's
// sandwich norms, OLMo 2's post-norms and QK norms over the projections, Granite's residual scale) in one call:
// [norm] -> q/k/v projection -> [q / k norms] -> RoPE + KV-cache store -> attention over the cache -> output projection
// [-> norm] (x scale) + residual -> [norm] -> gate/up projection -> activation-gate -> down projection [-> norm]
// (x scale) + residual.
//
// Why (issue 53): once the linears run near the memory roof (AMX tiles, the GGUF blocks expanded once a step), what is
// left of a decode step of a small model is the interpreter: ~20 torch-level calls a layer (module calls, views,
// splits, slicing cos/sin, the op calls themselves), a few microseconds each, 30 layers a step -- milliseconds against
// a step of a few. Here the layer is one call from Python; inside it the same kernels run in the same order on the
// same tensors (through the dispatcher, as the Python layer calls them), so every bit is the unfused layer's
// (tests/models/test_fused_layer.py). dense_stack runs all the layers of a forward so in one call.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using LinearParts = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);

const c10::OperatorHandle& op(const std::string& name) {
  static std::unordered_map<std::string, c10::OperatorHandle> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")).first;
  return it->second;
}

// One of our linears: y = op(x, packed, n) (+ bias). parts > 0: the integer family's op (its `parts` argument). The
// operator is looked up once per call of dense_layer / dense_stack, not once per product.
struct Lin {
  at::Tensor packed, bias;
  int64_t n = 0, parts = 0;
  const c10::OperatorHandle* handle = nullptr;
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = parts > 0 ? handle->typed<LinearParts>().call(x, packed, n, parts)
                             : handle->typed<Linear>().call(x, packed, n);
    return bias.numel() > 0 ? y + bias : y;
  }
};

// Held while a layer runs: the calls inside skip the autograd dispatch keys. Our ops have no autograd kernel, so each
// call went through torch's boxed "autograd not implemented" fallback (its arguments boxed onto a stack and unboxed
// again) and every aten op through its autograd wrapper: ~15 calls a layer, 450 a step, ~1 ms of a 1-row step of ~7
// (BENCHMARKS.md, issue 53). Our kernels are inference-only (``Target.use_kernels``), so below autograd is where the
// layer's calls belong; the call into dense_layer / dense_stack itself still meets autograd. Same kernels, same bits.
struct BelowAutograd {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autograd_dispatch_keyset_with_ADInplaceOrView};
};

// One layer from its slice of the arguments: w[0..14), names[0..4), ints[0..14), floats[0..4).
at::Tensor layer(const at::Tensor& x, const at::Tensor* w, const std::string* names, const int64_t* ints,
                 const double* floats, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc,
                 const at::Tensor& vc, const at::Tensor& pos, const at::Tensor& qpos, const at::Tensor& index) {
  Lin lin[4];
  for (int i = 0; i < 4; ++i) lin[i] = Lin{w[2 + 2 * i], w[3 + 2 * i], ints[i], ints[4 + i], &op(names[i])};
  const int64_t Hq = ints[8], Hkv = ints[9], D = ints[10], window = ints[11];
  const bool gelu = ints[12] != 0, bf16_attention = ints[13] != 0;
  const double eps = floats[0], offset = floats[1], scale = floats[2], residual_scale = floats[3];
  const int64_t B = pos.size(0), T = pos.size(1);
  static const auto norm = op("dspine_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double,
                                                                       double)>();
  static const auto rope = op("dspine_cpu::rope_store").typed<at::Tensor(at::Tensor, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>();
  using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            double);
  static const auto attend = op("dspine_cpu::attend_cache").typed<Attend>();
  static const auto attend_bf16 = op("dspine_cpu::attend_cache_bf16dp").typed<Attend>();
  static const auto silu = op("dspine_cpu::silu_mul").typed<at::Tensor(const at::Tensor&)>();
  static const auto gelu_op = op("dspine_cpu::gelu_tanh_mul").typed<at::Tensor(const at::Tensor&)>();
  const bool packed = index.numel() > 0;
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});

  // an empty norm weight: no such norm (OLMo 2 has no pre-norms); the residual scale multiplies as the Python layer
  auto maybe_norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    return weight.numel() > 0 ? norm.call(t, weight, eps, offset) : t;
  };
  auto scaled = [&](const at::Tensor& t) { return residual_scale == 1.0 ? t : t * residual_scale; };
  at::Tensor qkv = lin[0](maybe_norm(x2, w[0]));
  if (packed) qkv = at::zeros({B * T, qkv.size(1)}, qkv.options()).index_copy_(0, index, qkv);
  auto parts = qkv.split_with_sizes({Hq * D, Hkv * D, Hkv * D}, 1);
  // QK norms: per head (Qwen3, Gemma 3: a weight of head_dim) or over each whole projection (OLMo 2). Each row is
  // normed alone, so norming the spread rows of a packed forward (zeros at its padded slots stay zeros) gives the
  // valid rows' bits the Python layer gives them normed before the spread.
  auto qk_normed = [&](const at::Tensor& part, const at::Tensor& weight, int64_t heads) {
    if (weight.numel() == D) return norm.call(part.view({B, T, heads, D}), weight, eps, offset);
    return maybe_norm(part, weight).view({B, T, heads, D});
  };
  at::Tensor q = qk_normed(parts[0], w[10], Hq).contiguous();
  at::Tensor k = qk_normed(parts[1], w[11], Hkv);
  at::Tensor v = parts[2].view({B, T, Hkv, D});
  q = rope.call(q, k, v, cos, sin, kc, vc, pos);
  at::Tensor o = (bf16_attention ? attend_bf16 : attend).call(q, kc, vc, qpos, window, scale);
  if (packed) o = o.reshape({B * T, -1}).index_select(0, index);
  const at::Tensor h = x2 + scaled(maybe_norm(lin[1](o.reshape({-1, Hq * D})), w[12]));  // [post-norm]
  const at::Tensor gu = lin[2](maybe_norm(h, w[1]));
  return (h + scaled(maybe_norm(lin[3](gelu ? gelu_op.call(gu) : silu.call(gu)), w[13]))).view(x.sizes());
}

// x [..., H] (fp32, the layer's input tokens: [B, T, H], or [N, H], the valid ones of a packed forward, with `index`)
// -> the layer's output, shaped as x. Weights: ln1, ln2 (the attention's and the MLP's pre-norm weights), then per
// linear (qkv, o, gate_up, down) its packed tensor and bias, then the q and k norm weights (head_dim long: per head;
// else over the projection) and the attention's and the MLP's post-norm weights; an empty tensor: none. `names`: the
// four linears' op names; ints: the four out sizes, the four `parts`, n_heads, n_kv, head_dim, window, gelu (0: SiLU
// gate, 1: tanh-GELU gate), bf16 attention (1: the bf16 dot-product kernel). floats: eps, norm offset, attention
// scale, residual scale. cos/sin [B, T, rotary], pos / qpos [B, T] (where keys are stored / the positions queries
// attend from, -1 at a packed forward's padded slots), index [N] (flat b * T + t of the valid tokens) or an empty
// tensor.
at::Tensor dense_layer(const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<std::string>& names,
                       const std::vector<int64_t>& ints, const std::vector<double>& floats, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                       const at::Tensor& qpos, const at::Tensor& index) {
  TORCH_CHECK(w.size() == 14 && names.size() == 4 && ints.size() == 14 && floats.size() == 4, "dense_layer: arguments");
  const BelowAutograd below;
  return layer(x, w.data(), names.data(), ints.data(), floats.data(), cos, sin, kc, vc, pos, qpos, index);
}

// L such layers in a row, layer i from the i-th slice of w (14 each), names (4), ints (14), floats (4), with its own
// cos[i] / sin[i] and caches kc[i] / vc[i]: the last layer's output, then the outputs of the layers listed in `taps`
// (ascending), as the Python loop over dense_layer gives them. Why (issue 53): that loop cost 10-35 us of interpreter
// and argument conversion a layer (module call, the plan's lists rebuilt and converted, cos/sin sliced), 0.3-1 ms of
// a step of ~12; here it is one conversion a step. Same function, same order: the same bits.
std::vector<at::Tensor> dense_stack(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                    const std::vector<std::string>& names, const std::vector<int64_t>& ints,
                                    const std::vector<double>& floats, const std::vector<at::Tensor>& cos,
                                    const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& kc,
                                    const std::vector<at::Tensor>& vc, const at::Tensor& pos, const at::Tensor& qpos,
                                    const at::Tensor& index, const std::vector<int64_t>& taps) {
  const size_t L = kc.size();
  TORCH_CHECK(vc.size() == L && cos.size() == L && sin.size() == L && w.size() == 14 * L && names.size() == 4 * L &&
                  ints.size() == 14 * L && floats.size() == 4 * L,
              "dense_stack: arguments");
  const BelowAutograd below;
  std::vector<at::Tensor> out(1);
  at::Tensor h = x;
  size_t next_tap = 0;
  for (size_t i = 0; i < L; ++i) {
    h = layer(h, &w[14 * i], &names[4 * i], &ints[14 * i], &floats[4 * i], cos[i], sin[i], kc[i], vc[i], pos, qpos,
              index);
    for (; next_tap < taps.size() && taps[next_tap] == static_cast<int64_t>(i); ++next_tap) out.push_back(h);
  }
  TORCH_CHECK(next_tap == taps.size(), "dense_stack: taps must be ascending layer indices");
  out[0] = h;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("dense_layer(Tensor x, Tensor[] w, str[] names, int[] ints, float[] floats, Tensor cos, Tensor sin, "
        "Tensor(a!) kc, Tensor(b!) vc, Tensor pos, Tensor qpos, Tensor index) -> Tensor");
  m.def("dense_stack(Tensor x, Tensor[] w, str[] names, int[] ints, float[] floats, Tensor[] cos, Tensor[] sin, "
        "Tensor(a!)[] kc, Tensor(b!)[] vc, Tensor pos, Tensor qpos, Tensor index, int[] taps) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("dense_layer", &dense_layer);
  m.impl("dense_stack", &dense_stack);
}
