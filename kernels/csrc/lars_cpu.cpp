// One LARS (or plain SGD-momentum) step over a whole list of float32 CPU tensors in one call.
//
// The step is memory-bound, so what counts is the number of passes over w, g and m. Per tensor:
//   norms  : one pass reads w and g for ||w||^2 and ||g||^2 together
//   update : one pass reads w, g, m and writes m and w (decay, trust ratio, momentum, nesterov)
// The formula is FusedLARS's docstring (kernels/lars.py).
//
// Tensors are grouped into cache blocks of about kBlockElements elements (a larger tensor alone).
// Each block is a norm phase then an update phase, each a list of tasks (one pass over a chunk of
// one tensor). Thread t of n starts a phase at its own share, the t-th n-th of the tasks, so in the
// update phase it re-reads from its cache the w and g it read in the norm phase; then it takes any
// task of the phase that no thread has claimed yet. An update phase waits only for its block's
// norms, and no thread waits for another to arrive: on a shared machine, a thread that starts late
// or loses its core delays the others by at most the one task it holds.
// Plain C ABI (loaded with ctypes), no torch headers, a build that takes about a second. Threads
// come from OpenMP: kernels/_native.py builds with -fopenmp, and the libgomp.so.1 this links
// resolves to the one torch has loaded, so the kernel runs on torch's own (warm) threads. Without
// OpenMP it runs on one thread.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
#endif

namespace {

// A thread's share of a block's w and g (1 MiB with 2 threads) fits a core's L2, so the update
// phase re-reads them from cache. Most of ResNet-50 is in tensors larger than a block, which
// cannot gain this way, so the block size hardly matters for them.
constexpr int64_t kBlockElements = int64_t{1} << 18;
constexpr int64_t kChunk = int64_t{1} << 14;     // elements per task: 64 KiB of each array
constexpr int64_t kMinChunk = int64_t{1} << 15;  // elements per thread worth a second thread
// Independent float accumulators (GCC/Clang vector extension: 4 SSE registers, 2 AVX, 1 AVX-512),
// enough that the adds do not wait on each other.
constexpr int kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kFlush = 2048;

// Read by kernels/lars.py through ctypes.Structure: keep the two in the same order.
struct Options {
  double lr, momentum, weight_decay, trust_coefficient, eps;
  double min_trust_ratio, max_trust_ratio;  // clip the ratio to [min, max], last; max may be inf
  int32_t lars;        // 0: plain SGD momentum on g (a lars_exclude group): no decay, ratio 1
  int32_t nesterov;
  int32_t trust_clip;  // ratio = min(ratio / lr, 1)
};

// Adds sum(w^2) and sum(g^2) over [0, n) to sums[0] and sums[1]. Written with vector types because
// without -ffast-math GCC may not reorder a float sum, and its own vectorisation (across
// iterations, with shuffles) does not keep up with memory. Each float lane sums at most
// kFlush / kLanes squares before going into a double, which keeps the result close to a float64
// sum.
void add_squares(const float* w, const float* g, int64_t n, double* sums) {
  for (int64_t start = 0; start < n; start += kFlush) {
    const int64_t stop = std::min(n, start + kFlush);
    Lanes sw = {}, sg = {};
    int64_t i = start;
    for (; i + kLanes <= stop; i += kLanes) {
      Lanes a, b;
      std::memcpy(&a, w + i, sizeof a);  // unaligned loads
      std::memcpy(&b, g + i, sizeof b);
      sw += a * a;
      sg += b * b;
    }
    for (; i < stop; ++i) {
      sw[0] += w[i] * w[i];
      sg[0] += g[i] * g[i];
    }
    for (int u = 0; u < kLanes; ++u) {
      sums[0] += sw[u];
      sums[1] += sg[u];
    }
  }
}

// d = ratio * g + decay * w (decay = ratio * weight_decay); m = mu * m + d;
// w -= lr * (nesterov ? d + mu * m : m).
void update(float* __restrict w, const float* __restrict g, float* __restrict m, int64_t n,
            float ratio, float decay, float mu, float lr, bool nesterov) {
  if (nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      const float d = ratio * g[i] + decay * w[i];
      const float mi = mu * m[i] + d;
      m[i] = mi;
      w[i] -= lr * (d + mu * mi);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float mi = mu * m[i] + (ratio * g[i] + decay * w[i]);
      m[i] = mi;
      w[i] -= lr * mi;
    }
  }
}

// The trust ratio from the squared norms, as FusedLARS's docstring defines it; *unclipped gets
// its value before the [min, max] clip.
double trust_ratio(double w_sq, double g_sq, const Options& o, double* unclipped) {
  const double w_norm = std::sqrt(w_sq), g_norm = std::sqrt(g_sq);
  double ratio = 1.0;
  if (w_norm > 0 && g_norm > 0)
    ratio = o.trust_coefficient * w_norm / (g_norm + o.weight_decay * w_norm + o.eps);
  if (o.trust_clip) ratio = std::min(ratio / o.lr, 1.0);
  *unclipped = ratio;
  return std::min(std::max(ratio, o.min_trust_ratio), o.max_trust_ratio);
}

// One pass over elements [begin, end) of one tensor.
struct Task {
  int64_t tensor, begin, end, block;
  bool norm;  // the norm pass, else the update pass
};

// Tensors [first_tensor, last_tensor), whose norm tasks are [first_task, norms_end) and update
// tasks [norms_end, updates_end).
struct Block {
  int64_t first_tensor, last_tensor, first_task, norms_end, updates_end;
};

// The step's tasks, block by block: all norm tasks (when lars), then all update tasks.
void plan(int64_t count, const int64_t* numel, bool lars, std::vector<Task>& tasks,
          std::vector<Block>& blocks) {
  auto add_tasks = [&](const Block& block, bool norm) {
    for (int64_t i = block.first_tensor; i < block.last_tensor; ++i)
      for (int64_t begin = 0; begin < numel[i]; begin += kChunk)
        tasks.push_back({i, begin, std::min(numel[i], begin + kChunk),
                         static_cast<int64_t>(blocks.size()), norm});
  };
  auto add_block = [&](int64_t first, int64_t last) {
    Block block{first, last, static_cast<int64_t>(tasks.size()), 0, 0};
    if (lars) add_tasks(block, true);
    block.norms_end = static_cast<int64_t>(tasks.size());
    add_tasks(block, false);
    block.updates_end = static_cast<int64_t>(tasks.size());
    blocks.push_back(block);
  };
  int64_t first = 0, size = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (i > first && size + numel[i] > kBlockElements) {
      add_block(first, i);
      first = i;
      size = 0;
    }
    size += numel[i];
  }
  add_block(first, count);
}

// Spins briefly (the awaited tasks are usually a chunk away from done), then yields the core: the
// box is shared, and a spinning waiter could keep the thread it waits for off the CPU.
template <class Ready>
void wait_until(Ready ready) {
  for (int spins = 0; !ready();) {
    if (spins < 4096)
      ++spins;
    else
      std::this_thread::yield();
  }
}

}  // namespace

extern "C" {

// w, g, m: `count` pointers to float32 arrays of numel[i] elements each (w and m are updated in
// place); unclipped: `count` doubles that get each tensor's trust ratio before the [min, max] clip
// (with options->lars; may be null); threads: the most threads to use (torch.get_num_threads()).
void lars_step(int64_t count, float* const* w, const float* const* g, float* const* m,
               const int64_t* numel, const Options* options, double* unclipped, int threads) {
  const Options o = *options;
  const bool lars = o.lars != 0;
  std::vector<Task> tasks;
  std::vector<Block> blocks;
  plan(count, numel, lars, tasks, blocks);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const size_t n_blocks = blocks.size();

  // Norm task k adds its share into sums[2k], sums[2k + 1]. The thread that finishes a block's last
  // one adds the shares in task order (so no ratio depends on which thread took which task), writes
  // the block's ratios and marks it ready for its update tasks.
  std::vector<double> sums(2 * n_tasks, 0.0);
  std::vector<double> w_sq(count, 0.0), g_sq(count, 0.0), ratios(count, 1.0),
      before_clip(count, 1.0);
  std::unique_ptr<std::atomic<int64_t>[]> norms_left(new std::atomic<int64_t>[n_blocks]);
  std::unique_ptr<std::atomic<bool>[]> ready(new std::atomic<bool>[n_blocks]);
  for (size_t b = 0; b < n_blocks; ++b) {
    norms_left[b].store(blocks[b].norms_end - blocks[b].first_task, std::memory_order_relaxed);
    ready[b].store(blocks[b].norms_end == blocks[b].first_task, std::memory_order_relaxed);
  }

  auto finish_norms = [&](const Block& block, int64_t b) {
    for (int64_t k = block.first_task; k < block.norms_end; ++k) {
      w_sq[tasks[k].tensor] += sums[2 * k];
      g_sq[tasks[k].tensor] += sums[2 * k + 1];
    }
    for (int64_t i = block.first_tensor; i < block.last_tensor; ++i)
      ratios[i] = trust_ratio(w_sq[i], g_sq[i], o, &before_clip[i]);
    ready[b].store(true, std::memory_order_release);
  };

  std::unique_ptr<std::atomic<bool>[]> claimed(new std::atomic<bool>[n_tasks]);
  for (int64_t k = 0; k < n_tasks; ++k) claimed[k].store(false, std::memory_order_relaxed);
  const float mu = static_cast<float>(o.momentum), lr = static_cast<float>(o.lr);

  auto run = [&](int64_t k) {
    const Task& t = tasks[k];
    if (t.norm) {
      add_squares(w[t.tensor] + t.begin, g[t.tensor] + t.begin, t.end - t.begin, &sums[2 * k]);
      if (norms_left[t.block].fetch_sub(1, std::memory_order_acq_rel) == 1)
        finish_norms(blocks[t.block], t.block);
      return;
    }
    const double ratio = ratios[t.tensor];
    update(w[t.tensor] + t.begin, g[t.tensor] + t.begin, m[t.tensor] + t.begin, t.end - t.begin,
           static_cast<float>(ratio), static_cast<float>(lars ? ratio * o.weight_decay : 0.0),
           mu, lr, o.nesterov != 0);
  };
  // Runs the unclaimed tasks of [begin, end), starting at thread's share and wrapping around.
  auto run_phase = [&](int64_t begin, int64_t end, int thread, int threads) {
    const int64_t n = end - begin, own = n * thread / threads;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = begin + (own + j) % n;
      if (!claimed[k].load(std::memory_order_relaxed) &&
          !claimed[k].exchange(true, std::memory_order_relaxed))
        run(k);
    }
  };

  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += numel[i];
  const int nt = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, total / kMinChunk)));
#pragma omp parallel num_threads(nt)
  {
    const int thread = omp_get_thread_num(), team = omp_get_num_threads();
    for (size_t b = 0; b < n_blocks; ++b) {
      run_phase(blocks[b].first_task, blocks[b].norms_end, thread, team);
      wait_until([&] { return ready[b].load(std::memory_order_acquire); });
      run_phase(blocks[b].norms_end, blocks[b].updates_end, thread, team);
    }
  }
  if (lars && unclipped != nullptr) std::copy(before_clip.begin(), before_clip.end(), unclipped);
}

}  // extern "C"
