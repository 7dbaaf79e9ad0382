/* The calling thread's OpenMP worker threads, handed back.
 *
 * libgomp keeps a pool of workers for every thread that has started a parallel region, and once the pools together
 * hold more threads than the process has CPUs it spins only ~100 times at a region's end before it sleeps on a futex.
 * An engine loads its weights on one thread and steps on another: two pools of two threads on two cores, so every
 * one of a decode step's hundreds of regions ended with its worker asleep and woken again (a W4A16 batch-1 step on a
 * 2-core Xeon: 30-34 ms with the loading thread's pool alive, 24-26 ms without). */
#include <stdint.h>

#if defined(_OPENMP)
/* OpenMP 5.0's pause, declared here and weak: GCC implements it from version 9 yet still says _OPENMP 201511, and an
 * older runtime without it must not stop the whole library from loading. 1 is omp_pause_soft. */
extern int omp_pause_resource_all(int kind) __attribute__((weak));
#endif

/* Frees the calling thread's pool (its threads exit; a later parallel region on this thread starts new ones).
 * Returns 1 when the runtime did, 0 where it cannot (a build without OpenMP, a runtime without the call, or a call
 * from inside a parallel region). */
int64_t release_thread_pool(void) {
#if defined(_OPENMP)
    return omp_pause_resource_all != 0 && omp_pause_resource_all(1) == 0;
#else
    return 0;
#endif
}
