// Modes `full` and `block`: Attention Residuals (SPEC sections 2-4).
//
// Full AttnRes is Block AttnRes with one sublayer per block, so one implementation serves both.
// Sublayer l (0-based) lies in block n = l / S at index k = l % S. Its sources are the embedding,
// the completed block sums B_0..B_{n-1} and, for k > 0, the partial sum P of block n so far; the
// output mix reads the embedding and every block sum (SPEC 3). Each source's per-token inverse RMS
// is computed once, when the source is formed, and shared by every later reader (SPEC 2).
//
// Backward: dL/d(out of sublayer (n,k)) = dL/dB_n + sum_{i>k} dL/dP^(i), kept in B_n's gradient
// buffer, which the partial sums' gradients are added to as the pass moves back.
//
// All buffers and ops are the backend's (attnres/backend.hpp), the same calls on every backend.
// Full AttnRes with static queries runs its backward by source (below, the backend's
// depth_source_backward).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "model/routers.hpp"
#include "ops/ops.hpp"

namespace attnres {

namespace {

class AttnResRouter final : public DepthRouter {
 public:
  AttnResRouter(const ModelConfig& c, Backend* be)
      : be_(be ? *be : *cpu_backend()),
        L_(c.n_sublayers()),
        d_(c.d_model),
        // (a block larger than the model is one block of all its sublayers: the same function,
        // without S buffers for sublayers that do not exist; 2^20 of them took 16 GB)
        S_(std::min(c.residual.effective_block_size(), c.n_sublayers())),
        window_(c.residual.window),
        dynamic_(c.residual.query == DepthQuery::dynamic),
        eps_(static_cast<float>(c.key_norm_eps())),
        tau_(static_cast<float>(c.residual.temperature)) {
    mix_.d = d_;
    mix_.H = c.residual.heads;
    mix_.softmax = c.residual.gate == DepthGate::softmax;
    mix_.key_norm = c.residual.key_norm == KeyNorm::rms;
    mix_.eps = eps_;
    NB_ = (L_ + S_ - 1) / S_;
    // Two-phase needs queries known before the block starts and one softmax over a fixed set of
    // completed blocks: softmax gate, static query, no window.
    two_phase_ = c.residual.two_phase && mix_.softmax && !dynamic_ && window_ == 0 && S_ > 1;
    // Full AttnRes with static queries: backward by source (see begin_backward), and the forward
    // in groups of mixers that share one pass over the older sources (prepare_grouped).
    // Block AttnRes with static queries and no window, on the CPU: the block sums backward by
    // source too, each partial sum (read by one mixer) by that mixer. (On an H200 that was
    // slower than by mixer: 4.7 against 3.2 ms a step at the 124M shape; docs/BENCHMARKS.md.)
    by_source_ =
        !dynamic_ && (S_ == 1 ? window_ == 0 || window_ >= L_ : window_ == 0 && be_.is_cpu());
    group_ = S_ == 1 && by_source_ && c.residual.two_phase && mix_.softmax ? kFullGroup : 1;
    last_ = L_;
    own_.be = &be_;
    qg_.on(&be_);
    dqg_.on(&be_);
  }

  bool supports_stages() const override { return true; }
  int64_t boundary_sources(int64_t l) const override { return 1 + (l + S_ - 1) / S_; }
  int64_t source_block_size() const override { return S_; }

  void set_stage(int64_t first, int64_t last) override {
    check(first >= 0 && first < last && last <= L_ && first % S_ == 0 &&
              (last % S_ == 0 || last == L_),
          "internal: stage [" + std::to_string(first) + ", " + std::to_string(last) +
              ") does not lie on block boundaries of size " + std::to_string(S_));
    first_ = first;
    last_ = last;
    stage_ = true;
    by_source_ = false;  // later readers of a source live on other ranks: backward by mixer
  }

  void bind_store(SourceStore* store) override {
    st_ = store ? store : &own_;
    check((st_->be ? st_->be : cpu_backend().get()) == &be_,
          "internal: a depth-source store on another backend than its router");
  }

  void add_params(ParamLayout& layout) override {
    for (int64_t m = 0; m <= L_; m++) {
      const std::string p = mixer_prefix(m, L_);
      layout.add(p + "query", {d_}, false);
      if (mix_.key_norm) layout.add(p + "key_norm.weight", {d_}, false);
      if (dynamic_) layout.add(p + "query_proj.weight", {d_, d_}, false);
    }
  }

  void bind(const ParamLayout& layout, float* params, float* grads) override {
    params_ = params;
    grads_ = grads;
    off_.assign(L_ + 1, {});
    for (int64_t m = 0; m <= L_; m++) {
      const std::string p = mixer_prefix(m, L_);
      off_[m].query = layout.find(p + "query")->offset;
      if (mix_.key_norm) off_[m].gain = layout.find(p + "key_norm.weight")->offset;
      if (dynamic_) off_[m].proj = layout.find(p + "query_proj.weight")->offset;
    }
  }

  void init_params(float* params) const override {
    for (int64_t m = 0; m <= L_; m++) {
      std::fill_n(params + off_[m].query, d_, 0.0f);  // SPEC 2: pseudo-queries start at zero
      if (off_[m].gain >= 0) std::fill_n(params + off_[m].gain, d_, 1.0f);
      if (off_[m].proj >= 0) std::fill_n(params + off_[m].proj, d_ * d_, 0.0f);
    }
  }

  // ---------------------------------------------------------------- forward
  void begin(const float* emb, int64_t n) override {
    set_storage();
    alloc(n);
    Source& e = st_->ensure(0, n, d_, mix_.H);
    be_.copy(e.v.data(), emb, sizeof(float) * n * d_);
    start_pass();
  }

  void begin_stage(int64_t n) override {
    check(stage_ && first_ > 0, "internal: begin_stage() on a router that is not a later stage");
    set_storage();
    alloc(n);
    for (int64_t id = 0; id < boundary_sources(first_); id++) {
      check(st_->has(id), "internal: pipeline stage at sublayer " + std::to_string(first_) +
                              " is missing depth source " + std::to_string(id));
    }
    start_pass();
  }

  // Inverse RMS of the sources that arrived without it; folded queries; the first input.
  void start_pass() {
    for (int64_t id = 0; id < boundary_sources(first_); id++) {
      Source& s = st_->e[static_cast<size_t>(id)];
      if (mix_.key_norm && !s.has_rstd)
        be_.depth_rstd(s.r.data(), s.v.data(), n_, d_, mix_.H, eps_);
      s.has_rstd = true;
      if (!s.has_bf16) round_to_bf16(s);
    }
    // Static queries fold the key-norm gain in once per pass: (w * g) . v_hat (SPEC 2 identity).
    if (!dynamic_) {
      qg_.resize((L_ + 1) * d_);
      for (int64_t m = 0; m <= L_; m++) {
        const float* w = params_ + off_[m].query;
        float* qg = qg_.data() + m * d_;
        if (mix_.key_norm) {
          be_.mul(qg, w, params_ + off_[m].gain, d_);
        } else {
          be_.copy(qg, w, sizeof(float) * d_);
        }
        if (tau_ != 1.0f) be_.scale(qg, tau_, d_);  // score temperature: s = tau q . k
      }
    }
    prepare_input(first_);
  }

  const float* input(int64_t l) override { return xin_[l].data(); }
  // The first sublayer of a block writes straight into the source it forms (no copy); later ones
  // write to scratch, which commit_output adds to the partial sum.
  float* output_slot(int64_t l) override { return l % S_ == 0 ? formed(l).v.data() : out_.data(); }

  void commit_output(int64_t l) override {
    const int64_t k = l % S_, N = n_, nd = n_ * d_;
    // The partial sum including this output: P^(k+1) = P^(k) + out (P^(0) = 0).
    Source& dst = formed(l);
    float* p = dst.v.data();
    if (k != 0) be_.add(p, part_[l].v.data(), out_.data(), nd);
    if (mix_.key_norm) be_.depth_rstd(dst.r.data(), p, N, d_, mix_.H, eps_);
    dst.has_rstd = true;
    round_to_bf16(dst);
    if (l + 1 < last_) {
      prepare_input(l + 1);
    } else if (l + 1 == L_) {
      mix_forward(L_, final_.data(), lse_[L_].data());
    }
  }

  const float* final_hidden() override { return final_.data(); }

  // ---------------------------------------------------------------- backward
  // Two backward schemes. By mixer (dynamic queries, a window, pipeline stages): each mixer's
  // backward adds into the gradients of all its sources as soon as its dx is known. By source
  // (static queries): each mixer only keeps its dx and D = dx . x; a source's gradient is formed
  // when the pass reaches the sublayer that produced it (grad_output), from every mixer that read
  // it, in one pass per reader over memory instead of three (read v, read and write dv). Full
  // AttnRes: the same memory, (L+1) stored dx buffers replace the L per-source gradient buffers
  // and the scratch. Block AttnRes: a block sum B_n is formed at its block's last sublayer from
  // the later blocks' mixers, and each partial sum, read by its own mixer only, goes by that
  // mixer at commit_grad_input; the dx buffers come on top of the block sums' gradients.
  void begin_backward(const float* dh) override {
    const int64_t nd = n_ * d_;
    if (by_source_) {
      alloc_by_source();
      be_.copy(dxs_[L_].data(), dh, sizeof(float) * nd);
      be_.depth_dx_dot(D_[L_].data(), dxs_[L_].data(), final_.data(), mix_, n_);
      dq_all_.on(&be_).assign_zero(static_cast<size_t>((L_ + 1) * d_));
      return;
    }
    if (!stage_) {  // a stage's store gradients already hold what later stages added
      for (int64_t id = 0; id <= NB_; id++) {
        be_.zero(st_->e[static_cast<size_t>(id)].g.data(), sizeof(float) * nd);
      }
    }
    mix_backward(L_, dh, final_.data(), lse_[L_].data());
  }

  void begin_backward_stage() override {
    check(stage_ && last_ < L_,
          "internal: begin_backward_stage() on a router that is not an "
          "earlier stage");
  }

  // dL/d out_l = dL/dB_n + sum_{i>k} dL/dP^(i). The partial sums' gradients are accumulated
  // straight into B_n's gradient buffer (complete before block n's backward starts, and read by
  // nothing after), which therefore holds exactly that running sum.
  const float* grad_output(int64_t l) override {
    if (!by_source_) return blk(l / S_).g.data();
    if (S_ > 1) {  // B_n's gradient from the later blocks' mixers; the partials' added below
      const int64_t n = l / S_;
      if (last_in_block(l))
        source_backward(blk(n).g.data(), blk(n), std::min((n + 1) * S_, L_), L_);
      return blk(n).g.data();
    }
    // Sublayer l's output is source block l, read by mixers l+1..L. Sources go in groups of
    // back_group_ (from the top): the group's first, l = head, takes readers head+1..L for all
    // of them in one pass over those readers' dx; each later one, l = head - i, adds the readers
    // inside the group (l+1..head), whose dx exist only now, to its part from that pass.
    const int64_t G = back_group_, head = L_ - 1 - (L_ - 1 - l) / G * G, i = head - l;
    if (i > 0) {
      source_backward(dv_cur_.data(), blk(l), l + 1, head);
      be_.add(dv_cur_.data(), dv_cur_.data(), dv_part_[static_cast<size_t>(i - 1)].data(), n_ * d_);
      return dv_cur_.data();
    }
    const int64_t n = std::min(G, l + 1);
    std::vector<float*> dv{dv_cur_.data()};
    std::vector<ops::DepthSource> src;
    for (int64_t j = 0; j < n; j++) {
      if (j > 0) dv.push_back(dv_part_[static_cast<size_t>(j - 1)].data());
      src.push_back({blk(l - j).v.data(), blk(l - j).r.data(), nullptr, bf16_of(blk(l - j))});
    }
    const std::vector<ops::DepthReader> rd = readers(l + 1, L_);
    be_.depth_sources_backward(dv.data(), src.data(), n, rd.data(), static_cast<int64_t>(rd.size()),
                               dq_all_.data() + (l + 1) * d_, mix_, n_);
    return dv_cur_.data();
  }

  float* grad_input_slot(int64_t l) override {
    float* dx = by_source_ ? dxs_[l].data() : dx_.data();
    be_.zero(dx, sizeof(float) * n_ * d_);
    return dx;
  }

  void commit_grad_input(int64_t l) override {
    if (by_source_) {
      be_.depth_dx_dot(D_[l].data(), dxs_[l].data(), xin_[l].data(), mix_, n_);
      if (S_ > 1 && l % S_ != 0) {  // the partial sum P^(k), read by this mixer alone
        const ops::DepthSource p{part_[l].v.data(), part_[l].r.data(), blk(l / S_).g.data(),
                                 bf16_of(part_[l])};
        be_.depth_mix_backward(dq_all_.data() + l * d_, dxs_[l].data(), xin_[l].data(),
                               lse_[l].data(), &p, 1, qg_.data() + l * d_, 0, mix_, n_);
      }
      return;
    }
    // The partial source P^(k)'s gradient lands in B_n's gradient, turning it into dL/d out_{l-1}.
    mix_backward(l, dx_.data(), xin_[l].data(), lse_[l].data());
  }

  const float* grad_embedding() override {
    if (!by_source_) return emb().g.data();
    source_backward(emb().g.data(), emb(), 0, L_);  // read by every mixer
    // The first mixer reads the embedding alone: a softmax over one source is 1 whatever the
    // query, so its query's gradient is zero, not the rounding noise of a . (dx . v - dx . x)
    // (which Adam turns into steps of about lr, and which differed by backend).
    if (mix_.softmax) be_.zero(dq_all_.data(), sizeof(float) * d_);
    // The readers' query gradients, summed over the sources by the backend.
    for (int64_t m = 0; m <= L_; m++) accumulate_query_grad(m, dq_all_.data() + m * d_);
    return emb().g.data();
  }

  bool depth_weights(std::vector<std::vector<double>>& w, std::vector<std::string>& rows,
                     std::vector<std::string>& cols) override {
    if (stage_) return false;  // a stage holds only its own mixers' inputs
    // A host-side diagnostic: on a device, host copies of the sources (each once) and queries.
    std::map<const float*, std::vector<float>> copies;
    auto host = [&](const float* p, int64_t n, bool once) -> const float* {
      if (p == nullptr) return p;
      auto it = copies.find(p);
      if (it == copies.end() || !once) {
        it = copies.insert_or_assign(p, std::vector<float>(static_cast<size_t>(n))).first;
        be_.download(it->second.data(), p, sizeof(float) * n);
      }
      return it->second.data();
    };
    cols = {"emb"};
    for (int64_t j = 0; j < NB_; j++) {
      cols.push_back(S_ == 1 ? mixer_label(j, L_) : "block" + std::to_string(j));
    }
    if (S_ > 1) cols.push_back("partial");
    rows.clear();
    w.assign(L_ + 1, std::vector<double>(cols.size(), std::nan("")));
    for (int64_t m = 0; m <= L_; m++) {
      rows.push_back(mixer_label(m, L_));
      auto src = sources(m);
      const auto idx = source_columns(m);
      int64_t q_ld = 0;
      const float* qd = query(m, src, &q_ld);  // sets q_ld
      const float* q = host(qd, q_ld ? n_ * d_ : d_, false);
      for (auto& s : src) {
        s = {host(s.v, n_ * d_, true), host(s.rstd, n_ * mix_.H, true), nullptr};
      }
      std::vector<double> sum(src.size(), 0.0);
      ops::depth_mix_weights(sum.data(), src.data(), static_cast<int64_t>(src.size()), q, q_ld,
                             mix_, n_);
      for (size_t i = 0; i < src.size(); i++) {
        w[m][idx[i]] = sum[i] / static_cast<double>(n_ * mix_.H);
      }
    }
    return true;
  }

  int64_t activation_bytes(int64_t n) const override {
    const int64_t H = mix_.H;
    const int64_t sources = 1 + NB_ + L_;  // embedding, blocks, partials (upper bound)
    const int64_t per_row = sources * (2 * d_ + H) + L_ * (d_ + H) + 4 * d_ +
                            (two_phase_ ? S_ * (d_ + H) : 0) + (group_ - 1) * (d_ + H) +
                            (by_source_ && S_ > 1 ? (L_ + 1) * (d_ + H) : 0) +
                            (bf16_ ? sources * d_ / 2 : 0);  // (bf16 copies: half a float each)
    return static_cast<int64_t>(sizeof(float)) * n * per_row;
  }

 private:
  using Source = SourceStore::Entry;  // value (n,d), inverse RMS (n,H), gradient (n,d)
  using Buf = DevBuf<float>;
  struct Offsets {
    int64_t query = -1, gain = -1, proj = -1;
  };

  Source& emb() { return st_->e[0]; }
  Source& blk(int64_t b) { return st_->e[static_cast<size_t>(1 + b)]; }
  bool last_in_block(int64_t l) const { return l % S_ == S_ - 1 || l == L_ - 1; }
  // The source sublayer l's output completes: its block's sum, or the next partial sum.
  Source& formed(int64_t l) { return last_in_block(l) ? blk(l / S_) : part_[l + 1]; }

  void alloc(int64_t n) {
    n_ = n;
    const size_t nd = static_cast<size_t>(n * d_), nh = static_cast<size_t>(n * mix_.H);
    auto fit = [&](Source& s, bool grad) {
      s.v.on(&be_).resize(nd);
      s.r.on(&be_).resize(nh);
      if (grad) s.g.on(&be_).resize(nd);
      s.present = true;
      s.has_rstd = s.has_bf16 = false;  // this pass's values come
    };
    if (!stage_) {  // the router's own sources, gradients zeroed by begin_backward
      own_.e.resize(static_cast<size_t>(NB_ + 1));
      fit(own_.e[0], true);
      for (int64_t b = 0; b < NB_; b++) fit(blk(b), !by_source_ || S_ > 1);
    } else {  // the stage's own blocks; the pipeline put the earlier ones in the store
      for (int64_t b = first_ / S_; b < (last_ + S_ - 1) / S_; b++) {
        st_->ensure(1 + b, n, d_, mix_.H);
      }
    }
    // Per-sublayer state only for this stage's sublayers (all of them outside pipelines).
    auto grow = [&](Buf& b, size_t size) { b.on(&be_).resize(size); };
    part_.resize(L_);
    xin_.resize(L_);
    lse_.resize(L_ + 1);
    for (int64_t l = first_; l < last_; l++) {
      if (l % S_ != 0) fit(part_[l], false);  // partial before sublayer l exists for k > 0
      grow(xin_[l], nd);
      grow(lse_[l], nh);
    }
    if (last_ == L_) {
      grow(lse_[L_], nh);
      grow(final_, nd);
    }
    if (S_ > 1) grow(out_, nd);      // (S == 1 never uses it)
    if (!by_source_) grow(dx_, nd);  // (the by-source buffers come with the backward)
    if (dynamic_) {
      grow(qdyn_, nd);
      grow(qraw_, nd);
      grow(dq_, nd);
    }
    if (two_phase_) {
      o1_.resize(S_);
      lse1_.resize(S_);
      for (auto& o : o1_) grow(o, nd);
      for (auto& o : lse1_) grow(o, nh);
    }
    if (group_ > 1) {  // (the group's first mixer writes its own input: no slot 0)
      o1_.resize(group_);
      lse1_.resize(group_);
      for (int64_t k = 1; k < group_; k++) {
        grow(o1_[k], nd);
        grow(lse1_[k], nh);
      }
    }
  }

  // The by-source backward's buffers: every mixer's dx (N,d) and D (N,H), the current source's
  // gradient. Allocated by the first backward (a forward-only run, as generation, needs none).
  void alloc_by_source() {
    const size_t nd = static_cast<size_t>(n_ * d_), nh = static_cast<size_t>(n_ * mix_.H);
    dxs_.resize(L_ + 1);
    for (auto& x : dxs_) x.on(&be_).resize(nd);
    D_.resize(L_ + 1);
    for (auto& x : D_) x.on(&be_).resize(nh);
    if (S_ > 1) return;  // (block sums: their gradient buffers)
    dv_cur_.on(&be_).resize(nd);
    // (grouped on the CPU, whose depth_sources_backward fuses the group's pass over dx)
    back_group_ = be_.is_cpu() ? kBackGroup : 1;
    dv_part_.resize(static_cast<size_t>(back_group_ - 1));
    for (auto& x : dv_part_) x.on(&be_).resize(nd);
  }

  // bf16 storage (--precision bf16 on a device): each source is also rounded to bf16 once, when
  // it is formed, and every depth mix reads that copy (half the traffic of the O(L^2) reads;
  // scores, mixes and gradients still accumulate in fp32; the key norm's inverse RMS comes from
  // the fp32 values). The CPU's depth ops read the fp32 sources: bf16 there is the linear layers'.
  void set_storage() { bf16_ = be_.matmul_precision() == MatmulPrecision::bf16 && !be_.is_cpu(); }
  void round_to_bf16(Source& s) {
    if (!bf16_) return;
    s.vb.on(&be_).resize(static_cast<size_t>(n_ * d_));
    be_.to_bf16(s.vb.data(), s.v.data(), n_ * d_);
    s.has_bf16 = true;
  }
  const uint16_t* bf16_of(const Source& s) const { return bf16_ ? s.vb.data() : nullptr; }

  // Sources of mixer m (m == L_: the output mix), with gradient accumulators.
  std::vector<ops::DepthSource> sources(int64_t m, bool completed_only = false) {
    std::vector<ops::DepthSource> s;
    const int64_t nb = m == L_ ? NB_ : m / S_;
    for (int64_t j = 0; j < nb; j++) {
      s.push_back({blk(j).v.data(), blk(j).r.data(), blk(j).g.data(), bf16_of(blk(j))});
    }
    if (m < L_ && m % S_ != 0 && !completed_only) {
      s.push_back({part_[m].v.data(), part_[m].r.data(), blk(m / S_).g.data(), bf16_of(part_[m])});
    }
    if (window_ > 0 && static_cast<int64_t>(s.size()) > window_) {
      s.erase(s.begin(), s.end() - window_);
    }
    s.insert(s.begin(), {emb().v.data(), emb().r.data(), emb().g.data(), bf16_of(emb())});
    return s;
  }

  // Column (as in depth_weights) of each of sources(m): emb 0, block j 1 + j, partial NB + 1.
  std::vector<size_t> source_columns(int64_t m) const {
    std::vector<size_t> c;
    const int64_t nb = m == L_ ? NB_ : m / S_;
    for (int64_t j = 0; j < nb; j++) c.push_back(1 + j);
    if (m < L_ && m % S_ != 0) c.push_back(1 + NB_);
    if (window_ > 0 && static_cast<int64_t>(c.size()) > window_)
      c.erase(c.begin(), c.end() - window_);
    c.insert(c.begin(), 0);
    return c;
  }

  // Query (times gain) for mixer m: shared (d) for static queries, per token for dynamic ones.
  const float* query(int64_t m, const std::vector<ops::DepthSource>& src, int64_t* q_ld) {
    if (!dynamic_) {
      *q_ld = 0;
      return qg_.data() + m * d_;
    }
    // q_n = w + W u_n with u the most recent source (SPEC 6 "input-dependent query"); qg = q g.
    const float* u = src.back().v;
    be_.matmul_forward(qraw_.data(), u, params_ + off_[m].proj, n_, d_, d_);
    be_.add_row(qraw_.data(), params_ + off_[m].query, n_, d_);
    if (mix_.key_norm) {
      be_.mul_row(qdyn_.data(), qraw_.data(), params_ + off_[m].gain, n_, d_);
    } else {
      be_.copy(qdyn_.data(), qraw_.data(), sizeof(float) * n_ * d_);
    }
    if (tau_ != 1.0f) be_.scale(qdyn_.data(), tau_, n_ * d_);  // score temperature
    *q_ld = d_;
    return qdyn_.data();
  }

  void mix_forward(int64_t m, float* x, float* lse) {
    auto src = sources(m);
    int64_t q_ld = 0;
    const float* q = query(m, src, &q_ld);
    be_.depth_mix_forward(x, lse, src.data(), static_cast<int64_t>(src.size()), q, q_ld, mix_, n_);
  }

  // Full AttnRes, mixers l .. l+G-1 of a group (G = group_, counted from the stage's first): the
  // first scores every source that exists at l for all G queries in ONE pass over them (phase 1,
  // SPEC 4); mixer l+k then merges only the k sources formed since (phase 2, one at a time, in
  // place). Each old source is read once per group instead of once per mixer: the O(L^2) reads
  // that bound the forward drop by about G, for 2 (G-1) (N,d) arrays of partial results.
  void prepare_grouped(int64_t l) {
    const int64_t k = (l - first_) % group_;
    if (k == 0) {
      const int64_t K = std::min(group_, last_ - l);
      auto src = sources(l);
      std::vector<float*> o(K), ls(K);
      std::vector<const float*> q(K);
      for (int64_t j = 0; j < K; j++) {
        o[j] = j == 0 ? xin_[l].data() : o1_[j].data();
        ls[j] = j == 0 ? lse_[l].data() : lse1_[j].data();
        q[j] = qg_.data() + (l + j) * d_;
      }
      be_.depth_mix_phase1(o.data(), ls.data(), src.data(), static_cast<int64_t>(src.size()),
                           q.data(), K, mix_, n_);
      return;
    }
    const float* o = o1_[k].data();
    const float* ls = lse1_[k].data();
    for (int64_t j = l - k; j < l; j++) {  // the outputs of sublayers l-k .. l-1
      const ops::DepthSource p{blk(j).v.data(), blk(j).r.data(), nullptr, bf16_of(blk(j))};
      be_.depth_mix_phase2(xin_[l].data(), lse_[l].data(), o, ls, p, qg_.data() + l * d_, mix_, n_);
      o = xin_[l].data();
      ls = lse_[l].data();
    }
  }

  // Computes x_l once its sources exist (right after sublayer l-1's output).
  void prepare_input(int64_t l) {
    const int64_t k = l % S_;
    if (group_ > 1) {
      prepare_grouped(l);
      return;
    }
    if (!two_phase_) {
      mix_forward(l, xin_[l].data(), lse_[l].data());
      return;
    }
    if (k == 0) {
      // Phase 1 (SPEC 4): every sublayer of this block scores the completed blocks in one pass.
      const int64_t K = std::min(S_, L_ - l);
      auto src = sources(l, /*completed_only=*/true);
      std::vector<float*> o(K), ls(K);
      std::vector<const float*> q(K);
      for (int64_t j = 0; j < K; j++) {
        o[j] = o1_[j].data();
        ls[j] = lse1_[j].data();
        q[j] = qg_.data() + (l + j) * d_;
      }
      be_.depth_mix_phase1(o.data(), ls.data(), src.data(), static_cast<int64_t>(src.size()),
                           q.data(), K, mix_, n_);
      be_.copy(xin_[l].data(), o1_[0].data(), sizeof(float) * n_ * d_);
      be_.copy(lse_[l].data(), lse1_[0].data(), sizeof(float) * n_ * mix_.H);
    } else {
      // Phase 2: only the partial sum is new; merge it by log-sum-exp.
      const ops::DepthSource p{part_[l].v.data(), part_[l].r.data(), nullptr, bf16_of(part_[l])};
      be_.depth_mix_phase2(xin_[l].data(), lse_[l].data(), o1_[k].data(), lse1_[k].data(), p,
                           qg_.data() + l * d_, mix_, n_);
    }
  }

  // Static query qg = tau w * g of mixer m: dw += tau dqg * g, dg += tau dqg * w. dqg (d/d qg):
  // backend memory, scaled by tau in place.
  void accumulate_query_grad(int64_t m, float* dqg) {
    if (tau_ != 1.0f) be_.scale(dqg, tau_, d_);
    float* dw = grads_ + off_[m].query;
    if (!mix_.key_norm) {
      be_.add(dw, dw, dqg, d_);
      return;
    }
    be_.add_product(dw, dqg, params_ + off_[m].gain, d_);
    be_.add_product(grads_ + off_[m].gain, dqg, params_ + off_[m].query, d_);
  }

  // Mixers first..last as readers of a source (their dx, lse, D and query).
  std::vector<ops::DepthReader> readers(int64_t first, int64_t last) {
    std::vector<ops::DepthReader> rd;
    for (int64_t m = first; m <= last; m++) {
      rd.push_back({dxs_[m].data(), lse_[m].data(), D_[m].data(), qg_.data() + m * d_, m * d_});
    }
    return rd;
  }

  // By-source backward: dv = the gradient of source `src` through mixers first..last.
  void source_backward(float* dv, const Source& src, int64_t first, int64_t last) {
    const std::vector<ops::DepthReader> rd = readers(first, last);
    const ops::DepthSource s{src.v.data(), src.r.data(), nullptr, bf16_of(src)};
    be_.depth_source_backward(dv, s, rd.data(), static_cast<int64_t>(rd.size()),
                              dq_all_.data() + first * d_, mix_, n_);
  }

  // Backpropagates dx through mixer m into its sources' gradients and its parameters.
  void mix_backward(int64_t m, const float* dx, const float* x, const float* lse) {
    auto src = sources(m);
    const int64_t S = static_cast<int64_t>(src.size());
    if (!dynamic_) {
      dqg_.assign_zero(d_);
      be_.depth_mix_backward(dqg_.data(), dx, x, lse, src.data(), S, qg_.data() + m * d_, 0, mix_,
                             n_);
      accumulate_query_grad(m, dqg_.data());
      return;
    }
    const float* g = mix_.key_norm ? params_ + off_[m].gain : nullptr;
    float* dw = grads_ + off_[m].query;
    float* dg = g ? grads_ + off_[m].gain : nullptr;
    int64_t q_ld = 0;
    query(m, src, &q_ld);  // recomputes qraw_/qdyn_: cheaper than storing L of them
    be_.zero(dq_.data(), sizeof(float) * n_ * d_);
    be_.depth_mix_backward(dq_.data(), dx, x, lse, src.data(), S, qdyn_.data(), q_ld, mix_, n_);
    if (tau_ != 1.0f) be_.scale(dq_.data(), tau_, n_ * d_);  // qdyn = tau (w + W u) g
    // dq_ holds d/d(qg) per token; qg = (w + W u) * g: dg += sum_rows dq (w + W u), then
    // dq *= g is d/dq, and dw += sum_rows dq.
    const int64_t nd = n_ * d_;
    if (g) {
      qprod_.on(&be_).resize(static_cast<size_t>(nd));
      be_.mul(qprod_.data(), dq_.data(), qraw_.data(), nd);
      be_.column_sum_add(dg, qprod_.data(), n_, d_);
      be_.mul_row(dq_.data(), dq_.data(), g, n_, d_);
    }
    be_.column_sum_add(dw, dq_.data(), n_, d_);
    // dW += dq^T u ; du += dq W  (u = the most recent source)
    be_.matmul_backward(src.back().dv, grads_ + off_[m].proj, dq_.data(), src.back().v,
                        params_ + off_[m].proj, n_, d_, d_);
  }

  Backend& be_;
  const int64_t L_, d_, S_, window_;
  const bool dynamic_;
  const float eps_;
  const float tau_;  // score temperature (1 = none)
  ops::DepthMix mix_;
  int64_t NB_ = 0, n_ = 0;
  bool two_phase_ = false;
  // Full AttnRes: mixers per forward group (prepare_grouped; 1 = each mixer reads its sources).
  // Four minimises the reads at 16-64 sublayers: about L^2 / (2 G) in phase 1 against 3 G L / 2
  // for the one-at-a-time merges.
  static constexpr int64_t kFullGroup = 4;
  int64_t group_ = 1;
  // Full AttnRes's by-source backward: sources per pass over the readers' dx (grad_output).
  // Measured (BM_FullDepthBackward, L 32, d 128, one thread): 69.2 / 66.1 / 63.4 / 65.3 ms for
  // groups of 1 / 2 / 4 / 8.
  static constexpr int64_t kBackGroup = 4;
  int64_t back_group_ = 1;
  bool by_source_ = false;
  bool bf16_ = false;  // the depth mixes read bf16 copies of the sources (set_storage)
  float* params_ = nullptr;
  float* grads_ = nullptr;
  std::vector<Offsets> off_;
  Buf qg_;                        // ((L+1), d) static query * gain
  Buf dqg_;                       // (d) one mixer's static query gradient
  int64_t first_ = 0, last_ = 0;  // sublayers of this stage: [0, L) outside pipelines
  bool stage_ = false;            // a pipeline stage, with its sources in *st_
  SourceStore own_;               // the sources outside pipelines
  SourceStore* st_ = &own_;
  std::vector<Source> part_;
  std::vector<Buf> xin_, lse_, o1_, lse1_;
  Buf final_, out_, dx_, qdyn_, qraw_, dq_, qprod_;
  std::vector<Buf> dxs_, D_;  // by source: every mixer's dx (N,d) and dx . x (N,H)
  Buf dv_cur_;
  std::vector<Buf> dv_part_;  // by source: the later members' parts from their group's pass
  Buf dq_all_;                // by source: every mixer's query gradient ((L+1), d)
};

}  // namespace

std::unique_ptr<DepthRouter> make_attnres_router(const ModelConfig& cfg, Backend* be) {
  return std::make_unique<AttnResRouter>(cfg, be);
}

}  // namespace attnres
