/* The one instruction-set dispatcher of the kernels (docs/DESIGN.md §5 Kernels and ISAs).
 *
 * The kernels are portable C compiled several times, once per variant, under a target
 * attribute. The variants occupy KF_N_ISA slots whose names depend on the architecture:
 *   slot  x86-64   aarch64   (without dispatch -- other architectures, no GCC/Clang (x86),
 *                             no GCC or no Linux (aarch64), -DKF_NO_DISPATCH -- slot 0 alone)
 *   0     base     neon      the build's own flags (x86-64 baseline: SSE2; aarch64: NEON);
 *   1     avx2     dotprod   x86-64-v3 (AVX2, FMA, F16C, BMI2) / Armv8.2-A + DotProd (sdot);
 *   2     avx512   i8mm      x86-64-v4 + AVX512-VNNI / Armv8.2-A + DotProd + I8MM (smmla).
 * Each family of kernels keeps a table of its entry points indexed by slot (matmul.h,
 * attention.h, gemm_q8.h); a family without code of its own for a variant lists the
 * nearest lower one there. No ifunc: the CPU is asked once, at import (kf_isa_init:
 * cpuid on x86, getauxval(AT_HWCAP / AT_HWCAP2) on aarch64 Linux), the best variant it
 * runs is used, unless KESTREL_ISA names a lower one or kf_set_isa asks for it (the tests
 * run them all). All of this lives in one extension module, so there is one kf_isa for
 * every kernel.
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

/* aarch64 Linux with GCC: the target attributes below and getauxval. (Clang spells its
 * aarch64 target attributes differently; it builds the neon variant alone.) */
#if defined(__aarch64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) \
    && !defined(KF_NO_DISPATCH)
#define KF_ARM_DISPATCH 1
#include <sys/auxv.h>
#else
#define KF_ARM_DISPATCH 0
#endif

enum { KF_ISA_BASE = 0, KF_ISA_AVX2 = 1, KF_ISA_AVX512 = 2, KF_N_ISA = 3 };
/* the same slots under their aarch64 names */
enum { KF_ISA_NEON = 0, KF_ISA_DOTPROD = 1, KF_ISA_I8MM = 2 };

/* The variants' function attributes (what kf_isa_detect checks the CPU has). */
#define KF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define KF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq," \
    "avx512cd,avx512vnni,avx2,fma,f16c,bmi,bmi2,popcnt,prefer-vector-width=512")))

#if KF_ARM_DISPATCH
/* FEAT_DotProd and FEAT_I8MM are optional from Armv8.2-A on, so a CPU that has them runs
 * Armv8.2-A. A build for plain Armv8-A (the default) takes the whole architecture in the
 * attribute, as arm_neon.h declares its sdot / smmla intrinsics under it; a build whose
 * own -march is already Armv8.2-A or later (GCC tells it by its Armv8.1 macros; an
 * -march of exactly Armv8.1-A needs -DKF_NO_DISPATCH) only adds the extensions, so that
 * the portable helpers compiled with those flags still inline into the variants. */
#if defined(__ARM_FEATURE_QRDMX)
#define KF_TARGET_DOTPROD __attribute__((target("+dotprod")))
#define KF_TARGET_I8MM __attribute__((target("+dotprod+i8mm")))
#else
#define KF_TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define KF_TARGET_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif
#endif

#if defined(__aarch64__)
static const char *const kf_isa_names[KF_N_ISA] = {"neon", "dotprod", "i8mm"};
#else
static const char *const kf_isa_names[KF_N_ISA] = {"base", "avx2", "avx512"};
#endif
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
#elif KF_ARM_DISPATCH
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if ((hw & HWCAP_ASIMDDP) && (hw2 & HWCAP2_I8MM))
        return KF_ISA_I8MM;
    if (hw & HWCAP_ASIMDDP)
        return KF_ISA_DOTPROD;
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
