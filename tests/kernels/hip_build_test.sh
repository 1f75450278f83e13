#!/usr/bin/env bash
# timeout: 240
# CI compile check of the AMD build: kernels/cuda compiled by Debian's hipcc (ROCm 5.2) for
# gfx90a and gfx1030 through the vendor header (`make hip` into a scratch dir), and each
# object must carry a code object for both architectures. No AMD GPU is needed or used.
# Skips (exit 77) when hipcc is absent and apt cannot install it here.
set -u
if ! command -v hipcc >/dev/null; then
    SUDO=; [ "$(id -u)" != 0 ] && SUDO=sudo
    if ! out=$( { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
                 $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends hipcc; } 2>&1) \
        || ! command -v hipcc >/dev/null; then
        echo "SKIP: hipcc is not installed and apt could not install it: $(echo "$out" | tail -n 1)"
        exit 77
    fi
fi
tmp=$(mktemp -d /tmp/mm-hip.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
if ! make -s --no-print-directory hip HIP_BUILD="$tmp" >"$tmp/log" 2>&1; then
    cat "$tmp/log"
    echo "FAIL: make hip did not compile kernels/cuda"
    exit 1
fi
# Every object that carries device code (the kernel files) must hold both architectures.
n=0
for o in $(find "$tmp/obj" -name '*.o'); do
    grep -aq "amdgcn-amd-amdhsa" "$o" || continue
    for arch in gfx90a gfx1030; do
        grep -aq "amdgcn-amd-amdhsa--$arch" "$o" || { echo "FAIL: $o has no $arch code object"; exit 1; }
    done
    n=$((n + 1))
done
for f in matmul ops; do
    grep -aq "amdgcn-amd-amdhsa--gfx90a" "$tmp/obj/kernels/cuda/$f.o" || { echo "FAIL: $f.o has no device code"; exit 1; }
done
echo "hip: kernel objects compiled for gfx90a and gfx1030 ($n checked)"
