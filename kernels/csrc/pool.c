/* The thread pool every kernel's slices run on, and the per-thread scratch buffers (no instruction-set code).
 *
 * - kw_run: slices on the calling thread's OpenMP team (torch's) when Python has seen one OpenMP runtime in the
 *   process (kw_use_openmp(1)): right after a torch op that team is still spinning, where a pool of our own had to
 *   fight it for the cores (measured: 2-2.4x slower calls right after a torch matmul). Else on a pool of T-1
 *   threads of ours that park on a condition variable after a short spin; calls from several threads take turns
 *   (one owns the pool at a time).
 * - A fork()ed child inherits none of the pool's threads and libgomp's team does not survive a fork (torch's own
 *   ops hang there): the child starts a pool afresh, never OpenMP (child_after_fork).
 */
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdlib.h>

#include "kw.h"

#define SPIN 2000

static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER; /* one call at a time owns the pool */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static kw_slice_fn g_fn;
static const void *g_arg; /* the calling thread's job: it waits for every slice before returning */
static atomic_int g_gen, g_done, g_nactive;
static int g_pool;       /* pool threads started (T-1) */
static int g_born[MAXT]; /* the generation each pool thread was started at: its first job is the next one */
static int g_atfork;
static int g_openmp; /* kw_use_openmp(1): slices run on the calling thread's OpenMP team (torch's) */

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    int seen = g_born[t];
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&g_gen, memory_order_acquire) == seen && spins < SPIN) {
            _mm_pause();
            spins++;
        }
        if (atomic_load_explicit(&g_gen, memory_order_acquire) == seen) {
            pthread_mutex_lock(&g_mu);
            while (atomic_load(&g_gen) == seen) pthread_cond_wait(&g_cv, &g_mu);
            pthread_mutex_unlock(&g_mu);
        }
        seen = atomic_load(&g_gen);
        int n = atomic_load(&g_nactive);
        if (t < n) g_fn(g_arg, t, n);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
    return NULL;
}

static void child_after_fork(void) {
    g_pool = 0;
    g_openmp = 0;
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
}

static void watch_forks(void) {
    if (!g_atfork) {
        pthread_atfork(NULL, NULL, child_after_fork);
        g_atfork = 1;
    }
}

static int ensure_pool(int want) {
    watch_forks();
    while (g_pool < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_born[g_pool + 1] = atomic_load(&g_gen);
        int rc = pthread_create(&th, &attr, worker, (void *)(intptr_t)(g_pool + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) return 0;
        g_pool++;
    }
    return 1;
}

/* Python turns this on once it has seen that the libgomp this library uses is the one torch uses. */
void kw_use_openmp(int on) {
    watch_forks();
    g_openmp = on;
}

int kw_threads(int nthreads) { return nthreads < 1 ? 1 : nthreads > MAXT ? MAXT : nthreads; }

/* Slice 0 on the calling thread, the others on the team or the pool; alone when the pool cannot grow. */
void kw_run(kw_slice_fn fn, const void *arg, int nthreads) {
#ifdef _OPENMP
    if (nthreads > 1 && g_openmp) {
#pragma omp parallel num_threads(nthreads)
        fn(arg, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    if (nthreads > 1) pthread_mutex_lock(&g_call);
    if (nthreads == 1 || !ensure_pool(nthreads - 1)) {
        fn(arg, 0, 1);
        if (nthreads > 1) pthread_mutex_unlock(&g_call);
        return;
    }
    g_fn = fn;
    g_arg = arg;
    atomic_store(&g_nactive, nthreads);
    atomic_store(&g_done, 0);
    pthread_mutex_lock(&g_mu);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_release);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    fn(arg, 0, nthreads);
    while (atomic_load_explicit(&g_done, memory_order_acquire) < g_pool) _mm_pause();
    pthread_mutex_unlock(&g_call);
}

void *kw_scratch(kw_buf *b, size_t bytes) {
    if (b->cap < bytes) {
        free(b->p);
        b->p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}
