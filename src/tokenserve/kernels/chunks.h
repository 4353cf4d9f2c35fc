// Splitting one op's work between its calling thread and helper threads, without waiting
// for helpers that wake up too late to help.
//
// Why not ThreadPool::ParallelFor: it returns only when every shard it scheduled has run.
// On these VMs a pool thread that was asleep starts 15-100 us after it is woken (waking an
// idle vCPU), so an op of a few hundred microseconds (a decode step's dense layer) often
// finishes its own half and then waits for a thread that has not started yet; an op of
// tens of microseconds (a small model's layer) waits longer than it computes. Here the work
// is a set of chunks taken from a shared counter: the caller takes chunks until none is
// left, then waits only for chunks another thread has already taken. A pool thread that
// wakes after that finds no chunk and returns; it touches only the shared counters, which
// it co-owns, never the caller's stack.
//
// Helpers that stay awake: waking a pool thread per op still cost most ops their helper.
// An op of tens of microseconds (a small model's matrix, an int8 matrix) was often done by
// the caller alone before the helper started. So the chunks go first to a team of helper
// threads of our own (one fewer than the pool's threads), shared by every op library of
// the process, that keep polling for the next op's chunks for a while after their last one
// (TOKENSERVE_KERNEL_SPIN_US, default 2000 us; 0 turns the team off) and then sleep until
// an op wakes them. During generation the steps come back to back, so the helpers stay
// awake from one op to the next, as llama.cpp's threads and OpenMP's do; an idle server's
// helpers sleep. One op at a time uses the team; an op that finds it busy (another model
// stepping in the same process) uses the pool as before.
#ifndef TOKENSERVE_KERNELS_CHUNKS_H_
#define TOKENSERVE_KERNELS_CHUNKS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "tensorflow/core/platform/threadpool.h"

namespace tokenserve {

namespace chunks_internal {

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins, then yields, until `done` reaches `n`: what is left is at most one chunk per
// helper, already running (on two cores a helper may be waiting for this very core).
inline void WaitForDone(const std::atomic<int64_t>& done, int64_t n) {
  for (int spins = 0; done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 2000) {
      Pause();
    } else {
      std::this_thread::yield();
    }
  }
}

struct Counters {
  explicit Counters(int64_t n) : num_chunks(n) {}
  const int64_t num_chunks;
  std::atomic<int64_t> next{0};  // the next chunk to take
  std::atomic<int64_t> done{0};  // chunks finished
};

// Takes chunks until none is left; `body` is dereferenced only for a chunk this thread took,
// and the caller does not return before that chunk is done, so it is still alive then.
template <typename Body>
void Drain(Counters& counters, const Body* body, int64_t worker) {
  for (int64_t chunk = counters.next.fetch_add(1, std::memory_order_relaxed);
       chunk < counters.num_chunks;
       chunk = counters.next.fetch_add(1, std::memory_order_relaxed)) {
    (*body)(chunk, worker);
    counters.done.fetch_add(1, std::memory_order_release);
  }
}

// The process's helper team. Its state is shared by every op library through the small
// runtime library (helpers.cc) that the loader makes global before loading any op library;
// without it each library has a team of its own.
struct HelperTeam {
  // job << 48 | workers << 40 | num_chunks << 20 | next chunk: one compare-and-swap claims
  // a chunk of the job it names, so a helper never runs a chunk of a job that has ended,
  // and reads `run` and `body` only after claiming (the caller rewrites them only once
  // every chunk of the job before is done)
  std::atomic<uint64_t> ticket{0};
  std::atomic<int64_t> done{0};
  void (*run)(const void*, int64_t, int64_t) = nullptr;
  const void* body = nullptr;
  std::atomic<bool> busy{false};  // an op is using the team
  int64_t helpers = 0;
  std::chrono::nanoseconds linger{0};
  std::atomic<int64_t> sleeping{0};
  std::mutex mu;
  std::condition_variable cv;
  uint64_t wakes = 0;  // guarded by mu
};

constexpr uint64_t kFieldMask20 = (uint64_t{1} << 20) - 1;
constexpr int64_t kMaxTeamChunks = int64_t{1} << 20;

// Whether the job a ticket names has a chunk nobody has claimed yet.
inline bool HasUnclaimedChunk(uint64_t ticket) {
  return (ticket & kFieldMask20) < ((ticket >> 20) & kFieldMask20);
}

// Claims and runs one chunk of the current job as `worker`; false when none is left for it.
inline bool TakeTeamChunk(HelperTeam& team, int64_t worker) {
  uint64_t t = team.ticket.load(std::memory_order_acquire);
  while (HasUnclaimedChunk(t) && worker < static_cast<int64_t>((t >> 40) & 0xff)) {
    if (team.ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
      team.run(team.body, static_cast<int64_t>(t & kFieldMask20), worker);
      team.done.fetch_add(1, std::memory_order_release);
      return true;
    }
  }
  return false;
}

inline void HelperLoop(HelperTeam* team, int64_t worker) {
  pthread_setname_np(pthread_self(), "tokenserve-help");  // as tests and `top -H` see them
  using Clock = std::chrono::steady_clock;
  auto last = Clock::now();
  for (int spins = 0;;) {
    if (TakeTeamChunk(*team, worker)) {
      spins = 0;
      last = Clock::now();
      continue;
    }
    if (++spins < 64) {
      Pause();
      continue;
    }
    spins = 0;
    // every 64 polls: let a runnable thread of this core in (TF's pool, the server's
    // threads), and go to sleep once the team has had no chunk for `linger`
    std::this_thread::yield();
    if (Clock::now() - last < team->linger) continue;
    std::unique_lock<std::mutex> lock(team->mu);
    const uint64_t seen = team->wakes;
    team->sleeping.fetch_add(1, std::memory_order_seq_cst);
    if (!HasUnclaimedChunk(team->ticket.load(std::memory_order_seq_cst))) {  // none posted since
      team->cv.wait(lock, [&] { return team->wakes != seen; });
    }
    team->sleeping.fetch_sub(1, std::memory_order_relaxed);
    last = Clock::now();
  }
}

// A new team of `workers - 1` helper threads (they live as long as the process), or
// nullptr when TOKENSERVE_KERNEL_SPIN_US is 0 or there is nobody to help.
inline HelperTeam* NewHelperTeam(int64_t workers) {
  const char* env = std::getenv("TOKENSERVE_KERNEL_SPIN_US");
  const long long linger_us = env != nullptr && *env != '\0' ? std::atoll(env) : 2000;
  if (linger_us <= 0 || workers < 2) return nullptr;
  auto* team = new HelperTeam;
  team->helpers = std::min<int64_t>(workers, 255) - 1;
  team->linger = std::chrono::microseconds(linger_us);
  for (int64_t worker = 1; worker <= team->helpers; ++worker) {
    std::thread(HelperLoop, team, worker).detach();
  }
  return team;
}

}  // namespace chunks_internal
}  // namespace tokenserve

// Defined by the runtime library (helpers.cc) when the loader made it global: the one team
// of the process, created by its first caller with that caller's worker count.
extern "C" __attribute__((weak)) void* tokenserve_helper_team(int64_t workers);

namespace tokenserve {
namespace chunks_internal {

inline HelperTeam* ProcessHelperTeam(int64_t workers) {
  if (tokenserve_helper_team != nullptr) {
    return static_cast<HelperTeam*>(tokenserve_helper_team(workers));
  }
  static HelperTeam* const team = NewHelperTeam(workers);  // this library's own
  return team;
}

// Runs the chunks on the calling thread and the team; false (nothing run) when there is no
// team or another op is using it. Workers past the team's size get no chunk, so per-worker
// scratch sized for `workers` stays in range.
template <typename Body>
bool RunOnTeam(int64_t workers, int64_t num_chunks, const Body& body) {
  HelperTeam* team = ProcessHelperTeam(workers);
  if (team == nullptr || num_chunks >= kMaxTeamChunks) return false;
  if (team->busy.exchange(true, std::memory_order_acquire)) return false;
  workers = std::min<int64_t>(workers, team->helpers + 1);
  team->run = [](const void* b, int64_t chunk, int64_t worker) {
    (*static_cast<const Body*>(b))(chunk, worker);
  };
  team->body = &body;
  team->done.store(0, std::memory_order_relaxed);
  // only the op holding `busy` writes the ticket, so the last job's number is its own
  const uint64_t job = ((team->ticket.load(std::memory_order_relaxed) >> 48) + 1) & 0xffff;
  team->ticket.store(job << 48 | static_cast<uint64_t>(workers) << 40 |
                         static_cast<uint64_t>(num_chunks) << 20,
                     std::memory_order_seq_cst);
  if (team->sleeping.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(team->mu);
    ++team->wakes;
    team->cv.notify_all();
  }
  while (TakeTeamChunk(*team, 0)) {
  }
  WaitForDone(team->done, num_chunks);
  team->busy.store(false, std::memory_order_release);
  return true;
}
}  // namespace chunks_internal

// Runs body(chunk, worker) once for each chunk in [0, num_chunks), on the calling thread
// (worker 0) and up to `workers - 1` helpers (workers 1, 2, ...: the process's helper team,
// or pool threads when the team is busy or off), each taking the next
// chunk from a shared counter. Returns when every chunk has run. Chunks of one worker run
// one after another, so per-worker scratch (indexed by `worker`) needs no locking.
template <typename Body>
void RunChunks(tensorflow::thread::ThreadPool* pool, int64_t workers, int64_t num_chunks,
               const Body& body) {
  workers = std::min(workers, num_chunks);
  if (workers <= 1 || pool == nullptr) {
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) body(chunk, 0);
    return;
  }
  if (chunks_internal::RunOnTeam(workers, num_chunks, body)) return;
  auto counters = std::make_shared<chunks_internal::Counters>(num_chunks);
  for (int64_t worker = 1; worker < workers; ++worker) {
    pool->Schedule([counters, body_ptr = &body, worker] {
      chunks_internal::Drain(*counters, body_ptr, worker);
    });
  }
  chunks_internal::Drain(*counters, &body, 0);
  chunks_internal::WaitForDone(counters->done, num_chunks);
}

// Work per chunk handed between threads, in cycles, roughly.
constexpr int64_t kChunkCycles = 40000;

// `items` of about `cost` cycles each cut into chunks of about kChunkCycles: a small call
// stays one chunk (on the calling thread), a big one is shared. At most `items` chunks.
struct ChunkSplit {
  int64_t per_chunk, num_chunks;
};
inline ChunkSplit SplitIntoChunks(int64_t items, int64_t cost) {
  const int64_t wanted = std::max<int64_t>(1, std::min(items, items * cost / kChunkCycles));
  const int64_t per_chunk = std::max<int64_t>(1, (items + wanted - 1) / wanted);
  return {per_chunk, (items + per_chunk - 1) / per_chunk};
}

// Runs body(item, worker, next) once for each item in [0, num_items), like RunChunks, but
// each worker owns one contiguous range of items and takes them front to back, so it knows
// the item it will most likely take next (`next`, -1 if none) and can prefetch its data
// while it computes this one. A worker whose range is done takes items from the back of
// the others' ranges, so a pool thread that wakes late costs its range's tail, not the op,
// and the ranges meet where the work does. (With one shared counter, the next item a
// worker takes is unknown, and a wrong guess prefetches into the other core's cache.)
template <typename Body>
void RunRanges(tensorflow::thread::ThreadPool* pool, int64_t workers, int64_t num_items,
               const Body& body) {
  const int64_t ranges = std::max<int64_t>(1, std::min(workers, num_items));
  // a range's undone items [front, back), as front << 32 | back, so one compare-and-swap
  // takes an item from either end
  std::unique_ptr<std::atomic<uint64_t>[]> range(new std::atomic<uint64_t>[ranges]);
  for (int64_t r = 0; r < ranges; ++r) {
    const uint64_t front = r * num_items / ranges, back = (r + 1) * num_items / ranges;
    range[r].store(front << 32 | back, std::memory_order_relaxed);
  }
  // takes one item from range r's front (or back); -1 when the range is done
  auto take = [&](int64_t r, bool from_front, int64_t* next) -> int64_t {
    uint64_t v = range[r].load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v >> 32, back = v & 0xffffffffu;
      if (front >= back) return -1;
      const uint64_t taken = v + (from_front ? uint64_t{1} << 32 : ~uint64_t{0});
      if (range[r].compare_exchange_weak(v, taken, std::memory_order_relaxed)) {
        const int64_t item = from_front ? front : back - 1;
        *next = back - front > 1 ? (from_front ? item + 1 : item - 1) : -1;
        return item;
      }
    }
  };
  // The ranges are touched only inside chunks, which RunChunks waits for, so a pool thread
  // that wakes after the op returned never sees them.
  RunChunks(pool, ranges, ranges, [&](int64_t own, int64_t worker) {
    int64_t next;
    for (int64_t item; (item = take(own, true, &next)) >= 0;) body(item, worker, next);
    for (int64_t r = 1; r < ranges; ++r) {
      for (int64_t item; (item = take((own + r) % ranges, false, &next)) >= 0;) {
        body(item, worker, next);
      }
    }
  });
}

// The end (exclusive) of the items a RunRanges worker reads back to back from `item` on:
// past `next` when that follows `item`, else just `item`. Kernels that prefetch ahead of
// their stream stop there.
inline int64_t RangeStreamEnd(int64_t item, int64_t next) {
  return next == item + 1 ? item + 2 : item + 1;
}

}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_CHUNKS_H_
