/* The W4A16 CPU kernel's worker threads: `run_parallel(fn, ctx, num_chunks, nt)` runs fn(ctx, c, n) for
   every chunk c in 0..n-1 on the calling thread and up to nt - 1 workers, and returns when all are done.

   Decode calls the kernel ~100 times per token with ~10-100 us of work each, on machines that are often
   shared. So: (1) chunks are taken, not assigned: a job is one 64-bit ticket (generation << 32 | next
   chunk) that threads advance with compare-and-swap, and the caller takes chunks too, so a worker that
   is slow to wake (or descheduled by another process) delays nothing but the chunk it took; the caller
   waits only for chunks in progress. A CAS that succeeds proves the job was still open when its fields
   were read, so no worker ever needs to acknowledge a job. (2) Waking sleeping threads (a futex wake and
   an IPI, tens of us in a VM) would cost as much as the work, so workers poll for a while after each
   job (SPIN_NS, yielding the CPU after the first SPIN_PAUSE_NS) before they sleep on a condition
   variable. Workers are created on first use, never joined, and forgotten in a forked child. */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 256
#define SPIN_PAUSE_NS 20000LL /* poll with `pause` this long, then with sched_yield */
#define SPIN_NS 200000LL      /* ~the gap between two Linear calls of a decode step, with margin */

typedef void (*task_fn)(void *ctx, int64_t chunk, int64_t num_chunks);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t ticket; /* generation << 32 | next chunk */
    atomic_llong done;       /* chunks finished in the current job */
    atomic_int sleepers;     /* workers waiting on cv */
    _Atomic(task_fn) fn;
    _Atomic(void *) ctx;
    atomic_llong num_chunks;
    int num_workers; /* threads 1..num_workers exist */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Take and run chunks of generation `gen` until none is left (or a newer job replaced it). */
static void take_chunks(uint32_t gen) {
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        if ((uint32_t)(t >> 32) != gen)
            return;
        task_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        long long n = atomic_load_explicit(&pool.num_chunks, memory_order_relaxed);
        int64_t chunk = (int64_t)(t & 0xFFFFFFFFu);
        if (chunk >= n)
            return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1))
            continue;
        fn(ctx, chunk, n); /* the CAS proved fn, ctx and n were this open job's when read */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *pool_worker(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        long long start = now_ns(), elapsed = 0;
        uint32_t gen = (uint32_t)(atomic_load(&pool.ticket) >> 32);
        for (int i = 0; gen == seen; i++) {
            if (elapsed < SPIN_PAUSE_NS)
                cpu_relax();
            else
                sched_yield();
            gen = (uint32_t)(atomic_load(&pool.ticket) >> 32);
            if ((i & 63) == 63 && (elapsed = now_ns() - start) > SPIN_NS)
                break;
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = (uint32_t)(atomic_load(&pool.ticket) >> 32)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        take_chunks(gen);
    }
    return NULL;
}

/* For pthread_atfork's child handler (registered by the module). */
static void pool_forget_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.num_workers = 0; /* the child has only the forking thread */
}

/* Make sure threads 1..n-1 exist (as far as the system allows). */
static void pool_ensure(int n) {
    n = n > MAX_THREADS ? MAX_THREADS : n;
    while (pool.num_workers < n - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        uintptr_t gen = (uintptr_t)(atomic_load(&pool.ticket) >> 32);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, pool_worker, (void *)gen);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool.num_workers++;
    }
}

/* Callers serialize (the module holds one lock around each kernel call). */
static void run_parallel(task_fn fn, void *ctx, int64_t num_chunks, int nt) {
    if (nt <= 1 || num_chunks <= 1) {
        for (int64_t c = 0; c < num_chunks; c++)
            fn(ctx, c, num_chunks);
        return;
    }
    pool_ensure(nt);
    uint32_t gen = (uint32_t)(atomic_load(&pool.ticket) >> 32) + 1;
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.num_chunks, num_chunks, memory_order_relaxed);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.ticket, (uint64_t)gen << 32); /* seq_cst: publishes the fields above */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    take_chunks(gen);
    long long start = now_ns();
    for (int i = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < num_chunks; i++) {
        if ((i & 63) == 63 && now_ns() - start > SPIN_PAUSE_NS)
            sched_yield(); /* the chunk's thread may be waiting for this CPU */
        else
            cpu_relax();
    }
}
