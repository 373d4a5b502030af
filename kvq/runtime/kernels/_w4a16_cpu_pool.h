/* The W4A16 CPU kernel's worker threads: `run_parallel(fn, ctx, nt)` runs fn(ctx, tid, nt) for tid in
   0..nt-1, tid 0 on the calling thread, and returns when all are done.

   Decode calls the kernel ~100 times per token with ~10-100 us of work each, so waking sleeping threads
   (a futex wake and an IPI per call, tens of us in a VM) would cost as much as the work. Workers spin
   for a short while after each job (SPIN_NS) and only then sleep on a condition variable; a call that
   finds them spinning costs one cache-line write. Jobs are published by a generation counter; every
   worker acknowledges every generation (so job fields are never rewritten under a slow worker). Workers
   are created on first use, never joined, and forgotten in a forked child (pthread_atfork). */

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 256
#define SPIN_NS 200000LL /* ~the gap between two Linear calls of a decode step, with margin */

typedef void (*task_fn)(void *ctx, int tid, int nt);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;     /* bumped once per job */
    atomic_int pending;  /* workers yet to acknowledge the current job */
    atomic_int sleepers; /* workers waiting on cv */
    task_fn fn;
    void *ctx;
    int nt;
    int num_workers; /* threads 1..num_workers exist */
    unsigned start_gen[MAX_THREADS];
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

static void *pool_worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seen = pool.start_gen[id];
    for (;;) {
        unsigned g = atomic_load_explicit(&pool.gen, memory_order_acquire);
        long long deadline = now_ns() + SPIN_NS;
        for (int i = 0; g == seen; i++) {
            cpu_relax();
            g = atomic_load_explicit(&pool.gen, memory_order_acquire);
            if ((i & 255) == 255 && g == seen && now_ns() > deadline)
                break;
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((g = atomic_load(&pool.gen)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        if (id < pool.nt)
            pool.fn(pool.ctx, id, pool.nt);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

static void pool_forget_after_fork(void) {
    /* the child has only the forking thread: its workers are gone */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.pending, 0);
    pool.num_workers = 0;
}

/* Make sure threads 1..n-1 exist; returns how many threads a job can use (n, or fewer on failure). */
static int pool_ensure(int n) {
    static int is_fork_handled = 0;
    if (!is_fork_handled) {
        pthread_atfork(NULL, NULL, pool_forget_after_fork);
        is_fork_handled = 1;
    }
    if (n > MAX_THREADS)
        n = MAX_THREADS;
    while (pool.num_workers < n - 1) {
        int id = pool.num_workers + 1;
        pthread_t thread;
        pthread_attr_t attr;
        pool.start_gen[id] = atomic_load(&pool.gen);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool.num_workers = id;
    }
    return n < pool.num_workers + 1 ? n : pool.num_workers + 1;
}

/* Callers serialize (the module holds one lock around each kernel call). */
static void run_parallel(task_fn fn, void *ctx, int nt) {
    nt = nt < 1 ? 1 : pool_ensure(nt);
    if (nt == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nt = nt;
    atomic_store(&pool.pending, pool.num_workers);
    atomic_fetch_add(&pool.gen, 1); /* seq_cst: ordered before the sleepers load below */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    fn(ctx, 0, nt);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0)
        cpu_relax();
}
