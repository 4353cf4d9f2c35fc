// Splitting one op's work between its calling thread and TF's intra-op pool, without
// waiting for pool threads that wake up too late to help.
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
#ifndef TOKENSERVE_KERNELS_CHUNKS_H_
#define TOKENSERVE_KERNELS_CHUNKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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

}  // namespace chunks_internal

// Runs body(chunk, worker) once for each chunk in [0, num_chunks), on the calling thread
// (worker 0) and up to `workers - 1` pool threads (workers 1, 2, ...), each taking the next
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
  auto counters = std::make_shared<chunks_internal::Counters>(num_chunks);
  for (int64_t worker = 1; worker < workers; ++worker) {
    pool->Schedule([counters, body_ptr = &body, worker] {
      chunks_internal::Drain(*counters, body_ptr, worker);
    });
  }
  chunks_internal::Drain(*counters, &body, 0);
  // What is left is at most one chunk per helper, already running: spin briefly, then yield
  // (on two cores the helper may be waiting for this very core).
  for (int spins = 0; counters->done.load(std::memory_order_acquire) < num_chunks; ++spins) {
    if (spins < 2000) {
      chunks_internal::Pause();
    } else {
      std::this_thread::yield();
    }
  }
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
