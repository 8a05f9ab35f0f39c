#!/usr/bin/env bash
# The kernels on aarch64, under qemu-user: cross-build the extension for aarch64 and run
# the kernel tests (tests/kernels) with an aarch64 Python + numpy (docs/DESIGN.md §5).
#
#   scripts/qemu_aarch64.sh sysroot SYSROOT      # once: an arm64 Python 3.11 + numpy + pytest
#   scripts/qemu_aarch64.sh test SYSROOT OUTDIR [pytest args...]
#   scripts/qemu_aarch64.sh variants SYSROOT OUTDIR [pytest args...]
#
# `test` cythonizes pyx/lib.pyx on the host (the host Python needs Cython), compiles lib.c
# with aarch64-linux-gnu-gcc -O3 -fopenmp $ARM_CFLAGS (default: none, the build a plain
# `pip install` makes; the kernels pick neon / dotprod / i8mm at run time, pyx/isa.h) into
# OUTDIR, stages a copy of kestrel_cli (no host .so) and tests/ there, and runs
# `python3.11 -m pytest tests/kernels tests/test_kv_cache.py` (or the pytest args given)
# under qemu-aarch64 on $QEMU_CPU (default max).
#
# `variants` builds once, prints how many sdot / smmla instructions the .so holds, then
# runs the tests once per variant, each on a qemu CPU model that has exactly what the
# variant needs, with KESTREL_ISA naming it and KESTREL_EXPECT_VARIANTS what that CPU
# runs (the tests assert both: tests/conftest.py check_variants_listed):
#   neon     cortex-a53  (Armv8.0: no dotprod)
#   dotprod  cortex-a76  (dotprod, no i8mm)
#   i8mm     max         (dotprod and i8mm)
# then one line of pass counts per variant. Non-zero when any run fails.
# Nothing in the checkout is written. The exit status is pytest's (non-zero on failure).
#
# `sysroot` fetches Debian bookworm's arm64 packages with `apt-get download` and unpacks
# them into SYSROOT with dpkg -x (nothing installed on the host, no root needed once the
# arm64 architecture is known to apt), and the aarch64 wheel of the host's tokenizers
# version with `pip download` (unzipped there). gguf (pure Python, the k-quant tests' reference) is
# copied from the host Python's site-packages at `test` time.
#
# Host prerequisites (Debian bookworm, as root; installs nothing of arm64 on the host):
#   apt-get install -y qemu-user gcc-aarch64-linux-gnu
#   dpkg --add-architecture arm64 && apt-get update
# (Installing python3:arm64 itself with apt would replace the host's python3: don't.)
#
# Env: PYTHON (host Python with Cython and gguf; default python3), ARM_CFLAGS,
# OMP_NUM_THREADS (default 2), QEMU_CPU (`test` only; default max: dotprod, i8mm, fp16).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
CC_ARM=${CC_ARM:-aarch64-linux-gnu-gcc}
ARM_CFLAGS=${ARM_CFLAGS:-}

die() { echo "qemu_aarch64: $*" >&2; exit 2; }

ARM_DEBS_ARCH="libc6 libgcc-s1 libpython3.11-minimal libpython3.11-stdlib libpython3.11
libpython3.11-dev python3.11-minimal python3.11 libexpat1 zlib1g libbz2-1.0 liblzma5 libffi8
libstdc++6 libssl3 libcrypt1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libdb5.3 libnsl2
libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
python3-numpy libblas3 liblapack3 libgfortran5 libgomp1 python3-yaml libyaml-0-2"
ARM_DEBS_ALL="python3-pytest python3-pluggy python3-iniconfig python3-packaging python3-py
python3-attr python3-more-itertools python3-pkg-resources"

make_sysroot() {
    local root=$1
    command -v apt-get >/dev/null || die "apt-get not found (Debian/Ubuntu only)"
    dpkg --print-foreign-architectures | grep -qx arm64 \
        || die "apt does not know arm64: dpkg --add-architecture arm64 && apt-get update"
    mkdir -p "$root/.debs"
    local pkgs=() p
    for p in $ARM_DEBS_ARCH; do pkgs+=("$p:arm64"); done
    for p in $ARM_DEBS_ALL; do pkgs+=("$p"); done
    (cd "$root/.debs" && apt-get download "${pkgs[@]}")
    for p in "$root"/.debs/*.deb; do dpkg -x "$p" "$root"; done
    # the alternatives links the packages' postinst would make
    ln -sf blas/libblas.so.3 "$root/usr/lib/aarch64-linux-gnu/libblas.so.3"
    ln -sf lapack/liblapack.so.3 "$root/usr/lib/aarch64-linux-gnu/liblapack.so.3"
    # tokenizers (Rust; `import kestrel_cli` imports it): the host's version, its manylinux
    # aarch64 wheel from PyPI through the host's pip, unzipped beside numpy
    local tv
    tv=$("$PYTHON" -c "import tokenizers; print(tokenizers.__version__)") \
        || die "the host Python ($PYTHON) has no tokenizers package"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 \
        --python-version 3.11 --implementation cp "tokenizers==$tv" -d "$root/.whl"
    "$PYTHON" -m zipfile -e "$root"/.whl/tokenizers-"$tv"-*.whl "$root/usr/lib/python3/dist-packages/"
    qemu-aarch64 -L "$root" "$root/usr/bin/python3.11" -c \
        "import numpy, pytest, yaml, tokenizers, platform; print('sysroot ok:', platform.machine(), 'numpy', numpy.__version__, 'pytest', pytest.__version__, 'tokenizers', tokenizers.__version__)"
}

SO=kestrel_cli/_kernels/lib.cpython-311-aarch64-linux-gnu.so

# build ROOT OUT: lib.c, the aarch64 .so in a staged copy of kestrel_cli and tests/, and
# OUT/bin/python3 (the guest Python as a host executable)
build() {
    local root=$1 out=$2
    local py="$root/usr/bin/python3.11"
    [[ -x $py ]] || die "no $py: run '$0 sysroot $root' first"
    command -v qemu-aarch64 >/dev/null || die "qemu-aarch64 not found: apt-get install qemu-user"
    command -v "$CC_ARM" >/dev/null || die "$CC_ARM not found: apt-get install gcc-aarch64-linux-gnu"
    local npinc="$root/usr/lib/python3/dist-packages/numpy/core/include"
    [[ -d $npinc ]] || die "no arm64 numpy headers in $root"
    local gguf_dir
    gguf_dir=$("$PYTHON" -c "import gguf, os; print(os.path.dirname(gguf.__file__))") \
        || die "the host Python ($PYTHON) has no gguf package"

    rm -rf "$out/stage"
    mkdir -p "$out/stage/site"
    local t0=$SECONDS
    # 1. lib.c on the host: the module setup.py builds, with setup.py's directives
    "$PYTHON" -m cython -3 --module-name kestrel_cli._kernels.lib \
        -X boundscheck=False,wraparound=False,cdivision=True,initializedcheck=False \
        -I "$REPO/pyx" -o "$out/lib.c" "$REPO/pyx/lib.pyx"
    # 2. the aarch64 .so into a staged copy of the package
    (cd "$REPO" && tar cf - --exclude='*.so' --exclude=__pycache__ kestrel_cli \
        tests) | tar xf - -C "$out/stage"
    cp -r "$gguf_dir" "$out/stage/site/"
    # shellcheck disable=SC2086
    "$CC_ARM" -O3 -fopenmp $ARM_CFLAGS -fPIC -shared \
        -DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION \
        -I"$root/usr/include/python3.11" -idirafter "$root/usr/include" \
        -I"$npinc" -I"$REPO/pyx" "$out/lib.c" -o "$out/stage/$SO"
    echo "qemu_aarch64: built -O3 ${ARM_CFLAGS:-(no -march)} in $((SECONDS - t0)) s"
    # 3. a host wrapper that is the guest Python's sys.executable (qemu -0), so the tests'
    # `sys.executable` subprocesses run under qemu too (no binfmt_misc needed); the CPU
    # model from the caller's QEMU_CPU at each start
    mkdir -p "$out/bin"
    printf '#!/bin/sh\nexec env QEMU_LD_PREFIX="%s" QEMU_CPU="${QEMU_CPU:-max}" PYTHONHOME="%s" qemu-aarch64 -0 "$0" "%s" "$@"\n' \
        "$root" "$root/usr" "$py" > "$out/bin/python3"
    chmod +x "$out/bin/python3"
}

# run OUT [pytest args]: the tests under qemu on $QEMU_CPU; cwd = the stage (its
# kestrel_cli, not the checkout's)
run() {
    local out=$1; shift
    [[ $# -gt 0 ]] || set -- tests/kernels tests/test_kv_cache.py
    local t0=$SECONDS rc=0
    (cd "$out/stage" && export PYTHONPATH="$out/stage:$out/stage/site" \
        PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" \
        OMP_WAIT_POLICY=passive QEMU_CPU="${QEMU_CPU:-max}" \
        && "$out/bin/python3" -c "import platform, sys; from kestrel_cli.runtime import kernels; \
print('qemu_aarch64:', platform.machine(), 'cpu', '${QEMU_CPU:-max}', 'variants', \
kernels.isa_variants(), 'in use', kernels.isa())" \
        && "$out/bin/python3" -m pytest -p no:cacheprovider -q "$@") || rc=$?
    echo "qemu_aarch64: tests rc=$rc in $((SECONDS - t0)) s"
    return $rc
}

run_tests() {
    local root=$1 out=$2; shift 2
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    build "$root" "$out"
    run "$out" "$@"
}

# variant, qemu CPU model, the variants that CPU runs
VARIANTS="neon:cortex-a53:neon dotprod:cortex-a76:neon,dotprod i8mm:max:neon,dotprod,i8mm"

run_variants() {
    local root=$1 out=$2; shift 2
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    build "$root" "$out"
    local objdump=${CC_ARM%gcc}objdump
    if command -v "$objdump" >/dev/null; then
        "$objdump" -d "$out/stage/$SO" > "$out/lib.dis"
        echo "qemu_aarch64: $SO: $(grep -cw sdot "$out/lib.dis") sdot," \
             "$(grep -cw smmla "$out/lib.dis") smmla"
    fi
    local v cpu want summary="" rc=0 one counts
    for spec in $VARIANTS; do
        IFS=: read -r v cpu want <<< "$spec"
        echo "qemu_aarch64: === $v on $cpu"
        one=0
        QEMU_CPU=$cpu KESTREL_ISA=$v KESTREL_EXPECT_VARIANTS="${want//,/ }" \
            run "$out" "$@" 2>&1 | tee "$out/$v.log" || one=1
        # pytest's counts line (none when the args add -q to run's: -qq prints none)
        counts=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$out/$v.log" \
            | tail -1 | tr -d '=' || true)
        summary+="qemu_aarch64: $v ($cpu): ${counts:-no counts line} (rc $one)"$'\n'
        [[ $one -eq 0 ]] || rc=1
    done
    printf '%s' "$summary"
    return $rc
}

case "${1:-}" in
    sysroot) [[ $# -eq 2 ]] || die "usage: $0 sysroot SYSROOT"; make_sysroot "$2" ;;
    test) [[ $# -ge 3 ]] || die "usage: $0 test SYSROOT OUTDIR [pytest args...]"
          run_tests "$2" "$3" "${@:4}" ;;
    variants) [[ $# -ge 3 ]] || die "usage: $0 variants SYSROOT OUTDIR [pytest args...]"
          run_variants "$2" "$3" "${@:4}" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
