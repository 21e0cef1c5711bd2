// The packed engine's own threads: every parallel loop of a forward runs on a pool the engine owns, never on the
// caller's OpenMP team.
//
// Why: the kernels' loops are many and small (some 180 a one-token step, a few microseconds to a few hundred each),
// so what a loop costs to start matters as much as the loop. On OpenMP (at::parallel_for) that cost belonged to the
// host process: once it held more OpenMP threads than cores (any torch op in another thread, llama.cpp, a library
// that runs OpenMP), libgomp stopped spin-waiting in every team and each loop paid a wake-up, a step about 3x its
// cost on 2 cores. Here the pool's threads are not OpenMP's, and nothing the host does changes how they wait.
//
// How, as llama.cpp's thread pool does it: the calling thread is the pool's first worker, and the others wait for
// work by spinning briefly (SPIN_NS: long enough to stay awake across one forward's loops and from one decode step
// to the next), then sleep on a condition variable, so an idle pool costs nothing. A loop is split as
// at::parallel_for split it (at most one chunk a thread, no chunk under its grain); chunks are claimed from one
// atomic ticket, so a worker the OS has not yet scheduled never holds up the loop: the caller takes its chunk.
// Where a chunk runs changes no result: every output element of the kernels is computed by one fixed sequence of
// operations (kernels_impl.h).
//
// One pool per thread count, shared by every model in the process that asks for that count, and held by one call
// (a forward, a matmul, a drafter's block) at a time: two engines decoding at once take turns at the cores instead of
// spinning against each other on them.
#pragma once

#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

class ComputePool {
   public:
    // How long an idle worker spins before it sleeps: a one-token step's loops come microseconds apart and one step
    // follows another within a millisecond or two of Python, so a decoding pool never sleeps; an idle one sleeps
    // after this long.
    static constexpr int64_t SPIN_NS = 2'000'000;

    explicit ComputePool(int threads) : threads_(std::max(1, threads)), ran_(threads_), ids_(threads_) {
        for (int slot = 1; slot < threads_; ++slot) workers_.emplace_back([this, slot] { work(slot); });
        // Each worker writes its id first thing; wait for them so worker_ids() is complete from the start.
        for (int slot = 1; slot < threads_; ++slot) {
            while (ids_[slot].load(std::memory_order_acquire) == 0) std::this_thread::yield();
        }
    }

    ~ComputePool() {
        {
            std::lock_guard<std::mutex> lock(sleep_mutex_);
            stop_.store(true);
        }
        sleep_cv_.notify_all();
        for (auto& worker : workers_) worker.join();
    }

    ComputePool(const ComputePool&) = delete;
    ComputePool& operator=(const ComputePool&) = delete;

    int threads() const { return threads_; }

    // The pool for `threads`, made on first use and kept for the life of the process (never destroyed: a worker
    // must not be joined while the interpreter tears down around a daemon thread's call).
    static std::shared_ptr<ComputePool> shared(int threads) {
        static std::mutex registry_mutex;
        static auto* registry = new std::map<int, std::shared_ptr<ComputePool>>();
        std::lock_guard<std::mutex> lock(registry_mutex);
        auto& pool = (*registry)[threads];
        if (!pool) pool = std::make_shared<ComputePool>(threads);
        return pool;
    }

    // Holds the pool for one top-level call on the calling thread, which becomes its first worker; a call made
    // inside another on the same thread shares the outer one's hold.
    class Session {
       public:
        explicit Session(ComputePool& pool) : pool_(pool), outer_(active_) {
            if (outer_ == &pool_) return;
            pool_.calls_.lock();
            active_ = &pool_;
            pool_.ids_[0].store(os_thread_id(), std::memory_order_relaxed);
            for (auto& ran : pool_.ran_) ran.store(0, std::memory_order_relaxed);
        }
        ~Session() {
            if (outer_ == &pool_) return;
            active_ = outer_;
            pool_.calls_.unlock();
        }
        Session(const Session&) = delete;
        Session& operator=(const Session&) = delete;

       private:
        ComputePool& pool_;
        ComputePool* outer_;
    };

    // f(b, e) over [begin, end) in chunks: serial where the range is no more than `grain`, the pool has one thread,
    // or the caller is already inside a chunk; else at most one chunk a thread, none under `grain` items (a matrix's
    // tiles: each thread reads one contiguous stretch of the weights).
    template <class F>
    void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
        const int64_t range = end - begin;
        if (range <= 0) return;
        if (threads_ == 1 || range <= grain || in_chunk_) {
            f(begin, end);
            return;
        }
        const int64_t parts = std::min<int64_t>(threads_, (range + std::max<int64_t>(grain, 1) - 1) /
                                                              std::max<int64_t>(grain, 1));
        run((range + parts - 1) / parts, begin, end, f);
    }

    // f(b, e) over [begin, end) one item at a time (a few at a time past MAX_CHUNKS items), each thread taking the
    // next as it finishes one: for items of unequal cost (attention's splits of a head, some of one position),
    // which one chunk a thread would leave unbalanced.
    template <class F>
    void parallel_each(int64_t begin, int64_t end, const F& f) {
        const int64_t range = end - begin;
        if (range <= 0) return;
        if (threads_ == 1 || range == 1 || in_chunk_) {
            f(begin, end);
            return;
        }
        run((range + MAX_CHUNKS - 1) / MAX_CHUNKS, begin, end, f);
    }

    // The OS thread ids of the pool's own workers (the caller's is not among them).
    std::vector<int64_t> worker_ids() const {
        std::vector<int64_t> ids;
        for (int slot = 1; slot < threads_; ++slot) ids.push_back(ids_[slot].load());
        return ids;
    }

    // The OS thread ids that ran at least one chunk in the last call (the caller's among them if it did).
    std::vector<int64_t> last_call_ids() const {
        std::lock_guard<std::mutex> lock(calls_);
        std::vector<int64_t> ids;
        for (int slot = 0; slot < threads_; ++slot) {
            if (ran_[slot].load(std::memory_order_relaxed)) ids.push_back(ids_[slot].load());
        }
        return ids;
    }

    // The pool the calling thread holds (inside a Session), else nullptr.
    static ComputePool* active() { return active_; }

   private:
    static constexpr int64_t MAX_CHUNKS = 0xffff;

    // Post a loop of chunks of `size` items, run chunks here until none is left to claim, then wait for the ones
    // the workers claimed.
    template <class F>
    void run(int64_t size, int64_t begin, int64_t end, const F& f) {
        const int64_t chunks = (end - begin + size - 1) / size;
        job_ = {&call<F>, &f, begin, end, size};
        failure_ = nullptr;
        done_.store(0, std::memory_order_relaxed);
        const uint32_t generation = ++generation_;
        ticket_.store(pack(generation, chunks, 0), std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lock(sleep_mutex_);
            sleep_cv_.notify_all();
        }
        run_chunks(0, generation);
        // A worker the OS took off its core mid-chunk holds the loop until it runs again: past a few microseconds
        // of waiting, offer this core to it.
        for (int spins = 1; done_.load(std::memory_order_acquire) < chunks; ++spins) {
            if (spins % 4096 == 0) {
                std::this_thread::yield();
            } else {
                _mm_pause();
            }
        }
        if (failure_) std::rethrow_exception(failure_);
    }

    struct Job {
        void (*fn)(const void*, int64_t, int64_t);
        const void* f;
        int64_t begin, end, size;
    };

    template <class F>
    static void call(const void* f, int64_t b, int64_t e) {
        (*static_cast<const F*>(f))(b, e);
    }

    // A ticket is a loop's generation (32 bits), its number of chunks and the next chunk to claim (16 bits each).
    static uint64_t pack(uint32_t generation, int64_t chunks, int64_t next) {
        return (static_cast<uint64_t>(generation) << 32) | (static_cast<uint64_t>(chunks) << 16) |
               static_cast<uint64_t>(next);
    }
    static uint32_t generation_of(uint64_t t) { return static_cast<uint32_t>(t >> 32); }

    static int64_t os_thread_id() {
        thread_local const int64_t id = static_cast<int64_t>(syscall(SYS_gettid));
        return id;
    }

    // Claim and run chunks of `generation`'s loop until none is left. The job's fields are read only after a claim
    // succeeds: the loop cannot end, and the next one overwrite them, while a claimed chunk runs.
    void run_chunks(int slot, uint32_t generation) {
        for (;;) {
            uint64_t t = ticket_.load(std::memory_order_acquire);
            if (generation_of(t) != generation || (t & 0xffff) >= ((t >> 16) & 0xffff)) return;
            if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
            const Job job = job_;
            const int64_t b = job.begin + static_cast<int64_t>(t & 0xffff) * job.size;
            in_chunk_ = true;
            try {
                job.fn(job.f, b, std::min(job.end, b + job.size));
            } catch (...) {
                std::lock_guard<std::mutex> lock(failure_mutex_);
                if (!failure_) failure_ = std::current_exception();
            }
            in_chunk_ = false;
            ran_[slot].store(1, std::memory_order_relaxed);
            done_.fetch_add(1, std::memory_order_release);
        }
    }

    void work(int slot) {
        pthread_setname_np(pthread_self(), "dspark-pool");
        ids_[slot].store(os_thread_id(), std::memory_order_release);
        uint32_t seen = 0;
        for (;;) {
            uint64_t t = ticket_.load(std::memory_order_acquire);
            if (generation_of(t) == seen) {
                if (!wait_for_work(seen)) return;
                continue;
            }
            seen = generation_of(t);
            run_chunks(slot, seen);
        }
    }

    // Spin for SPIN_NS, then sleep, until a loop newer than `seen` is posted; false once the pool stops.
    bool wait_for_work(uint32_t seen) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(SPIN_NS);
        for (int spins = 1;; ++spins) {
            if (generation_of(ticket_.load(std::memory_order_acquire)) != seen) return true;
            if (stop_.load(std::memory_order_relaxed)) return false;
            _mm_pause();
            if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
        }
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        sleep_cv_.wait(lock, [&] {
            return generation_of(ticket_.load(std::memory_order_seq_cst)) != seen || stop_.load();
        });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        return !stop_.load();
    }

    const int threads_;
    std::vector<std::thread> workers_;
    std::vector<std::atomic<uint8_t>> ran_;
    std::vector<std::atomic<int64_t>> ids_;
    mutable std::mutex calls_;
    Job job_{};
    uint32_t generation_ = 0;
    std::exception_ptr failure_;
    std::mutex failure_mutex_;
    alignas(64) std::atomic<uint64_t> ticket_{0};
    alignas(64) std::atomic<int64_t> done_{0};
    alignas(64) std::atomic<int> sleepers_{0};
    std::atomic<bool> stop_{false};
    std::mutex sleep_mutex_;
    std::condition_variable sleep_cv_;
    static thread_local ComputePool* active_;
    static thread_local bool in_chunk_;
};

inline thread_local ComputePool* ComputePool::active_ = nullptr;
inline thread_local bool ComputePool::in_chunk_ = false;

// The kernels' parallel loop: on the pool the calling thread holds, or serially where it holds none.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (ComputePool* pool = ComputePool::active()) {
        pool->parallel_for(begin, end, grain, f);
    } else if (begin < end) {
        f(begin, end);
    }
}

// The same, one item at a time (ComputePool::parallel_each).
template <class F>
inline void parallel_each(int64_t begin, int64_t end, const F& f) {
    if (ComputePool* pool = ComputePool::active()) {
        pool->parallel_each(begin, end, f);
    } else if (begin < end) {
        f(begin, end);
    }
}
