/* STREAM-like memory bandwidth: the triad a[i] = b[i] + s * c[i] (McCalpin's STREAM
 * kernel and byte counting: 3 arrays x 8 bytes per element, write-allocate traffic not
 * counted), plus a read-only sum, the access pattern of a decode GEMV over the weights.
 *
 *   cc -O3 -fopenmp -march=native scripts/stream_triad.c -o /tmp/stream_triad
 *   OMP_NUM_THREADS=2 /tmp/stream_triad [MiB per array, default 1024] [repetitions, 10]
 *
 * Prints one key=value line per kernel: best (max) GB/s over the repetitions, the first
 * one (page faults) excluded. Arrays are first touched in parallel, as STREAM does.
 * Use arrays several times the last-level cache: lscpu says 480 MB here and a quiet host
 * lets one process use much of it (256 MiB arrays read 49 GB/s, 1024 MiB ones 35 GB/s).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    int reps = argc > 2 ? atoi(argv[2]) : 10;
    size_t n = mib * (1u << 20) / sizeof(double);
    if (n == 0 || reps < 2) {
        fprintf(stderr, "usage: %s [MiB per array >= 1] [repetitions >= 2]\n", argv[0]);
        return 2;
    }
    double *a = aligned_alloc(64, n * sizeof(double));
    double *b = aligned_alloc(64, n * sizeof(double));
    double *c = aligned_alloc(64, n * sizeof(double));
    if (!a || !b || !c) {
        fprintf(stderr, "stream_triad: out of memory\n");
        return 1;
    }
    const double s = 3.0;
    long i, nn = (long)n;
#pragma omp parallel for schedule(static)
    for (i = 0; i < nn; i++) {
        a[i] = 0.0;
        b[i] = 1.0;
        c[i] = 2.0;
    }
    double best_triad = 0.0, best_read = 0.0, sink = 0.0;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
#pragma omp parallel for schedule(static)
        for (i = 0; i < nn; i++)
            a[i] = b[i] + s * c[i];
        double t1 = now();
        double sum = 0.0;
#pragma omp parallel for simd schedule(static) reduction(+ : sum)
        for (i = 0; i < nn; i++)            /* simd: lanes may reassociate the sum */
            sum += b[i];
        double t2 = now();
        sink += sum + a[r % nn];
        if (r == 0)
            continue;                       /* first pass: page faults, cold TLB */
        double triad = 3.0 * (double)n * sizeof(double) / (t1 - t0) / 1e9;
        double read = (double)n * sizeof(double) / (t2 - t1) / 1e9;
        best_triad = triad > best_triad ? triad : best_triad;
        best_read = read > best_read ? read : best_read;
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("[STREAM] kernel=triad threads=%d array_mib=%zu best_gbs=%.2f\n", threads, mib,
           best_triad);
    printf("[STREAM] kernel=read threads=%d array_mib=%zu best_gbs=%.2f\n", threads, mib,
           best_read);
    if (sink == 42.0)
        printf("\n");                       /* keep the sums alive */
    free(a);
    free(b);
    free(c);
    return 0;
}
