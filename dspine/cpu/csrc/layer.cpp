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
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <omp.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "team.h"

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

// ---- the team stack --------------------------------------------------------------------------------------------
// Why (issue 53): with the layers fused, a decode step of a small model still spent a fifth of its main thread
// outside the kernels -- ~11 output tensors allocated a layer, the dispatcher, torch's residual adds -- while the
// other thread waited in libgomp for the next parallel region (~40 % of its time at one row, ~25 % at eight); and
// the norms, RoPE, the SiLU gate and the adds ran on one thread. Here the whole stack runs in ONE parallel region
// over buffers allocated once: each thread takes its share of every piece (a linear's tiles, the rows of a norm,
// attention items pulled from a counter) and the threads meet at a barrier where the next piece reads what others
// wrote. Same functions on the same values in the same per-element order: the bits of the op-by-op path.
//
// Covered: layers of the plain pre-norm block (Llama's, Mistral's, SmolLM2's: no biases, QK or post norms, residual
// scale; SiLU gate) whose linears are the fp32 family's (linear.cpp: fp32, bf16, Q4_1, Q8_0 weights) or the integer
// family's (gemm_q8.cpp: q8 / q16), with fp32 caches or bf16 ones read on the fp32 path, in a forward of at most
// team::max_rows() linear rows, packed or not: the decode steps and verifies of the fp32 default on any CPU and of
// q8 / q16 where AVX512-BF16 does not take their attention. Anything else (the bf16 family, other blocks, prompts)
// takes the loop of fused layers below.
bool team_enabled = true;
std::atomic<int64_t> team_runs{0};  // forwards the team stack ran (the tests' evidence that it did)

using dspine::team::Format;

struct TeamLayer {
  const float *ln1, *ln2;
  Format fmt[4];
  int parts[4];  // the integer family's activation parts (1 or 2)
  const uint8_t* w[4];
  int64_t n[4], k[4];  // each linear's outputs and inputs
  float eps, offset, scale;
  int64_t window, cap, d;
  void *kc, *vc;  // float, or bfloat16 bits (bf16_cache)
  bool bf16_cache;
  const float *cos, *sin;
};

bool format_of(const std::string& name, Format* f) {
  if (name == "dspine_cpu::linear") *f = Format::F32;
  else if (name == "dspine_cpu::linear_bf16") *f = Format::BF16;
  else if (name == "dspine_cpu::linear_q4_1") *f = Format::Q4_1;
  else if (name == "dspine_cpu::linear_q8_0") *f = Format::Q8_0;
  else if (name == "dspine_cpu::linear_q8dp_q4_1") *f = Format::Q8DP_Q4_1;
  else if (name == "dspine_cpu::linear_q8dp_q8_0") *f = Format::Q8DP_Q8_0;
  else return false;
  return true;
}

inline bool is_f32(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous(); }

// The team's view of the stack's layers, or an empty vector when one of them (or the forward) is not covered.
std::vector<TeamLayer> team_plan(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                 const std::vector<std::string>& names, const std::vector<int64_t>& ints,
                                 const std::vector<double>& floats, const std::vector<at::Tensor>& cos,
                                 const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& kc,
                                 const std::vector<at::Tensor>& vc, const at::Tensor& pos, const at::Tensor& qpos,
                                 const at::Tensor& index, const std::vector<int64_t>& taps) {
  std::vector<TeamLayer> plan;
  const int64_t layers = static_cast<int64_t>(kc.size());
  for (size_t t = 0; t < taps.size(); ++t)  // distinct taps in order: each layer's output copied once
    if (taps[t] < 0 || taps[t] >= layers || (t > 0 && taps[t] <= taps[t - 1])) return plan;
  auto is_long = [](const at::Tensor& t) { return t.scalar_type() == at::kLong && t.is_contiguous(); };
  if (!team_enabled || !is_f32(x) || x.dim() < 2 || pos.dim() != 2 || !is_long(pos) || !is_long(qpos) ||
      qpos.sizes() != pos.sizes())
    return plan;
  const int64_t B = pos.size(0), T = pos.size(1), M = B * T, H = x.size(-1);
  const bool packed = index.numel() > 0;
  const int64_t N = packed ? index.numel() : M;  // the rows the linears run on
  if (N == 0 || N > dspine::team::max_rows() || x.numel() != N * H) return plan;
  if (packed) {  // a packed forward: x [N, H], the valid slots' flat indices, in order
    if (x.dim() != 2 || index.dim() != 1 || !is_long(index)) return plan;
    const int64_t* ip = index.data_ptr<int64_t>();
    for (int64_t j = 0; j < N; ++j)
      if (ip[j] < 0 || ip[j] >= M || (j > 0 && ip[j] <= ip[j - 1])) return plan;
  } else if (x.dim() != 3 || x.size(0) != B || x.size(1) != T || !(qpos.is_same(pos) || qpos.equal(pos))) {
    return plan;
  }
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (size_t i = 0; i < kc.size(); ++i) {
    const at::Tensor* lw = &w[14 * i];
    const int64_t* li = &ints[14 * i];
    const double* lf = &floats[4 * i];
    TeamLayer L{};
    for (int j = 0; j < 4; ++j) {
      if (!format_of(names[4 * i + j], &L.fmt[j]) || lw[3 + 2 * j].numel() > 0) return {};  // (no biases)
      L.parts[j] = static_cast<int>(li[4 + j]);
      if (dspine::team::integer(L.fmt[j]) ? L.parts[j] != 1 && L.parts[j] != 2 : L.parts[j] != 0) return {};
    }
    for (int j = 10; j < 14; ++j)
      if (lw[j].numel() > 0) return {};  // QK norms, post-norms
    const int64_t Hq = li[8], Hkv = li[9], D = li[10];
    if (Hq != ints[8] || Hkv != ints[9] || D != ints[10]) return {};  // one buffer layout for every layer's attention
    if (lw[0].numel() != H || lw[1].numel() != H || !is_f32(lw[0]) || !is_f32(lw[1]) || li[12] != 0 || li[13] != 0 ||
        lf[3] != 1.0 || Hkv <= 0 || Hq % Hkv != 0 || !dspine::team::attention_supported(D))
      return {};
    const int64_t K[4] = {H, Hq * D, H, li[2] / 2};
    for (int j = 0; j < 4; ++j) {
      L.n[j] = li[j];
      L.k[j] = K[j];
    }
    if (L.n[0] != (Hq + 2 * Hkv) * D || L.n[1] != H || L.n[2] % 2 != 0 || L.n[3] != H) return {};
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& packed_w = lw[2 + 2 * j];
      const bool fits = dspine::team::integer(L.fmt[j])
          ? dspine::team::q8_packed_matches(L.fmt[j] == Format::Q8DP_Q4_1, packed_w, L.n[j], K[j])
          : dspine::team::packed_matches(L.fmt[j], packed_w, L.n[j], K[j]);
      if (!fits) return {};
    }
    const at::Tensor &k = kc[i], &v = vc[i];
    L.bf16_cache = k.scalar_type() == at::kBFloat16;
    if (!(L.bf16_cache || k.scalar_type() == at::kFloat) || v.scalar_type() != k.scalar_type() ||
        !k.is_contiguous() || !v.is_contiguous() || k.dim() != 4 || k.sizes() != v.sizes() || k.size(0) != B ||
        k.size(1) != Hkv ||
        k.size(3) != D || !is_f32(cos[i]) || !is_f32(sin[i]) || cos[i].numel() != sin[i].numel() ||
        cos[i].numel() % std::max<int64_t>(M, 1) != 0)
      return {};
    L.cap = k.size(2);
    L.d = cos[i].numel() / M;
    if (L.d > D || L.d % 2 != 0) return {};
    for (int64_t m = 0; m < M; ++m)
      if (pp[m] < 0 || pp[m] >= L.cap) return {};  // the op path reports it
    L.ln1 = lw[0].data_ptr<float>();
    L.ln2 = lw[1].data_ptr<float>();
    for (int j = 0; j < 4; ++j) L.w[j] = static_cast<const uint8_t*>(lw[2 + 2 * j].data_ptr());
    L.eps = static_cast<float>(lf[0]);
    L.offset = static_cast<float>(lf[1]);
    L.scale = static_cast<float>(lf[2]);
    L.window = li[11];
    L.kc = k.data_ptr();
    L.vc = v.data_ptr();
    L.cos = cos[i].data_ptr<float>();
    L.sin = sin[i].data_ptr<float>();
    plan.push_back(L);
  }
  return plan;
}

// thread tid's share [lo, hi) of n items among nt
inline void share(int64_t n, int tid, int nt, int64_t* lo, int64_t* hi) {
  *lo = n * tid / nt;
  *hi = n * (tid + 1) / nt;
}

std::vector<at::Tensor> team_stack(const std::vector<TeamLayer>& plan, const at::Tensor& x, const at::Tensor& pos,
                                   const at::Tensor& qpos, const at::Tensor& index, int64_t Hq, int64_t Hkv, int64_t D,
                                   const std::vector<int64_t>& taps) {
  namespace tm = dspine::team;
  const int64_t B = pos.size(0), T = pos.size(1), M = B * T, H = x.size(-1);
  const bool packed = index.numel() > 0;
  const int64_t N = packed ? index.numel() : M;
  int64_t n0 = 0, n2 = 0;
  for (const auto& L : plan) {
    n0 = std::max(n0, L.n[0]);
    n2 = std::max(n2, L.n[2]);
  }
  const auto f32 = x.options();
  // the residual stream, its half-way point, the normed rows, the projections' outputs (N rows: the linears'); the
  // q/k/v and attention rows of every slot (M: a packed forward's spread, as the op path's index_copy_ makes it)
  at::Tensor cur = x.reshape({N, H}).clone(), h = at::empty({N, H}, f32), xn = at::empty({N, H}, f32);
  at::Tensor qkv = at::empty({N, n0}, f32), ob = at::empty({N, H}, f32), db = at::empty({N, H}, f32);
  at::Tensor gu = at::empty({N, n2}, f32), act = at::empty({N, n2 / 2}, f32), ao = at::empty({N, Hq * D}, f32);
  at::Tensor qkv_slots = packed ? at::empty({M, n0}, f32) : qkv, ao_slots = packed ? at::empty({M, Hq * D}, f32) : ao;
  std::vector<int64_t> row_of(packed ? M : 0, -1);  // slot -> its packed row (-1: padding)
  const int64_t* ip = packed ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t j = 0; j < (packed ? N : 0); ++j) row_of[ip[j]] = j;
  std::vector<at::Tensor> out(1);
  std::vector<float*> tap_at(plan.size(), nullptr);
  for (int64_t t : taps) {  // distinct, ascending (team_plan checked)
    out.push_back(at::empty(x.sizes(), f32));
    tap_at[t] = out.back().data_ptr<float>();
  }
  size_t qbytes = 0;  // the integer family's quantized input rows (one linear's at a time)
  for (const auto& L : plan)
    for (int j = 0; j < 4; ++j)
      if (tm::integer(L.fmt[j])) qbytes = std::max(qbytes, tm::q8_act_bytes(N, L.k[j], L.parts[j]));
  const auto qbuf = std::make_unique_for_overwrite<uint8_t[]>(qbytes);  // written before it is read
  uint8_t* qb = qbuf.get();
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[plan.size()]);
  for (size_t i = 0; i < plan.size(); ++i) next[i].store(0);
  float *cp = cur.data_ptr<float>(), *hp = h.data_ptr<float>(), *xp = xn.data_ptr<float>();
  float *qp = qkv.data_ptr<float>(), *ap = ao.data_ptr<float>(), *op = ob.data_ptr<float>();
  float *gp = gu.data_ptr<float>(), *tp = act.data_ptr<float>(), *dp = db.data_ptr<float>();
  float *qs = qkv_slots.data_ptr<float>(), *as = ao_slots.data_ptr<float>();
  const int64_t *pp = pos.data_ptr<int64_t>(), *qq = qpos.data_ptr<int64_t>();
  team_runs.fetch_add(1);
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    int64_t r0, r1, s0, s1;
    share(N, tid, n, &r0, &r1);  // this thread's rows, the same in every row-wise piece
    share(M, tid, n, &s0, &s1);  // and slots (RoPE and the cache store, a packed forward's spread)
    // linear j of layer L on its input rows (the integer family: on those rows quantized into qb, see quantize)
    auto tiles = [&](const TeamLayer& L, int j, const float* in, float* o) {
      int64_t t0, t1;
      const int64_t outs = L.n[j], K = L.k[j];
      if (tm::integer(L.fmt[j])) {
        share(tm::q8_panels(outs), tid, n, &t0, &t1);
        if (t0 < t1) tm::q8_panels_of(L.fmt[j] == Format::Q8DP_Q4_1, L.parts[j], qb, N, K, L.w[j], o, outs, t0, t1);
      } else {
        share(tm::tiles(outs), tid, n, &t0, &t1);
        if (t0 < t1) tm::linear_tiles(L.fmt[j], in, N, K, L.w[j], o, outs, t0, t1);
      }
    };
    // this thread's rows of linear j's input, quantized for the integer family (nothing for the fp32 family)
    auto quantize = [&](const TeamLayer& L, int j, const float* in) {
      if (tm::integer(L.fmt[j])) tm::q8_quantize_rows(in, N, L.k[j], L.parts[j], qb, r0, r1);
    };
    for (size_t i = 0; i < plan.size(); ++i) {
      const TeamLayer& L = plan[i];
      const int64_t I = L.n[2] / 2, Q = L.n[0], HD = Hq * D;
      tm::rms_norm_rows(cp, L.ln1, H, L.eps, L.offset, xp, r0, r1);
      quantize(L, 0, xp);
#pragma omp barrier
      tiles(L, 0, xp, qp);
#pragma omp barrier
      if (packed) {  // zeros at the padded slots, as index_copy_ into zeros leaves them
        for (int64_t m = s0; m < s1; ++m) {
          if (row_of[m] >= 0) std::copy(qp + row_of[m] * Q, qp + (row_of[m] + 1) * Q, qs + m * Q);
          else std::fill(qs + m * Q, qs + (m + 1) * Q, 0.f);
        }
      }
      if (L.bf16_cache)
        tm::rope_store_rows(qs, L.cos, L.sin, pp, static_cast<uint16_t*>(L.kc), static_cast<uint16_t*>(L.vc), T, Hq,
                            Hkv, D, L.cap, L.d, s0, s1);
      else
        tm::rope_store_rows(qs, L.cos, L.sin, pp, static_cast<float*>(L.kc), static_cast<float*>(L.vc), T, Hq, Hkv, D,
                            L.cap, L.d, s0, s1);
#pragma omp barrier
      if (L.bf16_cache)
        tm::attend_rows(qs, static_cast<const uint16_t*>(L.kc), static_cast<const uint16_t*>(L.vc), qq, B, T, Hq, Hkv,
                        D, L.cap, L.window, L.scale, as, next[i]);
      else
        tm::attend_rows(qs, static_cast<const float*>(L.kc), static_cast<const float*>(L.vc), qq, B, T, Hq, Hkv, D,
                        L.cap, L.window, L.scale, as, next[i]);
#pragma omp barrier
      if (packed || tm::integer(L.fmt[1])) {  // the attention's rows back in packed order, quantized
        if (packed)
          for (int64_t j = r0; j < r1; ++j) std::copy(as + ip[j] * HD, as + (ip[j] + 1) * HD, ap + j * HD);
        quantize(L, 1, ap);
#pragma omp barrier
      }
      tiles(L, 1, ap, op);
#pragma omp barrier
      for (int64_t r = r0; r < r1; ++r) {  // h = x + o (torch's fp32 add: the same rounding), then the MLP's norm
        for (int64_t c = 0; c < H; ++c) hp[r * H + c] = cp[r * H + c] + op[r * H + c];
        tm::rms_norm_rows(hp, L.ln2, H, L.eps, L.offset, xp, r, r + 1);
      }
      quantize(L, 2, xp);
#pragma omp barrier
      tiles(L, 2, xp, gp);
#pragma omp barrier
      tm::silu_rows(gp, I, tp, r0, r1);
      quantize(L, 3, tp);
#pragma omp barrier
      tiles(L, 3, tp, dp);
#pragma omp barrier
      for (int64_t r = r0; r < r1; ++r) {  // the layer's output; the next layer's norm reads only these rows
        for (int64_t c = 0; c < H; ++c) cp[r * H + c] = hp[r * H + c] + dp[r * H + c];
        if (tap_at[i] != nullptr) std::copy(cp + r * H, cp + (r + 1) * H, tap_at[i] + r * H);
      }
    }
  }
  out[0] = cur.view(x.sizes());
  return out;
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
  if (L > 0) {
    const std::vector<TeamLayer> plan = team_plan(x, w, names, ints, floats, cos, sin, kc, vc, pos, qpos, index, taps);
    if (plan.size() == L) return team_stack(plan, x, pos, qpos, index, ints[8], ints[9], ints[10], taps);
  }
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

// tests and benchmarks: the team stack on (the default) or off (the loop of fused layers); returns the setting
bool team_stack_switch(bool on) {
  team_enabled = on;
  return team_enabled;
}
int64_t team_stack_runs() { return team_runs.load(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("dense_layer(Tensor x, Tensor[] w, str[] names, int[] ints, float[] floats, Tensor cos, Tensor sin, "
        "Tensor(a!) kc, Tensor(b!) vc, Tensor pos, Tensor qpos, Tensor index) -> Tensor");
  m.def("dense_stack(Tensor x, Tensor[] w, str[] names, int[] ints, float[] floats, Tensor[] cos, Tensor[] sin, "
        "Tensor(a!)[] kc, Tensor(b!)[] vc, Tensor pos, Tensor qpos, Tensor index, int[] taps) -> Tensor[]");
  m.def("team_stack(bool on) -> bool", &team_stack_switch);
  m.def("team_stack_runs() -> int", &team_stack_runs);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("dense_layer", &dense_layer);
  m.impl("dense_stack", &dense_stack);
}
