// kvxfer CPU backend: gather / scatter / copy of paged KV rows on the host, with a small thread pool.
//
// Built by setup.py (g++ or $CXX, -O3, no CUDA) into kvxfer/_prebuilt/libkvx_cpu-<hash>.so, or
// lazily by kvxfer/backends/cpu.py into a cache directory; driven through ctypes, which releases
// the GIL for the whole call. Inputs were validated by kvxfer.ops: nothing is checked twice here.
//
// Model (the same as the CUDA kernels, csrc/kvx_copy.cuh): a transfer moves H * L * KV * T rows
// of R bytes. Row (h, l, kv, t) of a side lives at
//     layer(l) + head_off + kv * s_kv + h * s_head + block_ids[t / bs] * s_blk + (t % bs) * s_tok
// or, when the ids are token slots (slot_block > 1, bs = 1), with the slot s = block_ids[t]:
//     layer(l) + head_off + kv * s_kv + h * s_head + (s / slot_block) * s_blk + (s % slot_block) * s_tok
// with layer(l) = layers[l] for a paged cache, base + l * layer_stride for a dense wire (which is
// a paged side with one block of bs = T and s_tok = R).
//
// Plan, per call:
//   segments  tokens [t0, t0 + n) that stay inside one block on both sides, merged with the
//             next one whenever both sides continue contiguously (adjacent block ids)
//   items     (layer, kv, segment): a 2-D copy of H x n rows; its loops are collapsed wherever
//             both sides are contiguous (same layout and full heads: one memcpy per block;
//             HND <-> wire: one memcpy per head and block), the rest is one memcpy per row,
//             the NHD side walked in address order (see `tight`)
//   stores    streaming (non-temporal) when the caller asks (large transfers)
//   threads   items cut into contiguous chunks that the caller and up to threads - 1 pool
//             workers take in turn; never fewer than min_bytes_per_thread bytes per thread
//   overlap   a copy whose two sides may share memory goes through a temporary wire
//
// Compared with the alternatives on the same rows (profiling/sweep_cpu.py, llama3-8b, 13 MB,
// cold caches, one thread; x = memcpy time / op time): torch reference 0.21-0.56x, these CUDA
// kernel bodies run through the host shim (csrc/host, g++ -O3) 0.14-0.25x, this file
// 0.86-1.04x (2 threads: 0.92-1.07x with the second core busy elsewhere).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

typedef std::int64_t i64;

constexpr int kAbiVersion = 2;  // = cpu_build.ABI_VERSION; bump with any change to the arguments
constexpr int kSideFields = 12;
constexpr int kHeadFields = 8;
constexpr int kMaxThreads = 64;

// Flags (args[6]).
constexpr i64 kFlagStream = 1;  // non-temporal stores for runs of >= kStreamMinRun aligned bytes
// Bits 1-2: loop order of 2-D copies (Order below); 0 = the rule, the others for measurements.
constexpr int kOrderShift = 1;
constexpr i64 kOrderMask = 3;
constexpr i64 kChunksPerThread = 8;  // work-sharing granularity: see Pool

constexpr i64 kStreamMinRun = 256;  // shorter runs are memcpy'd even when streaming is on

struct Side {
  const i64* layers;  // [L] layer base addresses (paged cache), or null (dense wire)
  i64 base, layer_stride;
  const i64* block_ids;  // [ceil(T / block_size)]
  i64 block_size, s_kv, s_blk, s_tok, s_head, head_off;
  i64 extent;      // bytes from a layer's base address that its rows can reach (overlap checks)
  i64 slot_block;  // 1: ids are blocks; > 1: ids are token slots of blocks of this many tokens

  char* layer(i64 l) const {
    const i64 addr = layers ? layers[l] : base + l * layer_stride;
    return reinterpret_cast<char*>(static_cast<std::uintptr_t>(addr + head_off));
  }
  i64 token_offset(i64 t) const {
    const i64 j = t / block_size;
    i64 id = block_ids[j], o = t - j * block_size;
    if (slot_block != 1) {
      const i64 b = id / slot_block;
      o += id - b * slot_block;
      id = b;
    }
    return id * s_blk + o * s_tok;
  }
};

Side read_side(const i64* a) {
  Side s;
  s.layers = reinterpret_cast<const i64*>(static_cast<std::uintptr_t>(a[0]));
  s.base = a[1];
  s.layer_stride = a[2];
  s.block_ids = reinterpret_cast<const i64*>(static_cast<std::uintptr_t>(a[3]));
  s.block_size = a[4];
  s.s_kv = a[5];
  s.s_blk = a[6];
  s.s_tok = a[7];
  s.s_head = a[8];
  s.head_off = a[9];
  s.extent = a[10];
  s.slot_block = a[11];
  return s;
}

// The dense wire [H, L, KV, T, R] at `base`, as a side.
Side dense_side(char* base, i64 H, i64 L, i64 KV, i64 T, i64 R) {
  static const i64 zero = 0;
  Side s;
  s.layers = nullptr;
  s.base = static_cast<i64>(reinterpret_cast<std::uintptr_t>(base));
  s.layer_stride = KV * T * R;
  s.block_ids = &zero;
  s.block_size = T;
  s.s_kv = T * R;
  s.s_blk = 0;
  s.s_tok = R;
  s.s_head = L * KV * T * R;
  s.head_off = 0;
  s.extent = H * L * KV * T * R;
  s.slot_block = 1;
  return s;
}

// True when some layer of `a` and some layer of `b` (paged caches) share bytes they can reach:
// a copy inside one cache, or between views of one allocation.
bool may_overlap(const Side& a, const Side& b, i64 L) {
  if (a.layers == nullptr || b.layers == nullptr) return false;
  std::vector<std::pair<i64, i64>> spans;  // (start, end) of every layer of both sides, 2L
  spans.reserve(static_cast<std::size_t>(2 * L));
  for (i64 l = 0; l < L; ++l) {
    spans.emplace_back(a.layers[l], a.layers[l] + a.extent);
    spans.emplace_back(b.layers[l], b.layers[l] + b.extent);
  }
  std::sort(spans.begin(), spans.end());
  i64 end = std::numeric_limits<i64>::min();
  for (const auto& sp : spans) {  // any two spans sharing a byte (also layers of one side that
    if (sp.first < end) return true;  // alias each other: conservative, the result stays exact)
    end = std::max(end, sp.second);
  }
  return false;
}

struct Segment {
  i64 src_off, dst_off, n;
};

// ---------------------------------------------------------------------------- copy primitives
#if defined(__SSE2__)
// dst 16-byte aligned, n a multiple of 64: streaming stores (no read-for-ownership of the
// destination, nothing of it left in the cache): +10-45 % over memcpy per run (numbers and the
// size threshold in kvxfer/backends/cpu.py). Tried and not kept: software prefetch of the next
// item's source (its first 8/32 lines, all of it, or one line per line copied): no gain beyond
// the noise once every call starts from a cold cache. Software prefetch of the next item's
// first 8 or 32 lines on top: no gain beyond the noise (+-15 %), not kept.
inline void copy_stream(char* dst, const char* src, i64 n) {
  for (i64 i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
}
constexpr bool kHaveStream = true;
#else
inline void copy_stream(char* dst, const char* src, i64 n) { std::memcpy(dst, src, n); }
constexpr bool kHaveStream = false;
#endif

// One dimension of a 2-D row copy: count, and the byte strides on the source and destination.
struct Dim {
  i64 n, s, d;
};

// Which loop of a 2-D copy (tokens x heads, after folding) goes innermost. A side is walked in
// address order along a dim whose stride on it equals the run; of the two dims, the inner one is
// the dim whose contiguous side is packed tighter along the other dim (its other stride is
// smaller): for NHD <-> wire / HND that keeps the NHD side (rows of all heads side by side)
// sequential and leaves the other side with H sequential streams, instead of walking NHD with a
// stride of H rows. profiling/sweep_cpu.py, llama3-8b rows, 13 MB, one thread, cold caches (EPYC,
// 2 vCPU; x = memcpy time / op time): destination order always -> this rule: gather NHD 0.58x ->
// 0.90x, copy NHD->HND/32 0.63x -> 0.80x; scatter NHD keeps destination order (0.84x -> 0.87x;
// source order: 0.64x); HND <-> wire and HND/NHD -> HND have one contiguous run per head.
enum Order : i64 { kOrderAuto = 0, kOrderDestination = 1, kOrderSource = 2 };

inline i64 iabs(i64 x) { return x < 0 ? -x : x; }

// The smaller other-dim stride of the sides that are contiguous along `inner` (none: huge).
inline i64 tight(const Dim& inner, const Dim& outer, i64 run) {
  i64 best = std::numeric_limits<i64>::max();
  if (inner.s == run) best = std::min(best, iabs(outer.s));
  if (inner.d == run) best = std::min(best, iabs(outer.d));
  return best;
}

struct Job {
  Side src, dst;
  i64 H, L, KV, T, R;
  bool stream;
  i64 order;
  std::vector<Segment> segs;
  i64 items_per_chunk, num_chunks;

  i64 num_items() const { return L * KV * static_cast<i64>(segs.size()); }

  void copy_run(char* d, const char* s, i64 n) const {
    if (stream && n >= kStreamMinRun && n % 64 == 0 && (reinterpret_cast<std::uintptr_t>(d) & 15) == 0) {
      copy_stream(d, s, n);
    } else {
      std::memcpy(d, s, static_cast<std::size_t>(n));
    }
  }

  // H x n rows of R bytes; dims whose strides equal the contiguous run on both sides fold into it.
  void copy_2d(char* d, const char* s, i64 n_tok) const {
    Dim dims[2] = {{n_tok, src.s_tok, dst.s_tok}, {H, src.s_head, dst.s_head}};
    int nd = 2;
    i64 run = R;
    for (bool merged = true; merged;) {
      merged = false;
      for (int i = 0; i < nd; ++i) {
        if (dims[i].n == 1 || (dims[i].s == run && dims[i].d == run)) {
          run *= dims[i].n;
          dims[i] = dims[--nd];
          merged = true;
          break;
        }
      }
    }
    if (nd == 0) {
      copy_run(d, s, run);
    } else if (nd == 1) {
      const Dim a = dims[0];
      for (i64 i = 0; i < a.n; ++i) copy_run(d + i * a.d, s + i * a.s, run);
    } else {
      Dim inner = dims[0], outer = dims[1];
      bool swap;
      if (order == kOrderDestination) {
        swap = iabs(outer.d) < iabs(inner.d);
      } else if (order == kOrderSource) {
        swap = iabs(outer.s) < iabs(inner.s);
      } else {
        swap = tight(outer, inner, run) < tight(inner, outer, run);
      }
      if (swap) std::swap(outer, inner);
      for (i64 i = 0; i < outer.n; ++i) {
        char* dd = d + i * outer.d;
        const char* ss = s + i * outer.s;
        for (i64 j = 0; j < inner.n; ++j) copy_run(dd + j * inner.d, ss + j * inner.s, run);
      }
    }
  }

  void run_items(i64 begin, i64 end) const {
    const i64 num_segs = static_cast<i64>(segs.size());
    for (i64 item = begin; item < end; ++item) {
      const i64 g = item % num_segs;
      const i64 lk = item / num_segs;
      const i64 kv = lk % KV, l = lk / KV;
      const Segment& seg = segs[g];
      const char* s = src.layer(l) + kv * src.s_kv + seg.src_off;
      char* d = dst.layer(l) + kv * dst.s_kv + seg.dst_off;
      copy_2d(d, s, seg.n);
    }
  }

  void run_chunk(i64 c) const {
    const i64 begin = c * items_per_chunk;
    run_items(begin, std::min(begin + items_per_chunk, num_items()));
  }

  // Chunks taken from `next` until none is left; streaming stores drained before returning.
  void run_chunks(std::atomic<i64>& next) const {
    for (i64 c = next.fetch_add(1); c < num_chunks; c = next.fetch_add(1)) run_chunk(c);
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
  }
};

// ---------------------------------------------------------------------------- thread pool
// Workers sleep on a condition variable between calls. A call's items are cut into chunks that
// the caller and the woken workers take from a shared counter, so a worker the OS runs late (a
// busy shared machine) costs at most the chunk it is in, never the half of the transfer a static
// split would have given it: the caller waits only for workers that already started a chunk.
// One call uses the pool at a time; a concurrent caller (another engine thread) does not wait
// but runs its job on its own thread. After fork() the child gets a fresh, empty pool (the
// parent's threads do not exist there).
class Pool {
 public:
  // Run every chunk of `job` on the calling thread and up to `helpers` workers.
  void run(const Job& job, int helpers) {
    std::unique_lock<std::mutex> call(call_mutex_, std::try_to_lock);
    std::atomic<i64> own{0};
    if (!call.owns_lock() || !grow(helpers)) {
      job.run_chunks(own);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &job;
      helpers_ = helpers;
      next_.store(0);
      ++generation_;
    }
    work_cv_.notify_all();
    job.run_chunks(next_);
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    job_ = nullptr;  // workers that wake from now on find nothing to do
  }

 private:
  // Make sure `n` workers exist; false if threads cannot be created.
  bool grow(int n) {
    try {
      while (static_cast<int>(workers_.size()) < n) {
        const int idx = static_cast<int>(workers_.size());
        workers_.emplace_back([this, idx] { loop(idx); });
        workers_.back().detach();  // the pool lives for the process (exit or fork ends it)
      }
    } catch (const std::system_error&) {
      return false;
    }
    return true;
  }

  void loop(int idx) {
    unsigned long long seen = 0;
    for (;;) {
      const Job* job;
      {
        std::unique_lock<std::mutex> lk(m_);
        work_cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (job_ == nullptr || idx >= helpers_) continue;
        job = job_;
        ++active_;
      }
      job->run_chunks(next_);
      std::lock_guard<std::mutex> lk(m_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex call_mutex_, m_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::thread> workers_;
  const Job* job_ = nullptr;
  int helpers_ = 0, active_ = 0;
  std::atomic<i64> next_{0};
  unsigned long long generation_ = 0;
};

std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork_once;

// In a forked child the parent's workers do not exist: leak its pool, start a fresh one.
void reset_pool_in_child() { g_pool.store(nullptr); }

Pool& pool() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, reset_pool_in_child); });
  Pool* p = g_pool.load();
  if (p == nullptr) {
    Pool* fresh = new Pool();  // never freed: its detached workers use it until the process ends
    if (g_pool.compare_exchange_strong(p, fresh)) return *fresh;
    delete fresh;  // another thread installed one first (no worker started yet: safe to free)
  }
  return *p;
}

// ---------------------------------------------------------------------------- planning
void make_segments(Job& job) {
  const Side &a = job.src, &b = job.dst;
  job.segs.clear();
  for (i64 t = 0; t < job.T;) {
    const i64 n = std::min({a.block_size - t % a.block_size, b.block_size - t % b.block_size, job.T - t});
    const i64 so = a.token_offset(t), d_o = b.token_offset(t);
    if (!job.segs.empty()) {
      Segment& prev = job.segs.back();
      if (prev.src_off + prev.n * a.s_tok == so && prev.dst_off + prev.n * b.s_tok == d_o) {
        prev.n += n;  // both sides continue contiguously (e.g. adjacent block ids)
        t += n;
        continue;
      }
    }
    job.segs.push_back({so, d_o, n});
    t += n;
  }
}

// Threads for the job (>= 1): at most `max_threads`, at least min_bytes bytes each. Cuts the
// items into chunks of about equal size, kChunksPerThread per thread.
int plan_threads(Job& job, int max_threads, i64 min_bytes) {
  const i64 items = job.num_items();
  const i64 total = job.H * job.L * job.KV * job.T * job.R;
  const i64 threads = std::max<i64>(1, std::min<i64>({max_threads, items, total / min_bytes}));
  const i64 chunks = threads == 1 ? 1 : std::min<i64>(items, threads * kChunksPerThread);
  job.items_per_chunk = (items + chunks - 1) / chunks;
  job.num_chunks = (items + job.items_per_chunk - 1) / job.items_per_chunk;
  return static_cast<int>(threads);
}

void run(Job& job, int threads, i64 min_bytes) {
  make_segments(job);
  const int parts = plan_threads(job, threads, min_bytes);
  if (parts == 1) {
    std::atomic<i64> next{0};
    job.run_chunks(next);
  } else {
    pool().run(job, parts - 1);
  }
}

}  // namespace

extern "C" {

// The layout of kvx_cpu_move's arguments; the Python side refuses a library that disagrees.
int kvx_cpu_abi_version() { return kAbiVersion; }

// 1 when non-temporal stores are compiled in (SSE2), else 0.
int kvx_cpu_has_stream() { return kHaveStream ? 1 : 0; }

// args: H, L, KV, T, R (row bytes), threads, flags, min_bytes_per_thread, then the source and
// destination sides, 12 fields each: layers address (0 for a dense wire), base, layer_stride,
// block_ids address, block_size, s_kv, s_blk, s_tok, s_head, head_off, extent (bytes),
// slot_block (1: block ids; > 1: token slots, block_size 1).
// Returns 0, or -1 when n is not the expected count, -2 when memory for the plan ran out.
int kvx_cpu_move(const i64* args, int n) {
  if (n != kHeadFields + 2 * kSideFields) return -1;
  try {
    Job job;
    job.H = args[0];
    job.L = args[1];
    job.KV = args[2];
    job.T = args[3];
    job.R = args[4];
    const int threads = static_cast<int>(std::max<i64>(1, std::min<i64>(args[5], kMaxThreads)));
    job.stream = (args[6] & kFlagStream) != 0;
    job.order = (args[6] >> kOrderShift) & kOrderMask;
    const i64 min_bytes = std::max<i64>(1, args[7]);
    job.src = read_side(args + kHeadFields);
    job.dst = read_side(args + kHeadFields + kSideFields);
    if (job.T <= 0 || job.H <= 0 || job.L <= 0 || job.KV <= 0 || job.R <= 0) return 0;
    if (may_overlap(job.src, job.dst, job.L)) {
      // Every row read before any is written, as the torch reference does: through a wire.
      std::unique_ptr<char[]> wire(new char[static_cast<std::size_t>(job.H * job.L * job.KV * job.T * job.R)]);
      const Side dense = dense_side(wire.get(), job.H, job.L, job.KV, job.T, job.R);
      Job second = job;
      job.dst = dense;
      second.src = dense;
      run(job, threads, min_bytes);
      run(second, threads, min_bytes);
    } else {
      run(job, threads, min_bytes);
    }
    return 0;
  } catch (const std::bad_alloc&) {
    return -2;
  }
}

}  // extern "C"
