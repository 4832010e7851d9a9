// MSTopK on the CPU in three streaming passes instead of one pass per bisection step.
//
// For a non-negative float, the ordering of its bit pattern as uint32 equals the ordering of its
// value, so histograms of |x|'s bits give exact counts of `|x| >= t` for any threshold t:
//   scan   : sum and max of |x|, a histogram of the top 16 bits of |x| (8 exponent + 8 mantissa)
//   refine : a histogram of the low 15 bits of the elements in one top-level bin
//   select : the indices with |x| >= hi, and the first `cap` indices with lo <= |x| < hi
// kernels/mstopk.py runs the bisection on these histograms; see the comments there.
// Plain C ABI (loaded with ctypes), std::thread for parallelism: no torch headers, no OpenMP
// runtime next to torch's, and a build that takes about a second.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kLowBits = 15;
constexpr int64_t kHighBins = int64_t{1} << 16;
constexpr int64_t kLowBins = int64_t{1} << kLowBits;
constexpr int64_t kMinChunk = int64_t{1} << 16;  // below this a thread costs more than it saves
constexpr int64_t kBlock = 64;                   // vectorised "any hit?" test before scalar work
constexpr int64_t kFlush = int64_t{1} << 30;     // per-thread uint32 counters flush before overflow

inline uint32_t abs_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u & 0x7fffffffu;
}

inline float from_bits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Runs fn(thread, begin, end) over contiguous chunks in thread order; returns the threads used.
template <class Fn>
int parallel_chunks(int64_t n, int threads, Fn fn) {
  const int64_t useful = std::max<int64_t>(1, n / kMinChunk);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
  const int64_t chunk = (n + nt - 1) / nt;
  std::vector<std::thread> workers;
  for (int t = 1; t < nt; ++t)
    workers.emplace_back(fn, t, std::min(n, t * chunk), std::min(n, (t + 1) * chunk));
  fn(0, int64_t{0}, std::min(n, chunk));
  for (auto& w : workers) w.join();
  return nt;
}

}  // namespace

extern "C" {

// sum_out: sum of |x| in double; max_out: max |x|; hist: kHighBins counters (overwritten).
void mstopk_scan(const float* x, int64_t n, int threads, double* sum_out, float* max_out,
                 int64_t* hist) {
  std::vector<double> sums(threads, 0.0);
  std::vector<uint32_t> maxes(threads, 0);
  std::vector<std::vector<int64_t>> hists(threads);
  const int nt = parallel_chunks(n, threads, [&](int t, int64_t begin, int64_t end) {
    std::vector<uint32_t> local(kHighBins, 0);
    std::vector<int64_t>& total = hists[t];
    total.assign(kHighBins, 0);
    double acc[4] = {0.0, 0.0, 0.0, 0.0};  // independent chains: double adds are latency-bound
    uint32_t mx = 0;
    for (int64_t start = begin; start < end; start += kFlush) {
      const int64_t stop = std::min(end, start + kFlush);
      int64_t i = start;
      for (; i + 4 <= stop; i += 4) {
        for (int u = 0; u < 4; ++u) {
          const uint32_t b = abs_bits(x[i + u]);
          acc[u] += from_bits(b);
          mx = std::max(mx, b);
          ++local[b >> kLowBits];
        }
      }
      for (; i < stop; ++i) {
        const uint32_t b = abs_bits(x[i]);
        acc[0] += from_bits(b);
        mx = std::max(mx, b);
        ++local[b >> kLowBits];
      }
      for (int64_t h = 0; h < kHighBins; ++h) total[h] += local[h];
      std::fill(local.begin(), local.end(), 0u);
    }
    sums[t] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    maxes[t] = mx;
  });
  double sum = 0.0;
  uint32_t mx = 0;
  std::fill(hist, hist + kHighBins, int64_t{0});
  for (int t = 0; t < nt; ++t) {
    sum += sums[t];
    mx = std::max(mx, maxes[t]);
    for (int64_t h = 0; h < kHighBins; ++h) hist[h] += hists[t][h];
  }
  *sum_out = sum;
  *max_out = from_bits(mx);
}

// hist: kLowBins counters (overwritten) of the low bits of the elements whose top bits equal `bin`.
void mstopk_refine(const float* x, int64_t n, int threads, uint32_t bin, int64_t* hist) {
  std::vector<std::vector<int64_t>> hists(threads);
  const int nt = parallel_chunks(n, threads, [&](int t, int64_t begin, int64_t end) {
    std::vector<int64_t>& local = hists[t];
    local.assign(kLowBins, 0);
    for (int64_t i = begin; i < end; i += kBlock) {
      const int64_t stop = std::min(end, i + kBlock);
      uint32_t hit = 0;
      for (int64_t j = i; j < stop; ++j) hit |= (abs_bits(x[j]) >> kLowBits) == bin;
      if (!hit) continue;
      for (int64_t j = i; j < stop; ++j) {
        const uint32_t b = abs_bits(x[j]);
        if ((b >> kLowBits) == bin) ++local[b & (kLowBins - 1)];
      }
    }
  });
  std::fill(hist, hist + kLowBins, int64_t{0});
  for (int t = 0; t < nt; ++t)
    for (int64_t h = 0; h < kLowBins; ++h) hist[h] += hists[t][h];
}

// Writes, in ascending index order, the indices with |x| >= hi into above (at most above_cap) and
// the first band_cap indices with lo <= |x| < hi into band; counts_out = {#above, #band} written.
void mstopk_select(const float* x, int64_t n, int threads, float lo, float hi, int64_t above_cap,
                   int64_t band_cap, int64_t* above, int64_t* band, int64_t* counts_out) {
  const uint32_t lo_bits = abs_bits(lo), hi_bits = abs_bits(hi);
  std::vector<std::vector<int64_t>> aboves(threads), bands(threads);
  const int nt = parallel_chunks(n, threads, [&](int t, int64_t begin, int64_t end) {
    std::vector<int64_t>& a = aboves[t];
    std::vector<int64_t>& b = bands[t];
    for (int64_t i = begin; i < end; i += kBlock) {
      const int64_t stop = std::min(end, i + kBlock);
      uint32_t hit = 0;
      for (int64_t j = i; j < stop; ++j) hit |= abs_bits(x[j]) >= lo_bits;
      if (!hit) continue;
      for (int64_t j = i; j < stop; ++j) {
        const uint32_t v = abs_bits(x[j]);
        if (v >= hi_bits) {
          if (static_cast<int64_t>(a.size()) < above_cap) a.push_back(j);
        } else if (v >= lo_bits && static_cast<int64_t>(b.size()) < band_cap) {
          b.push_back(j);
        }
      }
    }
  });
  int64_t na = 0, nb = 0;
  for (int t = 0; t < nt; ++t) {
    const int64_t ta = std::min<int64_t>(aboves[t].size(), above_cap - na);
    const int64_t tb = std::min<int64_t>(bands[t].size(), band_cap - nb);
    std::copy(aboves[t].begin(), aboves[t].begin() + ta, above + na);
    std::copy(bands[t].begin(), bands[t].begin() + tb, band + nb);
    na += ta;
    nb += tb;
  }
  counts_out[0] = na;
  counts_out[1] = nb;
}

}  // extern "C"
