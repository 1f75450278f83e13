#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the built moemesh binaries, the launcher, the systemd units, the sysusers entry, the
# docs and the example environment files. Run through `make install` (which builds first):
#
#   make install                          -> /usr/local/bin, /usr/local/lib/systemd/system, ...
#   make install PREFIX=/opt/moemesh UNITDIR=/etc/systemd/system
#   make install DESTDIR=/tmp/pkgroot     (staging for a package; paths inside the units stay
#                                          PREFIX-based, without DESTDIR)
#
# Variables (environment): BIN (built binaries, default build/bin), PREFIX (/usr/local),
# DESTDIR (""), UNITDIR ($PREFIX/lib/systemd/system; systemd searches /usr/local/lib/systemd/
# system, for other prefixes use /etc/systemd/system), SYSUSERSDIR ($PREFIX/lib/sysusers.d),
# CONFDIR (/etc/moemesh: only *.example files are written there, never a live .env).
# The units name /usr/local/bin/moemesh-launch; they are rewritten to $PREFIX/bin here.
set -euo pipefail

die() { echo "install.sh: $*" >&2; exit 1; }

BIN=${BIN:-build/bin}
PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
UNITDIR=${UNITDIR:-$PREFIX/lib/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-$PREFIX/lib/sysusers.d}
CONFDIR=${CONFDIR:-/etc/moemesh}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)

case $PREFIX in /*) ;; *) die "PREFIX must be an absolute path (got '$PREFIX')" ;; esac
case $PREFIX in *'#'*|*' '*) die "PREFIX must not contain '#' or spaces (got '$PREFIX')" ;; esac

daemons=(gateway router attention expert drafter)
for d in "${daemons[@]}"; do
    [ -x "$BIN/moemesh-$d" ] || die "$BIN/moemesh-$d is missing: run make first"
done
[ -x "$BIN/moemesh" ] || die "$BIN/moemesh is missing: run make first"

install -d "$DESTDIR$PREFIX/bin" "$DESTDIR$UNITDIR" "$DESTDIR$SYSUSERSDIR" \
    "$DESTDIR$PREFIX/share/doc/moemesh" "$DESTDIR$PREFIX/share/moemesh/templates" "$DESTDIR$CONFDIR"
for d in "${daemons[@]}"; do
    install -m 0755 "$BIN/moemesh-$d" "$DESTDIR$PREFIX/bin/moemesh-$d"
done
install -m 0755 "$BIN/moemesh" "$DESTDIR$PREFIX/bin/moemesh"
install -m 0755 "$here/moemesh-launch" "$DESTDIR$PREFIX/bin/moemesh-launch"

for u in "$here"/systemd/*.service "$here"/systemd/*.target; do
    sed -e "s#/usr/local/bin/#$PREFIX/bin/#g" \
        -e "s#/usr/local/share/doc/moemesh/#$PREFIX/share/doc/moemesh/#g" \
        "$u" >"$DESTDIR$UNITDIR/$(basename "$u")"
    chmod 0644 "$DESTDIR$UNITDIR/$(basename "$u")"
done
install -m 0644 "$here/systemd/moemesh.sysusers.conf" "$DESTDIR$SYSUSERSDIR/moemesh.conf"
install -m 0644 "$root/docs/OPERATIONS.md" "$DESTDIR$PREFIX/share/doc/moemesh/OPERATIONS.md"
for t in "$here"/templates/*.jinja; do # chat templates for the gateway's --chat-template
    install -m 0644 "$t" "$DESTDIR$PREFIX/share/moemesh/templates/$(basename "$t")"
done
for e in "$here"/env/*.env.example; do
    install -m 0644 "$e" "$DESTDIR$CONFDIR/$(basename "$e")"
done

echo "installed moemesh into $DESTDIR$PREFIX (units: $DESTDIR$UNITDIR)"
if [ -z "$DESTDIR" ]; then
    echo "next: systemd-sysusers; copy $CONFDIR/moemesh.env.example to $CONFDIR/moemesh.env and edit it;"
    echo "      systemctl daemon-reload; systemctl enable --now moemesh-router ... (docs/OPERATIONS.md)"
fi
