#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Boots Debian's 6.1 kernel under qemu (TCG: this host's KVM hangs the stock kernel) with an
# initramfs holding busybox, the soft-RoCE modules (rdma_rxe and its dependencies), rdma-core
# with the rxe provider, and the given binaries; binds rxe0 to the VM's e1000 NIC, runs a guest
# script, prints the serial console, and exits with the guest script's status.
#
#   tests/rdma/vm.sh [--bin FILE]... [--file SRC=DST]... [--timeout S] GUEST_SCRIPT [ARGS...]
#
# --bin copies FILE to /t/<basename> and the shared libraries it needs (by ldd) to their own
# paths. GUEST_SCRIPT runs inside the VM as `sh /guest.sh ARGS` with cwd /t, after rxe0 is up.
# The kernel .deb and the extracted modules are cached in $MM_RDMA_CACHE (default
# build/rdma-vm); the Debian version is found with apt-cache (override: MM_RDMA_KVER, e.g.
# 6.1.0-57-amd64). Needs: qemu-system-x86, busybox-static, cpio (installed if missing, as root).
# Exit status: the guest script's, 2 on a harness failure (no result line), 3 when a
# prerequisite cannot be had (package install or kernel download failed), 124 on timeout.
set -euo pipefail

CACHE=${MM_RDMA_CACHE:-build/rdma-vm}
TIMEOUT=300
MEM_MB=${MM_RDMA_VM_MEM:-1024}
SMP=${MM_RDMA_VM_SMP:-2}
BINS=()
FILES=()
while [ $# -gt 0 ]; do
    case $1 in
    --bin) BINS+=("$2"); shift 2 ;;
    --file) FILES+=("$2"); shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "vm.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "vm.sh: missing GUEST_SCRIPT (see --help)" >&2; exit 2; }
GUEST=$1; shift
[ -f "$GUEST" ] || { echo "vm.sh: guest script $GUEST not found" >&2; exit 2; }

log() { echo "vm.sh: $*" >&2; }

# ---- host tools ------------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx insmod || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" >/dev/null || { log "cannot install ${need[*]}"; exit 3; }
fi
# The static busybox: busybox-static installs /bin/busybox; refuse a dynamic one.
BUSYBOX=/bin/busybox
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    log "$BUSYBOX is dynamically linked; install busybox-static"; exit 2
fi

# ---- kernel and modules ----------------------------------------------------------------------
mkdir -p "$CACHE"
KVER=${MM_RDMA_KVER:-}
if [ -z "$KVER" ]; then
    KVER=$(cat "$CACHE/kver" 2>/dev/null || true)
    if [ -z "$KVER" ]; then
        KVER=$(apt-cache depends linux-image-amd64 2>/dev/null |
               grep -o 'linux-image-6\.1\.0-[0-9]*-amd64' | head -1 | sed 's/^linux-image-//')
        [ -n "$KVER" ] || { log "apt-cache knows no linux-image-6.1.0-*-amd64 (apt-get update?)"; exit 3; }
        echo "$KVER" >"$CACHE/kver"
    fi
fi
KDIR=$CACHE/linux-$KVER
if [ ! -f "$KDIR/ok" ]; then
    log "fetching linux-image-$KVER"
    rm -rf "$KDIR"; mkdir -p "$KDIR/deb"
    (cd "$KDIR/deb" && apt-get download "linux-image-$KVER" >/dev/null 2>&1) ||
        { log "apt-get download linux-image-$KVER failed (no network?)"; exit 3; }
    dpkg-deb -x "$KDIR"/deb/*.deb "$KDIR/root"
    rm -rf "$KDIR/deb"
    touch "$KDIR/ok"
fi
VMLINUZ=$KDIR/root/boot/vmlinuz-$KVER
MODROOT=$KDIR/root/lib/modules/$KVER
[ -f "$VMLINUZ" ] || { log "no $VMLINUZ in the package"; exit 2; }

# Module load order: dependencies first, read from each module's .modinfo "depends=" field (no
# kmod on this host). Built-in ones (modules.builtin) need nothing.
declare -A MODPATH=() LOADED=()
while IFS= read -r p; do b=${p##*/}; MODPATH[${b%.ko}]=$p; done < <(find "$MODROOT/kernel" -name '*.ko')
ORDER=()
add_mod() {
    local m=${1//-/_} d
    [ -n "${LOADED[$m]:-}" ] && return 0
    LOADED[$m]=1
    local p=${MODPATH[$m]:-${MODPATH[${m//_/-}]:-}}
    if [ -z "$p" ]; then
        grep -q "/${m}.ko\$" "$MODROOT/modules.builtin" && return 0
        log "module $m not found in linux-image-$KVER"; exit 2
    fi
    for d in $(strings -a "$p" | sed -n 's/^depends=//p' | head -1 | tr ',' ' '); do add_mod "$d"; done
    ORDER+=("$p")
}
# crc32_generic: rxe allocates the "crc32" shash for its ICRC when a device is added; without
# it `rdma link add` fails with ENOENT (the kernel cannot modprobe it here: no kmod in the VM).
for m in e1000 crc32_generic rdma_rxe ib_uverbs; do add_mod "$m"; done

# ---- initramfs -------------------------------------------------------------------------------
STAGE=$(mktemp -d /tmp/mm-rdma-vm.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
R=$STAGE/root
mkdir -p "$R"/{bin,sbin,dev,proc,sys,tmp,t,etc,lib/modules,run}
cp "$BUSYBOX" "$R/bin/busybox"
n=0
: >"$R/modules.list"
for p in "${ORDER[@]}"; do
    n=$((n + 1)); b=$(printf '%02d-%s' "$n" "$(basename "$p")")
    cp "$p" "$R/lib/modules/$b"; echo "$b" >>"$R/modules.list"
done

copy_with_libs() { # src dst: copies a file and, by ldd, every shared library it needs
    local src=$1 dst=$2 lib
    mkdir -p "$(dirname "$R$dst")"
    cp -L "$src" "$R$dst"
    while read -r lib; do
        [ -e "$R$lib" ] && continue
        mkdir -p "$R$(dirname "$lib")"
        cp -L "$lib" "$R$lib"
    done < <(ldd "$src" 2>/dev/null | grep -o '/[^ ]*\.so[^ ]*' | sort -u)
}
RXE=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
[ -f "$RXE" ] || { log "no $RXE: install ibverbs-providers"; exit 2; }
copy_with_libs "$RXE" "$RXE"
mkdir -p "$R/etc/libibverbs.d"
cp /etc/libibverbs.d/rxe.driver "$R/etc/libibverbs.d/"
copy_with_libs "$(command -v rdma)" /sbin/rdma
for b in "${BINS[@]}"; do
    [ -f "$b" ] || { log "binary $b not found"; exit 2; }
    copy_with_libs "$b" "/t/$(basename "$b")"
done
for f in "${FILES[@]}"; do
    mkdir -p "$(dirname "$R${f#*=}")"; cp -L "${f%%=*}" "$R${f#*=}"
done
cp "$GUEST" "$R/guest.sh"
printf '%q ' "$@" >"$R/guest.args"

cat >"$R/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/t
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
ulimit -l unlimited
step() { echo "MMVM-STEP: $*"; }
die() { echo "MMVM-FAIL: $*"; dmesg | tail -n 20; echo "MMVM-EXIT: 2"; poweroff -f; sleep 10; }
for m in $(cat /modules.list); do insmod /lib/modules/$m || die "insmod $m"; done
step "modules loaded: $(cat /modules.list | tr '\n' ' ')"
ip link set lo up
ip link set eth0 up || die "no eth0"
ip addr add 10.0.2.15/24 dev eth0
rdma link add rxe0 type rxe netdev eth0 || die "rdma link add rxe0 failed"
# The port follows eth0's carrier, which e1000 raises a moment after `ip link set up`.
i=0; while ! rdma link show rxe0/1 2>/dev/null | grep -q 'state ACTIVE' && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
[ -e /dev/infiniband/uverbs0 ] || die "no /dev/infiniband/uverbs0"
rdma link show rxe0/1 | grep -q 'state ACTIVE' || die "rxe0 port not ACTIVE: $(rdma link show)"
step "$(rdma link show | tr '\n' ' ')"
cd /t
echo "MMVM-BEGIN"
eval "set -- $(cat /guest.args)"
sh /guest.sh "$@"
rc=$?
echo "MMVM-EXIT: $rc"
sync
poweroff -f
EOF
chmod +x "$R/init"
IMG=$STAGE/initrd.cpio.gz
(cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) >"$IMG"
log "kernel $KVER, initramfs $(du -h "$IMG" | cut -f1), ${#BINS[@]} binaries, booting (TCG, ${SMP} vCPU, ${MEM_MB} MiB)"

# ---- boot ------------------------------------------------------------------------------------
OUTLOG=$STAGE/console.log
set +e
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt \
    -smp "$SMP" -m "$MEM_MB" -nographic -no-reboot -nodefaults -serial stdio \
    -kernel "$VMLINUZ" -initrd "$IMG" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init" \
    -netdev user,id=n0 -device e1000,netdev=n0,romfile= </dev/null | tee "$OUTLOG" | tr -d '\r'
qrc=${PIPESTATUS[0]}
set -e
if [ "$qrc" = 124 ]; then log "VM timed out after ${TIMEOUT}s"; exit 124; fi
rc=$(tr -d '\r' <"$OUTLOG" | sed -n 's/^MMVM-EXIT: \([0-9]*\)$/\1/p' | tail -1)
if [ -z "$rc" ]; then log "the VM ended (qemu rc $qrc) without a result line"; exit 2; fi
exit "$rc"
