/* The one instruction-set dispatcher of the kernels (docs/DESIGN.md §5 Kernels and ISAs).
 *
 * The kernels are portable C compiled several times, once per variant, under a target
 * attribute:
 *   base     the build's own flags (x86-64 baseline: SSE2; aarch64: NEON, and sdot when
 *            built with -march=...+dotprod); the only variant off x86, without GCC/Clang,
 *            or built with -DKF_NO_DISPATCH;
 *   avx2     x86-64-v3 (AVX2, FMA, F16C, BMI2);
 *   avx512   x86-64-v4 + AVX512-VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later).
 * Each family of kernels keeps a table of its entry points indexed by variant (matmul.h,
 * attention.h); a family without code of its own for a variant lists the nearest lower
 * one there. No ifunc: the CPU is asked once, at import (kf_isa_init), the best variant
 * it runs is used, unless KESTREL_ISA=base|avx2|avx512 or kf_set_isa asks for a lower one
 * (the tests run them all). All of this lives in one extension module, so there is one
 * kf_isa for every kernel.
 */
#ifndef KESTREL_ISA_H
#define KESTREL_ISA_H

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KF_NO_DISPATCH)
#define KF_X86_DISPATCH 1
#else
#define KF_X86_DISPATCH 0
#endif

enum { KF_ISA_BASE = 0, KF_ISA_AVX2 = 1, KF_ISA_AVX512 = 2, KF_N_ISA = 3 };

/* The variants' function attributes (what kf_isa_detect checks the CPU has). */
#define KF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define KF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq," \
    "avx512cd,avx512vnni,avx2,fma,f16c,bmi,bmi2,popcnt,prefer-vector-width=512")))

static const char *const kf_isa_names[KF_N_ISA] = {"base", "avx2", "avx512"};
static int kf_isa_max = KF_ISA_BASE;     /* best variant this CPU runs */
static int kf_isa = KF_ISA_BASE;         /* variant in use, by every kernel */

/* The best variant the CPU supports. */
static int kf_isa_detect(void)
{
#if KF_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        return KF_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        return KF_ISA_AVX2;
#endif
    return KF_ISA_BASE;
}

/* Use variant `isa` (clamped to what the CPU runs); returns the one now in use. */
static int kf_set_isa(int isa)
{
    kf_isa = isa < KF_ISA_BASE ? KF_ISA_BASE : (isa > kf_isa_max ? kf_isa_max : isa);
    return kf_isa;
}

/* At import: detect the CPU, then apply KESTREL_ISA. Returns 0, or -1 when KESTREL_ISA
 * names no variant (the variant in use is then the best one). */
static int kf_isa_init(void)
{
    kf_isa_max = kf_isa_detect();
    kf_isa = kf_isa_max;
    const char *env = getenv("KESTREL_ISA");
    if (env == NULL || env[0] == '\0')
        return 0;
    for (int i = 0; i < KF_N_ISA; i++)
        if (strcmp(env, kf_isa_names[i]) == 0) {
            kf_set_isa(i);
            return 0;
        }
    return -1;
}

#endif /* KESTREL_ISA_H */
