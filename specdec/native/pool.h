// The kernels' thread pool: a parallel loop whose caller never waits for a thread that has not started.
#ifndef SPECDEC_POOL_H
#define SPECDEC_POOL_H

// Tasks [first, last) of a loop: `worker` is 0 for the caller and 1..threads - 1 for the pool's threads (an index into
// per-worker scratch); a task writes only its own outputs.
typedef void (*pool_task)(void *ctx, int first, int last, int worker);

// Run tasks 0..n - 1 on up to `threads` threads, the caller among them; returns when every task has run. A claim
// takes what is left over the threads (large first, then smaller), so a loop costs few claims and ends evenly.
void pool_run(int threads, pool_task fn, void *ctx, int n);

#endif
