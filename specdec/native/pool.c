// A parallel loop for a machine that other processes share.
//
// OpenMP's loops end in a barrier that waits for every thread of the team, so where another process holds a core a
// token's ~150 loops each wait for a descheduled thread. Here the tasks of a loop are claimed one at a time from a
// shared counter, by the caller and by whichever pool threads are running: a thread that has not woken up claims
// nothing, and the caller does its share. The caller waits only for tasks another thread has claimed and not yet
// finished. Pool threads spin briefly for the next loop (a forward's loops follow each other within microseconds),
// then sleep on a futex; the caller wakes them and starts on the tasks at once, without waiting for them.
//
// The claim word packs the next task, the task count and the loop's thread count, so a claim either takes a task of
// the loop that is running or fails: a thread that read the word of an older loop cannot take a task of a newer one
// with an older loop's function. One loop runs at a time; a second caller (another Python thread) runs its loop on
// its own thread instead of waiting. A forked child starts its own pool threads when it first needs them.
#define _GNU_SOURCE
#include "pool.h"

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "specdec_native.h"

#define SPIN_NS 100000L  // a pool thread spins this long for the next loop before it sleeps
#define TASK_BITS 28     // claim word: next task (28 bits) | task count (28 bits) | threads - 1 (8 bits)
#define TASK_MASK ((1ULL << TASK_BITS) - 1)

// Each atomic on a cache line of its own: the claims, the count of finished tasks and the loop counter the idle
// threads poll would otherwise move one line between the cores at every claim.
typedef struct {
    _Alignas(64) _Atomic uint64_t claim;
    _Alignas(64) _Atomic uint32_t generation;  // bumped for every loop; sleeping threads wait on it
    _Alignas(64) _Atomic int done;             // tasks of the running loop finished by pool threads
    _Alignas(64) _Atomic int sleepers;
    _Alignas(64) int workers;                  // pool threads started (1..workers)
    pool_task fn;
    void *ctx;
    pthread_mutex_t lock;  // one loop at a time
} pool_t;

static pool_t P = {.lock = PTHREAD_MUTEX_INITIALIZER};
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;

// fork() keeps only the calling thread: the child must not inherit a held lock or count the parent's threads
static void before_fork(void) {
    pthread_mutex_lock(&start_lock);
    pthread_mutex_lock(&P.lock);
}
static void after_fork_in_parent(void) {
    pthread_mutex_unlock(&P.lock);
    pthread_mutex_unlock(&start_lock);
}
static void after_fork_in_child(void) {
    pthread_mutex_init(&P.lock, NULL);
    pthread_mutex_init(&start_lock, NULL);
    P.workers = 0;
    atomic_store(&P.sleepers, 0);
}
static void setup(void) { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); }

static inline uint64_t pack(uint64_t next, uint64_t n, int threads) {
    return next | n << TASK_BITS | (uint64_t)(threads - 1) << (2 * TASK_BITS);
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

// Take the next tasks of the running loop for `worker`, [first, *last): a 1 / threads share of those left, at
// least one; -1 when none is left or the worker is not one of the loop's threads.
static int claim(int worker, int *last) {
    uint64_t word = atomic_load_explicit(&P.claim, memory_order_acquire);
    for (;;) {
        const uint64_t next = word & TASK_MASK, n = word >> TASK_BITS & TASK_MASK;
        const int threads = (int)(word >> 2 * TASK_BITS) + 1;
        if (next >= n || worker >= threads) return -1;
        uint64_t share = (n - next) / (uint64_t)threads;
        share = share ? share : 1;
        if (atomic_compare_exchange_weak_explicit(&P.claim, &word, word + share, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *last = (int)(next + share);
            return (int)next;
        }
    }
}

static uint32_t wait_for_loop(uint32_t old) {
    long started = now_ns();
    for (int spin = 1;; spin++) {
        const uint32_t seen = atomic_load_explicit(&P.generation, memory_order_acquire);
        if (seen != old) return seen;
        if (spin % 64 || now_ns() - started < SPIN_NS) {
            _mm_pause();
            continue;
        }
        atomic_fetch_add(&P.sleepers, 1);  // then read the generation again: a caller that bumped it sees us
        if (atomic_load(&P.generation) == old)
            syscall(SYS_futex, &P.generation, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
        atomic_fetch_sub(&P.sleepers, 1);
        started = now_ns();
    }
}

static void *worker_main(void *arg) {
    const int worker = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&P.generation);
    for (;;) {
        seen = wait_for_loop(seen);
        int mine = 0;
        for (int first, last; (first = claim(worker, &last)) >= 0; mine += last - first)
            P.fn(P.ctx, first, last, worker);  // the loop cannot end before these are counted: fn and ctx stay valid
        if (mine) atomic_fetch_add_explicit(&P.done, mine, memory_order_release);  // once: one line move a loop
    }
    return NULL;
}

// Start pool threads up to `count` (fewer where the system refuses; the loops stay correct with any number).
static void start_workers(int count) {
    pthread_mutex_lock(&start_lock);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  // signals go to the caller's threads, never to the pool's
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (P.workers < count) {
        pthread_t thread;
        if (pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)(P.workers + 1))) break;
        P.workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_mutex_unlock(&start_lock);
}

static void run_alone(pool_task fn, void *ctx, int n) { fn(ctx, 0, n, 0); }

void pool_run(int threads, pool_task fn, void *ctx, int n) {
    if (threads > SPECDEC_MAX_THREADS) threads = SPECDEC_MAX_THREADS;
    if (threads <= 1 || n <= 1 || (uint64_t)n > TASK_MASK) {
        run_alone(fn, ctx, n);
        return;
    }
    pthread_once(&once, setup);
    if (pthread_mutex_trylock(&P.lock)) {  // another thread's loop is running: this one runs on its caller
        run_alone(fn, ctx, n);
        return;
    }
    if (P.workers < threads - 1) start_workers(threads - 1);
    P.fn = fn;
    P.ctx = ctx;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.claim, pack(0, (uint64_t)n, threads), memory_order_release);
    atomic_fetch_add(&P.generation, 1);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    int mine = 0;
    for (int first, last; (first = claim(0, &last)) >= 0; mine += last - first) fn(ctx, first, last, 0);
    // what is left was claimed by pool threads that are running it; a preempted one is waited for, yielding the core
    for (long spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < n - mine; spins++) {
        if (spins < 4096) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&P.lock);
}
